"""Agentic RL end to end through every service: a supervised warm start of a tiny language model on generated
arithmetic (SFT, no rollout collecting), then GRPO from that checkpoint with the hf backend, both through
``rlfabric train``. Held-out exact-match accuracy (greedy, the same held-out problems for both runs) must rise by
at least 10 points."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest

CLI = [sys.executable, "-m", "services.cli"]
SFT_UPDATES = 500
GRPO_EPISODES = 64 * 100
EVAL_EPISODES = "512"


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _evals(run_dir) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r["eval_return_mean"]) for r in csv.DictReader(f) if r.get("eval_return_mean")]


@pytest.mark.slow
def test_grpo_from_an_sft_checkpoint_raises_held_out_accuracy(tmp_path):
    from services.env.tasks.sft_data import build

    data = tmp_path / "arith_sft.npz"
    np.savez(data, **build("arith", 4000, seed=0))
    sft = tmp_path / "sft"
    _cli("train", "examples/arith_sft.yaml", "--run-dir", str(sft), "--quiet",
         "--set", f"replay.datasets.offline={data}", "--set", f"algorithm.total_updates={SFT_UPDATES}")
    before = float(_cli("eval", str(sft / "checkpoints/final.pt"), "--episodes", EVAL_EPISODES).stdout.splitlines()[-1])
    grpo = tmp_path / "grpo"
    _cli("train", "examples/arith_grpo.yaml", "--run-dir", str(grpo), "--quiet",
         "--set", f"policy.init_checkpoint={sft / 'checkpoints/final.pt'}",
         "--set", f"train.total_env_steps={GRPO_EPISODES}")
    after = float(_cli("eval", str(grpo / "checkpoints/final.pt"), "--episodes", EVAL_EPISODES).stdout.splitlines()[-1])
    assert 0.05 < before < 0.8, f"the warm start should be partial ({before:.3f}), or GRPO has nothing to show"
    assert after >= before + 0.10, f"held-out accuracy {before:.3f} -> {after:.3f}"
    with open(grpo / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    mismatch = [float(r["logprob_mismatch_abs"]) for r in rows if r.get("logprob_mismatch_abs")]
    assert mismatch and max(mismatch) < 1e-3  # engine and learner hold the same fp32 weights
