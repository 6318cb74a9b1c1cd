"""One-shot check of every CUDA path of rlfabric, for a GPU machine lent for a few minutes (issue 21, item 5).

Each check runs in a process of its own under its own time budget (a hung engine is killed, its GPU memory freed,
and the next check still runs); one broken path never hides the others. Total wall time stays under ``--budget``
(default 470 s). Checks:

  * ``pi0``: transformers' PI0ForConditionalGeneration built tiny from a config (random init, nothing downloaded),
    in bf16 on CUDA: one training step (flow loss, backward, AdamW) and one ``sample_actions``; ms of each.
  * ``pi0_rl``: rlfabric's own pi0 policy at the example's sizes, 64 envs: a decision with the prefix's KV cache
    against the prefix recomputed per denoising step, one PPO update in fp32 and one in bf16-mixed, and how far the
    learner's re-scoring of the rollout's Flow-SDE chains lands from the rollout's (< 1e-4 in fp32).
  * ``hf_rollout``: the rollout's torch backend (no engine package needed): a perturbed version must change its
    greedy outputs; sampled tokens/s at batch 64, fp32 and bf16.
  * ``vllm``: the rollout's VLLMBackend on CUDA with a tiny Llama: greedy generate, load a perturbed version in
    place, generate again; the outputs must change and match the HF backend's greedy outputs on the same weights.
  * ``nccl``: rlfabric's weight transport (PairHost/PairClient, NCCL) between two processes; GB/s. NCCL needs a
    distinct GPU per rank: skipped on a one-GPU machine.
  * ``sglang``: SGLangBackend generate once, where ``import sglang`` works.
  * ``sleep_wake``: VLLMBackend.sleep()/wake() around a collocated learner turn; GiB freed (cudaMemGetInfo).
  * ``maniskill``: ``env.adapter: maniskill`` on SAPIEN with this GPU's Vulkan driver, where mani-skill is installed:
    a seeded reset repeats, the arm and the camera follow an action, the success flag turns on once the cube sits on
    its goal, and steps/s with a 64x64 camera.

With ``--examples`` (or ``--only-examples a,b``), every example spec and every algorithm then runs a few iterations
through all services with ``runtime.device=cuda``, each under its own budget (bench/gpu_examples.py).

Without a CUDA device every check reports "skipped: no CUDA device" and the script exits 0 at once. rlfabric must be
installed (``pip install -e .``): algorithms and backends are found through its entry points.

    python bench/gpu_check.py --out bench/results/gpu_check.json [--only vllm,sleep_wake] [--examples]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import pi0_ode_recomputing_prefix, report  # noqa: E402

CHECKS = ("pi0", "pi0_rl", "hf_rollout", "offload", "maniskill", "vllm", "nccl", "sglang", "sleep_wake")
BUDGET_S = {"pi0": 45, "pi0_rl": 60, "hf_rollout": 40, "offload": 40, "maniskill": 90, "vllm": 110, "nccl": 35,
            "sglang": 65, "sleep_wake": 75}  # each a ceiling; --budget (8 min) caps the sum
SPEC = {"observation_space": {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64},
        "action_space": {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}}


class Skip(Exception):
    """A check that cannot run on this machine (missing package, too few GPUs): reported, not a failure."""


# ---------------------------------------------------------------------------------------------------- checks


def check_pi0(device: str) -> dict:
    """A tiny π0 (PaliGemma prefix + Gemma action expert), bf16 on CUDA (fp32 on CPU, for the self-test)."""
    import torch

    try:
        from transformers import PI0Config, PI0ForConditionalGeneration
    except ImportError as exc:
        import transformers

        raise Skip(f"transformers {transformers.__version__} has no PI0 ({exc}); needs transformers>=5.19") from None
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    text = {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "patch_size": 16,
              "image_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "vision_use_head": False}
    image_token = 127
    config = PI0Config(
        vlm_config={"model_type": "paligemma", "text_config": text, "vision_config": vision, "projection_dim": 64,
                    "image_token_id": image_token},
        dit_config={**text, "hidden_size": 32, "intermediate_size": 64},
        chunk_size=8, max_state_dim=8, max_action_dim=8, num_inference_steps=4)
    torch.manual_seed(0)
    model = PI0ForConditionalGeneration(config).to(device=device, dtype=dtype)
    batch, cameras, per_camera, prompt = 4, 2, (64 // 16) ** 2, 6
    ids = torch.cat([torch.full((batch, cameras * per_camera), image_token),
                     torch.randint(1, 100, (batch, prompt))], dim=1).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values": torch.rand(batch, cameras, 3, 64, 64, device=device, dtype=dtype),
              "pixel_attention_mask": torch.ones(batch, cameras, dtype=torch.bool, device=device),
              "state": torch.randn(batch, 8, device=device, dtype=dtype)}
    actions = torch.randn(batch, 8, 8, device=device, dtype=dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        loss = model(**inputs, actions=actions).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return float(loss)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    model.train()
    first = step()  # warm-up: kernels picked, optimizer state allocated
    sync()
    t0 = time.perf_counter()
    losses = [step() for _ in range(3)]
    sync()
    train_ms = (time.perf_counter() - t0) / 3 * 1e3
    if not all(torch.isfinite(torch.tensor([first, *losses]))):
        raise RuntimeError(f"non-finite flow loss: {[first, *losses]}")
    model.eval()
    sample = {k: v for k, v in inputs.items()}
    model.sample_actions(**sample)
    sync()
    t0 = time.perf_counter()
    chunk = model.sample_actions(**sample)
    sync()
    sample_ms = (time.perf_counter() - t0) * 1e3
    if tuple(chunk.shape) != (batch, 8, 8) or not torch.isfinite(chunk.float()).all():
        raise RuntimeError(f"sample_actions gave shape {tuple(chunk.shape)} (want {(batch, 8, 8)}) or non-finite values")
    return {"dtype": str(dtype).removeprefix("torch."), "parameters": sum(p.numel() for p in model.parameters()),
            "batch": batch, "train_step_ms": round(train_ms, 2), "sample_actions_ms": round(sample_ms, 2),
            "flow_loss": round(losses[-1], 4), "num_inference_steps": config.num_inference_steps}


def check_pi0_rl(device: str) -> dict:
    """rlfabric's own pi0 policy (services/policies/pi0.py) at the example's sizes and spaces (examples/
    arm_reach_pi0.yaml: a 64x64 camera, 8 proprio, 4x2 chunks), 64 envs: a rollout's decision with the prefix's KV
    cache reused against the prefix recomputed per denoising step, then one PPO update in fp32 and one in bf16-mixed
    (the learner's ``runtime.precision``); the learner's re-scoring of the rollout's chains must agree to 1e-4 in
    fp32, and bf16-mixed's disagreement is reported."""
    import numpy as np
    import torch

    from rlfabric.services.core.config import load_config
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.core.runtime import learner_precision
    from rlfabric.services.env.sims import instructions

    config = load_config(Path(__file__).resolve().parents[1] / "examples" / "arm_reach_pi0.yaml")
    size, H, A, B, T = config.env.kwargs["image_size"], config.env.action_chunk, 2, 64, 4
    spaces = {"observation_space": {"kind": "dict", "spaces": {
        "image": {"kind": "box", "shape": [size, size, 3], "dtype": "uint8", "low": 0, "high": 255},
        "instruction": {"kind": "box", "shape": [instructions.MAX_TOKENS], "dtype": "int64", "low": 0,
                        "high": instructions.vocab_size() - 1},
        "proprio": {"kind": "box", "shape": [8], "dtype": "float32", "low": -np.inf, "high": np.inf}}},
        "action_space": {"kind": "box", "shape": [H, A], "dtype": "float32", "low": -1.0, "high": 1.0}}
    torch.manual_seed(0)
    policy = build_policy("pi0", spaces, config.policy).to(device)
    g = torch.Generator().manual_seed(0)
    texts = ["reach the red ball", "touch the blue one"] * (B // 2)
    obs = {"image": torch.randint(0, 256, (B, size, size, 3), generator=g, dtype=torch.uint8),
           "proprio": torch.randn(B, 8, generator=g),
           "instruction": torch.as_tensor(np.stack([instructions.encode(t) for t in texts]))}
    obs = {k: v.to(device) for k, v in obs.items()}
    K = policy.steps

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed_ms(fn, repeats: int = 10) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        return (time.perf_counter() - t0) / repeats * 1e3

    def recompute() -> torch.Tensor:
        return pi0_ode_recomputing_prefix(policy, obs)

    policy.eval()
    cached = policy.act(obs, deterministic=True)[0][:, -1]
    if not torch.allclose(cached, recompute(), atol=1e-4):
        raise RuntimeError("the prefix's KV cache and the prefix recomputed per step gave different chunks")
    act_ms = timed_ms(lambda: policy.act(obs))
    recompute_ms = timed_ms(recompute)
    figures = {"parameters": sum(p.numel() for p in policy.parameters()), "envs": B, "denoising_steps": K,
               "decision_ms_kv_cache": round(act_ms, 2), "decision_ms_recompute_prefix": round(recompute_ms, 2)}
    for precision in ("fp32", "bf16-mixed"):
        torch.manual_seed(0)
        fresh = build_policy("pi0", spaces, config.policy).to(device)
        algo = config.spec(fresh, config, torch.Generator(device=device).manual_seed(0), env_spec=spaces)
        chains, logp, values = fresh.act(obs, generator=torch.Generator(device=device).manual_seed(1))
        rewards = (torch.arange(B, device=device) % 2 == 0).float()  # every other env's chain earned a reward
        batch = {"obs": {k: v[None].expand(T, *v.shape).contiguous() for k, v in obs.items()},
                 "actions": chains[None].expand(T, *chains.shape).contiguous(),
                 "logp": logp[None].expand(T, *logp.shape).contiguous(),
                 "values": values[None].expand(T, B).contiguous(), "rewards": rewards[None].expand(T, B).contiguous(),
                 "dones": torch.ones(T, B, device=device), "last_values": torch.zeros(B, device=device)}
        sync()
        t0 = time.perf_counter()
        with learner_precision(precision, device):
            stats = algo.update(batch)
        sync()
        tag = precision.replace("-mixed", "")
        figures[f"update_s_{tag}"] = round(time.perf_counter() - t0, 3)
        figures[f"logprob_mismatch_{tag}"] = float(f"{stats['logprob_mismatch_abs']:.2e}")
        if not all(np.isfinite(float(v)) for v in stats.values() if isinstance(v, (int, float))):
            raise RuntimeError(f"non-finite PPO stats in {precision}: {stats}")
    if figures["logprob_mismatch_fp32"] >= 1e-4:
        raise RuntimeError(f"the learner re-scored the rollout's chains {figures['logprob_mismatch_fp32']} apart in "
                           f"fp32 (want < 1e-4) ({figures})")
    return figures


def lm_config(backend: str, memory: float | None = None, dtype: str = "auto", hidden: int = 64, layers: int = 2):
    """A Llama run, tiny by default (hidden 64, one head: head_dim 64, which every vLLM attention kernel
    supports)."""
    from rlfabric.services.core.config import parse_config

    fraction = f", engine_memory_fraction: {memory}" if memory else ""
    return parse_config(f"""
name: gpu-check
seed: 3
env: {{adapter: text, id: arith, num_envs: 8, options: {{group_size: 2}}}}
policy: {{lm: {{hidden_size: {hidden}, intermediate_size: {2 * hidden}, layers: {layers}, heads: {hidden // 64},
             max_positions: 128}}}}
rollout: {{backend: {backend}, temperature: 1.0, dtype: {dtype}{fraction}}}
algorithm: {{name: grpo}}
""")


def lm_prompts(backend, n: int) -> list[list[int]]:
    from rlfabric.services.env.tasks.arith import ArithTask

    task = ArithTask(level=3, split="train")
    return [[1, *backend.encode(task.prompt(p))] for p in task.problems(n, seed=0)]


def tokens(gens) -> list[list[int]]:
    return [[int(t) for t in g.tokens] for g in gens]


def check_hf_rollout(device: str) -> dict:
    """The rollout's torch backend (services/rollout/backends/hf.py), which needs no engine package: greedy generate,
    a perturbed weight version loaded in place must change the outputs, and sampled tokens/s at batch 64 in fp32 and
    in bf16 (``rollout.dtype``)."""
    import torch

    from rlfabric.services.rollout.backends.hf import HFBackend

    figures: dict = {}
    for dtype in ("float32", "bfloat16"):
        backend = HFBackend(lm_config("hf", dtype=dtype), SPEC, device)
        base = {k: v.detach().cpu().float().clone() for k, v in backend.policy.state_dict().items()}
        contexts = lm_prompts(backend, 8)
        backend.load(1, base)
        before = tokens(backend.generate(contexts, 16, sample=False))
        g = torch.Generator().manual_seed(7)
        t0 = time.perf_counter()
        backend.load(2, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()})
        reload_ms = (time.perf_counter() - t0) * 1e3
        changed = sum(a != b for a, b in zip(tokens(backend.generate(contexts, 16, sample=False)), before,
                                             strict=True))
        if changed == 0:
            raise RuntimeError(f"{dtype}: greedy outputs did not change after loading a perturbed version")
        wide = lm_prompts(backend, 64)
        backend.generate(wide, 64, sample=True)
        t0 = time.perf_counter()
        n = sum(len(x.tokens) for x in backend.generate(wide, 64, sample=True))
        tag = "fp32" if dtype == "float32" else "bf16"
        figures[f"tokens_per_s_batch64_{tag}"] = round(n / (time.perf_counter() - t0))
        figures[f"reload_ms_{tag}"] = round(reload_ms, 1)
        figures[f"rows_changed_by_reload_{tag}"] = f"{changed}/{len(before)}"
    return figures


def check_offload(device: str) -> dict:
    """The learner's side of a collocated turn (services/core/offload.py, ``scheduling.offload: host``): a ~110M
    parameter LM policy and its AdamW state, after a step, leave the device and come back. On CUDA the memory must
    be free for *another process* (cudaMemGetInfo), as the rollout stage taking its turn is one; values come back
    bit-identical and the next step runs."""
    import types

    import torch

    from rlfabric.services.core.models import build_policy
    from rlfabric.services.core.offload import ModelOffload, state_tensors

    config = lm_config("hf", hidden=1024, layers=8)
    policy = build_policy(config.policy_name, SPEC, config.policy).to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    ids = torch.randint(0, 64, (8, 64), device=device)

    def step() -> None:
        (-policy.token_logprobs(ids, torch.ones_like(ids)).mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    owners = types.SimpleNamespace(optimizer=optimizer)
    offload = ModelOffload(lambda: state_tensors(policy, owners), "host", name="gpu-check")
    before = {k: v.detach().clone().cpu() for k, v in policy.state_dict().items()}
    gib = 2**30
    free = (lambda: torch.cuda.mem_get_info()[0]) if device == "cuda" else (lambda: 0)
    if device == "cuda":
        torch.cuda.synchronize()
    awake = free()
    moved = offload.offload()
    asleep = free()
    offload.onload()
    woken = free()
    same = all(torch.equal(before[k], v.detach().cpu()) for k, v in policy.state_dict().items())
    step()
    figures = {"parameters": sum(p.numel() for p in policy.parameters()), "offloaded_gib": round(moved / gib, 3),
               "offload_s": round(offload.offload_seconds, 3), "onload_s": round(offload.onload_seconds, 3),
               "same_values_after_onload": same}
    if device == "cuda":
        figures.update(free_awake_gib=round(awake / gib, 2), free_asleep_gib=round(asleep / gib, 2),
                       free_woken_gib=round(woken / gib, 2), freed_gib=round((asleep - awake) / gib, 3))
        if asleep - awake < 0.9 * moved:
            raise RuntimeError(f"offload moved {moved / gib:.2f} GiB but the device has only "
                               f"{(asleep - awake) / gib:.2f} GiB more free for other processes ({figures})")
    if not same:
        raise RuntimeError(f"the state came back with other values ({figures})")
    return figures


def check_vllm(device: str) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise Skip(f"vllm not installed ({exc})") from None
    import torch

    from rlfabric.services.rollout.backends.hf import HFBackend
    from rlfabric.services.rollout.backends.vllm import VLLMBackend
    hf = HFBackend(lm_config("hf"), SPEC, device)
    t0 = time.perf_counter()
    engine = VLLMBackend(lm_config("vllm", 0.3 if device == "cuda" else None), SPEC, device)
    init_s = time.perf_counter() - t0
    try:
        base = {k: v.detach().cpu().clone() for k, v in hf.policy.state_dict().items()}
        contexts = lm_prompts(hf, 8)
        for b in (hf, engine):
            b.load(1, base)
        before = tokens(engine.generate(contexts, 16, sample=False))
        g = torch.Generator().manual_seed(7)
        perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                     for k, v in base.items()}
        t0 = time.perf_counter()
        engine.load(2, perturbed)
        reload_s = time.perf_counter() - t0
        hf.load(2, perturbed)
        after = tokens(engine.generate(contexts, 16, sample=False))
        reference = tokens(hf.generate(contexts, 16, sample=False))
        changed = sum(a != b for a, b in zip(after, before, strict=True))
        match = sum(a == r for a, r in zip(after, reference, strict=True)) / len(after)
        first = all(a[:1] == r[:1] for a, r in zip(after, reference, strict=True))
        wide = lm_prompts(hf, 64)
        engine.generate(wide, 64, sample=True)  # warm-up at the timed batch
        t0 = time.perf_counter()
        n = sum(len(g.tokens) for g in engine.generate(wide, 64, sample=True))
        rate = n / (time.perf_counter() - t0)
    finally:
        engine.close()
    figures = {"engine_init_s": round(init_s, 1), "reload_s": round(reload_s, 3), "tokens_per_s_batch64": round(rate),
               "rows_changed_by_reload": f"{changed}/{len(after)}", "greedy_match_vs_hf": round(match, 3)}
    if changed == 0:
        raise RuntimeError(f"greedy outputs did not change after loading a perturbed version ({figures})")
    if not first or match < 0.75:  # fp32 both; later tokens of a random model may flip on near-ties
        raise RuntimeError(f"vLLM greedy outputs differ from HF's on the same weights ({figures})")
    return figures


def _pair_subscriber(backend: str, store, pair: int, prefix: str, numel: int, rounds: int, out) -> None:
    """The subscriber's side of one weight-transport pair: receives ``rounds`` timed buckets after a warm-up. Its
    rendezvous goes over ``store`` (a pipe to the host's process; a service's goes over its weight channel)."""
    import torch

    from rlfabric.services.core.weight_transport import PairClient

    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(1)
        device = "cuda:1"
    def ask(meta: dict, value: bytes) -> tuple[dict, bytes]:
        store.send((meta, value))
        return store.recv()

    client = PairClient(backend, "127.0.0.1", pair, prefix, ask, 60.0)
    buf = torch.empty(numel, dtype=torch.uint8, device=device)
    client.recv([buf])  # warm-up: the communicator is set up on the first transfer
    t0 = time.perf_counter()
    for _ in range(rounds):
        client.recv([buf])
    seconds = time.perf_counter() - t0
    out.put({"seconds": seconds, "checksum": int(buf[:1024].sum())})
    client.close()


def check_nccl(device: str) -> dict:
    """rlfabric's own weight transport (services/core/weight_transport.py) across two processes: NCCL on CUDA
    (gloo on CPU, the self-test of this check's code)."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from rlfabric.services.core.weight_transport import PairHost

    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise Skip("this torch build has no NCCL")
        if torch.cuda.device_count() < 2:
            raise Skip(f"needs 2 GPUs (NCCL needs a distinct device per rank; {torch.cuda.device_count()} here)")
        torch.cuda.set_device(0)
    numel, rounds = (256 if backend == "nccl" else 16) * 2**20, 8
    host = PairHost(backend, "127.0.0.1")
    pair, prefix = host.join("127.0.0.1", 60.0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store, theirs = ctx.Pipe()

    def answer() -> None:  # the pair's store operations, as the publisher's weight channel answers them
        with contextlib.suppress(EOFError, OSError):
            while True:
                meta, value = store.recv()
                store.send(host.store_op(pair, meta, value))

    threading.Thread(target=answer, daemon=True).start()
    proc = ctx.Process(target=_pair_subscriber, args=(backend, theirs, pair, prefix, numel, rounds, results),
                       daemon=True)
    proc.start()
    try:
        data = torch.full((numel,), 7, dtype=torch.uint8, device="cuda:0" if backend == "nccl" else "cpu")
        for _ in range(rounds + 1):
            host.send(pair, [data])
        got = results.get(timeout=90)
    finally:
        host.close()
        proc.join(timeout=10)
    if got["checksum"] != 7 * 1024:
        raise RuntimeError(f"received bytes differ from those sent (checksum {got['checksum']} != {7 * 1024})")
    return {"backend": backend, "bytes_per_round": numel, "rounds": rounds,
            "gb_per_s": round(numel * rounds / got["seconds"] / 1e9, 2)}


def check_sglang(device: str) -> dict:
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        raise Skip(f"sglang not installed ({exc})") from None
    from rlfabric.services.rollout.backends.sglang import SGLangBackend

    t0 = time.perf_counter()
    engine = SGLangBackend(lm_config("sglang", 0.3), SPEC, device)
    init_s = time.perf_counter() - t0
    try:
        contexts = lm_prompts(engine, 16)
        engine.generate(contexts, 16, sample=False)
        t0 = time.perf_counter()
        out = engine.generate(contexts, 32, sample=True)
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    n = sum(len(g.tokens) for g in out)
    if n == 0:
        raise RuntimeError("SGLang generated no tokens")
    return {"engine_init_s": round(init_s, 1), "tokens_per_s_batch16": round(n / seconds)}


def check_sleep_wake(device: str) -> dict:
    import torch

    if device != "cuda":
        raise Skip("sleep/wake frees GPU memory: CUDA only")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise Skip(f"vllm not installed ({exc})") from None
    from rlfabric.services.rollout.backends.vllm import VLLMBackend

    engine = VLLMBackend(lm_config("vllm", 0.3), SPEC, device)
    gib = 2**30
    try:
        contexts = lm_prompts(engine, 8)
        before = tokens(engine.generate(contexts, 16, sample=False))
        torch.cuda.synchronize()
        awake, total = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        engine.sleep()
        sleep_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        asleep = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        engine.wake()
        wake_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        woken = torch.cuda.mem_get_info()[0]
        again = tokens(engine.generate(contexts, 16, sample=False))
    finally:
        engine.close()
    freed = (asleep - awake) / gib
    figures = {"total_gib": round(total / gib, 1), "free_awake_gib": round(awake / gib, 2),
               "free_asleep_gib": round(asleep / gib, 2), "free_woken_gib": round(woken / gib, 2),
               "freed_gib": round(freed, 2), "sleep_s": round(sleep_s, 2), "wake_s": round(wake_s, 2),
               "same_greedy_after_wake": again == before}
    if freed < 0.1 * 0.3 * total / gib:  # the engine reserves 30% of the card: most of it must come back
        raise RuntimeError(f"sleep freed {freed:.2f} GiB of the ~{0.3 * total / gib:.1f} GiB the engine reserves "
                           f"(vLLM's sleep mode needs LLM(enable_sleep_mode=True) on CUDA) ({figures})")
    if again != before:
        raise RuntimeError(f"greedy outputs changed across sleep/wake: weights not restored ({figures})")
    return figures


def check_maniskill(device: str) -> dict:
    """``env.adapter: maniskill`` (services/env/adapters/maniskill.py) on SAPIEN, which needs a Vulkan device:
    PushCube-v1 with its camera at 64x64, 2 sub-envs stepped as the env service steps them."""
    if importlib.util.find_spec("mani_skill") is None:
        raise Skip("mani-skill not installed (pip install 'rlfabric[maniskill]')")
    if device != "cuda":
        raise Skip("SAPIEN needs a Vulkan device: checked on the GPU's driver")
    import numpy as np
    import sapien

    from rlfabric.services.core.config import EnvConfig
    from rlfabric.services.env.adapters import adapter

    t0 = time.perf_counter()
    envs = adapter("maniskill").make_vector_env(EnvConfig(adapter="maniskill", id="PushCube-v1",
                                                          options={"image_size": 64}), 2)
    figures: dict = {"make_s": round(time.perf_counter() - t0, 2)}
    try:
        spaces = envs.single_observation_space.spaces
        cameras = [k for k, space in spaces.items() if space.dtype == np.uint8]
        figures.update(cameras=",".join(f"{c}{list(spaces[c].shape)}" for c in cameras),
                       state_dim=spaces["state"].shape[0], action=f"{list(envs.single_action_space.shape)}")
        first, _ = envs.reset(seed=3)
        again, _ = envs.reset(seed=3)
        figures["seeded_reset_repeats"] = bool(np.array_equal(first["state"], again["state"]))
        figures["cameras_not_blank"] = all(float(first[c].std()) > 0 for c in cameras)
        push = np.tile(np.linspace(-1.0, 1.0, envs.single_action_space.shape[0], dtype=np.float32), (2, 1))
        for _ in range(5):
            obs, *_ = envs.step(push)
        figures["state_moved"] = round(float(np.abs(obs["state"] - first["state"]).max()), 4)
        figures["camera_changed"] = round(float(np.mean([np.abs(obs[c].astype(int) - first[c]).mean()
                                                         for c in cameras])), 2)
        envs.reset(seed=4)
        task = envs.envs[0].unwrapped  # PushCubeEnv: put sub-env 0's cube on its goal
        goal = np.asarray(task.goal_region.pose.p[0].cpu(), np.float64)
        task.obj.set_pose(sapien.Pose(p=[goal[0], goal[1], task.cube_half_size]))
        hold = np.zeros((2, envs.single_action_space.shape[0]), np.float32)
        _, _, terminated, _, info = envs.step(hold)
        final = info.get("final_info", info)
        figures["terminated_after_placing"] = [bool(t) for t in terminated]
        figures["is_success_sub_env_0"] = bool(np.asarray(final["is_success"])[0])
        envs.reset(seed=5)
        t0 = time.perf_counter()
        steps = 50
        for _ in range(steps):
            envs.step(push)
        figures["env_steps_per_s"] = round(2 * steps / (time.perf_counter() - t0), 1)
    finally:
        envs.close()
    wrong = [k for k, want in (("seeded_reset_repeats", True), ("cameras_not_blank", True),
                               ("is_success_sub_env_0", True)) if figures[k] != want]
    if wrong or figures["state_moved"] < 1e-3 or figures["terminated_after_placing"] != [True, False]:
        raise RuntimeError(f"ManiSkill through the adapter: {wrong or 'the arm or the success flag'} is off "
                           f"({figures})")
    return figures


FUNCTIONS = {"pi0": check_pi0, "pi0_rl": check_pi0_rl, "hf_rollout": check_hf_rollout, "offload": check_offload,
             "maniskill": check_maniskill, "vllm": check_vllm, "nccl": check_nccl, "sglang": check_sglang,
             "sleep_wake": check_sleep_wake}


# ---------------------------------------------------------------------------------------------------- driver


def child(name: str, device: str, result: str, work: str = "") -> None:
    """Run one check (or, with ``work``, one example entry: bench/gpu_examples.py) here and write
    {"status", "figures"} to ``result``."""
    try:
        if work:
            import gpu_examples

            doc = {"status": "ok", "figures": gpu_examples.run(name, device, Path(work))}
        else:
            doc = {"status": "ok", "figures": FUNCTIONS[name](device)}
    except Skip as exc:
        doc = {"status": f"skipped: {exc}", "figures": {}}
    except Exception as exc:  # noqa: BLE001 — a check's failure is its row, never the end of the run
        traceback.print_exc()  # into the check's log, whose tail the row carries
        frames = traceback.extract_tb(exc.__traceback__)
        ours = [f for f in frames if Path(f.filename).resolve() == Path(__file__).resolve()]
        where = ours[-1:] + frames[-1:]  # the check's line, then where it raised
        doc = {"status": f"failed: {type(exc).__name__}: {str(exc)[:800]}", "figures": {},
               "where": " -> ".join(dict.fromkeys(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in where))}
    Path(result).write_text(json.dumps(doc))


def run_check(name: str, timeout_s: float, device: str, work: str = "") -> dict:
    """One check (an example entry with ``work``) in a process (and process group) of its own, killed with its
    engines and services at ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        result = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        t0 = time.perf_counter()
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--device", device, "--result",
                                     str(result), *(["--work", work] if work else [])], stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            finally:
                try:  # the whole group, always: engine processes outlive the check's process otherwise
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        seconds = time.perf_counter() - t0
        tail = log.read_text(errors="replace")[-1500:]
        if result.exists():
            doc = json.loads(result.read_text())
        elif seconds >= timeout_s:
            doc = {"status": f"failed: over its {timeout_s:.1f} s budget", "figures": {}}
        else:
            doc = {"status": f"failed: process exited {proc.returncode} without a result", "figures": {}}
        if not doc["status"].startswith(("ok", "skipped")):
            doc["log_tail"] = tail
    return {"check": name, "status": doc["status"], "seconds": round(seconds, 1), "figures": doc["figures"],
            **{k: doc[k] for k in ("where", "log_tail") if k in doc}}


