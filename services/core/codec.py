"""The wire format of the data plane: ``[header, buf0, buf1, ...]``.

The header is small JSON (kind, seq, version, meta, and per tensor its name, dtype and shape); each buffer is
the raw bytes of one C-contiguous tensor, sent zero-copy. Decoding validates everything against the header and a
size bound before touching the bytes. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from services.core.batch import TensorBatch

WIRE_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_TENSORS = 4096

# wire dtype name -> numpy dtype used to hold the bytes. bfloat16 has no numpy dtype: its bits ride as uint16
# and become torch.bfloat16 again on decode (torch is imported only when such a tensor arrives).
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
DTYPES["bfloat16"] = np.dtype("uint16")


class FrameError(ValueError):
    """A data-plane message that cannot be accepted; the message says which part and why."""


def _as_buffer(name: str, value: Any) -> tuple[str, tuple[int, ...], Any]:
    if isinstance(value, np.generic):  # numpy scalars travel as 0-d arrays
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # (keeps 0-d arrays 0-d)
        dtype = arr.dtype.name
        if dtype not in DTYPES or dtype == "bfloat16":
            raise FrameError(f"tensor '{name}': dtype {arr.dtype} is not supported on the data plane "
                             f"(supported: {', '.join(sorted(DTYPES))})")
        return dtype, arr.shape, (memoryview(arr).cast("B") if arr.size else b"")
    # torch tensor (duck-typed so the codec does not import torch)
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        import torch

        t = value.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.int16).numpy().view(np.uint16)
            return "bfloat16", tuple(t.shape), (memoryview(arr).cast("B") if arr.size else b"")
        arr = t.numpy()
        return _as_buffer(name, arr)
    raise FrameError(f"tensor '{name}': expected a numpy array or torch tensor, got {type(value).__name__}")


def encode(kind: str, batch: TensorBatch | None = None) -> list[Any]:
    """Frames for one message. Buffers alias the arrays (zero-copy): don't mutate them until sent."""
    batch = batch or TensorBatch()
    specs, buffers = [], []
    for name, value in batch.tensors.items():
        dtype, shape, buf = _as_buffer(name, value)
        specs.append({"name": name, "dtype": dtype, "shape": list(shape)})
        buffers.append(buf)
    header = json.dumps(
        {"w": WIRE_VERSION, "kind": kind, "seq": batch.seq, "version": batch.version,
         "meta": batch.meta, "tensors": specs},
        separators=(",", ":"),
    ).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}; move large metadata into tensors")
    return [header, *buffers]


def message_bytes(frames: list[Any]) -> int:
    return sum(len(f) if not hasattr(f, "nbytes") else f.nbytes for f in frames)


def decode(frames: list[Any], max_bytes: int, as_torch_bf16: bool = True) -> tuple[str, TensorBatch]:
    """Validate and decode frames (bytes, memoryviews or zmq.Frame) into (kind, batch). Arrays alias the frames."""
    if not frames:
        raise FrameError("empty message: expected [header, buffers...]")
    views = [memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise FrameError(f"message of {total} bytes exceeds the data-plane bound of {max_bytes} bytes "
                         f"(data_plane.max_message_bytes); send smaller batches or raise the bound")
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise FrameError(f"header frame of {views[0].nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(views[0].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"header is not valid JSON ({exc.__class__.__name__}); is the peer an rlfabric data plane?") from None
    if not isinstance(header, dict) or header.get("w") != WIRE_VERSION:
        raise FrameError(f"header wire version {header.get('w') if isinstance(header, dict) else None!r} != {WIRE_VERSION}")
    kind, specs, meta = header.get("kind"), header.get("tensors"), header.get("meta", {})
    seq, version = header.get("seq", 0), header.get("version", -1)
    if not isinstance(kind, str) or not isinstance(specs, list) or not isinstance(meta, dict):
        raise FrameError("header must carry kind (str), tensors (list) and meta (object)")
    if not isinstance(seq, int) or not isinstance(version, int):
        raise FrameError("header seq and version must be integers")
    if len(specs) > MAX_TENSORS or len(specs) != len(views) - 1:
        raise FrameError(f"header describes {len(specs)} tensors but the message has {len(views) - 1} buffers")
    tensors: dict[str, Any] = {}
    for spec, view in zip(specs, views[1:], strict=True):
        if not isinstance(spec, dict):
            raise FrameError("tensor spec must be an object with name, dtype, shape")
        name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
        if not isinstance(name, str) or name in tensors:
            raise FrameError(f"tensor name {name!r} is missing or repeated")
        if dtype not in DTYPES:
            raise FrameError(f"tensor '{name}': unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise FrameError(f"tensor '{name}': shape must be a list of non-negative ints, got {shape!r}")
        np_dtype = DTYPES[dtype]
        expected = math.prod(shape) * np_dtype.itemsize
        if expected != view.nbytes:
            raise FrameError(f"tensor '{name}': {view.nbytes} bytes but {dtype}{shape} needs {expected}")
        arr = np.frombuffer(view, dtype=np_dtype).reshape(shape) if expected else np.zeros(shape, np_dtype)
        if dtype == "bfloat16" and as_torch_bf16:
            import torch

            arr = torch.from_numpy(arr.copy().view(np.int16)).view(torch.bfloat16)
        tensors[name] = arr
    return kind, TensorBatch(tensors, meta=meta, version=version, seq=seq)


# One stored value holding a message's frames (Redis values, weight files): b"RLF1", u32 count, u64 length of each
# frame, then the frames back to back. Reading returns views into the value: no copies.
BLOB_MAGIC = b"RLF1"
MAX_BLOB_FRAMES = 100_000


def frame_parts(frames: list[Any]) -> tuple[int, list[Any]]:
    """The blob as (total length, pieces to write back to back) without joining them (zero-copy sends)."""
    lengths = [memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<I{len(frames)}Q", len(frames), *lengths)
    return 8 + 8 * len(frames) + sum(lengths), [BLOB_MAGIC, head, *frames]


def pack_frames(frames: list[Any]) -> bytes:
    return b"".join(frame_parts(frames)[1])


def unpack_frames(value: bytes | memoryview, name: str = "value") -> list[memoryview]:
    """The frames of a blob made by pack_frames; a wrong, truncated or padded blob is refused."""
    view = memoryview(value)
    if view.nbytes < 8 or bytes(view[:4]) != BLOB_MAGIC:
        raise FrameError(f"{name} is not an rlfabric frames blob (magic mismatch)")
    (count,) = struct.unpack_from("<I", view, 4)
    if count > MAX_BLOB_FRAMES or view.nbytes < 8 + 8 * count:
        raise FrameError(f"{name} has a corrupt frame table ({count} frames)")
    lengths = struct.unpack_from(f"<{count}Q", view, 8)
    offset, frames = 8 + 8 * count, []
    for n in lengths:
        frames.append(view[offset:offset + n])
        offset += n
    if offset != view.nbytes:
        raise FrameError(f"{name} is truncated or padded: {view.nbytes} bytes, its frames add up to {offset}")
    return frames
