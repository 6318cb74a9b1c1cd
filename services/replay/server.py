"""The replay service's faces: gRPC control (Configure, GetStats, Clear) and the data plane.

Data-plane requests (``source`` defaults to "online", where rollout workers put what they collect):
  put     batch(version, dims) {source?}                 -> ack {puts, transitions}  (only once stored)
  get     {min_version, wait_s}                          -> batch | empty            (on-policy FIFO, long-poll)
  sample  {n, source? | mix: {source: weight},           -> n rows ("sample",), with a per-row "version" (and
           minibatch?}                                      "source" index into meta.sources for a mix)
  sample_windows {n, length, source?}                    -> n windows ("sample", "time") of consecutive steps

What a client can make replay hold is bounded: parked gets (MAX_PARKED_GETS, MAX_PARKED_PER_PEER), and a sample's
rows (n, times length for windows) and bytes (they must fit one data-plane message), checked before anything is
drawn; the excess is refused with an error naming the bound.

Each named source is a store of its own (``replay.store``: memory, or Redis so the data outlives this process);
``replay.datasets`` sources are loaded from files at Configure. A store that cannot do its job (Redis lost beyond
the retries) answers with an error naming the config field and the fix.

A mix is stratified: every consecutive ``minibatch`` rows of its answer (all n when not given) hold each source's
share, floor(weight * minibatch) rows plus a random draw of the rounding remainder (so each share is exact in
expectation, and exact when weight * minibatch is whole), and carry the fields every source has (a data set's
extra columns, e.g. ``episode``, are left out when the online window lacks them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import grpc
import numpy as np
from prometheus_client import Counter, Gauge

from rlfabric.services.core import paths
from rlfabric.services.core.algorithm import DEFAULT_SOURCE
from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.config import ConfigError, RunConfig
from rlfabric.services.core.dataplane import (
    DataServer,
    Reply,
    StaleAttempt,
    check_fence,
    fence_of,
    meta_float,
    meta_int,
)
from rlfabric.services.core.objectstore import open_store
from rlfabric.services.core.ownership import check_owner
from rlfabric.services.core.paths import DataRoots, Endpoints, confine_storage, redis_endpoint
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, replay_pb2, replay_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime, run_service
from rlfabric.services.replay.datasets import DatasetError, chunks, load_dataset
from rlfabric.services.replay.stores import MAX_SAMPLE_ROWS, ReplayStore, check_sample, open_replay_store
from rlfabric.services.replay.stores.memory import MemoryStore, default_capacity_bytes
from rlfabric.services.replay.stores.redis import ReplayStoreError, ReplayStoreUnavailable, redact_url

log = logging.getLogger(__name__)
PUTS = Counter("rlfabric_replay_puts_total", "trajectory batches stored")
TRANSITIONS = Gauge("rlfabric_replay_transitions", "rows stored, by source", ["source"])
STALE = Counter("rlfabric_replay_stale_attempt_requests_total",
                "requests refused as coming from a worker of an ended attempt (a fenced-off worker)")
STORE_ERRORS = Counter("rlfabric_replay_store_errors_total", "requests the store could not serve (e.g. Redis lost)")
MAX_PARKED_GETS = 1024  # long-polling gets parked at once: each holds a reply, and every put scans them
MAX_PARKED_PER_PEER = 16  # ... by one connection (a learner parks one at a time)
REDIS_PASSWORD_ENV = "RLFABRIC_REDIS_PASSWORD"  # the Redis password, from the worker's environment, never a run spec


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` when it names none (compose's Redis: redis://redis:6379/0 in the spec, the password
    in the replay container's environment)."""
    parts = urlsplit(url)
    if not password or parts.password is not None or parts.scheme not in ("redis", "rediss"):
        return url
    return urlunsplit(parts._replace(netloc=f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}@"
                                            f"{parts.netloc.rsplit('@', 1)[-1]}"))


@dataclass
class _Waiting:
    deadline: float
    min_version: int
    reply: Reply


