"""Baseline for bench/embodied.py: Stable-Baselines3 PPO (MultiInputPolicy: a Nature-CNN on the image beside the
proprioception) on rlfabric/ArmReach-v0 with action chunks, the same hyper-parameters and evaluation protocol as
the rlfabric run (every 4 updates, 16 deterministic episodes over 16 envs started from the same seeds). Prints
one JSON line when an evaluation first reaches the threshold, then stops."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gymnasium as gym
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sb3_cartpole import EvalUntil, learn_until  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.vec_env import SubprocVecEnv  # noqa: E402

import rlfabric.services.env.sims  # noqa: E402,F401 — registers rlfabric/ArmReach-v0
from rlfabric.services.env.chunking import ActionChunk  # noqa: E402


def make(chunk: int):
    def build():
        return ActionChunk(gym.make("rlfabric/ArmReach-v0", image_size=64), chunk)

    return build


def main() -> None:
    seed, total, target = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    hp, cnn = json.loads(sys.argv[4]), json.loads(sys.argv[5])
    torch.set_num_threads(1)
    # envs render in worker processes: OSMesa's LLVM in the training process crashes the triton import that
    # torch.optim's dynamo does (rlfabric's env and rollout processes never import torch.optim)
    sub = {"vec_env_cls": SubprocVecEnv, "vec_env_kwargs": {"start_method": "forkserver"}}
    env = make_vec_env(make(hp["chunk"]), n_envs=hp["num_envs"], seed=seed, **sub)
    eval_env = make_vec_env(make(hp["chunk"]), n_envs=16, seed=seed + 100_000, **sub)
    model = PPO("MultiInputPolicy", env, n_steps=hp["n_steps"], batch_size=hp["batch_size"],
                n_epochs=hp["n_epochs"], gamma=hp["gamma"], gae_lambda=hp["gae_lambda"],
                learning_rate=hp["learning_rate"], clip_range=hp["clip_range"], ent_coef=hp["ent_coef"],
                max_grad_norm=hp["max_grad_norm"], seed=seed, device="cpu", verbose=0,
                policy_kwargs={"net_arch": [64, 64], "activation_fn": torch.nn.ReLU,
                               "features_extractor_kwargs": {"cnn_output_dim": cnn["features"]}})
    cb = EvalUntil(eval_env, every_rollouts=4, episodes=16, target=target, eval_seed=seed + 100_000)
    print(json.dumps(learn_until(model, cb, total)))

if __name__ == "__main__":
    main()
