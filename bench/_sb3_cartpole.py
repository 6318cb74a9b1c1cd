"""Baseline for bench/e2e_cartpole.py: Stable-Baselines3 PPO with the same (rl-zoo) hyper-parameters and the
same evaluation protocol (every 10 updates, 10 deterministic episodes over 10 envs started from the same seeds
each time, as rlfabric's eval pool is). Prints one JSON line when
an evaluation first reaches the target, then stops."""

from __future__ import annotations

import json
import sys
import time

import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy


class EvalUntil(BaseCallback):
    def __init__(self, eval_env, every_rollouts: int, episodes: int, target: float, eval_seed: int):
        super().__init__()
        self.eval_env, self.every, self.episodes, self.target = eval_env, every_rollouts, episodes, target
        self.eval_seed = eval_seed
        self.rollouts = 0
        self.reached = None
        self.evals = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        pass

    def _on_rollout_start(self) -> None:
        # SB3 calls this before collecting rollout k+1, i.e. after update k: evaluate then, like rlfabric does
        if self.rollouts and self.rollouts % self.every == 0 and self.reached is None:
            mean = evaluate(self.model, self.eval_env, self.episodes, self.eval_seed)
            self.evals.append((self.num_timesteps, float(mean)))
            if mean >= self.target:
                self.reached = (time.time(), self.num_timesteps, float(mean))
                self.model._stop_now = True
        self.rollouts += 1


def evaluate(model, eval_env, episodes: int, seed: int) -> float:
    """rlfabric's protocol: every evaluation starts eval env i from seed + i (the same states each time)."""
    eval_env.seed(seed)
    mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=episodes, deterministic=True)
    return float(mean)


def main() -> None:
    seed, total, target = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    eval_env = make_vec_env("CartPole-v1", n_envs=10, seed=seed + 100_000)
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=lambda p: 1e-3 * p, clip_range=lambda p: 0.2 * p, seed=seed,
                device="cpu", verbose=0)
    cb = EvalUntil(eval_env, every_rollouts=10, episodes=10, target=target, eval_seed=seed + 100_000)
    print(json.dumps(learn_until(model, cb, total)))


def learn_until(model, cb: EvalUntil, total: int) -> dict:
    """Train until ``cb``'s evaluation reaches its target (or ``total`` steps, then one final evaluation, as
    rlfabric does); when it was reached, at how many env steps, and every evaluation."""
    orig = model.collect_rollouts

    def collect(*a, **kw):  # stop right after the evaluation that reached the target
        if getattr(model, "_stop_now", False):
            return False
        return orig(*a, **kw)

    model.collect_rollouts = collect
    model.learn(total_timesteps=total, callback=cb)
    if cb.reached is None:
        mean = evaluate(model, cb.eval_env, cb.episodes, cb.eval_seed)
        cb.evals.append((model.num_timesteps, float(mean)))
        if mean >= cb.target:
            cb.reached = (time.time(), model.num_timesteps, float(mean))
    return {"reached_at": cb.reached[0] if cb.reached else None, "env_steps": cb.reached[1] if cb.reached else None,
            "eval_return": cb.reached[2] if cb.reached else None, "evals": cb.evals, "end": time.time()}


if __name__ == "__main__":
    main()
