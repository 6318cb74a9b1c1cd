"""The wire format of the data plane: ``[header, buf0, buf1, ...]``.

The header is small JSON: kind, seq, version, meta, the batch dims, and per field its name, dtype and shape (plus
its own dims where they differ from the batch's, and for a ragged field the shape of its lengths). Each buffer is
the raw bytes of one C-contiguous array, sent zero-copy; a ragged field is two buffers, its values then its int64
lengths. Nothing is ever unpickled.

The decoder is the trust boundary of every data port, so it bounds everything it reads before acting on it: the
message and header sizes, the header's nesting and node count, every integer (int64, no 4300-digit strings, no
NaN/inf), names, ranks, dims and shape products, and the buffer count; then batch dims must agree across fields and
ragged lengths must add up (none negative, summed without int64 wrap-around). Whatever is wrong comes back as a
FrameError that names the part; nothing else escapes.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from rlfabric.services.core.batch import SEP, Ragged, TensorBatch

WIRE_VERSION = 2
READABLE_WIRE_VERSIONS = (1, 2)  # 1: before declared dims (still in Redis replays written then)
MAX_HEADER_BYTES = 64 * 1024
MAX_TENSORS = 4096
MAX_NAME_CHARS = 256
MAX_RANK = 32
MAX_DIM = 1 << 40
MAX_BATCH_DIMS = 8
MAX_META_DEPTH = 16
MAX_META_NODES = 4096
INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)

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
_WIRE = {np.dtype(name): name for name in DTYPES if name != "bfloat16"}  # native numpy dtype -> wire name


class FrameError(ValueError):
    """A data-plane message that cannot be accepted; the message says which part and why."""


def _as_buffer(name: str, value: Any) -> tuple[str, tuple[int, ...], Any]:
    if type(value) is np.ndarray and value.flags.c_contiguous and value.dtype in _WIRE:  # the usual case, first
        return _WIRE[value.dtype], value.shape, (memoryview(value).cast("B") if value.size else b"")
    if isinstance(value, np.generic):  # numpy scalars travel as 0-d arrays
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # (0-d arrays are contiguous)
        dtype = _WIRE.get(arr.dtype)
        if dtype is None:
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
        return _as_buffer(name, t.numpy())
    raise FrameError(f"tensor '{name}': expected a numpy array, torch tensor or Ragged, got {type(value).__name__}")


_spec_cache: dict[tuple, str] = {}  # a batch layout -> its "tensors" JSON (the same layout repeats every message)


def encode(kind: str, batch: TensorBatch | None = None, seq: int | None = None) -> list[Any]:
    """Frames for one message (``seq`` overrides the batch's). Buffers alias the arrays (zero-copy): don't mutate
    them until sent."""
    batch = batch or TensorBatch()
    seq = batch.seq if seq is None else seq
    layout: list[tuple] = []
    buffers: list[Any] = []
    for name, value in batch.tensors.items():
        fd = batch.field_dims.get(name)
        if isinstance(value, Ragged):
            dtype, shape, buf = _as_buffer(name, value.values)
            _, lshape, lbuf = _as_buffer(name + "#lengths", np.asarray(value.flat_lengths().reshape(value.shape)))
            layout.append((name, dtype, shape, fd, lshape))
            buffers += [buf, lbuf]
        else:
            dtype, shape, buf = _as_buffer(name, value)
            layout.append((name, dtype, shape, fd, None))
            buffers.append(buf)
    key = tuple(layout)
    specs = _spec_cache.get(key)
    if specs is None:
        doc = []
        for name, dtype, shape, fd, lshape in layout:
            spec: dict[str, Any] = {"name": name, "dtype": dtype, "shape": list(shape)}
            if fd is not None:
                spec["dims"] = list(fd)
            if lshape is not None:
                spec["lengths"] = list(lshape)
            doc.append(spec)
        specs = json.dumps(doc, separators=(",", ":"))
        if len(_spec_cache) >= 512:
            _spec_cache.clear()
        _spec_cache[key] = specs
    dims = json.dumps(list(batch.dims), separators=(",", ":")) if batch.dims else "[]"
    meta = json.dumps(batch.meta, separators=(",", ":"), allow_nan=False) if batch.meta else "{}"
    header = (f'{{"w":{WIRE_VERSION},"kind":{json.dumps(kind)},"seq":{int(seq)},'
              f'"version":{int(batch.version)},"meta":{meta},"dims":{dims},"tensors":{specs}}}').encode()
    if len(header) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}; move large metadata into tensors")
    return [header, *buffers]


def message_bytes(frames: list[Any]) -> int:
    return sum(len(f) if not hasattr(f, "nbytes") else f.nbytes for f in frames)


# -- decoding: everything bounded before use ----------------------------------------------------------------------
# (Python's json refuses integers of over 4300 digits itself; the checks below bound the rest to 64 bits.)
def _no_constant(text: str) -> Any:
    raise FrameError(f"header holds {text}; numbers must be finite")


def _check_meta(meta: Any) -> None:
    """Nesting depth and node count of the metadata, 64-bit integers and finite numbers (iteratively: no recursion
    to exhaust)."""
    stack = [(meta, 0)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_META_NODES:
            raise FrameError(f"header meta has more than {MAX_META_NODES} values")
        if depth > MAX_META_DEPTH:
            raise FrameError(f"header meta nests deeper than {MAX_META_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise FrameError("header meta holds an integer beyond 64 bits")
        elif isinstance(value, float) and not math.isfinite(value):
            raise FrameError("header meta holds a number out of range; numbers must be finite")


def _int64(header: dict, key: str, default: int, minimum: int = INT64_MIN) -> int:
    value = header.get(key, default)
    if type(value) is not int or not minimum <= value <= INT64_MAX:
        shown = f"a {len(str(value))}-digit integer" if type(value) is int else repr(value)[:40]
        raise FrameError(f"header {key} must be an integer in [{minimum}, 2^63), got {shown}")
    return value


def _shape_of(name: str, shape: Any, what: str = "shape") -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(
            type(d) is int and 0 <= d <= MAX_DIM for d in shape):
        raise FrameError(f"tensor '{name}': {what} must be a list of at most {MAX_RANK} ints in [0, 2^40], got "
                         f"{str(shape)[:80]}")
    return tuple(shape)


def _bytes_of(name: str, shape: tuple[int, ...], itemsize: int, limit: int) -> int:
    """shape's byte count, refusing shapes whose element count (zero dims aside) overflows what a buffer holds."""
    elements = 1
    for d in shape:
        elements *= max(d, 1)
        if elements * itemsize > limit:
            if 0 in shape:
                continue
            raise FrameError(f"tensor '{name}': shape {list(shape)} needs more than the message's {limit} bytes")
    if elements > (1 << 48):
        raise FrameError(f"tensor '{name}': shape {list(shape)} has too many elements")
    return math.prod(shape) * itemsize


def _array(name: str, dtype: str, shape: tuple[int, ...], view: memoryview, limit: int, bf16_torch: bool) -> Any:
    np_dtype = DTYPES[dtype]
    expected = _bytes_of(name, shape, np_dtype.itemsize, limit)
    if expected != view.nbytes:
        raise FrameError(f"tensor '{name}': {view.nbytes} bytes but {dtype}{list(shape)} needs {expected}")
    arr = np.frombuffer(view, dtype=np_dtype).reshape(shape) if expected else np.zeros(shape, np_dtype)
    if dtype == "bfloat16" and bf16_torch:
        import torch

        return torch.from_numpy(arr.copy().view(np.int16)).view(torch.bfloat16)
    return arr


def decode(frames: list[Any], max_bytes: int, as_torch_bf16: bool = True) -> tuple[str, TensorBatch]:
    """Validate and decode frames (bytes, memoryviews or zmq.Frame) into (kind, batch). Arrays alias the frames.
    Anything malformed raises FrameError, never another exception."""
    try:
        return _decode(frames, max_bytes, as_torch_bf16)
    except FrameError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, MemoryError,
            struct.error) as exc:  # a case the checks above missed must still not escape as something else
        raise FrameError(f"malformed message ({exc.__class__.__name__}: {str(exc)[:200]})") from None


