"""Issue 19, finding 10: what a token holder sends is bounded before it is held or allocated, and lengths cannot
wrap. Replay's parked long-polls, its byte capacity and sample sizes, ragged lengths in the codec and in Ragged,
registry entries, and the object keys a Redis replay's refs name."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from rlfabric.services.core.batch import Ragged, TensorBatch
from rlfabric.services.core.codec import FrameError, decode
from tests.conftest import short_config
from tests.support_redis import redis_server  # noqa: F401

WRAPPING = [2**63 - 1, 2**63 - 1, 3, 4]  # adds up to 5 in int64 arithmetic


def _ragged_frames(lengths: list[int], items: int) -> list[bytes]:
    header = {"w": 2, "kind": "put", "seq": 1, "version": 0, "meta": {}, "dims": ["sample"],
              "tensors": [{"name": "tokens", "dtype": "int64", "shape": [items], "lengths": [len(lengths)]}]}
    return [json.dumps(header).encode(), np.arange(items, dtype=np.int64).tobytes(),
            np.array(lengths, dtype=np.int64).tobytes()]


def test_ragged_lengths_that_wrap_in_int64_are_refused_by_the_decoder():
    with pytest.raises(FrameError, match="ragged tensor 'tokens'.*exceeds the 5 items"):
        decode(_ragged_frames(WRAPPING, 5), 1 << 20)
    _, ok = decode(_ragged_frames([1, 0, 3, 1], 5), 1 << 20)  # the honest lengths of the same values still pass
    assert [list(r) for r in ok["tokens"].rows()] == [[0], [], [1, 2, 3], [4]]


@pytest.mark.parametrize("lengths,items,why", [
    (WRAPPING, 5, "exceeds the 5 items"),
    ([2, -1], 1, "negative length"),
    ([1, 1], 3, "add up to 2 but there are 3"),
    ([2**62, 2**62, 2**62, 2**62], 2**62, "add up to"),  # no length above the items, but their sum wraps to 0
])
def test_ragged_constructor_refuses_lengths_that_do_not_describe_the_values(lengths, items, why):
    values = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (items,), (0,))  # (no real allocation)
    with pytest.raises(ValueError, match=why):
        Ragged(values, np.array(lengths, dtype=np.int64))


def test_a_wrapping_ragged_field_never_reaches_a_replay_store():
    """Before the fix the wrapping lengths were stored, and every later sample of the store broke."""
    from rlfabric.services.replay.stores.memory import MemoryStore

    store = MemoryStore(100)
    store.put(TensorBatch({"tokens": Ragged.from_rows([[1], [2, 3]], dtype=np.int64)}, dims=("sample",), version=0))
    with pytest.raises(FrameError):
        _, bad = decode(_ragged_frames(WRAPPING, 5), 1 << 20)
        store.put(bad)
    assert store.sample(8, np.random.default_rng(0))["tokens"].flat_lengths().sum() >= 8


# ---- registry entries -------------------------------------------------------------------------------------------

def _registration(**kw):
    from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2

    endpoint = {"grpc": "127.0.0.1:5000", "data": "tcp://127.0.0.1:5001",
                "metrics": "http://127.0.0.1:5002/metrics", **kw.pop("endpoint", {})}
    return coordinator_pb2.RegisterWorkerRequest(role=common_pb2.ROLLOUT, endpoint=common_pb2.Endpoint(**endpoint),
                                                 pid=1, host=kw.pop("host", "h"), labels=kw.pop("labels", {}))


@pytest.mark.parametrize("request_kw,field", [
    ({"host": "h" * (4 << 20)}, "host"),
    ({"endpoint": {"grpc": "127.0.0.1:" + "9" * (1 << 20)}}, "endpoint.grpc"),
    ({"endpoint": {"metrics": "http://x/" + "m" * 600}}, "endpoint.metrics"),
    ({"labels": {f"k{i}": "v" for i in range(1000)}}, "labels exceed"),
    ({"labels": {"pool": "p" * (1 << 20)}}, "label 'pool'"),
    ({"labels": {"k" * 500: "v"}}, "keys are at most"),
    ({"labels": {f"k{i}": "v" * 500 for i in range(10)}}, "a registration of"),
])
def test_registrations_larger_than_any_real_worker_are_refused(request_kw, field):
    """Before the fix each entry could hold up to 8 MiB of strings (the gRPC message bound), 4096 entries at once."""
    from rlfabric.services.coordinator.registry import WorkerRegistry

    reg = WorkerRegistry()
    first = reg.register(_registration())
    with pytest.raises(ValueError, match=field):
        reg.register(_registration(**request_kw))
    assert list(reg.workers) == [first.worker_id]  # the refused one replaced nothing (same grpc address)
    reg.register(_registration(host="worker-7.lab.example.org", labels={"pool": "gpu-a"}))  # a real one still fits


# ---- Redis replay's refs name only the batch's own objects ------------------------------------------------------

def _img(version: int) -> TensorBatch:
    return TensorBatch({"obs": np.full((4, 2, 64), version, np.float32), "rewards": np.zeros((4, 2), np.float32)},
                       version=version, dims=("time", "env"))


def _foreign_refs() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("rlfabric_replay_foreign_refs_total") or 0.0


@pytest.mark.parametrize("how", ["eviction", "clear"])
def test_refs_written_into_redis_cannot_make_replay_delete_a_checkpoint(redis_server, tmp_path, how):  # noqa: F811
    """Whoever could write the refs hash used to make replay delete any object (a checkpoint) on eviction."""
    import redis

    from rlfabric.services.core.objectstore import FilesystemObjectStore
    from rlfabric.services.replay.stores.redis import RedisStore

    objects = FilesystemObjectStore(tmp_path / "objects")
    checkpoint = "checkpoints/ckpt-000001/model.safetensors"
    objects.put_bytes(checkpoint, b"weights")
    store = RedisStore(redis_server, "run1", 8, object_store=objects, offload_bytes=1024, cache_bytes=0)
    store.put(_img(0))  # obs (2048 bytes) goes to the object store
    bid = store._window[0].id
    own = f"replay/run1/{bid}/obs"
    assert objects.exists(own)
    r = redis.Redis.from_url(redis_server)
    r.hset("rlfabric:run1:refs", bid, json.dumps([own, checkpoint, f"replay/run1/{bid}/../../../{checkpoint}",
                                                  f"replay/run10/{bid}/obs"]))
    before = _foreign_refs()
    if how == "eviction":
        store.put(_img(1))  # capacity 8: evicts the first batch
        assert store.evicted == 1
    else:
        store.clear()
    assert objects.get_bytes(checkpoint) == b"weights"
    assert not objects.exists(own)  # the batch's own offloaded tensor still goes
    assert _foreign_refs() - before == 3


def test_a_stored_batch_that_names_a_foreign_object_is_not_read(redis_server, tmp_path):  # noqa: F811
    import redis

    from rlfabric.services.core.codec import unpack_frames
    from rlfabric.services.core.objectstore import FilesystemObjectStore
    from rlfabric.services.replay.stores.redis import RedisStore, ReplayStoreError

    objects = FilesystemObjectStore(tmp_path / "objects")
    objects.put_bytes("checkpoints/secret", np.zeros(4 * 2 * 64, np.float32).tobytes())
    store = RedisStore(redis_server, "run1", 100, object_store=objects, offload_bytes=1024, cache_bytes=0)
    store.put(_img(0))
    bid = store._window[0].id
    r = redis.Redis.from_url(redis_server)
    frames = [bytes(f) for f in unpack_frames(r.get(f"rlfabric:run1:batch:{bid}"))]
    header = json.loads(frames[0])
    header["refs"][0]["key"] = "checkpoints/secret"
    from rlfabric.services.core.codec import pack_frames

    r.set(f"rlfabric:run1:batch:{bid}", pack_frames([json.dumps(header).encode(), *frames[1:]]))
    with pytest.raises(ReplayStoreError, match="names object 'checkpoints/secret'"):
        store.take_onpolicy(0)


# ---- replay: parked long-polls, byte capacity, sample sizes ------------------------------------------------------

@pytest.fixture
def replay():
    """A replay service in this process, as `rlfabric serve replay` builds it (its data plane on loopback)."""
    import asyncio

    from rlfabric.services.core.runtime import ServiceOptions, ServiceRuntime
    from rlfabric.services.replay.server import ReplayService

    async def build():
        return ReplayService(ServiceRuntime(ServiceOptions(role="replay")), "127.0.0.1")

    service = asyncio.run(build())
    clients = []

    def client(max_bytes: int = 1 << 26):
        from rlfabric.services.core.dataplane import DataClient

        clients.append(DataClient(service.data.endpoint, max_bytes=max_bytes, timeout_s=10, peer="replay"))
        return clients[-1]

    service.client = client
    yield service
    for c in clients:
        c.close()
    service.data.stop()


def _wait_parked(service, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(service.waiting) < count:
        assert time.monotonic() < deadline, f"{len(service.waiting)} gets parked, expected {count}"
        time.sleep(0.005)


def test_parked_long_polls_are_bounded_per_connection_and_per_service(replay):
    """Before the fix every get with wait_s was parked, without limit, for up to an hour each."""
    from rlfabric.services.core.dataplane import RemoteError
    from rlfabric.services.replay.server import MAX_PARKED_GETS, MAX_PARKED_PER_PEER

    get = TensorBatch(meta={"min_version": 0, "wait_s": 60.0})
    greedy = replay.client()
    for _ in range(MAX_PARKED_PER_PEER):
        greedy.send("get", get)
    with pytest.raises(RemoteError, match=f"this connection has {MAX_PARKED_PER_PEER} gets parked.*"
                                          "MAX_PARKED_PER_PEER"):
        greedy.recv(greedy.send("get", get), timeout_s=5)
    for _ in range(MAX_PARKED_GETS // MAX_PARKED_PER_PEER - 1):
        other = replay.client()
        for _ in range(MAX_PARKED_PER_PEER):
            other.send("get", get)
    _wait_parked(replay, MAX_PARKED_GETS)
    late = replay.client()
    with pytest.raises(RemoteError, match=f"{MAX_PARKED_GETS} gets are parked already.*MAX_PARKED_GETS"):
        late.request("get", get, timeout_s=5)
    assert late.request("get", TensorBatch(meta={"min_version": 0}))[0] == "empty"  # a plain get still answers
    # a put serves the oldest parked get; its slot is free again
    batch = TensorBatch({"obs": np.zeros((2, 1), np.float32)}, version=0, dims=("time", "env"))
    assert late.request("put", batch)[0] == "ack"
    kind, _ = greedy.recv(1, timeout_s=5)
    assert kind == "batch"
    seq = late.send("get", get)
    deadline = time.monotonic() + 10
    while not (replay.waiting and replay.waiting[-1].reply.seq == seq):  # the late get is parked now, not refused
        assert time.monotonic() < deadline, "the late get was not parked"
        time.sleep(0.005)
    assert len(replay.waiting) == MAX_PARKED_GETS


def test_a_sample_larger_than_a_reply_can_carry_is_refused_before_it_is_gathered(replay):
    """Before the fix `sample` gathered n rows of any size (n up to 2^24) and only then found it could not send
    them; now n x the largest row is checked against data_plane.max_message_bytes first."""
    from rlfabric.services.core.dataplane import RemoteError

    replay.data.max_bytes = 1 << 20
    c = replay.client(max_bytes=1 << 20)
    rows = TensorBatch({"obs": np.ones((4, 2, 16 << 10), np.uint8)}, version=0, dims=("time", "env"))  # 16 KiB rows
    assert c.request("put", rows)[0] == "ack"
    assert replay.store.row_bytes == (16 << 10) + 8
    with pytest.raises(RemoteError, match="a sample of 64 rows of up to 16392 bytes.*max_message_bytes=1048576"):
        c.request("sample", TensorBatch(meta={"n": 64}), timeout_s=5)
    with pytest.raises(RemoteError, match="max_message_bytes"):
        c.request("sample", TensorBatch(meta={"n": 64, "mix": {"online": 1.0}}), timeout_s=5)
    with pytest.raises(RemoteError, match="a sample of 64 rows"):
        c.request("sample_windows", TensorBatch(meta={"n": 16, "length": 4}), timeout_s=5)
    with pytest.raises(RemoteError, match=r"exceeds 16777216"):
        c.request("sample_windows", TensorBatch(meta={"n": 1 << 20, "length": 1 << 10}), timeout_s=5)
    kind, out = c.request("sample", TensorBatch(meta={"n": 32}))
    assert kind == "batch" and out["obs"].shape == (32, 16 << 10)  # what fits is served
    assert c.request("sample_windows", TensorBatch(meta={"n": 8, "length": 2}))[1]["obs"].shape == (8, 2, 16 << 10)


def test_memory_replay_capacity_counts_bytes_too():
    """Before the fix only rows counted: 1M rows of large images could take all of the host's memory."""
    from rlfabric.services.replay.stores.memory import MemoryStore, default_capacity_bytes

    assert MemoryStore(10).capacity_bytes == default_capacity_bytes() > 0
    store = MemoryStore(1_000_000, capacity_bytes=10_000)
    for v in range(3):
        store.put(TensorBatch({"obs": np.full((1000, 1), v, np.float32)}, version=v, dims=("sample",)))  # 4000 B
    assert len(store) == 2 and store.bytes == 8000 and store.evicted == 1 and store.transitions == 2000
    assert store.take_onpolicy(0).version == 1  # the evicted batch left the FIFO too
    with pytest.raises(ValueError, match="batch of 40000 bytes exceeds the memory replay's byte capacity of 10000"):
        store.put(TensorBatch({"obs": np.zeros((10_000, 1), np.float32)}, version=3, dims=("sample",)))
    assert len(store) == 2 and store.bytes == 8000


