"""TensorBatch by declared dims: joins, flattening, rows, ragged fields and nested (Dict) fields, never guessing an
axis."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import Ragged, TensorBatch


def _trajectory(T: int, N: int, offset: int = 0) -> TensorBatch:
    """A [T, N] trajectory whose cells are numbered (t * 1000 + global env), a per-env field, and ragged tokens of
    a length that depends on the cell."""
    env = np.arange(offset, offset + N)
    cell = np.arange(T)[:, None] * 1000 + env[None, :]
    rows = [np.full(int(c % 3), c, np.int64) for c in cell.reshape(-1)]
    tokens = Ragged.from_rows(rows, np.int64)
    tokens = Ragged(tokens.values, tokens.lengths.reshape(T, N))
    return TensorBatch({"cell": cell, "obs": {"image": np.zeros((T, N, 2, 2, 3), np.uint8), "state": cell * 1.0},
                        "last_values": env * 1.0, "tokens": tokens},
                       version=3, dims=("time", "env"), field_dims={"last_values": ("env",)})


def test_shards_join_along_the_named_dim_ragged_fields_included():
    a, b = _trajectory(4, 2, 0), _trajectory(4, 3, 2)
    joined = TensorBatch.cat([a, b], "env")
    whole = _trajectory(4, 5, 0)
    assert joined.sizes() == {"time": 4, "env": 5} and joined.rows == 20
    np.testing.assert_array_equal(joined["cell"], whole["cell"])
    np.testing.assert_array_equal(joined["last_values"], np.arange(5.0))  # per env: joined along env too
    assert joined["tokens"].equals(whole["tokens"])  # values re-ordered to the joined cells' row-major order
    assert joined["obs/image"].dtype == np.uint8 and set(joined["obs"]) == {"image", "state"}


def test_flatten_take_and_unflatten_keep_rows_aligned():
    flat = _trajectory(4, 3).flatten()
    assert flat.dims == ("sample",) and flat.rows == 12 and "last_values" not in flat  # not a row field
    picked = flat.take(np.array([11, 0, 5]))
    assert picked["cell"].tolist() == [3002, 0, 1002]
    assert [r.tolist() for r in picked["tokens"].rows()] == [[3002] * (3002 % 3), [], [1002] * (1002 % 3)]
    parts = flat.unflatten("sample", ("update", "sample"), (3, 4))
    assert parts.sizes() == {"update": 3, "sample": 4} and parts["obs/state"].shape == (3, 4)
    assert parts["tokens"].shape == (3, 4)


def test_inconsistent_fields_and_bad_dims_are_refused_by_name():
    with pytest.raises(ValueError, match="batch dim 'env' is 3 in field 'b' but 2 in field 'a'"):
        TensorBatch({"a": np.zeros((4, 2)), "b": np.zeros((4, 3))}, dims=("time", "env")).sizes()
    with pytest.raises(ValueError, match="ragged field 't' has 1 cell dims"):
        TensorBatch({"t": Ragged.from_rows([[1], [2, 3]])}, dims=("time", "env")).sizes()
    with pytest.raises(ValueError, match="cannot join along 'env'"):
        TensorBatch.cat([TensorBatch({"a": np.zeros(3)}, dims=("sample",))], "env")


def test_ragged_padding_and_torch_conversion():
    r = Ragged.from_rows([[1, 2, 3], [], [4]], np.int64)
    values, mask = r.padded(pad=-1)
    assert values.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]] and mask.sum() == 4
    out = TensorBatch({"t": r, "x": np.ones((3, 2), np.float32)}, dims=("sample",)).to_torch()
    assert isinstance(out["t"], Ragged) and isinstance(out["t"].values, torch.Tensor)
    tv, tm = out["t"].padded()
    assert tv.tolist() == [[1, 2, 3], [0, 0, 0], [4, 0, 0]] and tm.dtype == torch.bool
    assert out["t"].take(np.array([2, 0])).values.tolist() == [4, 1, 2, 3]