class ReplayService(replay_pb2_grpc.ReplayServicer):
    def __init__(self, runtime: ServiceRuntime, host: str, roots: DataRoots | None = None,
                 endpoints: Endpoints | None = None):
        self.runtime = runtime
        # where a run spec's data sets and object store may lie, and the Redis/S3 endpoints it may name (the operator's)
        self.roots = roots if roots is not None else DataRoots.parse(".")
        self.endpoints = endpoints if endpoints is not None else Endpoints.parse("")
        self.max_memory_bytes = default_capacity_bytes()  # --max-memory-bytes: a run's memory sources together
        self.lock = threading.Lock()
        self.stores: dict[str, ReplayStore] = {DEFAULT_SOURCE: MemoryStore(RunConfig().replay.capacity_transitions)}
        self.rng = np.random.default_rng(0)
        self.waiting: list[_Waiting] = []
        self.fence = ""  # the run attempt this replay serves (Configure's context_json.fence): see check_fence
        self.stale_fences: set[str] = set()  # ended attempts' fences already logged (once each)
        self.data = DataServer(host, max_bytes=RunConfig().data_plane.max_message_bytes, name="replay",
                               advertise_host=runtime.advertise_host)
        runtime.data_endpoint = self.data.endpoint
        self.data.start(self.handle, self.tick)
        runtime.watch("replay-data-plane", self.data.health)
        runtime.on_shutdown(self._close_stores)  # hooks run in reverse: the data plane stops first
        runtime.on_shutdown(self.data.stop)

    @property
    def store(self) -> ReplayStore:
        """The "online" source: what rollout workers put and the on-policy FIFO."""
        return self.stores[DEFAULT_SOURCE]

    def _source(self, meta: dict) -> ReplayStore:
        name = meta.get("source", DEFAULT_SOURCE)
        if not isinstance(name, str) or name not in self.stores:
            raise ValueError(f"no replay source {str(name)[:64]!r}; this run has {sorted(self.stores)} "
                             f"(replay.datasets adds named sources)")
        return self.stores[name]

    def handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        try:
            check_fence(batch.meta, self.fence, "replay")
            self._handle(kind, batch, reply)
        except StaleAttempt as exc:
            STALE.inc()
            fence = str(batch.meta.get("fence"))[:32]
            if fence not in self.stale_fences and len(self.stale_fences) < 1024:
                self.stale_fences.add(fence)
                log.warning("refused '%s' from a worker of an ended attempt", kind, extra={"fence": fence})
            reply.error(str(exc))
        except ReplayStoreError as exc:
            STORE_ERRORS.inc()
            log.error("replay store failed on '%s': %s", kind, exc)
            reply.error(f"replay: '{kind}' failed: {str(exc).removeprefix('replay: ')}")

    def _handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        meta = batch.meta
        with self.lock:
            if kind == "put":
                store = self._source(meta)
                puts = store.put(batch)
                PUTS.inc()
                TRANSITIONS.labels(meta.get("source", DEFAULT_SOURCE)).set(store.transitions)
                reply.send("ack", TensorBatch(meta={"puts": puts, "transitions": store.transitions}))
                self._serve_waiting()
            elif kind == "get":
                min_version = meta_int(meta, "min_version", 0, -(1 << 62), 1 << 62)
                wait_s = meta_float(meta, "wait_s", 0.0, 0.0, 3600.0)
                found = self.store.take_onpolicy(min_version)
                if found is not None:
                    reply.send("batch", found)
                elif wait_s > 0:
                    self._park(_Waiting(time.monotonic() + wait_s, min_version, reply))
                else:
                    reply.send("empty")
            elif kind == "sample":
                found = self._sample(meta)
                if found is None:  # a source that fills as the run goes (interventions) may still be empty
                    reply.send("empty")
                else:
                    reply.send("batch", found)
            elif kind == "sample_windows":
                n, length = meta_int(meta, "n", 0, 1, MAX_SAMPLE_ROWS), meta_int(meta, "length", 0, 1, 1 << 16)
                store = self._source(meta)
                check_sample(n * length, store.row_bytes, self.data.max_bytes)
                reply.send("batch", store.sample_windows(n, length, self.rng))
            else:
                raise ValueError(f"unknown request kind {kind!r}; expected put, get, sample or sample_windows")

    def _sample(self, meta: dict) -> TensorBatch | None:
        """``n`` rows of one source, or of a mix (its empty sources left out, the others' weights renormalised);
        None when every source asked for is empty."""
        n = meta_int(meta, "n", 0, 1, MAX_SAMPLE_ROWS)
        mix = meta.get("mix")
        if mix is None:
            store = self._source(meta)
            if not store.transitions:
                return None
            check_sample(n, store.row_bytes, self.data.max_bytes)
            return store.sample(n, self.rng)
        if not isinstance(mix, dict) or not mix or not all(
                isinstance(w, int | float) and not isinstance(w, bool) and w >= 0 for w in mix.values()) or sum(
                mix.values()) <= 0:
            raise ValueError("meta.mix must map source names to non-negative weights with a positive sum")
        names = list(mix)
        for name in names:
            self._source({"source": name})
        weights = np.array([mix[k] if self.stores[k].transitions else 0.0 for k in names], dtype=np.float64)
        if weights.sum() <= 0:
            return None
        per = meta_int(meta, "minibatch", n, 1, n)
        if n % per:
            raise ValueError(f"meta.minibatch={per} does not divide n={n}: a mix is drawn as whole minibatches")
        check_sample(n, max(self.stores[k].row_bytes for k, w in zip(names, weights, strict=True) if w),
                     self.data.max_bytes)
        counts = stratified_counts(n // per, per, weights / weights.sum(), self.rng)  # [minibatch, source]
        parts = []
        for index, (name, k) in enumerate(zip(names, counts.sum(0), strict=True)):
            if k:
                part = self.stores[name].sample(int(k), self.rng)
                part.tensors["source"] = np.full(int(k), index, dtype=np.int64)
                parts.append(part)
        common = set.intersection(*(set(p.tensors) for p in parts))
        out = TensorBatch.cat([p.select(*common) for p in parts], "sample")
        # the rows come source by source; reorder them minibatch by minibatch, each holding its counts
        labels = np.repeat(np.tile(np.arange(len(names)), len(counts)), counts.reshape(-1))
        order = np.empty(n, dtype=np.int64)
        offset = 0
        for index in range(len(names)):
            at = labels == index
            order[at] = offset + np.arange(int(at.sum()))
            offset += int(at.sum())
        out = out.take(order)
        out.meta = {"sources": names}
        return out

    def _park(self, waiting: _Waiting) -> None:
        """Park a long-polling get until a batch comes or its wait ends; beyond the bounds it is refused (a
        ValueError, which the data plane answers as an error naming the bound)."""
        if len(self.waiting) >= MAX_PARKED_GETS:
            raise ValueError(f"{len(self.waiting)} gets are parked already, the most replay holds "
                             f"(MAX_PARKED_GETS={MAX_PARKED_GETS}); ask again without wait_s, or later")
        peer = waiting.reply.identity
        if sum(w.reply.identity == peer for w in self.waiting) >= MAX_PARKED_PER_PEER:
            raise ValueError(f"this connection has {MAX_PARKED_PER_PEER} gets parked already, the most one holds "
                             f"(MAX_PARKED_PER_PEER); wait for their answers before asking again")
        self.waiting.append(waiting)

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
                w.reply.send("batch", found)
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
            newest_version=s.newest_version,
            source_transitions={name: store.transitions for name, store in self.stores.items()})

    async def Configure(self, request, context):
        await check_owner(self.runtime, request.run_id, context)
        try:
            config = RunConfig.from_json(request.config_json)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            ctx = json.loads(request.context_json) if request.context_json else {}
            run_dir = str(ctx.get("run_dir") or "") if isinstance(ctx, dict) else ""
            fence = fence_of(ctx)
        except (json.JSONDecodeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"context_json is not valid JSON ({exc}). Fix: send "
                                                                  f'{{"run_dir": ..., "env_spec": ...}}')
        try:  # may wait up to replay.connect_timeout_s, and read data sets: keep the event loop (health) serving
            stores, loaded = await asyncio.to_thread(self._open_stores, config, request.run_id, run_dir)
        except ReplayStoreError as exc:
            code = (grpc.StatusCode.INVALID_ARGUMENT if exc.bad_input else grpc.StatusCode.UNAVAILABLE
                    if isinstance(exc, ReplayStoreUnavailable) else grpc.StatusCode.FAILED_PRECONDITION)
            await context.abort(code, str(exc))
        # storage.* settings (ObjectStoreError), replay.datasets files, paths and endpoints the operator did not allow
        except (ConfigError, DatasetError, paths.PathRefused, paths.EndpointRefused) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"replay: {exc}")
        except (ValueError, OSError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replay: cannot open replay.store="
                                                                     f"{config.replay.store!r}: {exc}")
        old = await asyncio.to_thread(self._swap, stores, config, fence)
        for store in old:
            await asyncio.to_thread(store.close)
        self.runtime.state = f"busy:{request.run_id}"
        log.info("configured", extra={"run_id": request.run_id, "store": config.replay.store,
                                      "sources": {k: len(s) for k, s in stores.items()}, "loaded": loaded})
        return common_pb2.ConfigureReply(data_endpoint=self.data.endpoint, detail_json=json.dumps({"loaded": loaded}))

    def _open_stores(self, config: RunConfig, run_id: str, run_dir: str
                     ) -> tuple[dict[str, ReplayStore], dict[str, int]]:
        """A store per source. Redis reopens what an earlier replay service stored under this run_id; its large
        tensors go to the run's object store (none without a run_dir or storage.root: they then stay in Redis).
        A data set source is (re)loaded from its file when its store is empty. Paths lie under this worker's data
        roots and endpoints are on its allow-list (a ValueError naming the field otherwise)."""
        objects = None
        if config.replay.store == "redis":
            self.endpoints.check(redis_endpoint(config.replay.redis_url), "replay.redis_url",
                                 redact_url(config.replay.redis_url))
            config = config.model_copy(update={"replay": config.replay.model_copy(
                update={"redis_url": with_password(config.replay.redis_url, os.environ.get(REDIS_PASSWORD_ENV, ""))})})
            if run_dir or config.storage.root or config.storage.kind != "filesystem":
                storage, run_dir = confine_storage(config.storage, run_dir, self.roots, self.endpoints)
                objects = open_store(storage, run_dir, run_id=run_id)
        stores: dict[str, ReplayStore] = {}
        loaded: dict[str, int] = {}
        if config.replay.store == "memory":
            config = within_memory_budget(config, self.max_memory_bytes)
        try:
            stores[DEFAULT_SOURCE] = open_replay_store(config, run_id, objects)
            for name in config.spec.data(config.algorithm).source_names:  # sources the run fills (interventions)
                if name not in stores and name not in config.replay.datasets:
                    stores[name] = open_replay_store(config, run_id, objects, source=name)
            for name, path in config.replay.datasets.items():
                data = load_dataset(path, max_rows=config.replay.capacity_transitions, roots=self.roots,
                                    field=f"replay.datasets.{name}", config=config)  # (a JSONL: the run's tokenizer)
                store = stores[name] = open_replay_store(config, run_id, objects, source=name,
                                                         capacity=max(data.rows, 1))
                if len(store) == 0:
                    try:
                        for part in chunks(data):
                            store.put(part)
                    except ValueError as exc:  # one chunk over the byte bound
                        raise DatasetError(f"replay.datasets.{name}: {path}: {exc}. Fix: raise "
                                           f"replay.capacity_bytes") from None
                    if store.transitions < data.rows:  # the byte bound evicted rows: a data set is kept whole
                        raise DatasetError(f"replay.datasets.{name}: {path} does not fit the replay's byte "
                                           f"capacity (it kept {store.transitions} of {data.rows} rows). Fix: raise "
                                           f"replay.capacity_bytes, or use replay.store=redis")
                    loaded[name] = data.rows
        except BaseException:
            for store in stores.values():
                store.close()
            raise
        return stores, loaded

    def _swap(self, stores: dict[str, ReplayStore], config: RunConfig, fence: str) -> list[ReplayStore]:
        with self.lock:
            old, self.stores, self.fence = list(self.stores.values()), stores, fence
            self.rng = np.random.default_rng(config.seed)
            self.data.max_bytes = config.data_plane.max_message_bytes
            for w in self.waiting:
                w.reply.error("replay was reconfigured for a new run; request again")
            self.waiting = []
            for name, store in stores.items():
                TRANSITIONS.labels(name).set(store.transitions)
        return [s for s in old if all(s is not n for n in stores.values())]

    def _close_stores(self) -> None:
        for store in self.stores.values():
            store.close()

    def _locked_stats(self) -> replay_pb2.ReplayStats:
        with self.lock:
            return self._stats()

    def _locked_clear(self, source: str, pending_only: bool) -> replay_pb2.ReplayStats:
        with self.lock:
            for store in ([self._source({"source": source})] if source else list(self.stores.values())):
                if pending_only:
                    store.drop_pending()
                else:
                    store.clear()
            return self._stats()

    async def GetStats(self, request, context):
        return await asyncio.to_thread(self._locked_stats)

    async def Clear(self, request, context):
        """Drop stored data: every source, or one; with pending_only, only the on-policy FIFO (the window stays).
        While a run owns this replay only that run's coordinator (naming the run) may clear it."""
        owner = self.runtime.owner_run
        if owner and request.run_id != owner:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"replay is in use by run {owner}: clearing it would take the data from under that "
                                f"run. Fix: stop the run first (rlfabric stop {owner}), then clear")
        await check_owner(self.runtime, request.run_id, context)  # naming the run takes its key too
        try:
            return await asyncio.to_thread(self._locked_clear, request.source, request.pending_only)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ReplayStoreError as exc:
            STORE_ERRORS.inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE if isinstance(exc, ReplayStoreUnavailable)
                                else grpc.StatusCode.FAILED_PRECONDITION, str(exc))


