"""SAC-Flow's actor (services/policies/flow_actor.py): the chain's log-likelihood as its module docstring writes
it, recomputed by hand from the same noise; the actor's gradient reaching the velocity network through every
step; deterministic acting as the noiseless flow from x_0 = 0; its options validated by field."""

from __future__ import annotations

import math

import pytest
import torch

BOX = {"kind": "box", "shape": [2], "dtype": "float32", "low": [-2.0, -2.0], "high": [2.0, 2.0]}
OBS = {"kind": "box", "shape": [3], "dtype": "float32", "low": [-1.0] * 3, "high": [1.0] * 3}


def actor(**options):
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.models import build_policy

    opts = ", ".join(f"{k}: {v}" for k, v in options.items())
    run = parse_config(f"""
name: t
env: {{id: Pendulum-v1}}
policy: {{hidden_sizes: [16, 16], activation: relu, flow_actor: {{{opts}}}}}
algorithm: {{name: sac_flow}}
""")
    assert run.policy_name == "flow_actor"
    torch.manual_seed(0)
    return build_policy("flow_actor", {"observation_space": OBS, "action_space": BOX}, run.policy)


@pytest.mark.parametrize("velocity", ["gated", "plain"])
def test_the_chain_log_prob_is_the_sum_of_its_gaussian_steps_and_the_tanh_correction(velocity):
    pi = actor(steps=3, velocity=velocity)
    obs = torch.randn(5, 3)
    actions, logp = pi.sample(obs, torch.Generator().manual_seed(7))
    # by hand, from the same draws: x_0, then one eps per step
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        h = pi.encoder(obs)
        std = pi.log_std(h).clamp(-5, 1).exp() / math.sqrt(3)
        x = torch.randn(5, 2, generator=g)
        expected = torch.zeros(5)
        for k in range(3):
            out = pi.velocity(torch.cat([h, x, torch.full((5, 1), k / 3)], -1))
            v = torch.sigmoid(out[:, :2]) * (out[:, 2:] - x) if velocity == "gated" else out
            mean = x + v / 3
            x = mean + std * torch.randn(5, 2, generator=g)
            expected += torch.distributions.Normal(mean, std).log_prob(x).sum(-1)
        expected -= torch.log(1 - torch.tanh(x) ** 2).sum(-1)
    assert torch.allclose(actions, torch.tanh(x), atol=1e-6)
    assert torch.allclose(logp, expected, atol=1e-4)


def test_the_actor_loss_reaches_the_velocity_network_through_every_step():
    pi = actor(steps=4)
    actions, logp = pi.sample(torch.randn(8, 3), torch.Generator().manual_seed(0))
    (actions.sum() + 0.1 * logp.sum()).backward()
    grads = [p.grad for p in pi.velocity.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert pi.log_std[-1].weight.grad.abs().sum() > 0  # the noise scale is trained by the entropy term


def test_deterministic_acting_is_the_noiseless_flow_from_the_priors_mode():
    pi = actor(steps=2)
    obs = torch.randn(4, 3)
    a1, _, values = pi.act(obs, deterministic=True)
    a2, _, _ = pi.act(obs, deterministic=True, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and torch.equal(values, torch.zeros(4))
    with torch.no_grad():
        h, x = pi.encoder(obs), torch.zeros(4, 2)
        for k in range(2):
            x = x + pi.step_velocity(h, x, k / 2) / 2
    assert torch.allclose(a1, torch.tanh(x), atol=1e-6)
    assert (pi.env_actions(a1) == 2 * a1.numpy()).all()  # rescaled to the Box's [-2, 2]


def test_bad_options_name_the_field():
    from rlfabric.services.core.spec_yaml import ConfigError

    with pytest.raises(ConfigError, match="policy.flow_actor.steps"):
        actor(steps=0)
    with pytest.raises(ConfigError, match="policy.flow_actor.velocity"):
        actor(velocity="gru")
