"""DAPO (Yu et al. 2025): GRPO with the four changes that make long-horizon LM RL stable, all of them here.

    clip-higher        eps_high > eps_low (0.28 vs 0.2): low-probability good tokens may rise further
    token-level loss   the loss averages over all response tokens of the batch, not per response first
    dynamic sampling   groups whose responses all got the same reward carry no gradient: they are dropped, and
                       the batch is refilled from the next iterations' groups (generated with the same weights:
                       nothing was updated meanwhile) until ``train_groups`` groups are in hand, at most
                       ``max_refills`` times
    overlong shaping   r += 0                              if len <= L_max - L_cache
                       r += (L_max - L_cache - len) / L_cache   if L_max - L_cache < len <= L_max
                       r += -1                             if len > L_max
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field

from rlfabric.services.core.algorithm import register
from rlfabric.services.core.batch import Ragged, cat_ragged
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.grpo import GRPO, GRPOConfig, take

torch = lazy_import("torch")


class DAPOConfig(GRPOConfig):
    name: Literal["dapo"] = "dapo"  # type: ignore[assignment]
    clip_high: float = Field(0.28, gt=0, allow_inf_nan=False, description="eps_high: clip-higher, above clip_low, "
                                                                          "so rare tokens can gain probability")
    loss_agg: Literal["sequence", "token"] = Field("token", description="token-level averaging over the batch")
    scale_rewards: Literal["group", "none"] = Field(
        "group", description="divide each advantage by its group's reward std (none: only subtract the mean)")
    train_groups: int = Field(8, ge=1, le=1 << 16, description="groups with signal per update")
    max_refills: int = Field(4, ge=0, le=1000, description="iterations to wait for them before training on fewer")
    overlong_max: int = Field(0, ge=0, le=1 << 20, description="L_max in tokens; 0: no overlong shaping")
    overlong_buffer: int = Field(4, ge=1, le=1 << 20, description="L_cache: the soft-penalty band below L_max")


def overlong_penalty(lengths: torch.Tensor, l_max: int, cache: int) -> torch.Tensor:
    soft = (l_max - cache - lengths.float()) / cache
    return torch.where(lengths <= l_max - cache, torch.zeros_like(soft), torch.where(lengths <= l_max, soft, -1.0))


def join(parts: list[dict]) -> dict:
    return {k: cat_ragged([p[k] for p in parts], 0) if isinstance(parts[0][k], Ragged)
            else torch.cat([p[k] for p in parts]) for k in parts[0]}


@register
class DAPO(GRPO):
    Config = DAPOConfig

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.pending: list[dict] = []
        self.waited = 0

    def rewards(self, batch: dict) -> torch.Tensor:
        r = batch["rewards"].float()
        if self.cfg.overlong_max:
            r = r + overlong_penalty(batch["response_tokens"], self.cfg.overlong_max, self.cfg.overlong_buffer)
        return r

    def select(self, batch: dict) -> dict | None:
        r, group = self.rewards(batch), batch["group"]
        _, inverse = torch.unique(group, return_inverse=True)
        n = int(inverse.max()) + 1
        lo = torch.full((n,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amin")
        hi = torch.full((n,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amax")
        keep = (hi > lo)[inverse]
        self.last_kept_groups = int((hi > lo).sum())
        if keep.any():
            self.pending.append(take(batch, torch.nonzero(keep).squeeze(1)))
        have = sum(len(torch.unique(p["group"])) for p in self.pending)
        if have < self.cfg.train_groups and self.waited < self.cfg.max_refills:
            self.waited += 1
            return None
        if not self.pending:
            self.waited = 0
            return None
        joined = join(self.pending)
        self.pending, self.waited = [], 0
        groups = torch.unique(joined["group"])[: self.cfg.train_groups]
        return take(joined, torch.nonzero(torch.isin(joined["group"], groups)).squeeze(1))

    def update(self, batch: dict) -> dict[str, float]:
        stats = super().update(batch)
        stats["kept_groups"] = float(self.last_kept_groups)
        stats["pending_groups"] = float(sum(len(np.unique(p["group"].numpy())) for p in self.pending))
        return stats
