"""Embodied GRPO: groups of envs start from one initial state, only each env's first episode counts, advantages
are episode returns against their group's, and the update moves the policy toward the better episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models import build_policy
from rlfabric.services.env.pool import EnvPool
from rlfabric.services.learner.algorithms.grpo_embodied import (
    EmbodiedGRPO,
    episode_advantages,
    first_episode_mask,
)


def run_config(**algorithm) -> RunConfig:
    return RunConfig.model_validate({
        "env": {"id": "rlfabric/ArmReach-v0", "num_envs": 8, "action_chunk": 2, "kwargs": {"observation": "state"}},
        "policy": {"name": "vla", "vla": {"width": 32, "heads": 2, "layers": 1, "head": "tokens", "bins": 5,
                                          "logprob_level": "action"}},
        "algorithm": {"name": "grpo_embodied", "group_size": 4, "n_steps": 4, **algorithm}})


def test_groups_of_envs_start_from_one_state_and_groups_differ():
    cfg = run_config()
    pool = EnvPool(cfg.env, 8, chunks=2)  # groups of 4 span the two sub-vector envs' boundary alike
    obs = np.concatenate(pool.reset(seed=11, group=4))
    assert all(np.array_equal(obs[i], obs[0]) for i in range(4))
    assert all(np.array_equal(obs[i], obs[4]) for i in range(4, 8))
    assert not np.array_equal(obs[0], obs[4])
    again = np.concatenate(pool.reset(seed=11, group=1))  # group 1: every env its own start
    assert len({again[i].tobytes() for i in range(8)}) == 8


def test_only_the_first_episode_of_each_env_counts():
    dones = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 1, 0]], dtype=torch.float32)  # [T=4, N=3]
    mask = first_episode_mask(dones)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 1], [0, 0, 1], [0, 0, 1]]


def test_episode_advantages_against_the_group():
    returns = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 5.0])
    adv, spread = episode_advantages(returns, 2, scale=True)
    assert adv[:2].tolist() == pytest.approx([-1 / np.sqrt(2), 1 / np.sqrt(2)], abs=1e-5)  # (r - mean) / std
    assert adv[2:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert spread.tolist() == [True, True, False, False, False, False]  # equal returns teach nothing
    raw, _ = episode_advantages(returns, 2, scale=False)
    assert raw[:2].tolist() == [-1.0, 1.0]


def test_an_update_raises_the_log_prob_of_the_better_episode_and_lowers_the_worse():
    torch.manual_seed(0)
    cfg = run_config(epochs=8, learning_rate=3e-3, minibatch_size=64)
    pool = EnvPool(cfg.env, 8)
    policy = build_policy(cfg.policy_name, {"observation_space": pool.obs_spec, "action_space": pool.act_spec},
                          cfg.policy)
    obs = torch.as_tensor(np.concatenate(pool.reset(seed=3, group=4)))
    T, N = 4, 8
    obs_t = obs[None].expand(T, N, -1).contiguous()
    actions, logp, _ = policy.act(obs_t.reshape(T * N, -1))
    rewards = torch.zeros(T, N)
    rewards[:, 0] = 1.0  # env 0 the best of group 0, env 1 the worst; group 1 all equal
    rewards[:, 1] = -1.0
    dones = torch.zeros(T, N)
    dones[-1] = 1.0
    batch = {"obs": obs_t, "actions": actions.reshape(T, N, *actions.shape[1:]),
             "logp": logp.reshape(T, N, *logp.shape[1:]), "rewards": rewards, "dones": dones}
    algo = EmbodiedGRPO(policy, cfg, generator=torch.Generator().manual_seed(0))
    stats = algo.update(batch)
    assert stats["zero_std_fraction"] == pytest.approx(0.5)  # group 1 had no spread
    with torch.no_grad():
        new_logp, _, _ = policy.evaluate(batch["obs"].reshape(T * N, -1),
                                         batch["actions"].reshape(T * N, *actions.shape[1:]))
    change = (new_logp.reshape(T, N, -1) - batch["logp"]).sum((0, 2))
    assert change[0] > 0.5 and change[1] < -0.5
    assert algo.optimizer_steps == 8
