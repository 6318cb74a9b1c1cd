"""RolloutWorker: the acting loop, on its own thread with its own sockets (env, replay, learner weights).

The worker owns what every collector needs — the backend and its weight versions, the env channel, the replay
client, turns (offload) and drains — and hands the acting itself to the run's collector (collectors/). Jobs
(collect, produce, evaluate) run one at a time; a long ``produce`` runs queued evaluations between batches.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from rlfabric.services.core import progress
from rlfabric.services.core.algorithm import INTERVENTIONS
from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.dataplane import DataClient, PeerTimeout
from rlfabric.services.core.devices import resolve_device
from rlfabric.services.core.objectstore import open_store
from rlfabric.services.core.offload import ModelOffload, state_tensors
from rlfabric.services.core.runtime import set_torch_threads
from rlfabric.services.core.weights import WeightSubscriber, load_weights
from rlfabric.services.rollout.backends import build_backend
from rlfabric.services.rollout.collectors import collector_class
from rlfabric.services.rollout.collectors.gym import Evaluation, Stopped, intervened_transitions

log = logging.getLogger(__name__)

__all__ = ["CollectResult", "RolloutWorker", "Stopped", "WeightsLate"]


class WeightsLate(TimeoutError):
    """The learner did not publish the weight version a batch needs within data_plane.timeout_s: the learner's
    doing (its Train is slow or failing), so the coordinator hears it as DEADLINE_EXCEEDED, not as an unreachable
    peer, and looks to the learner's Train for the cause."""


@dataclass
class CollectResult:
    batch_index: int
    env_steps: int
    weight_version: int
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    collect_seconds: float = 0.0
    env_seconds: float = 0.0
    policy_seconds: float = 0.0
    weight_wait_seconds: float = 0.0
    shard: int = 0
    shard_envs: int = 0
    stats: dict[str, float] = field(default_factory=dict)


