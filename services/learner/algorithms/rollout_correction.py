"""Rollout correction: importance weights for the gap between the inference engine that sampled a batch and the
learner that trains on it, shared by every LM policy-gradient algorithm (the GRPO family: grpo, dapo,
reinforce_pp, ppo_lm, gspo, cispo) through ``algorithm.rollout_correction``. Not an algorithm: nothing registers.

The engine (vLLM, SGLang, the hf sampler in bf16) and the learner score the same tokens under the same weights
slightly differently (kernels, precision, batch shapes), so the batch is a little off-policy even before the first
step. Per response token t of response i, with the learner's log-probs before the update (``behaviour:
proximal``) and the engine's recorded at sampling:

    log-ratio       d_t = log pi_learner_old(y_t) - log pi_engine(y_t)       (what logprob_mismatch_abs averages |.| of)
    level token     rho_t = exp(d_t)                                         each token its own ratio
    level sequence  rho_t = exp(sum_s d_s)                                   the response's whole IS ratio, every token
    level geometric rho_t = exp(mean_s d_s)                                  its per-token geometric mean
    tis             w_t = sg(min(rho_t, cap))                                truncated IS (veRL/TRL "TIS")
    mis             w_t = 1 if low <= rho_t <= high else 0                   masked IS (veRL "MIS", IcePop)

and the policy-gradient term of each token's loss is multiplied by w_t (a KL term or a value loss is not). A masked
token keeps its place in the loss's denominators (a weight of 0, as in IcePop's objective), so masking does not
rescale what is left. Per update it logs the ratio at its level (over response tokens, or over responses) as
``rollout_is_ratio_mean``/``rollout_is_ratio_std``, and the share of those units it changed:
``rollout_is_truncated_fraction`` (tis: rho > cap) or ``rollout_is_masked_fraction`` (mis).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")

LOG_RATIO_LIMIT = 20.0  # |log rho| beyond this is clamped for the logged ratio only (exp would overflow)


class RolloutCorrection(BaseModel):
    """``algorithm.rollout_correction``: which importance weight corrects the engine-vs-learner gap."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    mode: Literal["none", "tis", "mis"] = Field(
        "none", description="none: no correction; tis: weight each token's policy-gradient loss by min(rho, cap); "
                            "mis: drop tokens (or whole responses) whose rho is outside [low, high] from it")
    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="the ratio rho: per token; per response (the product of its tokens' ratios, applied "
                             "to all of them); or per response as the geometric mean of its tokens' ratios")
    cap: float = Field(2.0, gt=0, allow_inf_nan=False, description="C of tis: the largest weight a token gets")
    low: float = Field(0.5, gt=0, le=1, allow_inf_nan=False, description="mis: the smallest rho kept")
    high: float = Field(2.0, ge=1, allow_inf_nan=False, description="mis: the largest rho kept")

    @model_validator(mode="after")
    def _band(self) -> RolloutCorrection:
        if self.low >= self.high:
            raise ValueError(f"rollout_correction.low={self.low} must be below high={self.high}")
        return self

    @property
    def on(self) -> bool:
        return self.mode != "none"


def log_ratios(learner: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log rho [B, T] at ``level``, 0 at masked-out positions."""
    d = (learner - engine) * mask
    if level == "token":
        return d
    per_row = d.sum(1, keepdim=True)
    if level == "geometric":
        per_row = per_row / mask.sum(1, keepdim=True).clamp(min=1)
    return per_row * mask


def rollout_weights(learner: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor,
                    cfg: RolloutCorrection) -> tuple[torch.Tensor, dict[str, float]]:
    """The correction's weight w [B, T] of each token's policy-gradient loss (no gradient: both log-probs are
    recorded numbers), and its stats. ``learner``/``engine``: log-probs [B, T] of the sampled tokens; ``mask``: the
    response tokens."""
    log_rho = log_ratios(learner.detach(), engine.detach(), mask, cfg.level)
    if cfg.mode == "tis":
        changed = log_rho > math.log(cfg.cap)
        weight = log_rho.clamp(max=math.log(cfg.cap)).exp()
    elif cfg.mode == "mis":
        changed = (log_rho < math.log(cfg.low)) | (log_rho > math.log(cfg.high))
        weight = (~changed).to(log_rho.dtype)
    else:
        return torch.ones_like(log_rho), {}
    # the units the ratio belongs to: response tokens, or responses (those with a token to train)
    live = mask > 0
    if cfg.level != "token":
        first = torch.zeros_like(live).scatter_(1, live.to(torch.int64).argmax(1, keepdim=True), True)
        live = live & first  # one position stands for each response
    ratio = log_rho[live].clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    n = int(live.sum())
    stats = {"rollout_is_ratio_mean": float(ratio.mean()) if n else 1.0,
             "rollout_is_ratio_std": float(ratio.std(correction=0)) if n else 0.0,
             f"rollout_is_{'truncated' if cfg.mode == 'tis' else 'masked'}_fraction":
                 float(changed[live].sum()) / max(n, 1)}
    return weight * mask + (1 - mask), stats


__all__ = ["RolloutCorrection", "log_ratios", "rollout_weights"]
