"""SFT: supervised next-token training of a language-model policy on a data set of (prompt, response) pairs, the
warm start of RL post-training.

    L = -mean over the model's tokens t of log p(x_t | x_<t)    (prompt and tool-output tokens carry no loss)

The data set is an .npz of ``tokens`` (int64 [N, L], right-padded with <pad>), ``lengths`` ([N], tokens per row)
and ``loss_mask`` (uint8 [N, L], 1 on the model's tokens); ``python -m rlfabric.services.env.tasks.sft_data`` writes one
for a text task.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import OfflineAlgorithm, OfflineConfig, register
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class SFTConfig(OfflineConfig):
    name: Literal["sft"] = "sft"
    batch_size: int = Field(64, ge=1, le=1 << 16, description="sequences per gradient step")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False, description="AdamW's step size")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="AdamW's decoupled weight decay")
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False, description="clip of the gradient's global norm")


def model_token_mask(lengths: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention mask [B, L], mask of the predicted tokens that carry loss [B, L-1]) of a right-padded batch."""
    longest = int(lengths.max())
    attn = (torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None]).long()
    return attn, loss_mask[:, 1:longest].float() * attn[:, 1:]


def response_nll(policy: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor,
                 total: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean negative log-likelihood of the model's tokens, their count) for a right-padded [B, L] batch; with
    ``total`` (the whole minibatch's count when this is one rank's share) the sum over ``total``."""
    attn, mask = model_token_mask(lengths, loss_mask)
    logp = policy.token_logprobs(tokens[:, :attn.shape[1]], attn)  # [B, L-1]: predicts tokens[:, 1:]
    n = mask.sum().clamp(min=1)
    return -(logp * mask).sum() / (n if total is None else total.clamp(min=1)), n


@register
class SFT(OfflineAlgorithm):
    Config = SFTConfig
    policy = "causal_lm"
    data_parallel = True

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
            lengths, loss_mask = batch["lengths"][u].long(), batch["loss_mask"][u]
            rows, share = self.shard(torch.arange(len(lengths), device=lengths.device))  # this rank's rows (all of them on one rank)
            whole = model_token_mask(lengths, loss_mask)[1].sum()  # the minibatch's loss tokens, all ranks'
            loss, n = response_nll(self.policy, batch["tokens"][u][rows].long(), lengths[rows], loss_mask[rows],
                                   whole)
            loss = loss * share
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm, foreach=True)
            self.optimizer.step()
            self.optimizer_steps += 1
            total += float(loss.detach()) * float(whole)  # this rank's summed NLL
            tokens += float(n) * share
        return {"sft_loss": total / max(tokens, 1.0)}
