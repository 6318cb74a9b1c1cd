"""DSRL's policy and update (services/policies/latent_noise.py, services/learner/algorithms/dsrl.py): a recorded
action is the latent and the chunk the frozen base's ODE decodes it into; the base's decoding from zero is its own
deterministic acting; the critics read the latent alone; the base loads from the expert role and never moves."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models import build_policy

OBS = {"kind": "box", "shape": [5], "dtype": "float32", "low": [-1.0] * 5, "high": [1.0] * 5}
CHUNK = {"kind": "box", "shape": [3, 2], "dtype": "float32", "low": [[-0.5, -2.0]] * 3, "high": [[0.5, 2.0]] * 3}
SPEC = {"observation_space": OBS, "action_space": CHUNK}
VLA = {"width": 16, "heads": 2, "layers": 1, "head": "flow", "flow_steps": 3}


def config(**algorithm) -> RunConfig:
    return RunConfig.model_validate({
        "algorithm": {"name": "dsrl", "batch_size": 32, "expert_checkpoint": "base.pt", **algorithm},
        "policy": {"name": "latent_noise", "hidden_sizes": [32], "latent_noise": {"noise_bound": 1.5}, "vla": VLA}})


def trained_base(cfg: RunConfig):
    """A vla flow policy with a non-zero velocity (its last layer starts at zero)."""
    torch.manual_seed(1)
    base = build_policy("vla", SPEC, cfg.policy)
    with torch.no_grad():
        for p in base.expert[-1].parameters():
            p.normal_(0.0, 0.3)
    return base.requires_grad_(False)


def test_a_recorded_action_is_the_latent_and_the_chunk_the_base_decodes_it_into():
    cfg = config()
    torch.manual_seed(0)
    pi = build_policy("latent_noise", SPEC, cfg.policy)
    pi.base.load_state_dict(trained_base(cfg).state_dict())
    obs = torch.randn(6, 5)
    raw, logp, _ = pi.act(obs, generator=torch.Generator().manual_seed(3))
    w = pi.latent(raw)
    assert raw.shape == (6, 6 + 6) and w.shape == (6, 6) and logp.shape == (6,)
    assert w.abs().max() < 1
    chunk = pi.base.decode_noise(obs, 1.5 * w)
    assert torch.allclose(raw[:, 6:], chunk.reshape(6, 6))
    env = pi.env_actions(raw)
    assert env.shape == (6, 3, 2) and (abs(env[..., 0]) <= 0.5).all() and (abs(env[..., 1]) <= 2.0).all()
    # deterministic: the actor's mode, decoded
    mode, _, _ = pi.act(obs, deterministic=True)
    mu = pi.actor(obs)[0]
    assert torch.allclose(pi.latent(mode), torch.tanh(mu))
    with pytest.raises(ValueError, match="uniform random actions"):
        pi.random_actions(4)


def test_the_base_decoding_zero_noise_is_its_own_deterministic_acting():
    base = trained_base(config())
    obs = torch.randn(4, 5)
    chain, _, _ = base.act(obs, deterministic=True)
    assert torch.allclose(base.decode_noise(obs, torch.zeros(4, 6)), chain[:, -1].clamp(-1, 1), atol=1e-6)
    other = base.decode_noise(obs, torch.ones(4, 6))
    assert not torch.allclose(other, chain[:, -1].clamp(-1, 1))  # the noise steers the chunk


def test_critics_read_the_latent_and_only_the_latent_actor_trains():
    from rlfabric.services.learner.algorithms.dsrl import DSRL

    cfg = config(learning_starts=0)
    assert DSRL.needs(cfg.algorithm).expert and DSRL.trajectory(cfg.algorithm).random_until_env_steps == 0
    with pytest.raises(ValueError, match="expert_checkpoint"):
        DSRL.check(config(expert_checkpoint=""))
    torch.manual_seed(0)
    pi = build_policy("latent_noise", SPEC, cfg.policy)
    base = trained_base(cfg)
    algo = DSRL(pi, cfg, torch.Generator().manual_seed(0), env_spec=SPEC, expert=base)
    assert all(torch.equal(a, b) for a, b in zip(pi.base.state_dict().values(), base.state_dict().values(), strict=True))
    assert algo.q1.q[0].in_features == 5 + 6  # obs + the latent, not the chunk
    before = {k: v.clone() for k, v in pi.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    obs = torch.randn(2, 32, 5, generator=g)
    raw = pi.act(obs.reshape(64, 5))[0].reshape(2, 32, 12)
    batch = {"obs": obs, "actions": raw, "rewards": torch.randn(2, 32, generator=g),
             "next_obs": torch.randn(2, 32, 5, generator=g), "terminated": torch.zeros(2, 32)}
    metrics = algo.update(batch)
    assert algo.optimizer_steps == 2 and all(map(torch.isfinite, map(torch.tensor, metrics.values())))
    after = pi.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("base."))
    assert any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("actor."))


def test_a_base_of_another_shape_is_refused_naming_the_section():
    from rlfabric.services.learner.algorithms.dsrl import DSRL

    cfg = config()
    pi = build_policy("latent_noise", SPEC, cfg.policy)
    other = build_policy("vla", SPEC, config().policy.model_copy(update={"vla": cfg.policy.vla.model_copy(
        update={"width": 32})}))
    with pytest.raises(ValueError, match="policy.vla section"):
        DSRL(pi, cfg, torch.Generator().manual_seed(0), env_spec=SPEC, expert=other)
