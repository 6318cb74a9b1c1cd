"""Baseline for bench/algos.py: Stable-Baselines3 SAC or sb3-contrib CrossQ on Pendulum-v1 with the arguments
bench/algos.py mapped from rlfabric's example spec, and rlfabric's evaluation protocol: after the update of every
``eval_every`` env steps, ``eval_episodes`` deterministic episodes over ``eval_envs`` envs started from the same
seeds each time (env i from eval_seed + i, as rlfabric's eval pool), and one final evaluation at the step cap
(as rlfabric's last iteration). Prints one JSON line: when an evaluation first reached the target (absolute
time.time(), so the caller's clock can start at process launch), at how many env steps, and every evaluation.

    python bench/_sb3_pendulum.py '<json: algo, seed, total, target, threads, env_id, num_envs, eval_envs,
                                  eval_episodes, eval_every, eval_seed, kwargs, policy_kwargs>'
"""

from __future__ import annotations

import json
import sys
import time

import torch
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy

ACTIVATIONS = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh}


def evaluate(model, eval_env, episodes: int, seed: int) -> float:
    """rlfabric's protocol: every evaluation starts eval env i from seed + i (the same states each time)."""
    eval_env.seed(seed)
    mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=episodes, deterministic=True)
    return float(mean)


class EvalEvery(BaseCallback):
    """Evaluates after the update that follows every ``every`` env steps (SB3 calls ``_on_rollout_start`` before
    collecting rollout k+1, i.e. after training on rollout k: where rlfabric evaluates, after an iteration's
    update). Once an evaluation reaches ``target`` the next env step ends ``learn``."""

    def __init__(self, eval_env, every: int, episodes: int, target: float, eval_seed: int):
        super().__init__()
        self.eval_env, self.every, self.episodes, self.target = eval_env, every, episodes, target
        self.eval_seed = eval_seed
        self.next_eval = every
        self.reached: tuple[float, int, float] | None = None
        self.evals: list[tuple[int, float]] = []

    def _on_step(self) -> bool:
        return self.reached is None

    def _on_rollout_start(self) -> None:
        if self.reached is None and self.model.num_timesteps >= self.next_eval:
            self.next_eval += self.every
            self.check()

    def check(self) -> None:
        mean = evaluate(self.model, self.eval_env, self.episodes, self.eval_seed)
        self.evals.append((self.model.num_timesteps, mean))
        if mean >= self.target:
            self.reached = (time.time(), self.model.num_timesteps, mean)


def build(hp: dict):
    kwargs = dict(hp["kwargs"])
    kwargs["train_freq"] = tuple(kwargs["train_freq"])
    pk = dict(hp["policy_kwargs"])
    pk["activation_fn"] = ACTIVATIONS[pk["activation_fn"]]
    if "optimizer_kwargs" in pk:
        pk["optimizer_kwargs"] = {k: tuple(v) if isinstance(v, list) else v for k, v in pk["optimizer_kwargs"].items()}
    env = make_vec_env(hp["env_id"], n_envs=hp["num_envs"], seed=hp["seed"])
    if hp["algo"] == "sac":
        from stable_baselines3 import SAC as cls
    elif hp["algo"] == "crossq":
        from sb3_contrib import CrossQ as cls
    else:
        raise ValueError(f"unknown algorithm {hp['algo']!r}")
    return cls("MlpPolicy", env, policy_kwargs=pk, seed=hp["seed"], device="cpu", verbose=0, **kwargs)


def main() -> None:
    hp = json.loads(sys.argv[1])
    torch.set_num_threads(hp["threads"])  # as rlfabric's learner (runtime.set_torch_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    model = build(hp)
    eval_env = make_vec_env(hp["env_id"], n_envs=hp["eval_envs"], seed=hp["eval_seed"])
    cb = EvalEvery(eval_env, hp["eval_every"], hp["eval_episodes"], hp["target"], hp["eval_seed"])
    model.learn(total_timesteps=hp["total"], callback=cb)
    if cb.reached is None and (not cb.evals or cb.evals[-1][0] != model.num_timesteps):
        cb.check()  # the step cap: one final evaluation, as rlfabric's last iteration makes
    print(json.dumps({"reached_at": cb.reached[0] if cb.reached else None,
                      "env_steps": cb.reached[1] if cb.reached else None,
                      "eval_return": cb.reached[2] if cb.reached else None,
                      "final_env_steps": model.num_timesteps, "evals": cb.evals, "end": time.time()}))


if __name__ == "__main__":
    main()
