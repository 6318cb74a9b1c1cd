"""Which run holds a worker: a Configure for another run while one holds it is refused, so one client cannot take
over the workers of another's run.

The worker learns its holder from the coordinator's heartbeat replies (``ServiceRuntime.owner_run``). That copy
lags: the coordinator places a worker and configures it before the next heartbeat, and a worker freed by a
finished run still names it for up to one heartbeat interval. So a Configure whose run is not the holder the last
heartbeat named asks the coordinator again (one Heartbeat call) before it refuses anything.
"""

from __future__ import annotations

import hmac
import logging

import grpc

from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2, coordinator_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime, channel, set_process_title

log = logging.getLogger(__name__)


RUN_KEY_METADATA = "rlfabric-run-key"  # what the coordinator's calls for a run carry: that run's key


async def _ask(runtime: ServiceRuntime) -> None:
    """The coordinator's answer now (one Heartbeat call): the run that holds this worker, and its key."""
    try:
        async with channel(runtime.options.coordinator) as ch:
            reply = await coordinator_pb2_grpc.CoordinatorStub(ch).Heartbeat(coordinator_pb2.HeartbeatRequest(
                worker_id=runtime.worker_id, state=runtime.state, worker_key=runtime.worker_key), timeout=5)
        runtime.owner_key = reply.run_key
        if reply.run_id != runtime.owner_run:  # as a heartbeat's reply would: the process title follows
            runtime.owner_run = reply.run_id
            set_process_title(runtime.options.role, reply.run_id, runtime.port)
    except grpc.aio.AioRpcError as exc:  # the last heartbeat's answer stands
        log.warning("cannot ask the coordinator which run holds this worker (%s); going by the last heartbeat",
                    exc.details() or exc.code().name)


async def holder(runtime: ServiceRuntime, run_id: str) -> str:
    """The run that holds this worker now and is not ``run_id`` ("" when none does, or for a worker that
    registers with no coordinator: nothing places it, so nothing holds it)."""
    if not runtime.options.coordinator or not runtime.worker_id or runtime.owner_run == run_id:
        return ""
    await _ask(runtime)
    owner = runtime.owner_run
    return owner if owner and owner != run_id else ""


def _has_key(runtime: ServiceRuntime, context) -> bool:
    given = dict(context.invocation_metadata() or ()).get(RUN_KEY_METADATA, "")
    return bool(runtime.owner_key) and hmac.compare_digest(runtime.owner_key.encode(),
                                                           given.encode(errors="replace"))


async def check_owner(runtime: ServiceRuntime, run_id: str, context) -> None:
    """Abort ``context`` with FAILED_PRECONDITION when another run holds this worker, and with PERMISSION_DENIED
    when a call names the run that holds it without that run's key: a run id is no secret (ListWorkers shows it),
    and only the coordinator that placed the worker has the key."""
    owner = await holder(runtime, run_id)
    if owner:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this {runtime.options.role} worker is held by run {owner}; run {run_id or '(none)'!r} "
                            f"may not configure it. Fix: submit the run to the coordinator (it places it on idle "
                            f"workers), or stop run {owner} first (rlfabric stop {owner})")
    if not runtime.owner_run or runtime.owner_run != run_id or _has_key(runtime, context):
        return
    await _ask(runtime)  # the key may have changed (a restarted coordinator took the run up again)
    if runtime.owner_run == run_id and not _has_key(runtime, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"this {runtime.options.role} worker is held by run {run_id}, and this call does not "
                            f"carry that run's key: only the coordinator that placed the worker drives it. Fix: "
                            f"act on the run through the coordinator (rlfabric status / stop {run_id})")
