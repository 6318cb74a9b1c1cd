"""The robot gateway service's gRPC face: connect a robot (a driver and its control loop), stream commands in and
states out, narrow the safety limits, e-stop and clear. Every call is authenticated by the service runtime like
every other rlfabric service; the loop keeps its guarantees whatever a client sends or fails to send."""

from __future__ import annotations

import asyncio
import logging
import re

import grpc
import numpy as np

from services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
from services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
from services.core.runtime import ServiceRuntime, run_service
from services.robot_gateway.drivers import build_driver
from services.robot_gateway.loop import ControlLoop, Tick
from services.robot_gateway.safety import LimitError, Limits

log = logging.getLogger(__name__)
MAX_ROBOTS = 16
ROBOT_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
STATES_BUFFERED = 64  # per Control stream: a slow reader loses the oldest states, never stalls the loop


def state_message(robot_id: str, t: Tick) -> pb.RobotState:
    return pb.RobotState(robot_id=robot_id, seq=t.tick, time=t.time, position=t.position.tolist(),
                         velocity=t.velocity.tolist(), estopped=t.estopped, fault=t.fault, loop_jitter_s=t.jitter_s,
                         loop_lateness_s=t.lateness_s, overruns=t.overruns, holding=t.holding,
                         hold_reason=t.hold_reason, target=t.target.tolist(), command_seq=t.command_seq,
                         clipped=t.clipped, slowed=t.slowed, intervening=t.intervening, episode=t.episode,
                         episode_intervened_ticks=t.episode_intervened_ticks, end_effector=t.end_effector.tolist())


def limits_message(robot_id: str, lim: Limits) -> pb.SafetyLimits:
    return pb.SafetyLimits(robot_id=robot_id, position_min=lim.position_min.tolist(),
                           position_max=lim.position_max.tolist(), velocity_max=lim.velocity_max.tolist(),
                           workspace_min=lim.workspace_min.tolist(), workspace_max=lim.workspace_max.tolist(),
                           slew_max=lim.slew_max.tolist(), jump_max=lim.jump_max)


