"""MemoryStore: replay batches in process memory.

Two views over the same batches: an on-policy FIFO the learner consumes once (oldest first, refusing data older
than the staleness bound the caller passes), and a capacity-bounded window that off-policy users sample rows (or
windows of steps) from uniformly. Batches keep their declared dims; a row is one cell of their batch shape.
Capacity is counted in rows and in bytes (rows alone would let a client that sends large rows fill the host's
memory): the oldest batches are evicted while either is exceeded, and a batch larger than either is refused.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import numpy as np

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.replay.stores import (
    WindowMax,
    check_batch,
    draw_rows,
    gather_rows,
    row_bytes,
    sample_windows,
)


def default_capacity_bytes() -> int:
    """Half of this host's physical memory: what a memory replay may hold by default."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # (no sysconf names on this platform)
        return 16 << 30


@dataclass(eq=False)  # identity, not field equality: comparing batches would compare arrays
class _Stored:
    batch: TensorBatch
    transitions: int
    nbytes: int


class MemoryStore:
    def __init__(self, capacity_transitions: int, capacity_bytes: int | None = None):
        """``capacity_bytes``: the most bytes of batches held (default: half of this host's memory)."""
        self.capacity = capacity_transitions
        self.capacity_bytes = default_capacity_bytes() if capacity_bytes is None else capacity_bytes
        self._window: deque[_Stored] = deque()
        self._row_bytes = WindowMax()
        self._pending: deque[_Stored] = deque()
        self.transitions = 0
        self.bytes = 0
        self.puts = self.onpolicy_gets = self.samples = self.evicted = self.stale_dropped = 0
        self.newest_version = -1

    def put(self, batch: TensorBatch) -> int:
        n = check_batch(batch, self.capacity)
        item = _Stored(batch, n, batch.nbytes)
        if item.nbytes > self.capacity_bytes:
            raise ValueError(f"batch of {item.nbytes} bytes exceeds the memory replay's byte capacity of "
                             f"{self.capacity_bytes} (by default half of the replay host's memory); send smaller "
                             f"batches, or use replay.store=redis")
        self._window.append(item)
        self._row_bytes.append(item, row_bytes(batch, n))
        self._pending.append(item)
        self.transitions += n
        self.bytes += item.nbytes
        self.puts += 1
        self.newest_version = max(self.newest_version, batch.version)
        while self.transitions > self.capacity or self.bytes > self.capacity_bytes:
            old = self._window.popleft()
            self._row_bytes.evict(old)
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

    def drop_pending(self) -> int:
        """Forget the FIFO (batches not yet taken) but keep the window; returns how many were dropped."""
        dropped = len(self._pending)
        self._pending.clear()
        self.stale_dropped += dropped
        return dropped

    def sample(self, n: int, rng: np.random.Generator) -> TensorBatch:
        if not self._window:
            raise ValueError("replay is empty: nothing to sample yet")
        counts = np.array([s.transitions for s in self._window])
        flat, owner = draw_rows(counts, n, rng)
        self.samples += 1
        return gather_rows([s.batch for s in self._window], counts, flat, owner)

    def sample_windows(self, n: int, length: int, rng: np.random.Generator) -> TensorBatch:
        out = sample_windows([s.batch for s in self._window], n, length, rng)
        self.samples += 1
        return out

    def clear(self) -> None:
        self._window.clear()
        self._row_bytes.clear()
        self._pending.clear()
        self.transitions = self.bytes = 0

    def close(self) -> None:
        self.clear()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def row_bytes(self) -> int:
        """The most bytes one row of the window can take in a sample (0 when empty)."""
        return self._row_bytes.value

    def __len__(self) -> int:
        return len(self._window)
