"""Issue 19, finding 10: what a token holder sends is bounded before it is held or allocated, and lengths cannot
wrap. Replay's parked long-polls, its byte capacity and sample sizes, ragged lengths in the codec and in Ragged,
registry entries, and the object keys a Redis replay's refs name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.core.batch import Ragged, TensorBatch
from services.core.codec import FrameError, decode
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
    from services.replay.stores.memory import MemoryStore

    store = MemoryStore(100)
    store.put(TensorBatch({"tokens": Ragged.from_rows([[1], [2, 3]], dtype=np.int64)}, dims=("sample",), version=0))
    with pytest.raises(FrameError):
        _, bad = decode(_ragged_frames(WRAPPING, 5), 1 << 20)
        store.put(bad)
    assert store.sample(8, np.random.default_rng(0))["tokens"].flat_lengths().sum() >= 8


# ---- registry entries -------------------------------------------------------------------------------------------

def _registration(**kw):
    from services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2

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
    from services.coordinator.registry import WorkerRegistry

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

    from services.core.objectstore import FilesystemObjectStore
    from services.replay.stores.redis import RedisStore

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

    from services.core.codec import unpack_frames
    from services.core.objectstore import FilesystemObjectStore
    from services.replay.stores.redis import RedisStore, ReplayStoreError

    objects = FilesystemObjectStore(tmp_path / "objects")
    objects.put_bytes("checkpoints/secret", np.zeros(4 * 2 * 64, np.float32).tobytes())
    store = RedisStore(redis_server, "run1", 100, object_store=objects, offload_bytes=1024, cache_bytes=0)
    store.put(_img(0))
    bid = store._window[0].id
    r = redis.Redis.from_url(redis_server)
    frames = [bytes(f) for f in unpack_frames(r.get(f"rlfabric:run1:batch:{bid}"))]
    header = json.loads(frames[0])
    header["refs"][0]["key"] = "checkpoints/secret"
    from services.core.codec import pack_frames

    r.set(f"rlfabric:run1:batch:{bid}", pack_frames([json.dumps(header).encode(), *frames[1:]]))
    with pytest.raises(ReplayStoreError, match="names object 'checkpoints/secret'"):
        store.take_onpolicy(0)
