"""Replay stores behind one interface, chosen by ``replay.store``.

A store holds batches of any declared dims (trajectories ``("time", "env")``, samples or token sequences
``("sample",)``), each tagged with the weight version that produced it, and offers three views:
  take_onpolicy    an on-policy FIFO the learner consumes once, oldest first, refusing versions below a bound
  sample           rows drawn uniformly over the capacity-bounded window (a trajectory's rows are its T * N
                   transitions, a token batch's rows its sequences; ragged fields come along exactly)
  sample_windows   windows of consecutive steps along "time" (sequence models)
``put`` returns only once the batch is stored: the replay service acknowledges a put after it returns, so nothing
acknowledged is lost. The replay service keeps one store per named source ("online", data sets, interventions).
Every store knows the most bytes one of its rows can take (``row_bytes``), so a sample request is refused before it
allocates more than a reply can carry (``check_sample``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rlfabric.services.core.batch import Ragged, TensorBatch, array_nbytes

if TYPE_CHECKING:
    from rlfabric.services.core.config import RunConfig
    from rlfabric.services.core.objectstore import ObjectStore

TIME = "time"
MAX_SAMPLE_ROWS = 1 << 24  # rows one sample request may ask for: n, or n x length for windows
_VERSION_BYTES = 8  # the int64 "version" column every sample carries per row


def check_batch(batch: TensorBatch, capacity: int) -> int:
    """What every store refuses alike before storing; returns the batch's rows (the product of its batch dims)."""
    if batch.version < 0:
        raise ValueError("replay batch has no policy version (header 'version' < 0); tag it with the weight "
                         "version that produced it")
    if not batch.dims:
        raise ValueError("replay batch declares no batch dims (header 'dims'); a trajectory is (time, env), "
                         "samples or sequences (sample,)")
    try:
        sizes = batch.sizes()
    except ValueError as exc:
        raise ValueError(f"replay batch is inconsistent: {exc}") from None
    rows = 1
    for d in batch.dims:
        rows *= sizes.get(d, 0)
    if rows == 0:
        raise ValueError("replay batch holds no rows (a batch dim is 0)")
    if rows > capacity:
        raise ValueError(f"batch of {rows} rows exceeds replay.capacity_transitions={capacity}")
    return rows


