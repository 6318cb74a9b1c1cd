"""The replay service's faces: gRPC control (Configure, GetStats, Clear) and the data plane.

Data-plane requests:
  put  batch(version)                 -> ack {puts, transitions}     (acknowledged only once stored)
  get  {min_version, wait_s}          -> batch | empty                (on-policy FIFO, long-poll)
  sample {n, seed?}                   -> batch of n transitions       (uniform, off-policy)

The store is the one ``replay.store`` names (memory, or Redis so the data outlives this process); a store that
cannot do its job (Redis lost beyond the retries) answers with an error naming the config field and the fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
from prometheus_client import Counter, Gauge

from services.core.batch import TensorBatch
from services.core.config import ConfigError, RunConfig
from services.core.dataplane import DataServer, Reply
from services.core.objectstore import open_store
from services.core.proto.rlfabric.v1 import common_pb2, replay_pb2, replay_pb2_grpc
from services.core.runtime import ServiceRuntime, run_service
from services.replay.stores import ReplayStore, open_replay_store
from services.replay.stores.memory import MemoryStore
from services.replay.stores.redis import ReplayStoreError, ReplayStoreUnavailable

log = logging.getLogger(__name__)
PUTS = Counter("rlfabric_replay_puts_total", "trajectory batches stored")
TRANSITIONS = Gauge("rlfabric_replay_transitions", "transitions stored")
STORE_ERRORS = Counter("rlfabric_replay_store_errors_total", "requests the store could not serve (e.g. Redis lost)")


@dataclass
class _Waiting:
    deadline: float
    min_version: int
    reply: Reply


class ReplayService(replay_pb2_grpc.ReplayServicer):
    def __init__(self, runtime: ServiceRuntime, host: str):
        self.runtime = runtime
        self.lock = threading.Lock()
        self.store: ReplayStore = MemoryStore(RunConfig().replay.capacity_transitions)
        self.rng = np.random.default_rng(0)
        self.waiting: list[_Waiting] = []
        self.data = DataServer(host, max_bytes=RunConfig().data_plane.max_message_bytes, name="replay",
                               advertise_host=runtime.advertise_host)
        runtime.data_endpoint = self.data.endpoint
        self.data.start(self.handle, self.tick)
        runtime.on_shutdown(lambda: self.store.close())  # hooks run in reverse: the data plane stops first
        runtime.on_shutdown(self.data.stop)

    def handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        try:
            self._handle(kind, batch, reply)
        except ReplayStoreError as exc:
            STORE_ERRORS.inc()
            log.error("replay store failed on '%s': %s", kind, exc)
            reply.error(f"replay: '{kind}' failed: {str(exc).removeprefix('replay: ')}")

    def _handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        with self.lock:
            if kind == "put":
                puts = self.store.put(batch)
                PUTS.inc()
                TRANSITIONS.set(self.store.transitions)
                reply.send("ack", TensorBatch(meta={"puts": puts, "transitions": self.store.transitions}))
                self._serve_waiting()
            elif kind == "get":
                min_version = int(batch.meta.get("min_version", 0))
                found = self.store.take_onpolicy(min_version)
                if found is not None:
                    reply.send("batch", TensorBatch(found.tensors, meta=found.meta, version=found.version))
                elif float(batch.meta.get("wait_s", 0)) > 0:
                    self.waiting.append(_Waiting(time.monotonic() + float(batch.meta["wait_s"]), min_version, reply))
                else:
                    reply.send("empty")
            elif kind == "sample":
                n = int(batch.meta.get("n", 0))
                if n <= 0:
                    raise ValueError("sample needs meta.n > 0 (the number of transitions)")
                reply.send("batch", self.store.sample(n, self.rng))
            else:
                raise ValueError(f"unknown request kind {kind!r}; expected put, get or sample")

    def _serve_waiting(self) -> None:
        """Hand new batches to parked gets. Runs after a put was acknowledged, so a store failure here goes to
        the parked requests, never to the put."""
        keep = []
        for i, w in enumerate(self.waiting):
            try:
                found = self.store.take_onpolicy(w.min_version) if self.store.pending else None
            except ReplayStoreError as exc:
                STORE_ERRORS.inc()
                for failed in self.waiting[i:]:
                    failed.reply.error(f"replay: 'get' failed: {str(exc).removeprefix('replay: ')}")
                break
            if found is not None:
                w.reply.send("batch", TensorBatch(found.tensors, meta=found.meta, version=found.version))
            else:
                keep.append(w)
        self.waiting = keep

    def tick(self) -> None:
        if not self.waiting:
            return
        now = time.monotonic()
        with self.lock:
            expired = [w for w in self.waiting if now >= w.deadline]
            self.waiting = [w for w in self.waiting if now < w.deadline]
        for w in expired:
            w.reply.send("empty")

    def _stats(self) -> replay_pb2.ReplayStats:
        s = self.store
        return replay_pb2.ReplayStats(
            batches=len(s), transitions=s.transitions, capacity=s.capacity, bytes=s.bytes, puts=s.puts,
            onpolicy_gets=s.onpolicy_gets, samples=s.samples, evicted_batches=s.evicted,
            stale_dropped=s.stale_dropped, rejected_messages=self.data.rejected, pending_onpolicy=s.pending,
            newest_version=s.newest_version)

    async def Configure(self, request, context):
        try:
            config = RunConfig.from_json(request.config_json)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            ctx = json.loads(request.context_json) if request.context_json else {}
            run_dir = str(ctx.get("run_dir") or "") if isinstance(ctx, dict) else ""
        except json.JSONDecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"context_json is not valid JSON ({exc}). Fix: send "
                                                                  f'{{"run_dir": ..., "env_spec": ...}}')
        try:  # may wait up to replay.connect_timeout_s: keep the event loop (health, heartbeats) serving
            store = await asyncio.to_thread(self._open_store, config, request.run_id, run_dir)
        except ReplayStoreError as exc:
            code = (grpc.StatusCode.INVALID_ARGUMENT if exc.bad_input else grpc.StatusCode.UNAVAILABLE
                    if isinstance(exc, ReplayStoreUnavailable) else grpc.StatusCode.FAILED_PRECONDITION)
            await context.abort(code, str(exc))
        except ConfigError as exc:  # the object store's storage.* settings (ObjectStoreError)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"replay: cannot open the object store: {exc}")
        except (ValueError, OSError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replay: cannot open replay.store="
                                                                     f"{config.replay.store!r}: {exc}")
        old = await asyncio.to_thread(self._swap, store, config)
        if old is not store:
            await asyncio.to_thread(old.close)
        self.runtime.state = f"busy:{request.run_id}"
        log.info("configured", extra={"run_id": request.run_id, "store": config.replay.store,
                                      "batches": len(store), "pending": store.pending})
        return common_pb2.ConfigureReply(data_endpoint=self.data.endpoint)

    @staticmethod
    def _open_store(config: RunConfig, run_id: str, run_dir: str) -> ReplayStore:
        """The configured store. Redis reopens what an earlier replay service stored under this run_id; its large
        tensors go to the run's object store (none without a run_dir or storage.root: they then stay in Redis)."""
        objects = None
        if config.replay.store == "redis" and (run_dir or config.storage.root or config.storage.kind != "filesystem"):
            objects = open_store(config.storage, run_dir, run_id=run_id)
        return open_replay_store(config, run_id, objects)

    def _swap(self, store: ReplayStore, config: RunConfig) -> ReplayStore:
        with self.lock:
            old, self.store = self.store, store
            self.rng = np.random.default_rng(config.seed)
            self.data.max_bytes = config.data_plane.max_message_bytes
            for w in self.waiting:
                w.reply.error("replay was reconfigured for a new run; request again")
            self.waiting = []
            TRANSITIONS.set(store.transitions)
        return old

    def _locked_stats(self) -> replay_pb2.ReplayStats:
        with self.lock:
            return self._stats()

    def _locked_clear(self) -> replay_pb2.ReplayStats:
        with self.lock:
            self.store.clear()
            return self._stats()

    async def GetStats(self, request, context):
        return await asyncio.to_thread(self._locked_stats)

    async def Clear(self, request, context):
        try:
            return await asyncio.to_thread(self._locked_clear)
        except ReplayStoreError as exc:
            STORE_ERRORS.inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE if isinstance(exc, ReplayStoreUnavailable)
                                else grpc.StatusCode.FAILED_PRECONDITION, str(exc))


async def _build(runtime: ServiceRuntime, args) -> None:
    replay_pb2_grpc.add_ReplayServicer_to_server(ReplayService(runtime, args.host), runtime.server)


def main(argv: list[str] | None = None) -> None:
    run_service("replay", _build, argv)


if __name__ == "__main__":
    main()
