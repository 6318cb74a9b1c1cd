"""CISPO (MiniMax-M1, 2025): a REINFORCE-style token loss weighted by a clipped importance-sampling weight with no
gradient, so every token keeps its gradient through log pi, where PPO's clip would have dropped it.

    for each prompt, G sampled responses y_1..y_G with rewards r_1..r_G (one group):
    advantage   A_i = (r_i - mean(r)) / (std(r) + eps)                  (as GRPO; scale_rewards: none keeps
                                                                         r_i - mean(r))
    ratio       r_t = pi(y_it) / pi_old(y_it)                           per response token t
    IS weight   w_t = clip(r_t, 1 - eps_low_is, 1 + eps_high_is)        eps_low_is: None is no lower bound
    loss        -sum_{i,t} sg(w_t) A_i log pi(y_it) / (number of response tokens of the batch)   (loss_agg: token)
    KL          + beta * k3 per token, as GRPO (beta > 0 only)

d loss = -sg(w_t) A_i d log pi(y_it) / N for every token: the clip bounds how much a token's update is weighed, it
never removes the token (PPO's clip zeroes the gradient of tokens past the band, often the rare "fork" tokens of
long reasoning). ``clip_fraction`` is the share of response tokens whose weight the clip changed.

Rollout correction (``rollout_correction``, behaviour: proximal) multiplies each token's term by the correction's
own weight (a function of pi_learner_old / pi_engine, rollout_correction.py), on top of sg(w_t).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.grpo import GRPO, GRPOConfig

torch = lazy_import("torch")


class CISPOConfig(GRPOConfig):
    name: Literal["cispo"] = "cispo"  # type: ignore[assignment]
    clip_low: float | None = Field(  # type: ignore[assignment]
        None, gt=0, lt=1, allow_inf_nan=False,
        description="eps_low_is: the IS weight is clipped below 1 - eps_low_is; None (CISPO's): no lower bound")
    clip_high: float = Field(0.28, gt=0, allow_inf_nan=False,
                             description="eps_high_is: the IS weight is clipped above 1 + eps_high_is")
    loss_agg: Literal["sequence", "token"] = Field(
        "token", description="token (CISPO's): the sum over all response tokens of the batch over their number; "
                             "sequence: the mean per response, then over responses")


def cispo_surrogate(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float | None,
                    high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-sg(clip(r, 1 - low, 1 + high)) A log pi per token, and which tokens' weights the clip changed."""
    ratio = (logp - old).exp().detach()
    weight = ratio.clamp(min=None if low is None else 1 - low, max=1 + high)
    return -weight * adv * logp, (weight != ratio).float()


@register
class CISPO(GRPO):
    Config = CISPOConfig

    def surrogate(self, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cispo_surrogate(logp, old, adv, self.cfg.clip_low, self.cfg.clip_high)


__all__ = ["CISPO", "CISPOConfig", "cispo_surrogate"]
