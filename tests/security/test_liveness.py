"""Liveness, not stopwatches (issue 40): a Train or Collect call is judged by its worker's progress, never by its
length. A worker that stops showing progress while its heartbeats and health check say it is fine (wedged), or
whose heartbeats stop (frozen), is lost to the run within its window, loudly, and the run recovers; a worker that
works for as long as its work takes is never lost for it."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from rlfabric.services.coordinator.plan import PlanExecutor
from rlfabric.services.coordinator.registry import BUSY_CPU_SHARE, Worker
from rlfabric.services.coordinator.run import Run, RunFailed
from rlfabric.services.coordinator.stages import Unresponsive
from rlfabric.services.core.proto.rlfabric.v1 import (
    coordinator_pb2,
    learner_pb2,
    learner_pb2_grpc,
    rollout_pb2_grpc,
)
from tests.conftest import short_config

pytestmark = pytest.mark.serial  # liveness windows and heartbeats in seconds: never beside another test

# data_plane.timeout_s 0.5 + runtime.liveness_s 0.5: a 1 s window, at a scale a unit test can wait for
QUICK = {"data_plane": {"timeout_s": 0.5}, "runtime__liveness_s": 0.5}


class _Wedged:
    """A call that never answers; it notices when its caller gives up."""

    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def hang(self, request, context):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def _serve(add, servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _worker(role: str, address: str) -> Worker:
    return Worker(f"{role}-0", role, address, "", "", os.getpid(), "localhost")


def test_a_learner_whose_train_shows_no_progress_is_lost_within_its_window(tmp_path):
    wedged = _Wedged()

    class Learner(learner_pb2_grpc.LearnerServicer):
        Train = wedged.hang

    async def scenario() -> tuple[Run, Worker, float, BaseException]:
        server, address = await _serve(learner_pb2_grpc.add_LearnerServicer_to_server, Learner())
        worker = _worker("learner", address)
        run = Run("wedged-learner", short_config(**QUICK), tmp_path)
        plan = PlanExecutor(run, {"learner": [worker]})
        assert plan.liveness_window() == 1.0
        started = time.monotonic()
        try:
            # (before deadlines, this call waited forever: the outer bound only keeps the test from hanging)
            await asyncio.wait_for(plan._train(0, 0), 20)
        except RunFailed as exc:
            error: BaseException = exc
        took = time.monotonic() - started
        await asyncio.wait_for(wedged.cancelled.wait(), 5)  # the learner is told to stop waiting for its batch
        await plan.close()
        await server.stop(None)
        return run, worker, took, error

    run, worker, took, error = asyncio.run(scenario())
    assert isinstance(error, Unresponsive) and error.worker is worker and error.method == "Train"
    assert took < 5, f"the wedged Train was given up after {took:.1f}s (window 1s)"
    assert [w for w, _ in run.lost] == [worker]  # the run's recovery path takes it from here: a lost worker
    why = run.lost[0][1]
    assert "showed no progress in Train" in why and "runtime.liveness_s" in why and "data_plane.timeout_s" in why
    assert any(e.log.level == "warning" and "showed no progress in Train" in e.log.message for e in run.history)


def test_a_rollout_whose_collect_shows_no_progress_is_lost_within_its_window(tmp_path):
    wedged = _Wedged()

    class Rollout(rollout_pb2_grpc.RolloutServicer):
        Collect = wedged.hang

    async def scenario() -> tuple[Run, Worker, BaseException]:
        server, address = await _serve(rollout_pb2_grpc.add_RolloutServicer_to_server, Rollout())
        worker = _worker("rollout", address)
        run = Run("wedged-rollout", short_config(**QUICK), tmp_path)
        plan = PlanExecutor(run, {"rollout": [worker], "learner": [_worker("learner", "127.0.0.1:9")]})
        try:
            async for _ in plan._turns(0, 1):
                pass
        except RunFailed as exc:
            error: BaseException = exc
        await plan.close()
        await server.stop(None)
        return run, worker, error

    run, worker, error = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert isinstance(error, Unresponsive) and error.method == "Collect"
    assert run.lost and run.lost[0][0] is worker and "showed no progress in Collect" in run.lost[0][1]


def test_a_timeout_the_worker_reports_itself_is_not_mistaken_for_a_wedged_worker(tmp_path):
    """The learner answers DEADLINE_EXCEEDED itself when a batch's shards do not come (its peers' fault): that is a
    failure of the call, probed as before, not a loss of the learner."""

    class Learner(learner_pb2_grpc.LearnerServicer):
        async def Train(self, request, context):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no shards of batch 0 from replay within 0.5s")

    async def scenario() -> tuple[Run, BaseException]:
        server, address = await _serve(learner_pb2_grpc.add_LearnerServicer_to_server, Learner())
        run = Run("slow-peers", short_config(**QUICK), tmp_path)
        plan = PlanExecutor(run, {"learner": [_worker("learner", address)]})
        try:
            await plan._train(0, 0)
        except RunFailed as exc:
            error: BaseException = exc
        await plan.close()
        await server.stop(None)
        return run, error

    run, error = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert not isinstance(error, Unresponsive) and "no shards of batch 0" in error.reason
    assert run.lost == []


def test_a_train_that_shows_progress_runs_as_long_as_it_takes(tmp_path):
    """A Train that lasts 4 windows, its worker's heartbeats showing work throughout (as a real learner's CPU time
    does): it completes, and nobody is lost. Under the old rule (a deadline on the call) it was given up."""
    train_s = 4.0

    class Learner(learner_pb2_grpc.LearnerServicer):
        async def Train(self, request, context):
            await asyncio.sleep(train_s)
            return learner_pb2.TrainReply(weight_version=7)

    async def scenario():
        server, address = await _serve(learner_pb2_grpc.add_LearnerServicer_to_server, Learner())
        worker = _worker("learner", address)
        run = Run("slow-update", short_config(**QUICK), tmp_path)
        plan = PlanExecutor(run, {"learner": [worker]})

        async def heartbeats():  # what the registry hears every 0.25 s from a worker using a whole core
            cpu = 0.0
            while True:
                await asyncio.sleep(0.25)
                cpu += 0.25
                worker.note(cpu, 0)

        beating = asyncio.create_task(heartbeats())
        started = time.monotonic()
        reply = await plan._train(0, 0)
        took = time.monotonic() - started
        beating.cancel()
        await plan.close()
        await server.stop(None)
        return run, reply, took

    run, reply, took = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert reply.weight_version == 7 and took >= train_s and run.lost == []


def test_what_counts_as_progress():
    """An idle service's CPU (heartbeats, gRPC threads: under 1 % of a core) is no progress; a data-plane message
    is, and so is a CPU share of BUSY_CPU_SHARE or more since the last progress."""
    worker = _worker("rollout", "127.0.0.1:9")
    t0 = worker.progressed_at
    worker.note(cpu_s=0.01, messages=0, now=t0 + 2.0)  # 0.5 % of a core for 2 s
    assert worker.progressed_at == t0 and worker.stalled_for(t0, now=t0 + 2.0) == 2.0
    worker.note(cpu_s=0.01, messages=1, now=t0 + 3.0)  # an env step's answer arrived (a slow real robot)
    assert worker.progressed_at == t0 + 3.0
    worker.note(cpu_s=0.01 + BUSY_CPU_SHARE * 4.0, messages=1, now=t0 + 7.0)  # 4 s at the busy share
    assert worker.progressed_at == t0 + 7.0
    worker.note(cpu_s=0.01 + BUSY_CPU_SHARE * 4.0 + 0.001, messages=1, now=t0 + 9.0)
    assert worker.stalled_for(t0, now=t0 + 9.0) == 2.0  # counted from the last progress, not the call's start


def _run_with_learner(mode: str, tmp_path, monkeypatch):
    """A CartPole run on a local stack (supervised, as `rlfabric train` runs it) whose learner misbehaves as
    tests/security/wedged_learner.py's ``mode`` says; returns the final status, the run's events, the seconds from
    submit to the end, the marker file, and the stack's restarts."""
    from rlfabric.services.coordinator.client import CoordinatorClient
    from rlfabric.services.launcher import LocalStack

    spawn = LocalStack._spawn

    def wedged_learner(self, name: str, module: str, args: list[str]):  # started as the launcher starts any learner
        return spawn(self, name, "tests.security.wedged_learner" if name == "learner" else module, args)

    monkeypatch.setattr(LocalStack, "_spawn", wedged_learner)
    marker = tmp_path / "wedged"
    monkeypatch.setenv("WEDGE_MARKER", str(marker))
    monkeypatch.setenv("WEDGE_MODE", mode)
    stack = LocalStack(log_dir=tmp_path / "logs", runs_root=tmp_path, roles=("env", "replay", "rollout"),
                       heartbeat_timeout_s=3.0)
    stack.start()
    stack.supervise()
    client = CoordinatorClient(stack.address)  # (starting the stack made its secret this process's)
    try:
        client.wait_ready(30)
        stack.start_worker("learner")
        cfg = short_config(data_plane={"timeout_s": 1}, train={"total_env_steps": 320, "eval_every_iterations": 0},
                           checkpoint={"every_iterations": 1},
                           runtime={"worker_wait_s": 60, "max_recoveries": 1, "liveness_s": 1})
        status = client.submit(cfg)
        started = time.monotonic()
        final = client.wait(status.run_id)
        took = time.monotonic() - started
        events = list(client.watch(status.run_id))
        return final, events, took, marker, dict(stack.restarts)
    finally:
        client.close()
        stack.stop()


