"""Continuous actions learn too: PPO with a Gaussian policy on Pendulum-v1, disaggregated and pipelined."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

TARGET = -400.0  # random play scores about -1200 to -1500; a swung-up, balanced pendulum about -150 to -250


@pytest.mark.slow
def test_pendulum_ppo_learns_on_seed_0(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", "examples/pendulum_ppo.yaml",
                           "--run-dir", str(run_dir), "--quiet", "--set", f"train.stop_at_eval_return={TARGET}"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    assert evals[0] < -900, "the first evaluation should look like random play"
    assert evals[-1] >= TARGET and int(rows[-1]["env_steps"]) <= 150_000
