"""Token batches — ragged sequences of varying length, prompt/response masks and GRPO-style group ids — come back
exactly from every hop they take: the codec, the data plane, and both replay stores (put/take and sampled rows).
Property-based: hypothesis draws the lengths, dtypes and groups."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfabric.services.core.batch import Ragged, TensorBatch
from rlfabric.services.core.codec import decode, encode
from rlfabric.services.core.dataplane import DataClient, DataServer
from rlfabric.services.replay.stores.memory import MemoryStore
from rlfabric.services.replay.stores.redis import RedisStore
from tests.support_redis import redis_server  # noqa: F401

_ids = itertools.count()


@st.composite
def token_batches(draw) -> TensorBatch:
    groups = draw(st.integers(1, 4))
    per_group = draw(st.integers(1, 3))
    B = groups * per_group
    lengths = draw(st.lists(st.integers(0, 9), min_size=B, max_size=B))
    dtype = draw(st.sampled_from([np.int64, np.int32, np.uint16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    rows = [rng.integers(0, 1000, n).astype(dtype) for n in lengths]
    prompt = [np.arange(n) < draw(st.integers(0, max(n, 0))) for n in lengths]  # a prompt prefix, then response
    logp = [rng.standard_normal((n, 2)).astype(np.float32) for n in lengths]  # items with a shape of their own
    return TensorBatch({"tokens": Ragged.from_rows(rows, dtype), "prompt_mask": Ragged.from_rows(prompt, bool),
                        "logp": Ragged.from_rows(logp, np.float32, item_shape=(2,)),
                        "group_id": np.repeat(np.arange(groups), per_group).astype(np.int64),
                        "row_id": np.arange(B, dtype=np.int64), "reward": rng.standard_normal(B).astype(np.float32)},
                       version=draw(st.integers(0, 50)), dims=("sample",), meta={"prompt_set": "arith"})


def _same(a: TensorBatch, b: TensorBatch) -> None:
    assert a.version == b.version and a.dims == b.dims and set(a.tensors) == set(b.tensors)
    for name, value in a.tensors.items():
        other = b.tensors[name]
        if isinstance(value, Ragged):
            assert isinstance(other, Ragged) and value.equals(other), name
        else:
            assert other.dtype == value.dtype and np.array_equal(other, value), name


def _rows_agree(sample: TensorBatch, original: TensorBatch) -> None:
    """Every sampled row is the original row its row_id names, ragged fields included."""
    tokens, logp = original["tokens"].rows(), original["logp"].rows()
    for i, row in enumerate(sample["row_id"]):
        assert np.array_equal(sample["tokens"].rows()[i], tokens[row])
        assert np.array_equal(sample["logp"].rows()[i], logp[row])
        assert sample["group_id"][i] == original["group_id"][row]


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(token_batches())
def test_codec_round_trip(batch):
    kind, back = decode(encode("batch", batch), 1 << 24)
    assert kind == "batch" and back.meta == batch.meta
    _same(batch, back)


@pytest.fixture(scope="module")
def echo_server():
    server = DataServer(max_bytes=1 << 24, name="echo")
    server.start(lambda kind, batch, reply: reply.send("echo", batch))
    client = DataClient(server.endpoint, max_bytes=1 << 24, timeout_s=5)
    yield client
    client.close()
    server.stop()


@SETTINGS
@given(batch=token_batches())
def test_data_plane_round_trip(echo_server, batch):
    kind, back = echo_server.request("put", batch)
    assert kind == "echo"
    _same(batch, back)


@SETTINGS
@given(batch=token_batches(), seed=st.integers(0, 1000))
def test_memory_store_round_trip_and_sampled_rows(batch, seed):
    store = MemoryStore(1000)
    store.put(batch)
    _same(batch, store.take_onpolicy(0))
    sample = store.sample(7, np.random.default_rng(seed))
    assert sample.dims == ("sample",) and sample.rows == 7
    _rows_agree(sample, batch)


@SETTINGS
@given(batch=token_batches(), seed=st.integers(0, 1000))
def test_redis_store_round_trip_and_sampled_rows(redis_server, batch, seed):  # noqa: F811
    for cache in (0, 1 << 20):  # from Redis itself, and from the store's in-process copy
        store = RedisStore(redis_server, f"ragged-{next(_ids)}", 1000, cache_bytes=cache)
        try:
            store.put(batch)
            _same(batch, store.take_onpolicy(0))
            sample = store.sample(7, np.random.default_rng(seed))
            _rows_agree(sample, batch)
            memory = MemoryStore(1000)
            memory.put(batch)
            _same(memory.sample(7, np.random.default_rng(seed)), sample)  # the same draws as the memory store
        finally:
            store.clear()
            store.close()
