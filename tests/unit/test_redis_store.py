"""RedisStore against a real redis-server: MemoryStore's semantics, the key layout, persistence, offloading to the
object store, and what happens when Redis is missing or lost."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import decode
from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.objectstore import FilesystemObjectStore, ObjectStore
from rlfabric.services.replay.stores import open_replay_store
from rlfabric.services.replay.stores.memory import MemoryStore
from rlfabric.services.replay.stores.redis import (
    RedisStore,
    ReplayStoreError,
    ReplayStoreUnavailable,
    redact_url,
    unpack_frames,  # re-exported from rlfabric.services.core.codec
)
from tests.support_redis import RedisServer, redis_server  # noqa: F401


def _batch(version, T=4, N=2, fill=None, width=3):
    fill = version if fill is None else fill
    return TensorBatch({"obs": np.full((T, N, width), fill, np.float32), "rewards": np.full((T, N), fill, np.float32),
                        "last_values": np.zeros(N, np.float32)}, version=version, meta={"chunk": version % 2},
                       dims=("time", "env"), field_dims={"last_values": ("env",)})


def _store(url, run_id="t", capacity=1000, **kw) -> RedisStore:
    return RedisStore(url, run_id, capacity, **kw)


def _same(a: TensorBatch, b: TensorBatch) -> None:
    assert a.version == b.version and set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        np.testing.assert_array_equal(a[name], b[name])
        assert a[name].dtype == b[name].dtype


STATS = ("transitions", "bytes", "puts", "onpolicy_gets", "samples", "evicted", "stale_dropped", "newest_version",
         "pending")


@pytest.mark.parametrize("cache_bytes,inline_bytes", [(256 << 20, 1 << 20), (0, 0)],
                         ids=["cached-value-in-script", "uncached-value-in-multi"])
def test_same_answers_and_counters_as_the_memory_store(redis_server, cache_bytes, inline_bytes):  # noqa: F811
    """Every operation, step by step, against MemoryStore as the reference: FIFO with the version bound, eviction,
    uniform sampling with the same rng draws, clear."""
    mem, red = MemoryStore(40), _store(redis_server, capacity=40, cache_bytes=cache_bytes, inline_bytes=inline_bytes)
    rng_m, rng_r = np.random.default_rng(7), np.random.default_rng(7)

    def both(op):
        a, b = op(mem, rng_m), op(red, rng_r)
        for field in STATS:
            assert getattr(red, field) == getattr(mem, field), field
        assert len(red) == len(mem)
        return a, b

    for v in range(3):
        assert both(lambda s, _, v=v: s.put(_batch(v, T=4 + v)))[1] == v + 1  # 8 + 10 + 12 transitions
    for v in range(3, 6):  # 10 each: the window overflows 40 and evicts the oldest (still pending) batches
        both(lambda s, _, v=v: s.put(_batch(v, T=5, N=2)))
    assert red.evicted == 3 and red.pending == 3
    a, b = both(lambda s, _: s.take_onpolicy(4))  # version 3 is older than the bound: dropped and counted
    _same(a, b)
    assert red.stale_dropped == 1 and b.meta == {"chunk": 0}
    a, b = both(lambda s, r: s.sample(500, r))
    _same(a, b)
    assert set(b["version"]) == {3, 4, 5} and b["obs"].shape == (500, 3) and "last_values" not in b
    while (pair := both(lambda s, _: s.take_onpolicy(0)))[0] is not None:
        _same(*pair)
    assert pair[1] is None
    both(lambda s, _: s.clear())
    assert red.transitions == 0 and red.puts == 6 and len(red) == 0
    with pytest.raises(ValueError, match="empty"):
        red.sample(1, rng_r)


def test_sampling_a_window_of_mixed_layouts_matches_the_memory_store(redis_server):  # noqa: F811
    """Sampling reads per-tensor columns while every batch has one layout; a different one (here float64 rewards)
    falls back to gathering per batch until it is evicted."""
    mem, red = MemoryStore(32), _store(redis_server, capacity=32)
    odd = _batch(1)
    odd["rewards"] = odd["rewards"].astype(np.float64)
    for b in (_batch(0), odd, _batch(2), _batch(3)):
        mem.put(b)
        red.put(b)
    a, b = mem.sample(300, np.random.default_rng(5)), red.sample(300, np.random.default_rng(5))
    _same(a, b)
    assert b["rewards"].dtype == np.float64 and red._columns is None
    for v in (4, 5):  # evicts batches 0 and 1: one layout again
        mem.put(_batch(v))
        red.put(_batch(v))
    a, b = mem.sample(300, np.random.default_rng(6)), red.sample(300, np.random.default_rng(6))
    _same(a, b)
    assert b["rewards"].dtype == np.float32 and red._columns is not None and red._columns.rows == 32
    columns = red._columns
    mem.put(_batch(6, T=8))
    red.put(_batch(6, T=8))  # kept up to date by puts and evictions, not rebuilt
    assert red._columns is columns
    _same(mem.sample(300, np.random.default_rng(7)), red.sample(300, np.random.default_rng(7)))


def test_evicting_a_batch_already_taken_keeps_the_pending_ones(redis_server):  # noqa: F811
    s = _store(redis_server, capacity=16)
    for v in range(2):
        s.put(_batch(v))
    assert s.take_onpolicy(0).version == 0
    s.put(_batch(2))  # evicts batch 0, which is no longer pending
    assert (len(s), s.pending, s.evicted, s.transitions) == (2, 2, 1, 16)
    assert [s.take_onpolicy(0).version, s.take_onpolicy(0).version, s.take_onpolicy(0)] == [1, 2, None]


def test_bad_batches_are_refused_and_nothing_is_written(redis_server):  # noqa: F811
    s = _store(redis_server, capacity=100)
    with pytest.raises(ValueError, match="policy version"):
        s.put(_batch(-1))
    with pytest.raises(ValueError, match="batch dim 'time' is 3"):
        s.put(TensorBatch({"a": np.zeros((4, 2)), "b": np.zeros((3, 2))}, version=0, dims=("time", "env")))
    with pytest.raises(ValueError, match="exceeds replay.capacity_transitions=100"):
        s.put(_batch(0, T=60))
    with pytest.raises(ValueError, match="empty"):
        s.sample(1, np.random.default_rng(0))
    assert redis.Redis.from_url(redis_server).keys("rlfabric:t:batch:*") == []


def test_key_layout_holds_codec_frames_and_eviction_deletes_keys(redis_server):  # noqa: F811
    s = _store(redis_server, run_id="run-7", capacity=16, key_prefix="lab")
    for v in range(3):
        s.put(_batch(v))  # 8 transitions each: the third put evicts the first
    r = redis.Redis.from_url(redis_server)
    entries = [e.decode().split(" ") for e in r.lrange("lab:run-7:window", 0, -1)]
    window = [e[0] for e in entries]
    assert [e[1:] for e in entries] == [["8", "1", "136", "0"], ["8", "2", "136", "0"]]  # transitions, version,
    assert sorted(k.decode() for k in r.keys("*")) == sorted(  # bytes, offloaded
        [f"lab:run-7:batch:{i}" for i in window] + [f"lab:run-7:{k}" for k in ("window", "stats")])
    frames = unpack_frames(r.get(f"lab:run-7:batch:{window[0]}"))
    header = json.loads(frames[0].tobytes())
    assert header["id"] == window[0] and header["refs"] == []
    kind, batch = decode(frames[1:], 1 << 20)  # the data plane's own frames: JSON header + raw buffers
    assert kind == "batch" and batch.version == 1 and batch.meta == {"chunk": 1}
    _same(batch, _batch(1))
    stats = {k.decode(): int(v) for k, v in r.hgetall("lab:run-7:stats").items()}
    assert stats == {"transitions": 16, "bytes": 272, "puts": 3, "evicted": 1, "newest_version": 2, "samples": 0,
                     "pending": 2}
    assert s.take_onpolicy(0).version == 1 and r.hget("lab:run-7:stats", "pending") == b"1"


@pytest.mark.parametrize("inline_bytes,protocol", [(0, 2), (1 << 30, 2), (0, 3)],
                         ids=["value-in-multi", "value-in-script", "resp3"])
def test_puts_and_takes_on_the_stores_own_connection(redis_server, inline_bytes, protocol):  # noqa: F811
    """Replies are parsed by the store itself: RESP2 and RESP3, values larger than one read (received into a
    buffer of their own, handed out read-only), and a Redis that lost its script cache (SCRIPT FLUSH, or a restart)
    in the middle of a MULTI."""
    url = f"{redis_server}{'&' if '?' in redis_server else '?'}protocol={protocol}"
    s = _store(url, capacity=10_000, cache_bytes=0, inline_bytes=inline_bytes)
    big = _batch(2, T=64, N=8, width=64)  # 128 KiB of observations
    s.put(_batch(0))
    redis.Redis.from_url(redis_server).script_flush()
    s.put(_batch(1))
    s.put(big)
    _same(s.take_onpolicy(0), _batch(0))
    _same(s.take_onpolicy(1), _batch(1))
    taken = s.take_onpolicy(2)
    _same(taken, big)
    assert not taken["obs"].flags.writeable
    assert s.take_onpolicy(0) is None and (s.puts, s.onpolicy_gets, s.pending, len(s)) == (3, 3, 0, 3)


def test_a_reopened_store_has_the_same_batches_fifo_and_counters(redis_server):  # noqa: F811
    s = _store(redis_server, capacity=100)
    for v in range(4):
        s.put(_batch(v))
    assert s.take_onpolicy(1).version == 1
    s.sample(5, np.random.default_rng(0))
    s.close()
    again = _store(redis_server, capacity=100, cache_bytes=0)  # what a restarted replay service opens
    assert (len(again), again.pending, again.transitions, again.puts, again.onpolicy_gets, again.samples,
            again.stale_dropped, again.newest_version) == (4, 2, 32, 4, 1, 1, 1, 3)
    _same(again.take_onpolicy(0), _batch(2))
    assert again.put(_batch(4)) == 5
    _same(again.take_onpolicy(0), _batch(3))
    _same(again.take_onpolicy(0), _batch(4))
    assert again.take_onpolicy(0) is None
    assert len(_store(redis_server, run_id="other")) == 0  # runs do not see each other
    smaller = _store(redis_server, capacity=20)  # reopened with a smaller capacity: trimmed at once
    assert (len(smaller), smaller.transitions, smaller.evicted) == (2, 16, 3)


class _NoDeleteStore(ObjectStore):
    """An object store that implements only the base interface's reads and writes (delete is not implemented)."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def put_bytes(self, key: str, data: bytes) -> str:
        self.objects[key] = bytes(data)
        return f"mem://{key}"

    def get_bytes(self, key: str) -> bytes:
        return self.objects[key]


