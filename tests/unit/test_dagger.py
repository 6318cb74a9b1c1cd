"""DAgger's spec and update: an expert role, states only from the rollout, and every sampled state labelled by the
expert's mode as the env executes it, which an actor-critic student comes to imitate: a squashed-Gaussian expert
(Box actions) and a categorical one (Discrete)."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models.actor_critic import ActorCritic
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.learner.algorithms.dagger import DAgger

OBS = {"kind": "box", "shape": [3], "dtype": "float32"}
BOX = {"kind": "box", "shape": [1], "dtype": "float32", "low": [-2.0], "high": [2.0]}
DISCRETE = {"kind": "discrete", "shape": [], "dtype": "int64", "n": 3}


def config(**algorithm) -> RunConfig:
    return RunConfig.model_validate({"algorithm": {"name": "dagger", "batch_size": 64, "learning_rate": 0.003,
                                                   "expert_checkpoint": "expert.pt", **algorithm},
                                     "policy": {"hidden_sizes": [32]}})


def test_spec_asks_for_an_expert_and_only_states():
    cfg = config()
    assert DAgger.needs(cfg.algorithm).expert and DAgger.trajectory(cfg.algorithm).fields == ("obs",)
    assert DAgger.data(cfg.algorithm).source_names == ("online",)
    assert cfg.policy_name == "actor_critic"
    with pytest.raises(ValueError, match="expert_checkpoint"):
        DAgger.check(config(expert_checkpoint=""))


@pytest.mark.parametrize("space", ["box", "discrete"])
def test_every_state_is_labelled_by_the_expert_and_imitated(space):
    torch.manual_seed(0)
    cfg = config()
    if space == "box":  # a SAC-style expert: squashed actions, rescaled to [-2, 2] for the env
        expert = SquashedGaussianActor(OBS, BOX, cfg.policy)
        policy = ActorCritic(OBS, BOX, cfg.policy)
    else:
        expert = ActorCritic(OBS, DISCRETE, cfg.policy)
        with torch.no_grad():
            expert.pi_head.weight.mul_(50.0)  # a decided expert: its mode varies over the states
        policy = ActorCritic(OBS, DISCRETE, cfg.policy)
    expert.requires_grad_(False)
    algo = DAgger(policy, cfg, torch.Generator().manual_seed(0), expert=expert)
    g = torch.Generator().manual_seed(1)
    batch = {"obs": torch.randn(4, 64, 3, generator=g)}  # states the policy visited: no actions recorded
    first = algo.update(batch)
    for _ in range(100):
        last = algo.update(batch)
    assert algo.optimizer_steps == 404
    assert last["bc_loss"] < first["bc_loss"] and last["expert_gap"] < 0.25 * first["expert_gap"], (first, last)
    held_out = torch.randn(256, 3, generator=g)
    mine = torch.as_tensor(policy.env_actions(policy.act(held_out, deterministic=True)[0]))
    theirs = torch.as_tensor(expert.env_actions(expert.act(held_out, deterministic=True)[0]))
    if space == "box":
        assert (mine - theirs).abs().mean() < 0.2  # of a [-2, 2] range
    else:
        assert (mine == theirs).float().mean() > 0.9


def test_the_mixture_schedule_and_what_a_mixed_collector_may_record(monkeypatch):
    cfg = config(beta=1.0, beta_decay=0.5)
    traj = DAgger.trajectory(cfg.algorithm)
    assert [traj.expert_share(i) for i in range(4)] == [1.0, 0.5, 0.25, 0.125]
    assert DAgger.trajectory(config().algorithm).expert_share(0) == 0.0  # beta = 0: the policy always acts
    from rlfabric.services.core.algorithm import Trajectory
    from rlfabric.services.rollout.collectors.gym import GymCollector

    class Backend:
        has_value = False

    mixed = Trajectory(fields=("obs", "actions"), expert_acts=0.5)
    run = config()
    monkeypatch.setattr(DAgger, "trajectory", classmethod(lambda cls, c: mixed))
    with pytest.raises(ValueError, match="record states only"):
        GymCollector(run, Backend(), None, 4, 1, "train/0")
