"""TensorBatch: the one batch type every service speaks — named fields over named batch dimensions.

A batch declares its batch dimensions by name (``dims``): ``("time", "env")`` for a trajectory, ``("sample",)``
for sampled transitions or token sequences, ``()`` for a plain bag of tensors (a request, a reply). Every field
starts with the batch dimensions, or, where ``field_dims`` says so, with a subset of them in the same order (a
trajectory's ``last_values`` is per env, not per step). Joining shards, flattening a trajectory into samples and
taking rows all go by these names, so nothing ever guesses which axis is which.

Fields are numpy arrays or torch tensors of any dtype (uint8 images stay uint8), ``Ragged`` sequences (token
streams: every cell's items back to back plus one length per batch cell), and nested names ``obs/image`` for Dict
observations (``group("obs")`` gives them back as a dict). ``version`` is the weight version that produced the
data and ``seq`` a per-channel sequence number. The codec (codec.py) is the wire format of this type.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SEP = "/"  # nested field names: obs/image, obs/state


def _is_torch(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "dtype") and not isinstance(value, np.ndarray)


def _concat(arrays: Sequence[Any], axis: int) -> Any:
    if _is_torch(arrays[0]):
        import torch

        return torch.cat(list(arrays), dim=axis)
    return np.concatenate(arrays, axis=axis)


def _index(array: Any, idx: np.ndarray) -> Any:
    if _is_torch(array):
        import torch

        return array[torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(array.device)]
    return array[idx]


def array_nbytes(value: Any) -> int:
    """Bytes of a numpy array, torch tensor or Ragged (values and lengths)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, Ragged):
        return value.nbytes
    return int(value.numel() * value.element_size())


def segment_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the items of segments [start, start + length), back to back (a vectorised gather plan)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    return np.arange(total, dtype=np.int64) + shift


