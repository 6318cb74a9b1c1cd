"""Embodied RL on a pixel task (rlfabric/ArmReach-v0: a MuJoCo arm rendered headless at 64x64 on the CPU, action
chunks of 4), everything measured in this run, on this machine, through real service processes:

  * env steps/s of every execution plan with the VLA-shaped policy (collocated, both hybrids, disaggregated at
    staleness 1), steady state (warm-up iterations dropped, no evaluation). Target: the best pipelined or hybrid
    plan >= 1.3x collocated;
  * wall-clock to an evaluation threshold, rlfabric PPO (examples/arm_reach_cnn.yaml) against Stable-Baselines3
    PPO on the same task with the same hyper-parameters and the same network (a Nature-CNN image encoder beside the
    proprioception, a [64, 64] MLP head; SB3's MultiInputPolicy). Each side is timed from the start of its training process to the first
    evaluation that reaches the threshold (start-up included). Target: rlfabric / SB3 <= 1.0.

  * with ``--policy pi0`` (transformers' pi0, examples/arm_reach_pi0.yaml's sizes, random init, on
    rlfabric/ArmReachLang-v0): the same plans, and the decision latency of acting with the VLM prefix's KV cache
    computed once and reused by every denoising step against recomputing the prefix at each step (same chunks).

    python bench/embodied.py --out bench/results/embodied.json [--iterations 8] [--threshold 1.0] [--skip-plans]
    python bench/embodied.py --policy pi0 --out bench/results/embodied_pi0.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import pi0_ode_recomputing_prefix, python, report  # noqa: E402
from modes import start_stack, steps_per_s, train  # noqa: E402

from services.core.config import load_config  # noqa: E402

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


def plans(iterations: int, work: Path, spec: Path = VLA) -> dict[str, float]:
    base = load_config(spec)
    measured: dict[str, float] = {}
    for name, sched in PLANS.items():  # a fresh stack per plan: no plan inherits another's warm processes
        folder = work / name.replace(" ", "_").replace("|", "_")
        stack, client = start_stack(folder)
        try:
            rows = train(client, base, sched, iterations, folder / "run")
        finally:
            client.close()
            stack.stop()
        measured[name] = steps_per_s(rows[WARMUP:])
        print(f"{name:<28} {measured[name]:8.1f} env steps/s (decisions of {base.env.action_chunk} steps)",
              flush=True)
    return measured


def pi0_decision_latency(repeats: int = 20) -> dict[str, float]:
    """ms per decision of 16 observations: pi0's prefix once with its KV cache reused by the K denoising steps (the
    policy's act), against the prefix recomputed at every step (pi0's forward with the images and words each
    time). Both integrate the same ODE from zero noise, checked equal."""
    import gymnasium as gym
    import numpy as np
    import torch

    import services.env.sims  # noqa: F401  (registers the rlfabric/ tasks)
    from services.core.models import build_policy
    from services.env.adapters.gymnasium import describe_space
    from services.env.chunking import ActionChunk
    from services.env.sims import instructions

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
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats * 1000

    cached = policy.act(obs, deterministic=True)[0][:, -1]
    if not torch.allclose(cached, recompute(), atol=1e-5):
        raise RuntimeError("the cached and recomputed prefixes gave different chunks")
    ms_cached = timed(lambda: policy.act(obs, deterministic=True))
    ms_recompute = timed(recompute)
    print(f"pi0 decision of {B} observations, {K} denoising steps: {ms_cached:.1f} ms with the prefix's KV cache, "
          f"{ms_recompute:.1f} ms recomputing the prefix per step", flush=True)
    return {"decision_ms_kv_cache": ms_cached, "decision_ms_recompute_prefix": ms_recompute,
            "denoising_steps": float(K), "prefix_tokens": float(np.prod(policy.inputs(obs)["input_ids"].shape[1:]))}


def rlfabric_to_threshold(seed: int, threshold: float, max_steps: int, work: Path, plan: dict) -> dict:
    """`rlfabric train` on the bench's best plan, its local stack started by the command (start-up counted)."""
    run_dir = work / f"rlfabric-{seed}"
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
    proc = subprocess.run([python(), "-m", "services.cli", "train", str(CNN_RUN), "--run-dir", str(run_dir), "--quiet",
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
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlfabric-embodied-"))
    metrics: dict = {}
    ratios: dict[str, float] = {}
    targets: dict[str, str] = {}
    best = "hybrid env+rollout|learner"
    if args.policy == "pi0":
        latency = pi0_decision_latency()
        metrics.update(latency)
        ratios["decision_latency_kv_cache_vs_recompute"] = (latency["decision_ms_kv_cache"]
                                                            / latency["decision_ms_recompute_prefix"])
        targets["decision_latency_kv_cache_vs_recompute"] = "<1.0"
        args.skip_sb3 = True
    if not args.skip_plans:
        measured = plans(args.iterations, work, SPECS[args.policy])
        metrics.update({f"{k} env_steps_per_s": v for k, v in measured.items()})
        pipelined = {k: v for k, v in measured.items() if k != "collocated"}
        best = max(pipelined, key=pipelined.get)
        metrics["best pipelined/hybrid plan"] = best
        ratios["best_pipelined_vs_collocated"] = pipelined[best] / measured["collocated"]
        targets["best_pipelined_vs_collocated"] = ">=1.3"
    if not args.skip_sb3:
        ours, theirs = [], []
        for seed in args.seeds:
            ours.append(rlfabric_to_threshold(seed, args.threshold, args.max_steps, work, PLANS[best]))
            theirs.append(sb3_to_threshold(seed, args.threshold, args.max_steps))
            print(f"seed {seed}: rlfabric {ours[-1]['seconds']} s ({ours[-1]['decisions']} decisions), SB3 "
                  f"{theirs[-1]['seconds']} s ({theirs[-1]['decisions']} decisions)", flush=True)
        metrics.update({"threshold": args.threshold, "rlfabric": ours, "sb3": theirs})
        done = [(a["seconds"], b["seconds"]) for a, b in zip(ours, theirs, strict=True) if a["seconds"] and b["seconds"]]
        if done:
            ratios["wall_to_threshold_vs_sb3"] = sum(a for a, _ in done) / sum(b for _, b in done)
            targets["wall_to_threshold_vs_sb3"] = "<=1.0"
        else:
            print("no seed reached the threshold on both sides: no wall-clock ratio", flush=True)
    report("embodied", metrics, ratios, targets, args.out)


if __name__ == "__main__":
    main()
