import json

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import DTYPES, FrameError, decode, encode

NUMPY_DTYPES = [d for d in DTYPES if d != "bfloat16"]


def _frames(kind, batch):
    return [bytes(f) for f in encode(kind, batch)]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4)])
def test_numpy_round_trip_every_dtype(dtype, shape):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal(shape) * 100).astype(dtype) if dtype != "bool" else rng.random(shape) > 0.5
    kind, out = decode(_frames("x", TensorBatch({"a": arr}, meta={"k": 1}, version=7, seq=3)), 1 << 20)
    assert kind == "x" and out.version == 7 and out.seq == 3 and out.meta == {"k": 1}
    assert out["a"].dtype == arr.dtype and out["a"].shape == arr.shape
    np.testing.assert_array_equal(out["a"], arr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8,
                                   torch.bool, torch.float64, torch.int32])
def test_torch_round_trip(dtype):
    t = (torch.randn(4, 5) * 10).to(dtype)
    _, out = decode(_frames("w", TensorBatch({"t": t})), 1 << 20)
    back = out["t"] if isinstance(out["t"], torch.Tensor) else torch.from_numpy(np.array(out["t"]))
    assert back.dtype == dtype
    assert torch.equal(back, t)


def test_non_contiguous_and_multiple_tensors():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    b = torch.arange(6).reshape(2, 3).t()
    _, out = decode(_frames("m", TensorBatch({"a": a, "b": b})), 1 << 20)
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b.numpy())


def test_decoded_arrays_alias_frames_zero_copy():
    frames = encode("z", TensorBatch({"a": np.arange(1000, dtype=np.int64)}))
    buf = bytearray(frames[1])
    _, out = decode([frames[0], buf], 1 << 20)
    buf[0:8] = (12345).to_bytes(8, "little")
    assert out["a"][0] == 12345  # a view on the frame, not a copy


def _corrupt(header_patch=None, buffers=None):
    frames = _frames("x", TensorBatch({"a": np.zeros(4, np.float32)}))
    header = json.loads(frames[0])
    if header_patch:
        header_patch(header)
    return [json.dumps(header).encode(), *(buffers if buffers is not None else frames[1:])]


@pytest.mark.parametrize("frames,match", [
    ([], "empty message"),
    ([b"\xff\xfenot json"], "not valid JSON"),
    ([b"[1,2]"], "wire version"),
    (None, "needs 16"),
])
def test_corrupt_messages_are_rejected_with_reason(frames, match):
    if frames is None:
        frames = _corrupt(buffers=[b"\x00" * 3])
    with pytest.raises(FrameError, match=match):
        decode(frames, 1 << 20)


@pytest.mark.parametrize("patch,match", [
    (lambda h: h.update(w=99), "wire version"),
    (lambda h: h["tensors"][0].update(dtype="object"), "unknown dtype"),
    (lambda h: h["tensors"][0].update(shape=[-4]), r"list of at most 32 ints in \[0, 2\^40\]"),
    (lambda h: h["tensors"].append(h["tensors"][0]), "buffers"),
    (lambda h: h.update(seq="x"), "seq must be an integer"),
    (lambda h: h.update(kind=5), "kind"),
])
def test_header_validation(patch, match):
    with pytest.raises(FrameError, match=match):
        decode(_corrupt(patch), 1 << 20)


def test_size_bound_names_the_setting():
    frames = _frames("x", TensorBatch({"a": np.zeros(1000, np.float64)}))
    with pytest.raises(FrameError, match="max_message_bytes"):
        decode(frames, 4096)


def test_unsupported_values_are_refused():
    with pytest.raises(FrameError, match="not supported"):
        encode("x", TensorBatch({"a": np.array(["s"], dtype=object)}))
    with pytest.raises(FrameError, match="expected a numpy array"):
        encode("x", TensorBatch({"a": [1, 2]}))


def test_frames_blob_round_trip_and_corruption():
    from rlfabric.services.core.codec import pack_frames, unpack_frames

    frames = encode("x", TensorBatch({"a": np.arange(5.0), "b": np.zeros((2, 2), np.uint8)}, version=3))
    blob = pack_frames(frames)
    kind, out = decode(unpack_frames(blob), 1 << 20)
    assert kind == "x" and out.version == 3 and out["a"].tolist() == [0, 1, 2, 3, 4]
    for bad, match in [(b"RLF2" + blob[4:], "magic"), (blob[:-1], "truncated or padded"),
                       (blob + b"\0", "truncated or padded"), (blob[:8] + b"\xff" * 8, "corrupt frame table"),
                       (b"RLF1\xff\xff\xff\x7f", "corrupt frame table")]:
        with pytest.raises(FrameError, match=match):
            unpack_frames(bad)
