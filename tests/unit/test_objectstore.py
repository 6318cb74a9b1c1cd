import socket

import pytest

from rlfabric.services.core.config import ConfigError, StorageConfig
from rlfabric.services.core.objectstore import FilesystemObjectStore, ObjectStoreError, open_store


def test_put_get_list_and_atomic_replace(tmp_path):
    store = FilesystemObjectStore(tmp_path)
    uri = store.put_bytes("checkpoints/a.pt", b"one")
    assert uri.startswith("file://") and store.get_bytes("checkpoints/a.pt") == b"one"
    store.put_bytes("checkpoints/a.pt", b"two")
    assert store.get_bytes("checkpoints/a.pt") == b"two"
    assert store.list("checkpoints/") == ["checkpoints/a.pt"]  # no temp files left behind
    assert store.exists("checkpoints/a.pt") and not store.exists("nope")
    with pytest.raises(FileNotFoundError, match="no object"):
        store.get_bytes("nope")


@pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../../b", "a//b"])
def test_keys_cannot_escape_the_root(tmp_path, key):
    with pytest.raises(ValueError, match="relative path"):
        FilesystemObjectStore(tmp_path).put_bytes(key, b"x")


def test_delete_removes_and_tolerates_missing(tmp_path):
    store = FilesystemObjectStore(tmp_path)
    store.put_bytes("replay/a", b"1")
    store.put_bytes("replay/b", b"2")
    store.delete("replay/a")
    store.delete("replay/a")  # already gone: a no-op, so eviction can be retried
    assert store.list("replay/") == ["replay/b"] and not store.exists("replay/a")
    store.put_bytes("replay/a", b"3")  # the folder still takes new objects
    assert store.get_bytes("replay/a") == b"3"
    with pytest.raises(ValueError, match="relative path"):
        store.delete("../outside")


def test_open_store_defaults_to_the_filesystem(tmp_path):
    store = open_store(StorageConfig(), default_root=tmp_path)
    assert isinstance(store, FilesystemObjectStore) and store.root == tmp_path.resolve()
    assert isinstance(open_store(StorageConfig(root=str(tmp_path / "x")), tmp_path), FilesystemObjectStore)


@pytest.mark.parametrize("fields, message", [
    ({"endpoint": ""}, "storage.endpoint is empty"),
    ({"access_key": "", "secret_key": ""}, r"storage.access_key and storage.secret_key not set.*RLFABRIC_S3_ACCESS_KEY"),
    ({"secret_key": ""}, r"storage.secret_key not set"),
    ({"endpoint": "https://minio:9000"}, "says https:// but storage.secure is False"),
    ({"prefix": "a/../b"}, "storage.prefix='a/../b' must be a relative path"),
    ({"bucket": "Bad_Bucket"}, "storage.bucket='Bad_Bucket' is not a valid S3 bucket name"),
])
def test_s3_config_errors_name_the_field(monkeypatch, fields, message):
    monkeypatch.delenv("RLFABRIC_S3_ACCESS_KEY", raising=False)
    monkeypatch.delenv("RLFABRIC_S3_SECRET_KEY", raising=False)
    base = {"kind": "s3", "endpoint": f"127.0.0.1:{_closed_port()}", "access_key": "k", "secret_key": "s"}
    with pytest.raises(ObjectStoreError, match=message) as info:
        open_store(StorageConfig(**{**base, **fields}), default_root=".")
    assert isinstance(info.value, ConfigError)


def test_s3_scheme_in_endpoint_is_accepted_when_it_agrees(monkeypatch):
    port = _closed_port()
    config = StorageConfig(kind="s3", endpoint=f"http://127.0.0.1:{port}/", access_key="k", secret_key="s")
    # Gets past endpoint parsing to the connection attempt, which names the cleaned endpoint.
    with pytest.raises(ObjectStoreError, match=rf"storage.endpoint='127.0.0.1:{port}' is unreachable"):
        open_store(config, default_root=".")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
