"""Finding 8, ownership: every worker's Configure checks that the caller's run holds the worker. A Configure for
another run while one holds it is refused (FAILED_PRECONDITION naming the holder); the worker asks the coordinator
before it refuses, so a run placed (or a worker freed) since the last heartbeat is not refused by a stale copy. A
Configure naming the holder must carry the holder's key (issue 39: a run id is no secret), else PERMISSION_DENIED."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.conftest import Aborted, AbortingContext, short_config


class _Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """A coordinator that says which run holds the worker (``holder``) and counts the questions."""

    def __init__(self, holder: str):
        self.holder, self.asked = holder, 0

    async def Heartbeat(self, request, context):
        self.asked += 1
        return coordinator_pb2.HeartbeatReply(known=True, run_id=self.holder, run_key=key_of(self.holder))


def key_of(run_id: str) -> str:
    return f"key-of-{run_id}" if run_id else ""


class _Runtime:
    """What a worker service takes from its ServiceRuntime, in-process, registered with ``coordinator``."""

    def __init__(self, role: str, coordinator: str, owner_run: str):
        self.options = SimpleNamespace(role=role, host="127.0.0.1", coordinator=coordinator)
        self.advertise_host, self.data_endpoint, self.port = "127.0.0.1", "", 0
        self.worker_id, self.owner_run, self.state = f"{role}-1", owner_run, "idle"
        self.worker_key, self.owner_key = "worker-key", key_of(owner_run)

    def on_shutdown(self, hook) -> None:
        pass

    def watch(self, component: str, probe) -> None:
        pass


def _service(role: str, runtime):
    if role == "env":
        from rlfabric.services.env.server import EnvService

        return EnvService(runtime, "127.0.0.1")
    if role == "replay":
        from rlfabric.services.replay.server import ReplayService

        return ReplayService(runtime, "127.0.0.1")
    if role == "rollout":
        from rlfabric.services.rollout.server import RolloutService

        return RolloutService(runtime)
    from rlfabric.services.learner.server import LearnerService

    return LearnerService(runtime, "127.0.0.1", 1)


def _configure(role: str, cached_owner: str, holder: str, run_id: str, key: str | None = None
               ) -> tuple[Aborted | None, int, str]:
    """Configure a ``role`` worker whose last heartbeat named ``cached_owner`` while the coordinator says ``holder``
    holds it, for ``run_id`` (with ``key``, by default that run's, as the coordinator sends it) and a config_json
    that is not JSON: (the abort, questions asked, owner after)."""
    from rlfabric.services.core.ownership import RUN_KEY_METADATA

    key = key_of(run_id) if key is None else key

    async def main():
        server = grpc.aio.server()
        coordinator = _Coordinator(holder)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        runtime = _Runtime(role, f"127.0.0.1:{port}", cached_owner)
        service = _service(role, runtime)
        try:
            await service.Configure(common_pb2.ConfigureRequest(run_id=run_id, config_json="{not json"),
                                    AbortingContext(((RUN_KEY_METADATA, key),)))
            aborted = None
        except Aborted as exc:
            aborted = exc
        finally:
            if role == "replay":
                service.data.stop()
                service._close_stores()
            else:
                service.close()
            await server.stop(0)
        return aborted, coordinator.asked, runtime.owner_run

    return asyncio.run(main())


ROLES = ["env", "replay", "rollout", "learner"]


@pytest.mark.parametrize("role", ROLES)
def test_configure_for_another_run_is_refused_naming_the_holder(role):
    aborted, _, _ = _configure(role, cached_owner="run-a", holder="run-a", run_id="run-b")
    assert aborted is not None and aborted.code == grpc.StatusCode.FAILED_PRECONDITION, aborted
    assert "held by run run-a" in aborted.details and "run-b" in aborted.details


@pytest.mark.parametrize("role", ROLES)
def test_a_run_placed_since_the_last_heartbeat_is_not_refused(role):
    """The coordinator places a worker and configures it before the next heartbeat: the worker's copy still says
    the previous run (or none). It asks the coordinator, which names the new run: the Configure goes on (and fails
    only on its own bad config_json)."""
    for cached in ("", "run-before"):
        aborted, asked, owner = _configure(role, cached_owner=cached, holder="run-b", run_id="run-b")
        assert aborted is not None and aborted.code == grpc.StatusCode.INVALID_ARGUMENT, aborted
        assert asked == 1 and owner == "run-b"


def test_a_worker_freed_since_the_last_heartbeat_takes_the_next_run():
    aborted, asked, owner = _configure("env", cached_owner="run-ended", holder="", run_id="run-next")
    assert aborted.code == grpc.StatusCode.INVALID_ARGUMENT and asked == 1 and owner == ""


def test_the_holder_itself_is_not_asked_about():
    aborted, asked, _ = _configure("replay", cached_owner="run-a", holder="run-a", run_id="run-a")
    assert aborted.code == grpc.StatusCode.INVALID_ARGUMENT and asked == 0


@pytest.mark.parametrize("role", ROLES)
def test_configure_naming_the_holder_without_its_key_is_refused(role):
    """ListWorkers shows which run holds each worker: naming it is not enough. The worker asks the coordinator once
    (a restarted coordinator gives a run a new key) before it refuses."""
    for key in ("", "key-of-run-b"):
        aborted, asked, _ = _configure(role, cached_owner="run-a", holder="run-a", run_id="run-a", key=key)
        assert aborted is not None and aborted.code == grpc.StatusCode.PERMISSION_DENIED, aborted
        assert "run's key" in aborted.details and asked == 1


def test_a_stack_run_still_configures_its_workers(stack, tmp_path):
    """End to end on real processes: a run placed by the coordinator passes its workers' checks."""
    status = stack.client.submit(short_config(train={"total_env_steps": 128, "eval_every_iterations": 0}),
                                 run_dir=tmp_path / "owned")
    final = stack.client.wait(status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
