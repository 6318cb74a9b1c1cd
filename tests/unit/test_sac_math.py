"""SAC's math against hand-computed values and torch's own distributions."""

from __future__ import annotations

import torch
from torch.distributions import Normal, TanhTransform, TransformedDistribution

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models.critics import soft_update as polyak
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor, squashed_log_prob
from rlfabric.services.learner.algorithms.sac import SAC, critic_target

SPEC = {"observation_space": {"kind": "box", "shape": [3], "dtype": "float32"},
        "action_space": {"kind": "box", "shape": [2], "dtype": "float32", "low": [-2.0, 0.0], "high": [2.0, 1.0]}}


def test_critic_target_by_hand():
    y = critic_target(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0]), torch.tensor([5.0, 5.0]),
                      torch.tensor([4.0, 9.0]), torch.tensor([-1.0, -1.0]), gamma=0.9, alpha=0.5)
    # 1 + 0.9 * (min(5, 4) - 0.5 * -1) = 5.05 ; terminated: just the reward
    assert torch.allclose(y, torch.tensor([5.05, 1.0]))


def test_polyak_moves_targets_by_tau():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = a.weight.detach().clone()
    polyak(a, b, 0.25)
    assert torch.allclose(a.weight, 0.75 * before + 0.25 * b.weight)


def test_squashed_log_prob_matches_torch_tanh_transform():
    g = torch.Generator().manual_seed(0)
    mu, log_std = torch.randn(64, 2, generator=g), torch.randn(64, 2, generator=g).clamp(-2, 0.5)
    u = (mu + log_std.exp() * torch.randn(64, 2, generator=g)).clamp(-3, 3)  # tanh(u) != +-1 in float32
    reference = TransformedDistribution(Normal(mu, log_std.exp()), [TanhTransform()]).log_prob(torch.tanh(u)).sum(-1)
    assert torch.allclose(squashed_log_prob(u, mu, log_std), reference, atol=1e-3)


def test_actor_scales_to_bounds_and_sac_step_improves_the_critic():
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"algorithm": {"name": "sac", "batch_size": 32, "learning_starts": 0,
                                                  "learning_rate": 0.003},
                                    "policy": {"hidden_sizes": [32]}})
    actor = SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy)
    env = actor.env_actions(torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]))
    assert env.tolist() == [[-2.0, 0.0], [2.0, 1.0], [0.0, 0.5]]
    sac = SAC(actor, cfg, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    batch = {"obs": torch.randn(1, 32, 3, generator=g), "actions": torch.rand(1, 32, 2, generator=g) * 2 - 1,
             "rewards": torch.randn(1, 32, generator=g), "next_obs": torch.randn(1, 32, 3, generator=g),
             "terminated": torch.ones(1, 32)}  # terminal: the target is the reward, a fixed regression problem
    first = sac.update(batch)["q_loss"]
    for _ in range(200):
        last = sac.update(batch)["q_loss"]
    assert last < 0.4 * first and sac.optimizer_steps == 201
    assert sac.updates_for(100) == 100 and sac.env_steps == 100
    restored = SAC(SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy), cfg)
    restored.load_state_dict(sac.state_dict())
    assert restored.optimizer_steps == 201 and torch.equal(restored.q1_target.q[0].weight, sac.q1_target.q[0].weight)


def test_frozen_critics_give_the_actor_the_same_gradient_and_themselves_none():
    """The actor's loss through frozen critics: the same actor gradient as through live ones, no gradient on the
    critics' weights, and the critics trainable again after the block."""
    from rlfabric.services.core.models.critics import frozen

    torch.manual_seed(0)
    actor, critic = torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                                                                torch.nn.Linear(8, 1))
    obs = torch.randn(16, 3)
    grads = []
    for freeze in (False, True):
        actor.zero_grad(set_to_none=True), critic.zero_grad(set_to_none=True)
        if freeze:
            with frozen(critic):
                q = critic(torch.cat([obs, actor(obs)], 1))
        else:
            q = critic(torch.cat([obs, actor(obs)], 1))
        (-q.mean()).backward()
        grads.append(actor.weight.grad.clone())
        assert all((p.grad is None) == freeze for p in critic.parameters())
    assert torch.allclose(grads[0], grads[1]) and all(p.requires_grad for p in critic.parameters())
