"""Stages: the workers taking part in a run, and how the coordinator calls them (any failure becomes a RunFailed
that names the worker, the call and the cause)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.services.coordinator.registry import Worker
from rlfabric.services.coordinator.run import RunFailed
from rlfabric.services.core.ownership import RUN_KEY_METADATA
from rlfabric.services.core.proto.rlfabric.v1 import (
    env_pb2_grpc,
    learner_pb2_grpc,
    replay_pb2_grpc,
    rollout_pb2_grpc,
)
from rlfabric.services.core.runtime import channel

STUBS = {
    "env": env_pb2_grpc.EnvStub, "replay": replay_pb2_grpc.ReplayStub,
    "learner": learner_pb2_grpc.LearnerStub, "rollout": rollout_pb2_grpc.RolloutStub,
}


@dataclass
class Stage:
    """A worker taking part in a run and the stub the coordinator drives it with. Every call carries the run's key
    (``run_key``): a worker the run holds takes Configure and admin calls only with it (services/core/ownership.py),
    so another token holder who knows the run's id cannot reconfigure the run's workers."""

    worker: Worker
    channel: grpc.aio.Channel
    stub: object
    run_key: str = ""

    @classmethod
    def of(cls, worker: Worker, run_key: str = "") -> Stage:
        ch = channel(worker.grpc)
        return cls(worker, ch, STUBS[worker.role](ch), run_key)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RUN_KEY_METADATA, self.run_key),) if self.run_key else ()


class Unresponsive(RunFailed):
    """The worker did not answer a call within the call's deadline, or (Train, Collect: plan.py) showed no progress
    within its liveness window: wedged, while its heartbeats and health check may still say it is fine."""

    def __init__(self, reason: str, worker: Worker, method: str, window_s: float):
        super().__init__(reason)
        self.worker, self.method, self.window_s = worker, method, window_s


async def rpc(stage: Stage, method: str, request, timeout: float | None = None):
    """Call a worker; any failure becomes a RunFailed that names the worker, the call and the cause (Unresponsive
    when the call's own deadline passed)."""
    started = time.monotonic()
    try:
        return await getattr(stage.stub, method)(request, timeout=timeout, metadata=stage.metadata())
    except grpc.aio.AioRpcError as exc:
        detail = exc.details() or exc.code().name
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None and \
                time.monotonic() - started >= 0.9 * timeout:  # ours, not a worker's report on its own peers
            raise Unresponsive(f"{stage.worker.describe()}: {method} got no answer within its {timeout:.0f}s "
                               f"deadline", stage.worker, method, timeout) from None
        if exc.code() == grpc.StatusCode.UNAVAILABLE and not await healthy(stage):
            # its control plane is gone: never place work on it again (if it lives, its next heartbeat is
            # refused and it registers anew); a live worker reporting an unreachable peer stays placeable
            stage.worker.alive = False
        raise RunFailed(f"{stage.worker.describe()}: {method} failed: {detail}",
                        bad_input=exc.code() == grpc.StatusCode.INVALID_ARGUMENT) from None


async def healthy(stage: Stage, timeout_s: float = 1.0) -> bool:
    """The worker's standard gRPC health service answers SERVING."""
    try:
        reply = await health_pb2_grpc.HealthStub(stage.channel).Check(health_pb2.HealthCheckRequest(),
                                                                      timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def watched(stage: Stage, method: str, request, run, window_s: float):
    """A long call (Train, Collect, WarmStart) for as long as its worker shows progress; one that stalls past
    ``window_s``, or whose heartbeats stop, is lost to ``run`` (appended to ``run.lost``: the attempt ends and the
    run recovers without it, or fails), never waited on forever. The work's length never decides: only silence."""
    worker = stage.worker
    started = time.monotonic()
    call = asyncio.ensure_future(rpc(stage, method, request))
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=min(1.0, window_s / 4))
            if done:
                return call.result()
            stalled = worker.stalled_for(started)
            if worker.alive and stalled <= window_s:
                continue
            wait, lively = run.config.data_plane.timeout_s, run.config.runtime.liveness_s
            why = (f"stopped sending heartbeats during {method}" if not worker.alive else
                   f"showed no progress in {method} for {stalled:.0f}s (no compute, no data-plane messages; its "
                   f"window is data_plane.timeout_s={wait:g} for its waits on peers + runtime.liveness_s="
                   f"{lively:g}): wedged. If its work really waits that long, raise runtime.liveness_s")
            run.lost.append((worker, why))
            run.log(f"{worker.describe()} {why}", level="warning")
            raise Unresponsive(f"{worker.describe()}: {why}", worker, method, window_s)
    finally:
        if not call.done():
            call.cancel()  # the worker is told its caller went away (its Train stops waiting for shards)
