"""Action chunks: the env steps a chunk of actions per decision, an episode that ends inside a chunk drops the
rest of it (never executes it on the next episode), and per-step rewards, done flags and lengths are exact; PPO's
action-level discounting; the VLA policy's chunk log-probs against a hand computation, in both heads."""

from __future__ import annotations

import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models import build_policy
from rlfabric.services.env.pool import EnvPool
from rlfabric.services.learner.algorithms.ppo import compute_gae, per_step_discounting
from tests.rendering_support import run_rendering_cases

EXECUTED: list[tuple[int, float]] = []  # (episode, action) of every primitive step any Countdown env ran


class Countdown(gym.Env):
    """Episodes of ``length`` steps; the reward of step t (1-based) is t; obs = [t, episode]."""

    def __init__(self, length: int = 6):
        self.length, self.t, self.episode = length, 0, -1
        self.observation_space = gym.spaces.Box(-1e9, 1e9, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1e9, 1e9, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.episode = 0, self.episode + 1
        return np.array([0, self.episode], np.float32), {}

    def step(self, action):
        EXECUTED.append((self.episode, float(action[0])))
        self.t += 1
        return np.array([self.t, self.episode], np.float32), float(self.t), self.t >= self.length, False, {}


gym.register("tests/Countdown-v0", entry_point=Countdown)


def pool(horizon: int, length: int = 6, num_envs: int = 1) -> EnvPool:
    cfg = RunConfig.model_validate({"env": {"id": "tests/Countdown-v0", "action_chunk": horizon, "num_envs": num_envs,
                                            "kwargs": {"length": length}}})
    return EnvPool(cfg.env, num_envs)


def test_auto_reset_inside_a_chunk_drops_the_rest_of_the_chunk():
    EXECUTED.clear()
    p = pool(horizon=4, length=6)
    assert p.act_spec["shape"] == [4, 1]
    p.reset(seed=0)
    chunk = np.array([[[10.0], [11.0], [12.0], [13.0]]], np.float32)
    first = p.step(0, chunk)
    assert first["reward"].tolist() == [1 + 2 + 3 + 4] and not first["terminated"][0]
    assert first["step_rewards"].tolist() == [[1, 2, 3, 4]] and first["step_valid"].tolist() == [[1, 1, 1, 1]]
    assert first["obs"].tolist() == [[4, 0]] and "episode_return" not in first

    second = p.step(0, chunk + 10)  # the episode ends at the chunk's 2nd action
    assert second["terminated"].tolist() == [True]
    assert second["reward"].tolist() == [5 + 6]
    assert second["step_rewards"].tolist() == [[5, 6, 0, 0]]
    assert second["step_dones"].tolist() == [[0, 1, 0, 0]] and second["step_valid"].tolist() == [[1, 1, 0, 0]]
    assert second["executed"].tolist() == [2]
    assert second["obs"].tolist() == [[0, 1]]  # the next episode, freshly reset: nothing of the chunk ran on it
    assert second["final_obs"].tolist() == [[6, 0]]  # where the episode ended
    assert second["episode_return"].tolist() == [21] and second["episode_length"].tolist() == [6]  # primitive steps

    third = p.step(0, chunk + 20)
    assert third["step_rewards"].tolist() == [[1, 2, 3, 4]]
    assert EXECUTED == [(0, 10), (0, 11), (0, 12), (0, 13), (0, 20), (0, 21), (1, 30), (1, 31), (1, 32), (1, 33)]
    assert p.env_steps == 10  # primitive steps, not decisions
    p.close()


def test_envs_of_a_batch_end_at_different_steps_of_the_same_chunk():
    p = pool(horizon=3, length=4, num_envs=3)
    p.reset(seed=0)
    p.envs[0].envs[1].unwrapped.t = 2  # env 1 is two steps further into its episode than envs 0 and 2
    out = p.step(0, np.zeros((3, 3, 1), np.float32))
    assert out["terminated"].tolist() == [False, True, False]
    assert out["step_valid"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert out["episode_length"].tolist() == [0, 2, 0]  # the primitive steps the pool ran of that episode
    out = p.step(0, np.zeros((3, 3, 1), np.float32))
    assert out["terminated"].tolist() == [True, False, True]
    assert out["step_valid"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert out["step_dones"].tolist() == [[1, 0, 0], [0, 0, 0], [1, 0, 0]]
    p.close()


def test_a_chunk_is_refused_with_the_wrong_horizon():
    p = pool(horizon=4)
    p.reset(seed=0)
    with pytest.raises(ValueError, match=r"expects \(1, 4, 1\)"):
        p.step(0, np.zeros((1, 3, 1), np.float32))
    p.close()


def test_action_level_discounting_is_exact_per_primitive_step():
    g = 0.9
    step_rewards = torch.tensor([[[1.0, 2.0, 3.0]], [[4.0, 5.0, 0.0]]])  # [T=2, N=1, H=3]
    valid = torch.tensor([[[1.0, 1.0, 1.0]], [[1.0, 1.0, 0.0]]])
    rewards = torch.tensor([[6.0], [9.0 + g * 7.0]])  # the 2nd decision was truncated: gamma * V(final)=7 folded in
    discounted, gamma = per_step_discounting(rewards, step_rewards, valid, g)
    assert torch.allclose(discounted, torch.tensor([[1 + 2 * g + 3 * g**2], [4 + 5 * g + g**2 * 7.0]]))
    assert torch.allclose(gamma, torch.tensor([[g**3], [g**2]]))
    # the same returns as GAE(lambda=1) over the primitive steps: 1 + g*2 + g^2*3 + g^3*(4 + g*5 + g^2*7)
    adv, ret = compute_gae(discounted, torch.zeros(2, 1), torch.tensor([[0.0], [1.0]]), torch.zeros(1), gamma, 1.0)
    want = 1 + g * 2 + g**2 * 3 + g**3 * (4 + g * 5 + g**2 * 7)
    assert math.isclose(float(ret[0, 0]), want, rel_tol=1e-6)


def vla(monkeypatch, head: str, level: str, horizon: int = 3, **extra):
    monkeypatch.setenv("MUJOCO_GL", "disable")  # nothing renders here; OSMesa would crash later transformers tests
    cfg = RunConfig.model_validate({
        "env": {"id": "rlfabric/ArmReachLang-v0", "action_chunk": horizon, "kwargs": {"image_size": 32}},
        "policy": {"name": "vla", "vla": {"head": head, "logprob_level": level, "width": 32, "heads": 2, "layers": 1,
                                          "bins": 7, "flow_steps": 3, "flow_noise": 0.4, **extra.get("vla", {})},
                   **({"cnn": extra["cnn"]} if "cnn" in extra else {})}})
    p = EnvPool(cfg.env, 3)
    # observations drawn from the task's spaces, not rendered (rendered runs: tests/e2e, in their own processes)
    space = p.single_observation_space
    space.seed(1)
    samples = [space.sample() for _ in range(3)]
    obs = {k: torch.as_tensor(np.stack([o[k] for o in samples])) for k in samples[0]}
    torch.manual_seed(0)
    policy = build_policy(cfg.policy_name, {"observation_space": p.obs_spec, "action_space": p.act_spec}, cfg.policy)
    for param in policy.parameters():  # away from the zero-initialised heads, so the check is not trivial
        param.data.add_(0.1 * torch.randn_like(param))
    return policy, obs, p


@pytest.mark.parametrize("level", ["chunk", "action", "token"])
def test_token_head_chunk_log_probs_match_a_hand_computation(monkeypatch, level):
    policy, obs, p = vla(monkeypatch, "tokens", level)
    raw, logp, _ = policy.act(obs, generator=torch.Generator().manual_seed(3))
    assert raw.shape == (3, 3, 2) and raw.dtype == torch.int64
    with torch.no_grad():  # by hand: softmax over bins of each query's output, the chosen bins' log-probs
        _, queries, _ = policy._run(obs)
        logits = queries @ policy.bin_head.weight.T + policy.bin_head.bias  # [B, H*A, bins]
        probs = logits.exp() / logits.exp().sum(-1, keepdim=True)
        chosen = probs.reshape(3, 3, 2, -1).gather(-1, raw.unsqueeze(-1)).squeeze(-1).log()  # [B, H, A]
    want = {"chunk": chosen.sum((1, 2)), "action": chosen.sum(2), "token": chosen}[level]
    assert logp.shape == want.shape and torch.allclose(logp, want, atol=1e-5)
    new_logp, entropy, _ = policy.evaluate(obs, raw)
    assert torch.allclose(new_logp, want, atol=1e-5) and entropy.shape == want.shape
    env_actions = policy.env_actions(raw)  # bin centres over [-1, 1]
    assert np.allclose(env_actions, np.linspace(-1, 1, 7)[raw.numpy()])
    p.close()


@pytest.mark.parametrize("level", ["chunk", "action", "token"])
def test_flow_head_chunk_log_probs_match_a_hand_computation(monkeypatch, level):
    policy, obs, p = vla(monkeypatch, "flow", level)
    chain, logp, _ = policy.act(obs, generator=torch.Generator().manual_seed(3))
    K, sigma = 3, 0.4
    assert chain.shape == (3, K + 1, 3, 2)
    with torch.no_grad():  # by hand: each Euler-Maruyama step of the Flow-SDE is N(mu_k, sigma^2 / K)
        context, _, _ = policy._run(obs)
        per_token = torch.zeros(3, 3, 2)
        for k in range(K):
            x = chain[:, k].reshape(3, 6)
            tau = k / K
            v = policy.velocity(x, torch.full((3,), tau), context)
            mu = x + (v - sigma**2 / (2 * (1 - tau)) * (x - tau * v)) / K
            var = sigma**2 / K
            x1 = chain[:, k + 1].reshape(3, 6)
            per_token += (-(x1 - mu) ** 2 / (2 * var) - 0.5 * math.log(2 * math.pi * var)).reshape(3, 3, 2)
    want = {"chunk": per_token.sum((1, 2)), "action": per_token.sum(2), "token": per_token}[level]
    assert logp.shape == want.shape and torch.allclose(logp, want, atol=1e-4)
    new_logp, _, _ = policy.evaluate(obs, chain)
    assert torch.allclose(new_logp, want, atol=1e-4)
    # the env executes the chain's last point, clipped to the bounds
    assert np.allclose(policy.env_actions(chain), chain[:, -1].clamp(-1, 1).numpy(), atol=1e-6)
    p.close()


def test_the_nature_encoder_summarises_the_image_in_a_few_tokens_that_both_heads_learn_through(monkeypatch):
    """encoder: nature -> image_tokens tokens from a Nature-CNN over the whole image; the policy's log-probs and
    the value (which reads the CNN's features beside the trunk's context) both send gradient into the CNN."""
    policy, obs, _ = vla(monkeypatch, "tokens", "action", vla={"encoder": "nature", "image_tokens": 2},
                         cnn={"channels": [8, 16], "kernels": [4, 3], "strides": [2, 1], "features": 24})
    tokens, pads, feats = policy._tokens(obs)
    text = obs["instruction"].shape[1]
    assert tokens.shape[1] == 1 + 2 + text + 1 and feats.shape == (3, 24)  # cls, image, instruction, proprio
    raw, _, _ = policy.act(obs, generator=torch.Generator().manual_seed(0))
    conv = policy.image_cnn.convs[0].weight
    for part in (0, 2):  # the policy's log-prob, the value
        policy.zero_grad()
        policy.evaluate(obs, raw)[part].sum().backward()
        assert conv.grad is not None and conv.grad.abs().sum() > 0
    assert policy.value_head[0].in_features == 32 + 24  # the trunk's context and the CNN's features



def test_a_chunk_renders_only_the_frame_it_returns_and_the_same_bytes():
    """ArmReach renders only the frame a chunk returns, and every observation is the same bytes as with every frame
    rendered (tests/unit/chunk_frames_cases.py, in a rendering process of its own)."""
    run_rendering_cases(Path(__file__).with_name("chunk_frames_cases.py"))
