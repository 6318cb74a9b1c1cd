"""Agentic RL end to end through every service: a supervised warm start of a tiny language model on generated
arithmetic (SFT, no rollout collecting), then GRPO, DAPO, REINFORCE++, GSPO and CISPO from that checkpoint with the
hf backend, all through ``rlfabric train``. Held-out exact-match accuracy (greedy, the same held-out problems for
every run) must rise: by at least 10 points for GRPO. The runs are deterministic for a seed (same numbers run after run)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.artefacts import cached, undisturbed

pytestmark = pytest.mark.minutes(1.6)  # on CI's 2 cores: the tiers start long files first

CLI = [sys.executable, "-m", "rlfabric.services.cli"]
SFT_UPDATES = 500
EPISODES = 64 * 100  # 100 iterations of 8 prompts x 8 samples
EVAL_EPISODES = "512"


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _accuracy(checkpoint) -> float:
    return float(_cli("eval", str(checkpoint), "--episodes", EVAL_EPISODES).stdout.splitlines()[-1])


def arith_sft(config) -> Path:
    """The SFT checkpoint (``sft/checkpoints/final.pt``) and its held-out accuracy (``accuracy``), built once for
    both tiers (tests/artefacts.py; tests/prebuild.py builds it ahead): the fast tier's GRPO and the slow tier's
    DAPO, REINFORCE++, GSPO and CISPO start from the same one."""
    from rlfabric.services.env.tasks.sft_data import build

    def sft(out):
        data = out / "arith_sft.npz"
        np.savez(data, **build("arith", 4000, seed=0))
        _cli("train", "examples/arith_sft.yaml", "--run-dir", str(out / "sft"), "--quiet",
             "--set", f"replay.datasets.offline={data}", "--set", f"algorithm.total_updates={SFT_UPDATES}")
        undisturbed(out / "sft")
        (out / "accuracy").write_text(str(_accuracy(out / "sft" / "checkpoints" / "final.pt")))

    return cached(config, "arith-sft", {"updates": SFT_UPDATES, "rows": 4000, "episodes": EVAL_EPISODES}, sft)


@pytest.fixture(scope="module")
def warm_start(request):
    out = arith_sft(request.config)
    return out / "sft" / "checkpoints" / "final.pt", float((out / "accuracy").read_text())


@pytest.mark.parametrize("algorithm, sets, gain", [
    pytest.param("grpo", [], 0.10, marks=pytest.mark.smoke),
    pytest.param("dapo", ["algorithm.learning_rate=0.0001", "algorithm.train_groups=8"], 0.08, marks=pytest.mark.slow),
    pytest.param("reinforce_pp", ["algorithm.learning_rate=0.0001"], 0.08, marks=pytest.mark.slow),
    # two minibatches per batch: the second is off-policy, so GSPO's sequence clip (about half its tokens clipped at
    # the paper's eps) and CISPO's clipped IS weight act
    pytest.param("gspo", ["algorithm.minibatch_size=32"], 0.08, marks=pytest.mark.slow),
    pytest.param("cispo", ["algorithm.minibatch_size=32"], 0.08, marks=pytest.mark.slow),
])
def test_rl_from_an_sft_checkpoint_raises_held_out_accuracy(warm_start, tmp_path, algorithm, sets, gain):
    checkpoint, before = warm_start
    assert 0.05 < before < 0.8, f"the warm start should be partial ({before:.3f}), or RL has nothing to show"
    run = tmp_path / algorithm
    overrides = [f"algorithm.name={algorithm}", *sets, f"policy.init_checkpoint={checkpoint}",
                 f"train.total_env_steps={EPISODES}"]
    _cli("train", "examples/arith_grpo.yaml", "--run-dir", str(run), "--quiet",
         *[arg for s in overrides for arg in ("--set", s)])
    after = _accuracy(run / "checkpoints" / "final.pt")
    assert after >= before + gain, f"{algorithm}: held-out accuracy {before:.3f} -> {after:.3f}"
    with open(run / "metrics.csv") as f:
        mismatch = [float(r["logprob_mismatch_abs"]) for r in csv.DictReader(f) if r.get("logprob_mismatch_abs")]
    assert mismatch and max(mismatch) < 1e-3  # engine and learner hold the same fp32 weights
