"""S3ObjectStore against a real S3 server on loopback (moto_server with auth enforced, or CI's endpoint)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from minio import Minio

from rlfabric.services.core.config import ConfigError
from rlfabric.services.core.objectstore import ObjectStoreError, S3ObjectStore, open_store
from tests.support_s3 import S3Server, _free_port, _stop, start_moto
from tests.support_s3 import s3_server as s3_server  # noqa: F401

MiB = 1 << 20


def raw_client(server: S3Server) -> Minio:
    return Minio(server.endpoint, access_key=server.access_key, secret_key=server.secret_key, secure=False,
                 region=server.region)


def test_round_trip_overwrite_list_exists_delete(s3_server):
    config = s3_server.storage()
    store = open_store(config, default_root="/nonexistent")
    assert isinstance(store, S3ObjectStore)
    uri = store.put_bytes("checkpoints/a.pt", b"one")
    assert uri == f"s3://{config.bucket}/checkpoints/a.pt"
    assert store.get_bytes("checkpoints/a.pt") == b"one"
    store.put_bytes("checkpoints/a.pt", b"two")
    assert store.get_bytes("checkpoints/a.pt") == b"two"
    store.put_bytes("checkpoints/b.pt", b"")
    store.put_bytes("weights/v1", bytes(range(256)))
    assert store.get_bytes("checkpoints/b.pt") == b""
    assert store.list() == ["checkpoints/a.pt", "checkpoints/b.pt", "weights/v1"]
    assert store.list("checkpoints/") == ["checkpoints/a.pt", "checkpoints/b.pt"]
    assert store.list("check") == ["checkpoints/a.pt", "checkpoints/b.pt"]  # a string prefix, like the fs store
    assert store.exists("weights/v1") and not store.exists("weights/v2") and not store.exists("weights")
    store.delete("checkpoints/a.pt")
    store.delete("checkpoints/a.pt")  # deleting twice is a no-op
    assert not store.exists("checkpoints/a.pt")
    assert store.list("checkpoints/") == ["checkpoints/b.pt"]
    with pytest.raises(FileNotFoundError, match=rf"no object 'checkpoints/a.pt' in s3://{config.bucket}/"):
        store.get_bytes("checkpoints/a.pt")


def test_large_object_goes_multipart_and_round_trips(s3_server):
    config = s3_server.storage()
    store = S3ObjectStore.from_config(config, part_size=5 * MiB)
    data = os.urandom(12 * MiB + 123)
    store.put_bytes("big/blob", data)
    assert store.get_bytes("big/blob") == data
    # A multipart ETag ends in -<parts>: 12 MiB in 5 MiB parts is 3 parts.
    assert raw_client(s3_server).stat_object(config.bucket, "big/blob").etag.endswith("-3")
    assert not list(raw_client(s3_server)._list_multipart_uploads(config.bucket).uploads)  # nothing left open


def test_readers_never_see_a_half_written_object(s3_server):
    store = S3ObjectStore.from_config(s3_server.storage(), part_size=5 * MiB)
    versions = [bytes([i]) * (6 * MiB) for i in (1, 2)]
    store.put_bytes("weights/latest", versions[0])
    seen, errors, done = [], [], threading.Event()

    def reader():
        try:
            while not done.is_set():
                seen.append(store.get_bytes("weights/latest"))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(4):
        store.put_bytes("weights/latest", versions[(i + 1) % 2])
    done.set()
    thread.join(30)
    assert not errors and seen
    assert all(blob in versions for blob in seen)


def test_prefix_isolation_and_uri(s3_server):
    config = s3_server.storage()
    run1 = S3ObjectStore.from_config(config, prefix="team/run1")
    run10 = S3ObjectStore.from_config(config, prefix="/team/run10/")
    run1.put_bytes("ckpt", b"1")
    run10.put_bytes("ckpt", b"10")
    run10.put_bytes("extra/x", b"x")
    assert run1.list() == ["ckpt"] and run1.get_bytes("ckpt") == b"1"
    assert run10.list() == ["ckpt", "extra/x"] and run10.get_bytes("ckpt") == b"10"
    assert run1.uri("ckpt") == f"s3://{config.bucket}/team/run1/ckpt"
    names = sorted(o.object_name for o in raw_client(s3_server).list_objects(config.bucket, recursive=True))
    assert names == ["team/run1/ckpt", "team/run10/ckpt", "team/run10/extra/x"]
    run1.delete("ckpt")
    assert run10.get_bytes("ckpt") == b"10"
    # open_store with a run id keeps runs apart under storage.prefix, as run directories do on a filesystem.
    run_a = open_store(config.model_copy(update={"prefix": "team"}), "/nonexistent", run_id="run-a")
    assert run_a.uri("ckpt") == f"s3://{config.bucket}/team/run-a/ckpt" and run_a.list() == []


@pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../../b", "a//b"])
def test_keys_are_validated(s3_server, key):
    store = S3ObjectStore.from_config(s3_server.storage(bucket="rlf-keys-check"))
    for op in (lambda: store.put_bytes(key, b"x"), lambda: store.get_bytes(key), lambda: store.delete(key)):
        with pytest.raises(ValueError, match="relative path"):
            op()


def test_missing_bucket_is_created_or_named_in_a_clear_error(s3_server):
    config = s3_server.storage(create_bucket=False)
    with pytest.raises(ObjectStoreError, match=rf"storage.bucket='{config.bucket}' does not exist.*create_bucket"):
        open_store(config, default_root="/nonexistent")
    assert not raw_client(s3_server).bucket_exists(config.bucket)  # the failed open created nothing
    created = open_store(config.model_copy(update={"create_bucket": True}), default_root="/nonexistent")
    assert raw_client(s3_server).bucket_exists(config.bucket)
    created.put_bytes("k", b"v")
    again = open_store(config, default_root="/nonexistent")  # now it exists: create_bucket false is fine
    assert again.get_bytes("k") == b"v"


def test_credentials_fall_back_to_environment(s3_server, monkeypatch):
    monkeypatch.setenv("RLFABRIC_S3_ACCESS_KEY", s3_server.access_key)
    monkeypatch.setenv("RLFABRIC_S3_SECRET_KEY", s3_server.secret_key)
    config = s3_server.storage(access_key="", secret_key="")
    store = open_store(config, default_root="/nonexistent")
    assert store.put_bytes("env", b"ok").startswith("s3://")


def test_wrong_credentials_fail_at_open_with_the_field_to_fix(s3_server):
    if not s3_server.enforces_auth:
        pytest.skip(f"the S3 server at {s3_server.endpoint} accepts any credentials")
    config = s3_server.storage()
    open_store(config, default_root="/nonexistent")  # the bucket exists; only the credentials differ below
    cases = [
        ({"access_key": "AKIAUNKNOWNKEY000000"}, "InvalidAccessKeyId.*does not know storage.access_key"),
        ({"secret_key": "not-the-secret"}, "SignatureDoesNotMatch.*storage.secret_key does not match"),
    ]
    if s3_server.unprivileged_key:
        key, secret = s3_server.unprivileged_key
        cases.append(({"access_key": key, "secret_key": secret}, "AccessDenied.*lack permission"))
    for update, why in cases:
        start = time.monotonic()
        with pytest.raises(ObjectStoreError, match=why) as info:
            open_store(config.model_copy(update=update), default_root="/nonexistent")
        assert "Fix: set storage.access_key and storage.secret_key" in str(info.value)
        assert isinstance(info.value, ConfigError)  # the learner turns ValueErrors into INVALID_ARGUMENT
        assert time.monotonic() - start < 5


def test_unreachable_endpoint_fails_fast_naming_the_field(s3_server):
    closed = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(ObjectStoreError, match=rf"storage.endpoint='{closed}' is unreachable.*Fix"):
        open_store(s3_server.storage(endpoint=closed), default_root="/nonexistent")
    assert time.monotonic() - start < 3
    # A server that accepts connections but never answers: bounded by the timeouts, not minio's 5-minute default.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        endpoint = f"127.0.0.1:{hung.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ObjectStoreError, match=rf"storage.endpoint='{endpoint}' is unreachable.*Timeout"):
            S3ObjectStore.from_config(s3_server.storage(endpoint=endpoint), connect_timeout_s=0.5)
        assert time.monotonic() - start < 3

def test_server_lost_after_open_gives_connection_errors(tmp_path):
    proc, server = start_moto(tmp_path)
    try:
        store = S3ObjectStore.from_config(server.storage(), connect_timeout_s=1.0, retries=1)
        store.put_bytes("k", b"v")
    finally:
        _stop(proc)
    for op in (lambda: store.put_bytes("k", b"w"), lambda: store.get_bytes("k"), lambda: store.list()):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"storage.endpoint='{server.endpoint}' is unreachable"):
            op()
        assert time.monotonic() - start < 5

