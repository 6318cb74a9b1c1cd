"""The off-policy family end to end: SAC on Pendulum-v1 through real services, under a plan whose stages take
turns and under one whose learner samples the replay window while rollout streams (staleness 1)."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

pytestmark = pytest.mark.minutes(0.9)  # on CI's 2 cores: the tiers start long files first

TARGET = -300.0  # random play scores about -1200 to -1500


@pytest.mark.slow
@pytest.mark.parametrize("plan", [[], ["scheduling.mode=hybrid", "scheduling.placement={env: a, rollout: a, learner: b}",
                                       "scheduling.pipeline_chunks=1", "scheduling.staleness=1"]],
                         ids=["collocated", "hybrid-stream"])
def test_pendulum_sac_learns_on_seed_0(tmp_path, plan):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/pendulum_sac.yaml", "--run-dir", str(run_dir),
            "--quiet", "--set", "train.total_env_steps=15000"]
    for s in plan:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reached eval return >= -300" in proc.stderr
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    assert evals[0] < -900, "the first evaluation (uniform random actions so far) should look like random play"
    assert evals[-1] >= TARGET
    # no gradient step before learning_starts (1024 env steps), half a step per env step after
    updates = [(int(r["env_steps"]), float(r["optimizer_steps"])) for r in rows]
    assert all(opt == 0 for steps, opt in updates if steps < 1024)
    assert updates[-1][1] == pytest.approx(0.5 * (updates[-1][0] - 1024), abs=64 * 3)