def row_bytes(batch: TensorBatch, rows: int) -> int:
    """The most bytes one row of the batch can take in a sample: each per-row field's bytes per row, a ragged
    field's longest cell (and its length), plus the version column. (Fields that are per batch are not sampled.)"""
    total = _VERSION_BYTES
    for name, value in batch.tensors.items():
        if batch.dims_of(name) != batch.dims:
            continue
        if isinstance(value, Ragged):
            items = int(value.values.shape[0])
            item_bytes = -(-array_nbytes(value.values) // items) if items else 0
            lengths = value.flat_lengths()
            total += 8 + (int(lengths.max()) * item_bytes if lengths.size else 0)
        else:
            total += -(-array_nbytes(value) // max(rows, 1))
    return total


def check_sample(rows: int, per_row: int, max_bytes: int) -> None:
    """Refuse (a ValueError naming the bound and the fix) a sample of ``rows`` rows of up to ``per_row`` bytes each
    before anything is drawn or gathered: at most MAX_SAMPLE_ROWS rows, and a reply that fits one data-plane
    message (the caller could not receive a larger one)."""
    if rows > MAX_SAMPLE_ROWS:
        raise ValueError(f"a sample of {rows} rows (n, times length for windows) exceeds {MAX_SAMPLE_ROWS}; ask for "
                         f"fewer rows per request")
    if rows * per_row > max_bytes:
        raise ValueError(f"a sample of {rows} rows of up to {per_row} bytes each could take {rows * per_row} bytes, "
                         f"more than data_plane.max_message_bytes={max_bytes} (the reply must fit one message); ask "
                         f"for fewer rows per request or raise data_plane.max_message_bytes")


class WindowMax:
    """The largest value over a FIFO window (added at the tail, evicted from the head) in O(1) amortised: it keeps
    the entries that no later entry equals or outweighs. What a store's ``row_bytes`` reads on every sample."""

    def __init__(self) -> None:
        self._entries: deque[tuple[Any, int]] = deque()

    def append(self, item: Any, value: int) -> None:
        while self._entries and self._entries[-1][1] <= value:
            self._entries.pop()
        self._entries.append((item, value))

    def evict(self, item: Any) -> None:
        """``item`` left the head of the window."""
        if self._entries and self._entries[0][0] is item:
            self._entries.popleft()

    def clear(self) -> None:
        self._entries.clear()

    @property
    def value(self) -> int:
        return self._entries[0][1] if self._entries else 0


def draw_rows(counts: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Which rows (flat index over the window) and batches (owner) a uniform sample takes. Both stores draw with
    these calls, so they give the same rows for the same seed and contents."""
    flat = rng.integers(0, counts.sum(), size=n)
    return flat, np.searchsorted(np.cumsum(counts), flat, side="right")


def gather_rows(batches: list[TensorBatch], counts: np.ndarray, flat: np.ndarray, owner: np.ndarray) -> TensorBatch:
    """The drawn rows of every batch, flattened to ("sample",), in draw order, plus a per-row "version" field.
    Fields that are per batch rather than per row (a trajectory's last_values) are not rows and are left out.
    (Sampling runs every iteration of an off-policy run: rows are gathered per owning batch and field, with no
    intermediate batches.)"""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    by_owner = np.argsort(owner, kind="stable")  # draw positions grouped by the batch they come from
    owners, first = np.unique(owner[by_owner], return_index=True)
    bounds = [*first[1:], len(by_owner)]
    names: list[str] | None = None
    parts: dict[str, list] = {}
    versions = []
    for b, lo, hi in zip(owners, first, bounds, strict=True):
        batch = batches[b]
        fields = [n for n in batch.tensors if batch.dims_of(n) == batch.dims]
        if names is None:
            names, parts = fields, {n: [] for n in fields}
        elif fields != names:
            raise ValueError(f"the replay window mixes batches of different fields, so rows cannot be sampled "
                             f"together: {names} vs {fields}")
        local = flat[by_owner[lo:hi]] - starts[b]
        rows, k = int(counts[b]), len(batch.dims)
        for n in names:
            v = batch.tensors[n]
            parts[n].append(v.reshape((rows,)).take(local) if isinstance(v, Ragged)
                            else v.reshape(rows, *v.shape[k:])[local])
        versions.append(np.full(hi - lo, batch.version, dtype=np.int64))
    order = np.argsort(by_owner, kind="stable")  # back to draw order
    tensors = {}
    for n, p in parts.items():
        if isinstance(p[0], Ragged):
            tensors[n] = TensorBatch.cat([TensorBatch({n: r}, dims=("sample",)) for r in p], "sample")[n].take(order)
        else:
            tensors[n] = np.concatenate(p)[order]
    tensors["version"] = np.concatenate(versions)[order]
    return TensorBatch(tensors, dims=("sample",), version=int(tensors["version"].min()))


def sample_windows(batches: list[TensorBatch], n: int, length: int, rng: np.random.Generator) -> TensorBatch:
    """n windows of ``length`` consecutive steps, uniform over every window the trajectories hold (both stores)."""
    counts = window_counts(batches, length)
    if not counts.sum():
        raise ValueError(f"replay holds no trajectory of at least {length} steps to cut windows from")
    flat, owner = draw_rows(counts, n, rng)
    return gather_windows(batches, counts, flat, owner, length)


def window_counts(batches: list[TensorBatch], length: int) -> np.ndarray:
    """Windows of ``length`` steps each batch offers: its envs times the start steps that fit."""
    out = np.zeros(len(batches), dtype=np.int64)
    for i, b in enumerate(batches):
        if TIME in b.dims:
            sizes = b.sizes()
            others = int(np.prod([sizes[d] for d in b.dims if d != TIME]))
            out[i] = others * max(0, sizes[TIME] - length + 1)
    return out


def gather_windows(batches: list[TensorBatch], counts: np.ndarray, flat: np.ndarray, owner: np.ndarray,
                   length: int) -> TensorBatch:
    """Windows [t0, t0 + length) of one env's steps: a ("sample", "time") batch, in draw order. A window lies
    within one stored batch; fields without both dims are left out."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pieces: list[tuple[np.ndarray, dict[str, np.ndarray], int]] = []
    for b in np.unique(owner):
        sel = np.flatnonzero(owner == b)
        batch = batches[b]
        if batch.dims[:1] != (TIME,):
            raise ValueError(f"sequence windows need batches whose first dim is '{TIME}', got {list(batch.dims)}")
        sizes = batch.sizes()
        per_start = int(np.prod([sizes[d] for d in batch.dims[1:]]))  # cells of one time step
        local = flat[sel] - starts[b]
        t0, cell = local // per_start, local % per_start
        steps = t0[:, None] + np.arange(length)[None, :]  # [S, L]
        fields = {}
        for name, value in batch.tensors.items():
            if batch.dims_of(name) != batch.dims:
                continue
            if isinstance(value, Ragged):
                raise ValueError(f"sequence windows of ragged field '{name}' are not supported")
            rows = value.reshape(sizes[TIME], per_start, *value.shape[len(batch.dims):])
            fields[name] = rows[steps, cell[:, None]]
        fields["version"] = np.full(len(sel), batch.version, dtype=np.int64)
        pieces.append((sel, fields, batch.version))
    order = np.argsort(np.concatenate([sel for sel, _, _ in pieces]), kind="stable")
    names = pieces[0][1].keys()
    tensors = {k: np.concatenate([f[k] for _, f, _ in pieces])[order] for k in names}
    return TensorBatch(tensors, dims=("sample", TIME), field_dims={"version": ("sample",)},
                       version=min(v for _, _, v in pieces))


class ReplayStore(Protocol):
    capacity: int
    row_bytes: int  # the most bytes a row of the window can take in a sample (row_bytes()); 0 when empty
    transitions: int
    bytes: int
    puts: int
    onpolicy_gets: int
    samples: int
    evicted: int
    stale_dropped: int
    newest_version: int

    @property
    def pending(self) -> int: ...

    def __len__(self) -> int: ...

    def put(self, batch: TensorBatch) -> int: ...

    def take_onpolicy(self, min_version: int) -> TensorBatch | None: ...

    def drop_pending(self) -> int: ...

    def sample(self, n: int, rng: np.random.Generator) -> TensorBatch: ...

    def sample_windows(self, n: int, length: int, rng: np.random.Generator) -> TensorBatch: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


def open_replay_store(config: RunConfig, run_id: str, object_store: ObjectStore | None = None,
                      source: str = "online", capacity: int | None = None) -> ReplayStore:
    """The store ``replay.store`` names, for one named source. A Redis store reopens what an earlier replay service
    stored for the same ``replay.key_prefix``, run_id and source; ``object_store`` receives tensors larger than
    ``replay.offload_bytes`` (None keeps them in Redis)."""
    replay = config.replay
    capacity = capacity or replay.capacity_transitions
    if replay.store == "memory":
        from rlfabric.services.replay.stores.memory import MemoryStore

        return MemoryStore(capacity, replay.capacity_bytes)
    if replay.store == "redis":
        from rlfabric.services.replay.stores.redis import RedisStore

        return RedisStore.from_config(replay, run_id, object_store, source=source, capacity=capacity)
    raise ValueError(f"replay.store={replay.store!r} is not a known store. Fix: use 'memory' or 'redis'")