def test_row_bytes_follow_the_window_as_it_evicts():
    from rlfabric.services.replay.stores.memory import MemoryStore

    store = MemoryStore(30)
    wide = TensorBatch({"obs": np.zeros((10, 100), np.float32)}, version=0, dims=("sample",))
    narrow = TensorBatch({"obs": np.zeros((10, 1), np.float32)}, version=1, dims=("sample",))
    tokens = TensorBatch({"t": Ragged.from_rows([[1] * 50, [], [2]] * 3 + [[3]], dtype=np.int64)}, version=2,
                         dims=("sample",))
    store.put(wide)
    store.put(narrow)
    assert store.row_bytes == 400 + 8
    store.put(narrow)
    store.put(narrow)  # the wide batch is evicted
    assert store.row_bytes == 4 + 8
    store.put(tokens)  # a ragged row counts at its longest cell: 50 int64 items and its length
    assert store.row_bytes == 50 * 8 + 8 + 8
    store.clear()
    assert store.row_bytes == 0


def test_a_run_spec_sets_the_memory_replays_byte_capacity():
    from rlfabric.services.replay.stores import open_replay_store

    store = open_replay_store(short_config(replay={"capacity_bytes": 2 << 20}), "run-1")
    assert store.capacity_bytes == 2 << 20
    with pytest.raises(Exception, match="capacity_bytes"):  # below 1 MiB is refused at parse time, naming it
        short_config(replay={"capacity_bytes": 10})


