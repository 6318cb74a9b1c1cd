"""Replay stores behind one interface, chosen by ``replay.store``.

A store holds trajectory batches (time-major ``[T, N, ...]`` TensorBatches tagged with the weight version that
produced them) and offers two views: an on-policy FIFO the learner consumes once (``take_onpolicy``), and a
capacity-bounded window of transitions to sample uniformly (``sample``). ``put`` returns only once the batch
is stored: the replay service acknowledges a put after it returns, so nothing acknowledged is lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from services.core.batch import TensorBatch

if TYPE_CHECKING:
    from services.core.config import RunConfig
    from services.core.objectstore import ObjectStore


def check_trajectory(batch: TensorBatch, capacity: int) -> int:
    """What every store refuses alike before storing: returns the batch's transitions (T * N)."""
    if batch.version < 0:
        raise ValueError("trajectory batch has no policy version (header 'version' < 0); tag it with the "
                         "weight version that produced it")
    shapes = {tuple(v.shape[:2]) for v in batch.tensors.values() if v.ndim >= 2}
    if len(shapes) != 1:
        raise ValueError(f"a trajectory batch needs every [T, N, ...] tensor to share T and N, got {shapes}")
    t, n = shapes.pop()
    if t * n > capacity:
        raise ValueError(f"batch of {t * n} transitions exceeds replay.capacity_transitions={capacity}")
    return t * n


class ReplayStore(Protocol):
    capacity: int
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

    def sample(self, n: int, rng: np.random.Generator) -> TensorBatch: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


def open_replay_store(config: RunConfig, run_id: str, object_store: ObjectStore | None = None) -> ReplayStore:
    """The store ``replay.store`` names. A Redis store reopens what an earlier replay service stored for the same
    ``replay.key_prefix`` and run_id; ``object_store`` receives tensors larger than ``replay.offload_bytes``
    (None keeps them in Redis)."""
    replay = config.replay
    if replay.store == "memory":
        from services.replay.stores.memory import MemoryStore

        return MemoryStore(replay.capacity_transitions)
    if replay.store == "redis":
        from services.replay.stores.redis import RedisStore

        return RedisStore.from_config(replay, run_id, object_store)
    raise ValueError(f"replay.store={replay.store!r} is not a known store. Fix: use 'memory' or 'redis'")
