"""Data sets on disk: named replay sources loaded at the start of a run (offline RL, demonstrations).

A data set is an ``.npz`` file of equally long arrays, one row per transition: ``obs`` (or ``obs/<key>`` for Dict
observations), ``actions``, ``rewards``, ``next_obs``, ``terminated``, and whatever else an algorithm reads. It is
read with ``allow_pickle=False`` (numpy refuses object arrays), checked, and stored into its source in chunks, so
both replay stores hold it like collected data. ``rlfabric collect`` writes such files from a checkpoint.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from services.core.batch import SEP, TensorBatch
from services.core.paths import DataRoots, PathRefused

CHUNK_ROWS = 1 << 15


class DatasetError(ValueError):
    """A data set file that cannot be used; the message names the file, the array and the fix."""


def load_dataset(path: str | Path, max_rows: int, max_bytes: int = 8 << 30, roots: DataRoots | None = None,
                 field: str = "replay.datasets") -> TensorBatch:
    """The file's arrays as one ("sample",) batch of version 0. Sizes are checked from the archive's directory
    before any array is read. ``roots``: the directories a run spec's data set must lie in (any, without them);
    either way only a regular file is opened (a FIFO or a device is refused, not read)."""
    path = Path(path)
    roots = roots if roots is not None else DataRoots.anywhere()
    try:
        if not roots.confine(path, field).exists():
            raise DatasetError(f"{path}: no such data set file. Fix: write one with `rlfabric collect` (an .npz of "
                               f"obs, actions, rewards, next_obs, terminated) and point replay.datasets at it")
        file = roots.open(path, field)
    except PathRefused as exc:
        raise DatasetError(str(exc)) from None
    with file:
        try:
            with zipfile.ZipFile(file) as archive:
                size = sum(info.file_size for info in archive.infolist())
        except zipfile.BadZipFile:
            raise DatasetError(f"{path}: not an .npz archive") from None
        if size > max_bytes:
            raise DatasetError(f"{path}: {size} bytes uncompressed exceeds the {max_bytes}-byte bound for a data set")
        file.seek(0)
        tensors: dict[str, np.ndarray] = {}
        try:
            with np.load(file, allow_pickle=False) as npz:
                for name in npz.files:
                    if not name or "" in name.split(SEP):
                        raise DatasetError(f"{path}: array name {name!r} is not a field name")
                    tensors[name] = np.ascontiguousarray(npz[name])
        except ValueError as exc:  # object arrays (pickle) are refused here
            raise DatasetError(f"{path}: cannot read safely ({exc})") from None
    if not tensors:
        raise DatasetError(f"{path}: holds no arrays")
    rows = {name: (a.shape[0] if a.ndim else -1) for name, a in tensors.items()}
    if len(set(rows.values())) != 1 or -1 in rows.values():
        raise DatasetError(f"{path}: every array needs the same number of rows (one per transition), got {rows}")
    n = next(iter(rows.values()))
    if n == 0 or n > max_rows:
        raise DatasetError(f"{path}: {n} rows; a data set source holds 1..{max_rows} (replay.capacity_transitions)")
    for name, a in tensors.items():
        if a.dtype.kind not in "biuf":
            raise DatasetError(f"{path}: array {name!r} has dtype {a.dtype}; only numbers and booleans")
    return TensorBatch(tensors, version=0, dims=("sample",))


def chunks(batch: TensorBatch, rows: int = CHUNK_ROWS) -> list[TensorBatch]:
    """The data set cut into batches of at most ``rows`` rows (each a separate stored batch)."""
    total = batch.rows
    return [TensorBatch({k: v[a:a + rows] for k, v in batch.tensors.items()}, version=batch.version,
                        dims=batch.dims, meta={"dataset_rows": total}) for a in range(0, total, rows)]


def save_dataset(path: str | Path, batch: TensorBatch) -> Path:
    """Write a ("sample",) batch of dense fields as an .npz data set."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: np.asarray(v) for k, v in batch.tensors.items()})
    return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")
