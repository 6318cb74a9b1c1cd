"""MemoryStore: trajectory batches in process memory.

Two views over the same batches: an on-policy FIFO the learner consumes once (oldest first, refusing data older
than the staleness bound the caller passes), and a capacity-bounded window that off-policy users sample
transitions from uniformly. Batches are time-major [T, N, ...]; a transition is one (t, n) cell.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from services.core.batch import TensorBatch
from services.replay.stores import check_trajectory


@dataclass(eq=False)  # identity, not field equality: comparing batches would compare arrays
class _Stored:
    batch: TensorBatch
    transitions: int
    nbytes: int


class MemoryStore:
    def __init__(self, capacity_transitions: int):
        self.capacity = capacity_transitions
        self._window: deque[_Stored] = deque()
        self._pending: deque[_Stored] = deque()
        self.transitions = 0
        self.bytes = 0
        self.puts = self.onpolicy_gets = self.samples = self.evicted = self.stale_dropped = 0
        self.newest_version = -1

    def put(self, batch: TensorBatch) -> int:
        n = check_trajectory(batch, self.capacity)
        item = _Stored(batch, n, batch.nbytes)
        self._window.append(item)
        self._pending.append(item)
        self.transitions += n
        self.bytes += item.nbytes
        self.puts += 1
        self.newest_version = max(self.newest_version, batch.version)
        while self.transitions > self.capacity:
            old = self._window.popleft()
            self.transitions -= old.transitions
            self.bytes -= old.nbytes
            self.evicted += 1
            if old in self._pending:
                self._pending.remove(old)
        return self.puts

    def take_onpolicy(self, min_version: int) -> TensorBatch | None:
        """Oldest unconsumed batch with version >= min_version; older ones are dropped and counted."""
        while self._pending:
            item = self._pending.popleft()
            if item.batch.version >= min_version:
                self.onpolicy_gets += 1
                return item.batch
            self.stale_dropped += 1
        return None

    def sample(self, n: int, rng: np.random.Generator) -> TensorBatch:
        if not self._window:
            raise ValueError("replay is empty: nothing to sample yet")
        counts = np.array([s.transitions for s in self._window])
        flat = rng.integers(0, counts.sum(), size=n)
        owner = np.searchsorted(np.cumsum(counts), flat, side="right")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        out: dict[str, list[np.ndarray]] = {}
        versions = np.empty(n, dtype=np.int64)
        items = list(self._window)
        for b in np.unique(owner):
            sel = np.flatnonzero(owner == b)
            local = flat[sel] - starts[b]
            stored = items[b]
            T, N = next(v.shape[:2] for v in stored.batch.tensors.values() if v.ndim >= 2)
            for name, v in stored.batch.tensors.items():
                if v.ndim >= 2 and v.shape[:2] == (T, N):
                    out.setdefault(name, []).append(v.reshape(T * N, *v.shape[2:])[local])
            versions[sel] = stored.batch.version
        order = np.argsort(np.concatenate([np.flatnonzero(owner == b) for b in np.unique(owner)]))
        tensors = {k: np.concatenate(v)[order] for k, v in out.items()}
        tensors["version"] = versions
        self.samples += 1
        return TensorBatch(tensors, version=int(versions.min()))

    def clear(self) -> None:
        self._window.clear()
        self._pending.clear()
        self.transitions = self.bytes = 0

    def close(self) -> None:
        self.clear()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def __len__(self) -> int:
        return len(self._window)
