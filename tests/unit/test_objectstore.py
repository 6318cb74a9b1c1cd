import pytest

from services.core.objectstore import FilesystemObjectStore


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
