"""The replay service's faces: gRPC control (Configure, GetStats, Clear) and the data plane.

Data-plane requests:
  put  batch(version)                 -> ack {puts, transitions}     (acknowledged only once stored)
  get  {min_version, wait_s}          -> batch | empty                (on-policy FIFO, long-poll)
  sample {n, seed?}                   -> batch of n transitions       (uniform, off-policy)
"""

from __future__ import annotations

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
from services.core.proto.rlfabric.v1 import common_pb2, replay_pb2, replay_pb2_grpc
from services.core.runtime import ServiceRuntime, run_service
from services.replay.stores.memory import MemoryStore

log = logging.getLogger(__name__)
PUTS = Counter("rlfabric_replay_puts_total", "trajectory batches stored")
TRANSITIONS = Gauge("rlfabric_replay_transitions", "transitions stored")


@dataclass
class _Waiting:
    deadline: float
    min_version: int
    reply: Reply


class ReplayService(replay_pb2_grpc.ReplayServicer):
    def __init__(self, runtime: ServiceRuntime, host: str):
        self.runtime = runtime
        self.lock = threading.Lock()
        self.store = MemoryStore(RunConfig().replay.capacity_transitions)
        self.rng = np.random.default_rng(0)
        self.waiting: list[_Waiting] = []
        self.data = DataServer(host, max_bytes=RunConfig().data_plane.max_message_bytes, name="replay")
        runtime.data_endpoint = self.data.endpoint
        self.data.start(self.handle, self.tick)
        runtime.on_shutdown(self.data.stop)

    def handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
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
        keep = []
        for w in self.waiting:
            found = self.store.take_onpolicy(w.min_version) if self.store.pending else None
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
        with self.lock:
            self.store = MemoryStore(config.replay.capacity_transitions)
            self.rng = np.random.default_rng(config.seed)
            self.data.max_bytes = config.data_plane.max_message_bytes
            for w in self.waiting:
                w.reply.error("replay was reconfigured for a new run; request again")
            self.waiting = []
        self.runtime.state = f"busy:{request.run_id}"
        log.info("configured", extra={"run_id": request.run_id, "store": config.replay.store})
        return common_pb2.ConfigureReply(data_endpoint=self.data.endpoint)

    async def GetStats(self, request, context):
        with self.lock:
            return self._stats()

    async def Clear(self, request, context):
        with self.lock:
            self.store.clear()
            return self._stats()


async def _build(runtime: ServiceRuntime, args) -> None:
    replay_pb2_grpc.add_ReplayServicer_to_server(ReplayService(runtime, args.host), runtime.server)


def main(argv: list[str] | None = None) -> None:
    run_service("replay", _build, argv)


if __name__ == "__main__":
    main()
