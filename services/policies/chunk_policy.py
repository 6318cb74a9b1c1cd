"""ChunkPolicy: what every action-chunk policy (vla, pi0, vla_tokens) shares. Its actions are a Box of H steps of
A dimensions (env.action_chunk; a single action is H = 1), worked in [-1, 1] per dimension and mapped onto the
bounds for the env, and its per-token log-probs [B, H, A] reduce to the configured level: one per chunk, per
action or per token, which is the shape of ``logp`` an update takes ratios of."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models.encoders import box_bound


class ChunkPolicy(nn.Module):
    has_value = True
    value_modules = ("value_head",)  # the critic's own weights (an algorithm may step them at their own rate)
    serves = "actor_critic"
    discrete = False

    def init_chunks(self, action_space: dict[str, Any], policy: str, level: str) -> None:
        if action_space["kind"] != "box" or len(action_space["shape"]) not in (1, 2):
            raise ValueError(f"policy.name={policy} acts in Box action spaces of shape [A] or [H, A] (a chunk of H "
                             f"actions: env.action_chunk), not {action_space['kind']} {action_space['shape']}")
        self.action_shape = tuple(action_space["shape"])
        self.H, self.A = (1, *self.action_shape) if len(self.action_shape) == 1 else self.action_shape
        self.act_dim = self.H * self.A  # a chunk's width flat (a flow policy's initial noise too)
        self.level = level
        self.register_buffer("low", box_bound(action_space, "low").reshape(self.H, self.A))
        self.register_buffer("high", box_bound(action_space, "high").reshape(self.H, self.A))

    def reduce(self, per_token: torch.Tensor) -> torch.Tensor:
        """[B, H, A] -> the configured log-prob level."""
        if self.level == "token":
            return per_token
        if self.level == "action":
            return per_token.sum(-1)
        return per_token.sum((-1, -2))

    def to_unit(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions [B, H, A] (e.g. demonstrations) onto [-1, 1], clipped."""
        unit = 2.0 * (actions.reshape(-1, self.H, self.A).float() - self.low) / (self.high - self.low) - 1.0
        return unit.clamp(-1.0, 1.0)

    def to_env(self, unit: torch.Tensor) -> np.ndarray:
        """Chunks in [-1, 1] [B, H, A] onto the bounds, in the env's action shape."""
        chunk = self.low + (unit.reshape(-1, self.H, self.A) + 1.0) * 0.5 * (self.high - self.low)
        return chunk.reshape(-1, *self.action_shape).cpu().numpy()

    def random_actions(self, n: int, generator: torch.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``n`` uniform chunks over the bounds (``rlfabric collect --random``), as (recorded, executed) actions:
        both the chunk the env executes, as the scripted expert's are recorded, since a chunk policy's own form (a
        denoising chain, token ids) has no uniform counterpart."""
        unit = torch.rand((n, self.H, self.A), generator=generator, device=self.low.device) * 2 - 1
        chunk = self.to_env(unit)
        return chunk, chunk
