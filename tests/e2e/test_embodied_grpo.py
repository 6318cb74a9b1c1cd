"""GRPO with episode-level groups learns an arm-reaching task through every service (disaggregated plan) with the
VLA-shaped policy's tokens head: each batch resets groups of 8 envs to one start each, and episodes are scored
against their group. Success (the env's is_success, metrics.csv train_success_rate) goes from chance to about
half the episodes in 40k decisions (~40 s; seeds 0-2 measured 0.04-0.06 -> 0.48-0.54). State observations keep
it within CI's budget; the pixel task runs the same code (examples/arm_reach_grpo.yaml)."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.minutes(1.3)  # on CI's 2 cores: the tiers start long files first


@pytest.mark.slow
def test_grpo_with_episode_groups_learns_to_reach(tmp_path):
    run_dir = tmp_path / "grpo"
    proc = subprocess.run(
        [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/arm_reach_grpo.yaml", "--run-dir", str(run_dir),
         "--quiet", "--set", "scheduling.mode=disaggregated", "--set", "env.kwargs={observation: state}",
         "--set", "train.total_env_steps=40000", "--set", "train.eval_every_iterations=0"],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    success = [float(r["train_success_rate"]) for r in rows if r.get("train_success_rate")]
    assert np.mean(success[:8]) <= 0.2 and np.mean(success[-8:]) >= 0.35, success
    assert all(float(r["zero_std_fraction"]) < 1.0 for r in rows[-8:])  # groups still tell episodes apart
