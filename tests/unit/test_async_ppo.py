"""Async PPO's decoupled objective and staleness drop against values computed by hand."""

import copy
import math

import pytest
import torch
from pydantic import ValidationError

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models import ActorCritic
from rlfabric.services.learner.algorithms.async_ppo import (
    AsyncPPO,
    behaviour_weights,
    decoupled_ppo_loss,
    version_lags,
)
from rlfabric.services.learner.algorithms.ppo import PPO, ppo_loss

OBS = {"kind": "box", "shape": [4]}
DISCRETE = {"kind": "discrete", "shape": [], "dtype": "int64", "n": 3}
Z4 = torch.zeros(4)


def _loss(new, prox, mu, adv, cap):
    w, truncated = behaviour_weights(prox, mu, cap)
    loss, stats = decoupled_ppo_loss(new, prox, w, adv, Z4, Z4, Z4, Z4, clip=0.2, clip_vf=None, vf_coef=0.0,
                                     ent_coef=0.0)
    return loss, stats, w, truncated


def test_with_proximal_equal_to_behaviour_it_is_ppos_clipped_loss():
    mu = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.8, 0.8, 0.3, 0.3]))  # ratios 1.6, 1.6, 0.6, 0.6
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats, w, truncated = _loss(new, mu.clone(), mu, adv, cap=2.0)
    assert w.tolist() == [1.0] * 4 and not truncated.any()
    # min(r*A, clip(r)*A): 1.2, -1.6, 0.6, -0.8 (as PPO's hand case)
    assert loss.item() == pytest.approx(-(1.2 - 1.6 + 0.6 - 0.8) / 4)
    ppo, _ = ppo_loss(new, mu, adv, Z4, Z4, Z4, Z4, clip=0.2, clip_vf=None, vf_coef=0.0, ent_coef=0.0)
    assert loss.item() == ppo.item()
    assert stats["clip_fraction"].item() == 1.0


def test_behaviour_weight_and_its_truncation_by_hand():
    prox = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.8, 0.8, 0.3, 0.3]))  # r = pi_theta / pi_prox: 1.6, 1.6, 0.6, 0.6
    mu = torch.log(torch.tensor([0.625, 0.5, 1.0, 0.2]))  # w = pi_prox / mu: 0.8, 1.0, 0.5, 2.5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    # the clip is around pi_prox: min terms 1.2, -1.6, 0.6, -0.8, each times its w
    loss, stats, w, truncated = _loss(new, prox, mu, adv, cap=None)
    assert w.tolist() == pytest.approx([0.8, 1.0, 0.5, 2.5])
    assert loss.item() == pytest.approx(-(0.8 * 1.2 - 1.6 + 0.5 * 0.6 - 2.5 * 0.8) / 4)  # 0.585
    loss, _, w, truncated = _loss(new, prox, mu, adv, cap=2.0)
    assert w.tolist() == pytest.approx([0.8, 1.0, 0.5, 2.0]) and truncated.tolist() == [False, False, False, True]
    assert loss.item() == pytest.approx(-(0.8 * 1.2 - 1.6 + 0.5 * 0.6 - 2.0 * 0.8) / 4)  # 0.485
    assert stats["clip_fraction"].item() == 1.0  # measured against pi_prox, not mu


def test_the_behaviour_weight_carries_no_gradient():
    prox = torch.log(torch.tensor([0.5, 0.4])).requires_grad_()
    mu = torch.log(torch.tensor([0.25, 0.4]))
    new = prox.detach().clone().requires_grad_()
    w, _ = behaviour_weights(prox, mu, None)
    loss, _ = decoupled_ppo_loss(new, prox.detach(), w, torch.tensor([1.0, 1.0]), torch.zeros(2), torch.zeros(2),
                                 torch.zeros(2), torch.zeros(2), 0.2, None, 0.0, 0.0)
    loss.backward()
    assert prox.grad is None
    assert new.grad.tolist() == pytest.approx([-2.0 / 2, -1.0 / 2])  # d(-mean(w r A))/d log pi_theta at r = 1


def test_version_lags_and_the_staleness_drop():
    lags, keep = version_lags(5, torch.tensor([5, 4, 3, 2, 6]), bound=2)
    assert lags.tolist() == [0, 1, 2, 3, -1] and keep.tolist() == [True, True, True, False, True]
    _, keep = version_lags(5, torch.tensor([5, 4]), bound=0)
    assert keep.tolist() == [True, False]


