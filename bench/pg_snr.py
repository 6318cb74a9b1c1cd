"""How much of a flow policy's policy gradient is signal: noise on every denoising step (Flow-SDE, the baseline)
against noise on the last step only (``sde_steps: last``) and against a one-step chain (``flow_steps: 1``), from
the same checkpoint on its own env.

For each mode the checkpoint's policy plays ``--decisions`` chunks on 16 envs (stochastic acting, as a rollout
does). Finished episodes are split into 4 disjoint quarters, and each quarter gives one REINFORCE estimate
g_q = sum_i A_i grad log pi(chain_i) / n over the parameters that train. Here A is the return-to-go (gamma 0.95),
the chunk's own reward, or the episode's success, each normalised. Two independent estimates share only the true
gradient, so:

    signal = mean over pairs of g_a . g_b    (unbiased for |E g|^2)
    noise  = mean of |g_q|^2 - signal        (the variance of one quarter's estimate)
    snr    = signal / noise, per quarter of ~decisions/4 chunks; also the mean cosine between quarters

Where the signal is a small fraction of one batch's estimate, RL moves the weights mostly at random. That is what
stalls PPO from a supervised pi0 on ArmReachLang: docs/benchmarks.md.

    python bench/pg_snr.py runs/<id>/warm_start/supervised/checkpoints/final.pt --out bench/results/pg_snr.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import report  # noqa: E402

ADVANTAGES = ("return_to_go", "chunk_reward", "success")


def collect(backend, config, decisions: int, seed: int) -> list[tuple]:
    """(obs, chain, reward, episode, done) per decision from 16 envs acting stochastically."""
    import gymnasium as gym

    import rlfabric.services.env.sims  # noqa: F401  (registers the rlfabric/ tasks)
    from rlfabric.services.env.chunking import ActionChunk

    envs = [ActionChunk(gym.make(config.env.id, **config.env.kwargs), config.env.action_chunk) for _ in range(16)]
    obs = [e.reset(seed=seed + i)[0] for i, e in enumerate(envs)]
    episode, nxt, steps = list(range(16)), 16, []
    while len(steps) < decisions:
        chains, actions, _, _ = backend.act({k: np.stack([o[k] for o in obs]) for k in obs[0]}, False)
        for j, env in enumerate(envs):
            after, reward, terminated, truncated, _ = env.step(actions[j])
            steps.append(({k: v.copy() for k, v in obs[j].items()}, chains[j], reward, episode[j],
                          terminated or truncated))
            if terminated or truncated:
                episode[j], nxt = nxt, nxt + 1
                after, _ = env.reset(seed=seed + episode[j])
            obs[j] = after
    for env in envs:
        env.close()
    return steps


def advantages(steps: list[tuple], gamma: float = 0.95) -> tuple[np.ndarray, dict[str, np.ndarray], float]:
    """The decisions of finished episodes, each advantage kind per decision, and the episodes' success rate."""
    by_episode: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        by_episode[s[3]].append(i)
    keep, adv, wins = [], {k: {} for k in ADVANTAGES}, []
    for idx in by_episode.values():
        if not steps[idx[-1]][4]:
            continue  # unfinished at the end of collection
        rewards = [steps[i][2] for i in idx]
        g, to_go = 0.0, []
        for r in reversed(rewards):
            g = r + gamma * g
            to_go.append(g)
        won = float(rewards[-1] > 0.5)  # ArmReach: +1 on success, which ends the episode
        for i, rtg, r in zip(idx, reversed(to_go), rewards, strict=True):
            adv["return_to_go"][i], adv["chunk_reward"][i], adv["success"][i] = rtg, r, won
        keep += idx
        wins.append(won)
    keep_a = np.array(sorted(keep))
    return keep_a, {k: np.array([v[i] for i in keep_a]) for k, v in adv.items()}, float(np.mean(wins))


