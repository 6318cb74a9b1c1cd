"""RECAP's math: one-step advantages and the improvement indicator on a hand-computed episode, the indicator's
dropout to the NULL token, the guided action of the advantage-conditioned policy, the update on a two-action bandit
(the guided policy picks the rewarded action where behaviour cloning would average), and its config's errors."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import ConfigError, RunConfig, parse_config
from rlfabric.services.core.models import build_policy
from rlfabric.services.core.models.advantage_conditioned import IMPROVING, NOT_IMPROVING, NULL, guided_mean
from rlfabric.services.learner.algorithms.recap import drop_indicator, improvement_indicator, td_advantages

SPEC = {"observation_space": {"kind": "box", "shape": [3], "dtype": "float32"},
        "action_space": {"kind": "box", "shape": [1], "dtype": "float32", "low": -2.0, "high": 2.0}}


def _config(algorithm: str = "{name: recap}", policy: str = "{hidden_sizes: [32]}") -> RunConfig:
    return parse_config(f"algorithm: {algorithm}\npolicy: {policy}\nreplay: {{datasets: {{offline: d.npz}}}}\n")


def test_one_step_advantages_and_indicator_of_a_hand_computed_episode():
    # a 4-step episode: V(s_0..s_3) = -5, -4, -1, -3; rewards -1, -2, 0, -3; gamma 0.5
    values = torch.tensor([-5.0, -4.0, -1.0, -3.0])
    rewards = torch.tensor([-1.0, -2.0, 0.0, -3.0])
    terminated = torch.tensor([0.0, 0.0, 0.0, 1.0])
    next_values = torch.tensor([-4.0, -1.0, -3.0, 99.0])  # the terminal step's V(s') must not count
    adv = td_advantages(rewards, terminated, values, next_values, 0.5)
    # -1 + 0.5 * -4 + 5 = 2;  -2 + 0.5 * -1 + 4 = 1.5;  0 + 0.5 * -3 + 1 = -0.5;  -3 + 3 = 0
    assert adv.tolist() == pytest.approx([2.0, 1.5, -0.5, 0.0])
    # truncated instead (a time limit): bootstrapped through V(final obs) = -2: -3 + 0.5 * -2 + 3 = -1
    truncated = td_advantages(rewards, torch.zeros(4), values, torch.tensor([-4.0, -1.0, -3.0, -2.0]), 0.5)
    assert truncated[-1].item() == pytest.approx(-1.0)
    # the threshold is the (1 - positive_fraction) quantile: sorted A = -0.5, 0, 1.5, 2
    assert improvement_indicator(adv, 0.25).tolist() == [1, 0, 0, 0]  # q = 1.625
    assert improvement_indicator(adv, 0.5).tolist() == [1, 1, 0, 0]  # q = 0.75
    assert improvement_indicator(adv, 0.9).tolist() == [1, 1, 0, 1]  # q = -0.35
    assert improvement_indicator(adv, 0.5).dtype == torch.long


def test_indicator_dropout_replaces_tokens_by_null_at_its_rate():
    tokens = (torch.arange(100_000) % 2).long()
    assert torch.equal(drop_indicator(tokens, 0.0), tokens)
    assert (drop_indicator(tokens, 1.0) == NULL).all()
    dropped = drop_indicator(tokens, 0.3, torch.Generator().manual_seed(0))
    is_null = dropped == NULL
    assert is_null.float().mean().item() == pytest.approx(0.3, abs=0.01)
    assert torch.equal(dropped[~is_null], tokens[~is_null])  # the rest keep their label
    assert is_null[tokens == 1].float().mean().item() == pytest.approx(0.3, abs=0.015)  # whatever the label
    again = drop_indicator(tokens, 0.3, torch.Generator().manual_seed(0))
    assert torch.equal(dropped, again)


def test_guided_action_is_classifier_free_guidance_of_the_mean():
    assert guided_mean(torch.tensor([1.0]), torch.tensor([3.0]), 1.5).item() == pytest.approx(4.0)  # 1 + 1.5 * 2
    torch.manual_seed(0)
    cfg = _config()
    actor = build_policy(cfg.policy_name, SPEC, cfg.policy)
    assert cfg.policy_name == "advantage_conditioned"
    obs = torch.randn(64, 3)
    with torch.no_grad():
        mu_null, _ = actor(obs)
        mu_good, log_std_good = actor(obs, torch.full((64,), IMPROVING))
        mu_bad, _ = actor(obs, torch.full((64,), NOT_IMPROVING))
    assert not torch.allclose(mu_null, mu_good) and not torch.allclose(mu_bad, mu_good)  # the token is read
    for w in (0.0, 1.0, 2.5):
        actor.guidance.fill_(w)
        actions, logp, values = actor.act(obs, deterministic=True)
        assert torch.allclose(actions, torch.tanh(mu_null + w * (mu_good - mu_null)), atol=1e-6), w
        assert torch.allclose(actor.guided(obs)[1], log_std_good)
        assert logp.shape == (64,) and (values == 0).all()
    sampled, _, _ = actor.act(obs, generator=torch.Generator().manual_seed(0))
    assert sampled.abs().max() <= 1 and not torch.allclose(sampled, actions)
    assert "guidance" in actor.state_dict()  # the weights carry w to every process that acts with them
    assert actor.env_actions(torch.ones(2, 1)).tolist() == [[2.0], [2.0]]


def _bandit(g: torch.Generator) -> dict:
    """A [1, 256] minibatch: action +0.9 earns 1, -0.9 earns 0, each half the time; every transition terminal."""
    obs = torch.randn(1, 256, 3, generator=g)
    good = torch.rand(1, 256, generator=g) < 0.5
    return {"obs": obs, "actions": torch.where(good, 0.9, -0.9).unsqueeze(-1), "rewards": good.float(),
            "next_obs": obs, "terminated": torch.ones(1, 256)}


def test_recap_update_conditions_the_policy_on_improvement():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    cfg = _config("{name: recap, learning_rate: 0.003, value_hidden_sizes: [32], value_warmup_updates: 30, "
                  "guidance: 1.0, positive_fraction: 0.4}")
    actor = build_policy(cfg.policy_name, SPEC, cfg.policy)
    algo = cfg.spec(actor, cfg, torch.Generator().manual_seed(0), env_spec=SPEC)
    assert actor.guidance.item() == 1.0 and algo.optimizer_steps == 0
    stats = algo.update(_bandit(g))
    assert "actor_loss" not in stats  # the value warms up alone
    # V fits the mean reward; the reward's variance (0.25) is what it cannot explain: the floor of v_loss
    for _ in range(150):
        stats = algo.update(_bandit(g))
    assert stats["v_loss"] < 0.35 and stats["indicator_rate"] == pytest.approx(0.4, abs=0.02), stats
    obs = torch.randn(512, 3, generator=g)
    with torch.no_grad():
        unconditional = torch.tanh(actor(obs)[0]).mean().item()
        guided = actor.act(obs, deterministic=True)[0].mean().item()
    assert guided > 0.5, (guided, unconditional)  # the improving action
    assert abs(unconditional) < 0.4, (guided, unconditional)  # the mixture, as behaviour cloning
    restored = cfg.spec(build_policy(cfg.policy_name, SPEC, cfg.policy), cfg, env_spec=SPEC)
    restored.load_state_dict(algo.state_dict())
    assert restored.optimizer_steps == algo.optimizer_steps == 151


def test_recap_config_errors_name_the_field():
    assert _config("{name: recap, guidance: 3}").algorithm.guidance == 3
    with pytest.raises(ConfigError, match="value_warmup_updates"):
        _config("{name: recap, total_updates: 100, value_warmup_updates: 100}")
    with pytest.raises(ConfigError, match="indicator_dropout"):
        _config("{name: recap, indicator_dropout: 0, guidance: 2}")
    with pytest.raises(ConfigError, match="positive_fraction"):
        _config("{name: recap, positive_fraction: 1.0}")
    with pytest.raises(ConfigError, match="advantage_conditioned"):  # a plain actor has no indicator input
        _config(policy="{name: squashed_gaussian}")
