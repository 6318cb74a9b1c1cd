"""Critics of off-policy and offline algorithms: Q(s, a) and V(s), each with the observation encoder a policy would
use for the same space (vectors flattened, images through a CNN, Dicts concatenated), and an ensemble of N
Q-functions evaluated as one batched matmul per layer, optionally with LayerNorm."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from rlfabric.services.core.models.encoders import build_encoder
from rlfabric.services.core.models.mlp import mlp


@contextmanager
def frozen(*critics: nn.Module) -> Iterator[None]:
    """Critics whose weights take no gradient inside the block: the actor's loss climbs Q through the actions only.
    Its backward then skips the critics' weight gradients, which the critics' next step would zero anyway (about a
    third of that backward on the small MLPs of the off-policy examples)."""
    params = [p for c in critics for p in c.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


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


class LinearEnsemble(nn.Module):
    """N independent linear layers applied together: x [N, B, in] -> [N, B, out] (one ``baddbmm``). Each member is
    initialised as ``nn.Linear`` initialises itself: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in))."""

    def __init__(self, n: int, in_features: int, out_features: int):
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(n, in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n, 1, out_features).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class LayerNormEnsemble(nn.Module):
    """LayerNorm over the features of each member's rows, with each member's own gain and bias: [N, B, F]."""

    def __init__(self, n: int, features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n, 1, features))
        self.bias = nn.Parameter(torch.zeros(n, 1, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight + self.bias


class QEnsemble(nn.Module):
    """N critics Q_1..Q_N(s, a) -> [N, B]. Each member is the MLP of ``hidden_sizes`` (default the policy's) on the
    encoded observation with the action appended, ReLU as QNetwork; with ``layer_norm`` every hidden layer is
    Linear -> LayerNorm -> ReLU (it keeps Q bounded on actions the data does not cover). The members share one
    observation encoder (parameter-free for vectors; for images one CNN that every member's loss trains, as DrQ's
    twin critics share theirs) and nothing else."""

    def __init__(self, obs_space: dict[str, Any], act_dim: int, policy_cfg: Any, n: int = 2,
                 hidden_sizes: list[int] | None = None, layer_norm: bool = False):
        super().__init__()
        if n < 1:
            raise ValueError(f"a critic ensemble needs n >= 1 members, got {n}")
        self.n = n
        self.encoder = build_encoder(obs_space, policy_cfg)
        sizes = [self.encoder.out_dim + act_dim, *(hidden_sizes or policy_cfg.hidden_sizes)]
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:], strict=True):
            layers.append(LinearEnsemble(n, a, b))
            if layer_norm:
                layers.append(LayerNormEnsemble(n, b))
            layers.append(nn.ReLU())
        layers.append(LinearEnsemble(n, sizes[-1], 1))
        self.q = nn.Sequential(*layers)

    def forward(self, obs: Any, actions: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.encoder(obs), actions.reshape(actions.shape[0], -1)], -1)
        return self.q(x.unsqueeze(0).expand(self.n, *x.shape)).squeeze(-1)
