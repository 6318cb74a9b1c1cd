"""PPO for language-model policies: a value head on the LM's last hidden state, GAE over response tokens (the
RLHF recipe), and the clipped surrogate of GRPO's loop. Groups are optional (group_size 1 works).

    per-token reward   r_t = task reward at the response's last token  - beta * (log pi_old - log pi_ref)  (beta > 0)
    TD error           delta_t = r_t + gamma * V(s_t+1) - V(s_t)         over the response's tokens only: prompt and
                                                                         tool-output tokens are skipped, not stepped
    advantage          A_t = sum_k (gamma * lambda)^k delta_t+k,  whitened over the batch's response tokens
    return             R_t = A_t (before whitening) + V(s_t)
    loss               clipped surrogate  +  vf_coef * 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2)

V_old (and the advantages) come from the learner's pass over the batch before the update: engines serve only the
LM, never the head.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.grpo import GRPO, GRPOConfig, aggregate
from rlfabric.services.learner.algorithms.reinforce_pp import last_token

torch = lazy_import("torch")


class PPOLMConfig(GRPOConfig):
    name: Literal["ppo_lm"] = "ppo_lm"  # type: ignore[assignment]
    gamma: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="discount per response token")
    gae_lambda: float = Field(0.95, ge=0, le=1, allow_inf_nan=False, description="GAE's lambda: bias (0) against "
                                                                                "variance (1) of the advantages")
    vf_coef: float = Field(0.1, ge=0, allow_inf_nan=False, description="weight of the value loss")
    value_clip: float = Field(0.2, gt=0, allow_inf_nan=False, description="how far V may move from V_old")
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False, description="beta of the per-token KL reward")
    loss_agg: Literal["sequence", "token"] = Field("token", description="token-level averaging over the batch")


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> torch.Tensor:
    """Advantages [B, T] over the masked-in positions of each row, in order (masked-out positions are skipped: the
    next response token's value bootstraps across them); 0 at masked-out positions."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    carry = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        live = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * carry
        adv[:, t] = torch.where(live, step, torch.zeros_like(step))
        next_value = torch.where(live, values[:, t], next_value)
        carry = torch.where(live, step, carry)
    return adv


@register
class PPOLM(GRPO):
    Config = PPOLMConfig
    policy = "causal_lm_value"
    kl_in_loss = False
    grouped = False

    def advantages(self, batch: dict, seq: dict[str, torch.Tensor], mask: torch.Tensor, old: torch.Tensor,
                   ref: torch.Tensor | None) -> torch.Tensor:
        tokens, attn = seq["tokens"], seq["attention_mask"]
        chunk = self.cfg.minibatch_size
        with torch.no_grad():
            values = torch.cat([self.policy.token_logprobs_values(tokens[i:i + chunk], attn[i:i + chunk],
                                                                  self.temperature)[1]
                                for i in range(0, tokens.shape[0], chunk)])
        rewards = last_token(mask) * self.rewards(batch)[:, None]
        if ref is not None:
            rewards = rewards - self.cfg.kl_coef * (old - ref) * mask
        adv = gae(rewards, values, mask, self.cfg.gamma, self.cfg.gae_lambda)
        self.old_values, self.returns = values, adv + values
        live = mask > 0
        return (adv - adv[live].mean()) / (adv[live].std() + 1e-8) * mask

    def forward(self, tokens: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.policy.token_logprobs_values(tokens, attn, self.temperature)

    def auxiliary_loss(self, aux: Any, idx: torch.Tensor, mask: torch.Tensor,
                       whole: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        width = aux.shape[1]  # a length-grouped pass is as wide as its own longest row
        values, old, ret = aux, self.old_values[idx, :width], self.returns[idx, :width]
        clipped = old + (values - old).clamp(-self.cfg.value_clip, self.cfg.value_clip)
        per_token = 0.5 * torch.max((values - ret).pow(2), (clipped - ret).pow(2))
        loss = aggregate(per_token, mask, self.cfg.loss_agg, whole)
        live = mask > 0  # explained variance of the returns over this minibatch's response tokens
        residual, spread = (ret - values.detach())[live].var(), ret[live].var()
        explained = float(1 - residual / (spread + 1e-8)) if live.sum() > 1 else 0.0
        return self.cfg.vf_coef * loss, {"value_loss": float(loss.detach()), "explained_variance": explained}


__all__ = ["PPOLM", "PPOLMConfig", "gae"]
