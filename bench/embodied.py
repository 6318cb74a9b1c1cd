"""Embodied RL on a pixel task (rlfabric/ArmReach-v0: a MuJoCo arm rendered headless at 64x64 on the CPU, action
chunks of 4), everything measured in this run, on this machine, through real service processes:

  * env steps/s of every execution plan with the VLA-shaped policy (collocated, both hybrids, disaggregated at
    staleness 1), steady state (warm-up iterations dropped, no evaluation). Target: the best pipelined or hybrid
    plan >= 1.3x collocated;
  * wall-clock to an evaluation threshold, rlfabric PPO (examples/arm_reach_cnn.yaml) against Stable-Baselines3
    PPO on the same task with the same hyper-parameters and the same network (a Nature-CNN image encoder beside the
    proprioception, a [64, 64] MLP head; SB3's MultiInputPolicy). Each side is timed from the start of its training
    process to the first evaluation that reaches the threshold (start-up included); a side's sample in a round is
    its median over ``--seeds`` (a seed that never reaches the threshold counts as infinitely slow), the per-seed
    runs are kept in the JSON. Target: rlfabric / SB3 <= 1.0.

  * with ``--policy pi0`` (transformers' pi0, examples/arm_reach_pi0.yaml's sizes, random init, on
    rlfabric/ArmReachLang-v0): the same plans, and the decision latency of acting with the VLM prefix's KV cache
    computed once and reused by every denoising step against recomputing the prefix at each step (same chunks).

Every comparison runs ``--repeats`` rounds (default 3; ``--quick``: one), each side once per round, the sides
alternating (the plans: a fresh stack per plan and round; pi0's latency: the policy loaded once, the two ways of
acting alternating; SB3: rlfabric's seeds, then SB3's, per round). Every ratio is a ratio of the sides' medians over
the rounds; each side's median, min and max are printed and written ("sides"), and a side whose spread (max - min)
exceeds 20% of its median is flagged NOISY with every ratio that uses it.

    python bench/embodied.py --out bench/results/embodied.json [--iterations 8] [--threshold 1.0] [--skip-plans]
                             [--repeats 3 | --quick]
    python bench/embodied.py --policy pi0 --out bench/results/embodied_pi0.json
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_repeat_args,
    interleave,
    median_of,
    pi0_ode_recomputing_prefix,
    python,
    ratio_of_medians,
    repeat_count,
    report,
    seed_median,
)
from modes import slug, start_stack, steps_per_s, train  # noqa: E402

from rlfabric.services.core.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLA = ROOT / "examples" / "arm_reach_vla.yaml"
SPECS = {"vla": VLA, "pi0": ROOT / "examples" / "arm_reach_pi0.yaml"}
WARMUP = 2
PLANS = {
    "collocated": {"mode": "collocated"},
    "hybrid env+rollout|learner": {"mode": "hybrid", "pipeline_chunks": 2, "staleness": 1,
                                   "placement": {"env": "a", "rollout": "a", "learner": "b"}},
    "hybrid env|rollout+learner": {"mode": "hybrid", "pipeline_chunks": 2,
                                   "placement": {"env": "a", "rollout": "b", "learner": "b"}},
    "disaggregated": {"mode": "disaggregated", "pipeline_chunks": 2, "staleness": 1},
}
CNN_RUN = ROOT / "examples" / "arm_reach_cnn.yaml"
# the shared settings of the SB3 comparison: PPO with a CNN policy (examples/arm_reach_cnn.yaml), 16 envs of chunks
# of 4; the CNN is SB3's Nature-CNN (32/64/64 channels) on both sides
HP = {"num_envs": 16, "n_steps": 16, "batch_size": 64, "n_epochs": 8, "gamma": 0.95, "gae_lambda": 0.9,
      "learning_rate": 5e-4, "clip_range": 0.2, "ent_coef": 0.0, "max_grad_norm": 1.0, "chunk": 4}
CNN = {"channels": [32, 64, 64], "kernels": [8, 4, 3], "strides": [4, 2, 1], "features": 128}


def plans(iterations: int, work: Path, spec: Path = VLA, repeats: int = 1) -> dict[str, list[float]]:
    """Env steps/s of every plan, ``repeats`` rounds of every plan in turn: {plan: its samples}."""
    base = load_config(spec)
    runs = itertools.count()

    def side(name: str, sched: dict):
        def measure() -> float:  # a fresh stack per plan and round: no plan inherits another's warm processes
            folder = work / f"{slug(name)}-{next(runs)}"
            stack, client = start_stack(folder)
            try:
                rows = train(client, base, sched, iterations, folder / "run")
            finally:
                client.close()
                stack.stop()
            return steps_per_s(rows[WARMUP:])
        return measure

    print(f"env steps/s of every plan (decisions of {base.env.action_chunk} steps)", flush=True)
    return interleave({name: side(name, sched) for name, sched in PLANS.items()}, repeats)


def pi0_decision_latency(repeats: int = 1, calls: int = 20) -> tuple[dict, dict[str, list[float]]]:
    """ms per decision of 16 observations: pi0's prefix once with its KV cache reused by the K denoising steps (the
    policy's act), against the prefix recomputed at every step (pi0's forward with the images and words each
    time). Both integrate the same ODE from zero noise, checked equal. The policy is built once; each of
    ``repeats`` rounds times ``calls`` decisions of each way in turn. Returns (metrics, {side: ms per round})."""
    import gymnasium as gym
    import numpy as np
    import torch

    import rlfabric.services.env.sims  # noqa: F401  (registers the rlfabric/ tasks)
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.env.adapters.gymnasium import describe_space
    from rlfabric.services.env.chunking import ActionChunk
    from rlfabric.services.env.sims import instructions

    torch.set_num_threads(1)
    config = load_config(SPECS["pi0"])
    # nothing renders here: without this, ArmReach picks OSMesa, whose LLVM crashes (SIGSEGV) the import of
    # triton that transformers' pi0 makes through torch._dynamo later in this process. Only while mujoco is
    # imported: the services this bench starts afterwards inherit the environment, and they do render.
    previous = os.environ.get("MUJOCO_GL")
    os.environ["MUJOCO_GL"] = "disable"
    try:
        env = ActionChunk(gym.make(config.env.id, **config.env.kwargs), config.env.action_chunk)
    finally:
        if previous is None:
            os.environ.pop("MUJOCO_GL")
        else:
            os.environ["MUJOCO_GL"] = previous
    spaces = {"observation_space": describe_space(env.observation_space),
              "action_space": describe_space(env.action_space)}
    env.close()
    policy = build_policy("pi0", spaces, config.policy).eval()
    g = torch.Generator().manual_seed(0)  # latency does not depend on what the image shows
    size = config.env.kwargs["image_size"]
    obs = {"image": torch.randint(0, 256, (16, size, size, 3), generator=g, dtype=torch.uint8),
           "proprio": torch.randn(16, 8, generator=g),
           "instruction": torch.as_tensor(np.stack([instructions.encode("reach the red ball")] * 16))}
    K, B = policy.steps, 16

    def recompute() -> torch.Tensor:
        return pi0_ode_recomputing_prefix(policy, obs)

    def timed(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1000

    cached = policy.act(obs, deterministic=True)[0][:, -1]
    if not torch.allclose(cached, recompute(), atol=1e-5):
        raise RuntimeError("the cached and recomputed prefixes gave different chunks")
    print(f"pi0 decision of {B} observations, {K} denoising steps, ms (mean of {calls} calls per sample):", flush=True)
    samples = interleave({"pi0 decision ms kv cache": lambda: timed(lambda: policy.act(obs, deterministic=True)),
                          "pi0 decision ms recompute prefix": lambda: timed(recompute)}, repeats)
    ms_cached = median_of(samples["pi0 decision ms kv cache"])
    ms_recompute = median_of(samples["pi0 decision ms recompute prefix"])
    print(f"pi0 decision of {B} observations, {K} denoising steps: {ms_cached:.1f} ms with the prefix's KV cache, "
          f"{ms_recompute:.1f} ms recomputing the prefix per step (medians)", flush=True)
    return ({"decision_ms_kv_cache": ms_cached, "decision_ms_recompute_prefix": ms_recompute,
             "denoising_steps": float(K), "prefix_tokens": float(np.prod(policy.inputs(obs)["input_ids"].shape[1:]))},
            samples)


def rlfabric_to_threshold(seed: int, threshold: float, max_steps: int, work: Path, plan: dict,
                          tag: str = "") -> dict:
    """`rlfabric train` on the bench's best plan, its local stack started by the command (start-up counted)."""
    run_dir = work / f"rlfabric-{seed}{tag}"
    sets = [f"seed={seed}", f"env.num_envs={HP['num_envs']}", "env.eval_envs=16",
            f"env.action_chunk={HP['chunk']}", f"algorithm.n_steps={HP['n_steps']}",
            f"algorithm.batch_size={HP['batch_size']}", f"algorithm.n_epochs={HP['n_epochs']}",
            f"algorithm.gamma={HP['gamma']}", f"algorithm.gae_lambda={HP['gae_lambda']}",
            f"algorithm.learning_rate={HP['learning_rate']}", f"algorithm.clip_range={HP['clip_range']}",
            f"algorithm.ent_coef={HP['ent_coef']}", f"algorithm.max_grad_norm={HP['max_grad_norm']}",
            "policy.hidden_sizes=[64, 64]", "policy.activation=relu", f"policy.cnn={json.dumps(CNN)}",
            f"train.total_env_steps={max_steps}", "train.eval_every_iterations=4", "train.eval_episodes=16",
            f"train.stop_at_eval_return={threshold}", f"scheduling={json.dumps(plan)}"]
    t0 = time.time()
    proc = subprocess.run([python(), "-m", "rlfabric.services.cli", "train", str(CNN_RUN), "--run-dir", str(run_dir), "--quiet",
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    hit = next((r for r in rows if r["eval_return_mean"] and float(r["eval_return_mean"]) >= threshold), None)
    evals = [(int(r["env_steps"]), float(r["eval_return_mean"])) for r in rows if r["eval_return_mean"]]
    return {"seconds": float(hit["time"]) - t0 if hit else None, "decisions": int(hit["env_steps"]) if hit else None,
            "evals": evals}


def sb3_to_threshold(seed: int, threshold: float, max_steps: int) -> dict:
    t0 = time.time()
    proc = subprocess.run([python(), str(Path(__file__).parent / "_sb3_embodied.py"), str(seed), str(max_steps),
                           str(threshold), json.dumps(HP), json.dumps(CNN)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": out["reached_at"] - t0 if out["reached_at"] else None, "decisions": out["env_steps"],
            "evals": out["evals"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--iterations", type=int, default=8, help="iterations per plan (the first 2 are warm-up)")
    ap.add_argument("--threshold", type=float, default=1.0, help="eval mean return both sides must reach")
    ap.add_argument("--max-steps", type=int, default=60_000, help="decisions each side may take")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--skip-sb3", action="store_true")
    ap.add_argument("--skip-plans", action="store_true", help="only the SB3 comparison (on the hybrid plan)")
    ap.add_argument("--policy", choices=sorted(SPECS), default="vla",
                    help="pi0: its plans and decision latency (the SB3 comparison is the vla policy's)")
    add_repeat_args(ap)
    args = ap.parse_args()
    repeats = repeat_count(args)
    work = Path(tempfile.mkdtemp(prefix="rlfabric-embodied-"))
    metrics: dict = {}
    ratios: dict[str, float | None] = {}
    targets: dict[str, str] = {}
    samples: dict[str, list] = {}
    compares: dict[str, list[str]] = {}
    best = "hybrid env+rollout|learner"
    if args.policy == "pi0":
        latency, latency_samples = pi0_decision_latency(repeats)
        metrics.update(latency)
        samples |= latency_samples
        key = "decision_latency_kv_cache_vs_recompute"
        compares[key] = ["pi0 decision ms kv cache", "pi0 decision ms recompute prefix"]
        ratios[key] = ratio_of_medians(samples, *compares[key])
        targets[key] = "<1.0"
        args.skip_sb3 = True
    if not args.skip_plans:
        plan_samples = plans(args.iterations, work, SPECS[args.policy], repeats)
        samples |= plan_samples
        measured = {k: median_of(v) for k, v in plan_samples.items()}
        metrics.update({f"{k} env_steps_per_s": v for k, v in measured.items()})
        pipelined = {k: v for k, v in measured.items() if k != "collocated"}
        best = max(pipelined, key=pipelined.get)
        metrics["best pipelined/hybrid plan"] = best
        compares["best_pipelined_vs_collocated"] = [best, "collocated"]
        ratios["best_pipelined_vs_collocated"] = ratio_of_medians(samples, best, "collocated")
        targets["best_pipelined_vs_collocated"] = ">=1.3"
    if not args.skip_sb3:
        ours: list[list[dict]] = []  # per round, per seed
        theirs: list[list[dict]] = []
        rounds = itertools.count()

        def rlfabric_side() -> float:
            tag = f"-round{next(rounds)}"
            ours.append([rlfabric_to_threshold(seed, args.threshold, args.max_steps, work, PLANS[best], tag)
                         for seed in args.seeds])
            for seed, r in zip(args.seeds, ours[-1], strict=True):
                print(f"  seed {seed}: rlfabric {r['seconds']} s ({r['decisions']} decisions)", flush=True)
            return seed_median(r["seconds"] for r in ours[-1])

        def sb3_side() -> float:
            theirs.append([sb3_to_threshold(seed, args.threshold, args.max_steps) for seed in args.seeds])
            for seed, r in zip(args.seeds, theirs[-1], strict=True):
                print(f"  seed {seed}: SB3 {r['seconds']} s ({r['decisions']} decisions)", flush=True)
            return seed_median(r["seconds"] for r in theirs[-1])

        print(f"wall-clock s to eval return {args.threshold} (median over seeds {args.seeds}), rlfabric on {best}",
              flush=True)
        samples |= interleave({"rlfabric wall_to_threshold_s": rlfabric_side, "sb3 wall_to_threshold_s": sb3_side},
                              repeats)
        metrics.update({"threshold": args.threshold, "seeds": args.seeds, "rlfabric": ours, "sb3": theirs})
        key = "wall_to_threshold_vs_sb3"
        compares[key] = ["rlfabric wall_to_threshold_s", "sb3 wall_to_threshold_s"]
        ratios[key] = ratio_of_medians(samples, *compares[key])
        targets[key] = "<=1.0"
        if ratios[key] is None:
            print("a side's median did not reach the threshold: no wall-clock ratio", flush=True)
    report("embodied", metrics, ratios, targets, args.out, sides=samples, compares=compares, repeats=repeats)


if __name__ == "__main__":
    main()
