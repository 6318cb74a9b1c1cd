"""DAgger (Ross et al. 2011): the learner's policy collects states, an expert labels every visited state with its
action, and the policy is trained by supervised imitation on the aggregate of all iterations' labelled states.

    iteration i   the rollout collects states s ~ d_pi_i with the current policy pi_i
    labels        a*(s) = the expert's action (its mode, as the env executes it), computed by the learner for every
                  sampled state
    data          D = every state visited so far (the replay window: size replay.capacity_transitions to keep
                  all iterations), sampled uniformly
    update        L = -E_(s ~ D) [log pi(a*(s) | s)]        (behaviour cloning on expert labels)

    who acts      at each step of iteration i, per env: the expert with probability beta_i = beta * beta_decay^i,
                  the policy otherwise (Ross et al.'s mixture pi_i = beta_i pi* + (1 - beta_i) pi_hat_i; beta = 1,
                  decay p: their beta_i = p^(i-1)); beta = 0: the policy always acts

The expert is a frozen policy checkpoint of any kind (``expert_checkpoint``: the learner's expert role): a PPO
actor-critic, a SAC or CrossQ actor, a VLA; its labels are the env actions it would execute (ids for Discrete
spaces, Box vectors), so the student, an actor-critic policy (categorical or Gaussian), learns from any of them.
The rollout loads the same checkpoint to act with it (``Trajectory.expert_acts``); the learner labels. Labels are
exact on every visited state, which is what DAgger's guarantee rests on. Metric ``expert_steps`` counts the env
steps the expert took.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import (
    Algorithm,
    AlgorithmConfig,
    DataAccess,
    Roles,
    Trajectory,
    register,
)
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class DAggerConfig(AlgorithmConfig):
    name: Literal["dagger"] = "dagger"
    expert_checkpoint: str = Field("", max_length=4096, description="checkpoint file of the expert policy (a run "
                                                                    "with the same env)")
    n_steps: int = Field(64, ge=1, le=100_000, description="steps per env per iteration")
    batch_size: int = Field(128, ge=1, le=1 << 16, description="visited states per gradient step")
    updates_per_iteration: int = Field(50, ge=1, le=100_000, description="gradient steps per iteration")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False, description="Adam's step size")
    beta: float = Field(0.0, ge=0, le=1, description="beta_0: the share of the first iteration's env steps the "
                                                     "expert acts in (0: the policy always acts)")
    beta_decay: float = Field(0.5, gt=0, le=1, description="beta_i = beta * beta_decay^i for iteration i")


@register
class DAgger(Algorithm):
    Config = DAggerConfig
    policy = "actor_critic"  # categorical for Discrete actions, Gaussian for Box: either kind of expert's labels
    roles = Roles(expert=True)

    @classmethod
    def trajectory(cls, cfg: DAggerConfig) -> Trajectory:
        return Trajectory(fields=("obs",), expert_acts=cfg.beta, expert_decay=cfg.beta_decay)

    @classmethod
    def data(cls, cfg: DAggerConfig) -> DataAccess:
        return DataAccess.uniform(cfg.batch_size)

    @classmethod
    def check(cls, run: Any) -> None:
        if not run.algorithm.expert_checkpoint:
            raise ValueError("algorithm.expert_checkpoint is empty: DAgger needs an expert to label the visited "
                             "states. Fix: set it to a checkpoint file of a run with the same env")

    def __init__(self, policy: nn.Module, run: Any, generator: torch.Generator | None = None, **kw: Any):
        super().__init__(policy, run, generator, **kw)
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=self.cfg.learning_rate)

    def updates_for(self, env_steps: int) -> int:
        self.env_steps += env_steps
        return self.cfg.updates_per_iteration

    def labels(self, obs: Any) -> torch.Tensor:
        """The expert's env actions for ``obs`` (its mode), on the policy's device."""
        raw = self.expert.act(obs, deterministic=True)[0]
        device = next(self.policy.parameters()).device
        return torch.as_tensor(self.expert.env_actions(raw), device=device)

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch of visited states, labelled by the expert."""
        total, gap = 0.0, 0.0
        U = batch["obs"].shape[0] if not isinstance(batch["obs"], dict) else next(iter(batch["obs"].values())).shape[0]
        for u in range(U):
            obs = tree_map(lambda x, u=u: x[u], batch["obs"])
            labels = self.labels(obs)
            with torch.no_grad():  # how far the policy's own mode is from the expert's, as the env sees them
                mine = torch.as_tensor(self.policy.env_actions(self.policy.act(obs, deterministic=True)[0]),
                                       device=labels.device)
                gap += float((mine != labels).float().mean() if self.policy.discrete
                             else (mine - labels).abs().mean())
            loss = -self.policy.evaluate(obs, labels)[0].mean()  # ids, or Box actions (an actor-critic's raw
            # actions are env actions, clipped to the bounds when executed)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.optimizer_steps += 1
            total += loss.item()
        return {"bc_loss": total / max(U, 1), "expert_gap": gap / max(U, 1)}


__all__ = ["DAgger", "DAggerConfig"]