def _decode(frames: list[Any], max_bytes: int, as_torch_bf16: bool) -> tuple[str, TensorBatch]:
    if not frames:
        raise FrameError("empty message: expected [header, buffers...]")
    if len(frames) > 2 * MAX_TENSORS + 1:
        raise FrameError(f"message of {len(frames)} frames: at most {2 * MAX_TENSORS + 1}")
    views = [memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise FrameError(f"message of {total} bytes exceeds the data-plane bound of {max_bytes} bytes "
                         f"(data_plane.max_message_bytes); send smaller batches or raise the bound")
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise FrameError(f"header frame of {views[0].nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(views[0].tobytes(), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"header is not valid JSON ({exc.__class__.__name__}); is the peer an rlfabric data "
                         f"plane?") from None
    except RecursionError:
        raise FrameError("header nests too deeply") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise FrameError(f"header holds an unreadable number ({str(exc)[:80]})") from None
    if not isinstance(header, dict) or header.get("w") not in READABLE_WIRE_VERSIONS:
        got = header.get("w") if isinstance(header, dict) else None
        raise FrameError(f"header wire version {str(got)[:20]!r} is not one of {READABLE_WIRE_VERSIONS}")
    kind, specs, meta = header.get("kind"), header.get("tensors"), header.get("meta", {})
    if not isinstance(kind, str) or len(kind) > 64 or not isinstance(specs, list) or not isinstance(meta, dict):
        raise FrameError("header must carry kind (a short str), tensors (list) and meta (object)")
    seq, version = _int64(header, "seq", 0, 0), _int64(header, "version", -1)
    _check_meta(meta)
    dims = header.get("dims", [])
    if not isinstance(dims, list) or len(dims) > MAX_BATCH_DIMS or len(set(map(str, dims))) != len(dims) or not all(
            isinstance(d, str) and 0 < len(d) <= 64 for d in dims):
        raise FrameError(f"header dims must be at most {MAX_BATCH_DIMS} distinct names, got {str(dims)[:80]}")
    dims = tuple(dims)
    if len(specs) > MAX_TENSORS:
        raise FrameError(f"header describes {len(specs)} tensors; at most {MAX_TENSORS}")
    buffers = sum(2 if isinstance(s, dict) and "lengths" in s else 1 for s in specs)
    if buffers != len(views) - 1:
        raise FrameError(f"header describes {buffers} buffers but the message has {len(views) - 1}")
    tensors: dict[str, Any] = {}
    field_dims: dict[str, tuple[str, ...]] = {}
    it = iter(views[1:])
    for spec in specs:
        if not isinstance(spec, dict):
            raise FrameError("tensor spec must be an object with name, dtype, shape")
        name, dtype = spec.get("name"), spec.get("dtype")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or "" in name.split(SEP):
            raise FrameError(f"tensor name {str(name)[:80]!r} must be 1-{MAX_NAME_CHARS} characters without empty "
                             f"'{SEP}' parts")
        if name in tensors:
            raise FrameError(f"tensor name {name!r} is repeated")
        if dtype not in DTYPES:
            raise FrameError(f"tensor '{name}': unknown dtype {str(dtype)[:20]!r}")
        shape = _shape_of(name, spec.get("shape"))
        if "dims" in spec:
            fd = spec["dims"]
            if not isinstance(fd, list) or not all(isinstance(d, str) and d in dims for d in fd):
                raise FrameError(f"tensor '{name}': dims {str(fd)[:80]} must name batch dims {list(dims)}")
            field_dims[name] = tuple(fd)
        values = _array(name, dtype, shape, next(it), max_bytes, as_torch_bf16)
        if "lengths" in spec:
            lshape = _shape_of(name, spec["lengths"], "lengths")
            lengths = _array(name + "#lengths", "int64", lshape, next(it), max_bytes, False)
            if not shape:
                raise FrameError(f"ragged tensor '{name}': values need a leading item dim")
            try:  # (the constructor checks the lengths: none negative, and their sum without int64 wrap)
                tensors[name] = Ragged(values, lengths)
            except ValueError as exc:
                raise FrameError(f"ragged tensor '{name}': {str(exc).removeprefix('Ragged ')}") from None
        else:
            tensors[name] = values
    batch = TensorBatch(tensors, meta=meta, version=version, seq=seq, dims=dims, field_dims=field_dims)
    if dims:
        try:
            batch.sizes()
        except ValueError as exc:
            raise FrameError(f"inconsistent batch: {exc}") from None
    return kind, batch


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