def test_large_tensors_go_to_the_object_store_by_reference(redis_server, tmp_path):  # noqa: F811
    objects = FilesystemObjectStore(tmp_path / "objects")
    s = _store(redis_server, run_id="img", capacity=24, object_store=objects, offload_bytes=1024, cache_bytes=0)
    big = _batch(0, width=64)  # obs: 4*2*64*4 = 2048 bytes > 1024; rewards: 32 bytes stay in Redis
    s.put(big)
    bid = s._window[0].id
    key = f"replay/img/{bid}/obs"
    assert objects.list("replay/") == [key]
    assert objects.get_bytes(key) == big["obs"].tobytes()
    r = redis.Redis.from_url(redis_server)
    frames = unpack_frames(r.get(f"rlfabric:img:batch:{bid}"))
    assert json.loads(frames[0].tobytes())["refs"] == [{"frame": 1, "tensor": "obs", "key": key, "bytes": 2048}]
    assert len(frames[2]) == 0 and len(frames[3]) == 32  # no observation bytes in Redis
    assert json.loads(r.hget("rlfabric:img:refs", bid)) == [key]
    _same(_store(redis_server, run_id="img", capacity=24, object_store=objects).take_onpolicy(0), big)
    s.put(_batch(1, width=64))
    s.put(_batch(2, width=64))  # capacity 24 holds 3 batches; the next put evicts the first
    s.put(_batch(3, width=64))
    assert len(objects.list("replay/img/")) == 3 and key not in objects.list("replay/img/")
    out = s.sample(64, np.random.default_rng(1))
    np.testing.assert_array_equal(out["obs"][:, 0], out["version"].astype(np.float32))  # resolved, aligned
    s.clear()
    assert objects.list("replay/") == []


