"""WorkerRegistry: who is registered, who is alive (heartbeats), and which run holds which worker."""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
from dataclasses import dataclass, field

from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2
from rlfabric.services.core.runtime import ROLE_NAMES


@dataclass
class Worker:
    worker_id: str
    role: str
    grpc: str
    data: str
    metrics: str
    pid: int
    host: str
    labels: dict[str, str] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    run_id: str = ""
    key: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # its heartbeats carry it (and only it has it)
    # Progress (services/core/progress.py), as its heartbeats report it: when it last showed work, and the marks
    # that work is measured from.
    progressed_at: float = field(default_factory=time.monotonic)
    messages: int = 0
    _mark_cpu_s: float = 0.0
    _mark_at: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        return f"{self.role} worker {self.worker_id} (pid {self.pid} on {self.host}, {self.grpc})"

    def note(self, cpu_s: float, messages: int, now: float | None = None) -> None:
        """A heartbeat's signs of work. It progressed if a data-plane message arrived since the last heartbeat, or
        if it used at least BUSY_CPU_SHARE of a core since its last progress: an idle service (its heartbeats, its
        gRPC threads) uses under 1 %; a worker that computes, close to 100 %."""
        now = time.monotonic() if now is None else now
        if messages != self.messages or cpu_s - self._mark_cpu_s >= BUSY_CPU_SHARE * (now - self._mark_at):
            self.progressed_at, self._mark_cpu_s, self._mark_at = now, cpu_s, now
        self.messages = messages

    def stalled_for(self, since: float, now: float | None = None) -> float:
        """Seconds without progress, counted from ``since`` at the earliest (a call's start)."""
        return (time.monotonic() if now is None else now) - max(since, self.progressed_at)


BUSY_CPU_SHARE = 0.05  # the CPU share (of one core) that counts as work; an idle service measured 0.3-0.9 %
MAX_WORKERS = 4096  # registrations held at once; dead ones make room first
# What one registration may hold (the coordinator keeps it as long as the worker lives, and lists it to every
# client): an address or host name fits in a few hundred characters, and workers set one label (their pool).
MAX_FIELD_CHARS = 512  # each of host, endpoint.grpc/data/metrics, a label value
MAX_LABELS = 16
MAX_LABEL_KEY_CHARS = 64
MAX_REGISTRATION_CHARS = 4096  # all of them together


class RegistryFull(ValueError):
    """Every registration slot holds a live worker."""


def check_sizes(req: coordinator_pb2.RegisterWorkerRequest) -> None:
    """Refuse a registration whose strings are larger than any real worker's (a ValueError naming the field and
    the bound): a gRPC message may carry 8 MiB, which the registry would otherwise hold per worker."""
    fields = {"host": req.host, "endpoint.grpc": req.endpoint.grpc, "endpoint.data": req.endpoint.data,
              "endpoint.metrics": req.endpoint.metrics}
    for name, value in fields.items():
        if len(value) > MAX_FIELD_CHARS:
            raise ValueError(f"{name} of {len(value)} characters exceeds {MAX_FIELD_CHARS}; a worker registers its "
                             f"host name and host:port addresses here")
    if len(req.labels) > MAX_LABELS:
        raise ValueError(f"{len(req.labels)} labels exceed {MAX_LABELS}; a worker sets its pool (--pool) and few more")
    for key, value in req.labels.items():
        if len(key) > MAX_LABEL_KEY_CHARS or len(value) > MAX_FIELD_CHARS:
            raise ValueError(f"label {key[:64]!r}: keys are at most {MAX_LABEL_KEY_CHARS} characters and values "
                             f"at most {MAX_FIELD_CHARS}")
    total = sum(map(len, fields.values())) + sum(len(k) + len(v) for k, v in req.labels.items())
    if total > MAX_REGISTRATION_CHARS:
        raise ValueError(f"a registration of {total} characters (host, endpoints, labels) exceeds "
                         f"{MAX_REGISTRATION_CHARS}; shorten the labels")


