"""Weight-sync epochs: bucketed, optionally delta, over ZeroMQ or torch.distributed.

A weight version is an integer epoch. The learner's ``WeightPublisher`` snapshots each published version into one
aligned byte arena and keeps the last few (so a fetch that started on a version can finish after a newer one is
published, and deltas have a base). A rollout worker's ``WeightSubscriber`` asks ``get {have, min_version, wait_s}``;
the publisher answers with a manifest (names, dtypes, shapes, payload segments, bucket byte ranges) as soon as it
has a version newer than ``have`` and at least ``min_version``, or parks the request until then (long-poll) and
finally answers ``current {version}``. Because a request can wait for a version, the rollout's staleness rule
(batch i needs version >= i - k) is enforced exactly, not by polling.

The payload then moves bucket by bucket, each a separate message, so a model larger than the data plane's message
bound still syncs: over ZeroMQ (``bucket`` requests, pipelined) or over a per-pair torch.distributed group (gloo or
NCCL, see weight_transport.py). A delta payload carries only the tensors that changed since the subscriber's
version, and for a tensor with few changed elements only (flat int64 indices, values); applied to the subscriber's
copy it is bit-identical to a full transfer. Everything travels as typed header + raw bytes: no pickle.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import DTYPES, FrameError, decode, encode, pack_frames, unpack_frames
from rlfabric.services.core.dataplane import DataClient, DataServer, RemoteError, Reply, meta_float, meta_int

log = logging.getLogger(__name__)

WEIGHTS_KEY = "weights/latest"
TRANSPORTS = ("zmq", "gloo", "nccl")
ALIGN = 64  # every tensor starts 64-byte aligned in an arena: dtype views and bucket cuts stay legal
KEEP_VERSIONS = 3  # snapshots a publisher holds at most (fewer when weight_sync.snapshot_bytes says so): in-flight
#                   fetches finish, lagging subscribers get deltas
KEEP_DELTAS = 8
VERSION_MAX = 1 << 62
MAX_PARKED = 1024  # weight requests waiting for a version at once (one per rollout worker, normally)
REPLY_SLACK = 4096  # room for a bucket reply's header within data_plane.max_message_bytes
ZMQ_WINDOW = 4  # bucket requests in flight per fetch
FETCH_RESTARTS = 5


@dataclass(frozen=True)
class WeightSyncOptions:
    """How weights travel; the same field names as the run config's weight_sync section (duck-typed).

    ``bucket_bytes`` and ``delta_max_fraction`` are the publisher's; ``delta`` must be set on both sides;
    ``transport`` picks the subscriber's payload path (a publisher with gloo or nccl also serves zmq)."""

    transport: str = "zmq"
    bucket_bytes: int = 32 << 20
    delta: bool = False
    delta_max_fraction: float = 0.25
    snapshot_bytes: int = 1 << 30


def _options(sync: Any) -> WeightSyncOptions:
    if sync is None:
        return WeightSyncOptions()
    opts = WeightSyncOptions(str(sync.transport), int(sync.bucket_bytes), bool(sync.delta),
                             float(sync.delta_max_fraction), int(getattr(sync, "snapshot_bytes", 1 << 30)))
    if opts.transport not in TRANSPORTS:
        raise ValueError(f"weight_sync.transport={opts.transport!r}; expected one of {TRANSPORTS}")
    if opts.bucket_bytes < ALIGN:
        raise ValueError(f"weight_sync.bucket_bytes={opts.bucket_bytes} is too small (at least {ALIGN})")
    if not 0.0 <= opts.delta_max_fraction <= 1.0:
        raise ValueError(f"weight_sync.delta_max_fraction={opts.delta_max_fraction} must be within [0, 1]")
    if opts.transport == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight_sync.transport=nccl needs a CUDA device here; use gloo (CPU) or zmq")
    return opts


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- arenas: a version's tensors back to back in one uint8 tensor --------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def raw(self, arena: torch.Tensor) -> torch.Tensor:
        return arena[self.offset:self.offset + self.nbytes]


