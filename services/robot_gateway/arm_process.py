"""Each arm's control loop in a process of its own, so that its tick never waits on the gateway's GIL.

In the gateway's process the loop thread shared one GIL with the gRPC event loop, the camera threads and every
other arm: a tick that woke on time still waited for the GIL behind whichever thread held it, and under a training
load that thread (not real-time) could be preempted while holding it. Its own process gives the loop a GIL nobody
else takes, a real-time priority that is not inherited by anyone else, and an event loop of its own: between ticks
(``ControlLoop.idle``) the arm process serves the gateway's requests on one socket, in the loop's own thread, so a
request never takes the GIL from a tick and an EStop is applied by the next tick.

    gateway (ArmProcess)                         arm process (serve)
    requests  -- SEQPACKET socket, JSON -->      ControlLoop methods, between ticks; answers on the same socket
    states    <-- every tick, JSON ----------    (non-blocking: a gateway too slow to read loses ticks, counted,
                                                  never stalls the loop)
    frames    <-- a stream socket -----------    the camera's thread: header (JSON) + raw pixels

Nothing on either socket is pickled. The gateway re-exports each tick's lateness, jitter, holding and overruns as its
own Prometheus series; a process that dies fails the gateway's health check with its exit code.

    python -m rlfabric.services.robot_gateway.arm_process REQUEST_FD FRAME_FD   (started by ArmProcess, never by hand)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import fields

import numpy as np
from prometheus_client import Counter

from rlfabric.services.core.logs import setup_logging
from rlfabric.services.core.registry import load_target
from rlfabric.services.robot_gateway.cameras import CameraFeed
from rlfabric.services.robot_gateway.drivers import (
    DRIVERS,
    Driver,
    DriverConnectionError,
    DriverOptionError,
    DriverUnavailable,
)
from rlfabric.services.robot_gateway.loop import (
    EPISODES,
    HOLDING,
    INTERVENED,
    JITTER,
    LATENESS,
    OVERRUNS,
    ControlLoop,
    EpisodeCounts,
    TakeoverError,
    Tick,
)
from rlfabric.services.robot_gateway.safety import LimitError, Limits
from rlfabric.services.robot_gateway.series import robot_series

log = logging.getLogger(__name__)
STATES_DROPPED = Counter("rlfabric_robot_states_dropped_total", "tick states the gateway read too late to get "
                         "(the arm process never waits for it)", ["robot"])
MESSAGE_BYTES = 64 << 10  # one request, answer or state (a few joints): far below this
FRAME_HEADER = struct.Struct("!II")  # JSON bytes, pixel bytes
ANSWER_S = 2.0  # a request's answer comes between two ticks; longer means the loop is stuck (its driver's I/O)


# -- what crosses the sockets ------------------------------------------------------------------------------------------
def limits_json(lim: Limits) -> dict:
    return {f.name: (float(v) if f.name == "jump_max" else np.asarray(v, float).tolist())
            for f in fields(lim) for v in [getattr(lim, f.name)]}


def limits_from(d: dict) -> Limits:
    return Limits(**{k: (float(v) if k == "jump_max" else np.asarray(v, float)) for k, v in d.items()})


def _tick_json(t) -> dict:
    d = {f.name: getattr(t, f.name) for f in fields(t)}
    for k in ("position", "velocity", "target", "end_effector"):
        d[k] = np.asarray(d[k], float).tolist()
    return d


class _Owner:
    """A takeover's owner as the arm process knows it: the gateway's key for the caller, and its name."""

    def __init__(self, key: int, name: str):
        self.key, self.name = key, name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Owner) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return self.name


# errors a request may raise that the gateway maps to a status code: re-raised there by their class
ERRORS = {c.__name__: c for c in (LimitError, TakeoverError, ValueError, TypeError, DriverOptionError,
                                  DriverConnectionError, DriverUnavailable, RuntimeError)}


# -- the arm process ---------------------------------------------------------------------------------------------------
class _Serve:
    """The arm process: one driver, one ControlLoop ticking on the main thread, requests served between ticks."""

    def __init__(self, sock: socket.socket, frames: socket.socket):
        self.sock, self.frames = sock, frames
        self.loop = None
        self.feed = None
        self.dropped = 0  # states the gateway did not read in time
        self.running = False
        self.realtime_sent = False

    def send(self, message: dict) -> bool:
        """Without blocking: False when the gateway has not read the states before (it gets the next one)."""
        try:
            self.sock.send(json.dumps(message).encode())
            return True
        except BlockingIOError:
            return False

    def answer(self, request: dict, result=None, error: BaseException | None = None) -> None:
        if "id" not in request:
            return
        message = {"id": request["id"], "ok": result} if error is None else \
            {"id": request["id"], "error": [type(error).__name__, str(error)]}
        deadline = time.monotonic() + ANSWER_S
        while not self.send(message) and time.monotonic() < deadline:  # an answer is never dropped: the gateway
            time.sleep(0.0005)  # waits for it, reading all the while

    def build(self, setup: dict) -> dict:
        cls = load_target(setup["target"])  # what the gateway's registry resolved the name to: its operator's choice
        if not (isinstance(cls, type) and issubclass(cls, Driver)):
            raise ValueError(f"driver {setup['driver']!r}: {setup['target']!r} is not a Driver subclass")
        driver = cls(**setup["options"])
        try:
            capture = driver.camera(setup["camera_size"]) if setup["camera_size"] else None
            self.loop = ControlLoop(setup["robot_id"], driver, setup["hz"], setup["watchdog_s"], setup["spin_s"])
        except BaseException:
            driver.close()
            raise
        if capture is not None:
            self.feed = CameraFeed(setup["robot_id"], capture, setup["camera_hz"], lambda: self.loop.last.tick,
                                   setup["camera_size"])
            self.feed.on_frame = self.send_frame
            self.feed.on_error = self.send_frame_error
        self.loop.listeners.append(self.publish)
        self.loop.intervention_listeners.append(lambda active, episode: self.send(
            {"event": "intervention", "active": active, "episode": episode}))
        self.loop.idle = self.idle
        return {"joint_names": list(driver.joint_names), "hard": limits_json(self.loop.hard),
                "target": self.loop.target.tolist(), "last": _tick_json(self.loop.last)}

    @staticmethod
    def _frame_header(header: dict, pixels: int) -> bytes:
        data = json.dumps(header).encode()
        return FRAME_HEADER.pack(len(data), pixels) + data

    def send_frame_error(self, error: str) -> None:
        with contextlib.suppress(OSError):  # (the gateway gone: nobody is left to tell)
            self.frames.sendall(self._frame_header({"error": error}, 0))

    def send_frame(self, image: np.ndarray, index: int, captured: float, tick: int) -> None:
        self.frames.sendall(self._frame_header({"index": index, "time": captured, "tick": tick,
                                                "shape": list(image.shape)}, image.nbytes) + image.tobytes())

    def publish(self, tick) -> None:
        loop = self.loop
        message = {"tick": _tick_json(tick), "health": loop.health(), "dropped": self.dropped}
        if not self.realtime_sent and loop.realtime != "not started":
            message["realtime"] = loop.realtime
        if self.send(message):
            self.realtime_sent = self.realtime_sent or "realtime" in message
        else:
            self.dropped += 1

    def handle(self, request: dict) -> None:
        loop, call = self.loop, request.get("call")
        try:
            if call == "submit":
                loop.submit(np.asarray(request["position"], float), int(request["seq"]), bool(request["resetting"]))
            elif call == "estop":
                loop.estop(str(request["reason"]))
            elif call == "latch_fault":
                loop.latch_fault(str(request["fault"]))
            elif call == "clear":
                loop.clear()
            elif call == "intervene":
                position = request.get("position")
                loop.intervene(bool(request["active"]), None if position is None else np.asarray(position, float),
                               int(request.get("seq", 0)), owner=self.owner(request))
            elif call == "teleop_command":
                self.answer(request, loop.teleop_command(np.asarray(request["position"], float), int(request["seq"]),
                                                         owner=self.owner(request)))
                return
            elif call == "check_owner":
                loop.check_owner(self.owner(request), str(request["what"]))
            elif call == "release":
                loop.release(self.owner(request))
            elif call == "end_episode":
                intervened = loop.episode_intervened > 0
                counts = loop.end_episode(str(request["outcome"]))
                self.answer(request, {"intervened": intervened, "episode": loop.episode,
                                      "episodes": counts.episodes, "with_intervention": counts.with_intervention,
                                      "success_without_intervention": counts.success_without_intervention,
                                      "intervened_ticks": counts.intervened_ticks})
                return
            elif call == "set_limits":
                self.answer(request, limits_json(loop.set_limits(limits_from(request["limits"]))))
                return
            elif call == "start":
                if self.feed is not None:
                    self.feed.thread.start()  # before the loop claims real-time: a thread inherits its priority
                self.running = True
            elif call == "stop":
                loop.halt()
                self.running = False
            else:
                raise ValueError(f"unknown request {str(call)[:40]!r}")
        except Exception as exc:  # noqa: BLE001 — answered to the gateway, which raises it for its caller
            self.answer(request, error=exc)
            return
        self.answer(request, True)

    def owner(self, request: dict) -> _Owner | None:
        owner = request.get("owner")
        return None if owner is None else _Owner(int(owner[0]), str(owner[1]))

    def drain(self) -> bool:
        """Serve every request waiting; False once the gateway has gone (its end of the socket closed)."""
        while True:
            try:
                data = self.sock.recv(MESSAGE_BYTES)
            except BlockingIOError:
                return True
            if not data:
                return False
            self.handle(json.loads(data))

    def idle(self, until: float) -> None:
        """Until ``until`` (the spin before the next deadline), serve requests as they come: at least once, so a
        request that came during the last spin is served before the next tick."""
        if not self.drain():
            self.loop.halt()
            return
        while self.running and (remaining := until - time.monotonic()) > 0:
            if select.select([self.sock], [], [], remaining)[0] and not self.drain():
                self.loop.halt()  # the gateway died: stop, brake (below)
                return

    def main(self) -> None:
        setup = json.loads(self.sock.recv(MESSAGE_BYTES))
        setup_logging("robot_gateway", setup["log_file"])  # where the gateway logs, in its format
        try:
            hello = self.build(setup)
        except BaseException as exc:  # noqa: BLE001 — the gateway reports it to the caller of Connect
            self.sock.send(json.dumps({"error": [type(exc).__name__, str(exc)[:2000]]}).encode())
            return
        self.sock.send(json.dumps({"ok": hello}).encode())
        self.sock.setblocking(False)
        while not self.running:  # restore the device's latch and limits, then start
            select.select([self.sock], [], [], 1.0)
            if not self.drain():
                break
        loop = self.loop
        try:
            if self.running:
                sys.setswitchinterval(0.0005)  # the camera's thread gives the GIL back within half a millisecond
                loop.run()
        finally:
            loop.stop()  # brakes
            with contextlib.suppress(OSError, AttributeError):  # the rest (closing, the interpreter's exit) takes
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # ~60 ms of CPU: not at real-time
                # priority, where it would stall every other arm pinned to this core that long
            if self.feed is not None:
                self.feed.stop()
            loop.driver.close()
            with loop.lock:
                final = {"estopped": loop.estopped, "fault": loop.fault,
                         "limits": limits_json(loop.safety.limits), "error": repr(loop.error) if loop.error else ""}
            self.sock.setblocking(True)
            with contextlib.suppress(OSError):
                self.sock.send(json.dumps({"stopped": final}).encode())


def _log_file() -> str | None:
    """The gateway's log file, if it logs to one (else the arm process logs to the stderr it inherits)."""
    return next((h.baseFilename for h in logging.getLogger().handlers if hasattr(h, "baseFilename")), None)


