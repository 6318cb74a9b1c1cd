"""LatentNoisePolicy: acting in the initial noise of a frozen flow policy. A flow policy's denoising ODE is a
deterministic map from its initial noise w to an action chunk; a small actor that picks w per observation steers the
base without touching its weights (Wagenmaker et al. 2025, diffusion steering). Off-policy RL trains the small actor
with the latent as its action.

    w = noise_bound * tanh(u),  u ~ N(mu(s), sigma(s))          (a squashed-Gaussian actor over the latent)
    chunk = ODE_base(s, x_0 = w)                               (the base's deterministic decoding, frozen)
    recorded action  [tanh(u); chunk]                          (the env executes the chunk; critics read tanh(u))

Deterministic acting is the actor's mode, mu(s), decoded. The base is ``policy.latent_noise.base`` built from its own
section (``policy.vla`` with head flow, ``policy.pi0``); it must be a ``DecodesNoise`` (services/core/policy.py).
Its weights are frozen here: the algorithm loads them (from a checkpoint), and weight versions carry them with the
actor's, unchanged. Options: ``policy.latent_noise`` (services/policies/options.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models import build_policy
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.core.policy import DecodesNoise


class LatentNoisePolicy(nn.Module):
    serves = "steered_noise"
    has_value = False
    discrete = False

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        opts = cfg.latent_noise
        self.base = build_policy(opts.base, {"observation_space": obs_space, "action_space": action_space}, cfg)
        if not isinstance(self.base, DecodesNoise):
            raise ValueError(f"policy.latent_noise.base={opts.base!r} has no denoising ODE to steer (decode_noise). "
                             f"Fix: a flow policy: base: vla with policy.vla.head: flow, or base: pi0")
        self.base.requires_grad_(False)
        self.act_dim = self.base.act_dim
        self.bound = opts.noise_bound
        latent = {"kind": "box", "shape": [self.act_dim], "low": [-1.0] * self.act_dim, "high": [1.0] * self.act_dim}
        self.actor = SquashedGaussianActor(obs_space, latent, cfg)
        self.obs_dim = self.actor.obs_dim

    def train(self, mode: bool = True) -> LatentNoisePolicy:
        """The base stays in eval mode: it is frozen."""
        super().train(mode)
        self.base.eval()
        return self

    def sample(self, obs: Any, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised latents tanh(u) in [-1, 1] and their log-probs (what the soft actor loss needs)."""
        return self.actor.sample(obs, generator)

    def latent(self, actions: torch.Tensor) -> torch.Tensor:
        return actions.reshape(actions.shape[0], -1)[:, :self.act_dim]

    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """([latent; decoded chunk], the latent's log-probs, zeros)."""
        w, logp, zeros = self.actor.act(obs, deterministic, generator)
        chunk = self.base.decode_noise(obs, self.bound * w)
        return torch.cat([w, chunk.reshape(w.shape[0], -1).to(w.dtype)], -1), logp, zeros

    def random_actions(self, n: int, generator: torch.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Refused, loudly: a latent is decoded with the observation, which uniform warm-up actions lack."""
        raise ValueError("policy.name=latent_noise decodes its latent with the base policy and the observation, so it "
                         "draws no uniform random actions. Fix: explore with its own (untrained, wide) actor: an "
                         "algorithm with no random warm-up, or rlfabric collect without --random")

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """The decoded chunk of recorded actions, onto the env's bounds."""
        return self.base.to_env(actions.reshape(actions.shape[0], -1)[:, self.act_dim:])
