"""The robot gateway service's gRPC face: connect a robot (a driver and its control loop), stream commands in and
states out, narrow the safety limits, e-stop and clear, record episodes. Every call is authenticated by the service
runtime like every other rlfabric service; the loop keeps its guarantees whatever a client sends or fails to send.

Recorded episodes go to the gateway's object store, set by its ``--storage-*`` flags (or ``RLFABRIC_STORAGE_*``;
S3 credentials from ``$RLFABRIC_S3_ACCESS_KEY`` / ``$RLFABRIC_S3_SECRET_KEY``), opened at the first StartRecording;
to replay only at the endpoints the operator lists with ``--replay-endpoints`` (a client never picks where the
gateway connects).

What is safety state belongs to the physical device (``Driver.device_key``: the sim's name, a serial port, a Franka
IP), not to the robot id: the e-stop latch, a latched fault and narrowed limits survive Disconnect and Connect, and
one device is connected under one id at a time. Connect and Disconnect of one id run one at a time, and whatever
may block on a device (a driver's constructor, its close) runs off the event loop, so EStop answers within a tick
whatever else is going on. See docs/robot_safety.md."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from rlfabric.services.core import auth
from rlfabric.services.core.config import ConfigError, StorageConfig
from rlfabric.services.core.objectstore import ObjectStore, open_store
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime, run_service
from rlfabric.services.robot_gateway import series
from rlfabric.services.robot_gateway.arm_process import ArmCamera, ArmProcess
from rlfabric.services.robot_gateway.cameras import FrameServer
from rlfabric.services.robot_gateway.drivers import (
    DriverConnectionError,
    DriverOptionError,
    DriverUnavailable,
    driver_class,
)
from rlfabric.services.robot_gateway.loop import TakeoverError, Tick
from rlfabric.services.robot_gateway.recording import (
    ObjectStoreSink,
    Recorder,
    RecordingError,
    ReplaySink,
    check_memory,
    check_name,
    session_name,
)
from rlfabric.services.robot_gateway.safety import LimitError, Limits

log = logging.getLogger(__name__)
MAX_ROBOTS = 16
ROBOT_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
STATES_BUFFERED = 64  # per Control stream: a slow reader loses the oldest states, never stalls the loop
MAX_DEVICES = 1024  # devices whose safety state is remembered after they disconnect


@dataclass
class Device:
    """The safety state of one physical device, kept across reconnects (a robot id is only a name for a while)."""

    key: str
    driver: str
    holder: str | None = None  # the robot id it is connected (or connecting) under
    estopped: bool = False
    fault: str = ""
    limits: Limits | None = None  # narrowed limits; None: the driver's hard limits

    def remembered(self) -> bool:
        return self.holder is not None or self.estopped or bool(self.fault) or self.limits is not None


class _Stream:
    """A Teleop stream, as the owner of a takeover (named in a refusal)."""

    def __init__(self, peer: str):
        self.name = f"the Teleop stream of {peer} begun at {time.strftime('%H:%M:%S')}"

    def __str__(self) -> str:
        return self.name


def stretched(limits: Limits, hard: Limits, target: np.ndarray) -> Limits:
    """``limits`` with each joint's position range widened just enough to hold ``target`` (within ``hard``): the
    arm may then move back toward the kept range, never further out."""
    lo = np.maximum(np.minimum(limits.position_min, target), hard.position_min)
    hi = np.minimum(np.maximum(limits.position_max, target), hard.position_max)
    return limits.merged(position_min=lo, position_max=np.maximum(hi, lo))


def state_message(robot_id: str, t: Tick, estop_requested: bool = False) -> pb.RobotState:
    """Tick ``t`` as a message; ``estop_requested``: the loop holds an e-stop latch that ``t`` may predate."""
    return pb.RobotState(robot_id=robot_id, seq=t.tick, time=t.time, position=t.position.tolist(),
                         velocity=t.velocity.tolist(), estopped=t.estopped, fault=t.fault, loop_jitter_s=t.jitter_s,
                         loop_lateness_s=t.lateness_s, overruns=t.overruns, holding=t.holding,
                         hold_reason=t.hold_reason, target=t.target.tolist(), command_seq=t.command_seq,
                         clipped=t.clipped, slowed=t.slowed, intervening=t.intervening, episode=t.episode,
                         episode_intervened_ticks=t.episode_intervened_ticks, end_effector=t.end_effector.tolist(),
                         policy_seq=t.policy_seq, policy_resetting=t.policy_resetting,
                         estop_requested=t.estopped or estop_requested)


def limits_message(robot_id: str, lim: Limits) -> pb.SafetyLimits:
    return pb.SafetyLimits(robot_id=robot_id, position_min=lim.position_min.tolist(),
                           position_max=lim.position_max.tolist(), velocity_max=lim.velocity_max.tolist(),
                           workspace_min=lim.workspace_min.tolist(), workspace_max=lim.workspace_max.tolist(),
                           slew_max=lim.slew_max.tolist(), jump_max=lim.jump_max)


class RobotGatewayService(robot_gateway_pb2_grpc.RobotGatewayServicer):
    def __init__(self, runtime: ServiceRuntime, storage: StorageConfig | None = None,
                 storage_default_root: str = "recordings", replay_endpoints: frozenset[str] = frozenset(),
                 operator_secret: str = ""):
        self.operator_secret = operator_secret  # --operator-token-file: what clearing a latch takes (never a run's)
        self.loops: dict[str, ArmProcess] = {}
        self.drivers: dict[str, str] = {}
        self.devices: dict[str, Device] = {}  # by device key
        self.device_of: dict[str, str] = {}  # robot id -> device key, while connected
        self.id_locks: dict[str, list] = {}  # robot id -> [lock, calls holding or waiting]: see _id_lock
        self.replay_endpoints = replay_endpoints
        # a stopped one stays while its robot is connected, so GetRecording reports how it ended; Disconnect drops it
        self.recorders: dict[str, Recorder] = {}
        self.recording_requests: dict[str, pb.RecordingRequest] = {}
        self.storage, self.storage_default_root = storage or StorageConfig(), storage_default_root
        self.store: ObjectStore | None = None
        self.runtime = runtime
        self.frames: FrameServer | None = None  # the camera data plane, opened with the first camera
        runtime.on_shutdown(self.close)
        runtime.watch("control-loops", self.health)

    def health(self) -> str | None:
        if self.frames is not None and (why := self.frames.health()) is not None:
            return why
        for rid, rec in self.recorders.items():
            if rec.error is not None:
                return f"the recorder of {rid} died: {rec.error!r} (its episodes are no longer recorded)"
        return next((why for loop in self.loops.values() if (why := loop.health())), None)

    async def _loop(self, robot_id: str, context) -> ArmProcess:
        loop = self.loops.get(robot_id)
        if loop is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"robot {robot_id!r} is not connected. Fix: call Connect "
                                                           f"first (connected: {sorted(self.loops)})")
        return loop

    def _info(self, robot_id: str) -> pb.RobotInfo:
        loop = self.loops[robot_id]
        camera = self.frames.feeds.get(robot_id) if self.frames is not None else None
        return pb.RobotInfo(robot_id=robot_id, driver=self.drivers[robot_id], joint_names=loop.driver.joint_names,
                            control_hz=1 / loop.period, watchdog_s=loop.watchdog_s,
                            limits=limits_message(robot_id, loop.hard), realtime=loop.realtime,
                            camera_endpoint=self.frames.endpoint if camera else "",
                            camera_size=camera.size if camera else 0)

    @contextlib.asynccontextmanager
    async def _id_lock(self, robot_id: str):
        """Connect and Disconnect of one robot id, one at a time. Ids come from clients: an entry lives only while a
        call holds or waits for it, so a stream of fresh ids leaves nothing behind."""
        entry = self.id_locks.setdefault(robot_id, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self.id_locks[robot_id]

    async def Connect(self, request, context):
        rid = request.robot_id
        if not ROBOT_ID.match(rid):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"robot_id {rid[:80]!r}: 1-64 characters of "
                                                                  f"letters, digits, _ . -")
        hz = request.control_hz or 100.0
        if not 1 <= hz <= 2000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"control_hz={hz}: give 1..2000 (0: 100)")
        watchdog = request.watchdog_s or 0.1
        if not 1 / hz <= watchdog <= 10:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"watchdog_s={watchdog}: give one tick "
                                                                  f"({1 / hz:.4f} s) to 10 s (0: 0.1 s)")
        spin = 0.001 if request.spin_s == 0 else max(request.spin_s, 0.0)
        if not (np.isfinite(spin) and spin <= 0.5 / hz):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"spin_s={request.spin_s}: at most half a period "
                                                                  f"({0.5 / hz:.4f} s); 0: 1 ms, -1: never spin")
        camera_hz = request.camera_hz or 30.0
        if request.camera_size and not (np.isfinite(camera_hz) and 1 <= camera_hz <= 120):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"camera_hz={request.camera_hz}: give 1..120 "
                                                                  f"frames per second (0: 30)")
        options = dict(request.options)
        try:  # importing a driver's module may take a while: off the event loop
            cls = await asyncio.to_thread(driver_class, request.driver)
            key = cls.device_key(options, rid)
        except (ValueError, TypeError) as exc:  # a driver name or device address the request got wrong
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"driver {request.driver!r}: {exc}")
        except ImportError as exc:  # a registered driver whose module this host cannot import: its operator's fix
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"driver {request.driver!r} cannot be imported "
                                                                     f"on this gateway's host: {exc}")
        async with self._id_lock(rid):  # two Connects of one id never both build a loop
            if rid in self.loops:
                if self.drivers[rid] != request.driver or self.device_of[rid] != key:
                    await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"robot {rid!r} is connected to device "
                                                                        f"{self.device_of[rid]} (driver "
                                                                        f"{self.drivers[rid]!r}). Fix: Disconnect "
                                                                        f"it first, or use another robot_id")
                return self._info(rid)
            device = self.devices.get(key)
            if device is not None and device.holder not in (None, rid):
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"device {key} is connected as robot "
                                                                    f"{device.holder!r}: one device, one robot id "
                                                                    f"(one loop, one e-stop). Fix: use robot_id "
                                                                    f"{device.holder!r}, or Disconnect it first")
            if len(self.loops) >= MAX_ROBOTS:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_ROBOTS} robots are connected already")
            if device is None:
                device = self._remember(Device(key, request.driver))
                if device is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the gateway remembers the safety state "
                                                                            f"of {MAX_DEVICES} devices already (e-stops "
                                                                            f"or narrowed limits). Fix: connect and "
                                                                            f"ClearEStop/widen those, or restart it")
            device.holder = rid  # reserved: a concurrent Connect of another id for this device is refused
            try:
                loop = await self._open(rid, device, request, options, hz, watchdog, spin, camera_hz, context)
            finally:
                if rid not in self.loops:
                    device.holder = None
                    self._forget_if_clear(device)
        for _ in range(400):  # its first moments: what priority it got goes in the reply, and a first tick's state
            if loop.realtime != "not started" and loop.last.tick > 0:  # (a latch kept by the device included)
                break
            await asyncio.sleep(0.005)
        log.info("robot connected", extra={"robot": rid, "driver": request.driver, "device": key, "hz": hz,
                                           "watchdog_s": watchdog, "realtime": loop.realtime,
                                           "estopped": loop.estopped})
        return self._info(rid)

    def _remember(self, device: Device) -> Device | None:
        """A new device record; when full, a simulated arm's cleared record makes room (a real arm's never)."""
        if len(self.devices) >= MAX_DEVICES:
            spare = next((k for k, d in self.devices.items() if d.holder is None and d.driver == "sim"), None)
            if spare is None:
                return None
            del self.devices[spare]
        self.devices[device.key] = device
        return device

    def _forget_if_clear(self, device: Device) -> None:
        if not device.remembered() and self.devices.get(device.key) is device:
            del self.devices[device.key]

    async def _open(self, rid: str, device: Device, request, options: dict[str, str], hz: float, watchdog: float,
                    spin: float, camera_hz: float, context) -> ArmProcess:
        """Start the arm's process (its driver and loop) off the event loop (a Franka's probe alone may take a
        minute), restore the device's safety state, start ticking; on any failure the process ends (its driver
        closed)."""
        try:
            loop = await asyncio.to_thread(ArmProcess, rid, request.driver, options, hz, watchdog, spin,
                                           request.camera_size, camera_hz)
        except (DriverOptionError, DriverConnectionError, TypeError) as exc:  # the request's options (TypeError:
            # an option the driver's constructor does not take)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"driver {request.driver!r}: {exc}")
        except DriverUnavailable as exc:  # this host lacks the driver's library: its operator's to install
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"driver {request.driver!r}: {exc}")
        except Exception as exc:  # the driver or its device failed (a simulator's ValueError included): not the
            # caller's fault, so not INVALID_ARGUMENT
            log.error("driver failed to start", extra={"robot": rid, "driver": request.driver,
                                                        "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            await context.abort(grpc.StatusCode.INTERNAL, f"driver {request.driver!r} failed to start "
                                                          f"({type(exc).__name__}: {str(exc)[:300]}): a fault of "
                                                          f"the driver or its device, not of this request. The "
                                                          f"gateway's log has the traceback")
        try:
            await asyncio.to_thread(self._restore, loop, device)
            await asyncio.to_thread(loop.start)
        except BaseException:
            await asyncio.to_thread(loop.stop)
            raise
        if request.camera_size:
            feed = ArmCamera(loop, request.camera_size)
            try:
                await asyncio.to_thread(feed.start)
            except RuntimeError as exc:
                await asyncio.to_thread(loop.stop)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{exc}. Fix: give the gateway an "
                                                                         f"off-screen renderer (libosmesa6) or "
                                                                         f"camera_size: 0")
            if self.frames is None:
                self.frames = FrameServer(self.runtime.options.host, self.runtime.advertise_host)
            self.frames.add(feed)
        self.loops[rid], self.drivers[rid], self.device_of[rid] = loop, request.driver, device.key
        return loop

    @staticmethod
    def _restore(loop: ArmProcess, device: Device) -> None:
        """The device's latch and narrowed limits, onto its new loop (before it ticks)."""
        if device.estopped:
            loop.estop(f"latched before device {device.key} was reconnected")
        if device.fault:
            loop.latch_fault(device.fault)
        if device.limits is None:
            return
        try:
            device.limits.within(loop.hard)
            loop.set_limits(device.limits)
        except LimitError as exc:  # the arm was moved while disconnected (or its options changed): hold, loudly
            loop.set_limits(stretched(device.limits, loop.hard, loop.target)
                            if device.limits.position_min.shape == loop.hard.position_min.shape else loop.hard)
            loop.latch_fault(f"the limits kept for device {device.key} do not fit it now ({exc}); they were widened "
                             f"just enough to hold the arm. Fix: check the arm, SetLimits, then the operator clears it "
                             f"(rlfabric robot clear-estop)")

    async def Disconnect(self, request, context):
        async with self._id_lock(request.robot_id):
            loop = await self._loop(request.robot_id, context)
            del self.loops[request.robot_id], self.drivers[request.robot_id]
            device = self.devices[self.device_of.pop(request.robot_id)]
            try:
                if self.frames is not None:
                    await asyncio.to_thread(self.frames.remove, request.robot_id)
                await asyncio.to_thread(loop.stop)  # brakes, closes the driver, ends the arm's process
                await self._stop_recorder(request.robot_id, loop)
            finally:  # what latched stays with the device, whatever failed above
                self.recorders.pop(request.robot_id, None)  # ids are the clients': nothing of one outlives it
                self.recording_requests.pop(request.robot_id, None)
                with loop.lock:
                    device.estopped, device.fault = loop.estopped, loop.fault
                    limits = loop.safety.limits
                device.limits = None if limits.same_as(loop.hard) else limits
                device.holder = None
                self._forget_if_clear(device)
                series.forget(request.robot_id)  # (the device keeps what latched; the id's series go)
        log.info("robot disconnected", extra={"robot": request.robot_id, "device": device.key,
                                              "estopped": device.estopped})
        return state_message(request.robot_id, loop.last)

    async def GetState(self, request, context):
        loop = await self._loop(request.robot_id, context)
        return state_message(request.robot_id, loop.last)

    async def ListRobots(self, request, context):
        return pb.RobotList(robots=[self._info(rid) for rid in sorted(self.loops)])

    async def _streamed(self, request_iterator, context, accept, on_end: Callable[[ArmProcess], None] | None = None):
        """States of the first message's robot, one per tick, while ``accept`` takes each incoming message
        (returning why it refuses one: the stream then ends with INVALID_ARGUMENT, or with the status code it
        returns beside the reason, and the watchdog holds the arm). ``on_end`` runs however the stream ends."""
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        rid = first.robot_id
        loop = await self._loop(rid, context)
        states: asyncio.Queue[Tick] = asyncio.Queue(maxsize=STATES_BUFFERED)
        aloop = asyncio.get_running_loop()

        def offer(tick: Tick) -> None:
            if states.full():
                states.get_nowait()
            states.put_nowait(tick)

        def listener(tick: Tick) -> None:
            aloop.call_soon_threadsafe(offer, tick)

        async def read() -> str | tuple[grpc.StatusCode, str] | None:
            async for message in request_iterator:
                if message.robot_id != rid:
                    return f"a message for robot {message.robot_id!r} on the stream of {rid!r}"
                if (why := await accept(loop, message)) is not None:
                    return why
            return None

        async def refuse(why: str | tuple[grpc.StatusCode, str]) -> None:
            code, why = why if isinstance(why, tuple) else (grpc.StatusCode.INVALID_ARGUMENT, why)
            await context.abort(code, why)

        try:
            if (why := await accept(loop, first)) is not None:
                await refuse(why)
            loop.listeners.append(listener)
            reader = asyncio.create_task(read())
            try:
                while True:
                    tick = await states.get()
                    if reader.done() and (why := reader.result()) is not None:
                        await refuse(why)
                    yield state_message(rid, tick)
            finally:
                reader.cancel()
                loop.listeners.remove(listener)
        finally:
            if on_end is not None:
                on_end(loop)

    @staticmethod
    def _position(loop: ArmProcess, command) -> np.ndarray | str:
        joints = loop.driver.joint_names
        position = np.asarray(command.position, dtype=float)
        if position.shape != (len(joints),) or not np.isfinite(position).all():
            return f"position needs {len(joints)} finite values ({', '.join(joints)}), got {len(command.position)}"
        return position

    async def Control(self, request_iterator, context):
        async def accept(loop: ArmProcess, cmd) -> str | tuple[grpc.StatusCode, str] | None:
            position = self._position(loop, cmd)
            if isinstance(position, str):
                return position
            try:
                loop.submit(position, cmd.seq, cmd.resetting)  # sent, never awaited: a stream of commands costs the loop nothing
            except RuntimeError as exc:  # the arm's process stopped reading (stuck) or is gone
                return grpc.StatusCode.UNAVAILABLE, str(exc)
            return None

        async for state in self._streamed(request_iterator, context, accept):
            yield state

    async def Teleop(self, request_iterator, context):
        kinds = pb.TeleopEvent.Kind
        ends = {kinds.SUCCESS: "success", kinds.FAILURE: "failure", kinds.RERECORD: "rerecord",
                kinds.TERMINATE: "terminate"}

        owner = _Stream(context.peer())  # a takeover this stream begins is its own: no other stream may end it

        async def accept(loop: ArmProcess, event) -> str | tuple[grpc.StatusCode, str] | None:
            try:  # the arm's process answers between two ticks: waited for off the event loop
                return await asyncio.to_thread(take, loop, event)
            except TakeoverError as exc:
                return grpc.StatusCode.PERMISSION_DENIED, str(exc)
            except RuntimeError as exc:
                return grpc.StatusCode.UNAVAILABLE, str(exc)

        def take(loop: ArmProcess, event) -> str | None:
            if event.kind in (kinds.COMMAND, kinds.INTERVENE_START):
                position = self._position(loop, event.command)
                if isinstance(position, str):
                    return position
                if event.kind == kinds.INTERVENE_START:
                    loop.intervene(True, position, event.command.seq, owner=owner)
                else:
                    loop.teleop_command(position, event.command.seq, owner=owner)
            elif event.kind == kinds.INTERVENE_STOP:
                loop.intervene(False, owner=owner)
            elif event.kind in ends:
                loop.check_owner(owner, f"the verdict {ends[event.kind].upper()}")  # it would end the takeover
                recorder = self.recorders.get(loop.robot_id)
                if recorder is not None and recorder.recording:  # the verdict first: the episode's end is known
                    recorder.episode_ended(loop.episode, ends[event.kind])  # before a tick of the next one
                loop.end_episode(ends[event.kind])
            else:
                return f"unknown teleop event kind {event.kind}"
            return None

        async for state in self._streamed(request_iterator, context, accept, on_end=lambda loop: loop.release(owner)):
            yield state

    async def SetLimits(self, request, context):
        loop = await self._loop(request.robot_id, context)
        current = loop.safety.limits
        changes = {name: np.asarray(getattr(request, name), float)
                   for name in ("position_min", "position_max", "velocity_max", "slew_max", "workspace_min",
                                "workspace_max") if len(getattr(request, name))}
        if request.HasField("jump_max"):  # optional: unset keeps the current one, an explicit 0 is refused
            changes["jump_max"] = request.jump_max
        try:
            limits = await asyncio.to_thread(loop.set_limits, current.merged(**changes))
        except LimitError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("limits set", extra={"robot": request.robot_id, "fields": sorted(changes)})
        return limits_message(request.robot_id, limits)

    async def EStop(self, request, context):
        """Latch the e-stop and answer with the first tick that applied it: ``estopped``. A loop that has not
        ticked within 25 periods (stuck in its driver's I/O) cannot apply it yet; the reply then says the stop is
        only requested (``estop_requested`` without ``estopped``), and the loop holds on its next tick."""
        loop = await self._loop(request.robot_id, context)
        since = time.monotonic()
        loop.estop(request.reason[:200] or "requested")
        tick = await self._next_tick(loop, since, applied=lambda t: t.estopped)
        if not tick.estopped:
            log.error("e-stop requested but not yet applied: the control loop has not ticked since (its driver may "
                      "be stuck in I/O)", extra={"robot": request.robot_id[:200],
                                                 "last_tick_age_s": round(time.monotonic() - tick.time, 3)})
        return state_message(request.robot_id, tick, estop_requested=True)

    async def ClearEStop(self, request, context):
        """Only the operator clears an e-stop or a latched fault (a deliberate human act, as ISO 13850 asks): the
        call carries the operator's credential beside the deployment's bearer, which every run holds. Clearing
        moves nothing: the arm holds until a fresh command arrives."""
        rid = request.robot_id[:200]
        if not self.operator_secret:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"ClearEStop of {rid!r}: this gateway was started without an operator secret, so no "
                                f"call may clear a latch. Fix: restart it with --operator-token-file FILE (a secret "
                                f"of the operator's, not the deployment's token) and clear with `rlfabric robot "
                                f"clear-estop {rid} --gateway ADDRESS --operator-token-file FILE`")
        metadata = dict(context.invocation_metadata() or ())
        if not auth.operator_accepts(self.operator_secret, metadata.get(auth.OPERATOR_METADATA_KEY)):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"ClearEStop of {rid!r} takes the operator's credential: the deployment's token, "
                                f"which every run holds, cannot clear an e-stop or a latched fault. Fix: the "
                                f"operator checks the arm, then runs `rlfabric robot clear-estop {rid} --gateway "
                                f"ADDRESS --operator-token-file FILE`")
        loop = await self._loop(request.robot_id, context)
        await asyncio.to_thread(loop.clear)
        log.warning("e-stop and faults cleared by the operator", extra={"robot": rid})
        return state_message(request.robot_id, await self._next_tick(loop, time.monotonic()))

    @staticmethod
    async def _next_tick(loop: ArmProcess, since: float, applied: Callable[[Tick], bool] = lambda t: True) -> Tick:
        """The first state of a tick that began after ``since`` (taken once a change was made) and shows the change
        ``applied``, so a reply shows its effect: the next tick to finish may have read the robot's state before
        the change reached the arm's process (it was under way); at most 25 periods."""
        for _ in range(100):
            if loop.last.time > since and applied(loop.last):
                break
            await asyncio.sleep(loop.period / 4)
        return loop.last

    async def StreamInterventions(self, request, context):
        loop = await self._loop(request.robot_id, context)
        events: asyncio.Queue[tuple[bool, int]] = asyncio.Queue(maxsize=STATES_BUFFERED)
        aloop = asyncio.get_running_loop()

        def listener(active: bool, episode: int) -> None:
            aloop.call_soon_threadsafe(lambda: None if events.full() else events.put_nowait((active, episode)))

        loop.intervention_listeners.append(listener)
        try:
            while True:
                active, episode = await events.get()
                yield pb.Intervention(robot_id=request.robot_id, seq=episode, active=active)
        finally:
            loop.intervention_listeners.remove(listener)

    # -- recording ----------------------------------------------------------------------------------------------
    def _recording_status(self, robot_id: str) -> pb.RecordingStatus:
        rec = self.recorders.get(robot_id)
        if rec is None:
            return pb.RecordingStatus(robot_id=robot_id)
        s = rec.stats
        replay = next((sink for sink in rec.sinks if isinstance(sink, ReplaySink)), None)
        return pb.RecordingStatus(robot_id=robot_id, recording=rec.recording, dataset=rec.dataset, session=rec.session,
                                  episodes_kept=s.episodes_kept, episodes_discarded=s.episodes_discarded,
                                  episodes_failed=s.episodes_failed,
                                  ticks_recorded=s.ticks_recorded, ticks_dropped=s.ticks_dropped,
                                  replay_pushes=replay.pushes if replay else 0, write_errors=s.write_errors,
                                  last_episode_uri=s.last_episode_uri, last_error=s.last_error)

    def _open_store(self) -> ObjectStore:
        if self.store is None:
            self.store = open_store(self.storage, self.storage_default_root)
        return self.store

    async def StartRecording(self, request, context):
        """Record every tick of the robot from now on; see the RecordingRequest fields."""
        loop = await self._loop(request.robot_id, context)
        current = self.recorders.get(request.robot_id)
        if current is not None and current.recording:
            if self.recording_requests.get(request.robot_id) == request:  # a retried call: the same recording
                return self._recording_status(request.robot_id)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"robot {request.robot_id!r} is recording data "
                                                                     f"set {current.dataset!r} already. Fix: call "
                                                                     f"StopRecording first")
        try:
            check_name("dataset", request.dataset)
            if request.replay_endpoint and not request.replay_source:
                raise RecordingError("replay_source is empty but replay_endpoint is set. Fix: name the replay source "
                                     "the episodes go to (the run's replay must have it)")
            check_name("replay_source", request.replay_source, required=False)
            check_name("intervention_source", request.intervention_source, required=False)
            if (request.replay_source or request.intervention_source) and not request.replay_endpoint.startswith(
                    "tcp://"):
                raise RecordingError(f"replay_endpoint={request.replay_endpoint[:80]!r}: give replay's data-plane "
                                     f"endpoint, tcp://host:port")
            if len(request.task) > 1000:
                raise RecordingError(f"task: {len(request.task)} characters; at most 1000")
            check_memory(len(loop.driver.joint_names), request.queue_ticks, request.max_episode_ticks,
                         1 / loop.period)
        except RecordingError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.replay_endpoint and request.replay_endpoint not in self.replay_endpoints:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"replay_endpoint={request.replay_endpoint[:80]!r} "
                                                                   f"is not one this gateway's operator allowed "
                                                                   f"({sorted(self.replay_endpoints) or 'none'}): the "
                                                                   f"gateway connects only where its operator says. "
                                                                   f"Fix: start it with --replay-endpoints "
                                                                   f"tcp://host:port[,...] (or "
                                                                   f"RLFABRIC_REPLAY_ENDPOINTS)")
        try:  # S3 checks its endpoint, credentials and bucket here: off the event loop
            store = await asyncio.to_thread(self._open_store)
        except (ConfigError, OSError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the gateway's object store (flags --storage-*, "
                                                                     f"or RLFABRIC_STORAGE_*): {exc}")
        session = session_name()
        sinks: list = [ObjectStoreSink(store, f"recordings/{request.dataset}/{request.robot_id}/{session}")]
        if request.replay_endpoint:
            sinks.append(ReplaySink(request.replay_endpoint, request.replay_source, request.intervention_source))
        rec = Recorder(request.robot_id, loop.driver.joint_names, 1 / loop.period, sinks, dataset=request.dataset,
                       session=session, task=request.task, queue_ticks=request.queue_ticks,
                       max_episode_ticks=request.max_episode_ticks)
        self.recording_requests[request.robot_id] = request
        self.recorders[request.robot_id] = rec.start()
        loop.listeners.append(rec.offer)
        log.info("recording started", extra={"robot": request.robot_id, "dataset": request.dataset,
                                             "session": session, "replay_source": request.replay_source})
        return self._recording_status(request.robot_id)

    async def _stop_recorder(self, robot_id: str, loop: ArmProcess) -> None:
        rec = self.recorders.get(robot_id)
        if rec is None or not rec.recording:
            return
        if rec.offer in loop.listeners:
            loop.listeners.remove(rec.offer)
        await asyncio.to_thread(rec.stop)  # writes the episodes that have a verdict
        log.info("recording stopped", extra={"robot": robot_id, "kept": rec.stats.episodes_kept,
                                             "dropped_ticks": rec.stats.ticks_dropped})

    async def StopRecording(self, request, context):
        loop = await self._loop(request.robot_id, context)
        await self._stop_recorder(request.robot_id, loop)
        return self._recording_status(request.robot_id)

    async def GetRecording(self, request, context):
        await self._loop(request.robot_id, context)
        return self._recording_status(request.robot_id)

    def close(self) -> None:
        if self.frames is not None:
            self.frames.close()
        for loop in self.loops.values():
            loop.stop()
        for rid, rec in self.recorders.items():
            if rec.recording:
                if rec.offer in self.loops[rid].listeners:
                    self.loops[rid].listeners.remove(rec.offer)
                rec.stop()


