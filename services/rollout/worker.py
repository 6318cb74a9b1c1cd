"""RolloutWorker: the acting loop, on its own thread with its own sockets (env, replay, learner weights).

Collecting pipelines env chunks: actions for chunk c are sent to the env service, and while it simulates them
the policy acts on the next chunk's fresh observations. With one chunk this is the plain act/step loop.
Jobs (collect, produce, evaluate) run one at a time; a long ``produce`` runs queued evaluations between batches.
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

import numpy as np

from services.core.batch import TensorBatch
from services.core.config import RunConfig
from services.core.dataplane import DataClient, PeerTimeout
from services.core.objectstore import open_store
from services.core.offload import ModelOffload, state_tensors
from services.core.runtime import set_torch_threads
from services.core.weights import WeightSubscriber, load_weights
from services.rollout.backends.torch import TorchBackend

log = logging.getLogger(__name__)


class Stopped(Exception):
    """A job was stopped before it finished; its partial data was discarded."""


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


class RolloutWorker:
    def __init__(self, config: RunConfig, env_spec: dict, peers: dict[str, str], base_version: int = 0,
                 start_iteration: int = 0, shard: int = 0, shard_envs: int | None = None, env_offset: int = 0):
        self.config = config
        # this worker's shard of the env batch: envs [env_offset, env_offset + shard_envs) of the run, seeded by
        # their global index so a run splits the same envs whatever its number of workers
        self.shard = shard
        self.shard_envs = shard_envs or config.env.num_envs
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
            self.backend = TorchBackend(cfg, self.env_spec)
            target = cfg.scheduling.offload_target(cfg.runtime.device)
            # stages take turns on this pool: between its turns the policy leaves the device for the learner
            self.offload = ModelOffload(lambda: state_tensors(self.backend.policy), target,
                                        name=f"rollout{self.shard}") if target else None
            if self.start_iteration:  # a resumed run must not replay the episodes and samples of its start
                self.backend.generator.manual_seed(cfg.seed + 1 + 7919 * self.start_iteration)
            if cfg.scheduling.env_in_rollout():  # stages share this worker: no hop per env step
                from services.env.local import LocalEnvChannel

                self.env = LocalEnvChannel(cfg)
            else:
                self.env = DataClient(self.peers["env"], max_bytes=dp.max_message_bytes, timeout_s=dp.timeout_s,
                                      hwm=dp.high_water_mark, peer="env")
            self.replay = DataClient(self.peers["replay"], max_bytes=dp.max_message_bytes,
                                     timeout_s=dp.timeout_s, hwm=dp.high_water_mark, peer="replay")
            self.weights = WeightSubscriber(self.peers["learner"], dp.max_message_bytes, dp.timeout_s,
                                            sync=cfg.weight_sync)
            self.chunks = cfg.scheduling.chunks()
            self.chunk_size = self.shard_envs // self.chunks
            self.obs = self._reset(self.pool, cfg.seed + 7919 * self.start_iteration + self.env_offset,
                                   self.shard_envs)
        except BaseException as exc:  # noqa: BLE001 — surfaced to Configure
            self._ready.set_exception(exc)
            return
        if self.offload is not None:
            self.offload.offload()
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
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 — delivered to the caller
            fut.set_exception(exc)

    def submit(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        self.jobs.put((fn, args, fut))
        return fut

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

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """This stage's turn: the policy is on its device for it (and leaves after it when it was offloaded)."""
        with self.offload.onloaded() if self.offload is not None else nullcontext():
            yield

    # -- acting --------------------------------------------------------------------------------------------
    def _reset(self, pool: str, seed: int, num_envs: int | None = None) -> np.ndarray:
        meta = {"pool": pool, "seed": seed} | ({"num_envs": num_envs, "chunks": self.chunks} if num_envs else {})
        _, reply = self.env.request("reset", TensorBatch(meta=meta))
        return np.array(reply["obs"])

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
                raise TimeoutError(f"weight version {min_version} was not published within {timeout_s:.1f}s "
                                   f"(newest: {version}); is the learner training?")
            self._run_queued()

    def _check_drain(self, batch_index: int | None) -> None:
        if batch_index is not None and self.drain_after is not None and batch_index > self.drain_after:
            raise Stopped(f"drained after batch {self.drain_after}; batch {batch_index} not started")

    def collect(self, batch_index: int, min_version: int, stop: threading.Event | None = None,
                drainable: bool = False) -> CollectResult:
        with self._turn():
            return self._collect(batch_index, min_version, stop, drainable)

    def _collect(self, batch_index: int, min_version: int, stop: threading.Event | None,
                 drainable: bool) -> CollectResult:
        cfg = self.config
        waited = self.sync_weights(min_version, cfg.data_plane.timeout_s, stop, batch_index if drainable else None)
        if drainable:
            self._check_drain(batch_index)
        t_start = time.perf_counter()
        T, N, C, S = cfg.algorithm.n_steps, self.shard_envs, self.chunks, self.chunk_size
        gamma = cfg.algorithm.ppo.gamma
        obs_buf = np.zeros((T, N, *self.obs.shape[1:]), dtype=np.float32)
        act_shape = tuple(self.env_spec["action_space"]["shape"])
        discrete = self.env_spec["action_space"]["kind"] == "discrete"
        act_buf = np.zeros((T, N, *act_shape), dtype=np.int64 if discrete else np.float32)
        logp_buf = np.zeros((T, N), dtype=np.float32)
        val_buf = np.zeros((T, N), dtype=np.float32)
        rew_buf = np.zeros((T, N), dtype=np.float32)
        done_buf = np.zeros((T, N), dtype=np.float32)
        result = CollectResult(batch_index, T * N, self.version, shard=self.shard, shard_envs=N)
        policy_s = env_s = 0.0
        off_policy = cfg.algorithm.family == "off-policy"
        if off_policy:  # transitions for a replay window: where each step led, and whether it ended the episode
            next_buf = np.zeros_like(obs_buf)
            term_buf = np.zeros((T, N), dtype=np.float32)
        # off-policy warm-up: uniform actions until the run has collected learning_starts env steps
        explore = off_policy and batch_index * cfg.batch_env_steps() < cfg.algorithm.sac.learning_starts

        def act(c: int, t: int) -> int:
            nonlocal policy_s
            sl = slice(c * S, (c + 1) * S)
            p0 = time.perf_counter()
            if explore:
                raw, env_actions = self.backend.random_actions(S)
                logp, values = np.zeros(S, np.float32), np.zeros(S, np.float32)
            else:
                raw, env_actions, logp, values = self.backend.act(self.obs[sl])
            policy_s += time.perf_counter() - p0
            obs_buf[t, sl], act_buf[t, sl], logp_buf[t, sl], val_buf[t, sl] = self.obs[sl], raw, logp, values
            return self.env.send("step", TensorBatch({"actions": env_actions}, meta={"pool": self.pool, "chunk": c}))

        pending = [act(c, 0) for c in range(C)]
        for t in range(T):
            for c in range(C):
                if stop is not None and stop.is_set():
                    self.discarded += 1
                    log.warning("discarding in-flight batch %d at step %d/%d on stop", batch_index, t, T)
                    raise Stopped(f"batch {batch_index} discarded at step {t}/{T}")
                e0 = time.perf_counter()
                _, out = self.env.recv(pending[c])
                env_s += time.perf_counter() - e0
                sl = slice(c * S, (c + 1) * S)
                reward = np.array(out["reward"], dtype=np.float32)
                terminated, truncated = np.asarray(out["terminated"]), np.asarray(out["truncated"])
                bootstrap = np.logical_and(truncated, np.logical_not(terminated))
                if off_policy:  # the critic bootstraps from next_obs itself unless the episode terminated
                    nxt = np.array(out["obs"], dtype=np.float32)
                    done_now = np.logical_or(terminated, truncated)
                    if done_now.any():  # autoreset replaced them: where the episode really ended
                        nxt[done_now] = np.asarray(out["final_obs"])[done_now]
                    next_buf[t, sl], term_buf[t, sl] = nxt, terminated
                elif bootstrap.any():  # a time limit is not a failure: add the value of where the episode stopped
                    idx = np.flatnonzero(bootstrap)
                    reward[idx] += gamma * self.backend.value(np.asarray(out["final_obs"])[idx])
                rew_buf[t, sl] = reward
                done = np.logical_or(terminated, truncated)
                done_buf[t, sl] = done
                for i in np.flatnonzero(done):
                    result.returns.append(float(out["episode_return"][i]))
                    result.lengths.append(int(out["episode_length"][i]))
                self.obs[sl] = out["obs"]
                if t + 1 < T:
                    pending[c] = act(c, t + 1)
        if off_policy:
            tensors = {"obs": obs_buf, "actions": act_buf, "rewards": rew_buf, "next_obs": next_buf,
                       "terminated": term_buf}
        else:
            tensors = {"obs": obs_buf, "actions": act_buf, "logp": logp_buf, "values": val_buf, "rewards": rew_buf,
                       "dones": done_buf, "last_values": self.backend.value(self.obs).astype(np.float32)}
        batch = TensorBatch(
            tensors,
            meta={"batch_index": batch_index, "env_steps": T * N, "shard": self.shard, "env_offset": self.env_offset},
            version=self.version,
        )
        self.replay.request("put", batch)  # acknowledged: only now does the batch count
        self.batches += 1
        self.env_steps += T * N
        result.collect_seconds = time.perf_counter() - t_start
        result.env_seconds, result.policy_seconds, result.weight_wait_seconds = env_s, policy_s, waited
        return result

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

    def probe(self, round_trips: int) -> tuple[float, int, bool]:
        """Median round trip of a message as large as one chunk's step (its observations) to the env and back."""
        payload = {"obs": np.ascontiguousarray(self.obs[:self.chunk_size])}
        times = []
        for _ in range(max(1, round_trips)):
            t0 = time.perf_counter()
            self.env.request("echo", TensorBatch(payload))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)), int(payload["obs"].nbytes), self.config.scheduling.env_in_rollout()

    def evaluate(self, episodes: int, deterministic: bool, seed: int) -> list[float]:
        """Play ``episodes`` episodes on the eval pool, spread evenly over its envs (no short-episode bias),
        with the newest published weight version (what a checkpoint taken now would hold)."""
        with self._turn():
            return self._evaluate(episodes, deterministic, seed)

    def _evaluate(self, episodes: int, deterministic: bool, seed: int) -> list[float]:
        try:
            self.sync_weights(0, self.config.data_plane.timeout_s)
        except PeerTimeout:
            if self.version < 0:
                raise
            log.warning("learner unreachable; evaluating the weight version this worker holds (%d)", self.version)
        E = self.config.env.eval_envs
        quota = np.full(E, episodes // E) + (np.arange(E) < episodes % E)
        got: list[list[float]] = [[] for _ in range(E)]
        obs = self._reset("eval", seed)
        while any(len(g) < q for g, q in zip(got, quota, strict=True)):
            _, env_actions, _, _ = self.backend.act(obs, deterministic)
            _, out = self.env.request("step", TensorBatch({"actions": env_actions}, meta={"pool": "eval", "chunk": 0}))
            obs = np.array(out["obs"])
            done = np.logical_or(out["terminated"], out["truncated"])
            for i in np.flatnonzero(done):
                if len(got[i]) < quota[i]:
                    got[i].append(float(out["episode_return"][i]))
        return [r for g in got for r in g]
