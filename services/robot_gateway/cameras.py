"""Camera frames on the data plane: images are too big and too frequent for the control plane, so each robot with
a camera (``ConnectRequest.camera_size``) gets a ``CameraFeed`` thread that captures at its own rate, away from the
control loop, and one ``FrameServer`` per gateway answers ``frame`` requests on the ZeroMQ data plane (CURVE with
the deployment's token, bounded messages, typed header plus raw pixels) with the newest frame of a robot.

    request  'frame'  meta {robot_id}
    answer   'frame'  {image: uint8 [S, S, 3]}  meta {robot_id, frame (its index), time (capture, monotonic s),
                                                      tick (the control tick current at capture)}

A capture that fails stops its feed and fails the gateway's health check: a camera never goes stale silently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.dataplane import DataServer, Reply

log = logging.getLogger(__name__)
FRAME_BYTES = 4 << 20  # a request is tiny; an answer is one frame (256 x 256 x 3 at most)


class CameraFeed:
    """Captures one robot's frames at ``hz`` in a thread of its own and keeps the newest."""

    def __init__(self, robot_id: str, capture: Callable[[], np.ndarray], hz: float, tick: Callable[[], int],
                 size: int = 0):
        self.robot_id, self.capture, self.period, self.tick, self.size = robot_id, capture, 1.0 / hz, tick, size
        self.lock = threading.Lock()
        self.frame: np.ndarray | None = None
        self.index, self.time, self.frame_tick = -1, 0.0, -1
        self.error: str | None = None
        self.first = threading.Event()
        self.stopped = threading.Event()
        self.on_frame: Callable[[np.ndarray, int, float, int], None] | None = None  # each frame, as captured
        self.on_error: Callable[[str], None] | None = None  # the capture failed (the feed has stopped)
        self.thread = threading.Thread(target=self._run, name=f"camera-{robot_id}", daemon=True)

    def start(self, timeout_s: float = 20.0) -> None:
        """Start capturing; returns once the first frame is there (or raises why there is none)."""
        self.thread.start()
        if not self.first.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"robot {self.robot_id}: the camera gave no frame in {timeout_s:.0f} s")
        if self.error is not None:
            raise RuntimeError(self.error)

    def _run(self) -> None:
        deadline = time.monotonic()
        try:
            while not self.stopped.is_set():
                tick = self.tick()
                image = np.ascontiguousarray(self.capture(), dtype=np.uint8)
                with self.lock:
                    self.frame, self.index, self.time, self.frame_tick = image, self.index + 1, time.monotonic(), tick
                if self.on_frame is not None:
                    self.on_frame(image, self.index, self.time, tick)
                self.first.set()
                deadline += self.period  # absolute deadlines: the rate holds whatever a capture costs
                self.stopped.wait(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 — reported by health() and to every request, never swallowed
            self.error = f"robot {self.robot_id}: the camera failed: {type(exc).__name__}: {exc}"
            log.error("%s", self.error)
            if self.on_error is not None:
                self.on_error(self.error)
        finally:
            self.first.set()

    def newest(self) -> tuple[np.ndarray, int, float, int]:
        if self.error is not None:
            raise ValueError(self.error)
        with self.lock:
            if self.frame is None:
                raise ValueError(f"robot {self.robot_id}: no frame captured yet; ask again")
            return self.frame, self.index, self.time, self.frame_tick

    def health(self) -> str | None:
        return self.error

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


class FrameServer:
    """The gateway's one data-plane port for camera frames, shared by all its robots."""

    def __init__(self, host: str, advertise_host: str = ""):
        self.feeds: dict[str, CameraFeed] = {}
        self.lock = threading.Lock()
        self.data = DataServer(host, max_bytes=FRAME_BYTES, name="camera", advertise_host=advertise_host)
        self.endpoint = self.data.endpoint
        self.data.start(self.handle)

    def add(self, feed: CameraFeed) -> None:
        with self.lock:
            self.feeds[feed.robot_id] = feed

    def remove(self, robot_id: str) -> None:
        with self.lock:
            feed = self.feeds.pop(robot_id, None)
        if feed is not None:
            feed.stop()

    def handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        if kind != "frame":
            raise ValueError(f"unknown request {kind[:40]!r}: the camera port answers 'frame'")
        robot_id = batch.meta.get("robot_id")
        if not isinstance(robot_id, str):
            raise ValueError("meta.robot_id must name a connected robot (a string)")
        with self.lock:
            feed = self.feeds.get(robot_id)
            cameras = sorted(self.feeds)
        if feed is None:
            raise ValueError(f"robot {robot_id[:64]!r} has no camera here (robots with one: {cameras[:20]}). Fix: "
                             f"Connect it with camera_size > 0")
        image, index, captured, tick = feed.newest()
        reply.send("frame", TensorBatch({"image": image},
                                        meta={"robot_id": robot_id, "frame": index, "time": captured, "tick": tick}))

    def health(self) -> str | None:
        if (why := self.data.health()) is not None:
            return why
        with self.lock:
            feeds = list(self.feeds.values())
        return next((why for feed in feeds if (why := feed.health())), None)

    def close(self) -> None:
        with self.lock:
            feeds, self.feeds = list(self.feeds.values()), {}
        for feed in feeds:
            feed.stop()
        self.data.stop()
