"""AdvantageConditionedActor: a squashed-Gaussian policy pi(a | s, I) that also reads an improvement indicator I (a
binarised advantage label, from the algorithm that trains it). One network carries the conditional and the
unconditional policy: the indicator is a token, 0 (this action did not improve on the data's average), 1 (it did)
or NULL (unknown, the unconditional policy), given to the MLP as a one-hot beside the observation's features.

    u ~ N(mu(s, I), sigma(s, I)),  a = tanh(u),  log pi(a|s, I) = log N(u) - sum log(1 - tanh(u)^2)

Acting (the rollout, ``rlfabric eval``) uses classifier-free guidance toward I = 1, on the pre-tanh mean:

    mu_w(s) = mu(s, NULL) + w * (mu(s, 1) - mu(s, NULL)),   sigma_w(s) = sigma(s, 1),   a = tanh(mu_w + sigma_w * eps)

w = ``guidance``, a buffer of the module (so weight versions and checkpoints carry it and every process that acts
with the weights acts with the same w; the algorithm that trains the policy sets it from its config). w = 0 acts
unconditionally (behaviour cloning of all the data), w = 1 acts as pi(a | s, I = 1), w > 1 extrapolates past it
(it sharpens the policy toward actions more likely to be improvements: pi_null * (pi_1 / pi_null)^w). Actions and
replay live in [-1, 1] as the squashed-Gaussian actor's do; ``env_actions`` rescales to the Box bounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models.encoders import box_bound, build_encoder
from rlfabric.services.core.models.mlp import mlp
from rlfabric.services.core.models.squashed_gaussian import LOG_STD_MAX, LOG_STD_MIN, squashed_log_prob

NOT_IMPROVING, IMPROVING, NULL = 0, 1, 2  # indicator tokens (NULL: no indicator, the unconditional policy)
TOKENS = 3


def guided_mean(mu_null: torch.Tensor, mu_good: torch.Tensor, w: float | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance of a Gaussian's mean: mu_null + w * (mu_good - mu_null)."""
    return mu_null + w * (mu_good - mu_null)


class AdvantageConditionedActor(nn.Module):
    serves = "advantage_conditioned"
    has_value = False

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        if action_space["kind"] != "box":
            raise ValueError(f"an advantage-conditioned (squashed Gaussian) actor needs a continuous (Box) action "
                             f"space, got {action_space['kind']}")
        self.encoder = build_encoder(obs_space, cfg)
        self.obs_dim = self.encoder.out_dim
        self.action_shape = tuple(action_space["shape"])
        self.act_dim = int(np.prod(self.action_shape))
        self.discrete = False
        self.net = mlp([self.obs_dim + TOKENS, *cfg.hidden_sizes], cfg.activation, 2 * self.act_dim)
        self.register_buffer("scale", (box_bound(action_space, "high") - box_bound(action_space, "low")) / 2)
        self.register_buffer("center", (box_bound(action_space, "high") + box_bound(action_space, "low")) / 2)
        self.register_buffer("guidance", torch.tensor(1.0))  # w of acting; set by the training algorithm

    def _heads(self, features: torch.Tensor, indicator: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        onehot = nn.functional.one_hot(indicator.long(), TOKENS).to(features.dtype)
        mu, log_std = self.net(torch.cat([features, onehot], -1)).chunk(2, -1)
        return mu, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def forward(self, obs: Any, indicator: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, log_std) of pi(. | s, I) before tanh; ``indicator`` None is the NULL token for every row."""
        features = self.encoder(obs)
        if indicator is None:
            indicator = torch.full(features.shape[:1], NULL, dtype=torch.long, device=features.device)
        return self._heads(features, indicator)

    def log_prob(self, obs: Any, actions: torch.Tensor, indicator: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
        """log pi(a | s, I) of given squashed actions (I None: the unconditional policy), differentiable."""
        mu, log_std = self(obs, indicator)
        a = actions.reshape(actions.shape[0], -1).clamp(-1 + eps, 1 - eps)
        return squashed_log_prob(torch.atanh(a), mu, log_std)

    def guided(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu_w, log_std) of the guided policy toward I = 1 (module docstring), before tanh."""
        features = self.encoder(obs)
        rows = features.shape[0]
        tokens = torch.cat([torch.full((rows,), NULL, dtype=torch.long, device=features.device),
                            torch.full((rows,), IMPROVING, dtype=torch.long, device=features.device)])
        mu, log_std = self._heads(torch.cat([features, features]), tokens)  # one pass for both
        return guided_mean(mu[:rows], mu[rows:], self.guidance), log_std[rows:]

    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None):
        """(squashed actions, their log-probs under the guided policy, zeros): the rollout's acting interface."""
        mu, log_std = self.guided(obs)
        u = mu if deterministic else mu + log_std.exp() * torch.randn(mu.shape, generator=generator, device=mu.device)
        return torch.tanh(u), squashed_log_prob(u, mu, log_std), torch.zeros(mu.shape[0], device=mu.device)

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """Squashed actions in [-1, 1] rescaled to the Box bounds."""
        return (self.center + self.scale * actions).reshape(actions.shape[0], *self.action_shape).cpu().numpy()
