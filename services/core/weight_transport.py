"""torch.distributed pairs for weight payloads (gloo on CPU, NCCL on GPU).

torch.distributed allows one default group per process, and rollout workers join and leave a live run, so each
publisher-subscriber pair gets its own 2-rank group built directly on a ``PrefixStore`` of the publisher's
``TCPStore`` (rank 0 = publisher, rank 1 = subscriber). The ZeroMQ channel keeps the control (manifest, versions,
long-poll); these groups only move bucket bytes. Sends run on one thread per pair, so a blocking send never
stalls the publisher's data-plane thread.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import socket
import threading
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
MAX_PAIRS = 256


def local_ip_toward(host: str) -> str:
    """The local address that routes to ``host``: what a peer can dial back (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(1.0, seconds))


def make_group(backend: str, store: dist.Store, pair: int, rank: int, local_ip: str, timeout_s: float):
    """A 2-rank group of its own (blocks until the other rank builds its side, at most ``timeout_s``)."""
    prefixed = dist.PrefixStore(f"rlfabric/weights/pair/{pair}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _timedelta(timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise RuntimeError("weight_sync.transport=nccl needs CUDA and a torch build with NCCL; use gloo or zmq")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timedelta(timeout_s)
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"unknown torch.distributed backend {backend!r}; expected one of {BACKENDS}")


def _sync(backend: str) -> None:
    if backend == "nccl":  # NCCL's wait() only orders streams; the bytes must have landed before we go on
        torch.cuda.synchronize()


class _Pair:
    """Publisher side of one subscriber: its group, and a thread that sends queued bucket lists in order."""

    def __init__(self, host: PairHost, pair: int, peer_ip: str, timeout_s: float):
        self.host, self.pair, self.peer_ip, self.timeout_s = host, pair, peer_ip, timeout_s
        self.jobs: queue.Queue = queue.Queue()
        self.alive = True
        self.used = time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"weights-pair-{pair}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        backend = self.host.backend
        try:
            group = make_group(backend, self.host.store, self.pair, 0, local_ip_toward(self.peer_ip), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 — the subscriber never came, or could not connect
            log.warning("weights: pair %d (%s) did not connect: %s", self.pair, self.peer_ip, exc)
            self.alive = False
            return
        try:
            while (buckets := self.jobs.get()) is not None:
                try:
                    if backend == "nccl" and buckets:
                        torch.cuda.set_device(buckets[0].device)
                    for tag, t in enumerate(buckets):
                        group.send([t], 1, tag).wait()
                    _sync(backend)
                except Exception as exc:  # noqa: BLE001 — the peer died mid-transfer: this pair is over
                    log.warning("weights: pair %d lost during a send: %s", self.pair, exc)
                    return
        finally:
            self.alive = False
            group.shutdown()


class PairHost:
    """Publisher side: one TCPStore (port 0, bound on all interfaces) and a group per joined subscriber."""

    def __init__(self, backend: str, timeout_s: float = 60.0):
        if backend not in BACKENDS:
            raise ValueError(f"unknown torch.distributed backend {backend!r}; expected one of {BACKENDS}")
        self.backend = backend
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, _timedelta(timeout_s), wait_for_workers=False)
        self.port = self.store.port
        self._ids = itertools.count(1)
        self._pairs: dict[int, _Pair] = {}
        self._lock = threading.Lock()

    def join(self, peer_ip: str, timeout_s: float) -> int:
        """Start building a group with a new subscriber; it builds its side with the returned pair id."""
        with self._lock:
            dead = [p for p, pair in self._pairs.items() if not pair.alive]
            for p in dead:
                del self._pairs[p]
            if len(self._pairs) >= MAX_PAIRS:  # subscribers that vanished without leaving: close the idlest
                idlest = min(self._pairs, key=lambda p: self._pairs[p].used)
                self._pairs.pop(idlest).jobs.put(None)
            pair = next(self._ids)
            self._pairs[pair] = _Pair(self, pair, peer_ip, timeout_s)
        return pair

    def send(self, pair: int, buckets: list[torch.Tensor]) -> None:
        """Queue bucket tensors for the pair's thread; they stay referenced (alive) until sent."""
        with self._lock:
            p = self._pairs.get(pair)
        if p is None or not p.alive:
            raise ValueError(f"weight-transfer pair {pair} is closed or unknown; join again")
        p.used = time.monotonic()
        p.jobs.put(buckets)

    def leave(self, pair: int) -> None:
        with self._lock:
            p = self._pairs.pop(pair, None)
        if p is not None:
            p.jobs.put(None)

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for p in pairs:
            p.jobs.put(None)


class PairClient:
    """Subscriber side of one pair: receives bucket tensors (CPU for gloo, CUDA for NCCL) in order."""

    def __init__(self, backend: str, store_host: str, store_port: int, pair: int, timeout_s: float):
        self.backend, self.pair = backend, pair
        store = dist.TCPStore(store_host, store_port, None, False, _timedelta(timeout_s))
        self.group = make_group(backend, store, pair, 1, local_ip_toward(store_host), timeout_s)
        self._store = store

    def recv(self, buckets: list[torch.Tensor]) -> None:
        for tag, t in enumerate(buckets):
            self.group.recv([t], 0, tag).wait()
        _sync(self.backend)

    def close(self) -> None:
        try:
            self.group.shutdown()
        except Exception as exc:  # noqa: BLE001 — closing is best effort; the peer may be gone already
            log.debug("weights: pair %d shutdown: %s", self.pair, exc)