def cuda_device() -> str | None:
    """The GPUs' names, or None without CUDA. torch is imported here, not at module import, and asked only whether a
    device exists: this process creates no CUDA context (that would hold GPU memory the checks measure)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20).stdout.split("\n")
        return ", ".join(n.strip() for n in names if n.strip()) or "cuda"
    except (OSError, subprocess.TimeoutExpired):
        return "cuda"


def table(rows: list[dict]) -> str:
    width = max([11, *(len(r["check"]) for r in rows)])
    lines = [f"{'check':<{width}} {'seconds':>8}  status / figures"]
    for r in rows:
        figures = ", ".join(f"{k}={v}" for k, v in r["figures"].items())
        lines.append(f"{r['check']:<{width}} {r['seconds']:>8.1f}  {r['status'][:160]}"
                     + (f"\n{'':<{width + 10}}{figures}" if figures else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/gpu_check.json")
    ap.add_argument("--only", default="", help=f"comma-separated checks to run, of {','.join(CHECKS)}")
    ap.add_argument("--budget", type=float, default=480.0, help="total wall-clock seconds for all checks")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a self-test of a check's code
    ap.add_argument("--examples", action="store_true", help="then every example spec and every algorithm through "
                    "all services, a few iterations each (bench/gpu_examples.py)")
    ap.add_argument("--only-examples", default="", help="comma-separated example entries (implies --examples)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.device, args.result, args.work)
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or ([] if args.only_examples else list(CHECKS))
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"--only: unknown check(s) {unknown}; choose from {','.join(CHECKS)}")
    examples: list[str] = []
    if args.examples or args.only_examples:
        import gpu_examples

        known = gpu_examples.by_name()
        examples = [n.strip() for n in args.only_examples.split(",") if n.strip()] or list(known)
        if [n for n in examples if n not in known]:
            ap.error(f"--only-examples: unknown entries {[n for n in examples if n not in known]}; choose from "
                     f"{','.join(known)}")
    gpu = cuda_device() if args.device == "cuda" else args.device
    deadline = time.monotonic() + args.budget
    rows = []
    jobs = [(name, BUDGET_S[name], "") for name in names]
    if examples and gpu is not None:
        work = tempfile.mkdtemp(prefix="gpu-examples-")
        t0 = time.perf_counter()
        gpu_examples.prepare(Path(work))
        rows.append({"check": "examples: data", "status": "ok", "seconds": round(time.perf_counter() - t0, 1),
                     "figures": {"work": work}})
        jobs += [(f"{name}", gpu_examples.budget_s(name), work) for name in examples]
    elif examples:
        jobs += [(name, 0.0, "") for name in examples]
    for name, budget, work in jobs:
        left = deadline - time.monotonic()
        if gpu is None:
            rows.append({"check": name, "status": "skipped: no CUDA device", "seconds": 0.0, "figures": {}})
        elif left < 1:
            rows.append({"check": name, "status": f"skipped: --budget {args.budget:.0f} s spent", "seconds": 0.0,
                         "figures": {}})
        else:
            rows.append(run_check(name, min(budget, left), args.device, work))
        print(table(rows[-1:]).split("\n", 1)[1], flush=True)
    print(table(rows))
    report("gpu_check", {"device": gpu or "none", "checks": rows}, {}, {}, args.out)
    return 1 if any(r["status"].startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