# -- the gateway's side ------------------------------------------------------------------------------------------------
class _Joints:
    """What the gateway reads of the driver (it lives in the arm process)."""

    def __init__(self, joint_names: list[str]):
        self.joint_names = joint_names


class ArmProcess:
    """A ControlLoop in a process of its own, with the loop's interface: the gateway calls it as it would the loop.
    Building it connects the driver (blocking: call it off the event loop) and raises what the driver raised."""

    def __init__(self, robot_id: str, driver: str, options: dict[str, str], hz: float, watchdog_s: float,
                 spin_s: float, camera_size: int = 0, camera_hz: float = 30.0):
        self.robot_id, self.period, self.watchdog_s = robot_id, 1.0 / hz, watchdog_s
        self.holding_metric, self.lateness_metric, self.jitter_metric, self.overruns_metric, self.intervened_metric = (
            robot_series(m, robot_id) for m in (HOLDING, LATENESS, JITTER, OVERRUNS, INTERVENED))
        self.dropped_metric = robot_series(STATES_DROPPED, robot_id)
        self.lock = threading.Lock()
        self.listeners: list[Callable] = []
        self.intervention_listeners: list[Callable[[bool, int], None]] = []
        self.realtime = "not started"
        self.error: str | None = None
        self.missed = ""
        self.dropped = 0
        self.counts = EpisodeCounts()
        self.episode = 0
        self.estopped, self.fault = False, ""
        self._answers: dict[int, list] = {}
        self._next_id = 0
        self._stopped = threading.Event()
        self._final: dict | None = None
        self.frame_listener: Callable[[np.ndarray, int, float, int], None] | None = None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        frames_mine, frames_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock, self.frames = mine, frames_mine
        self.proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.robot_gateway.arm_process",
                                      str(theirs.fileno()), str(frames_theirs.fileno())],
                                     pass_fds=(theirs.fileno(), frames_theirs.fileno()), stdin=subprocess.DEVNULL)
        theirs.close()
        frames_theirs.close()
        try:
            self.sock.send(json.dumps({"robot_id": robot_id, "driver": driver, "target": DRIVERS.target(driver),
                                       "options": options, "hz": hz,
                                       "watchdog_s": watchdog_s, "spin_s": spin_s, "camera_size": camera_size,
                                       "camera_hz": camera_hz, "log_file": _log_file()}).encode())
            data = self.sock.recv(MESSAGE_BYTES)
            if not data:
                raise RuntimeError(f"the control process of {robot_id} exited while starting (code "
                                   f"{self.proc.wait(timeout=10)}); the gateway's log has its error")
            hello = json.loads(data)
            if "error" in hello:
                raise self._error(*hello["error"])
        except BaseException:
            self._end()
            raise
        hello = hello["ok"]
        self.driver = _Joints(hello["joint_names"])
        self.hard = limits_from(hello["hard"])
        self.limits = self.hard
        self.target = np.asarray(hello["target"], float)
        self.last = self._tick(hello["last"])
        self.reader = threading.Thread(target=self._read, name=f"arm-{robot_id}", daemon=True)
        self.reader.start()

    @staticmethod
    def _error(name: str, message: str) -> BaseException:
        cls = ERRORS.get(name)
        return cls(message) if cls is not None else RuntimeError(f"{name}: {message}")

    def _tick(self, d: dict):
        for k in ("position", "velocity", "target", "end_effector"):
            d[k] = np.asarray(d[k], float)
        return Tick(**d)

    # -- the reader thread: states, events and answers from the arm process --------------------------------------
    def _read(self) -> None:
        overruns = 0
        while True:
            try:
                data = self.sock.recv(MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "tick" in message:
                tick = self._tick(message["tick"])
                self.lateness_metric.observe(tick.lateness_s)
                self.jitter_metric.observe(tick.jitter_s)
                self.holding_metric.set(1 if tick.holding else 0)
                if tick.overruns > overruns:
                    self.overruns_metric.inc(tick.overruns - overruns)
                    overruns = tick.overruns
                if tick.intervening:
                    self.intervened_metric.inc()
                with self.lock:
                    self.estopped, self.fault, self.target, self.episode = (tick.estopped, tick.fault, tick.target,
                                                                            tick.episode)
                    self.missed = message["health"] or ""
                    if message["dropped"] > self.dropped:  # states this gateway was too slow to read: loud
                        self.dropped_metric.inc(message["dropped"] - self.dropped)
                        self.dropped = message["dropped"]
                    if "realtime" in message:
                        self.realtime = message["realtime"]
                self.last = tick
                for listener in list(self.listeners):
                    listener(tick)
            elif message.get("event") == "intervention":
                for listener in list(self.intervention_listeners):
                    listener(message["active"], message["episode"])
            elif "stopped" in message:
                self._final = message["stopped"]
            elif "id" in message:
                slot = self._answers.get(message["id"])
                if slot is not None:
                    slot.append(message)
                    slot[0].set()
        code = self.proc.wait()
        with self.lock:
            if not self._stopped.is_set():
                self.error = f"the control process of {self.robot_id} exited (code {code})"
        self.holding_metric.set(1)
        for slot in list(self._answers.values()):
            slot[0].set()

    # -- requests -------------------------------------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        """Never blocks the caller (the gateway's event loop): a loop that has stopped reading raises."""
        try:
            self.sock.send(json.dumps(message).encode(), socket.MSG_DONTWAIT)
        except BlockingIOError:
            raise RuntimeError(f"the control loop of {self.robot_id} is not reading its requests (stuck in its "
                               f"driver's I/O?)") from None
        except OSError as exc:
            raise RuntimeError(f"the control process of {self.robot_id} is gone ({exc}); reconnect the robot") \
                from None

    def _call(self, call: str, **args):
        """Ask the arm process and wait for its answer (it comes between two ticks)."""
        with self.lock:
            self._next_id += 1
            rid = self._next_id
        slot = self._answers[rid] = [threading.Event()]
        try:
            self._send({"call": call, "id": rid, **args})
            if not slot[0].wait(max(ANSWER_S, 5 * self.period)) or len(slot) < 2:
                raise RuntimeError(f"the control loop of {self.robot_id} did not answer {call} in "
                                   f"{max(ANSWER_S, 5 * self.period):.1f} s ({self.error or 'stuck in its driver?'})")
        finally:
            self._answers.pop(rid, None)
        answer = slot[1]
        if "error" in answer:
            raise self._error(*answer["error"])
        return answer["ok"]

    @staticmethod
    def _owner(owner: object | None):
        return None if owner is None else [id(owner), str(owner)]

    def submit(self, position: np.ndarray, seq: int, resetting: bool = False) -> None:
        self._send({"call": "submit", "position": np.asarray(position, float).tolist(), "seq": int(seq),
                    "resetting": bool(resetting)})

    def estop(self, reason: str) -> None:
        """Sent, not awaited: a loop stuck in its driver applies it once it ticks again (EStop's reply says so)."""
        with self.lock:
            self.estopped = True
        data = json.dumps({"call": "estop", "reason": reason}).encode()
        try:
            self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:  # a stuck loop's requests fill the socket: this one waits for room, never dropped
            threading.Thread(target=self._send_blocking, args=(data,), daemon=True).start()
        except OSError as exc:
            raise RuntimeError(f"the control process of {self.robot_id} is gone ({exc})") from None

    def _send_blocking(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(data)

    def latch_fault(self, fault: str) -> None:
        self._call("latch_fault", fault=fault)

    def clear(self) -> None:
        self._call("clear")

    def intervene(self, active: bool, position: np.ndarray | None = None, seq: int = 0,
                  owner: object | None = None) -> None:
        self._call("intervene", active=active, seq=int(seq), owner=self._owner(owner),
                   position=None if position is None else np.asarray(position, float).tolist())

    def teleop_command(self, position: np.ndarray, seq: int, owner: object | None = None) -> bool:
        return self._call("teleop_command", position=np.asarray(position, float).tolist(), seq=int(seq),
                          owner=self._owner(owner))

    def check_owner(self, owner: object, what: str) -> None:
        self._call("check_owner", owner=self._owner(owner), what=what)

    def release(self, owner: object) -> None:
        with contextlib.suppress(RuntimeError):  # sent, not awaited (a stream's end runs on the event loop); a gone
            self._send({"call": "release", "owner": self._owner(owner)})  # process has nothing left to release

    def end_episode(self, outcome: str):
        got = self._call("end_episode", outcome=outcome)
        robot_series(EPISODES, self.robot_id, outcome, str(got["intervened"]).lower()).inc()
        with self.lock:
            self.episode = got["episode"]
            self.counts.episodes = got["episodes"]
            self.counts.with_intervention = got["with_intervention"]
            self.counts.success_without_intervention = got["success_without_intervention"]
            self.counts.intervened_ticks = got["intervened_ticks"]
        return self.counts

    def set_limits(self, limits: Limits) -> Limits:
        limits.within(self.hard)  # the same check the loop makes, here first: a clear error without a round trip
        got = limits_from(self._call("set_limits", limits=limits_json(limits)))
        self.limits = got
        return got

    @property
    def safety(self):
        return self

    def start(self) -> None:
        self._call("start")

    def stop(self) -> None:
        """Stop ticking and brake (in the arm process), close the driver, and end the process."""
        self._stopped.set()
        with contextlib.suppress(RuntimeError):
            self._send({"call": "stop"})
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("the control process did not stop in 10 s: killed", extra={"robot": self.robot_id})
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)
        final = self._final
        if final is not None:
            with self.lock:
                self.estopped, self.fault = final["estopped"], final["fault"]
                self.limits = limits_from(final["limits"])
        self._end()

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
        self.frames.close()

    def health(self) -> str | None:
        with self.lock:
            if self.error is not None:
                return self.error
            return self.missed or None

    # -- camera frames ----------------------------------------------------------------------------------------------
    def read_frames(self, deliver: Callable[[np.ndarray, int, float, int], None]) -> None:
        """Deliver every frame the arm process captures, until it ends (run in the camera feed's thread)."""
        stream = self.frames.makefile("rb")
        while True:
            head = stream.read(FRAME_HEADER.size)
            if len(head) < FRAME_HEADER.size:
                return
            header_len, pixels = FRAME_HEADER.unpack(head)
            header = json.loads(stream.read(header_len))
            if "error" in header:
                raise RuntimeError(header["error"])
            image = np.frombuffer(stream.read(pixels), dtype=np.uint8).reshape(header["shape"])
            deliver(image, header["index"], header["time"], header["tick"])


class ArmCamera(CameraFeed):
    """The gateway's side of an arm process's camera: the newest frame it captured, for the FrameServer."""

    def __init__(self, arm: ArmProcess, size: int):
        super().__init__(arm.robot_id, lambda: np.zeros((size, size, 3), np.uint8), 1.0, lambda: arm.last.tick, size)
        self.arm = arm

    def _deliver(self, image: np.ndarray, index: int, captured: float, tick: int) -> None:
        with self.lock:
            self.frame, self.index, self.time, self.frame_tick = image, index, captured, tick
        self.first.set()

    def _run(self) -> None:
        try:
            self.arm.read_frames(self._deliver)
            if not self.stopped.is_set():
                self.error = f"robot {self.robot_id}: the camera stopped with its control process"
        except Exception as exc:  # noqa: BLE001 — reported by health() and to every request
            if not self.stopped.is_set():  # (stopping closes the stream under the read)
                self.error = str(exc) if isinstance(exc, RuntimeError) else f"robot {self.robot_id}: the " \
                                                                             f"camera's stream broke: {exc!r}"
        finally:
            self.first.set()

    def stop(self) -> None:
        """The stream ends with the arm process (ArmProcess.stop): nothing to wait for here."""
        self.stopped.set()


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    frames = socket.socket(fileno=int(sys.argv[2]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _Serve(sock, frames).main()


if __name__ == "__main__":
    main()
