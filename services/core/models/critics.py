"""Critics of off-policy and offline algorithms: Q(s, a) and V(s), each with the observation encoder a policy would
use for the same space (vectors flattened, images through a CNN, Dicts concatenated)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfabric.services.core.models.encoders import build_encoder
from rlfabric.services.core.models.mlp import mlp


@torch.no_grad()
def soft_update(target: nn.Module, source: nn.Module, rate: float) -> None:
    """Polyak averaging of target networks: target <- rate * source + (1 - rate) * target."""
    for t, s in zip(target.parameters(), source.parameters(), strict=True):
        t.lerp_(s, rate)


class QNetwork(nn.Module):
    """Q(s, a): the encoded observation with the action appended, through an MLP."""

    def __init__(self, obs_space: dict[str, Any], act_dim: int, policy_cfg: Any):
        super().__init__()
        self.encoder = build_encoder(obs_space, policy_cfg)
        self.q = mlp([self.encoder.out_dim + act_dim, *policy_cfg.hidden_sizes], "relu", 1)

    def forward(self, obs: Any, actions: torch.Tensor) -> torch.Tensor:
        return self.q(torch.cat([self.encoder(obs), actions.reshape(actions.shape[0], -1)], -1)).squeeze(-1)


class ValueNetwork(nn.Module):
    """V(s): the encoded observation through an MLP."""

    def __init__(self, obs_space: dict[str, Any], policy_cfg: Any):
        super().__init__()
        self.encoder = build_encoder(obs_space, policy_cfg)
        self.v = mlp([self.encoder.out_dim, *policy_cfg.hidden_sizes], "relu", 1)

    def forward(self, obs: Any) -> torch.Tensor:
        return self.v(self.encoder(obs)).squeeze(-1)
