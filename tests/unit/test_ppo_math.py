"""PPO's math against values computed by hand."""

import math

import pytest
import torch

from rlfabric.services.core.algorithm import ALGORITHMS, algorithm
from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models import ActorCritic
from rlfabric.services.learner.algorithms.ppo import PPO, compute_gae, ppo_loss


def test_gae_matches_hand_computation():
    # one env, three steps, episode ends after step 1 (index 1)
    r = torch.tensor([[1.0], [2.0], [3.0]])
    v = torch.tensor([[0.5], [1.0], [1.5]])
    d = torch.tensor([[0.0], [1.0], [0.0]])
    last = torch.tensor([2.0])
    g, lam = 0.9, 0.8
    # by hand:
    d2 = 3 + g * 2.0 - 1.5           # t=2 bootstraps from last value: 3.3
    a2 = d2                           # 3.3
    d1 = 2 + 0 - 1.0                  # t=1 is terminal: 1.0
    a1 = d1                           # no carry across the episode end
    d0 = 1 + g * 1.0 - 0.5            # 1.4
    a0 = d0 + g * lam * a1            # 1.4 + 0.72 = 2.12
    adv, ret = compute_gae(r, v, d, last, g, lam)
    assert adv.squeeze(-1).tolist() == pytest.approx([a0, a1, a2])
    assert ret.squeeze(-1).tolist() == pytest.approx([a0 + 0.5, a1 + 1.0, a2 + 1.5])


def test_gae_lambda_one_is_discounted_return_minus_value():
    r = torch.ones(4, 2)
    v = torch.zeros(4, 2)
    adv, _ = compute_gae(r, v, torch.zeros(4, 2), torch.zeros(2), 0.5, 1.0)
    assert adv[0].tolist() == pytest.approx([1 + 0.5 + 0.25 + 0.125] * 2)


def test_clipped_surrogate_matches_hand_values():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.8, 0.8, 0.3, 0.3]))   # ratios 1.6, 1.6, 0.6, 0.6
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    z = torch.zeros(4)
    loss, stats = ppo_loss(new, old, adv, z, z, z, torch.zeros(4), clip=0.2, clip_vf=None, vf_coef=0.0,
                           ent_coef=0.0)
    # min(r*A, clip(r)*A): A>0,r=1.6 -> 1.2 ; A<0,r=1.6 -> -1.6 ; A>0,r=0.6 -> 0.6 ; A<0,r=0.6 -> -0.8
    expected = -(1.2 - 1.6 + 0.6 - 0.8) / 4
    assert loss.item() == pytest.approx(expected)
    assert stats["clip_fraction"].item() == pytest.approx(1.0)
    ratio = torch.tensor([1.6, 1.6, 0.6, 0.6])
    assert stats["approx_kl"].item() == pytest.approx(((ratio - 1) - ratio.log()).mean().item(), rel=1e-5)


def test_value_clipping_and_entropy_terms():
    z = torch.zeros(2)
    new_v, old_v, ret = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([3.0, 1.0])
    # unclipped errors: (2-3)^2=1, (0-1)^2=1 ; clipped (0.5 max move): (0.5-3)^2=6.25, (0-1)^2=1 -> max: 6.25, 1
    loss, stats = ppo_loss(z, z, z, new_v, old_v, ret, torch.tensor([0.7, 0.3]), clip=0.2, clip_vf=0.5,
                           vf_coef=0.5, ent_coef=0.1)
    assert stats["value_loss"].item() == pytest.approx((6.25 + 1) / 2)
    assert loss.item() == pytest.approx(0.5 * 3.625 - 0.1 * 0.5)


SPACES = {
    "discrete": {"kind": "discrete", "shape": [], "dtype": "int64", "n": 3},
    "box": {"kind": "box", "shape": [2], "dtype": "float32", "low": [-1, -1], "high": [1, 1]},
}


