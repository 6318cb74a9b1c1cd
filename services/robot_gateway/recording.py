"""Episode recording: every control tick of a robot, kept per episode, written where learners and tools read it.

The control loop must keep its deadlines whatever the storage does, so the loop thread only hands each ``Tick`` to
a bounded queue (``offer``: never blocks); a recorder thread builds the episode's columns and, once a verdict ends
it, writes it. A tick the queue cannot take is dropped and counted (``rlfabric_robot_recording_dropped_ticks_total``
and the episode's ``dropped_ticks``), never lost silently. Episodes are told apart by the episode number each tick
carries, so a verdict and the ticks around it need no common ordering: episode e is complete once a tick of a later
episode arrives (or the recorder stops).

A kept episode (SUCCESS, FAILURE, TERMINATE) goes to the object store as two objects under
``recordings/<dataset>/<robot>/<session>/``: ``episode_<n>.npz`` (one row per tick, numbers and booleans only, read
back with ``allow_pickle=False``; a file ``replay.datasets`` accepts as it is) and then ``episode_<n>.json`` (what the
episode was: robot, joints, rate, task, verdict, counts). The JSON is written last, so a listing of ``.json`` keys
finds only complete episodes. With a replay endpoint the episode also goes to a named replay source as one
("time",) batch, and optionally its intervened ticks alone to a second source (human-gated imitation's corrections).
A RERECORD episode is discarded. An episode to keep that no sink took counts as failed, not kept (the status's
``episodes_failed``, ``last_error`` and the ``fate="failed"`` metric), and a recorder thread that dies fails the
gateway's health check.

A recording's memory is bounded: ``queue_ticks`` queued ticks and an episode of ``max_episode_ticks`` rows (its
columns, their final copy and the encoded file) must fit ``MEMORY_CAP`` per robot (``check_memory``).
"""

from __future__ import annotations

import io
import json
import logging
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Counter

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.objectstore import ObjectStore
from rlfabric.services.robot_gateway.loop import Tick
from rlfabric.services.robot_gateway.series import robot_series

log = logging.getLogger(__name__)
FORMAT = "rlfabric.robot_episode/1"
KEPT = ("success", "failure", "terminate")
QUEUE_TICKS = 4096
MEMORY_CAP = 256 << 20  # bytes a robot's recording may hold: its queue and its episode under way
QUEUED_TICK_BYTES = 1280  # a Tick waiting in the queue: its arrays and strings as Python objects (measured ~930)
EPISODE_COPIES = 3  # the columns, their final cut copy, and the encoded npz, at once while an episode is written
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DROPPED = Counter("rlfabric_robot_recording_dropped_ticks_total", "ticks the recorder could not keep: its queue was "
                  "full (the sink is too slow) or the episode passed max_episode_ticks", ["robot", "reason"])
RECORDED = Counter("rlfabric_robot_recording_ticks_total", "ticks recorded into episodes", ["robot"])
EPISODES = Counter("rlfabric_robot_recorded_episodes_total", "recorded episodes, by what became of them",
                   ["robot", "fate"])
WRITE_ERRORS = Counter("rlfabric_robot_recording_write_errors_total", "episodes an object store or replay refused",
                       ["robot", "sink"])


class RecordingError(ValueError):
    """A recording request that cannot be served; the message names the field and the fix."""


def check_name(field_name: str, value: str, required: bool = True) -> str:
    if (value or required) and not NAME.match(value):
        raise RecordingError(f"{field_name}={value[:80]!r}: give 1-64 letters, digits, '_' or '-'")
    return value