def check_lengths(lengths: np.ndarray, items: int) -> None:
    """Ragged lengths that describe ``items`` values exactly: integers, none negative, none above ``items``, and
    adding up to ``items`` without int64 wrap-around ([2^63-1, 2^63-1, 3, 4] adds up to 5 in int64 arithmetic, and
    its offsets would then point anywhere). A ValueError says which rule failed."""
    if lengths.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
    if not lengths.size:
        if items:
            raise ValueError(f"no lengths but {items} items")
        return
    low, high = int(lengths.min()), int(lengths.max())  # (Python ints: a uint64 beyond 2^63 stays itself)
    if low < 0:
        raise ValueError(f"negative length {low}")
    if high > items:
        raise ValueError(f"a length of {high} exceeds the {items} items there are")
    # sum in chunks whose int64 sums cannot wrap (chunk x high < 2^62), added as Python ints: one chunk unless
    # the lengths are huge
    flat, chunk = lengths.reshape(-1), max(1, (1 << 62) // max(high, 1))
    total = sum(int(flat[i:i + chunk].sum(dtype=np.int64)) for i in range(0, flat.size, chunk))
    if total != items:
        raise ValueError(f"lengths add up to {total} but there are {items} items")


@dataclass(eq=False)
class Ragged:
    """Variable-length cells: ``values`` holds every cell's items back to back (``[total, *item_shape]``) and
    ``lengths`` (int64, one per batch cell, in row-major order of the batch dims) how many belong to each.
    Lengths on the host are checked when made (``check_lengths``); a ValueError names what is wrong."""

    values: Any
    lengths: Any

    def __post_init__(self) -> None:
        lengths = self.lengths
        if _is_torch(lengths):
            if lengths.device.type != "cpu":
                return  # a device copy of host lengths checked when they were made (to_torch makes these)
            lengths = lengths.detach().numpy()
        elif not isinstance(lengths, np.ndarray):
            raise ValueError(f"Ragged lengths must be an integer array, got {type(lengths).__name__}")
        shape = tuple(self.values.shape)
        if not shape:
            raise ValueError("Ragged values need a leading item dim ([total, *item_shape]), got a 0-d array")
        try:
            check_lengths(lengths, int(shape[0]))
        except ValueError as exc:
            raise ValueError(f"Ragged lengths do not describe its values: {exc}") from None

    @classmethod
    def from_rows(cls, rows: Sequence[Any], dtype: Any = None, item_shape: tuple[int, ...] = ()) -> Ragged:
        arrays = [np.asarray(r, dtype=dtype) for r in rows]
        if arrays:
            values = np.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0].copy()
        else:
            values = np.zeros((0, *item_shape), dtype=dtype or np.float32)
        return cls(values, np.array([len(a) for a in arrays], dtype=np.int64))

    @classmethod
    def from_texts(cls, texts: Sequence[str]) -> Ragged:
        """Strings as their UTF-8 bytes, one cell each (text crosses the data plane this way)."""
        return cls.from_rows([np.frombuffer(t.encode(), dtype=np.uint8) for t in texts], dtype=np.uint8)

    def texts(self, field: str = "text") -> list[str]:
        """The cells of a uint8 Ragged as strings; a ValueError naming ``field`` when a cell is not UTF-8."""
        if np.dtype(self.values.dtype) != np.uint8 or self.item_shape:
            raise ValueError(f"{field} must be UTF-8 bytes (a Ragged uint8 field), got {self.values.dtype}")
        values = np.asarray(self.values)
        o = self.offsets
        try:
            return [values[o[i]:o[i + 1]].tobytes().decode() for i in range(len(o) - 1)]
        except UnicodeDecodeError as exc:
            raise ValueError(f"{field} holds bytes that are not UTF-8 ({exc.reason})") from None

    @property
    def shape(self) -> tuple[int, ...]:
        """The batch shape of the cells (what ``lengths`` is shaped as)."""
        return tuple(self.lengths.shape)

    @property
    def item_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return array_nbytes(self.values) + array_nbytes(self.lengths)

    def flat_lengths(self) -> np.ndarray:
        lengths = self.lengths.detach().cpu().numpy() if _is_torch(self.lengths) else self.lengths
        return np.asarray(lengths, dtype=np.int64).reshape(-1)

    @property
    def offsets(self) -> np.ndarray:
        """Where each cell starts in ``values``, plus the end: ``values[offsets[i]:offsets[i + 1]]`` is cell i."""
        lengths = self.flat_lengths()
        out = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=out[1:])
        return out

    def rows(self) -> list[Any]:
        o = self.offsets
        return [self.values[o[i]:o[i + 1]] for i in range(len(o) - 1)]

    def reshape(self, shape: tuple[int, ...]) -> Ragged:
        return Ragged(self.values, self.lengths.reshape(shape))

    def take(self, cells: np.ndarray) -> Ragged:
        """The given cells (flat indices over the batch shape), in that order: a 1-d Ragged."""
        cells = np.asarray(cells, dtype=np.int64)
        o = self.offsets
        lengths = o[cells + 1] - o[cells]
        values = _index(self.values, segment_index(o[cells], lengths))
        out_lengths = lengths if not _is_torch(self.lengths) else _as_torch_like(lengths, self.lengths)
        return Ragged(values, out_lengths)

    def padded(self, pad: Any = 0) -> tuple[Any, Any]:
        """(``[cells, max_len, *item]`` values padded with ``pad``, ``[cells, max_len]`` bool mask of real items)."""
        lengths = self.flat_lengths()
        cells, longest = len(lengths), int(lengths.max()) if len(lengths) else 0
        mask = np.arange(longest)[None, :] < lengths[:, None]
        if _is_torch(self.values):
            import torch

            out = torch.full((cells, longest, *self.item_shape), pad, dtype=self.values.dtype,
                             device=self.values.device)
            m = torch.from_numpy(mask).to(self.values.device)
            out[m] = self.values
            return out, m
        out = np.full((cells, longest, *self.item_shape), pad, dtype=self.values.dtype)
        out[mask] = self.values
        return out, mask

    def equals(self, other: Ragged) -> bool:
        return (np.array_equal(np.asarray(self.lengths), np.asarray(other.lengths))
                and self.values.dtype == other.values.dtype and np.array_equal(self.values, other.values))


def _as_torch_like(array: np.ndarray, like: Any) -> Any:
    import torch

    return torch.from_numpy(array).to(like.device)


