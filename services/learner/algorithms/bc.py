"""Behaviour cloning, offline: maximum likelihood of the data set's actions under the policy. The baseline every
offline RL algorithm is measured against; on data of mixed quality it imitates the mixture.

    L_pi = -E[log pi(a|s)]
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import OfflineAlgorithm, OfflineConfig, register
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class BCConfig(OfflineConfig):
    name: Literal["bc"] = "bc"
    learning_rate: float = Field(3e-4, gt=0, allow_inf_nan=False, description="Adam's step size")


@register
class BC(OfflineAlgorithm):
    Config = BCConfig
    policy = "squashed_gaussian"

    def __init__(self, actor: nn.Module, run, generator: torch.Generator | None = None, **kw):
        super().__init__(actor, run, generator, **kw)
        self.optimizer = torch.optim.Adam(actor.parameters(), lr=self.cfg.learning_rate)

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch."""
        loss = torch.zeros((), device=batch["actions"].device)
        for u in range(batch["actions"].shape[0]):
            b = tree_map(lambda x, u=u: x[u], batch)
            loss = -self.policy.log_prob(b["obs"], b["actions"].float()).mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.optimizer_steps += 1
        return {"bc_loss": loss.item()}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_steps = int(state["optimizer_steps"])
