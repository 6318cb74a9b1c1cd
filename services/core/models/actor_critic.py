"""ActorCritic: the policy of on-policy algorithms. An observation encoder (flat vectors, a CNN over uint8 images,
or a Dict of both) shared by separate actor and critic MLP bodies (as SB3's policies), a categorical head for
Discrete actions and a diagonal Gaussian for Box actions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from rlfabric.services.core.models.encoders import box_bound, build_encoder
from rlfabric.services.core.models.mlp import mlp


class ActorCritic(nn.Module):
    has_value = True
    value_modules = ("vf_body", "vf_head")  # the critic's own weights (the encoder is shared)

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        self.encoder = build_encoder(obs_space, cfg)
        self.discrete = action_space["kind"] == "discrete"
        if not self.discrete and action_space["kind"] != "box":
            raise ValueError(f"ActorCritic acts in Discrete or Box action spaces, not {action_space['kind']}")
        self.action_shape = tuple(action_space["shape"])
        out = int(action_space["n"]) if self.discrete else int(np.prod(self.action_shape))
        self.act_dim = out
        sizes = [self.encoder.out_dim, *cfg.hidden_sizes]
        self.pi_body = mlp(sizes, cfg.activation)
        self.vf_body = mlp(sizes, cfg.activation)
        self.pi_head = nn.Linear(sizes[-1], out)
        self.vf_head = nn.Linear(sizes[-1], 1)
        self.log_std = None if self.discrete else nn.Parameter(torch.full((out,), cfg.log_std_init))
        if not self.discrete:
            self.register_buffer("low", box_bound(action_space, "low"))
            self.register_buffer("high", box_bound(action_space, "high"))
        if cfg.ortho_init:
            self._ortho_init()

    def _ortho_init(self) -> None:
        for body in (self.pi_body, self.vf_body, self.encoder):
            for m in body.modules():
                if isinstance(m, nn.Linear | nn.Conv2d):
                    nn.init.orthogonal_(m.weight, math.sqrt(2))
                    nn.init.zeros_(m.bias)
        nn.init.orthogonal_(self.pi_head.weight, 0.01)
        nn.init.zeros_(self.pi_head.bias)
        nn.init.orthogonal_(self.vf_head.weight, 1.0)
        nn.init.zeros_(self.vf_head.bias)

    def distribution(self, obs: Any) -> Categorical | Normal:
        logits = self.pi_head(self.pi_body(self.encoder(obs)))
        if self.discrete:
            return Categorical(logits=logits, validate_args=False)
        return Normal(logits, self.log_std.exp().expand_as(logits), validate_args=False)

    def value(self, obs: Any) -> torch.Tensor:
        return self.vf_head(self.vf_body(self.encoder(obs))).squeeze(-1)

    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """Actions (raw, unclipped), their log-probs and state values for a batch of observations.

        The hot path of acting: plain tensor math instead of torch.distributions objects (3x cheaper per call
        for small MLPs); ``evaluate`` uses the distributions and tests check both agree.
        """
        x = self.encoder(obs)
        out = self.pi_head(self.pi_body(x))
        value = self.vf_head(self.vf_body(x)).squeeze(-1)
        if self.discrete:
            log_probs = torch.log_softmax(out, -1)
            if deterministic:
                actions = out.argmax(-1)
            else:
                actions = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
            return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1), value
        if deterministic:
            actions = out
        else:
            actions = out + self.log_std.exp() * torch.randn(out.shape, generator=generator, device=out.device)
        z = (actions - out) / self.log_std.exp()
        logp = (-0.5 * z.pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return actions, logp, value

    def evaluate(self, obs: Any, actions: torch.Tensor):
        """Log-probs, entropy and values of given actions: what a policy-gradient update differentiates. Discrete actions take the
        log-softmax path of ``act`` (one normalisation instead of the distribution object's three)."""
        x = self.encoder(obs)
        if self.discrete:
            log_probs = torch.log_softmax(self.pi_head(self.pi_body(x)), -1)
            logp = log_probs.gather(-1, actions.reshape(-1, 1).long()).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            return logp, entropy, self.vf_head(self.vf_body(x)).squeeze(-1)
        mean = self.pi_head(self.pi_body(x))
        dist = Normal(mean, self.log_std.exp().expand_as(mean), validate_args=False)
        actions = actions.reshape(actions.shape[0], -1)
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), self.vf_head(self.vf_body(x)).squeeze(-1)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """What the env receives: integer ids, or Box actions clipped to bounds and reshaped."""
        if self.discrete:
            return actions.cpu().numpy().astype(np.int64)
        clipped = torch.maximum(torch.minimum(actions, self.high), self.low)
        return clipped.reshape(actions.shape[0], *self.action_shape).cpu().numpy()
