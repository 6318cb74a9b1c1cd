"""torch.distributed pairs for weight payloads (gloo on CPU, NCCL on GPU).

torch.distributed allows one default group per process, and rollout workers join and leave a live run, so each
publisher-subscriber pair gets its own 2-rank group (rank 0 = publisher, rank 1 = subscriber). The ZeroMQ channel
keeps the control (manifest, versions, long-poll); these groups only move bucket bytes. Sends run on one thread per
pair, so a blocking send never stalls the publisher's data-plane thread.

torch.distributed authenticates nobody, so a pair has no TCP store at all: its rendezvous keys live in a
``HashStore`` inside the publisher's process, and the subscriber reaches them only through ``ChannelStore``, whose
every operation is a request on the (CURVE-authenticated) weight channel, confined to the keys under its pair's
random prefix. A stranger has no store to list or write (a ``TCPStore`` client lists every key of its server,
prefixes included), so it cannot learn a pair's keys or join its group. The gloo devices listen on the service's
own address only, never all interfaces; what they accept is the peer whose address and sequence number came
through those keys.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlfabric.services.core.batch import TensorBatch

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


WILDCARDS = ("", "0.0.0.0", "::", "[::]")
PREFIX_HEX = 32  # a group's key prefix: 128 random bits


def new_prefix() -> str:
    """A group's random key prefix (hex): handed to its peer over an authenticated channel only."""
    return secrets.token_hex(PREFIX_HEX // 2)


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or len(prefix) != PREFIX_HEX or any(c not in "0123456789abcdef" for c in prefix):
        raise ValueError(f"a torch.distributed group prefix must be {PREFIX_HEX} lowercase hex digits, got "
                         f"{str(prefix)[:40]!r}: the publisher and subscriber run different rlfabric versions")
    return prefix


def bind_address(host: str, advertise_host: str = "") -> str:
    """The one local address torch.distributed listeners bind: the service's own bind address, or where it binds
    all interfaces, the address its advertised name resolves to (what peers dial). Never the wildcard."""
    name = (advertise_host or socket.gethostname()) if host.strip("[]") in WILDCARDS else host.strip("[]")
    try:
        return socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise OSError(f"cannot resolve {name!r} to bind torch.distributed to ({exc}). Fix: start the service with "
                      f"--advertise-host set to this host's reachable address") from None


def listening_store(ip: str, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens on ``ip`` only. Left to itself torch binds all interfaces, so the socket is
    bound here and its descriptor handed over (the libuv server owns and closes it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((ip, 0))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind a torch.distributed store to {ip} ({exc.strerror}). Fix: give the service an "
                      f"address of this host (--host or --advertise-host)") from None
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(ip, port, None, True, _timedelta(timeout_s), wait_for_workers=False,
                             master_listen_fd=fd, use_libuv=True)
    except Exception:
        os.close(fd)
        raise


def interface_of(ip: str) -> str | None:
    """The name of the network interface holding IPv4 address ``ip`` (Linux), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                addr = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(addr[20:24]) == ip:
                return name
    return None


def _nccl_interface(local_ip: str) -> None:
    """NCCL picks its socket interface once per process from NCCL_SOCKET_IFNAME (by default any but loopback):
    unless the operator chose one, it is the interface of the address this group uses."""
    if "NCCL_SOCKET_IFNAME" not in os.environ and (name := interface_of(local_ip)) is not None:
        os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"


def make_group(backend: str, store: dist.Store, prefix: str, rank: int, local_ip: str, timeout_s: float):
    """A 2-rank group of its own on the keys under ``prefix`` (blocks until the other rank builds its side, at most
    ``timeout_s``); its gloo device listens on ``local_ip`` only."""
    prefixed = dist.PrefixStore(f"rlfabric/weights/{check_prefix(prefix)}", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _timedelta(timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise RuntimeError("weight_sync.transport=nccl needs CUDA and a torch build with NCCL; use gloo or zmq")
        _nccl_interface(local_ip)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timedelta(timeout_s)
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"unknown torch.distributed backend {backend!r}; expected one of {BACKENDS}")


def _sync(backend: str) -> None:
    if backend == "nccl":  # NCCL's wait() only orders streams; the bytes must have landed before we go on
        torch.cuda.synchronize()


class ChannelStore(dist.Store):
    """The subscriber's view of its pair's rendezvous keys: each operation asks the publisher over the weight
    channel (``ask(meta, value) -> (meta, value)``), which answers from the pair's in-process store. A read of a key
    not set yet is asked again until ``timeout_s``, as a TCPStore client's would wait."""

    POLL_S = 0.005

    def __init__(self, ask: Callable[[dict, bytes], tuple[dict, bytes]], timeout_s: float,
                 owner: str = "weights: the publisher"):
        super().__init__()
        self.ask, self.timeout_s, self.owner = ask, timeout_s, owner

    def _until(self, what: str, ready: Callable[[], tuple[bool, Any]]) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while True:
            done, value = ready()
            if done:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.owner}'s rendezvous key {what} was not set in {self.timeout_s:.0f} s "
                                   f"(its side of the group did not start)")
            time.sleep(self.POLL_S)

    def set(self, key: str, value) -> None:
        self.ask({"op": "set", "key": key}, bytes(value))

    def get(self, key: str) -> bytes:
        def ready() -> tuple[bool, bytes]:
            meta, value = self.ask({"op": "get", "key": key}, b"")
            return bool(meta.get("found")), value
        return self._until(key, ready)

    def add(self, key: str, amount: int) -> int:
        return int(self.ask({"op": "add", "key": key, "amount": int(amount)}, b"")[0]["value"])

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.ask({"op": "compare_set", "key": key, "expected": bytes(expected).hex()}, bytes(desired))[1]

    def check(self, keys: list[str]) -> bool:
        return bool(self.ask({"op": "check", "keys": list(keys)}, b"")[0].get("found"))

    def wait(self, keys: list[str], timeout=None) -> None:
        saved = self.timeout_s
        if timeout is not None:
            self.timeout_s = max(1.0, timeout.total_seconds())
        try:
            self._until(", ".join(keys), lambda: (self.check(keys), None))
        finally:
            self.timeout_s = saved

    def delete_key(self, key: str) -> bool:
        return bool(self.ask({"op": "delete_key", "key": key}, b"")[0].get("found"))

    def num_keys(self) -> int:
        raise RuntimeError(f"{self.owner}'s rendezvous store does not count keys")

    def set_timeout(self, timeout) -> None:
        self.timeout_s = max(1.0, timeout.total_seconds())


