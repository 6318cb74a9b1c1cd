"""Replay stores behind one interface, chosen by ``replay.store``.

A store holds trajectory batches (time-major ``[T, N, ...]`` TensorBatches tagged with the weight version that
produced them) and offers two views: an on-policy FIFO the learner consumes once (``take_onpolicy``), and a
capacity-bounded window of transitions to sample uniformly (``sample``). ``put`` returns only once the batch
is stored: the replay service acknowledges a put after it returns, so nothing acknowledged is lost.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from services.core.batch import TensorBatch


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
