"""Supervised fine-tuning of an action policy on demonstrations, offline: the warm start before RL (RLinf's
SFT-then-RL recipes). Each minibatch is the policy's own imitation loss on demonstrated env actions; the policy
decides what that is:

    pi0          flow matching: t ~ Beta, x_t = t * noise + (1 - t) * chunk, L = |v(x_t, t) - (noise - chunk)|^2
    vla flow     the same with its own expert
    vla tokens   cross-entropy of each action dimension's bin (also policy.name vla_tokens, on a VLM's LM head)

Demonstrations come from `rlfabric collect --expert` (the env's scripted expert), a checkpoint's policy, or any
.npz of obs and actions named in ``replay.datasets``. The run's checkpoint is RL's ``policy.init_checkpoint``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import OfflineAlgorithm, OfflineConfig, register
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.core.policy import Imitates

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class VLASFTConfig(OfflineConfig):
    name: Literal["vla_sft"] = "vla_sft"
    learning_rate: float = Field(3e-4, gt=0, allow_inf_nan=False, description="AdamW step size")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="AdamW decoupled weight decay")
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False, description="clip the gradient's global norm")


@register
class VLASFT(OfflineAlgorithm):
    Config = VLASFTConfig
    policy = "actor_critic"

    def __init__(self, policy: nn.Module, run, generator: torch.Generator | None = None, **kw):
        super().__init__(policy, run, generator, **kw)
        if not isinstance(policy, Imitates):
            raise ValueError(f"algorithm.name=vla_sft trains a policy on demonstrations through its "
                             f"imitation_loss(obs, actions), and policy {type(policy).__name__} has none. Fix: "
                             f"policy.name: pi0, vla or vla_tokens")
        self.params = [p for p in policy.parameters() if p.requires_grad]  # a frozen encoder stays as loaded
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch."""
        losses, norms = [], []
        for u in range(batch["actions"].shape[0]):
            b = tree_map(lambda x, u=u: x[u], batch)
            loss = self.policy.imitation_loss(b["obs"], b["actions"])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norms.append(float(nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)))
            self.optimizer.step()
            self.optimizer_steps += 1
            losses.append(loss.item())
        return {"sft_loss": sum(losses) / len(losses), "grad_norm": sum(norms) / len(norms)}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_steps = int(state["optimizer_steps"])
