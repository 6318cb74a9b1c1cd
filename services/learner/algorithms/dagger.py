"""DAgger (Ross et al. 2011): the learner's policy collects states, an expert labels every visited state with its
action, and the policy is trained by supervised imitation on the aggregate of all iterations' labelled states.

    iteration i   the rollout collects states s ~ d_pi_i with the current policy pi_i
    labels        a*(s) = the expert's action (its mode), computed by the learner for every sampled state
    data          D = every state visited so far (the replay window: size replay.capacity_transitions to keep
                  all iterations), sampled uniformly
    update        L = -E_(s ~ D) [log pi(a*(s) | s)]        (behaviour cloning on expert labels, as hg_dagger)

The expert is a frozen policy checkpoint (``expert_checkpoint``: the learner's expert role). Who acts: Ross et
al.'s mixture pi_i = beta_i expert + (1 - beta_i) pi_hat_i needs the rollout to execute the expert's action with
probability beta_i, and the collectors act with the published policy only, so this file runs the beta_i = 0
schedule (the learner's policy acts in every iteration; its first iteration's states come from the initial
policy instead of the expert). Labels are exact on every visited state, which is what DAgger's guarantee rests on.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import AlgorithmConfig, DataAccess, Roles, Trajectory, register
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.hg_dagger import HGDAgger

torch = lazy_import("torch")


class DAggerConfig(AlgorithmConfig):
    name: Literal["dagger"] = "dagger"
    expert_checkpoint: str = Field("", max_length=4096, description="checkpoint file of the expert policy (a run "
                                                                    "with the same env)")
    n_steps: int = Field(64, ge=1, le=100_000, description="steps per env per iteration")
    batch_size: int = Field(128, ge=1, le=1 << 16, description="visited states per gradient step")
    updates_per_iteration: int = Field(50, ge=1, le=100_000, description="gradient steps per iteration")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False, description="Adam's step size")
    label_clip: float = Field(0.95, gt=0, lt=1, description="expert actions are cloned within +-label_clip")


@register
class DAgger(HGDAgger):
    Config = DAggerConfig
    roles = Roles(expert=True)

    @classmethod
    def trajectory(cls, cfg: DAggerConfig) -> Trajectory:
        return Trajectory(fields=("obs",))

    @classmethod
    def data(cls, cfg: DAggerConfig) -> DataAccess:
        return DataAccess.uniform(cfg.batch_size)

    @classmethod
    def check(cls, run: Any) -> None:
        if not run.algorithm.expert_checkpoint:
            raise ValueError("algorithm.expert_checkpoint is empty: DAgger needs an expert to label the visited "
                             "states. Fix: set it to a checkpoint file of a run with the same env")

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch of visited states, labelled by the expert."""
        total, agree = 0.0, 0.0
        U = batch["obs"].shape[0] if not isinstance(batch["obs"], dict) else next(iter(batch["obs"].values())).shape[0]
        for u in range(U):
            obs = tree_map(lambda x, u=u: x[u], batch["obs"])
            labels = self.expert.act(obs, deterministic=True)[0]
            with torch.no_grad():
                agree += float((self.policy.act(obs, deterministic=True)[0] - labels).abs().mean())
            total += self.clone(obs, labels)
        return {"bc_loss": total / max(U, 1), "expert_gap": agree / max(U, 1)}


__all__ = ["DAgger", "DAggerConfig"]
