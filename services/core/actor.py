"""SquashedGaussianActor: the policy of off-policy continuous control (SAC): a diagonal Gaussian squashed by
tanh into [-1, 1], rescaled to the Box bounds only when handed to the env. Replay stores the squashed actions,
so critics and the learner's re-sampling live in one space.

    u ~ N(mu(s), sigma(s)),  a = tanh(u),  log pi(a|s) = log N(u) - sum log(1 - tanh(u)^2)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from services.core.config import PolicyConfig

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def mlp(sizes: list[int], activation: str, out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), ACTIVATIONS[activation]()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], out))


def squashed_log_prob(u: torch.Tensor, mu: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log pi(tanh(u)) for u drawn from N(mu, exp(log_std)), summed over action dims (numerically stable form of
    log(1 - tanh(u)^2) = 2 * (log 2 - u - softplus(-2u)))."""
    z = (u - mu) / log_std.exp()
    gauss = (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
    return gauss - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)


class SquashedGaussianActor(nn.Module):
    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: PolicyConfig):
        super().__init__()
        if action_space["kind"] != "box":
            raise ValueError(f"a squashed Gaussian actor (algorithm.name: sac) needs a continuous (Box) action "
                             f"space, got {action_space['kind']}; use algorithm.name: ppo for discrete actions")
        self.obs_dim = int(np.prod(obs_space["shape"])) if obs_space["shape"] else 1
        self.action_shape = tuple(action_space["shape"])
        self.act_dim = int(np.prod(self.action_shape))
        self.discrete = False
        self.net = mlp([self.obs_dim, *cfg.hidden_sizes], cfg.activation, 2 * self.act_dim)
        low = torch.tensor(action_space["low"], dtype=torch.float32).reshape(-1)
        high = torch.tensor(action_space["high"], dtype=torch.float32).reshape(-1)
        self.register_buffer("scale", (high - low) / 2)
        self.register_buffer("center", (high + low) / 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.net(obs.reshape(obs.shape[0], self.obs_dim).float()).chunk(2, -1)
        return mu, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def sample(self, obs: torch.Tensor, generator: torch.Generator | None = None):
        """Reparameterised squashed actions and their log-probs (differentiable: what SAC's actor loss needs)."""
        mu, log_std = self(obs)
        u = mu + log_std.exp() * torch.randn(mu.shape, generator=generator)
        return torch.tanh(u), squashed_log_prob(u, mu, log_std)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False, generator: torch.Generator | None = None):
        """(squashed actions, log-probs, zeros): the rollout's acting interface (no state value off-policy)."""
        mu, log_std = self(obs)
        u = mu if deterministic else mu + log_std.exp() * torch.randn(mu.shape, generator=generator)
        return torch.tanh(u), squashed_log_prob(u, mu, log_std), torch.zeros(mu.shape[0])

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Squashed actions in [-1, 1] rescaled to the Box bounds."""
        return (self.center + self.scale * actions).reshape(actions.shape[0], *self.action_shape).numpy()


def build_policy(config, env_spec: dict) -> nn.Module:
    """The acting policy of a run: what the learner publishes and the rollout loads."""
    if config.algorithm.name == "sac":
        return SquashedGaussianActor(env_spec["observation_space"], env_spec["action_space"], config.policy)
    from services.core.policy import ActorCritic

    return ActorCritic(env_spec["observation_space"], env_spec["action_space"], config.policy)