class RolloutWorker:
    def __init__(self, config: RunConfig, env_spec: dict, peers: dict[str, str], base_version: int = 0,
                 start_iteration: int = 0, shard: int = 0, shard_envs: int | None = None, env_offset: int = 0,
                 expert: dict | None = None, fence: str = ""):
        self.config = config
        self.fence = fence  # the run attempt it works for, stamped on its env and replay requests (check_fence)
        self.expert = expert  # an expert checkpoint's state, when the algorithm has the expert act in some steps
        # this worker's shard of the env batch: envs [env_offset, env_offset + shard_envs) of the run, seeded by
        # their global index so a run splits the same envs whatever its number of workers
        self.shard = shard
        self.shard_envs = shard_envs or config.env.num_envs
        self.interventions = config.collects and INTERVENTIONS in config.spec.data(config.algorithm).source_names
        self.env_offset = env_offset
        self.pool = f"train/{shard}"
        self.drain_after: int | None = None  # produce stops after this batch index (a leaving or re-sharded worker)
        self.base_version = base_version  # weight version of iteration 0 of this run
        self.start_iteration = start_iteration  # > 0 when the run resumed from a checkpoint
        self.env_spec = env_spec
        self.peers = peers
        self.jobs: queue.Queue = queue.Queue()
        self.batches = 0
        self.env_steps = 0
        self.discarded = 0
        self.version = -1
        self._closed = False
        self._ready = Future()
        self.thread = threading.Thread(target=self._main, name="rollout-worker", daemon=True)
        self.thread.start()
        self._ready.result()

    # -- thread plumbing -----------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            cfg = self.config
            set_torch_threads(cfg.runtime.torch_threads)
            dp = cfg.data_plane
            self.device = resolve_device(cfg.runtime.device)
            self.backend = build_backend(cfg.rollout.backend, cfg, self.env_spec, self.device)
            if self.expert is not None:
                if not hasattr(self.backend, "add_expert"):
                    raise ValueError(f"algorithm {cfg.algorithm.name!r} has an expert act in some steps, and "
                                     f"rollout.backend {cfg.rollout.backend!r} acts with the run's policy only. "
                                     f"Fix: rollout.backend: torch")
                self.backend.add_expert(self.expert)
                self.expert = None  # (the backend holds the built policy)
            target = cfg.scheduling.offload_target(self.device.type)
            # stages take turns on this pool: between its turns the policy leaves the device for the learner
            self.offload = ModelOffload(lambda: state_tensors(self.backend.policy), target,
                                        name=f"rollout{self.shard}") if target else None
            # an engine (vllm, sglang) frees its weights and KV cache between turns too, where it can
            self.sleeps = bool(target) and bool(getattr(self.backend, "frees_memory", False))
            if target and hasattr(self.backend, "sleep") and not self.sleeps:
                log.warning("rollout.backend %s cannot free its engine's memory on %s between turns (vLLM's sleep "
                            "mode needs CUDA): the engine keeps it; only the policy copy is offloaded",
                            cfg.rollout.backend, self.device.type)
            if self.start_iteration:  # a resumed run must not replay the episodes and samples of its start
                self.backend.generator.manual_seed(cfg.seed + 1 + 7919 * self.start_iteration)
            self.chunks = cfg.scheduling.chunks()
            if cfg.scheduling.env_in_rollout():  # stages share this worker: no hop per env step
                from rlfabric.services.env.local import LocalEnvChannel

                self.env = LocalEnvChannel(cfg)
            else:
                self.env = DataClient(self.peers["env"], max_bytes=dp.max_message_bytes, timeout_s=dp.timeout_s,
                                      hwm=dp.high_water_mark, peer="env", fence=self.fence)
            self.replay = DataClient(self.peers["replay"], max_bytes=dp.max_message_bytes,
                                     timeout_s=dp.timeout_s, hwm=dp.high_water_mark, peer="replay", fence=self.fence)
            self.weights = WeightSubscriber(self.peers["learner"], dp.max_message_bytes, dp.timeout_s,
                                            sync=cfg.weight_sync)
            self.collector = collector_class(cfg)(cfg, self.backend, self.env, self.shard_envs, self.chunks,
                                                  self.pool, self.env_offset)
            if cfg.collects:
                self.collector.reset(cfg.seed + 7919 * self.start_iteration + self.env_offset)
        except BaseException as exc:  # noqa: BLE001 — surfaced to Configure
            self._ready.set_exception(exc)
            return
        if self.offload is not None:
            self.offload.offload()
        if self.sleeps:
            self.backend.sleep()
        self._ready.set_result(True)
        while not self._closed:
            try:
                fn, args, fut = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            self._run_job(fn, args, fut)
        for sock in (self.env, self.replay):
            sock.close()
        self.weights.close()

    def _run_job(self, fn, args, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(progress.run_working(fn, *args))
        except BaseException as exc:  # noqa: BLE001 — delivered to the caller
            fut.set_exception(exc)

    def submit(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        self.jobs.put((fn, args, fut))
        return fut

    def health(self) -> str | None:
        """None while the acting thread runs (a ServiceRuntime.watch probe)."""
        return None if self._closed or self.thread.is_alive() else "the rollout worker thread died"

    def _run_queued(self) -> None:
        """Run jobs queued while a long job (produce) holds the thread, e.g. evaluations."""
        while True:
            try:
                fn, args, fut = self.jobs.get_nowait()
            except queue.Empty:
                return
            self._run_job(fn, args, fut)

    def close(self) -> None:
        self._closed = True
        if getattr(self, "offload", None) is not None:  # its file goes now: a stopping process may not wait for us
            self.offload.close()
        close = getattr(getattr(self, "backend", None), "close", None)
        if close is not None:  # an engine's own processes (vLLM) stop with the worker
            close()

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """This stage's turn: the policy is on its device for it (and leaves after it when it was offloaded), and
        an engine that sleeps between turns is awake."""
        with self.offload.onloaded() if self.offload is not None else nullcontext():
            if self.sleeps:
                self.backend.wake()
            try:
                yield
            finally:
                if self.sleeps:
                    self.backend.sleep()

    # -- weights -------------------------------------------------------------------------------------------
    def cold_start(self, run_dir: str, run_id: str) -> int:
        """Load the newest weights written to the object store (a worker that joins late or restarted),
        before asking the learner for anything newer. Returns the version loaded, or -1."""
        store = open_store(self.config.storage, run_dir, run_id)
        found = load_weights(store, self.config.data_plane.max_message_bytes)
        if found is None:
            return -1
        version, tensors = found
        if version > self.version:
            with self._turn():
                self.backend.load(version, tensors)
            self.version = version
        return version

    def sync_weights(self, min_version: int, timeout_s: float, stop: threading.Event | None = None,
                     batch_index: int | None = None) -> float:
        """Load the newest version; wait (bounded) until it is at least min_version. Returns seconds waited."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while True:
            wait = 0.0 if self.version >= min_version else min(0.25, max(0.0, deadline - time.monotonic()))
            version, tensors = self.weights.fetch(self.version, min_version if wait else 0, wait)
            if tensors is not None:
                self.backend.load(version, tensors)
                self.version = version
            if self.version >= min_version:
                return time.perf_counter() - t0
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped while waiting for weight version {min_version}")
            self._check_drain(batch_index)
            if time.monotonic() >= deadline:
                raise WeightsLate(f"weight version {min_version} was not published within {timeout_s:.1f}s "
                                   f"(newest: {version}); is the learner training?")
            self._run_queued()

    def _check_drain(self, batch_index: int | None) -> None:
        if batch_index is not None and self.drain_after is not None and batch_index > self.drain_after:
            raise Stopped(f"drained after batch {self.drain_after}; batch {batch_index} not started")

    # -- jobs ----------------------------------------------------------------------------------------------
    def collect(self, batch_index: int, min_version: int, stop: threading.Event | None = None,
                drainable: bool = False) -> CollectResult:
        with self._turn():
            waited = self.sync_weights(min_version, self.config.data_plane.timeout_s, stop,
                                       batch_index if drainable else None)
            if drainable:
                self._check_drain(batch_index)
            t0 = time.perf_counter()
            try:
                shard = self.collector.collect(batch_index, self.version, stop)
            except Stopped:
                self.discarded += 1
                raise
        batch = shard.batch
        n = batch.rows
        batch.meta = {"batch_index": batch_index, "env_steps": n, "shard": self.shard, "env_offset": self.env_offset}
        if self.interventions:  # what a human did, as its own replay source (human-gated imitation, HIL-SERL sampling)
            human = intervened_transitions(batch)
            if human is not None:
                self.replay.request("put", human)
        self.replay.request("put", batch)  # acknowledged: only now does the batch count
        self.batches += 1
        self.env_steps += n
        seconds = time.perf_counter() - t0
        return CollectResult(batch_index, n, self.version, shard.returns, shard.lengths,
                             collect_seconds=seconds, env_seconds=shard.env_seconds,
                             policy_seconds=shard.policy_seconds, weight_wait_seconds=waited, shard=self.shard,
                             shard_envs=self.shard_envs, stats=shard.stats)

    def produce(self, first: int, max_batches: int, staleness: int, emit: Callable[[CollectResult], None],
                stop: threading.Event) -> int:
        """Collect batch after batch; batch i uses a weight version >= i - staleness. A drain (``drain_after``)
        lets the batch in flight finish and be stored, then ends the stream: nothing is discarded."""
        i = first
        self.drain_after = None
        while not stop.is_set() and (max_batches <= 0 or i < first + max_batches):
            if self.drain_after is not None and i > self.drain_after:
                break
            self._run_queued()
            try:
                emit(self.collect(i, self.base_version + max(0, i - staleness), stop, drainable=True))
            except Stopped:
                break
            i += 1
        return i - first

    def probe(self, round_trips: int, stop: threading.Event | None = None) -> tuple[float, int, bool]:
        rtt, size = self.collector.probe(round_trips, stop)
        return rtt, size, self.config.scheduling.env_in_rollout()

    def evaluate(self, episodes: int, deterministic: bool, seed: int,
                 stop: threading.Event | None = None) -> Evaluation:
        """Play ``episodes`` evaluation episodes with the newest published weight version (what a checkpoint taken
        now would hold)."""
        with self._turn():
            try:
                self.sync_weights(0, self.config.data_plane.timeout_s)
            except PeerTimeout:
                if self.version < 0:
                    raise
                log.warning("learner unreachable; evaluating the weight version this worker holds (%d)",
                            self.version)
            return self.collector.evaluate(episodes, deterministic, seed, stop)
