"""REINFORCE++ (Hu 2025): PPO's clipped objective with no critic and no groups: a per-token KL penalty folded
into the reward, returns to go, and advantages normalised over the whole batch.

    per-token reward   r_t = -beta * (log pi_old(o_t) - log pi_ref(o_t)),   plus the task reward at the last token
    return             G_t = sum_{s >= t} r_s                                (gamma = 1 over a response)
    advantage          A_t = (G_t - mean(G)) / std(G)                        (over every response token of the batch)
    loss               the clipped surrogate of PPO, averaged over all response tokens
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.grpo import GRPO, GRPOConfig

torch = lazy_import("torch")


class ReinforcePPConfig(GRPOConfig):
    name: Literal["reinforce_pp"] = "reinforce_pp"  # type: ignore[assignment]
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False, description="beta of the per-token KL reward")
    loss_agg: Literal["sequence", "token"] = Field("token", description="token-level averaging over the batch")


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = sum over s >= t of rewards [B, T] (masked positions add nothing)."""
    r = rewards * mask
    return r.flip(1).cumsum(1).flip(1)


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] one-hot of each row's last masked-in position."""
    pos = torch.arange(mask.shape[1], device=mask.device)[None, :].expand_as(mask)
    last = torch.where(mask > 0, pos, -1).max(1).values
    return (pos == last[:, None]).float()


@register
class ReinforcePP(GRPO):
    Config = ReinforcePPConfig
    kl_in_loss = False
    grouped = False

    def advantages(self, batch: dict, seq: dict[str, torch.Tensor], mask: torch.Tensor, old: torch.Tensor,
                   ref: torch.Tensor | None) -> torch.Tensor:
        per_token = last_token(mask) * self.rewards(batch)[:, None]
        if ref is not None:
            per_token = per_token - self.cfg.kl_coef * (old - ref) * mask
        g = returns_to_go(per_token, mask)
        m = mask > 0
        mean, std = g[m].mean(), g[m].std()
        return (g - mean) / (std + 1e-8) * mask