def _shape(value: Any) -> tuple[int, ...]:
    return value.shape if isinstance(value, Ragged) else tuple(value.shape)


def tree_map(fn: Any, value: Any) -> Any:
    """``fn`` applied to every leaf of a nested dict (a Dict observation), or to ``value`` itself."""
    if isinstance(value, Mapping):
        return {k: tree_map(fn, v) for k, v in value.items()}
    return fn(value)


def flatten_names(tensors: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"obs": {"image": a}} -> {"obs/image": a}: nested fields (Dict observations) under path names."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"field name {name!r}: names are non-empty strings")
        path = f"{prefix}{SEP}{name}" if prefix else name
        if isinstance(value, Mapping):
            out.update(flatten_names(value, path))
        else:
            out[path] = value
    return out


def nest_names(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """{"obs/image": a} -> {"obs": {"image": a}}."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        node = out
        *parents, leaf = name.split(SEP)
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@dataclass
class TensorBatch:
    tensors: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = -1
    seq: int = 0
    dims: tuple[str, ...] = ()
    field_dims: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(isinstance(v, Mapping) for v in self.tensors.values()):
            self.tensors = flatten_names(self.tensors)
        self.dims = tuple(self.dims)
        if self.field_dims:
            self.field_dims = {k: tuple(v) for k, v in self.field_dims.items() if tuple(v) != self.dims}

    # -- mapping surface -----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        if name in self.tensors:
            return self.tensors[name]
        group = self.group(name)
        if not group:
            raise KeyError(name)
        return group

    def __setitem__(self, name: str, value: Any) -> None:
        self.tensors[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or any(k.startswith(name + SEP) for k in self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def items(self):
        return self.tensors.items()

    def group(self, prefix: str) -> dict[str, Any]:
        """The fields under ``prefix/`` as a nested dict (a Dict observation)."""
        head = prefix + SEP
        return nest_names({k[len(head):]: v for k, v in self.tensors.items() if k.startswith(head)})

    def nested(self) -> dict[str, Any]:
        return nest_names(self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(array_nbytes(v) for v in self.tensors.values())

    # -- dimensions ----------------------------------------------------------------------------------------
    def dims_of(self, name: str) -> tuple[str, ...]:
        return self.field_dims.get(name, self.dims)

    def sizes(self) -> dict[str, int]:
        """Size of every batch dimension, checked across fields: a field that disagrees is a ValueError naming
        both fields. (On every message and every put: fields with the batch's own dims take a fast path.)"""
        dims = self.dims
        if not dims:
            return {}
        n = len(dims)
        ref: tuple[int, ...] | None = None
        ref_name = ""
        subsets: list[tuple[str, tuple[str, ...], tuple[int, ...], bool]] = []
        for name, value in self.tensors.items():
            ragged = isinstance(value, Ragged)
            shape = value.shape if ragged else tuple(value.shape)
            fd = self.field_dims.get(name)
            if fd is not None:
                subsets.append((name, fd, shape, ragged))
                continue
            if (ragged and len(shape) != n) or len(shape) < n:
                raise ValueError(f"{'ragged ' if ragged else ''}field '{name}' has {len(shape)} "
                                 f"{'cell ' if ragged else ''}dims {list(shape)} but the batch dims are {list(dims)}")
            lead = shape[:n] if len(shape) != n else shape
            if ref is None:
                ref, ref_name = lead, name
            elif lead != ref:
                d = next(i for i in range(n) if lead[i] != ref[i])
                raise ValueError(f"batch dim '{dims[d]}' is {lead[d]} in field '{name}' but {ref[d]} in field "
                                 f"'{ref_name}'")
        sizes = dict(zip(dims, ref, strict=True)) if ref is not None else {}
        seen = dict.fromkeys(sizes, ref_name)
        for name, fd, shape, ragged in subsets:
            positions = [dims.index(d) if d in dims else -1 for d in fd]
            if -1 in positions or positions != sorted(positions):
                raise ValueError(f"field '{name}' declares dims {list(fd)}, not a subset of the batch dims "
                                 f"{list(dims)} in their order")
            if (ragged and len(shape) != len(fd)) or len(shape) < len(fd):
                raise ValueError(f"field '{name}' of shape {list(shape)} lacks its batch dims {list(fd)}")
            for d, size in zip(fd, shape, strict=False):
                if d in sizes and sizes[d] != size:
                    raise ValueError(f"batch dim '{d}' is {size} in field '{name}' but {sizes[d]} in field "
                                     f"'{seen[d]}'")
                sizes.setdefault(d, int(size))
                seen.setdefault(d, name)
        return sizes

    @property
    def batch_shape(self) -> tuple[int, ...]:
        sizes = self.sizes()
        return tuple(sizes.get(d, 0) for d in self.dims)

    @property
    def rows(self) -> int:
        """Cells of the full batch shape (transitions of a trajectory, sequences of a token batch)."""
        return math.prod(self.batch_shape) if self.dims else 0

    def _with(self, tensors: dict[str, Any], dims: tuple[str, ...] | None = None,
              field_dims: dict[str, tuple[str, ...]] | None = None, **kw: Any) -> TensorBatch:
        return TensorBatch(tensors, meta=kw.get("meta", dict(self.meta)), version=kw.get("version", self.version),
                           seq=self.seq, dims=self.dims if dims is None else dims,
                           field_dims=dict(self.field_dims) if field_dims is None else field_dims)

    def select(self, *names: str) -> TensorBatch:
        """Only the named fields (a group name selects everything under it)."""
        keep = {k: v for k, v in self.tensors.items()
                if k in names or any(k.startswith(n + SEP) for n in names)}
        return self._with(keep, field_dims={k: d for k, d in self.field_dims.items() if k in keep})

    def flatten(self, into: str = "sample") -> TensorBatch:
        """Every batch dim merged into one (row-major): a [T, N] trajectory becomes T * N samples. Fields that
        lack some batch dim (per-env bootstrap values) have no row of their own and are left out."""
        shape = self.batch_shape
        out: dict[str, Any] = {}
        for name, value in self.tensors.items():
            if self.dims_of(name) != self.dims:
                continue
            if isinstance(value, Ragged):
                out[name] = value.reshape((math.prod(shape),))
            else:
                out[name] = value.reshape(math.prod(shape), *tuple(value.shape)[len(shape):])
        return self._with(out, dims=(into,), field_dims={})

    def unflatten(self, dim: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> TensorBatch:
        """Split batch dim ``dim`` into ``names`` of ``sizes`` (e.g. U * B samples into [U, B] minibatches)."""
        if dim not in self.dims:
            raise ValueError(f"no batch dim '{dim}' in {list(self.dims)}")
        k = self.dims.index(dim)
        dims = self.dims[:k] + tuple(names) + self.dims[k + 1:]
        out: dict[str, Any] = {}
        field_dims: dict[str, tuple[str, ...]] = {}
        for name, value in self.tensors.items():
            fd = self.dims_of(name)
            if dim not in fd:
                out[name] = value
                field_dims[name] = fd
                continue
            j = fd.index(dim)
            if isinstance(value, Ragged):
                out[name] = value.reshape(value.shape[:j] + tuple(sizes) + value.shape[j + 1:])
            else:
                shape = tuple(value.shape)
                out[name] = value.reshape(*shape[:j], *sizes, *shape[j + 1:])
            field_dims[name] = fd[:j] + tuple(names) + fd[j + 1:]
        return self._with(out, dims=dims, field_dims=field_dims)

    def take(self, idx: np.ndarray) -> TensorBatch:
        """Rows ``idx`` of a batch with one batch dim (sampling, reordering)."""
        if len(self.dims) != 1:
            raise ValueError(f"take needs a batch with one batch dim, this one has {list(self.dims)}; flatten it")
        idx = np.asarray(idx, dtype=np.int64)
        out = {}
        for name, value in self.tensors.items():
            if not self.dims_of(name):
                out[name] = value
            elif isinstance(value, Ragged):
                out[name] = value.take(idx)
            else:
                out[name] = _index(value, idx)
        return self._with(out)

    def slice(self, dim: str, start: int, stop: int) -> TensorBatch:
        """Entries [start, stop) of batch dim ``dim`` in every field that has it (dense fields only)."""
        out = {}
        for name, value in self.tensors.items():
            fd = self.dims_of(name)
            if dim not in fd:
                out[name] = value
                continue
            if isinstance(value, Ragged):
                raise ValueError(f"slicing ragged field '{name}' along '{dim}' is not supported; flatten and take")
            index = [slice(None)] * fd.index(dim) + [slice(start, stop)]
            out[name] = value[tuple(index)]
        return self._with(out)

    @classmethod
    def cat(cls, batches: Sequence[TensorBatch], dim: str) -> TensorBatch:
        """Join batches along batch dim ``dim`` (shards of one trajectory along "env", samples along "sample").
        Fields without that dim must agree and are taken from the first batch. The version is the oldest."""
        if not batches:
            raise ValueError("cat needs at least one batch")
        first = batches[0]
        if dim not in first.dims:
            raise ValueError(f"cannot join along '{dim}': the batch dims are {list(first.dims)}")
        for b in batches[1:]:
            if b.dims != first.dims or set(b.tensors) != set(first.tensors):
                raise ValueError(f"cannot join batches with different fields or dims: {sorted(first.tensors)} "
                                 f"{list(first.dims)} vs {sorted(b.tensors)} {list(b.dims)}")
        out: dict[str, Any] = {}
        for name, value in first.tensors.items():
            fd = first.dims_of(name)
            parts = [b.tensors[name] for b in batches]
            if dim not in fd:
                out[name] = value
            elif isinstance(value, Ragged):
                out[name] = cat_ragged(parts, fd.index(dim))
            else:
                out[name] = _concat(parts, fd.index(dim))
        return TensorBatch(out, meta=dict(first.meta), version=min(b.version for b in batches), seq=first.seq,
                           dims=first.dims, field_dims=dict(first.field_dims))

    # -- torch ---------------------------------------------------------------------------------------------
    def to_torch(self, device: Any = "cpu", pin: bool = False) -> dict[str, Any]:
        """Nested dict of torch tensors on ``device`` (numpy arrays become views where numpy allows it; with
        ``pin`` a CUDA copy goes through pinned host memory, asynchronously). Ragged fields stay Ragged, with
        torch values and lengths."""
        import torch

        def convert(v: Any) -> Any:
            if isinstance(v, Ragged):
                return Ragged(convert(v.values), convert(v.lengths))
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v if v.flags.writeable else v.copy())
            if str(device) == "cpu":
                return v.to(device)
            if pin and v.device.type == "cpu":
                v = v.pin_memory()
            return v.to(device, non_blocking=pin)

        return nest_names({name: convert(v) for name, v in self.tensors.items()})

    @classmethod
    def from_mapping(cls, tensors: Mapping[str, Any], **kw: Any) -> TensorBatch:
        return cls(dict(tensors), **kw)


def cat_ragged(parts: list[Ragged], axis: int) -> Ragged:
    """Ragged fields joined along batch axis ``axis``: lengths concatenate along it, values follow the cells'
    row-major order in the joined shape."""
    lengths = np.concatenate([np.asarray(p.lengths) for p in parts], axis=axis)
    if axis == 0:
        return Ragged(_concat([p.values for p in parts], 0), lengths)
    # each part's cells, numbered as they sit in the joined shape, and where their items start in the parts'
    # values laid back to back
    cell_ids, starts, base, offset = [], [], 0, 0
    for p in parts:
        shape = p.shape
        grid = np.indices(shape)
        grid[axis] += offset
        cell_ids.append(np.ravel_multi_index(tuple(grid), lengths.shape).reshape(-1))
        starts.append(p.offsets[:-1] + base)
        base += int(p.flat_lengths().sum())
        offset += shape[axis]
    order = np.argsort(np.concatenate(cell_ids), kind="stable")
    flat_lengths = np.concatenate([p.flat_lengths() for p in parts])[order]
    values = _concat([p.values for p in parts], 0)
    return Ragged(_index(values, segment_index(np.concatenate(starts)[order], flat_lengths)), lengths)


__all__ = ["Ragged", "TensorBatch", "array_nbytes", "cat_ragged", "check_lengths", "flatten_names", "nest_names",
           "segment_index", "tree_map", "SEP"]
