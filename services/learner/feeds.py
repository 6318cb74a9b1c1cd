"""Feeds: how the learner reads replay for one update, as the algorithm's DataAccess declares it.

    OnPolicyFeed   the iteration's batch from the FIFO, once: one ("time", "env") shard per rollout worker, each at
                   least ``min_version``, joined along "env" by their env offsets
    SampledFeed    minibatches sampled from the window (uniform rows, sequence windows, or a weighted mix of named
                   sources), as many as the algorithm owes (``updates_for``), shaped ("update", "sample"[, "time"]).
                   When the run collects, the iteration's shards are taken from the FIFO first, which confirms that
                   epoch's data is stored (so updates per env step hold exactly) and keeps the FIFO empty.

Both speak to the replay service over one DataClient (owned by the learner's training thread).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from rlfabric.services.core.algorithm import DataAccess
from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.dataplane import DataClient, PeerTimeout

log = logging.getLogger(__name__)
WAIT_SLICE_S = 1.0  # a wait for shards is asked in slices this long, so a cancelled update stops within one


class UpdateCancelled(Exception):
    """The caller of the update went away (its Train call was cancelled): stop waiting for its data."""


@dataclass
class Fed:
    """One update's data: the batch (None when the algorithm owes no update yet) and the weight version of the
    iteration's collected data (what the staleness bound is about; the sampled rows may be older)."""

    batch: TensorBatch | None
    version: int


class OnPolicyFeed:
    def __init__(self, replay: DataClient, num_envs: int):
        self.replay, self.num_envs = replay, num_envs
        self.held: dict[int, list[TensorBatch]] = {}  # shards of later updates, taken early

    def take(self, batch_index: int, min_version: int, timeout_s: float,
             cancelled: threading.Event | None = None) -> TensorBatch:
        """Update ``batch_index``'s batch: the shards of that index, joined along "env" once they hold every env.
        Shards arrive FIFO from replay; one of a later index (a worker running ahead within the staleness bound) is
        held for its own update; one of an earlier index (left over from before a re-plan) is dropped."""
        deadline = time.monotonic() + timeout_s
        shards = self.held.pop(batch_index, [])
        envs = sum(_envs(b) for b in shards)
        while envs < self.num_envs:
            if cancelled is not None and cancelled.is_set():
                raise UpdateCancelled(f"update {batch_index} cancelled while waiting for its shards")
            left = max(0.0, deadline - time.monotonic())
            wait = min(left, WAIT_SLICE_S)
            kind, shard = self.replay.request("get", TensorBatch(meta={"min_version": min_version, "wait_s": wait}),
                                              timeout_s=wait + 5)
            if kind != "batch" and left > wait:
                continue  # nothing yet in this slice: ask again until the deadline
            if kind != "batch":
                raise PeerTimeout(f"no trajectory batch with version >= {min_version} arrived in replay within "
                                  f"{timeout_s:.1f}s (have {envs} of {self.num_envs} envs of batch {batch_index}); "
                                  f"is the rollout service producing?")
            index = shard.meta.get("batch_index", batch_index)
            if not isinstance(index, int):
                raise ValueError(f"a replay shard carries batch_index {index!r}; rollout workers write an integer")
            if index > batch_index:
                self.held.setdefault(index, []).append(shard)
                continue
            if index < batch_index:
                log.warning("dropped a shard of batch %d arriving at update %d", index, batch_index)
                continue
            shards.append(shard)
            envs += _envs(shard)
        if len(shards) == 1:
            return shards[0]
        shards.sort(key=lambda b: int(b.meta.get("env_offset", 0)))
        joined = TensorBatch.cat(shards, "env")
        joined.meta = {"env_steps": sum(int(b.meta.get("env_steps", 0)) for b in shards), "shards": len(shards),
                       "batch_index": batch_index}
        return joined

    def next(self, algo: Any, batch_index: int, min_version: int, timeout_s: float,
             cancelled: threading.Event | None = None) -> Fed:
        batch = self.take(batch_index, min_version, timeout_s, cancelled)
        return Fed(batch, batch.version)


def _envs(shard: TensorBatch) -> int:
    if "env" not in shard.dims:
        raise ValueError(f"a trajectory shard needs an 'env' batch dim, this one has {list(shard.dims)}")
    return shard.sizes()["env"]


class SampledFeed:
    def __init__(self, replay: DataClient, access: DataAccess, collects: bool, num_envs: int):
        self.replay, self.access, self.collects = replay, access, collects
        self.fifo = OnPolicyFeed(replay, num_envs) if collects else None

    def next(self, algo: Any, batch_index: int, min_version: int, timeout_s: float,
             cancelled: threading.Event | None = None) -> Fed:
        """The [U, B, ...] minibatches the algorithm owes now (None before it owes any)."""
        collected = (self.fifo.take(batch_index, min_version, timeout_s, cancelled) if self.fifo is not None
                     else None)
        version = collected.version if collected is not None else -1
        updates = algo.updates_for(collected.rows if collected is not None else 0)
        if updates <= 0:
            return Fed(None, version)
        a = self.access
        n = updates * a.batch_size
        if a.kind == "sequences":
            meta = {"n": n, "length": a.length, "source": a.sources[0][0]}
            kind = "sample_windows"
        elif a.kind == "mix":
            # every minibatch holds the mix's shares (not just the whole draw): [U, B] below splits it per B rows
            meta, kind = {"n": n, "mix": dict(a.sources), "minibatch": a.batch_size}, "sample"
        else:
            meta, kind = {"n": n, "source": a.sources[0][0]}, "sample"
        reply, batch = self.replay.request(kind, TensorBatch(meta=meta), timeout_s=timeout_s + 5)
        if reply == "empty":  # a source the run fills as it goes (interventions) has nothing yet: no update owed
            log.info("no update at batch %d: replay source(s) %s are still empty", batch_index,
                     list(a.source_names))
            return Fed(None, version)
        if reply != "batch":
            raise PeerTimeout(f"replay answered {reply!r} to a sample of {n} rows")
        return Fed(batch.unflatten("sample", ("update", "sample"), (updates, a.batch_size)),
                   version if collected is not None else batch.version)


def feed_for(access: DataAccess, replay: DataClient, collects: bool, num_envs: int) -> OnPolicyFeed | SampledFeed:
    if access.on_policy_fifo:
        return OnPolicyFeed(replay, num_envs)
    return SampledFeed(replay, access, collects, num_envs)