def store_message(meta: dict, value: bytes) -> TensorBatch:
    """A ChannelStore operation or its answer as a data-plane message: the meta, the value's bytes."""
    return TensorBatch({"value": np.frombuffer(value, np.uint8)} if value else {}, meta=meta)


def store_value(batch: TensorBatch) -> bytes:
    value = batch.tensors.get("value")
    return b"" if value is None else np.asarray(value, np.uint8).tobytes()


def asking(client: Any, extra: dict | None = None) -> Callable[[dict, bytes], tuple[dict, bytes]]:
    """ChannelStore's ``ask`` over a DataClient: each store operation one "store" request (``extra`` added to its
    meta: a weight pair's id)."""
    def ask(meta: dict, value: bytes) -> tuple[dict, bytes]:
        _, got = client.request("store", store_message({**meta, **(extra or {})}, value))
        return got.meta, store_value(got)
    return ask


STORE_OPS = ("set", "get", "add", "compare_set", "check", "delete_key")
MAX_KEY_BYTES, MAX_VALUE_BYTES, MAX_PAIR_KEYS = 512, 64 << 10, 256


def confined_store_op(store: dist.Store, meta: dict, value: bytes, root: str, new_key: Callable[[], None],
                      what: str) -> tuple[dict, bytes]:
    """One ``ChannelStore`` operation, done on ``store`` if every key it names lies under ``root`` (a group's random
    prefix): a peer on the authenticated channel reaches its own group's keys and no other's. ``new_key`` is called
    before a key is first written (to bound how many a peer may make). Never blocks: a key not set yet is
    reported missing, and the asking ``ChannelStore`` asks again."""
    op, keys = meta.get("op"), meta.get("keys") if meta.get("op") == "check" else [meta.get("key")]
    if op not in STORE_OPS:
        raise ValueError(f"{what}: unknown store operation {str(op)[:20]!r}; expected one of {STORE_OPS}")
    if not isinstance(keys, list) or not 0 < len(keys) <= 16 or not all(
            isinstance(k, str) and k.startswith(root) and len(k) <= MAX_KEY_BYTES for k in keys):
        raise ValueError(f"{what}: a store key outside this group's prefix (or malformed)")
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"{what}: a store value of {len(value)} bytes (at most {MAX_VALUE_BYTES})")
    key = keys[0]
    if op in ("set", "add", "compare_set") and not store.check([key]):
        new_key()
    if op == "set":
        store.set(key, value)
        return {}, b""
    if op == "get":
        found = store.check([key])
        return {"found": found}, store.get(key) if found else b""
    if op == "add":
        amount = meta.get("amount", 0)
        if not isinstance(amount, int) or isinstance(amount, bool) or abs(amount) > 1 << 62:
            raise ValueError(f"{what}: a store add needs an integer amount")
        return {"value": store.add(key, amount)}, b""
    if op == "compare_set":
        return {}, store.compare_set(key, bytes.fromhex(str(meta.get("expected", ""))), value)
    if op == "check":
        return {"found": store.check(keys)}, b""
    return {"found": store.delete_key(key)}, b""


