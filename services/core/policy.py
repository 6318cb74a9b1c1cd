"""ActorCritic: the MLP policy learner and rollout share (separate actor and critic networks, like SB3's
MlpPolicy), with a categorical head for Discrete actions and a diagonal Gaussian for Box actions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from services.core.config import PolicyConfig

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}
# Argument validation in torch.distributions costs more than the math for small batches; our inputs are ours.
torch.distributions.Distribution.set_default_validate_args(False)


def _mlp(sizes: list[int], activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), ACTIVATIONS[activation]()]
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: PolicyConfig):
        super().__init__()
        self.obs_dim = int(np.prod(obs_space["shape"])) if obs_space["shape"] else 1
        self.discrete = action_space["kind"] == "discrete"
        self.action_shape = tuple(action_space["shape"])
        out = int(action_space["n"]) if self.discrete else int(np.prod(self.action_shape))
        sizes = [self.obs_dim, *cfg.hidden_sizes]
        self.pi_body = _mlp(sizes, cfg.activation)
        self.vf_body = _mlp(sizes, cfg.activation)
        self.pi_head = nn.Linear(sizes[-1], out)
        self.vf_head = nn.Linear(sizes[-1], 1)
        self.log_std = None if self.discrete else nn.Parameter(torch.full((out,), cfg.log_std_init))
        if not self.discrete:
            self.register_buffer("low", torch.tensor(action_space["low"], dtype=torch.float32))
            self.register_buffer("high", torch.tensor(action_space["high"], dtype=torch.float32))
        if cfg.ortho_init:
            self._ortho_init()

    def _ortho_init(self) -> None:
        for body in (self.pi_body, self.vf_body):
            for m in body:
                if isinstance(m, nn.Linear):
                    nn.init.orthogonal_(m.weight, math.sqrt(2))
                    nn.init.zeros_(m.bias)
        nn.init.orthogonal_(self.pi_head.weight, 0.01)
        nn.init.zeros_(self.pi_head.bias)
        nn.init.orthogonal_(self.vf_head.weight, 1.0)
        nn.init.zeros_(self.vf_head.bias)

    def _flat(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.reshape(obs.shape[0], self.obs_dim).float()

    def distribution(self, obs: torch.Tensor) -> Categorical | Normal:
        logits = self.pi_head(self.pi_body(self._flat(obs)))
        if self.discrete:
            return Categorical(logits=logits)
        return Normal(logits, self.log_std.exp().expand_as(logits))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.vf_head(self.vf_body(self._flat(obs))).squeeze(-1)

    def _logp(self, dist, actions: torch.Tensor) -> torch.Tensor:
        return dist.log_prob(actions) if self.discrete else dist.log_prob(actions).sum(-1)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False, generator: torch.Generator | None = None):
        """Actions (raw, unclipped), their log-probs and state values for a batch of observations.

        The hot path of acting: plain tensor math instead of torch.distributions objects (3x cheaper per call
        for small MLPs); ``evaluate`` uses the distributions and tests check both agree.
        """
        x = self._flat(obs)
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
            actions = out + self.log_std.exp() * torch.randn(out.shape, generator=generator)
        z = (actions - out) / self.log_std.exp()
        logp = (-0.5 * z.pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return actions, logp, value

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor):
        """Log-probs, entropy and values of given actions: what PPO differentiates. Discrete actions take the
        log-softmax path of ``act`` (one normalisation instead of the distribution object's three)."""
        if self.discrete:
            x = self._flat(obs)
            log_probs = torch.log_softmax(self.pi_head(self.pi_body(x)), -1)
            logp = log_probs.gather(-1, actions.reshape(-1, 1).long()).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            return logp, entropy, self.vf_head(self.vf_body(x)).squeeze(-1)
        dist = self.distribution(obs)
        if not self.discrete:
            actions = actions.reshape(actions.shape[0], -1)
        entropy = dist.entropy() if self.discrete else dist.entropy().sum(-1)
        return self._logp(dist, actions), entropy, self.value(obs)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """What the env receives: integer ids, or Box actions clipped to bounds and reshaped."""
        if self.discrete:
            return actions.numpy().astype(np.int64)
        clipped = torch.maximum(torch.minimum(actions, self.high), self.low)
        return clipped.reshape(actions.shape[0], *self.action_shape).numpy()