def row_bytes(joints: int) -> int:
    """Bytes one tick takes in an episode's columns (``_Columns``)."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
               for shape, dtype in _Columns.shapes(joints).values())


def episode_tick_cap(joints: int, queue_ticks: int = QUEUE_TICKS) -> int:
    """The most ticks an episode may keep for its recording to fit MEMORY_CAP beside a queue of ``queue_ticks``."""
    return max(0, (MEMORY_CAP - queue_ticks * QUEUED_TICK_BYTES) // (EPISODE_COPIES * row_bytes(joints)))


def check_memory(joints: int, queue_ticks: int, max_episode_ticks: int, hz: float) -> None:
    """Refuse a recording whose queue and longest episode would not fit MEMORY_CAP (0s: the defaults)."""
    queue_ticks = queue_ticks or QUEUE_TICKS
    need = queue_ticks * QUEUED_TICK_BYTES + EPISODE_COPIES * row_bytes(joints) * (max_episode_ticks or 1)
    if need > MEMORY_CAP:
        raise RecordingError(f"queue_ticks={queue_ticks} and max_episode_ticks={max_episode_ticks} need "
                             f"{need / 2**20:.0f} MiB, past the recording memory cap of {MEMORY_CAP >> 20} MiB per "
                             f"robot ({QUEUED_TICK_BYTES} bytes a queued tick, {EPISODE_COPIES} x "
                             f"{row_bytes(joints)} bytes an episode tick of {joints} joints). Fix: at most "
                             f"{episode_tick_cap(joints, queue_ticks)} episode ticks with this queue "
                             f"({episode_tick_cap(joints, queue_ticks) / hz / 60:.0f} minutes at {hz:g} Hz), or 0 "
                             f"for the default")


def session_name() -> str:
    """A folder per recording, so a restarted gateway (episode numbers from 0 again) never overwrites one."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass
class Episode:
    """One finished episode: its per-tick columns and what it was."""

    index: int
    outcome: str
    columns: dict[str, np.ndarray]
    meta: dict

    @property
    def ticks(self) -> int:
        return len(self.columns["tick"])


class _Columns:
    """Per-tick columns grown by doubling, so a long episode costs its arrays, not a Python object per tick."""

    def __init__(self, joints: int, capacity: int = 256, limit: int = 1 << 62):
        self.n, self.joints, self.limit = 0, joints, limit
        self.capped = 0  # ticks past max_episode_ticks, not kept
        self.cols: dict[str, np.ndarray] = {}
        self._alloc(min(capacity, limit))

    @staticmethod
    def shapes(j: int) -> dict[str, tuple[tuple[int, ...], type]]:
        return {"obs/position": ((j,), np.float32), "obs/velocity": ((j,), np.float32),
                "obs/end_effector": ((3,), np.float32), "actions": ((j,), np.float32),
                "intervened": ((), np.bool_), "holding": ((), np.bool_), "estopped": ((), np.bool_),
                "fault": ((), np.bool_), "clipped": ((), np.bool_), "slowed": ((), np.bool_),
                "command_seq": ((), np.int64), "tick": ((), np.int64), "time": ((), np.float64),
                "lateness_s": ((), np.float32)}

    def _alloc(self, capacity: int) -> None:
        grown = {name: np.zeros((capacity, *shape), dtype) for name, (shape, dtype) in self.shapes(self.joints).items()}
        for name, old in self.cols.items():
            grown[name][:self.n] = old[:self.n]
        self.cols = grown

    def append(self, t: Tick) -> None:
        if self.n == len(self.cols["tick"]):
            self._alloc(min(2 * self.n, self.limit))  # never past the episode's cap: the memory bound counts on it
        c, i = self.cols, self.n
        c["obs/position"][i], c["obs/velocity"][i], c["obs/end_effector"][i] = t.position, t.velocity, t.end_effector
        c["actions"][i] = t.target
        c["intervened"][i], c["holding"][i], c["estopped"][i] = t.intervening, t.holding, t.estopped
        c["fault"][i], c["clipped"][i], c["slowed"][i] = bool(t.fault), t.clipped, t.slowed
        c["command_seq"][i], c["tick"][i], c["time"][i], c["lateness_s"][i] = t.command_seq, t.tick, t.time, \
            t.lateness_s
        self.n += 1

    def finish(self, outcome: str, episode: int) -> dict[str, np.ndarray]:
        """The columns cut to length, plus what a learner reads off the verdict: a reward of 1 on a success's last
        tick, ``terminated`` on the last tick of a success or failure, ``truncated`` on a TERMINATE's."""
        out = {name: a[:self.n].copy() for name, a in self.cols.items()}
        last = np.zeros(self.n, bool)
        last[-1:] = True
        out["rewards"] = (last & (outcome == "success")).astype(np.float32)
        out["terminated"] = last & (outcome in ("success", "failure"))
        out["truncated"] = last & (outcome == "terminate")
        out["episode"] = np.full(self.n, episode, np.int64)
        return out