def _storage_args(parser) -> None:
    """Where recorded episodes go: the same choices as a run's ``storage`` section, and the replay endpoints a
    recording may push to."""
    parser.add_argument("--storage-kind", choices=("filesystem", "s3"), default="filesystem",
                        help="object store for recorded episodes")
    parser.add_argument("--storage-root", default="recordings", help="filesystem store: its folder")
    parser.add_argument("--storage-endpoint", default="", help="S3/MinIO host:port")
    parser.add_argument("--storage-bucket", default="rlfabric", help="S3 bucket")
    parser.add_argument("--storage-prefix", default="", help="key prefix inside the bucket")
    parser.add_argument("--storage-secure", default="false", choices=("true", "false"), help="S3 over TLS")
    parser.add_argument("--operator-token-file", default="",
                        help="a file holding the operator's own secret (not the deployment's token): ClearEStop "
                             "takes a credential derived from it, so no run can clear an e-stop or a fault; "
                             "without it no call can clear one")
    parser.add_argument("--replay-endpoints", default="",
                        help="comma-separated replay data-plane endpoints (tcp://host:port) a StartRecording may "
                             "name; none by default (a client never chooses where the gateway connects)")


def replay_endpoints(flag: str) -> frozenset[str]:
    """``--replay-endpoints``: each one tcp://host:port."""
    endpoints = frozenset(e.strip() for e in flag.split(",") if e.strip())
    for e in endpoints:
        host, _, port = e.removeprefix("tcp://").rpartition(":")
        if not e.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{e!r} is not tcp://host:port")
    return endpoints


