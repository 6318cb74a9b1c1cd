"""Batch Renormalization (Ioffe 2017), and a batch-renormalised Q-network (Bhatt et al. 2024's critic). Torch
has BatchNorm but no BatchRenorm.

In training mode a feature x of a batch with mean mu_B and std sigma_B = sqrt(var_B + eps) is normalised as

    x_hat = (x - mu_B) / sigma_B * r + d,   y = weight * x_hat + bias
    r = clip(sigma_B / sigma, 1 / r_max, r_max),  d = clip((mu_B - mu) / sigma, -d_max, d_max)   (no gradient)

with mu, sigma = sqrt(var + eps) the running statistics, updated after the batch's normalisation by
mu <- momentum * mu + (1 - momentum) * mu_B (and var likewise with var_B). Warm-up: for the first
``warmup_steps`` training forwards r_max = 1 and d_max = 0, so r = 1, d = 0 and the layer is plain BatchNorm
(the running statistics are not yet worth renormalising toward); after it, r and d pull every batch's
normalisation toward the running statistics. In eval mode: x_hat = (x - mu) / sigma.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfabric.services.core.models.encoders import build_encoder


class BatchRenorm(nn.Module):
    """Batch Renormalization over the last dimension of [B, features] inputs (see the module docstring)."""

    def __init__(self, features: int, momentum: float = 0.99, eps: float = 1e-3, r_max: float = 3.0,
                 d_max: float = 5.0, warmup_steps: int = 100_000):
        super().__init__()
        self.momentum, self.eps, self.r_max, self.d_max, self.warmup_steps = momentum, eps, r_max, d_max, warmup_steps
        self.weight = nn.Parameter(torch.ones(features))
        self.bias = nn.Parameter(torch.zeros(features))
        self.register_buffer("running_mean", torch.zeros(features))
        self.register_buffer("running_var", torch.ones(features))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # training forwards so far

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return (x - self.running_mean) / (self.running_var + self.eps).sqrt() * self.weight + self.bias
        mean, var = x.mean(0), x.var(0, unbiased=False)
        std = (var + self.eps).sqrt()
        warm = bool(self.steps >= self.warmup_steps)
        r_max, d_max = (self.r_max, self.d_max) if warm else (1.0, 0.0)
        with torch.no_grad():
            running_std = (self.running_var + self.eps).sqrt()
            r = (std / running_std).clamp(1.0 / r_max, r_max)
            d = ((mean - self.running_mean) / running_std).clamp(-d_max, d_max)
            self.running_mean.lerp_(mean, 1.0 - self.momentum)
            self.running_var.lerp_(var, 1.0 - self.momentum)
            self.steps += 1
        return ((x - mean) / std * r + d) * self.weight + self.bias

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, momentum={self.momentum}, r_max={self.r_max}, d_max={self.d_max}, "
                f"warmup_steps={self.warmup_steps}")


class RenormQNetwork(nn.Module):
    """Q(s, a) with BatchRenorm on the input and after each hidden layer's activation, as Bhatt et al. 2024:
    [encoder(s), a] -> BRN -> (Linear -> ReLU -> BRN) x len(hidden) -> Linear -> Q."""

    def __init__(self, obs_space: dict[str, Any], act_dim: int, policy_cfg: Any, hidden: list[int], **brn: Any):
        super().__init__()
        self.encoder = build_encoder(obs_space, policy_cfg)
        width = self.encoder.out_dim + act_dim
        layers: list[nn.Module] = [BatchRenorm(width, **brn)]
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), BatchRenorm(h, **brn)]
            width = h
        layers.append(nn.Linear(width, 1))
        self.q = nn.Sequential(*layers)

    def forward(self, obs: Any, actions: torch.Tensor) -> torch.Tensor:
        return self.q(torch.cat([self.encoder(obs), actions.reshape(actions.shape[0], -1)], -1)).squeeze(-1)
