"""Train and Collect have deadlines (issue 19, finding 11): a learner or rollout worker that stops answering while
its heartbeats and health check say it is fine makes the run recover (or fail) within the deadline, loudly,
instead of hanging it forever."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from services.coordinator import plan as plan_module
from services.coordinator.plan import PlanExecutor
from services.coordinator.registry import Worker
from services.coordinator.run import Run, RunFailed
from services.coordinator.stages import Unresponsive
from services.core.proto.rlfabric.v1 import coordinator_pb2, learner_pb2_grpc, rollout_pb2_grpc
from tests.conftest import short_config

pytestmark = pytest.mark.serial  # deadlines and health windows in seconds: never beside another test


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


@pytest.fixture
def quick_deadlines(monkeypatch):
    """Deadline = data_plane.timeout_s (0.5) + 0.5 s of work (runtime.min_work_s in each test's config): the rule,
    at a scale a unit test can wait for."""
    monkeypatch.setattr(plan_module, "WORK_FACTOR", 1.0)


def test_a_learner_whose_train_never_returns_is_lost_within_the_deadline(quick_deadlines, tmp_path):
    wedged = _Wedged()

    class Learner(learner_pb2_grpc.LearnerServicer):
        Train = wedged.hang

    async def scenario() -> tuple[Run, Worker, float, BaseException]:
        server, address = await _serve(learner_pb2_grpc.add_LearnerServicer_to_server, Learner())
        worker = _worker("learner", address)
        run = Run("wedged-learner", short_config(data_plane={"timeout_s": 0.5}, runtime__min_work_s=0.5), tmp_path)
        plan = PlanExecutor(run, {"learner": [worker]})
        assert plan.deadline("Train") == 1.0
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
    assert took < 5, f"the wedged Train was given up after {took:.1f}s (deadline 1s)"
    assert [w for w, _ in run.lost] == [worker]  # the run's recovery path takes it from here: a lost worker
    why = run.lost[0][1]
    assert "did not answer Train within its 1s deadline" in why and "data_plane.timeout_s" in why
    assert any(e.log.level == "warning" and "did not answer Train" in e.log.message for e in run.history)


def test_a_rollout_whose_collect_never_returns_is_lost_within_the_deadline(quick_deadlines, tmp_path):
    wedged = _Wedged()

    class Rollout(rollout_pb2_grpc.RolloutServicer):
        Collect = wedged.hang

    async def scenario() -> tuple[Run, Worker, BaseException]:
        server, address = await _serve(rollout_pb2_grpc.add_RolloutServicer_to_server, Rollout())
        worker = _worker("rollout", address)
        run = Run("wedged-rollout", short_config(data_plane={"timeout_s": 0.5}, runtime__min_work_s=0.5), tmp_path)
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
    assert run.lost and run.lost[0][0] is worker and "did not answer Collect" in run.lost[0][1]


def test_a_timeout_the_worker_reports_itself_is_not_mistaken_for_a_wedged_worker(quick_deadlines, tmp_path):
    """The learner answers DEADLINE_EXCEEDED itself when a batch's shards do not come (its peers' fault): that is a
    failure of the call, probed as before, not a loss of the learner."""

    class Learner(learner_pb2_grpc.LearnerServicer):
        async def Train(self, request, context):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no shards of batch 0 from replay within 0.5s")

    async def scenario() -> tuple[Run, BaseException]:
        server, address = await _serve(learner_pb2_grpc.add_LearnerServicer_to_server, Learner())
        run = Run("slow-peers", short_config(data_plane={"timeout_s": 0.5}, runtime__min_work_s=0.5), tmp_path)
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


def test_the_deadline_follows_the_data_plane_timeout_and_the_slowest_call(tmp_path):
    run = Run("rule", short_config(data_plane={"timeout_s": 30}), tmp_path)
    plan = PlanExecutor(run, {})
    assert plan.deadline("Train") == 30 + 300  # the wait, and ten times it for the work
    plan.slowest["Train"] = 200.0  # calls that legitimately grew: three times the slowest
    assert plan.deadline("Train") == 30 + 600 and plan.deadline("Collect") == 330
    assert PlanExecutor(Run("tiny", short_config(data_plane={"timeout_s": 0.1}), tmp_path), {}).deadline(
        "Collect") == pytest.approx(30.1)  # work never gets less than runtime.min_work_s
    assert PlanExecutor(Run("tiny", short_config(data_plane={"timeout_s": 0.1}, runtime__min_work_s=5), tmp_path),
                        {}).deadline("Collect") == pytest.approx(5.1)


def test_a_run_whose_learner_wedges_recovers_instead_of_hanging(tmp_path, monkeypatch):
    """A real learner whose Train blocks (heartbeats and health SERVING throughout): the coordinator gives up on it
    at the deadline, the run recovers and completes."""
    from services.coordinator.client import CoordinatorClient
    from services.launcher import LocalStack

    spawn = LocalStack._spawn

    def wedged_learner(self, name: str, module: str, args: list[str]):  # started as the launcher starts any learner
        return spawn(self, name, "tests.security.wedged_learner" if name == "learner" else module, args)

    monkeypatch.setattr(LocalStack, "_spawn", wedged_learner)
    marker = tmp_path / "wedged"
    monkeypatch.setenv("WEDGE_MARKER", str(marker))
    stack = LocalStack(log_dir=tmp_path / "logs", runs_root=tmp_path, roles=("env", "replay", "rollout"),
                       heartbeat_timeout_s=3.0)
    stack.start()
    client = CoordinatorClient(stack.address)  # (starting the stack made its secret this process's)
    try:
        client.wait_ready(30)
        stack.start_worker("learner")
        cfg = short_config(data_plane={"timeout_s": 1}, train={"total_env_steps": 320, "eval_every_iterations": 0},
                           checkpoint={"every_iterations": 1},
                           runtime={"worker_wait_s": 60, "max_recoveries": 1, "min_work_s": 1})
        status = client.submit(cfg)
        started = time.monotonic()
        final = client.wait(status.run_id)
        took = time.monotonic() - started
        events = list(client.watch(status.run_id))
        logs = [e.log.message for e in events if e.HasField("log")]
        assert final.state == coordinator_pb2.SUCCEEDED, (final.reason, logs)
        assert marker.exists() and final.recoveries == 1, logs
        recoveries = [e.recovery for e in events if e.HasField("recovery")]
        assert recoveries[0].role == "learner", recoveries
        # data_plane.timeout_s 1 + the largest of runtime.min_work_s 1 and 10 x 1: an 11 s deadline
        assert "did not answer Train within its 11s deadline" in recoveries[0].cause, recoveries
        assert took < 100, f"the run took {took:.0f}s (one 11s deadline, then a recovery)"
    finally:
        client.close()
        stack.stop()
