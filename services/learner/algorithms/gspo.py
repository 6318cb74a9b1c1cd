"""GSPO (Zheng et al., Qwen 2025, "Group Sequence Policy Optimization"): GRPO with the importance ratio, and its
clip, taken per response instead of per token.

    for each prompt, G sampled responses y_1..y_G with rewards r_1..r_G (one group):
    advantage   A_i = (r_i - mean(r)) / (std(r) + eps)                          (as GRPO; scale_rewards: none keeps
                                                                                 r_i - mean(r))
    ratio       s_i = exp( (1/|y_i|) sum_t [log pi(y_it) - log pi_old(y_it)] )  length-normalised sequence ratio
    surrogate   L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)   one clip decision per response
    KL          + beta * k3 per token, as GRPO (beta > 0 only)
    loss        mean over responses of L_i (loss_agg: sequence; every token of response i carries L_i, so the
                per-response mean of the tokens is L_i itself)

Every token of a response whose ratio left the band on the side its advantage pushes towards gets no gradient;
inside the band, d L_i = -s_i A_i (1/|y_i|) sum_t d log pi(y_it). The band is narrow (eps 3e-4 / 4e-4, the paper's):
a sequence ratio averages |y_i| token log-ratios, so it moves far less than a token's.

    GSPO-token  (variant: token) s_it = sg(s_i) * pi(y_it) / sg(pi(y_it)): the same value and clip as s_i, and
                per-token advantages A_it may differ within a response; with GSPO's one advantage per response
                its gradient equals GSPO's

Rollout correction (``rollout_correction``, behaviour: proximal) multiplies each token's copy of L_i by the
correction's weight of that token (or of the response, level: sequence), as for GRPO (rollout_correction.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.grpo import GRPO, GRPOConfig

torch = lazy_import("torch")


class GSPOConfig(GRPOConfig):
    name: Literal["gspo"] = "gspo"  # type: ignore[assignment]
    clip_low: float = Field(3e-4, gt=0, lt=1, allow_inf_nan=False,
                            description="eps_low: the sequence ratio s_i is clipped below 1 - eps_low (3e-4: a "
                                        "length-normalised ratio moves little)")
    clip_high: float = Field(4e-4, gt=0, allow_inf_nan=False,
                             description="eps_high: the sequence ratio s_i is clipped above 1 + eps_high")
    loss_agg: Literal["sequence", "token"] = Field(
        "sequence", description="sequence: the mean over responses of L_i (GSPO's); token: over all response "
                                "tokens of the batch, so long responses weigh more")
    variant: Literal["sequence", "token"] = Field(
        "sequence", description="sequence: GSPO's s_i; token: GSPO-token's s_it = sg(s_i) pi / sg(pi), for "
                                "advantages that differ per token (the same gradient with one per response)")


def sequence_log_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i [b, 1]: the mean over response i's tokens of log pi - log pi_old."""
    return ((logp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


def gspo_surrogate(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float,
                   high: float, token_gradient: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(s A, clip(s, 1 - low, 1 + high) A) per token [b, T] (each response's value on all its tokens), and
    which responses' ratios lie outside the band (on their tokens)."""
    log_s = sequence_log_ratio(logp, old, mask)
    if token_gradient:  # GSPO-token: sg(s_i) * pi(y_it) / sg(pi(y_it)), the value of s_i per token
        s = (log_s.detach() + logp - logp.detach()).exp()
    else:
        s = log_s.exp().expand_as(logp)
    per_token = -torch.min(s * adv, s.clamp(1 - low, 1 + high) * adv)
    outside = ((s < 1 - low) | (s > 1 + high)).float()
    return per_token, outside


@register
class GSPO(GRPO):
    Config = GSPOConfig

    def surrogate(self, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gspo_surrogate(logp, old, adv, mask, self.cfg.clip_low, self.cfg.clip_high,
                              token_gradient=self.cfg.variant == "token")


__all__ = ["GSPO", "GSPOConfig", "gspo_surrogate", "sequence_log_ratio"]