def _logs(events) -> list[str]:
    return [e.log.message for e in events if e.HasField("log")]


def test_a_run_whose_learner_is_stuck_recovers_on_a_fresh_learner(tmp_path, monkeypatch):
    """A real learner whose Train blocks for good and ignores its caller giving up (heartbeats and health SERVING
    throughout): it shows no progress, the coordinator loses it within its window (data_plane.timeout_s 1 +
    runtime.liveness_s 1), the learner learns from its next heartbeat that it was lost while its work still runs
    and exits, the stack restarts it, and the run recovers on the fresh learner and completes."""
    final, events, took, marker, restarts = _run_with_learner("stuck", tmp_path, monkeypatch)
    assert final.state == coordinator_pb2.SUCCEEDED, (final.reason, _logs(events))
    assert marker.exists() and final.recoveries == 1, _logs(events)
    recoveries = [e.recovery for e in events if e.HasField("recovery")]
    assert recoveries[0].role == "learner" and "showed no progress in Train" in recoveries[0].cause, recoveries
    assert restarts.get("learner") == 1, restarts  # the stuck process ended itself, and a clean one took over
    stderr = (tmp_path / "logs" / "learner.log").read_text()
    assert "declared this worker lost while 1 call(s) still run here: exiting with code 75" in stderr
    assert took < 100, f"the run took {took:.0f}s (one 2s window, a restart, then a recovery)"


