"""SFT: supervised next-token training of a language-model policy on a data set of (prompt, response) pairs, the
warm start of RL post-training.

    L = -mean over the model's tokens t of log p(x_t | x_<t)    (prompt and tool-output tokens carry no loss)

The data set is an .npz of ``tokens`` (int64 [N, L], right-padded with <pad>), ``lengths`` ([N], tokens per row)
and ``loss_mask`` (uint8 [N, L], 1 on the model's tokens); ``python -m services.env.tasks.sft_data`` writes one
for a text task.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from services.core.algorithm import OfflineAlgorithm, OfflineConfig, register


class SFTConfig(OfflineConfig):
    name: Literal["sft"] = "sft"
    batch_size: int = Field(64, ge=1, le=1 << 16, description="sequences per gradient step")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False)


def response_nll(policy: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor,
                 loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean negative log-likelihood of the model's tokens, their count) for a right-padded [B, L] batch."""
    longest = int(lengths.max())
    tokens = tokens[:, :longest]
    attn = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    logp = policy.token_logprobs(tokens, attn)  # [B, L-1]: predicts tokens[:, 1:]
    mask = loss_mask[:, 1:longest].float() * attn[:, 1:]
    n = mask.sum().clamp(min=1)
    return -(logp * mask).sum() / n, n


@register
class SFT(OfflineAlgorithm):
    Config = SFTConfig
    policy = "causal_lm"

    @classmethod
    def check(cls, run: Any) -> None:
        super().check(run)
        if run.env.adapter != "text":
            raise ValueError(f"algorithm sft trains language-model policies: set env.adapter: text (got "
                             f"{run.env.adapter!r}); it evaluates on that task")

    def __init__(self, policy: nn.Module, run: Any, generator: torch.Generator | None = None, **kw):
        super().__init__(policy, run, generator, **kw)
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch."""
        total, tokens = 0.0, 0.0
        for u in range(batch["tokens"].shape[0]):
            loss, n = response_nll(self.policy, batch["tokens"][u].long(), batch["lengths"][u].long(),
                                   batch["loss_mask"][u])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm, foreach=True)
            self.optimizer.step()
            self.optimizer_steps += 1
            total += float(loss) * float(n)
            tokens += float(n)
        return {"sft_loss": total / max(tokens, 1.0)}
