"""SquashedGaussianActor: the policy of off-policy and offline continuous control: a diagonal Gaussian squashed by
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

from rlfabric.services.core.models.encoders import box_bound, build_encoder
from rlfabric.services.core.models.mlp import mlp

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0


def squashed_log_prob(u: torch.Tensor, mu: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log pi(tanh(u)) for u drawn from N(mu, exp(log_std)), summed over action dims (numerically stable form of
    log(1 - tanh(u)^2) = 2 * (log 2 - u - softplus(-2u)))."""
    z = (u - mu) / log_std.exp()
    gauss = (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
    return gauss - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)


class SquashedGaussianActor(nn.Module):
    has_value = False

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        if action_space["kind"] != "box":
            raise ValueError(f"a squashed Gaussian actor needs a continuous (Box) action space, got "
                             f"{action_space['kind']}; pick an algorithm whose policy acts in discrete spaces")
        self.encoder = build_encoder(obs_space, cfg)
        self.obs_dim = self.encoder.out_dim
        self.action_shape = tuple(action_space["shape"])
        self.act_dim = int(np.prod(self.action_shape))
        self.discrete = False
        self.net = mlp([self.obs_dim, *cfg.hidden_sizes], cfg.activation, 2 * self.act_dim)
        low = box_bound(action_space, "low")
        high = box_bound(action_space, "high")
        self.register_buffer("scale", (high - low) / 2)
        self.register_buffer("center", (high + low) / 2)

    def forward(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.net(self.encoder(obs)).chunk(2, -1)
        return mu, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    @staticmethod
    def _noise(mu: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Standard normal noise (the generator lives on the model's device)."""
        return torch.randn(mu.shape, generator=generator, device=mu.device)

    def sample(self, obs: Any, generator: torch.Generator | None = None):
        """Reparameterised squashed actions and their log-probs (differentiable: what a soft actor loss needs)."""
        mu, log_std = self(obs)
        u = mu + log_std.exp() * self._noise(mu, generator)
        return torch.tanh(u), squashed_log_prob(u, mu, log_std)

    def log_prob(self, obs: Any, actions: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """log pi(a|s) of given squashed actions (behaviour cloning, advantage-weighted regression)."""
        mu, log_std = self(obs)
        a = actions.reshape(actions.shape[0], -1).clamp(-1 + eps, 1 - eps)
        return squashed_log_prob(torch.atanh(a), mu, log_std)

    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """(squashed actions, log-probs, zeros): the rollout's acting interface (no state value here)."""
        mu, log_std = self(obs)
        u = mu if deterministic else mu + log_std.exp() * self._noise(mu, generator)
        return torch.tanh(u), squashed_log_prob(u, mu, log_std), torch.zeros(mu.shape[0], device=mu.device)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Squashed actions in [-1, 1] rescaled to the Box bounds."""
        return (self.center + self.scale * actions).reshape(actions.shape[0], *self.action_shape).cpu().numpy()
