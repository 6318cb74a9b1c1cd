"""Play episodes with a checkpoint's policy, in this process (no services needed): ``rlfabric eval``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from services.core.actor import build_policy
from services.core.config import RunConfig


def evaluate_checkpoint(path: str | Path, episodes: int, seed: int | None = None,
                        deterministic: bool = True) -> list[float]:
    """Returns of ``episodes`` episodes; by default on the run's own eval seeds, so it reproduces the run's eval."""
    from services.env.adapters.gymnasium import make_vector_env
    from services.learner.checkpoint import unpack

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint (runs leave one at runs/<id>/checkpoints/final.pt)")
    ckpt = unpack(path.read_bytes(), str(path))
    config = RunConfig.from_json(ckpt["config_json"])
    spec = json.loads(ckpt["env_spec_json"])
    policy = build_policy(config, spec)
    policy.load_state_dict(ckpt["policy"])
    seed = config.eval_seed() if seed is None else seed
    n = min(episodes, config.env.eval_envs)
    env = make_vector_env(config.env.id, n, "sync", config.env.kwargs)
    quota = np.full(n, episodes // n) + (np.arange(n) < episodes % n)
    got: list[list[float]] = [[] for _ in range(n)]
    running = np.zeros(n)
    obs, _ = env.reset(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    while any(len(g) < q for g, q in zip(got, quota, strict=True)):
        actions, _, _ = policy.act(torch.as_tensor(obs), deterministic, generator)
        obs, reward, terminated, truncated, _ = env.step(policy.env_actions(actions))
        running += reward
        for i in np.flatnonzero(np.logical_or(terminated, truncated)):
            if len(got[i]) < quota[i]:
                got[i].append(float(running[i]))
            running[i] = 0.0
    env.close()
    return [r for g in got for r in g]