class WorkerRegistry:
    def __init__(self, heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 3.0):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.workers: dict[str, Worker] = {}
        self._ids = itertools.count()

    def register(self, req: coordinator_pb2.RegisterWorkerRequest) -> Worker:
        role = ROLE_NAMES.get(req.role)
        if role is None or req.role == common_pb2.COORDINATOR:
            raise ValueError(f"role {req.role} cannot register as a worker")
        if not req.endpoint.grpc:
            raise ValueError("endpoint.grpc is required (host:port of the worker's control plane)")
        check_sizes(req)
        # a worker that registers again from the same address replaces its old entry (it restarted)
        for old in [w for w in self.workers.values() if w.grpc == req.endpoint.grpc]:
            del self.workers[old.worker_id]
        if len(self.workers) >= MAX_WORKERS:  # the dead make room; a registry full of live workers refuses more
            for dead in [w for w in self.workers.values() if not w.alive and not w.run_id]:
                del self.workers[dead.worker_id]
        if len(self.workers) >= MAX_WORKERS:
            raise RegistryFull(f"{len(self.workers)} workers are registered, the most this coordinator holds; "
                             f"deregister idle ones first")
        worker = Worker(f"{role}-{next(self._ids)}", role, req.endpoint.grpc, req.endpoint.data,
                        req.endpoint.metrics, req.pid, req.host, dict(req.labels))
        self.workers[worker.worker_id] = worker
        return worker

    def heartbeat(self, worker_id: str, key: str, cpu_s: float = 0.0, messages: int = 0) -> bool:
        """Whether the worker is known and alive (then seen now, with its signs of work); PermissionError for a
        caller without its key."""
        worker = self.workers.get(worker_id)
        if worker is not None and not hmac.compare_digest(worker.key.encode(), key.encode(errors="replace")):
            raise PermissionError(f"heartbeat for {worker_id} without that worker's key: only the worker itself "
                                  f"speaks for it")
        if worker is None or not worker.alive:
            return False
        worker.last_seen = time.monotonic()
        worker.note(cpu_s, messages, worker.last_seen)
        return True

    def deregister(self, worker_id: str) -> Worker | None:
        return self.workers.pop(worker_id, None)

    def reap(self) -> list[Worker]:
        """Mark workers whose heartbeats stopped as dead and return them (once)."""
        now = time.monotonic()
        dead = [w for w in self.workers.values() if w.alive and now - w.last_seen > self.heartbeat_timeout_s]
        for w in dead:
            w.alive = False
        return dead

    def idle(self, role: str, pool: str = "") -> list[Worker]:
        """Idle workers of a role; with ``pool``, those registered in that pool (``--pool``) first, then those
        registered in none (a worker pinned to another pool is never taken)."""
        free = [w for w in self.workers.values() if w.role == role and w.alive and not w.run_id]
        if not pool:
            return free
        return ([w for w in free if w.labels.get("pool") == pool] +
                [w for w in free if not w.labels.get("pool")])

    def acquire(self, role: str, run_id: str, pool: str = "") -> Worker | None:
        free = self.idle(role, pool)
        if not free:
            return None
        free[0].run_id = run_id
        return free[0]

    def release(self, run_id: str) -> None:
        for w in self.workers.values():
            if w.run_id == run_id:
                w.run_id = ""

    def status(self, worker: Worker) -> coordinator_pb2.WorkerStatus:
        from rlfabric.services.core.runtime import ROLES

        return coordinator_pb2.WorkerStatus(
            worker_id=worker.worker_id, role=ROLES[worker.role],
            endpoint=common_pb2.Endpoint(grpc=worker.grpc, data=worker.data, metrics=worker.metrics),
            pid=worker.pid, host=worker.host, alive=worker.alive,
            seconds_since_heartbeat=time.monotonic() - worker.last_seen, run_id=worker.run_id)