@pytest.mark.parametrize("kind", ["discrete", "box"])
def test_act_fast_path_agrees_with_distributions(kind):
    torch.manual_seed(0)
    policy = ActorCritic({"kind": "box", "shape": [4]}, SPACES[kind], RunConfig().policy)
    with torch.no_grad():
        policy.pi_head.weight.normal_()
    obs = torch.randn(16, 4)
    actions, logp, value = policy.act(obs, generator=torch.Generator().manual_seed(1))
    logp2, entropy, value2 = policy.evaluate(obs, actions)
    assert torch.allclose(logp, logp2, atol=1e-5) and torch.allclose(value, value2)
    det, _, _ = policy.act(obs, deterministic=True)
    if kind == "discrete":
        assert torch.equal(det, policy.distribution(obs).probs.argmax(-1))
    else:
        assert torch.allclose(det, policy.distribution(obs).mean)
        assert policy.env_actions(det * 100).max() <= 1.0  # clipped to the Box bounds


@pytest.mark.parametrize("n", [2, 5])
def test_discrete_evaluate_matches_the_categorical_distribution(n):
    """evaluate's log-softmax path (one normalisation) computes what the Categorical distribution does."""
    torch.manual_seed(0)
    policy = ActorCritic({"kind": "box", "shape": [4]}, {"kind": "discrete", "n": n, "shape": []}, RunConfig().policy)
    obs = torch.randn(300, 4) * 3
    actions = torch.randint(0, n, (300,))
    logp, entropy, value = policy.evaluate(obs, actions)
    dist = policy.distribution(obs)
    assert torch.allclose(logp, dist.log_prob(actions), atol=1e-6)
    assert torch.allclose(entropy, dist.entropy(), atol=1e-6)
    assert torch.allclose(value, policy.value(obs))


def test_update_moves_policy_towards_advantageous_actions():
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"algorithm": {"name": "ppo", "n_epochs": 10, "batch_size": 64,
                                                  "lr_schedule": "constant"}})
    policy = ActorCritic({"kind": "box", "shape": [4]}, SPACES["discrete"], cfg.policy)
    algo = cfg.spec(policy, cfg, torch.Generator().manual_seed(0))
    assert isinstance(algo, PPO) and "ppo" in ALGORITHMS
    T, N = 16, 8
    obs = torch.randn(T, N, 4)
    actions = torch.randint(0, 3, (T, N))
    with torch.no_grad():
        logp, _, values = policy.evaluate(obs.reshape(-1, 4), actions.reshape(-1))
    rewards = (actions == 2).float()  # action 2 is the good one
    batch = {"obs": obs, "actions": actions, "logp": logp.reshape(T, N), "values": values.reshape(T, N),
             "rewards": rewards, "dones": torch.ones(T, N), "last_values": torch.zeros(N)}
    before = policy.distribution(obs.reshape(-1, 4)).probs[:, 2].mean().item()
    stats = algo.update(batch)
    after = policy.distribution(obs.reshape(-1, 4)).probs[:, 2].mean().item()
    assert after > before + 0.02  # clipping bounds how far one update may move (ratio within 1 +- 0.2)
    assert after < before * 1.25
    assert algo.optimizer_steps == 10 * math.ceil(T * N / 64)
    assert algo.env_steps == T * N and stats["learning_rate"] == pytest.approx(1e-3)
    state = algo.state_dict()
    fresh = cfg.spec(policy, cfg)
    fresh.load_state_dict(state)
    assert fresh.optimizer_steps == algo.optimizer_steps


def test_linear_schedules_follow_env_steps():
    cfg = RunConfig.model_validate({"train": {"total_env_steps": 1024}})
    policy = ActorCritic({"kind": "box", "shape": [4]}, SPACES["discrete"], cfg.policy)
    algo = PPO(policy, cfg)
    T, N = 32, 8
    batch = {"obs": torch.randn(T, N, 4), "actions": torch.zeros(T, N, dtype=torch.long),
             "logp": torch.full((T, N), -1.1), "values": torch.zeros(T, N), "rewards": torch.ones(T, N),
             "dones": torch.zeros(T, N), "last_values": torch.zeros(N)}
    stats = algo.update(batch)  # 256 of 1024 steps consumed: 75% remaining
    assert stats["learning_rate"] == pytest.approx(0.75e-3) and stats["clip_range"] == pytest.approx(0.15)


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="not registered"):
        algorithm("nope")