def _setup(overrides: dict, staleness: int = 2, device: str = "cpu"):
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"algorithm": {"n_epochs": 3, "batch_size": 128, "lr_schedule": "constant",
                                                  **overrides},
                                    "scheduling": {"staleness": staleness}})
    policy = ActorCritic(OBS, DISCRETE, cfg.policy).to(device)
    T, N = 16, 8
    obs = torch.randn(T, N, 4, device=device)
    actions = torch.randint(0, 3, (T, N), device=device)
    with torch.no_grad():
        logp, _, values = policy.evaluate(obs.reshape(-1, 4), actions.reshape(-1))
    batch = {"obs": obs, "actions": actions, "logp": logp.reshape(T, N), "values": values.reshape(T, N),
             "rewards": (actions == 2).float(), "dones": torch.zeros(T, N, device=device),
             "last_values": torch.zeros(N, device=device)}
    return cfg, policy, batch


def test_an_on_policy_batch_gets_exactly_ppos_update():
    cfg, policy, batch = _setup({"name": "async_ppo"})
    twin = copy.deepcopy(policy)
    ppo_cfg = RunConfig.model_validate(
        {"algorithm": cfg.algorithm.model_dump(exclude={"max_staleness", "behaviour_weight_cap"}) | {"name": "ppo"}})
    algo = cfg.spec(policy, cfg, torch.Generator().manual_seed(3))
    ref = PPO(twin, ppo_cfg, torch.Generator().manual_seed(3))
    assert isinstance(algo, AsyncPPO) and "weight_version" in AsyncPPO.trajectory(cfg.algorithm).fields
    algo.weight_version = 7
    stats = algo.update(batch | {"weight_version": torch.full((16, 8), 7)})
    ref_stats = ref.update(batch)
    for a, b in zip(policy.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert stats["policy_loss"] == pytest.approx(ref_stats["policy_loss"], abs=1e-6)
    assert stats["version_lag_mean"] == 0 and stats["version_lag_max"] == 0 and stats["stale_dropped_fraction"] == 0
    assert stats["behaviour_weight_mean"] == pytest.approx(1.0) and stats["behaviour_weight_truncated_fraction"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this host: the GPU path runs where one exists"))])
def test_update_drops_samples_beyond_the_bound_and_reports_lags(device):
    cfg, policy, batch = _setup({"name": "async_ppo", "max_staleness": 1}, device=device)
    algo = cfg.spec(policy, cfg, torch.Generator(device=device).manual_seed(0))
    assert algo.bound == 1
    algo.weight_version = 10
    versions = torch.tensor([10, 10, 9, 9, 9, 8, 8, 7], device=device).expand(16, 8)  # per env column (a shard)
    stats = algo.update(batch | {"weight_version": versions})
    assert stats["version_lag_mean"] == pytest.approx((0 + 0 + 1 + 1 + 1 + 2 + 2 + 3) / 8)
    assert stats["version_lag_max"] == 3
    assert stats["version_lag_stale_fraction"] == pytest.approx(6 / 8)
    assert stats["stale_dropped_fraction"] == pytest.approx(3 / 8)
    assert algo.optimizer_steps == 3  # 80 kept rows: one minibatch per epoch
    assert algo.env_steps == 128  # dropped samples were still collected

    before = [p.detach().clone() for p in policy.parameters()]
    algo.weight_version = 20  # everything is 10+ versions old: no step, all counted as dropped
    stats = algo.update(batch | {"weight_version": versions})
    assert stats["stale_dropped_fraction"] == 1.0 and algo.optimizer_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


def test_default_bound_is_the_runs_staleness():
    cfg, policy, _ = _setup({"name": "async_ppo"}, staleness=3)
    assert AsyncPPO(policy, cfg).bound == 3


def test_stale_behaviour_weights_are_measured_and_truncated():
    cfg, policy, batch = _setup({"name": "async_ppo", "behaviour_weight_cap": 1.5})
    algo = cfg.spec(policy, cfg, torch.Generator().manual_seed(0))
    algo.weight_version = 1
    mu = batch["logp"].clone()
    mu[:, :4] -= math.log(2.0)  # half the envs: mu gave its actions half pi_prox's probability, w = 2 > cap
    stats = algo.update(batch | {"logp": mu, "weight_version": torch.ones(16, 8, dtype=torch.int64)})
    assert stats["behaviour_weight_mean"] == pytest.approx(1.5, rel=1e-5)
    assert stats["behaviour_weight_truncated_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("field,value", [("behaviour_weight_cap", 0.5), ("max_staleness", -1)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        RunConfig.model_validate({"algorithm": {"name": "async_ppo", field: value}})