def gradient_stats(policy, steps, keep, adv: dict[str, np.ndarray], quarters: int = 4) -> dict[str, dict]:
    import torch

    params = [p for p in policy.parameters() if p.requires_grad]
    episodes = np.array([steps[i][3] for i in keep])
    order = np.unique(episodes)
    np.random.default_rng(0).shuffle(order)
    parts = [np.isin(episodes, q) for q in np.array_split(order, quarters)]
    out = {}
    for kind, values in adv.items():
        grads = []
        for part in parts:
            idx, a = keep[part], torch.as_tensor(values[part], dtype=torch.float32)
            a = (a - a.mean()) / (a.std() + 1e-8)
            total = [torch.zeros_like(p) for p in params]
            for s in range(0, len(idx), 128):
                sub = idx[s:s + 128]
                obs = {k: torch.as_tensor(np.stack([steps[i][0][k] for i in sub])) for k in steps[0][0]}
                chains = torch.as_tensor(np.stack([steps[i][1] for i in sub]))
                logp = policy.evaluate(obs, chains)[0].reshape(len(sub), -1).sum(1)
                g = torch.autograd.grad((a[s:s + 128] * logp).sum() / len(idx), params, allow_unused=True)
                total = [t + x if x is not None else t for t, x in zip(total, g, strict=True)]
            grads.append(torch.cat([t.flatten() for t in total]).double())
        pairs = [(a, b) for a in range(quarters) for b in range(a + 1, quarters)]
        signal = float(np.mean([float(grads[a] @ grads[b]) for a, b in pairs]))
        noise = float(np.mean([float(g @ g) for g in grads])) - signal
        cosine = float(np.mean([float(torch.nn.functional.cosine_similarity(grads[a], grads[b], dim=0))
                                for a, b in pairs]))
        out[kind] = {"snr": signal / noise if noise > 0 else float("inf"), "cosine": cosine,
                     "decisions_per_quarter": int(len(keep) / quarters)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a flow policy's checkpoint (policy.name pi0), e.g. a supervised warm start")
    ap.add_argument("--decisions", type=int, default=4096, help="chunks played per mode")
    ap.add_argument("--seed", type=int, default=70000)
    ap.add_argument("--out", default="bench/results/pg_snr.json")
    args = ap.parse_args()
    os.environ.setdefault("MUJOCO_GL", "egl")
    import torch

    from rlfabric.services.rollout.evaluate import _from_checkpoint

    torch.set_num_threads(2)
    metrics: dict = {"checkpoint": args.checkpoint, "decisions": args.decisions}
    modes = {"all": ["policy.pi0.sde_steps=all"], "last": ["policy.pi0.sde_steps=last"],
             "one_step": ["policy.pi0.sde_steps=all", "policy.pi0.flow_steps=1"]}
    for mode, overrides in modes.items():
        t0 = time.perf_counter()
        config, backend = _from_checkpoint(args.checkpoint, overrides)
        steps = collect(backend, config, args.decisions, args.seed)
        keep, adv, success = advantages(steps)
        stats = gradient_stats(backend.policy, steps, keep, adv)
        metrics[mode] = {"success_rate": success, "flow_steps": backend.policy.steps,
                         "flow_noise": backend.policy.sigma, **stats, "seconds": time.perf_counter() - t0}
        print(f"{mode:8s} (flow_steps {backend.policy.steps}): stochastic success {success:.2f}; " + "; ".join(
            f"{k} snr {v['snr']:.3f} cosine {v['cosine']:.3f}" for k, v in stats.items()), flush=True)
    ratios = {f"snr_{mode}_vs_all_{k}": metrics[mode][k]["snr"] / metrics["all"][k]["snr"]
              if metrics["all"][k]["snr"] > 0 else float("inf") for mode in ("last", "one_step") for k in ADVANTAGES}
    report("pg_snr", metrics, ratios, {}, args.out)


if __name__ == "__main__":
    main()
