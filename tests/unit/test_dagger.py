"""DAgger's spec and update: an expert role, states only from the rollout, and every sampled state labelled by the
expert's mode, which the policy comes to imitate."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.learner.algorithms.dagger import DAgger

SPEC = {"observation_space": {"kind": "box", "shape": [3], "dtype": "float32"},
        "action_space": {"kind": "box", "shape": [1], "dtype": "float32", "low": [-2.0], "high": [2.0]}}


def config(**algorithm) -> RunConfig:
    return RunConfig.model_validate({"algorithm": {"name": "dagger", "batch_size": 64, "learning_rate": 0.003,
                                                   "expert_checkpoint": "expert.pt", **algorithm},
                                     "policy": {"hidden_sizes": [32]}})


def test_spec_asks_for_an_expert_and_only_states():
    cfg = config()
    assert DAgger.needs(cfg.algorithm).expert and DAgger.trajectory(cfg.algorithm).fields == ("obs",)
    assert DAgger.data(cfg.algorithm).source_names == ("online",)
    with pytest.raises(ValueError, match="expert_checkpoint"):
        DAgger.check(config(expert_checkpoint=""))


def test_every_state_is_labelled_by_the_expert_and_imitated():
    torch.manual_seed(0)
    cfg = config()
    policy = SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy)
    expert = SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy).requires_grad_(False)
    algo = DAgger(policy, cfg, torch.Generator().manual_seed(0), expert=expert)
    g = torch.Generator().manual_seed(1)
    batch = {"obs": torch.randn(4, 64, 3, generator=g)}  # states the policy visited: no actions recorded
    first = algo.update(batch)
    for _ in range(100):
        last = algo.update(batch)
    assert algo.optimizer_steps == 404
    assert last["bc_loss"] < first["bc_loss"] and last["expert_gap"] < 0.25 * first["expert_gap"], (first, last)
    held_out = torch.randn(256, 3, generator=g)
    gap = (policy.act(held_out, deterministic=True)[0] - expert.act(held_out, deterministic=True)[0]).abs().mean()
    assert gap < 0.1
