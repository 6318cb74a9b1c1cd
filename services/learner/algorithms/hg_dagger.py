"""HG-DAgger (Kelly et al. 2019): the policy acts, a human expert takes over when it drifts, and the policy learns
to do what the human did in the states where they had to step in.

    data        D = every (s, a_human) a human commanded while intervening (replay's "interventions" source,
                filled by the rollout from envs under teleop: a robot gateway with a teleop client)
    update      L = -E_(s, a) ~ D [log pi(a | s)]          (behaviour cloning on the aggregate of interventions)

Nothing is learned until the first intervention; as the policy improves the human steps in less, and success
without intervention (``success_without_intervention_rate`` in metrics.csv) is the measure. ``initial_policy``
warm-starts from a behaviour-cloned policy, as HG-DAgger does in practice.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import (
    INTERVENTIONS,
    Algorithm,
    AlgorithmConfig,
    DataAccess,
    Trajectory,
    register,
)
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class HGDAggerConfig(AlgorithmConfig):
    name: Literal["hg_dagger"] = "hg_dagger"
    n_steps: int = Field(64, ge=1, le=100_000, description="steps per env per iteration")
    batch_size: int = Field(128, ge=1, le=1 << 16, description="intervention rows per gradient step")
    updates_per_iteration: int = Field(50, ge=1, le=100_000, description="gradient steps per iteration (once "
                                                                         "there is any intervention)")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False, description="Adam's step size")
    label_clip: float = Field(0.95, gt=0, lt=1, description="human actions are cloned within +-label_clip")


@register
class HGDAgger(Algorithm):
    Config = HGDAggerConfig
    policy = "squashed_gaussian"

    @classmethod
    def trajectory(cls, cfg: HGDAggerConfig) -> Trajectory:
        return Trajectory(fields=("obs", "actions", "intervened", "executed_actions"))

    @classmethod
    def data(cls, cfg: HGDAggerConfig) -> DataAccess:
        return DataAccess.uniform(cfg.batch_size, INTERVENTIONS)

    def __init__(self, policy: nn.Module, run: Any, generator: torch.Generator | None = None, **kw: Any):
        super().__init__(policy, run, generator, **kw)
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=self.cfg.learning_rate)

    def updates_for(self, env_steps: int) -> int:
        self.env_steps += env_steps
        return self.cfg.updates_per_iteration

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch of intervention rows."""
        total = 0.0
        U = batch["actions"].shape[0]
        for u in range(U):
            b = tree_map(lambda x, u=u: x[u], batch)
            total += self.clone(b["obs"], b["actions"])
        return {"bc_loss": total / max(U, 1)}

    def clone(self, obs: Any, actions: torch.Tensor) -> float:
        """One gradient step of L = -E[log pi(a | s)] on labelled rows; the loss."""
        # a label at the box's edge (a human's move exceeded one step's range) is taught just inside it: at
        # exactly +-1 a squashed Gaussian's log-likelihood wants an infinite mean
        actions = actions.float().clamp(-self.cfg.label_clip, self.cfg.label_clip)
        loss = -self.policy.log_prob(obs, actions).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.optimizer_steps += 1
        return loss.item()


__all__ = ["HGDAgger", "HGDAggerConfig"]