class RobotGatewayService(robot_gateway_pb2_grpc.RobotGatewayServicer):
    def __init__(self, runtime: ServiceRuntime):
        self.loops: dict[str, ControlLoop] = {}
        self.drivers: dict[str, str] = {}
        runtime.on_shutdown(self.close)
        runtime.watch("control-loops", self.health)

    def health(self) -> str | None:
        return next((why for loop in self.loops.values() if (why := loop.health())), None)

    async def _loop(self, robot_id: str, context) -> ControlLoop:
        loop = self.loops.get(robot_id)
        if loop is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"robot {robot_id!r} is not connected. Fix: call Connect "
                                                           f"first (connected: {sorted(self.loops)})")
        return loop

    def _info(self, robot_id: str) -> pb.RobotInfo:
        loop = self.loops[robot_id]
        return pb.RobotInfo(robot_id=robot_id, driver=self.drivers[robot_id], joint_names=loop.driver.joint_names,
                            control_hz=1 / loop.period, watchdog_s=loop.watchdog_s,
                            limits=limits_message(robot_id, loop.hard), realtime=loop.realtime)

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
        if rid in self.loops:
            if self.drivers[rid] != request.driver:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"robot {rid!r} is connected with driver "
                                                                    f"{self.drivers[rid]!r}")
            return self._info(rid)
        if len(self.loops) >= MAX_ROBOTS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_ROBOTS} robots are connected already")
        try:
            driver = build_driver(request.driver, dict(request.options))
        except (ValueError, TypeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"driver {request.driver!r}: {exc}")
        loop = ControlLoop(rid, driver, hz, watchdog, spin)
        loop.start()
        self.loops[rid], self.drivers[rid] = loop, request.driver
        for _ in range(400):  # its first moments: what priority it got goes in the reply
            if loop.realtime != "not started":
                break
            await asyncio.sleep(0.005)
        log.info("robot connected", extra={"robot": rid, "driver": request.driver, "hz": hz, "watchdog_s": watchdog,
                                           "realtime": loop.realtime})
        return self._info(rid)

    async def Disconnect(self, request, context):
        loop = await self._loop(request.robot_id, context)
        del self.loops[request.robot_id], self.drivers[request.robot_id]
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)  # joins the loop thread, then brakes
        loop.driver.close()
        log.info("robot disconnected", extra={"robot": request.robot_id})
        return state_message(request.robot_id, loop.last)

    async def GetState(self, request, context):
        loop = await self._loop(request.robot_id, context)
        return state_message(request.robot_id, loop.last)

    async def _streamed(self, request_iterator, context, accept):
        """States of the first message's robot, one per tick, while ``accept`` takes each incoming message
        (returning why it refuses one: the stream then ends with INVALID_ARGUMENT and the watchdog holds the arm)."""
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

        async def read() -> str | None:
            async for message in request_iterator:
                if message.robot_id != rid:
                    return f"a message for robot {message.robot_id!r} on the stream of {rid!r}"
                if (why := accept(loop, message)) is not None:
                    return why
            return None

        if (why := accept(loop, first)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        loop.listeners.append(listener)
        reader = asyncio.create_task(read())
        try:
            while True:
                tick = await states.get()
                if reader.done() and (why := reader.result()) is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
                yield state_message(rid, tick)
        finally:
            reader.cancel()
            loop.listeners.remove(listener)

    @staticmethod
    def _position(loop: ControlLoop, command) -> np.ndarray | str:
        joints = loop.driver.joint_names
        position = np.asarray(command.position, dtype=float)
        if position.shape != (len(joints),) or not np.isfinite(position).all():
            return f"position needs {len(joints)} finite values ({', '.join(joints)}), got {len(command.position)}"
        return position

    async def Control(self, request_iterator, context):
        def accept(loop: ControlLoop, cmd) -> str | None:
            position = self._position(loop, cmd)
            if isinstance(position, str):
                return position
            loop.submit(position, cmd.seq)
            return None

        async for state in self._streamed(request_iterator, context, accept):
            yield state

    async def Teleop(self, request_iterator, context):
        kinds = pb.TeleopEvent.Kind
        ends = {kinds.SUCCESS: "success", kinds.FAILURE: "failure", kinds.RERECORD: "rerecord",
                kinds.TERMINATE: "terminate"}

        def accept(loop: ControlLoop, event) -> str | None:
            if event.kind in (kinds.COMMAND, kinds.INTERVENE_START):
                position = self._position(loop, event.command)
                if isinstance(position, str):
                    return position
                if event.kind == kinds.INTERVENE_START:
                    loop.intervene(True, position, event.command.seq)
                else:
                    loop.teleop_command(position, event.command.seq)
            elif event.kind == kinds.INTERVENE_STOP:
                loop.intervene(False)
            elif event.kind in ends:
                loop.end_episode(ends[event.kind])
            else:
                return f"unknown teleop event kind {event.kind}"
            return None

        async for state in self._streamed(request_iterator, context, accept):
            yield state

    async def SetLimits(self, request, context):
        loop = await self._loop(request.robot_id, context)
        current = loop.safety.limits
        changes = {name: np.asarray(getattr(request, name), float)
                   for name in ("position_min", "position_max", "velocity_max", "slew_max", "workspace_min",
                                "workspace_max") if len(getattr(request, name))}
        if request.jump_max:
            changes["jump_max"] = request.jump_max
        try:
            limits = loop.set_limits(current.merged(**changes))
        except LimitError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("limits set", extra={"robot": request.robot_id, "fields": sorted(changes)})
        return limits_message(request.robot_id, limits)

    async def EStop(self, request, context):
        loop = await self._loop(request.robot_id, context)
        loop.estop(request.reason[:200] or "requested")
        return state_message(request.robot_id, await self._next_tick(loop))

    async def ClearEStop(self, request, context):
        loop = await self._loop(request.robot_id, context)
        loop.clear()
        return state_message(request.robot_id, await self._next_tick(loop))

    @staticmethod
    async def _next_tick(loop: ControlLoop) -> Tick:
        """The first state after a change (within a few ticks), so a reply shows its effect."""
        seen = loop.last.tick
        for _ in range(100):
            if loop.last.tick > seen:
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

    def close(self) -> None:
        for loop in self.loops.values():
            loop.stop()
            loop.driver.close()


async def _build(runtime: ServiceRuntime, args) -> None:
    robot_gateway_pb2_grpc.add_RobotGatewayServicer_to_server(RobotGatewayService(runtime), runtime.server)


def main(argv: list[str] | None = None) -> None:
    run_service("robot_gateway", _build, argv)


if __name__ == "__main__":
    main()
