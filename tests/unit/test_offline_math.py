"""IQL's and behaviour cloning's math: the expectile loss by hand, the critics fitting a fixed regression, the
advantage weights preferring better actions, and the offline family's declarations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.config import ConfigError, RunConfig, parse_config
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.learner.algorithms.iql import expectile_loss

SPEC = {"observation_space": {"kind": "box", "shape": [3], "dtype": "float32"},
        "action_space": {"kind": "box", "shape": [1], "dtype": "float32", "low": -2.0, "high": 2.0}}


def _config(algorithm: str) -> RunConfig:
    return parse_config(f"algorithm: {algorithm}\npolicy: {{hidden_sizes: [32]}}\n"
                        f"replay: {{datasets: {{offline: d.npz}}}}\n")


def test_expectile_loss_by_hand():
    diff = torch.tensor([2.0, -2.0])
    # tau weighs positive errors, 1 - tau negative ones: (0.9 * 4 + 0.1 * 4) / 2
    assert expectile_loss(diff, 0.9).item() == pytest.approx(2.0)
    assert expectile_loss(torch.tensor([1.0, 1.0]), 0.7).item() == pytest.approx(0.7)
    # the minimiser of the expectile loss over a constant is the tau-expectile: above the mean for tau > 0.5
    x = torch.tensor([0.0, 0.0, 0.0, 10.0])
    v = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([v], lr=0.1)
    for _ in range(500):
        opt.zero_grad()
        expectile_loss(x - v, 0.9).backward()
        opt.step()
    assert v.item() > x.mean().item() + 2


def test_offline_specs_collect_nothing_and_need_their_data_set():
    cfg = _config("{name: iql, total_updates: 1000, updates_per_iteration: 100}")
    assert not cfg.collects and cfg.batch_env_steps() == 0 and cfg.iterations() == 10
    access = cfg.spec.data(cfg.algorithm)
    assert access.kind == "uniform" and access.source_names == ("offline",) and access.keeps_window
    with pytest.raises(ConfigError, match=r"algorithm.source='demos' names no data set. Fix: add replay.datasets"):
        _config("{name: bc, source: demos}")


def _batch(g: torch.Generator, good_reward: float) -> dict:
    """A [1, 256] minibatch: action +0.9 earns ``good_reward``, action -0.9 earns 0; every transition terminal."""
    obs = torch.randn(1, 256, 3, generator=g)
    good = torch.rand(1, 256, generator=g) < 0.5
    actions = torch.where(good, 0.9, -0.9).unsqueeze(-1)
    return {"obs": obs, "actions": actions, "rewards": good.float() * good_reward, "next_obs": obs,
            "terminated": torch.ones(1, 256)}


def test_iql_weights_the_better_action_and_bc_imitates_both():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    results = {}
    for name in ("iql", "bc"):
        cfg = _config(f"{{name: {name}, learning_rate: 0.003}}")
        actor = SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy)
        algo = cfg.spec(actor, cfg, torch.Generator().manual_seed(0), env_spec=SPEC)
        for _ in range(300):
            stats = algo.update(_batch(g, 1.0))
        if name == "iql":  # terminal transitions: the critics regress on the reward, a fixed problem
            assert stats["q_loss"] < 0.1, stats
        with torch.no_grad():
            mu, _ = actor(torch.randn(512, 3, generator=g))
        results[name] = torch.tanh(mu).mean().item()
        assert algo.optimizer_steps == 300
        restored = cfg.spec(SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy),
                            cfg, env_spec=SPEC)
        restored.load_state_dict(algo.state_dict())
        assert restored.optimizer_steps == 300
    assert results["iql"] > 0.5, results  # advantage weights pull the policy to the rewarded action
    assert abs(results["bc"]) < 0.3, results  # the mixture's mean: between the two actions
    assert np.isfinite(list(results.values())).all()
