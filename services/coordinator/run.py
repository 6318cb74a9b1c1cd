"""Run: the state of one submitted run — its lifecycle, its event history and the watchers that follow it."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2

TERMINAL = {coordinator_pb2.SUCCEEDED, coordinator_pb2.FAILED, coordinator_pb2.STOPPED}


class RunFailed(Exception):
    """The run cannot continue. ``bad_input`` marks failures caused by the user's input."""

    def __init__(self, reason: str, bad_input: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.bad_input = bad_input


class WorkerLost(RunFailed):
    """Workers of the run died or became unreachable: the attempt ends, and the run may recover."""

    def __init__(self, reason: str, loss):
        super().__init__(reason)
        self.loss = loss  # recovery.Loss


class StopRequested(Exception):
    """Raised by a workflow at an iteration boundary after StopRun: everything recorded so far is consistent."""


class Run:
    def __init__(self, run_id: str, config: RunConfig, run_dir: Path):
        self.run_id = run_id
        self.key = secrets.token_urlsafe(24)  # its workers' admin calls carry it (stages.Stage.run_key)
        self.config = config
        self.run_dir = run_dir
        self.state = coordinator_pb2.PENDING
        self.reason = ""
        self.bad_input = False
        self.env_steps = 0
        self.weight_version = 0
        self.iteration = 0
        self.latest: dict[str, float] = {}
        self.started = time.time()
        self.history: list[coordinator_pb2.RunEvent] = []
        self.watchers: set[asyncio.Queue] = set()
        self.task: asyncio.Task | None = None
        self.stop_requested = asyncio.Event()
        self.plan = config.scheduling.mode  # the plan executing now (mode auto: the one the scheduler chose)
        self.loop = None  # the TrainingLoop once placed
        self.attempt: asyncio.Task | None = None  # the placed workflow; a lost worker ends it, and the run recovers
        self.lost: list = []  # [(Worker, why)] since the attempt started
        self.recoveries = 0
        self.on_recovery = None  # called after each recovery (the coordinator records the count in its run index)
        self.stage = ""  # a warm_start stage before the run itself (coordinator/warm_start.py); "": the run
        self.parent = ""  # the run whose warm_start stage this run is ("": a run of its own)
        self.resume_dir = run_dir  # what `rlfabric resume` continues it from (a stage's: its parent's directory)

    def status(self) -> coordinator_pb2.RunStatus:
        return coordinator_pb2.RunStatus(
            run_id=self.run_id, state=self.state, reason=self.reason, bad_input=self.bad_input,
            run_dir=str(self.run_dir), env_steps=self.env_steps, weight_version=self.weight_version,
            iteration=self.iteration, latest=self.latest, mode=self.plan, recoveries=self.recoveries,
            stage=self.stage)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def _emit(self, event: coordinator_pb2.RunEvent) -> None:
        self.history.append(event)
        for q in self.watchers:
            q.put_nowait(event)

    def set_state(self, state: int, reason: str = "", bad_input: bool = False) -> None:
        self.state, self.reason, self.bad_input = state, reason, bad_input
        self._emit(coordinator_pb2.RunEvent(status=self.status()))

    def log(self, message: str, level: str = "info") -> None:
        self._emit(coordinator_pb2.RunEvent(log=coordinator_pb2.LogEvent(level=level, message=message,
                                                                         time=time.time())))

    def metrics(self, row: dict[str, float]) -> None:
        self.iteration = int(row.get("iteration", self.iteration))
        self.env_steps = int(row.get("env_steps", self.env_steps))
        self.weight_version = int(row.get("weight_version", self.weight_version))
        values = {k: float(v) for k, v in row.items() if k not in ("iteration", "env_steps", "weight_version")}
        self.latest.update(values)
        self._emit(coordinator_pb2.RunEvent(metrics=coordinator_pb2.MetricRow(
            iteration=self.iteration, env_steps=self.env_steps, wall_time_s=time.time() - self.started,
            weight_version=self.weight_version, values=values)))

    def recovered(self, event: coordinator_pb2.RecoveryEvent) -> None:
        self.recoveries = event.attempt
        self._emit(coordinator_pb2.RunEvent(recovery=event))
        if self.on_recovery is not None:
            self.on_recovery()

    def lose(self, worker, why: str) -> None:
        """A worker of this run died or left: end the running attempt (the run then recovers or fails)."""
        if self.finished:
            return
        self.lost.append((worker, why))
        if self.attempt is not None and not self.attempt.done():
            self.attempt.cancel()