@pytest.mark.slow
def test_a_learner_update_twice_the_old_deadline_completes(tmp_path, monkeypatch):
    """A learner whose Train of batch 1 computes for 24 s: twice (and more) the 11 s deadline the old rule gave this
    run's config (data_plane.timeout_s 1 + the largest of 1 and 10 x 1), and 12 of its liveness windows (2 s). Its
    heartbeats show its CPU time throughout, so it is never lost, and the run completes without a recovery."""
    final, events, took, marker, restarts = _run_with_learner("busy:24", tmp_path, monkeypatch)
    assert final.state == coordinator_pb2.SUCCEEDED, (final.reason, _logs(events))
    assert marker.exists() and final.recoveries == 0 and not restarts, (_logs(events), restarts)
    assert took >= 24


@pytest.mark.slow
def test_a_frozen_learner_is_lost_within_its_window_and_the_run_recovers(tmp_path, monkeypatch):
    """A learner that SIGSTOPs itself in its Train of batch 1: its heartbeats and its progress stop, so the
    coordinator declares it lost within its window (whichever comes first: no progress for 2 s, no heartbeat for
    3 s); the stack kills the frozen process (it never comes back on its own) and restarts it, and the run recovers
    on it and completes."""
    final, events, took, marker, restarts = _run_with_learner("frozen", tmp_path, monkeypatch)
    assert final.state == coordinator_pb2.SUCCEEDED, (final.reason, _logs(events))
    assert marker.exists() and final.recoveries == 1, _logs(events)
    recoveries = [e.recovery for e in events if e.HasField("recovery")]
    cause = recoveries[0].cause
    assert recoveries[0].role == "learner" and ("showed no progress in Train for 2s" in cause
                                                or "stopped sending heartbeats for 3.0s" in cause), recoveries
    assert restarts.get("learner") == 1, restarts
