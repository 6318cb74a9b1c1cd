"""WatchRun ends with the run's final status even when the run ends while its history is being sent."""

from __future__ import annotations

import asyncio

from rlfabric.services.coordinator.run import Run
from rlfabric.services.coordinator.server import CoordinatorService
from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2


def _watch(run: Run, during_history) -> list[coordinator_pb2.RunEvent]:
    service = CoordinatorService.__new__(CoordinatorService)  # only the run table is needed here
    service.runs, service.max_watchers = {run.run_id: run}, 256

    async def main():
        events = []
        async for event in service.WatchRun(coordinator_pb2.RunRef(run_id=run.run_id), None):
            events.append(event)
            if len(events) == 1:
                during_history()
        return events

    return asyncio.run(asyncio.wait_for(main(), 5))


def test_a_run_that_fails_while_history_is_sent_still_delivers_its_final_status(tmp_path):
    run = Run("r", RunConfig(), tmp_path)
    run.set_state(coordinator_pb2.RUNNING, "workers: env-0, learner-1")
    run.log("configured")
    events = _watch(run, lambda: run.set_state(coordinator_pb2.FAILED, "unknown env id", bad_input=True))
    statuses = [e.status for e in events if e.HasField("status")]
    assert statuses[-1].state == coordinator_pb2.FAILED and statuses[-1].reason == "unknown env id"


def test_a_finished_run_replays_its_history_and_ends(tmp_path):
    run = Run("r", RunConfig(), tmp_path)
    run.set_state(coordinator_pb2.RUNNING)
    run.set_state(coordinator_pb2.SUCCEEDED, "done")
    events = _watch(run, lambda: None)
    assert [e.status.state for e in events] == [coordinator_pb2.RUNNING, coordinator_pb2.SUCCEEDED]
