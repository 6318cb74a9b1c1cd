"""Weight-sync epochs: bucketed, delta and torch.distributed transfers must give bit-identical weights."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.dataplane import DataClient, RemoteError
from rlfabric.services.core.weights import KEEP_VERSIONS, WeightPublisher, WeightSubscriber, WeightSyncOptions

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _raw(value) -> tuple[str, tuple, bytes]:
    """dtype, shape and the exact bytes of a tensor (bit identity, NaN payloads and -0.0 included)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()
    a = np.asarray(value)
    return a.dtype.name, a.shape, a.tobytes()


def digest(tensors: dict) -> dict[str, str]:
    return {k: hashlib.sha256(repr(_raw(v)[:2]).encode() + _raw(v)[2]).hexdigest() for k, v in tensors.items()}


def assert_identical(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert _raw(got[name]) == _raw(want[name]), name


def model(params: int = 50_000, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with the awkward cases: NaN and -0.0, bf16, ints, bools, a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "body.weight": torch.randn(params // 100, 100, generator=g),
        "body.bias": torch.randn(params // 100, generator=g),
        "head.weight": torch.randn(4, params // 100, generator=g).to(torch.bfloat16),
        "head.bias": torch.tensor([float("nan"), -0.0, 1.0, float("inf")]),
        "steps": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
        "table": torch.randn(10, 3, generator=g, dtype=torch.float64),
    }
    state["table.np"] = np.arange(12, dtype=np.int32).reshape(3, 4)
    return state


@pytest.fixture
def pair(request):
    """(publisher, subscriber-factory); closes everything it made."""
    made = []

    def open_pub(max_bytes=4 * MiB, **sync):
        pub = WeightPublisher("127.0.0.1", max_bytes, sync=WeightSyncOptions(**sync) if sync else None)
        made.append(pub)
        return pub

    def open_sub(pub, max_bytes=4 * MiB, **sync):
        sub = WeightSubscriber(pub.endpoint, max_bytes, timeout_s=5, sync=WeightSyncOptions(**sync) if sync else None)
        made.append(sub)
        return sub

    yield open_pub, open_sub
    for obj in reversed(made):
        obj.close()


def test_zmq_full_round_trip_is_bit_identical(pair):
    open_pub, open_sub = pair
    pub = open_pub()
    state = model()
    published = {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in state.items()}
    pub.publish(0, state)
    state["body.weight"].add_(1)  # training mutates the live tensors: the published snapshot must not change
    sub = open_sub(pub)
    version, got = sub.fetch(-1)
    state = published
    assert version == 0 and not sub.last_fetch_delta
    assert_identical(got, state)
    assert isinstance(got["body.weight"], np.ndarray) and not got["body.weight"].flags.writeable
    assert sub.last_fetch_buckets == 1 and sub.last_fetch_bytes >= sum(len(_raw(v)[2]) for v in state.values())
    assert sub.fetch(0) == (0, None)


def test_held_versions_are_bounded_in_bytes(pair):
    """A publisher keeps at most KEEP_VERSIONS versions, fewer when weight_sync.snapshot_bytes says so, and always
    the newest one (warning once when that alone is over the bound); a held older version still serves a fetch."""
    open_pub, open_sub = pair
    one = sum(_raw(v)[2].__len__() for v in model().values())
    roomy = open_pub(snapshot_bytes=100 * MiB)
    tight = open_pub(snapshot_bytes=int(2.5 * one))
    tiny = open_pub(snapshot_bytes=1024)
    for version in range(5):
        for pub in (roomy, tight, tiny):
            pub.publish(version, model(seed=version))
    assert len(roomy._snapshots) == KEEP_VERSIONS  # noqa: SLF001 — what the bound is about
    assert len(tight._snapshots) == 2 and tight.snapshot_bytes() <= int(2.5 * one) + 4096  # noqa: SLF001
    assert list(tiny._snapshots) == [4] and tiny.snapshot_bytes() > 1024  # noqa: SLF001
    version, got = open_sub(tight).fetch(-1)
    assert version == 4
    assert_identical(got, {k: v for k, v in model(seed=4).items()})


def test_buckets_smaller_than_one_tensor(pair):
    open_pub, open_sub = pair
    pub = open_pub(bucket_bytes=1000)
    sub = open_sub(pub)
    state = model(20_000)
    pub.publish(3, state)
    version, got = sub.fetch(-1)
    assert version == 3 and sub.last_fetch_buckets > 80  # body.weight alone is 80 KB: split between elements
    assert_identical(got, state)


def test_model_larger_than_the_message_bound_still_syncs(pair):
    open_pub, open_sub = pair
    pub = open_pub(max_bytes=256 * 1024)  # default 32 MiB buckets are capped to fit the bound
    sub = open_sub(pub, max_bytes=256 * 1024)
    state = model(500_000)  # 2 MB of float32
    pub.publish(1, state)
    version, got = sub.fetch(-1)
    assert version == 1 and sub.last_fetch_buckets >= 8
    assert_identical(got, state)


def _train_step(state: dict, version: int) -> dict:
    """A partly frozen model: the body stays, a few body.bias entries and the whole head change."""
    new = {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in state.items()}
    new["body.bias"][:: 97] += 0.5
    new["head.weight"] += 1
    new["head.bias"][0] = float(version)  # NaN -> number: a bitwise comparison sees it
    new["steps"] += 1
    return new


def test_delta_sends_little_and_is_bit_identical(pair):
    open_pub, open_sub = pair
    pub = open_pub(delta=True, bucket_bytes=256 * 1024)
    sub = open_sub(pub, delta=True)
    fresh = open_sub(pub)
    state = model(1_000_000)
    pub.publish(0, state)
    sub.fetch(-1)
    full_bytes = sub.last_fetch_bytes
    for version in (1, 2):
        state = _train_step(state, version)
        pub.publish(version, state)
        got_version, got = sub.fetch(version - 1)
        assert got_version == version and sub.last_fetch_delta
        assert sub.last_fetch_bytes < full_bytes / 20
        assert_identical(got, state)
        assert_identical(got, fresh.fetch(-1)[1])  # same as a full transfer
    assert sub.fetch(2) == (2, None)


def test_delta_falls_back_to_full_when_have_is_too_old(pair):
    open_pub, open_sub = pair
    pub = open_pub(delta=True)
    sub = open_sub(pub, delta=True)
    state = model()
    pub.publish(0, state)
    sub.fetch(-1)
    full_bytes = sub.last_fetch_bytes
    for version in range(1, KEEP_VERSIONS + 2):  # version 0 falls out of the publisher's history
        state = _train_step(state, version)
        pub.publish(version, state)
    version, got = sub.fetch(0)
    assert version == KEEP_VERSIONS + 1 and not sub.last_fetch_delta and sub.last_fetch_bytes >= full_bytes * 0.9
    assert_identical(got, state)
    # a reset starts a new sequence: equal version numbers no longer name the same weights, so no delta
    state = model(seed=1)
    pub.reset(KEEP_VERSIONS + 2, state)
    version, got = sub.fetch(KEEP_VERSIONS + 1)
    assert not sub.last_fetch_delta
    assert_identical(got, state)


def test_publish_during_an_inflight_fetch_gives_one_version(pair):
    open_pub, open_sub = pair
    pub = open_pub(bucket_bytes=4096)
    sub = open_sub(pub)
    states = {v: {"a": torch.full((50_000,), float(v)), "b": torch.full((3000,), v, dtype=torch.int64)}
              for v in range(10)}
    pub.publish(0, states[0])
    queued = []
    recv = sub.client.recv

    def publish_mid_fetch(seq, timeout_s=None):
        kind, batch = recv(seq, timeout_s)
        if kind == "bucket" and batch.meta["index"] == 3:
            while queued:
                v = queued.pop(0)
                pub.publish(v, states[v])
        return kind, batch

    sub.client.recv = publish_mid_fetch
    queued[:] = [1]  # one newer version: the fetch finishes on the version it started with
    version, got = sub.fetch(-1)
    assert version == 0
    assert_identical(got, states[0])
    queued[:] = list(range(2, 3 + KEEP_VERSIONS))  # version 1 is dropped mid-fetch: restart on the newest
    version, got = sub.fetch(0)
    assert version == 2 + KEEP_VERSIONS
    assert_identical(got, states[version])


def test_unknown_or_corrupt_bucket_requests_get_clear_errors(pair):
    open_pub, _ = pair
    pub = open_pub()
    pub.publish(0, model())
    client = DataClient(pub.endpoint, max_bytes=4 * MiB, timeout_s=5)
    try:
        kind, manifest = client.request("get", TensorBatch(meta={"have": -1}))
        lineage = json.loads(np.asarray(manifest["manifest"]).tobytes())["lineage"]
        with pytest.raises(RemoteError, match="bucket 999 does not exist: version 0 .* has 1 buckets"):
            client.request("bucket", TensorBatch(meta={"version": 0, "base": -1, "lineage": lineage, "index": 999}))
        kind, batch = client.request("bucket", TensorBatch(meta={"version": 5, "base": -1, "lineage": lineage,
                                                                 "index": 0}))
        assert kind == "gone" and "version 5 is no longer held" in batch.meta["reason"]
        kind, _ = client.request("bucket", TensorBatch(meta={"version": 0, "base": -1, "lineage": "other",
                                                             "index": 0}))
        assert kind == "gone"  # another sequence's version 0
        with pytest.raises(RemoteError, match="'bucket' refused"):
            client.request("bucket", TensorBatch(meta={"version": "zero"}))
        with pytest.raises(RemoteError, match="unknown request kind 'put'"):
            client.request("put")
        with pytest.raises(RemoteError, match="serves weights over zmq, not gloo"):
            client.request("join", TensorBatch(meta={"transport": "gloo"}))
        assert client.request("bucket", TensorBatch(meta={"version": 0, "base": -1, "lineage": lineage,
                                                          "index": 0}))[0] == "bucket"  # still serving
    finally:
        client.close()


def test_sync_options_are_validated_and_duck_typed(pair):
    open_pub, open_sub = pair
    with pytest.raises(ValueError, match="transport='tcp'"):
        WeightPublisher("127.0.0.1", MiB, sync=SimpleNamespace(transport="tcp", bucket_bytes=MiB, delta=False,
                                                               delta_max_fraction=0.25))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl needs a CUDA device here; use gloo"):
            WeightSubscriber("tcp://127.0.0.1:9", MiB, 5, sync=WeightSyncOptions(transport="nccl"))
    cfg = SimpleNamespace(transport="zmq", bucket_bytes=2048, delta=True, delta_max_fraction=0.5)
    pub = WeightPublisher("127.0.0.1", MiB, sync=cfg)
    sub = WeightSubscriber(pub.endpoint, MiB, 5, sync=cfg)
    try:
        pub.publish(0, {"w": torch.arange(10_000.0)})
        assert sub.fetch(-1)[1]["w"].tolist() == list(range(10_000)) and sub.last_fetch_buckets == 20
    finally:
        sub.close()
        pub.close()


def test_gloo_in_process_with_buckets_and_delta(pair):
    open_pub, open_sub = pair
    pub = open_pub(transport="gloo", bucket_bytes=64 * 1024, delta=True)
    sub = open_sub(pub, transport="gloo", delta=True)
    state = model(200_000)
    pub.publish(0, state)
    version, got = sub.fetch(-1)
    assert version == 0 and sub.last_fetch_buckets > 10
    assert_identical(got, state)
    state = _train_step(state, 1)
    pub.publish(1, state)
    version, got = sub.fetch(0)
    assert version == 1 and sub.last_fetch_delta
    assert_identical(got, state)


CHILD = """
import json, sys
from rlfabric.services.core.weights import WeightSubscriber, WeightSyncOptions
from tests.unit.test_weights import digest
sub = WeightSubscriber(sys.argv[1], 1 << 22, 10, sync=WeightSyncOptions(transport=sys.argv[2], bucket_bytes=1 << 18))
out = []
for have, min_version in ((-1, 0), (0, 1)):
    version, tensors = sub.fetch(have, min_version, wait_s=10)
    out.append([version, digest(tensors)])
    print("got", version, flush=True)
sub.close()
print(json.dumps(out), flush=True)
"""


def _two_processes(transport: str, state0: dict, state1: dict, env: dict | None = None) -> None:
    pub = WeightPublisher("127.0.0.1", 1 << 22, sync=WeightSyncOptions(transport=transport, bucket_bytes=1 << 18))
    try:
        pub.publish(0, state0)
        child = subprocess.Popen([sys.executable, "-c", CHILD, pub.endpoint, transport], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, env={**os.environ, **(env or {})})
        assert child.stdout.readline().split() == ["got", "0"]
        pub.publish(1, state1)  # the child's second fetch is parked until now
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 0
        assert json.loads(out.splitlines()[-1]) == [[0, digest(state0)], [1, digest(state1)]]
    finally:
        pub.close()


def test_gloo_between_two_processes():
    state = model(300_000)
    _two_processes("gloo", state, _train_step(state, 1))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL pair needs two CUDA devices (one per rank; "
                                                          f"NCCL refuses two ranks on one GPU), found "
                                                          f"{torch.cuda.device_count()}")
def test_nccl_between_two_processes():
    state = {k: v.cuda() for k, v in model(300_000).items() if isinstance(v, torch.Tensor)}
    _two_processes("nccl", state, _train_step(state, 1), env={"CUDA_VISIBLE_DEVICES": "1"})


def test_gloo_pair_closed_by_the_publisher_is_rejoined(pair):
    open_pub, open_sub = pair
    pub = open_pub(transport="gloo")
    sub = open_sub(pub, transport="gloo")
    pub.publish(0, {"w": torch.arange(1000.0)})
    sub.fetch(-1)
    pub._pairs.leave(sub._pair.pair)  # as if evicted while idle
    pub.publish(1, {"w": torch.arange(1000.0) + 1})
    version, got = sub.fetch(0)
    assert version == 1 and got["w"].tolist() == [float(i + 1) for i in range(1000)]


def test_corrupt_manifest_is_refused_before_any_write():
    from rlfabric.services.core.codec import FrameError
    from rlfabric.services.core.weights import _Manifest

    doc = {"version": 1, "base": 0, "lineage": "x", "arena_bytes": 64, "tensors": [["w", "float32", [4], 0]],
           "payload_bytes": 128, "segments": [["idx", 0, "int64", 1, 0]], "buckets": [[0, 8]]}
    as_batch = lambda d: TensorBatch({"manifest": np.frombuffer(json.dumps(d).encode(), np.uint8)})  # noqa: E731
    with pytest.raises(FrameError, match="idx segment without its val"):
        _Manifest.parse(as_batch(doc))
    with pytest.raises(FrameError, match="segment for tensor #-1"):
        _Manifest.parse(as_batch({**doc, "segments": [["full", -1, "float32", 4, 0]]}))
    with pytest.raises(FrameError, match="bucket ranges out of order"):
        _Manifest.parse(as_batch({**doc, "segments": [], "buckets": [[8, 0]]}))
    with pytest.raises(FrameError, match="corrupt weight manifest"):
        _Manifest.parse(as_batch({**doc, "tensors": [["w", "float128", [4], 0]]}))
