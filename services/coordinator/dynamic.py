"""DynamicScheduler (``scheduling.dynamic``): move the env stage between the env services and the rollout workers
at epoch boundaries, from measured utilisation, and keep a move only if the next window is faster.

Every ``dynamic_every`` iterations it reads the window's utilisation:
  rollout  share of the iteration the rollout workers computed (acting, and simulating when the env is inside)
  env      share of the iteration the env services simulated (their own step time, from GetStats)
and proposes one move:
  env -> rollout   the env services mostly wait (env < 30%): their messages cost more than they overlap, so the
                   rollout workers step the envs in-process;
  rollout -> env   the rollout workers are the bottleneck (> 85% busy) and spend over half of it simulating, while
                   the host has room (the learner is idle more than half the time): an env service steps chunks
                   pipelined against inference.
After a move it measures the next window against the one before; a move that did not pay (under 3% faster) is
rolled back and not tried again, and one that paid is never reversed (the window before it measured the reverse). Staleness is untouched: a move only re-places a stage, at a boundary where the
streams were drained, so every batch still has the version its index requires.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfabric.services.coordinator.records import IterationRecord, PlanControl
from rlfabric.services.core.config import SchedulingConfig

ENV_IDLE = 0.30
ROLLOUT_BUSY = 0.85
MIN_GAIN = 0.03
REVERSE = {"env -> rollout": "rollout -> env", "rollout -> env": "env -> rollout"}


@dataclass
class Window:
    steps_per_s: float
    rollout: float
    env: float
    env_in_rollout_share: float
    learner: float


class DynamicScheduler:
    def __init__(self, control: PlanControl):
        self.control = control
        self.every = control.sched.dynamic_every
        self.rows: list[IterationRecord] = []
        self.env_seconds = 0.0
        self.base_name = ""
        self.trial: tuple[SchedulingConfig, Window, str] | None = None  # (plan to roll back to, its window, move)
        self.refused: set[str] = set()
        self.moves: list[dict] = []

    async def begin(self) -> None:
        """Start the first window now (after mode auto chose a plan, or at the run's start)."""
        self.rows = []
        self.env_seconds = await self.control.env_step_seconds()

    def window(self, env_total: float) -> Window:
        """Utilisation over the records since the last decision."""
        rows = self.rows
        env_s, self.env_seconds = env_total - self.env_seconds, env_total
        first, last = rows[0], rows[-1]
        wall = last.wall_time_s - first.wall_time_s - sum(r.eval_seconds for r in rows[1:])
        per_it = wall / max(len(rows) - 1, 1)
        body = rows[1:]
        collect = sum(r.collect_seconds for r in body) / len(body)
        policy = sum(r.policy_seconds for r in body) / len(body)
        blocked = sum(r.env_seconds for r in body) / len(body)
        train = sum(r.train_seconds for r in body) / len(body)
        in_rollout = self.control.sched.env_in_rollout()
        busy = collect if in_rollout else collect - blocked
        workers = max(1, self.control.env_workers) if not in_rollout else 1
        return Window(steps_per_s=(last.env_steps - first.env_steps) / max(wall, 1e-9),
                      rollout=min(1.0, busy / per_it), env=min(1.0, env_s / max(wall, 1e-9) / workers),
                      env_in_rollout_share=(collect - policy) / collect if in_rollout and collect > 0 else 0.0,
                      learner=min(1.0, train / per_it))

    def _moved(self, to_rollout: bool) -> SchedulingConfig:
        sched = self.control.sched
        update = {"env_placement": "rollout"} if to_rollout else {
            "env_placement": "env_service", "pipeline_chunks": max(2, sched.pipeline_chunks)}
        return sched.model_copy(update=update)

    async def _replan(self, sched: SchedulingConfig, why: str) -> None:
        self.base_name = self.base_name or self.control.plan_name.split(" [")[0]
        await self.control.request_plan(sched, f"{self.base_name} [{why}]")

    async def observe(self, record: IterationRecord) -> None:
        """Every recorded iteration; every ``dynamic_every`` of them it may queue a plan change."""
        self.rows.append(record)
        if len(self.rows) < self.every:
            return
        w = self.window(await self.control.env_step_seconds())
        i = record.iteration
        self.rows = []
        if self.trial is not None:
            previous, before, move = self.trial
            self.trial = None
            gain = w.steps_per_s / before.steps_per_s - 1
            kept = gain >= MIN_GAIN
            self.moves[-1].update(after_steps_per_s=w.steps_per_s, kept=kept)
            self.control.log(f"dynamic scheduler: {move} {'kept' if kept else 'rolled back'} "
                             f"({before.steps_per_s:.0f} -> {w.steps_per_s:.0f} env steps/s, {gain:+.0%})")
            if kept:  # the reverse move was just measured slower: do not oscillate
                self.refused.add(REVERSE[move])
            else:
                self.refused.add(move)
                await self._replan(previous, f"{move} rolled back")
            return
        move = None
        sched = self.control.sched
        if not sched.env_in_rollout() and w.env < ENV_IDLE:
            move = "env -> rollout"
        elif sched.env_in_rollout() and w.rollout > ROLLOUT_BUSY and w.env_in_rollout_share > 0.5 and w.learner < 0.5:
            move = "rollout -> env"
        if move is None or move in self.refused:
            return
        target = self._moved(move == "env -> rollout")
        try:
            self.control.validate(target)
        except Exception:  # noqa: BLE001 — e.g. the chunks cannot split these shards: no such move
            self.refused.add(move)
            return
        self.trial = (sched, w, move)
        self.moves.append({"iteration": i, "move": move, "before_steps_per_s": w.steps_per_s,
                           "env_utilisation": w.env, "rollout_utilisation": w.rollout, "learner_utilisation": w.learner})
        self.control.log(f"dynamic scheduler: {move} at iteration {i} (env {w.env:.0%}, rollout {w.rollout:.0%}, "
                         f"learner {w.learner:.0%} busy; {w.steps_per_s:.0f} env steps/s)")
        await self._replan(target, move)
