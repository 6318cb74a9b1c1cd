"""FlowActor: a flow-matching policy for off-policy continuous control, sampled as a short stochastic sequence
(Zhang et al. 2025: velocity-reparameterised sequential modelling). K Euler steps carry noise x_0 to an action;
each step adds Gaussian noise, so the chain has a tractable log-likelihood, and the chain is differentiated end
to end (the reparameterisation a soft actor loss needs).

    x_0 ~ N(0, I)                                                    (the flow's prior; deterministic acting: x_0 = 0)
    gated velocity (Flow-G)   g_k = sigmoid(G(h, x_k, t_k)),  c_k = C(h, x_k, t_k),  v_k = g_k * (c_k - x_k)
    plain velocity            v_k = V(h, x_k, t_k)                      (velocity: plain)
    step                      x_{k+1} = x_k + v_k / K + s(h) / sqrt(K) * eps_k,   eps_k ~ N(0, I), t_k = k / K
    action                    a = tanh(x_K)
    log pi(a, x_1..x_K | s, x_0) = sum_k log N(x_{k+1}; x_k + v_k / K, s(h)^2 / K) - sum log(1 - tanh(x_K)^2)

h is the observation's features and s(h) = exp(clamp(S(h))) a state-dependent noise scale (the total injected
variance is s^2 over the chain, as a Gaussian actor's sigma^2). The gate makes each step a convex move of x toward
a candidate (a GRU's update), which keeps the gradient through K steps bounded: the reason the paper
reparameterises the velocity. x_0's density does not depend on the policy. Options: ``policy.flow_actor``
(services/policies/options.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models.encoders import box_bound, build_encoder
from rlfabric.services.core.models.mlp import mlp

LOG_STD_MIN, LOG_STD_MAX = -5.0, 1.0


def tanh_log_det(x: torch.Tensor) -> torch.Tensor:
    """sum over dims of log(1 - tanh(x)^2), in the stable form 2 (log 2 - x - softplus(-2x))."""
    return (2 * (math.log(2) - x - nn.functional.softplus(-2 * x))).sum(-1)


class FlowActor(nn.Module):
    serves = "flow_chain"
    has_value = False
    discrete = False

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        if action_space["kind"] != "box":
            raise ValueError(f"policy flow_actor needs a continuous (Box) action space, got {action_space['kind']}")
        opts = cfg.flow_actor
        self.steps, self.gated = opts.steps, opts.velocity == "gated"
        self.encoder = build_encoder(obs_space, cfg)
        self.obs_dim = self.encoder.out_dim
        self.action_shape = tuple(action_space["shape"])
        self.act_dim = int(np.prod(self.action_shape))
        inputs = [self.obs_dim + self.act_dim + 1, *cfg.hidden_sizes]
        # gated: one network gives the gate's and the candidate's pre-activations; plain: the velocity
        self.velocity = mlp(inputs, cfg.activation, (2 if self.gated else 1) * self.act_dim)
        self.log_std = mlp([self.obs_dim, *cfg.hidden_sizes], cfg.activation, self.act_dim)
        low, high = box_bound(action_space, "low"), box_bound(action_space, "high")
        self.register_buffer("scale", (high - low) / 2)
        self.register_buffer("center", (high + low) / 2)

    def step_velocity(self, h: torch.Tensor, x: torch.Tensor, t: float) -> torch.Tensor:
        out = self.velocity(torch.cat([h, x, torch.full_like(x[:, :1], t)], -1))
        if not self.gated:
            return out
        gate, candidate = out.chunk(2, -1)
        return torch.sigmoid(gate) * (candidate - x)

    def chain(self, obs: Any, noise: bool, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tanh(x_K), log pi of the chain): K steps from x_0, with step noise (noise) or without (the mode)."""
        h = self.encoder(obs)
        std = self.log_std(h).clamp(LOG_STD_MIN, LOG_STD_MAX).exp() / math.sqrt(self.steps)
        shape = (h.shape[0], self.act_dim)
        x = torch.randn(shape, generator=generator, device=h.device) if noise else h.new_zeros(shape)
        logp = h.new_zeros(h.shape[0])
        for k in range(self.steps):
            mean = x + self.step_velocity(h, x, k / self.steps) / self.steps
            eps = torch.randn(shape, generator=generator, device=h.device) if noise else torch.zeros_like(mean)
            x = mean + std * eps
            logp = logp + (-0.5 * eps.pow(2) - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)
        return torch.tanh(x), logp - tanh_log_det(x)

    def sample(self, obs: Any, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions in [-1, 1] and their chains' log-probs, differentiable through every step."""
        return self.chain(obs, True, generator)

    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """(squashed actions, log-probs, zeros): the rollout's acting interface. Deterministic: x_0 = 0, no step
        noise (the flow's ODE from the prior's mode)."""
        actions, logp = self.chain(obs, not deterministic, generator)
        return actions, logp, torch.zeros(actions.shape[0], device=actions.device)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Squashed actions in [-1, 1] rescaled to the Box bounds."""
        return (self.center + self.scale * actions).reshape(actions.shape[0], *self.action_shape).cpu().numpy()