def test_without_object_store_delete_eviction_still_works_and_says_so(redis_server, caplog):  # noqa: F811
    objects = _NoDeleteStore()
    s = _store(redis_server, capacity=8, object_store=objects, offload_bytes=1024)
    with caplog.at_level(logging.WARNING):
        s.put(_batch(0, width=64))
        s.put(_batch(1, width=64))
    assert len(s) == 1 and s.evicted == 1
    assert "has no delete()" in caplog.text
    assert len(objects.objects) == 2  # the evicted batch's object stays behind


def test_factory_picks_the_store_by_config(redis_server):  # noqa: F811
    cfg = RunConfig.model_validate({"replay": {"store": "redis", "redis_url": redis_server, "capacity_transitions": 50,
                                               "key_prefix": "fx"}})
    store = open_replay_store(cfg, "r1", None)
    assert isinstance(store, RedisStore) and store.capacity == 50 and store.prefix == "fx:r1:"
    assert isinstance(open_replay_store(RunConfig(), "r1", None), MemoryStore)


def test_redis_down_at_open_is_a_fast_clear_error(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ReplayStoreUnavailable) as info:
        _store(f"redis://127.0.0.1:{port}/0", retry_attempts=5, retry_backoff_s=1.0)
    assert time.monotonic() - t0 < 1.0  # no retry budget spent on a Redis that is not there at all
    msg = str(info.value)
    assert f"replay.redis_url='redis://127.0.0.1:{port}/0'" in msg and "start redis-server" in msg
    with pytest.raises(ReplayStoreError, match="is not a Redis URL.*redis://HOST:PORT"):
        _store("http://127.0.0.1:1/")


