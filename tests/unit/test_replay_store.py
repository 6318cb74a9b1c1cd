import numpy as np
import pytest

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.replay.stores.memory import MemoryStore


def _batch(version, T=4, N=2, fill=None):
    fill = version if fill is None else fill
    return TensorBatch({"obs": np.full((T, N, 3), fill, np.float32), "rewards": np.full((T, N), fill, np.float32),
                        "last_values": np.zeros(N, np.float32)}, version=version, dims=("time", "env"),
                       field_dims={"last_values": ("env",)})


def test_onpolicy_fifo_with_version_bound():
    s = MemoryStore(1000)
    for v in (0, 1, 2, 3):
        s.put(_batch(v))
    assert s.take_onpolicy(2).version == 2  # 0 and 1 are older than the bound: dropped and counted
    assert s.stale_dropped == 2
    assert s.take_onpolicy(0).version == 3
    assert s.take_onpolicy(0) is None and s.onpolicy_gets == 2


def test_capacity_evicts_oldest_and_pending():
    s = MemoryStore(20)  # 8 transitions per batch
    for v in range(4):
        s.put(_batch(v))
    assert len(s) == 2 and s.transitions == 16 and s.evicted == 2
    assert s.take_onpolicy(0).version == 2
    with pytest.raises(ValueError, match="exceeds replay.capacity_transitions"):
        s.put(_batch(9, T=30))


def test_sampling_is_uniform_over_transitions_and_tags_versions():
    s = MemoryStore(1000)
    s.put(_batch(1, T=10, N=1))   # 10 transitions of version 1
    s.put(_batch(2, T=30, N=1))   # 30 transitions of version 2
    out = s.sample(4000, np.random.default_rng(0))
    assert out["obs"].shape == (4000, 3) and out["rewards"].shape == (4000,)
    assert "last_values" not in out  # per-batch tensors are not transitions
    frac_v2 = (out["version"] == 2).mean()
    assert 0.70 < frac_v2 < 0.80
    np.testing.assert_array_equal(out["rewards"], out["version"].astype(np.float32))  # rows stay aligned


def test_bad_batches_are_refused():
    s = MemoryStore(100)
    with pytest.raises(ValueError, match="policy version"):
        s.put(_batch(-1))
    bad = TensorBatch({"a": np.zeros((4, 2)), "b": np.zeros((3, 2))}, version=0, dims=("time", "env"))
    with pytest.raises(ValueError, match="batch dim 'time' is 3 in field 'b' but 4 in field 'a'"):
        s.put(bad)
    with pytest.raises(ValueError, match="declares no batch dims"):
        s.put(TensorBatch({"a": np.zeros((4, 2))}, version=0))
    with pytest.raises(ValueError, match="empty"):
        MemoryStore(10).sample(1, np.random.default_rng(0))


def test_eviction_in_the_onpolicy_steady_state():
    """put, put, take, put at capacity: the taken batch is evicted while another is pending (a regression:
    membership tests once compared batches field by field, i.e. array against array)."""
    s = MemoryStore(16)
    s.put(_batch(0))
    s.put(_batch(1))
    assert s.take_onpolicy(0).version == 0
    s.put(_batch(2))
    assert s.evicted == 1 and s.pending == 2 and s.take_onpolicy(0).version == 1


def _numbered(version: int, T: int = 6, N: int = 3) -> TensorBatch:
    """obs[t, n] = 100 * t + n (+ 10000 * version): every window tells where it came from."""
    cell = (100 * np.arange(T)[:, None] + np.arange(N)[None, :] + 10000 * version).astype(np.float32)
    return TensorBatch({"obs": cell[..., None].repeat(2, -1), "rewards": cell, "last_values": np.zeros(N, np.float32)},
                       version=version, dims=("time", "env"), field_dims={"last_values": ("env",)})


def test_sequence_windows_are_consecutive_steps_of_one_env():
    s = MemoryStore(1000)
    for v in range(3):
        s.put(_numbered(v))
    out = s.sample_windows(500, 4, np.random.default_rng(0))
    assert out.dims == ("sample", "time") and out["obs"].shape == (500, 4, 2) and out["rewards"].shape == (500, 4)
    steps = np.diff(out["rewards"], axis=1)
    assert (steps == 100).all()  # the same env, one step apart
    assert set(np.unique(out["rewards"][:, 0] % 100)) == {0, 1, 2}  # every env
    assert set(np.unique(out["rewards"][:, 0] // 100 % 100)) == {0, 1, 2}  # every start that fits (T - 4 + 1 = 3)
    np.testing.assert_array_equal(out["version"], out["rewards"][:, 0] // 10000)
    with pytest.raises(ValueError, match="no trajectory of at least 7 steps"):
        s.sample_windows(1, 7, np.random.default_rng(0))