class _Pair:
    """Publisher side of one subscriber: its group, its rendezvous keys, and a thread that sends queued bucket
    lists in order."""

    def __init__(self, host: PairHost, pair: int, prefix: str, peer_ip: str, timeout_s: float):
        self.host, self.pair, self.prefix, self.peer_ip, self.timeout_s = host, pair, prefix, peer_ip, timeout_s
        self.store = dist.HashStore()  # this pair's keys only: they go with it
        self.keys = 0
        self.jobs: queue.Queue = queue.Queue()
        self.alive = True
        self.used = time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"weights-pair-{pair}", daemon=True)
        self.thread.start()

    def store_op(self, meta: dict, value: bytes) -> tuple[dict, bytes]:
        """One of the subscriber's store operations (ChannelStore), on this pair's keys only."""
        return confined_store_op(self.store, meta, value, f"rlfabric/weights/{self.prefix}/", self._new_key,
                                 "weights")

    def _new_key(self) -> None:
        self.keys += 1
        if self.keys > MAX_PAIR_KEYS:
            raise ValueError(f"weights: a pair's rendezvous holds at most {MAX_PAIR_KEYS} keys")

    def _run(self) -> None:
        backend = self.host.backend
        try:
            group = make_group(backend, self.store, self.prefix, 0, self.host.ip, self.timeout_s)
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
    """Publisher side: a group per joined subscriber, each with its rendezvous keys in this process under a random
    prefix, its gloo device on ``ip`` (the service's own address; see ``bind_address``)."""

    def __init__(self, backend: str, ip: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown torch.distributed backend {backend!r}; expected one of {BACKENDS}")
        self.backend, self.ip = backend, ip
        self._ids = itertools.count(1)
        self._pairs: dict[int, _Pair] = {}
        self._lock = threading.Lock()

    def join(self, peer_ip: str, timeout_s: float) -> tuple[int, str]:
        """Start building a group with a new subscriber; it builds its side with the returned pair id and key
        prefix (which must reach it over an authenticated channel only)."""
        with self._lock:
            dead = [p for p, pair in self._pairs.items() if not pair.alive]
            for p in dead:
                del self._pairs[p]
            if len(self._pairs) >= MAX_PAIRS:  # subscribers that vanished without leaving: close the idlest
                idlest = min(self._pairs, key=lambda p: self._pairs[p].used)
                self._pairs.pop(idlest).jobs.put(None)
            pair, prefix = next(self._ids), new_prefix()
            self._pairs[pair] = _Pair(self, pair, prefix, peer_ip, timeout_s)
        return pair, prefix

    def store_op(self, pair: int, meta: dict, value: bytes) -> tuple[dict, bytes]:
        with self._lock:
            p = self._pairs.get(pair)
        if p is None or not p.alive:
            raise ValueError(f"weight-transfer pair {pair} is closed or unknown; join again")
        return p.store_op(meta, value)

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

    def __init__(self, backend: str, publisher_host: str, pair: int, prefix: str,
                 ask: Callable[[dict, bytes], tuple[dict, bytes]], timeout_s: float):
        self.backend, self.pair = backend, pair
        self._store = ChannelStore(ask, timeout_s)
        self.group = make_group(backend, self._store, prefix, 1, local_ip_toward(publisher_host), timeout_s)

    def recv(self, buckets: list[torch.Tensor]) -> None:
        for tag, t in enumerate(buckets):
            self.group.recv([t], 0, tag).wait()
        _sync(self.backend)

    def close(self) -> None:
        try:
            self.group.shutdown()
        except Exception as exc:  # noqa: BLE001 — closing is best effort; the peer may be gone already
            log.debug("weights: pair %d shutdown: %s", self.pair, exc)
