"""What the schedulers see of a run: a typed record per iteration, and the narrow interface through which they may
re-place its stages (PlanControl). They never touch the training loop or the plan executor themselves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rlfabric.services.core.config import SchedulingConfig


@dataclass(frozen=True)
class IterationRecord:
    """One recorded iteration (1-based ``iteration``), timed as the run log has it, under the plan that ran it."""

    iteration: int
    plan: str
    env_steps: int
    wall_time_s: float
    iteration_seconds: float
    collect_seconds: float = 0.0
    train_seconds: float = 0.0
    env_seconds: float = 0.0
    policy_seconds: float = 0.0
    weight_wait_seconds: float = 0.0
    eval_seconds: float = 0.0
    evaluated: bool = False
    values: dict[str, float] = field(default_factory=dict)  # the whole metrics row


class PlanControl(Protocol):
    """What a scheduler may ask of the plan executor."""

    @property
    def sched(self) -> SchedulingConfig: ...

    @property
    def plan_name(self) -> str: ...

    @property
    def rollout_workers(self) -> int: ...

    @property
    def env_workers(self) -> int: ...

    def validate(self, sched: SchedulingConfig) -> SchedulingConfig:
        """The plan as this run would run it; raises if it cannot (e.g. its chunks cannot split the shards)."""

    async def request_plan(self, sched: SchedulingConfig, name: str) -> None:
        """Run ``sched`` (under ``name``) from the next epoch boundary."""

    def describe(self, sched: SchedulingConfig) -> str: ...

    async def env_step_seconds(self) -> float:
        """Seconds the run's env services have spent inside simulator steps so far."""

    async def probe_ipc(self) -> float | None:
        """Round trip of a step-sized message from a rollout worker to its env service (None: env in-process)."""

    def log(self, message: str) -> None: ...
