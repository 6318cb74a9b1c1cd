import pytest
import torch

from rlfabric.services.core.objectstore import FilesystemObjectStore
from rlfabric.services.learner import checkpoint as ckpt


def _state(v):
    return {"weight_version": v, "policy": {"w": torch.full((3,), float(v))}, "extra_json": "{}"}


def test_pack_unpack_round_trip_and_checksum(tmp_path):
    data = ckpt.pack(_state(4))
    assert ckpt.unpack(data)["policy"]["w"].tolist() == [4.0] * 3
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    with pytest.raises(ckpt.CorruptCheckpoint, match="sha256 does not match"):
        ckpt.unpack(bytes(flipped), "ckpt-4")
    with pytest.raises(ckpt.CorruptCheckpoint, match="bad magic"):
        ckpt.unpack(b"PK\x03\x04" + data[8:])
    with pytest.raises(ckpt.CorruptCheckpoint, match="sha256"):
        ckpt.unpack(data[: len(data) // 2])  # a truncated copy


def test_load_latest_falls_back_past_corrupt_checkpoints(tmp_path):
    store = FilesystemObjectStore(tmp_path)
    for v in (2, 10, 4):
        store.put_bytes(ckpt.periodic_key(v), ckpt.pack(_state(v)))
    assert ckpt.periodic_keys(store)[0] == ckpt.periodic_key(10)  # numeric, not lexical, order
    store.put_bytes(ckpt.periodic_key(10), b"RLFCKPT1" + b"\0" * 40)
    key, state, skipped = ckpt.load_latest(store)
    assert key == ckpt.periodic_key(4) and state["weight_version"] == 4
    assert len(skipped) == 1 and "ckpt-0000000010.pt" in skipped[0] and "corrupt" in skipped[0]
    store.put_bytes("checkpoints/final.pt", ckpt.pack(_state(12)))
    assert ckpt.load_latest(store)[0] == "checkpoints/final.pt"


def test_prune_keeps_the_newest(tmp_path):
    store = FilesystemObjectStore(tmp_path)
    for v in range(1, 6):
        store.put_bytes(ckpt.periodic_key(v), ckpt.pack(_state(v)))
    removed = ckpt.prune(store, keep=2)
    assert sorted(removed) == [ckpt.periodic_key(v) for v in (1, 2, 3)]
    assert ckpt.periodic_keys(store) == [ckpt.periodic_key(5), ckpt.periodic_key(4)]


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="none written yet"):
        ckpt.load_latest(FilesystemObjectStore(tmp_path))


def test_weights_container_round_trip_and_corruption(tmp_path):
    from rlfabric.services.core.codec import FrameError
    from rlfabric.services.core.weights import load_weights, save_weights

    store = FilesystemObjectStore(tmp_path)
    assert load_weights(store, 1 << 20) is None
    save_weights(store, 7, {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(1, dtype=torch.bfloat16)})
    version, tensors = load_weights(store, 1 << 20)
    assert version == 7 and tensors["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    raw = store.get_bytes("weights/latest")
    store.put_bytes("weights/latest", raw[:-3])
    with pytest.raises(FrameError, match="truncated or padded"):
        load_weights(store, 1 << 20)
    store.put_bytes("weights/latest", b"PK" + raw[2:])
    with pytest.raises(FrameError, match="not an rlfabric frames blob"):
        load_weights(store, 1 << 20)
