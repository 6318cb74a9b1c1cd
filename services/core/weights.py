"""Weight-sync epochs on the data plane.

A weight version is an integer epoch. The learner's ``WeightPublisher`` holds the newest version and answers
``get {have, min_version, wait_s}``: the weights if it has something newer than ``have`` that is at least
``min_version``, otherwise it parks the request until such a version is published or ``wait_s`` passes, then
answers ``current {version}``. Rollout workers use ``WeightSubscriber``; because a request can wait for a
version, the rollout's staleness rule (batch i needs version >= i - k) is enforced exactly, not by polling.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.core.batch import TensorBatch
from services.core.codec import decode, encode, pack_frames, unpack_frames
from services.core.dataplane import DataClient, DataServer, Reply

WEIGHTS_KEY = "weights/latest"


@dataclass
class _Parked:
    deadline: float
    have: int
    min_version: int
    reply: Reply


class WeightPublisher:
    def __init__(self, host: str, max_bytes: int, advertise_host: str = ""):
        self.server = DataServer(host, max_bytes=max_bytes, name="weights", advertise_host=advertise_host)
        self.endpoint = self.server.endpoint
        self._lock = threading.Lock()
        self._version = -1
        self._tensors: dict[str, np.ndarray] = {}
        self._parked: list[_Parked] = []
        self.server.start(self._handle, self._tick)

    @property
    def version(self) -> int:
        return self._version

    def publish(self, version: int, state: dict[str, Any]) -> None:
        """Snapshot a state dict as ``version`` (copied, so training can keep mutating the live one)."""
        if version <= self._version:
            raise ValueError(f"weight version must increase: {version} <= {self._version}")
        self._set(version, state)

    def reset(self, version: int, state: dict[str, Any]) -> None:
        """Start a run's version sequence (a new run, or a resumed one at its checkpoint's version)."""
        self._set(version, state)

    def _set(self, version: int, state: dict[str, Any]) -> None:
        snapshot = {k: v.detach().to("cpu").clone().numpy() if hasattr(v, "detach") else np.array(v)
                    for k, v in state.items()}
        with self._lock:
            self._version, self._tensors = version, snapshot
        self.server.wake()

    def _answer(self, have: int, min_version: int, reply: Reply) -> bool:
        with self._lock:
            version, tensors = self._version, self._tensors
        if version > have and version >= min_version:
            reply.send("weights", TensorBatch(dict(tensors), version=version))
            return True
        return False

    def _handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        if kind != "get":
            raise ValueError(f"unknown request kind {kind!r}; expected 'get'")
        have, min_version = int(batch.meta.get("have", -1)), int(batch.meta.get("min_version", 0))
        wait_s = float(batch.meta.get("wait_s", 0.0))
        if self._answer(have, min_version, reply):
            return
        if wait_s <= 0:
            reply.send("current", TensorBatch(version=self._version))
            return
        self._parked.append(_Parked(time.monotonic() + wait_s, have, min_version, reply))

    def _tick(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        keep = []
        for p in self._parked:
            if self._answer(p.have, p.min_version, p.reply):
                continue
            if now >= p.deadline:
                p.reply.send("current", TensorBatch(version=self._version))
            else:
                keep.append(p)
        self._parked = keep

    def close(self) -> None:
        self.server.stop()


class WeightSubscriber:
    """Client side: fetches versions from a WeightPublisher. One per thread."""

    def __init__(self, endpoint: str, max_bytes: int, timeout_s: float):
        self.client = DataClient(endpoint, max_bytes=max_bytes, timeout_s=timeout_s, peer="learner")
        self.timeout_s = timeout_s

    def fetch(self, have: int, min_version: int = 0, wait_s: float = 0.0) -> tuple[int, dict[str, np.ndarray] | None]:
        """(version, tensors) if a newer version >= min_version arrived within wait_s, else (latest, None)."""
        kind, batch = self.client.request(
            "get", TensorBatch(meta={"have": have, "min_version": min_version, "wait_s": wait_s}),
            timeout_s=wait_s + self.timeout_s)
        if kind == "weights":
            return batch.version, batch.tensors
        return batch.version, None

    def close(self) -> None:
        self.client.close()


def save_weights(store, version: int, state: dict[str, Any], key: str = WEIGHTS_KEY) -> str:
    """Write a weight version to the object store for cold starts (a rollout worker that joins late, a
    restarted one): the data-plane frames in a length-prefixed container, no pickle."""
    return store.put_bytes(key, pack_frames(encode("weights", TensorBatch(dict(state), version=version))))


def load_weights(store, max_bytes: int, key: str = WEIGHTS_KEY) -> tuple[int, dict[str, np.ndarray]] | None:
    """The stored version and tensors, or None if none was written yet."""
    if not store.exists(key):
        return None
    frames = unpack_frames(store.get_bytes(key), key)
    kind, batch = decode(frames, max_bytes)
    return batch.version, {k: v.clone() if hasattr(v, "clone") else np.array(v) for k, v in batch.tensors.items()}
