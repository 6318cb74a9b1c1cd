"""Does a language-conditioned policy read its instruction? On rlfabric/ArmReachLang-v0, with the checkpoint's own
observations (state + instruction, or pixels + proprio + instruction), each held-out scene is played twice by its
deterministic policy: with the instruction naming the goal ball,
and with the same scene but the words naming the other ball. A policy that ignores the words goes to the same ball
both times, so it can never succeed in both; one that follows them succeeds in both about as often as
success_rate^2.

    python bench/lang_grounding.py runs/<run>/checkpoints/final.pt [--scenes 100] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
from common import report  # noqa: E402

import rlfabric.services.env.sims  # noqa: E402, F401  (registers the rlfabric/ tasks)
from rlfabric.services.env.chunking import ActionChunk  # noqa: E402
from rlfabric.services.env.sims import instructions  # noqa: E402
from rlfabric.services.rollout.evaluate import _from_checkpoint  # noqa: E402


def play(env: gym.Env, backend, seed: int, swap: bool) -> bool:
    """One episode of the scene ``seed``; with ``swap`` the instruction names the other ball. Success or not."""
    obs, _ = env.reset(seed=seed)
    u = env.unwrapped
    if swap:
        named = u.colors[1 - u.goal]
        u.text, u.goal = u.text.replace(u.colors[u.goal], named), 1 - u.goal
        u.start_distance = u.last_distance = max(u._distance(), 1e-3)
        obs = dict(obs, instruction=instructions.encode(u.text))
    while True:
        _, actions, _, _ = backend.act({k: np.asarray(v)[None] for k, v in obs.items()}, True)
        obs, _, terminated, truncated, _ = env.step(actions[0])
        if terminated or truncated:
            return bool(terminated)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--scenes", type=int, default=100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    config, backend = _from_checkpoint(args.checkpoint)
    if config.env.id != "rlfabric/ArmReachLang-v0":
        raise SystemExit(f"{args.checkpoint} trained on {config.env.id}; this check plays rlfabric/ArmReachLang-v0")
    env = ActionChunk(gym.make(config.env.id, **config.env.kwargs), config.env.action_chunk)
    runs = np.array([[play(env, backend, 20_000 + s, swap) for swap in (False, True)] for s in range(args.scenes)])
    env.close()
    success = float(runs.mean())
    both = float(runs.all(axis=1).mean())
    print(f"success per run {success:.2f}; both (true and swapped words) {both:.2f}; "
          f"independent at that rate {success ** 2:.2f}; a policy blind to the words: 0")
    report("lang_grounding", {"checkpoint": args.checkpoint, "scenes": args.scenes, "success_per_run": success,
                              "succeeded_in_both": both}, {"both_vs_independent": both / max(success ** 2, 1e-9)},
           {}, args.out)


if __name__ == "__main__":
    main()