def encode_npz(columns: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **columns)
    return buf.getvalue()


def decode_npz(data: bytes) -> dict[str, np.ndarray]:
    """An episode's arrays; pickled (object) arrays are refused, never loaded."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


class ObjectStoreSink:
    """Episodes to ``recordings/<dataset>/<robot>/<session>/episode_<n>.{npz,json}`` (the JSON last: the commit)."""

    name = "object_store"

    def __init__(self, store: ObjectStore, prefix: str):
        self.store, self.prefix = store, prefix.rstrip("/")

    def write(self, episode: Episode) -> str:
        key = f"{self.prefix}/episode_{episode.index:06d}"
        uri = self.store.put_bytes(key + ".npz", encode_npz(episode.columns))
        self.store.put_bytes(key + ".json", json.dumps({**episode.meta, "npz": uri}, indent=1).encode())
        return uri


class ReplaySink:
    """Episodes to a named replay source over the data plane: one ("time",) batch per episode, version 0 (no
    policy version made these actions); optionally the intervened ticks alone, as ("sample",) rows, to a second
    source. The client lives in the recorder thread (data-plane clients are one per thread)."""

    name = "replay"

    def __init__(self, endpoint: str, source: str, intervention_source: str = "", *, max_bytes: int = 256 << 20,
                 timeout_s: float = 10.0):
        self.endpoint, self.source, self.intervention_source = endpoint, source, intervention_source
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._client = None
        self.pushes = 0

    def write(self, episode: Episode) -> str:
        from rlfabric.services.core.dataplane import DataClient

        if self._client is None:
            self._client = DataClient(self.endpoint, max_bytes=self.max_bytes, timeout_s=self.timeout_s,
                                      peer="replay")
        meta = {"robot": episode.meta["robot_id"], "episode": episode.index, "outcome": episode.outcome}
        self._client.request("put", TensorBatch(dict(episode.columns), dims=("time",), version=0,
                                                meta={**meta, "source": self.source}))
        self.pushes += 1
        mask = episode.columns["intervened"]
        if self.intervention_source and mask.any():
            rows = {k: v[mask] for k, v in episode.columns.items()}
            self._client.request("put", TensorBatch(rows, dims=("sample",), version=0,
                                                    meta={**meta, "source": self.intervention_source}))
            self.pushes += 1
        return f"replay:{self.source}@{self.endpoint}"

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


@dataclass
class RecorderStats:
    episodes_kept: int = 0
    episodes_discarded: int = 0
    episodes_failed: int = 0  # to keep, but no sink took them
    ticks_recorded: int = 0
    queue_dropped: int = 0  # written by the loop thread only
    cap_dropped: int = 0  # written by the recorder thread only
    write_errors: int = 0
    last_episode_uri: str = ""
    last_error: str = ""
    dropped_by_episode: dict[int, int] = field(default_factory=dict)  # queue drops (loop thread)

    @property
    def ticks_dropped(self) -> int:
        return self.queue_dropped + self.cap_dropped


_STOP = object()


class Recorder:
    """Records one robot's ticks into episodes and hands finished ones to its sinks, on its own thread."""

    def __init__(self, robot_id: str, joint_names: list[str], hz: float, sinks: list, *, dataset: str = "",
                 session: str = "", task: str = "", queue_ticks: int = 0, max_episode_ticks: int = 0,
                 on_episode: Callable[[Episode, str], None] | None = None):
        self.robot_id, self.joint_names, self.hz = robot_id, list(joint_names), hz
        self.sinks, self.dataset, self.session, self.task = sinks, dataset, session, task
        self.max_episode_ticks = max_episode_ticks or max(1, min(int(3600 * hz), episode_tick_cap(
            len(self.joint_names), queue_ticks or QUEUE_TICKS)))
        self.queue: queue.Queue = queue.Queue(maxsize=queue_ticks or QUEUE_TICKS)
        self.stats = RecorderStats()
        self.on_episode = on_episode  # (episode, fate) after it was written or discarded: for tests and tools
        self._verdicts: dict[int, str] = {}
        self._lock = threading.Lock()
        self._first_episode: int | None = None
        self._stopping = False
        self.error: BaseException | None = None  # why the recorder thread died (the gateway's health says so)
        self._dropped_metric = robot_series(DROPPED, robot_id, "queue_full")
        self.thread = threading.Thread(target=self._run, name=f"recorder-{robot_id}", daemon=True)

    # -- the loop thread: never blocks ---------------------------------------------------------------------------
    def offer(self, tick: Tick) -> None:
        """A ``ControlLoop`` listener: hand the tick over, or count it dropped (the queue is full)."""
        try:
            self.queue.put_nowait(tick)
        except queue.Full:
            self.stats.queue_dropped += 1
            by_episode = self.stats.dropped_by_episode
            by_episode[tick.episode] = by_episode.get(tick.episode, 0) + 1
            self._dropped_metric.inc()

    # -- the gRPC thread ----------------------------------------------------------------------------------------
    def episode_ended(self, episode: int, outcome: str) -> None:
        """A verdict for ``episode`` (the loop's number before it ended it)."""
        with self._lock:
            self._verdicts[episode] = outcome

    def start(self) -> Recorder:
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Write what has a verdict, drop the episode under way, and end the thread (blocking: run off the event
        loop). The loop's listener must be removed first, so nothing is offered after the stop marker."""
        self._stopping = True
        while True:  # the marker must get in even if the queue is full: the thread is draining it
            try:
                self.queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if not self.thread.is_alive():
                    break
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.error("recorder did not finish within %.0f s", timeout_s, extra={"robot": self.robot_id})

    @property
    def recording(self) -> bool:
        return self.thread.is_alive() and not self._stopping

    # -- the recorder thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        current: tuple[int, _Columns] | None = None
        reported_drops, last_report = 0, 0.0
        try:
            while True:
                try:
                    item = self.queue.get(timeout=0.25)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if item is not None:
                    if current is None or item.episode != current[0]:
                        if current is not None:
                            self._close(*current)
                        self._skipped_verdicts(item.episode)
                        current = (item.episode, _Columns(len(self.joint_names), limit=self.max_episode_ticks))
                        if self._first_episode is None:
                            self._first_episode = item.episode
                    if current[1].n < self.max_episode_ticks:
                        current[1].append(item)
                        self.stats.ticks_recorded += 1
                        robot_series(RECORDED, self.robot_id).inc()
                    else:
                        current[1].capped += 1
                        self.stats.cap_dropped += 1
                        robot_series(DROPPED, self.robot_id, "episode_cap").inc()
                elif current is not None and self._verdict(current[0], pop=False) is not None:
                    # a verdict and no later tick for a while: the loop stopped; the episode is complete
                    self._close(*current)
                    current = None
                now = time.monotonic()
                if self.stats.ticks_dropped > reported_drops and now - last_report > 1.0:
                    log.warning("recorder fell behind: ticks dropped (its queue of %d was full)", self.queue.maxsize,
                                extra={"robot": self.robot_id, "dropped_total": self.stats.ticks_dropped})
                    reported_drops, last_report = self.stats.ticks_dropped, now
            if current is not None:  # kept if its verdict came; else the episode under way is not kept
                self._close(*current)
        except BaseException as exc:  # noqa: BLE001 — a dead recorder must say so; the loop keeps running regardless
            log.exception("recorder died", extra={"robot": self.robot_id})
            self.stats.last_error = f"the recorder thread died: {exc!r} (see the gateway log)"[:2000]
            self.error = exc
        finally:
            for sink in self.sinks:
                if hasattr(sink, "close"):
                    sink.close()

    def _verdict(self, episode: int, pop: bool = True) -> str | None:
        with self._lock:
            return self._verdicts.pop(episode, None) if pop else self._verdicts.get(episode)

    def _skipped_verdicts(self, before: int) -> None:
        """Verdicts for episodes none of whose ticks reached the recorder: nothing to write, said in the log."""
        with self._lock:
            skipped = sorted(e for e in self._verdicts if e < before)
            for e in skipped:
                self._verdicts.pop(e)
        for e in skipped:
            log.warning("episode ended with no recorded ticks", extra={"robot": self.robot_id, "episode": e})

    def _close(self, episode: int, cols: _Columns) -> None:
        outcome = self._verdict(episode)
        dropped = self.stats.dropped_by_episode.pop(episode, 0) + cols.capped
        if outcome is None or outcome not in KEPT:
            fate = "discarded" if outcome == "rerecord" else "unfinished"
            self.stats.episodes_discarded += int(outcome == "rerecord")
            robot_series(EPISODES, self.robot_id, fate).inc()
            log.info(f"episode {fate}", extra={"robot": self.robot_id, "episode": episode, "ticks": cols.n})
            if self.on_episode:
                self.on_episode(Episode(episode, outcome or "", {}, {}), fate)
            return
        columns = cols.finish(outcome, episode)
        meta = {"format": FORMAT, "robot_id": self.robot_id, "joint_names": self.joint_names, "control_hz": self.hz,
                "dataset": self.dataset, "session": self.session, "task": self.task, "episode": episode,
                "outcome": outcome, "ticks": cols.n, "intervened_ticks": int(columns["intervened"].sum()),
                "dropped_ticks": dropped, "partial_start": episode == self._first_episode,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "fields": {k: [str(v.dtype), list(v.shape[1:])] for k, v in columns.items()}}
        ep = Episode(episode, outcome, columns, meta)
        if dropped:
            log.warning("episode kept with dropped ticks (the recorder fell behind)",
                        extra={"robot": self.robot_id, "episode": episode, "dropped": dropped})
        written = 0
        for sink in self.sinks:
            try:
                uri = sink.write(ep)
                written += 1
                if sink.name == "object_store":
                    self.stats.last_episode_uri = uri
            except Exception as exc:  # noqa: BLE001 — one sink failing must not stop the others or the recorder
                self.stats.write_errors += 1
                self.stats.last_error = f"{sink.name}: {exc.__class__.__name__}: {exc}"[:2000]
                robot_series(WRITE_ERRORS, self.robot_id, sink.name).inc()
                log.error("could not write a recorded episode", extra={"robot": self.robot_id, "episode": episode,
                                                                       "sink": sink.name, "error": str(exc)[:500]})
        if not written:  # no sink has it: lost, and said so (never counted kept)
            self.stats.episodes_failed += 1
            robot_series(EPISODES, self.robot_id, "failed").inc()
            log.error("a recorded episode was lost: every sink refused it", extra={
                "robot": self.robot_id, "episode": episode, "outcome": outcome, "last_error": self.stats.last_error})
            if self.on_episode:
                self.on_episode(ep, "failed")
            return
        self.stats.episodes_kept += 1
        robot_series(EPISODES, self.robot_id, "kept").inc()
        log.info("episode recorded", extra={"robot": self.robot_id, "episode": episode, "outcome": outcome,
                                            "ticks": cols.n, "intervened": meta["intervened_ticks"]})
        if self.on_episode:
            self.on_episode(ep, "kept")


def read_episodes(store: ObjectStore, prefix: str = "recordings/") -> list[tuple[dict, dict[str, np.ndarray]]]:
    """Every complete episode under ``prefix`` (those whose JSON was written), in key order: (meta, columns)."""
    out = []
    for key in store.list(prefix):
        if not key.endswith(".json"):
            continue
        meta = json.loads(store.get_bytes(key))
        if meta.get("format") != FORMAT:
            continue
        out.append((meta, decode_npz(store.get_bytes(key[:-len(".json")] + ".npz"))))
    return out


__all__ = ["MEMORY_CAP", "Episode", "ObjectStoreSink", "Recorder", "RecordingError", "ReplaySink", "check_memory",
           "check_name", "decode_npz", "episode_tick_cap", "read_episodes", "row_bytes", "session_name"]
