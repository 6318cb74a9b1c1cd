"""Offline RL end to end: a data set of mixed quality (a partly trained SAC policy's episodes and random ones) made
with the system itself, then IQL learning from it with no rollout worker placed, against behaviour cloning on the
same data, both evaluated afterwards from their checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.minutes(1.5)  # on CI's 2 cores: the tiers start long files first

CLI = [sys.executable, "-m", "rlfabric.services.cli"]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _offline(tmp_path, name: str, data, algorithm: str | None = None) -> float:
    run_dir = tmp_path / name
    sets = ["--set", f"replay.datasets.offline={data}"] + (["--set", f"algorithm={algorithm}"] if algorithm else [])
    proc = _cli("train", "examples/pendulum_iql.yaml", "--run-dir", str(run_dir), "--quiet", *sets)
    assert "finished 16 iterations" in proc.stderr
    assert "loaded 8000 rows into replay source 'offline'" in proc.stderr
    logs = {p.name.split(".")[0] for p in (run_dir / "logs").iterdir()}
    assert "learner" in logs and "rollout" not in logs  # no rollout worker was even started
    return float(_cli("eval", str(run_dir / "checkpoints/final.pt"), "--episodes", "10").stdout.splitlines()[-1])


@pytest.mark.slow
def test_iql_from_a_mixed_data_set_beats_behaviour_cloning(tmp_path):
    sac = tmp_path / "sac"
    _cli("train", "examples/pendulum_sac.yaml", "--run-dir", str(sac), "--quiet", "--set", "train.total_env_steps=6000",
         "--set", "train.stop_at_eval_return=null")
    data = tmp_path / "mixed.npz"
    good = _cli("collect", str(sac / "checkpoints/final.pt"), "--episodes", "20", "--out", str(data))
    bad = _cli("collect", "examples/pendulum_sac.yaml", "--random", "--episodes", "20", "--out", str(data), "--append")
    assert "8000 transitions" in bad.stderr and "4000 transitions" in good.stderr
    iql = _offline(tmp_path, "iql", data)
    bc = _offline(tmp_path, "bc", data, "{name: bc, learning_rate: 0.001, updates_per_iteration: 500, "
                                        "total_updates: 8000}")
    assert bc < -800, f"behaviour cloning imitates the mixture, random half included ({bc:.0f})"
    assert iql > bc + 250 and iql > -700, f"IQL {iql:.0f} vs behaviour cloning {bc:.0f}"