def test_critic_warmup_trains_the_value_alone_then_the_policy():
    """A warm-started actor keeps its behaviour while its new critic learns; then PPO moves it. The first
    minibatch also reports how far the learner's log-probs are from the rollout's (0: the same weights)."""
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"algorithm": {"name": "ppo", "n_epochs": 10, "batch_size": 64,
                                                  "lr_schedule": "constant", "critic_warmup": 1}})
    policy = ActorCritic({"kind": "box", "shape": [4]}, SPACES["discrete"], cfg.policy)
    algo = cfg.spec(policy, cfg, torch.Generator().manual_seed(0))
    T, N = 16, 8
    obs = torch.randn(T, N, 4)
    actions = torch.randint(0, 3, (T, N))

    def batch():
        with torch.no_grad():
            logp, _, values = policy.evaluate(obs.reshape(-1, 4), actions.reshape(-1))
        return {"obs": obs, "actions": actions, "logp": logp.reshape(T, N), "values": values.reshape(T, N),
                "rewards": (actions == 2).float(), "dones": torch.ones(T, N), "last_values": torch.zeros(N)}

    def probs():
        return policy.distribution(obs.reshape(-1, 4)).probs[:, 2].mean().item()

    before, value_before = probs(), policy.value(obs.reshape(-1, 4)).detach()
    stats = algo.update(batch())
    assert stats["critic_warmup"] == 1.0 and stats["logprob_mismatch_abs"] < 1e-6
    assert probs() == pytest.approx(before, abs=1e-6)  # the actor did not move
    assert (policy.value(obs.reshape(-1, 4)).detach() - value_before).abs().mean() > 1e-3
    fresh = cfg.spec(policy, cfg)
    fresh.load_state_dict(algo.state_dict())  # a resumed run does not warm up again
    stats = fresh.update(batch())
    assert stats["critic_warmup"] == 0.0 and probs() > before + 0.02


def test_value_learning_rate_steps_the_critic_at_its_own_rate():
    """A fresh critic beside a warm-started actor: the critic's own weights (vf_body, vf_head) take Adam steps of
    value_learning_rate, the rest of learning_rate; lr_schedule scales both."""
    cfg = RunConfig.model_validate({"algorithm": {"name": "ppo", "n_epochs": 1, "batch_size": 256,
                                                  "learning_rate": 1e-5, "value_learning_rate": 1e-3},
                                    "train": {"total_env_steps": 1024}})
    policy = ActorCritic({"kind": "box", "shape": [4]}, SPACES["discrete"], cfg.policy)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    algo = PPO(policy, cfg)
    T, N = 32, 8
    batch = {"obs": torch.randn(T, N, 4), "actions": torch.zeros(T, N, dtype=torch.long),
             "logp": torch.full((T, N), -1.1), "values": torch.zeros(T, N), "rewards": torch.ones(T, N),
             "dones": torch.zeros(T, N), "last_values": torch.zeros(N)}
    algo.update(batch)  # one Adam step: each weight moves by about its group's step size
    assert [g["lr"] for g in algo.optimizer.param_groups] == pytest.approx([0.75e-5, 0.75e-3])
    moved = {k: (v - start[k]).abs().max().item() for k, v in policy.state_dict().items()}
    assert moved["vf_head.weight"] == pytest.approx(0.75e-3, rel=0.05)
    assert moved["pi_head.weight"] == pytest.approx(0.75e-5, rel=0.05)
    assert moved["pi_body.0.weight"] < 1e-4 and moved["vf_body.0.weight"] > 1e-4
    fresh = PPO(policy, cfg)
    fresh.load_state_dict(algo.state_dict())  # a checkpoint of the two groups resumes
    assert len(fresh.optimizer.param_groups) == 2