def stratified_counts(groups: int, per: int, p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[groups, sources] row counts, each row summing to ``per``: floor(p * per) of each source, and the rounding
    remainder drawn by p's fractional parts (a multinomial), so E[count] = p * per exactly."""
    share = p * per
    base = np.floor(share + 1e-9).astype(np.int64)
    left = per - int(base.sum())
    counts = np.tile(base, (groups, 1))
    if left > 0:
        frac = np.clip(share - base, 0.0, None)
        counts += rng.multinomial(left, frac / frac.sum(), size=groups)
    return counts


def within_memory_budget(config: RunConfig, budget: int) -> RunConfig:
    """A memory store's sources share ``budget`` (the service's --max-memory-bytes): each gets the spec's capacity_bytes,
    or its even share of the budget; a spec whose sources together ask more is refused (ConfigError)."""
    if config.replay.store != "memory":
        return config
    sources = {DEFAULT_SOURCE, *config.spec.data(config.algorithm).source_names, *config.replay.datasets}
    asked = config.replay.capacity_bytes
    if asked is None:
        share = max(1 << 20, budget // len(sources))
        return config.model_copy(update={"replay": config.replay.model_copy(update={"capacity_bytes": share})})
    if asked * len(sources) > budget:
        raise ConfigError(f"replay.capacity_bytes={asked} for each of the run's {len(sources)} sources "
                          f"({', '.join(sorted(sources))}) asks {asked * len(sources)} bytes, over this replay "
                          f"service's --max-memory-bytes={budget}. Fix: lower it, use "
                          f"replay.store=redis, or have the operator raise --max-memory-bytes")
    return config


async def _build(runtime: ServiceRuntime, args) -> None:
    service = ReplayService(runtime, args.host, DataRoots.parse(args.data_root), Endpoints.parse(args.allow_endpoints))
    if args.max_memory_bytes < 1 << 20:
        raise SystemExit("rlfabric serve replay: error: --max-memory-bytes must be at least 1 MiB (1048576)")
    service.max_memory_bytes = args.max_memory_bytes
    replay_pb2_grpc.add_ReplayServicer_to_server(service, runtime.server)


def _arguments(parser) -> None:
    paths.add_arguments(parser)
    parser.add_argument("--max-memory-bytes", type=int, default=default_capacity_bytes(),
                        help="what a run's memory replay may hold, all its sources together (default: half of "
                             "this host's memory); a spec's replay.capacity_bytes may ask less, never more")


def main(argv: list[str] | None = None) -> None:
    run_service("replay", _build, argv, _arguments)


if __name__ == "__main__":
    main()