def test_a_data_set_larger_than_the_byte_capacity_is_refused_not_cut(tmp_path):
    """Loading a data set source through a byte-bounded memory store would evict its first rows as it loads: the
    run would train on part of the user's data without a word. It is refused naming the fix instead."""
    from types import SimpleNamespace

    from rlfabric.services.core.paths import DataRoots, Endpoints
    from rlfabric.services.replay.datasets import DatasetError
    from rlfabric.services.replay.server import ReplayService

    np.savez(tmp_path / "demos.npz", obs=np.zeros((4096, 128), np.float32))  # 2 MiB
    np.savez(tmp_path / "small_rows.npz", obs=np.zeros((65536, 8), np.float32))  # 2 MiB in chunks under 1 MiB
    worker = SimpleNamespace(roots=DataRoots.parse(str(tmp_path)), endpoints=Endpoints.parse(""),
                             max_memory_bytes=1 << 30)
    for file in ("demos.npz", "small_rows.npz"):
        config = short_config(replay={"capacity_bytes": 1 << 20, "datasets": {"demos": file}})
        with pytest.raises(DatasetError, match="replay.capacity_bytes"):
            ReplayService._open_stores(worker, config, "r", str(tmp_path))
    config = short_config(replay={"capacity_bytes": 4 << 20, "datasets": {"demos": "demos.npz"}})
    stores, loaded = ReplayService._open_stores(worker, config, "r", str(tmp_path))
    assert loaded == {"demos": 4096} and stores["demos"].transitions == 4096


def test_a_runs_memory_replay_sources_share_the_operators_budget_and_messages_are_bounded():
    """replay.capacity_bytes defaulted to half the host's memory for each source (a run with a data set and
    interventions asked for 1.5x the host); data_plane.max_message_bytes had no upper bound."""
    import pydantic

    from rlfabric.services.core.config import ConfigError
    from rlfabric.services.replay.server import within_memory_budget

    two = {"datasets": {"demos": "demos.npz"}}  # the online source and the data set's
    assert within_memory_budget(short_config(replay=two), 64 << 20).replay.capacity_bytes == 32 << 20
    assert within_memory_budget(short_config(replay={"capacity_bytes": 16 << 20, **two}),
                                64 << 20).replay.capacity_bytes == 16 << 20
    with pytest.raises(ConfigError, match=r"asks 100663296 bytes, over this replay service's "
                                          r"--max-memory-bytes=67108864"):
        within_memory_budget(short_config(replay={"capacity_bytes": 48 << 20, **two}), 64 << 20)
    with pytest.raises(pydantic.ValidationError, match="max_message_bytes"):
        short_config(data_plane={"max_message_bytes": 2**33})