def test_a_redis_that_never_answers_fails_within_connect_timeout():
    silent = socket.socket()  # accepts connections (the kernel does) but never replies: a hung Redis
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        t0 = time.monotonic()
        with pytest.raises(ReplayStoreUnavailable, match="replay.connect_timeout_s=0.3"):
            _store(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", connect_timeout_s=0.3)
        assert time.monotonic() - t0 < 2.0
    finally:
        silent.close()


def test_wrong_password_is_bad_input_and_is_not_repeated(tmp_path):
    server = RedisServer(tmp_path / "redis", extra_args=("--requirepass", "right")).start()
    try:
        assert len(_store(server.url)) == 0  # the right password in the URL works
        with pytest.raises(ReplayStoreError) as info:
            _store(f"redis://:s3cret@127.0.0.1:{server.port}/0", retry_attempts=5, retry_backoff_s=1.0)
        assert info.value.bad_input and "refused the credentials" in str(info.value)
        assert "s3cret" not in str(info.value) and ":***@127.0.0.1" in str(info.value)
    finally:
        server.kill()
    assert redact_url("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


@pytest.mark.parametrize("appendfsync,crash", [("always", True), ("everysec", False)],
                         ids=["sigkill-fsync-always", "clean-restart-everysec"])
def test_acknowledged_batches_survive_a_redis_restart_with_appendonly(tmp_path, appendfsync, crash):
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync=appendfsync).start()
    try:
        s = _store(server.url, capacity=100)
        for v in range(5):
            s.put(_batch(v))  # returned = acknowledged
        s.take_onpolicy(0)
        s.close()
        server.kill() if crash else server.stop()
        server.start()
        again = _store(server.url, capacity=100, cache_bytes=0)
        assert (len(again), again.pending, again.puts, again.onpolicy_gets) == (5, 4, 5, 1)
        for v in range(1, 5):
            _same(again.take_onpolicy(0), _batch(v))
    finally:
        server.kill()


def test_redis_lost_mid_run_recovers_if_it_returns_within_the_retries(tmp_path, caplog):
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    try:
        s = _store(server.url, retry_attempts=8, retry_backoff_s=0.05)  # waits 0.05, 0.1, 0.2, ... up to 2 s
        s.put(_batch(0))
        server.kill()
        # The put runs on a helper thread while this one brings Redis back: a redis-server started by a short-lived
        # thread (a threading.Timer) dies with it, PR_SET_PDEATHSIG being per thread.
        answer: dict = {}

        def put() -> None:
            try:
                answer["puts"] = s.put(_batch(1))
            except Exception as exc:  # noqa: BLE001 — reported by the assert below
                answer["error"] = exc

        with caplog.at_level(logging.WARNING):
            helper = threading.Thread(target=put)
            helper.start()
            time.sleep(0.3)
            server.start()
            helper.join(30)
        assert answer == {"puts": 2}  # blocked in retries until Redis was back
        assert "Redis connection lost" in caplog.text and "retry 1/8" in caplog.text
        _same(s.take_onpolicy(0), _batch(0))
        _same(_store(server.url, cache_bytes=0).take_onpolicy(1), _batch(1))
    finally:
        server.kill()


def test_redis_lost_mid_run_gives_a_clear_error_after_bounded_retries(tmp_path):
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    try:
        s = _store(server.url, retry_attempts=3, retry_backoff_s=0.05, cache_bytes=0, connect_timeout_s=1.0)
        s.put(_batch(0))
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(ReplayStoreUnavailable) as info:
            s.put(_batch(1))
        # bounded: 0.05 + 0.1 + 0.2 s of backoff, and at most connect_timeout_s per attempt (refused connects are
        # instant; a socket to a server still dying may wait out its timeout, which made a tighter bound flaky)
        assert time.monotonic() - t0 < 3 * 1.0 + 0.35 + 1.0
        msg = str(info.value)
        assert "during put" in msg and "replay.retry_attempts=3" in msg and "restart redis-server" in msg
        with pytest.raises(ReplayStoreUnavailable, match="during sample"):
            s.sample(4, np.random.default_rng(0))
        assert (s.puts, len(s)) == (1, 1)  # the refused put was not counted
        server.start()  # the same store object carries on once Redis is back
        assert s.put(_batch(2)) == 2
        assert [s.take_onpolicy(0).version, s.take_onpolicy(0).version] == [0, 2]
    finally:
        server.kill()


class _FlakyProxy:
    """TCP proxy in front of Redis that can drop one reply after Redis executed the request (a lost ack)."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.drop_after = b""  # when set: drop the first reply that follows a request containing these bytes
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(self.target)
            armed = threading.Event()
            threading.Thread(target=self._pump, args=(client, upstream, armed, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, armed, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, armed: threading.Event, requests: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if requests and self.drop_after and self.drop_after in data:
                    self.drop_after = b""
                    armed.set()
                elif not requests and armed.is_set():
                    raise OSError("reply dropped")  # Redis has executed the request: that is why it replied
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("inline_bytes,request_marker", [(1 << 20, b"EVALSHA"), (0, b"EXEC")],
                         ids=["value-in-script", "value-in-multi"])
def test_a_retry_after_a_lost_reply_neither_duplicates_nor_skips(redis_server, inline_bytes,  # noqa: F811
                                                                 request_marker):
    real = redis.Redis.from_url(redis_server)
    target = urlsplit(redis_server)
    proxy = _FlakyProxy(target.hostname, target.port or 6379)
    try:
        via_proxy = redis_server.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
        s = _store(via_proxy, retry_attempts=3, retry_backoff_s=0.01, inline_bytes=inline_bytes)
        s.put(_batch(0))
        evalsha_before = _evalsha_calls(real)
        proxy.drop_after = request_marker
        assert s.put(_batch(1)) == 2  # Redis stored it, the ack was lost, the retry found it already there
        assert _evalsha_calls(real) - evalsha_before == 2 and proxy.connections == 2  # it really ran twice
        assert real.llen("rlfabric:t:window") == 2 and real.hget("rlfabric:t:stats", "pending") == b"2"
        assert len(s) == 2
        assert real.hget("rlfabric:t:stats", "puts") == b"2"
        proxy.drop_after = b"EVALSHA"
        _same(s.take_onpolicy(0), _batch(0))  # the retried take answers with what the first attempt popped
        assert real.hget("rlfabric:t:stats", "pending") == b"1" and s.onpolicy_gets == 1 and s.pending == 1
        _same(s.take_onpolicy(0), _batch(1))
        fresh = _store(redis_server, cache_bytes=0)
        _same(fresh.sample(9, np.random.default_rng(0)), s.sample(9, np.random.default_rng(0)))
    finally:
        proxy.close()


def _evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_sequence_windows_match_the_memory_store(redis_server):  # noqa: F811
    mem, red = MemoryStore(1000), _store(redis_server, capacity=1000, cache_bytes=0)
    for v in range(3):
        b = _batch(v, T=6, N=3)
        b["rewards"] = (100 * np.arange(6)[:, None] + np.arange(3)[None, :] + 10000 * v).astype(np.float32)
        mem.put(b)
        red.put(b)
    a, b = mem.sample_windows(200, 3, np.random.default_rng(4)), red.sample_windows(200, 3, np.random.default_rng(4))
    assert a.dims == b.dims == ("sample", "time")
    for name in ("obs", "rewards", "version"):
        np.testing.assert_array_equal(a[name], b[name])
    assert (np.diff(b["rewards"], axis=1) == 100).all()


def test_row_bytes_follow_the_window_and_survive_a_reopen(redis_server):  # noqa: F811
    """What replay checks a sample request against: the largest row of the window, as batches come and go."""
    s = _store(redis_server, capacity=24)
    s.put(_batch(0, width=100))  # obs 400 B + rewards 4 B per row, and the version column
    s.put(_batch(1, width=1))
    assert s.row_bytes == 400 + 4 + 8
    s.put(_batch(2, width=1))
    s.put(_batch(3, width=1))  # capacity 24 holds 3 batches of 8 rows: the wide one is evicted
    assert s.row_bytes == 4 + 4 + 8
    s.close()
    again = _store(redis_server, capacity=24)  # a reloaded entry knows its bytes: the mean row (per-env
    assert again.row_bytes == 8 + (8 * 8 + 8) // 8  # last_values included), at least the true one
    again.clear()
    assert again.row_bytes == 0