def _layout(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[tuple[_Entry, ...], int]:
    entries, offset = [], 0
    for name, dtype, shape in specs:
        entry = _Entry(name, dtype, shape, offset)
        entries.append(entry)
        offset = _align(offset + entry.nbytes)
    return tuple(entries), offset


def _source(name: str, value: Any) -> tuple[str, tuple[int, ...], Any]:
    """(wire dtype, shape, torch tensor or numpy array) of one state-dict value."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        value = value.detach()
    else:
        value = np.asarray(value)
        dtype = value.dtype.name
    if dtype not in DTYPES:
        raise FrameError(f"tensor '{name}': dtype {dtype} cannot be published (supported: {', '.join(sorted(DTYPES))})")
    return dtype, tuple(value.shape), value


def _elements(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Bits of each element as integers (so comparisons are exact for NaN, -0.0 and every dtype)."""
    if itemsize == 16:
        return raw.view(torch.int64).view(-1, 2)
    return raw.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize])


class _Snapshot:
    """One published version, copied (training keeps mutating the live tensors)."""

    def __init__(self, version: int, lineage: str, state: dict[str, Any], device: torch.device):
        sources = [(name, *_source(name, v)) for name, v in state.items()]
        self.version, self.lineage = version, lineage
        self.key = tuple((name, dtype, shape) for name, dtype, shape, _ in sources)
        self.entries, total = _layout(list(self.key))
        self.arena = torch.zeros(total, dtype=torch.uint8, device=device)
        for entry, (_, _, _, value) in zip(self.entries, sources, strict=True):
            dst = entry.raw(self.arena)
            if isinstance(value, torch.Tensor):
                dst.view(value.dtype).view(value.shape).copy_(value)
            elif device.type == "cpu":
                dst.numpy().view(DTYPES[entry.dtype]).reshape(entry.shape)[...] = value
            else:
                dst.copy_(torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the transfer threads use other streams
        self.full = _Payload(version, -1, [("full", i, e.dtype, e.numel, e.offset) for i, e in enumerate(self.entries)],
                             self.arena, self)


class _Payload:
    """What a fetch transfers: segments (role, tensor index, dtype, count, byte offset) in one arena, cut into
    buckets. role: ``full`` (the whole tensor), or ``idx`` (int64 flat indices) followed by ``val`` (values)."""

    def __init__(self, version: int, base: int, segments: list[tuple], arena: torch.Tensor, snapshot: _Snapshot):
        self.version, self.base, self.segments, self.arena, self.snapshot = version, base, segments, arena, snapshot
        self._buckets: dict[int, list[tuple[int, int]]] = {}
        self._manifests: dict[int, np.ndarray] = {}

    def buckets(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges of at most ``bucket_bytes``, segments in order; a larger segment is cut between elements."""
        if bucket_bytes not in self._buckets:
            out: list[tuple[int, int]] = []
            start = end = 0
            for _, _, dtype, count, offset in self.segments:
                stop = offset + count * DTYPES[dtype].itemsize
                if stop - start <= bucket_bytes:
                    end = stop
                    continue
                if end > start:
                    out.append((start, end))
                start, step = offset, max(1, bucket_bytes // DTYPES[dtype].itemsize) * DTYPES[dtype].itemsize
                while stop - start > bucket_bytes:
                    out.append((start, start + step))
                    start += step
                end = stop
            if end > start:
                out.append((start, end))
            self._buckets[bucket_bytes] = out
        return self._buckets[bucket_bytes]

    def manifest(self, bucket_bytes: int) -> np.ndarray:
        """The manifest as JSON bytes in a uint8 buffer (a tensor, so a model's many names never hit the header
        bound)."""
        if bucket_bytes not in self._manifests:
            doc = {"version": self.version, "base": self.base, "lineage": self.snapshot.lineage,
                   "arena_bytes": int(self.snapshot.arena.numel()),
                   "tensors": [[e.name, e.dtype, list(e.shape), e.offset] for e in self.snapshot.entries],
                   "payload_bytes": int(self.arena.numel()), "segments": [list(s) for s in self.segments],
                   "buckets": [list(b) for b in self.buckets(bucket_bytes)]}
            self._manifests[bucket_bytes] = np.frombuffer(json.dumps(doc, separators=(",", ":")).encode(), np.uint8)
        return self._manifests[bucket_bytes]

    def host_bytes(self, start: int, stop: int) -> np.ndarray:
        return self.arena[start:stop].cpu().numpy()


def _delta(old: _Snapshot, new: _Snapshot, max_fraction: float) -> _Payload | None:
    """The changes from ``old`` to ``new``, or None when a full transfer is no larger (or the layouts differ)."""
    if old.key != new.key or old.arena.device != new.arena.device:
        return None
    plan, offset, segments = [], 0, []
    for i, e in enumerate(new.entries):
        changed = _elements(e.raw(new.arena), e.itemsize) != _elements(e.raw(old.arena), e.itemsize)
        idx = (changed.any(1) if changed.dim() == 2 else changed).nonzero().flatten()
        k = idx.numel()
        if k == 0:
            continue
        if k < max_fraction * e.numel and k * (8 + e.itemsize) < e.nbytes:
            plan.append((i, idx))
            segments += [("idx", i, "int64", k, offset), ("val", i, e.dtype, k, _align(offset + 8 * k))]
            offset = _align(_align(offset + 8 * k) + k * e.itemsize)
        else:
            plan.append((i, None))
            segments.append(("full", i, e.dtype, e.numel, offset))
            offset = _align(offset + e.nbytes)
    if offset >= new.arena.numel() and segments:
        return None
    arena = torch.zeros(offset, dtype=torch.uint8, device=new.arena.device)
    segs = iter(segments)
    for i, idx in plan:
        e = new.entries[i]
        if idx is None:
            o = next(segs)[4]
            arena[o:o + e.nbytes].copy_(e.raw(new.arena))
            continue
        o_idx, o_val = next(segs)[4], next(segs)[4]
        k = idx.numel()
        arena[o_idx:o_idx + 8 * k].view(torch.int64).copy_(idx)
        arena[o_val:o_val + k * e.itemsize].view(k, e.itemsize).copy_(e.raw(new.arena).view(-1, e.itemsize)[idx])
    return _Payload(new.version, old.version, segments, arena, new)


@dataclass
class _Parked:
    deadline: float
    meta: dict
    reply: Reply


class WeightPublisher:
    """Learner side: holds the newest versions and serves manifests and buckets from the data-plane thread."""

    def __init__(self, host: str, max_bytes: int, advertise_host: str = "", *, sync: Any = None):
        self.sync = _options(sync)
        self.max_bytes = max_bytes
        self.zmq_bucket_bytes = min(self.sync.bucket_bytes, max_bytes - REPLY_SLACK)
        if self.zmq_bucket_bytes < ALIGN:
            raise ValueError(f"data_plane.max_message_bytes={max_bytes} leaves no room for weight buckets")
        self.server = DataServer(host, max_bytes=max_bytes, name="weights", advertise_host=advertise_host)
        self.endpoint = self.server.endpoint
        self._host, self._advertise_host = host, advertise_host  # where torch.distributed pairs listen
        self._lock = threading.Lock()
        self._version = -1
        self._lineage = secrets.token_hex(8)  # names a version sequence: equal numbers from another one differ
        self._snapshots: OrderedDict[int, _Snapshot] = OrderedDict()
        self._deltas: OrderedDict[tuple[int, int], _Payload | None] = OrderedDict()
        self._parked: list[_Parked] = []
        self._pairs = None  # weight_transport.PairHost, opened on the first torch.distributed subscriber
        self._warned_size = False
        self.server.start(self._handle, self._tick)

    @property
    def version(self) -> int:
        return self._version

    def snapshot_bytes(self) -> int:
        """Host (or device) bytes held in published versions and the deltas cached between them."""
        return (sum(int(snap.arena.numel()) for snap in self._snapshots.values())
                + sum(int(d.arena.numel()) for d in self._deltas.values() if d is not None))

    def publish(self, version: int, state: dict[str, Any]) -> None:
        """Snapshot a state dict as ``version`` (copied, so training can keep mutating the live one)."""
        if version <= self._version:
            raise ValueError(f"weight version must increase: {version} <= {self._version}")
        self._set(version, state, keep=True)

    def reset(self, version: int, state: dict[str, Any]) -> None:
        """Start a run's version sequence (a new run, or a resumed one at its checkpoint's version); versions held
        from before are dropped, since their numbers may now mean other weights."""
        self._set(version, state, keep=False)

    def _device(self, state: dict[str, Any]) -> torch.device:
        if self.sync.transport != "nccl":
            return torch.device("cpu")
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                return v.device
        return torch.device("cuda", torch.cuda.current_device())

    def _set(self, version: int, state: dict[str, Any], keep: bool) -> None:
        lineage = self._lineage if keep else secrets.token_hex(8)
        snapshot = _Snapshot(version, lineage, state, self._device(state))
        with self._lock:
            if not keep:
                self._snapshots.clear()
                self._deltas.clear()
                self._lineage = lineage
            self._snapshots[version] = snapshot
            while len(self._snapshots) > KEEP_VERSIONS or (
                    len(self._snapshots) > 1 and self.snapshot_bytes() > self.sync.snapshot_bytes):
                dropped, _ = self._snapshots.popitem(last=False)
                for key in [k for k in self._deltas if dropped in k]:
                    del self._deltas[key]
            self._version = version
            if self.snapshot_bytes() > self.sync.snapshot_bytes and not self._warned_size:
                self._warned_size = True
                log.warning("weights: one version is %d bytes, over weight_sync.snapshot_bytes=%d; holding it "
                            "anyway (the newest version is always held)", self.snapshot_bytes(),
                            self.sync.snapshot_bytes)
        self.server.wake()

    def _payload(self, version: int, base: int, lineage: str, exact: bool) -> _Payload | None:
        """The payload from ``base`` (-1: full) to ``version`` of ``lineage``; None if gone. Not ``exact``: full
        when the delta is impossible or no smaller."""
        with self._lock:
            snap, old = self._snapshots.get(version), self._snapshots.get(base)
            cached = self._deltas.get((base, version), False)
        if snap is None or (exact and snap.lineage != lineage):
            return None
        if snap.lineage != lineage:
            base = -1
        if base < 0 or (not exact and not self.sync.delta):
            return snap.full
        if cached is False:
            if old is None:
                return None if exact else snap.full
            cached = _delta(old, snap, self.sync.delta_max_fraction)
            with self._lock:
                self._deltas[(base, version)] = cached
                while len(self._deltas) > KEEP_DELTAS or (
                        len(self._deltas) > 1 and self.snapshot_bytes() > self.sync.snapshot_bytes):
                    self._deltas.popitem(last=False)
        if cached is None:
            return None if exact else snap.full
        return cached

    def _bucket_bytes(self, transport: str) -> int:
        return self.zmq_bucket_bytes if transport == "zmq" else self.sync.bucket_bytes

    def _answer(self, meta: dict, reply: Reply) -> bool:
        with self._lock:
            version, lineage = self._version, self._lineage
        have, wanted = meta_int(meta, "have", -1, -1, VERSION_MAX), meta_int(meta, "min_version", 0, -VERSION_MAX,
                                                                                 VERSION_MAX)
        if version <= have or version < wanted:
            return False
        base = meta_int(meta, "base", -1, -1, VERSION_MAX) if meta.get("lineage") == lineage else -1
        payload = self._payload(version, base, lineage, exact=False)
        if payload is None:  # reset between the two reads: answer on the next tick
            return False
        transport = str(meta.get("transport", "zmq"))
        manifest = payload.manifest(self._bucket_bytes(transport))
        if manifest.nbytes + REPLY_SLACK > self.max_bytes:
            raise ValueError(f"weight manifest of {manifest.nbytes} bytes exceeds data_plane.max_message_bytes")
        out = {"manifest": manifest}
        if transport == "zmq" and payload.buckets(self.zmq_bucket_bytes):
            start, stop = payload.buckets(self.zmq_bucket_bytes)[0]
            if manifest.nbytes + (stop - start) + 2 * REPLY_SLACK <= self.max_bytes:  # small models: 1 round trip
                out["bucket"] = payload.host_bytes(start, stop)
        reply.send("manifest", TensorBatch(out, version=version))
        return True

    def _handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        meta = batch.meta
        if kind == "get":
            wait_s = meta_float(meta, "wait_s", 0.0, 0.0, 3600.0)
            if self._answer(meta, reply):
                return
            if wait_s <= 0:
                reply.send("current", TensorBatch(version=self._version))
            elif len(self._parked) >= MAX_PARKED:
                raise ValueError(f"{MAX_PARKED} weight requests are already waiting here; ask again later")
            else:
                self._parked.append(_Parked(time.monotonic() + wait_s, meta, reply))
        elif kind == "bucket":
            self._bucket(meta_int(meta, "version", -1, 0, 1 << 62), meta_int(meta, "base", -1, -1, 1 << 62),
                         str(meta.get("lineage", "")), meta_int(meta, "index", -1, 0, 1 << 31), reply)
        elif kind == "send":
            self._send(meta_int(meta, "pair", -1, 0, 1 << 31), meta_int(meta, "version", -1, 0, 1 << 62),
                       meta_int(meta, "base", -1, -1, 1 << 62), str(meta.get("lineage", "")), reply)
        elif kind == "join":
            self._join(meta, reply)
        elif kind == "leave":
            if self._pairs is not None:
                self._pairs.leave(meta_int(meta, "pair", -1, 0, 1 << 31))
            reply.send("left")
        elif kind == "store":  # a pair's rendezvous, on this authenticated channel (weight_transport.ChannelStore)
            if self._pairs is None:
                raise ValueError("no weight-transfer pair was joined here; join first")
            from rlfabric.services.core.weight_transport import store_message, store_value  # (as PairHost is)

            answer, out = self._pairs.store_op(meta_int(meta, "pair", -1, 0, 1 << 31), meta, store_value(batch))
            reply.send("stored", store_message(answer, out))
        else:
            raise ValueError(f"unknown request kind {kind!r}; expected get, bucket, join, send, leave or store")

    def _gone(self, version: int, reply: Reply) -> None:
        reply.send("gone", TensorBatch(meta={"reason": f"weight version {version} is no longer held (newest: "
                                                       f"{self._version}); fetch again"}, version=self._version))

    def _bucket(self, version: int, base: int, lineage: str, index: int, reply: Reply) -> None:
        payload = self._payload(version, base, lineage, exact=True)
        if payload is None:
            self._gone(version, reply)
            return
        buckets = payload.buckets(self.zmq_bucket_bytes)
        if not 0 <= index < len(buckets):
            raise ValueError(f"bucket {index} does not exist: version {version} (base {base}) has {len(buckets)} "
                             f"buckets")
        start, stop = buckets[index]
        reply.send("bucket", TensorBatch({"data": payload.host_bytes(start, stop)}, version=version,
                                         meta={"index": index}))

    def _join(self, meta: dict, reply: Reply) -> None:
        backend = str(meta.get("transport"))
        if backend not in ("gloo", "nccl") or self.sync.transport == "zmq" or (
                backend == "nccl" and self.sync.transport != "nccl"):
            raise ValueError(f"this publisher serves weights over {self.sync.transport}, not {backend}; set the "
                             f"same weight_sync.transport on the learner")
        if self._pairs is None:
            from rlfabric.services.core.weight_transport import PairHost, bind_address

            self._pairs = PairHost("nccl" if self.sync.transport == "nccl" else "gloo",
                                   bind_address(self._host, self._advertise_host))
        if backend != self._pairs.backend:
            raise ValueError(f"this publisher serves {self._pairs.backend}, not {backend}")
        pair, prefix = self._pairs.join(str(meta.get("ip", "127.0.0.1"))[:64],
                                        meta_float(meta, "timeout_s", 30.0, 0.1, 3600.0))
        # the pair's key prefix travels only here, on the authenticated weight channel: nobody else can name its keys
        reply.send("joined", TensorBatch(meta={"pair": pair, "prefix": prefix}))

    def _send(self, pair: int, version: int, base: int, lineage: str, reply: Reply) -> None:
        payload = self._payload(version, base, lineage, exact=True)
        if payload is None:
            self._gone(version, reply)
            return
        if self._pairs is None:
            raise ValueError(f"weight-transfer pair {pair} is closed or unknown; join again")
        buckets = payload.buckets(self.sync.bucket_bytes)
        self._pairs.send(pair, [payload.arena[start:stop] for start, stop in buckets])
        reply.send("sending", TensorBatch(meta={"buckets": len(buckets)}, version=version))

    def _tick(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        keep = []
        for p in self._parked:
            try:
                if self._answer(p.meta, p.reply):
                    continue
            except Exception as exc:  # noqa: BLE001 — the parked peer must hear why, the others still wait
                log.exception("weights: answering a parked request failed")
                p.reply.error(f"weights: 'get' failed inside the service: {exc.__class__.__name__}: {exc}")
                continue
            if now >= p.deadline:
                p.reply.send("current", TensorBatch(version=self._version))
            else:
                keep.append(p)
        self._parked = keep

    def close(self) -> None:
        self.server.stop()
        if self._pairs is not None:
            self._pairs.close()


class _Gone(Exception):
    """The version being fetched was dropped by the publisher: start over on the newest."""


@dataclass(frozen=True)
class _Manifest:
    version: int
    base: int
    lineage: str
    entries: tuple[_Entry, ...]
    arena_bytes: int
    payload_bytes: int
    segments: tuple[tuple, ...]
    buckets: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, batch: TensorBatch) -> _Manifest:
        """Validate everything a peer could get wrong before a byte is written (bounds, dtypes, order)."""
        try:
            doc = json.loads(np.asarray(batch["manifest"]).tobytes())
            specs = [(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in doc["tensors"]]
            if any(d not in DTYPES or any(x < 0 for x in s) for _, d, s, _ in specs):
                raise ValueError("unknown dtype or negative shape")
            entries, arena_bytes = _layout([s[:3] for s in specs])
            if [e.offset for e in entries] != [s[3] for s in specs] or arena_bytes != doc["arena_bytes"]:
                raise ValueError("tensor layout does not match its shapes")
            segments = tuple((str(r), int(i), str(d), int(c), int(o)) for r, i, d, c, o in doc["segments"])
            end = _check_segments(entries, segments)
            buckets = tuple((int(a), int(b)) for a, b in doc["buckets"])
            stops = [0, *(b for _, b in buckets)]
            payload_bytes = int(doc["payload_bytes"])
            if max(end, stops[-1]) > payload_bytes or any(a < prev or a >= b for (a, b), prev in
                                                          zip(buckets, stops[:-1], strict=True)):
                raise ValueError("segments or bucket ranges out of order or beyond the payload")
            return cls(int(doc["version"]), int(doc["base"]), str(doc["lineage"]), entries, arena_bytes,
                       payload_bytes, segments, buckets)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise FrameError(f"corrupt weight manifest: {exc}") from None


def _check_segments(entries: tuple[_Entry, ...], segments: tuple[tuple, ...]) -> int:
    """Segments must name real tensors with their dtypes, lie in order and aligned, and pair each ``idx`` with
    the ``val`` right after it; returns where the last one ends."""
    end, after_idx = 0, None
    for role, i, dtype, count, offset in segments:
        if not 0 <= i < len(entries):
            raise ValueError(f"segment for tensor #{i} of {len(entries)}")
        e = entries[i]
        want = {"full": (e.dtype, e.numel), "idx": ("int64", count), "val": (e.dtype, count)}.get(role)
        paired = after_idx == (i, count) if role == "val" else after_idx is None
        if want != (dtype, count) or not paired or offset < end or offset % ALIGN or count > e.numel:
            raise ValueError(f"bad {role} segment for tensor {e.name}")
        after_idx = (i, count) if role == "idx" else None
        end = offset + count * DTYPES[dtype].itemsize
    if after_idx is not None:
        raise ValueError("an idx segment without its val segment")
    return end


@dataclass
class _Held:
    version: int
    lineage: str
    entries: tuple[_Entry, ...]
    arena: torch.Tensor


class WeightSubscriber:
    """Client side: fetches versions from a WeightPublisher and keeps the last one (the base of deltas).
    One per thread."""

    def __init__(self, endpoint: str, max_bytes: int, timeout_s: float, *, sync: Any = None):
        self.sync = _options(sync)
        self.client = DataClient(endpoint, max_bytes=max_bytes, timeout_s=timeout_s, peer="learner")
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.sync.transport == "nccl" \
            else torch.device("cpu")
        self._held: _Held | None = None
        self._pair = None  # weight_transport.PairClient
        self.last_fetch_bytes = 0  # manifest + payload bytes of the last fetch that brought weights
        self.last_fetch_seconds = 0.0
        self.last_fetch_delta = False
        self.last_fetch_buckets = 0

    def fetch(self, have: int, min_version: int = 0, wait_s: float = 0.0) -> tuple[int, dict[str, Any] | None]:
        """(version, tensors) if a newer version >= min_version arrived within wait_s, else (latest, None).
        Tensors are read-only numpy arrays (torch tensors for bfloat16 and on CUDA); don't modify them."""
        for _ in range(FETCH_RESTARTS):
            t0 = time.perf_counter()
            meta = {"have": have, "min_version": min_version, "wait_s": wait_s, "transport": self.sync.transport}
            if self.sync.delta and self._held is not None:
                meta.update(base=self._held.version, lineage=self._held.lineage)
            kind, batch = self.client.request("get", TensorBatch(meta=meta), timeout_s=wait_s + self.timeout_s)
            if kind == "current":
                return batch.version, None
            if kind != "manifest":
                raise FrameError(f"unexpected answer {kind!r} to a weight request")
            manifest = _Manifest.parse(batch)
            try:
                payload, received = self._receive(manifest, batch)
            except _Gone as exc:
                log.info("weights: %s; restarting the fetch", exc)
                continue
            held = self._apply(manifest, payload)
            self._held = held if self.sync.delta else None  # a base for the next delta, else nothing to keep
            self.last_fetch_bytes = int(batch["manifest"].nbytes) + received
            self.last_fetch_seconds = time.perf_counter() - t0
            self.last_fetch_delta = manifest.base >= 0
            self.last_fetch_buckets = len(manifest.buckets)
            return manifest.version, self._views(held)
        raise RuntimeError(f"weights changed faster than {FETCH_RESTARTS} fetches could complete; the publisher "
                           f"keeps {KEEP_VERSIONS} versions")

    def _receive(self, manifest: _Manifest, first: TensorBatch) -> tuple[torch.Tensor, int]:
        payload = torch.zeros(manifest.payload_bytes, dtype=torch.uint8, device=self.device)
        if self.sync.transport == "zmq":
            return payload, self._receive_zmq(manifest, first, payload.numpy())
        pair = self._join()
        try:
            kind, batch = self.client.request("send", TensorBatch(meta={
                "pair": pair.pair, "version": manifest.version, "base": manifest.base, "lineage": manifest.lineage}))
        except RemoteError as exc:  # e.g. the publisher closed our pair (idle, or it lost us): join again
            self._drop_pair()
            raise _Gone(str(exc)) from None
        if kind == "gone":
            raise _Gone(batch.meta.get("reason"))
        try:
            pair.recv([payload[a:b] for a, b in manifest.buckets])
        except Exception as exc:
            self._drop_pair()
            raise RuntimeError(f"weight transfer over {self.sync.transport} failed: {exc}") from exc
        return payload, sum(b - a for a, b in manifest.buckets)

    def _receive_zmq(self, manifest: _Manifest, first: TensorBatch, out: np.ndarray) -> int:
        received, n = 0, len(manifest.buckets)

        def put(index: int, data: Any) -> None:
            nonlocal received
            start, stop = manifest.buckets[index]
            data = np.asarray(data)
            if data.dtype != np.uint8 or data.nbytes != stop - start:
                raise FrameError(f"weight bucket {index}: {data.nbytes} bytes, expected {stop - start}")
            out[start:stop] = data
            received += data.nbytes

        nxt = 0
        if "bucket" in first and n:
            put(0, first["bucket"])
            nxt = 1
        pending: deque[tuple[int, int]] = deque()
        while nxt < n or pending:
            while nxt < n and len(pending) < ZMQ_WINDOW:
                meta = {"version": manifest.version, "base": manifest.base, "lineage": manifest.lineage, "index": nxt}
                pending.append((self.client.send("bucket", TensorBatch(meta=meta)), nxt))
                nxt += 1
            seq, index = pending.popleft()
            kind, batch = self.client.recv(seq)
            if kind == "gone":
                raise _Gone(batch.meta.get("reason"))
            if kind != "bucket" or batch.meta.get("index") != index:
                raise FrameError(f"unexpected answer {kind!r} to weight bucket {index}")
            put(index, batch["data"])
        return received

    def _apply(self, m: _Manifest, payload: torch.Tensor) -> _Held:
        """The new version's arena: the payload itself when full, else a copy of the held version patched."""
        if m.base < 0:
            return _Held(m.version, m.lineage, m.entries, payload)
        held = self._held
        if held is None or (held.version, held.lineage, held.entries) != (m.base, m.lineage, m.entries):
            raise FrameError(f"weight delta from version {m.base} does not fit the held version "
                             f"{held.version if held else None}")
        arena = held.arena.clone()
        segs = iter(m.segments)
        for role, i, _, count, offset in segs:
            e = m.entries[i]
            if role == "full":
                e.raw(arena).copy_(payload[offset:offset + e.nbytes])
                continue
            _, _, _, _, val_offset = next(segs)
            idx = payload[offset:offset + 8 * count].view(torch.int64)
            if count and (int(idx.min()) < 0 or int(idx.max()) >= e.numel):
                raise FrameError(f"weight delta for '{e.name}' indexes outside its {e.numel} elements")
            e.raw(arena).view(-1, e.itemsize)[idx] = payload[val_offset:val_offset + count * e.itemsize].view(
                count, e.itemsize)
        return _Held(m.version, m.lineage, m.entries, arena)

    @staticmethod
    def _views(held: _Held) -> dict[str, Any]:
        out: dict[str, Any] = {}
        host = held.arena.numpy() if held.arena.device.type == "cpu" else None
        for e in held.entries:
            if host is None or e.dtype == "bfloat16":
                t = e.raw(held.arena).view(getattr(torch, e.dtype)).view(e.shape)
                out[e.name] = t.clone() if host is not None else t
            else:
                arr = host[e.offset:e.offset + e.nbytes].view(DTYPES[e.dtype]).reshape(e.shape)
                arr.flags.writeable = False
                out[e.name] = arr
        return out

    def _join(self):
        if self._pair is None:
            from rlfabric.services.core.weight_transport import PairClient, asking, local_ip_toward

            host = self.client.endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
            _, batch = self.client.request("join", TensorBatch(meta={
                "transport": self.sync.transport, "ip": local_ip_toward(host), "timeout_s": self.timeout_s}))
            pair = int(batch.meta["pair"])

            self._pair = PairClient(self.sync.transport, host, pair, batch.meta.get("prefix"),
                                    asking(self.client, {"pair": pair}), self.timeout_s)
        return self._pair

    def _drop_pair(self) -> None:
        if self._pair is not None:
            pair, self._pair = self._pair, None
            try:
                self.client.request("leave", TensorBatch(meta={"pair": pair.pair}), timeout_s=1.0)
            except (RemoteError, TimeoutError, FrameError) as exc:
                log.debug("weights: leaving pair %d: %s", pair.pair, exc)
            pair.close()

    def close(self) -> None:
        self._drop_pair()
        self.client.close()


def save_weights(store, version: int, state: dict[str, Any], key: str = WEIGHTS_KEY) -> str:
    """Write a weight version to the object store for cold starts (a rollout worker that joins late, a
    restarted one): the data-plane frames in a length-prefixed container, no pickle."""
    return store.put_bytes(key, pack_frames(encode("weights", TensorBatch(dict(state), version=version))))


def load_weights(store, max_bytes: int, key: str = WEIGHTS_KEY) -> tuple[int, dict[str, np.ndarray]] | None:
    """The stored version and tensors, or None if none was written yet."""
    if not store.exists(key):
        return None
    frames = unpack_frames(store.get_bytes(key), key)
    kind, batch = decode(frames, max_bytes)
    return batch.version, {k: v.clone() if hasattr(v, "clone") else np.array(v) for k, v in batch.tensors.items()}
