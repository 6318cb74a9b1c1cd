"""DAgger on a discrete task, end to end: a PPO checkpoint that solves CartPole-v1 (the artefact
test_async_ppo.py builds) labels every state a fresh actor-critic visits, and the student solves CartPole (eval
>= 475) from random weights by imitation alone, in a few thousand env steps: with the policy acting throughout
(beta = 0), and with Ross et al.'s mixture, the expert acting in all of the first iteration's steps and half as
many each iteration after (beta = 1, decay 0.5), which the rollout counts."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from tests.e2e.test_async_ppo import cartpole_ppo

pytestmark = pytest.mark.minutes(0.6)  # (with the PPO artefact shared with test_async_ppo.py)


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_dagger_learns_cartpole_from_a_ppo_checkpoint(request, tmp_path, beta):
    expert = cartpole_ppo(request.config) / "run" / "checkpoints" / "final.pt"
    run_dir = tmp_path / "dagger"
    proc = subprocess.run(
        [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/cartpole_ppo.yaml", "--run-dir",
         str(run_dir), "--quiet",
         "--set", f"algorithm={{name: dagger, expert_checkpoint: {expert}, n_steps: 32, batch_size: 256, "
                  f"updates_per_iteration: 50, beta: {beta}, beta_decay: 0.5}}",
         "--set", "train.total_env_steps=8192", "--set", "train.eval_every_iterations=2"],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reached eval return >= 475" in proc.stderr, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    evals = [(int(r["env_steps"]), float(r["eval_return_mean"])) for r in rows if r["eval_return_mean"]]
    assert evals[0][1] < 300, evals  # after one round of labels it is not solved yet
    assert evals[-1][1] >= 475 and evals[-1][0] <= 8192, evals
    # who acted: the rollout's count of expert steps per iteration of 8 envs x 32 steps
    expert = [float(r.get("expert_steps") or 0.0) for r in rows]
    if beta == 0:
        assert not any(expert), expert
    else:
        assert expert[0] == 256 and 64 <= expert[1] <= 192 and sum(expert[4:]) <= 0.15 * 256 * len(expert[4:]), expert
    gaps = [float(r["expert_gap"]) for r in rows]  # the share of visited states where the student's action differs
    assert gaps[-1] < gaps[0] and gaps[-1] < 0.1, gaps