async def _build(runtime: ServiceRuntime, args) -> None:
    try:
        storage = StorageConfig(kind=args.storage_kind, root=args.storage_root, endpoint=args.storage_endpoint,
                                bucket=args.storage_bucket, prefix=args.storage_prefix,
                                secure=args.storage_secure == "true")
    except ValueError as exc:
        raise SystemExit(f"rlfabric serve robot_gateway: error: --storage-* flags: {exc}") from None
    try:
        allowed = replay_endpoints(args.replay_endpoints)
    except ValueError as exc:
        raise SystemExit(f"rlfabric serve robot_gateway: error: --replay-endpoints: {exc}. Fix: give "
                         f"tcp://host:port[,...]") from None
    operator = ""
    if args.operator_token_file:
        try:
            operator = auth.read_token_file(args.operator_token_file)
        except auth.AuthError as exc:
            raise SystemExit(f"rlfabric serve robot_gateway: error: --operator-token-file: {exc}") from None
        if len(operator) < auth.MIN_TOKEN_CHARS or operator == auth.current().token:
            raise SystemExit("rlfabric serve robot_gateway: error: --operator-token-file must hold a secret of at "
                             f"least {auth.MIN_TOKEN_CHARS} characters that is not the deployment's token (every "
                             "run holds that one). Fix: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
                             " > FILE; chmod 600 FILE")
    robot_gateway_pb2_grpc.add_RobotGatewayServicer_to_server(
        RobotGatewayService(runtime, storage, args.storage_root, allowed, operator), runtime.server)


def main(argv: list[str] | None = None) -> None:
    # camera frames render off-screen: MuJoCo picks its OpenGL backend once, on import, so choose OSMesa (Debian's
    # libosmesa6, CPU) before any driver imports it, unless the deployment chose one (MUJOCO_GL=egl on a GPU host)
    if "mujoco" not in sys.modules and ctypes.util.find_library("OSMesa"):
        os.environ.setdefault("MUJOCO_GL", "osmesa")
    run_service("robot_gateway", _build, argv, extra_args=_storage_args)


if __name__ == "__main__":
    main()
