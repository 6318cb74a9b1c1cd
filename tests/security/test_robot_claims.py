"""docs/robot_safety.md (and the README's safety paragraph), sentence by sentence: the claims no other test held.
Each test's docstring quotes the sentence it guards.

Most run in-process and without a clock: the loop's tick (``ControlLoop._tick``) on a fake driver, its schedule
under a fake clock, the filter, and the gateway's handlers over a fake arm process. The rest drive a real arm
process (sim) on an in-process gateway; none asserts a duration."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
from rlfabric.services.robot_gateway import loop as loop_module
from rlfabric.services.robot_gateway.drivers import Driver, register_driver
from rlfabric.services.robot_gateway.drivers.sim import SimArm
from rlfabric.services.robot_gateway.loop import ControlLoop, TakeoverError, Tick
from rlfabric.services.robot_gateway.safety import Limits, SafetyFilter
from tests.robot_support import OPERATOR_SECRET, as_operator, gateway_in_process

ROOT = Path(__file__).resolve().parents[2]
HAS_MUJOCO = importlib.util.find_spec("mujoco") is not None
needs_mujoco = pytest.mark.skipif(not HAS_MUJOCO, reason="the sim arm needs mujoco")

HARD = Limits(position_min=np.array([-2.6, -1.6, -2.3]), position_max=np.array([2.6, 1.6, 2.3]),
              velocity_max=np.full(3, 2.0), slew_max=np.full(3, 0.05), jump_max=0.5,
              workspace_min=np.array([-3.0, -3.0, -3.0]), workspace_max=np.array([3.0, 3.0, 3.0]))
HZ = 100.0
STEP = min(2.0 / HZ, 0.05)  # min(velocity_max * dt, slew_max) of HARD at 100 Hz: 0.02 rad


class FakeArm(Driver):
    """Three joints whose end effector is the joint vector itself (so a workspace box is a box in joint space);
    ``position`` is what ``read`` measures, ``commands`` every target the loop sent."""

    joint_names = ["a", "b", "c"]

    def __init__(self, position: str = "0.1,0.2,0.3"):
        self.position = np.array([float(v) for v in position.split(",")])
        self.commands: list[np.ndarray] = []

    def hard_limits(self) -> Limits:
        return HARD

    def forward_kinematics(self, q: np.ndarray) -> np.ndarray:
        return np.asarray(q, float).copy()

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        return self.position.copy(), np.zeros(3)

    def command(self, target: np.ndarray, dt: float) -> None:
        self.commands.append(np.asarray(target, float).copy())


def _json(values) -> str:
    """A vector as JSON without spaces (one field of a line the test splits on spaces)."""
    return json.dumps([float(v) for v in values], separators=(",", ":"))


class MarkSim(SimArm):
    """A sim arm that notes what a test watches in the file ``marks`` (it lives in the arm's own process): its
    brake and close, with the scheduling policy of the thread calling them, and with ``log_commands`` every
    target it is sent, with the time (CLOCK_MONOTONIC: one clock for every process of the host)."""

    def __init__(self, **options: str):
        self.marks = open(options.pop("marks"), "a", buffering=1)  # noqa: SIM115 — closed in close()
        self.log_commands = options.pop("log_commands", "false") == "true"
        super().__init__(**options)

    def command(self, target: np.ndarray, dt: float) -> None:
        if self.log_commands:
            self.marks.write(f"command {time.monotonic()!r} {_json(target)}\n")
        super().command(target, dt)

    def brake(self) -> None:
        self.marks.write(f"brake {os.sched_getscheduler(0)} {_json(self.data.ctrl)}\n")
        super().brake()

    def close(self) -> None:
        self.marks.write(f"close {os.sched_getscheduler(0)} {_json(self.data.ctrl)} {_json(self.data.qpos)}\n")
        self.marks.close()
        super().close()


register_driver("claims_fake", f"{__name__}:FakeArm")
register_driver("claims_mark_sim", f"{__name__}:MarkSim")


def make_loop(watchdog_s: float = 0.1, **kwargs) -> tuple[ControlLoop, FakeArm]:
    arm = FakeArm()
    return ControlLoop("claims", arm, HZ, watchdog_s, **kwargs), arm


# -- every tick, in order ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estopped", [False, True])
@pytest.mark.parametrize("fault", ["", "jump: test"])
@pytest.mark.parametrize("command", ["none", "stale", "fresh"])
def test_a_tick_holds_by_precedence_estop_then_fault_then_watchdog_else_follows(estopped, fault, command):
    """robot_safety.md, "Every tick, in order": e-stop latched -> hold; fault latched -> hold; no valid command
    within the watchdog window (or none yet) -> hold; otherwise the newest command, through the safety filter.
    README: "every tick, in this order: a latched e-stop holds ...; a latched fault holds ...; no command within the
    watchdog window holds ...; otherwise the newest command is clipped ...". Every combination of the states gives
    the hold of the first that applies, and a hold sends the target the arm already had."""
    loop, arm = make_loop()
    held = loop.target.copy()
    now = time.monotonic()
    if command != "none":
        loop.submit(held + [0.1, 0.0, 0.0], 1)
        loop.command.received = now - (0.5 if command == "stale" else 0.0)
    loop.estopped, loop.fault = estopped, fault
    loop._tick(1, now, 0.0, 0.0)
    tick = loop.last
    expected = ("e-stop" if estopped else f"fault: {fault}" if fault else "no command yet" if command == "none"
                else "watchdog" if command == "stale" else "")
    if expected:
        assert tick.holding and tick.hold_reason.startswith(expected), tick.hold_reason
        assert np.array_equal(arm.commands[-1], held) and np.array_equal(tick.target, held)
    else:
        assert not tick.holding and np.allclose(arm.commands[-1], held + [STEP, 0.0, 0.0])


def _filter(**changes) -> SafetyFilter:
    limits = HARD.merged(**changes)
    limits.within(HARD)
    return SafetyFilter(limits, lambda q: np.asarray(q, float).copy())


def test_the_jump_check_comes_first_and_measures_from_the_measured_position_and_the_raw_command():
    """robot_safety.md, the filter: "For each command, in order: a command further than `jump_max` from the measured
    position faults (the arm holds; it never chases a far target); the command is clipped into [position_min,
    position_max]; ..." The jump is measured against where the arm is (not its target) and on the command as sent
    (before the clip), and it wins over a workspace exit."""
    f = _filter(position_max=np.array([0.2, 1.6, 2.3]), workspace_max=np.array([0.25, 3.0, 3.0]))
    measured, target = np.zeros(3), np.array([0.15, 0.0, 0.0])  # a servo 0.15 rad behind its target
    near_target = f.apply(np.array([-0.55, 0.0, 0.0]), measured, target, 0.01)  # 0.55 from measured: a jump
    assert near_target.fault.startswith("jump") and np.array_equal(near_target.target, target)
    far_from_target = f.apply(np.array([-0.45, 0.0, 0.0]), measured, target, 0.01)  # 0.6 from target, 0.45 measured
    assert not far_from_target.fault and far_from_target.target[0] == pytest.approx(0.15 - STEP)
    # 0.6 rad out: a jump, though clipping first would have made it 0.2 (and its hand out of the workspace)
    raw = f.apply(np.array([0.6, 0.0, 0.0]), measured, target, 0.01)
    assert raw.fault.startswith("jump") and np.array_equal(raw.target, target)


def test_the_filter_clips_then_bounds_the_step_by_the_tighter_limit_then_clips_again_then_checks_the_workspace():
    """robot_safety.md: "the command is clipped into [position_min, position_max]; the target moves at most
    min(velocity_max * dt, slew_max) per joint from the last target; the result is clipped into the position limits
    once more (belt and braces: no step may carry a target out of them); and a target whose end effector ... leaves
    the workspace box faults." README: "clipped to the position limits, moved at most velocity_max x dt and
    slew_max per tick, and clipped into the position limits once more"."""
    f = _filter(position_max=np.array([0.2, 1.6, 2.3]), slew_max=np.array([0.05, 0.01, 0.05]))
    q = np.zeros(3)
    # clip: a command past the limit ends at the limit, flagged clipped (within jump_max of the arm)
    out = f.apply(np.array([0.45, 0.0, 0.0]), q, np.array([0.19, 0.0, 0.0]), 0.01)
    assert out.clipped and out.target[0] == pytest.approx(0.2) and not out.fault
    # the step: velocity_max * dt (2 * 0.01 = 0.02) when tighter; slew_max (0.01 on joint 1) when that is
    out = f.apply(np.array([0.3, 0.3, 0.3]), q, q, 0.01)
    assert out.slowed and np.allclose(out.target, [0.02, 0.01, 0.02])
    out = f.apply(np.array([0.3, 0.3, 0.3]), q, q, 0.1)  # 2 * 0.1 = 0.2: the slew limit binds every joint
    assert np.allclose(out.target, [0.05, 0.01, 0.05])
    # clipped once more: a last target outside the limits is brought inside, not merely stepped toward them
    out = f.apply(np.array([0.1, 0.0, 0.0]), np.array([0.3, 0.0, 0.0]), np.array([0.3, 0.0, 0.0]), 0.01)
    assert out.target[0] == pytest.approx(0.2), out.target  # a step alone would give 0.28
    # the workspace is checked last, on the target the steps made (not the command): a command whose hand is out
    # but whose step is in moves; a step that takes the hand out faults and holds
    box = _filter(workspace_max=np.array([0.25, 3.0, 3.0]))
    moved = box.apply(np.array([0.45, 0.0, 0.0]), np.array([0.2, 0.0, 0.0]), np.array([0.2, 0.0, 0.0]), 0.01)
    assert not moved.fault and moved.target[0] == pytest.approx(0.22)
    stopped = box.apply(np.array([0.45, 0.0, 0.0]), np.array([0.24, 0.0, 0.0]), np.array([0.24, 0.0, 0.0]), 0.01)
    assert stopped.fault.startswith("workspace") and stopped.target[0] == pytest.approx(0.24)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2), st.sampled_from(["velocity_max", "slew_max"]),
       st.lists(st.lists(st.floats(-3.0, 3.0), min_size=3, max_size=3), min_size=1, max_size=20),
       st.floats(1e-4, 0.1))
def test_a_zero_velocity_or_slew_limit_freezes_its_joint_under_any_command(joint, bound, stream, dt):
    """robot_safety.md: "`velocity_max` and `slew_max` >= 0 (0 freezes a joint)". SetLimits accepts the 0, and from
    then on no command moves that joint's target (the arm tracks it: measured = target)."""
    values = getattr(HARD, bound).copy()
    values[joint] = 0.0
    f = _filter(**{bound: values})  # accepted (``within`` raises otherwise)
    target = np.array([0.1, -0.2, 0.3])
    frozen = target[joint]
    for command in stream:
        target = f.apply(np.array(command), target.copy(), target, dt).target
        assert target[joint] == frozen


def test_the_first_hold_keeps_the_measured_position_and_leaving_a_hold_steps_from_the_held_target():
    """robot_safety.md: "A hold keeps the current target: the last target the loop sent (the measured position only
    before any target was sent). It never re-targets the measured position ... Leaving a hold, the velocity and slew
    limits count from that same target." The arm's measured position drifts (a servo's tracking error) while it
    holds; the hold keeps sending the first measured position, and the first move steps from it, not from where
    the arm sags to."""
    loop, arm = make_loop()
    first = arm.position.copy()
    arm.position = first + 0.01  # it sags while held
    now = time.monotonic()
    loop._tick(1, now, 0.0, 0.0)
    assert loop.last.hold_reason == "no command yet" and np.array_equal(arm.commands[-1], first)
    arm.position = first - [0.03, 0.0, 0.0]  # a tracking error against the direction of the next command
    loop.submit(first + [0.2, 0.0, 0.0], 1)
    loop._tick(2, loop.command.received, 0.0, 0.0)
    assert not loop.last.holding and np.allclose(arm.commands[-1], first + [STEP, 0.0, 0.0])  # from the target
    moved = arm.commands[-1].copy()
    loop._tick(3, loop.command.received + 0.5, 0.0, 0.0)  # the command went stale: a watchdog hold
    assert loop.last.hold_reason.startswith("watchdog") and np.array_equal(arm.commands[-1], moved)
    arm.position = moved - [0.04, 0.0, 0.0]
    loop.submit(first + [0.2, 0.0, 0.0], 2)
    loop._tick(4, loop.command.received, 0.0, 0.0)
    assert np.allclose(arm.commands[-1], moved + [STEP, 0.0, 0.0])


def test_a_watchdog_hold_ends_with_the_next_command():
    """robot_safety.md: "Watchdog holds, which the run itself causes (its commands stopped), end with its next
    command, as before." (No ClearEStop: unlike a latch, nothing stays behind.)"""
    loop, arm = make_loop()
    loop.submit(arm.position + [0.1, 0.0, 0.0], 1)
    loop._tick(1, loop.command.received + 0.2, 0.0, 0.0)
    assert loop.last.hold_reason.startswith("watchdog") and not loop.last.fault
    loop.submit(arm.position + [0.1, 0.0, 0.0], 2)
    loop._tick(2, loop.command.received, 0.0, 0.0)
    assert not loop.last.holding and loop.last.command_seq == 2 and loop.health() is None


def test_a_takeover_whose_owner_went_away_stays_belongs_to_no_one_and_anyone_may_take_it_or_stop_it():
    """robot_safety.md: "When the owner's stream ends, its takeover stays (its commands go stale and the watchdog
    holds the arm) and belongs to no one, so anyone may then take over or stop it."""
    loop, arm = make_loop()
    owner, other, third = object(), object(), object()
    loop.intervene(True, arm.position, 1, owner=owner)
    with pytest.raises(TakeoverError):
        loop.intervene(False, owner=other)
    loop.release(owner)  # the owner's stream ended
    assert loop.intervening and loop.intervention_owner is None  # it stays, nobody's
    loop._tick(1, loop.human.received + 0.5, 0.0, 0.0)
    assert loop.last.intervening and loop.last.hold_reason.startswith("watchdog: no teleop command")
    assert loop.teleop_command(arm.position, 2, owner=other)  # anyone may command it ...
    loop.intervene(True, arm.position, 3, owner=other)  # ... or take it over: then it is theirs
    with pytest.raises(TakeoverError, match="taken over"):
        loop.intervene(False, owner=third)
    loop.release(other)
    loop.intervene(False, owner=third)  # ... or stop it
    assert not loop.intervening


# -- the schedule, under a fake clock ------------------------------------------------------------------------------
class FakeClock:
    """``time`` as the loop module uses it: ``sleep(0)`` (one turn of the spin) advances 10 microseconds."""

    def __init__(self):
        self.now, self.spins = 5000.0, 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.spins += seconds == 0
        self.now += seconds or 1e-5


def run_ticks(loop: ControlLoop, clock: FakeClock, ticks: int, late: dict[int, float] | None = None):
    """Run ``loop`` on the fake clock (no real-time claim on this process) for ``ticks`` ticks; tick i (from 1)
    wakes ``late[i]`` seconds after its deadline. Returns the start, the deadlines it slept to and its ticks."""
    late, asked, seen = late or {}, [], []

    def idle(until: float) -> None:
        if until == 0.0:  # the serve-before-the-tick call
            return
        asked.append(until + loop.spin_s)
        clock.now = max(clock.now, until)
        if len(asked) in late:
            clock.now = asked[-1] + late[len(asked)]

    def on_tick(tick: Tick) -> None:
        seen.append(tick)
        if len(seen) >= ticks:
            loop.halt()

    loop.idle, loop._claim_realtime = idle, lambda: "test: none"
    loop.listeners.append(on_tick)
    start = clock.now
    loop.run()
    return start, asked, seen


def test_the_loop_keeps_an_absolute_schedule_through_a_late_tick_and_an_overrun(monkeypatch):
    """robot_safety.md: "The loop (loop.py) runs one tick per period against absolute deadlines": tick k is due at
    start + k * period; a late tick does not push the ones after it, and after an overrun it skips to the next
    deadline ahead on the same grid (no drift)."""
    clock = FakeClock()
    monkeypatch.setattr(loop_module, "time", clock)
    loop, _ = make_loop(watchdog_s=1.0)
    period = loop.period
    start, deadlines, ticks = run_ticks(loop, clock, 12, late={3: 0.6 * period, 6: 2.5 * period})
    grid = [(d - start) / period for d in deadlines]
    assert all(abs(g - round(g)) < 1e-6 for g in grid), grid  # every deadline is start + k * period
    ks = [round(g) for g in grid]
    assert ks[:6] == [1, 2, 3, 4, 5, 6]  # tick 3 woke 0.6 period late; tick 4 is still due at start + 4 periods
    assert ks[6] == 9 and ks[6:] == list(range(9, 9 + len(ks) - 6))  # woke at 8.5 periods: the next is 9, then on
    assert [t.tick for t in ticks] == [1, 2, 3, 4, 5, 8, *range(9, 9 + len(ks) - 6)][:len(ticks)]
    assert ticks[3].lateness_s < 1e-4 and ticks[6].lateness_s < 1e-4  # back on time right after each


def test_a_late_tick_is_an_overrun_only_past_a_whole_period_and_a_fault_past_the_watchdog_window(monkeypatch):
    """robot_safety.md: "A tick late by less than the window only counts as an overrun (a metric) when it is later
    than a whole period." And "A tick later than the watchdog window latches a fault"."""
    from prometheus_client import REGISTRY

    clock = FakeClock()
    monkeypatch.setattr(loop_module, "time", clock)
    loop, _ = make_loop(watchdog_s=0.05)  # five periods
    period = loop.period
    _, _, ticks = run_ticks(loop, clock, 8, late={2: 0.9 * period, 4: 1.1 * period, 6: 6 * period})
    late_09, late_11 = ticks[1], ticks[3]
    assert late_09.lateness_s == pytest.approx(0.9 * period, abs=1e-4) and late_09.overruns == 0
    assert late_11.lateness_s == pytest.approx(1.1 * period, abs=1e-4) and late_11.overruns == 1
    assert all(not t.fault for t in ticks[:5])
    missed = ticks[5]
    assert missed.overruns == 2 and missed.fault.startswith("deadline") and missed.holding
    assert REGISTRY.get_sample_value("rlfabric_robot_loop_overruns_total", {"robot": "claims"}) >= 2
    assert "missed its deadline" in loop.health()


@pytest.mark.parametrize("spin_s, spins", [(None, True), (0.0, False)])
def test_the_loop_spins_its_default_1_ms_before_each_deadline_and_never_with_spin_0(monkeypatch, spin_s, spins):
    """robot_safety.md: "The loop sleeps to just before its deadline and spins the last `spin_s` (default 1 ms;
    `ConnectRequest.spin_s`, -1: never spin)." The loop built without spin_s sleeps to 1 ms before each deadline
    and spins the rest; with 0 (what Connect makes of -1) it never spins."""
    clock = FakeClock()
    monkeypatch.setattr(loop_module, "time", clock)
    loop, _ = make_loop(**({} if spin_s is None else {"spin_s": spin_s}))
    start, deadlines, ticks = run_ticks(loop, clock, 5)
    assert loop.spin_s == (0.001 if spin_s is None else 0.0)
    assert (clock.spins > 0) == spins and all(t.lateness_s < 1e-4 for t in ticks)
    if spins:
        assert clock.spins >= 5 * 90  # ~1 ms of 10-microsecond turns per tick


# -- the gateway's handlers over a fake arm process ----------------------------------------------------------------
class FakeArmProcess:
    """What the gateway's handlers use of an ArmProcess, without a process: records how it was made and asked."""

    made: list[FakeArmProcess] = []

    def __init__(self, robot_id, driver, options, hz, watchdog_s, spin_s, camera_size=0, camera_hz=30.0):
        self.robot_id, self.period, self.watchdog_s, self.spin_s = robot_id, 1.0 / hz, watchdog_s, spin_s
        self.driver, self.hard, self.limits = SimpleNamespace(joint_names=["a", "b", "c"]), HARD, HARD
        self.target = np.zeros(3)
        self.realtime, self.lock = "fake", threading.Lock()
        self.listeners, self.intervention_listeners = [], []
        self.estopped, self.fault, self.missed, self.calls = False, "", "", []
        self.applies_estop = True
        self.last = Tick(1, time.monotonic(), np.zeros(3), np.zeros(3), np.zeros(3), False, "", True,
                         "no command yet", 0.0, 0.0, 0, -1)
        FakeArmProcess.made.append(self)

    @property
    def safety(self):
        return self

    def _ticked(self, **changes) -> None:
        from dataclasses import replace

        self.last = replace(self.last, tick=self.last.tick + 1, time=time.monotonic() + 1.0, **changes)

    def estop(self, reason: str) -> None:
        self.calls.append(("estop", reason))
        if self.applies_estop:
            self.estopped = True
            self._ticked(estopped=True, holding=True, hold_reason="e-stop")

    def latch_fault(self, fault: str) -> None:
        self.calls.append(("latch_fault", fault))
        self.fault = fault

    def set_limits(self, limits: Limits) -> Limits:
        self.calls.append(("set_limits", limits))
        self.limits = limits
        return limits

    def clear(self) -> None:
        self.estopped, self.fault, self.missed = False, "", ""
        self._ticked(estopped=False, fault="")

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def health(self) -> str | None:
        return self.missed or None


@pytest.fixture
def fake_gateway(monkeypatch):
    """A RobotGatewayService whose arms are FakeArmProcesses; ``call(handler, request, metadata)`` runs a handler
    on a fresh event loop and returns its reply (or raises Aborted)."""
    from rlfabric.services.robot_gateway import server
    from tests.conftest import Aborted, AbortingContext  # (here: the arm processes below import this module)
    from tests.robot_support import _Runtime

    monkeypatch.setattr(server, "ArmProcess", FakeArmProcess)
    FakeArmProcess.made = []

    def make(runtime=None):
        return server.RobotGatewayService(runtime or _Runtime(), operator_secret=OPERATOR_SECRET)

    def call(handler, request, metadata=()):
        return asyncio.run(handler(request, AbortingContext(metadata)))

    return SimpleNamespace(make=make, call=call, Aborted=Aborted, context=AbortingContext)


def _connect_request(rid: str, name: str | None = None, **fields) -> pb.ConnectRequest:
    return pb.ConnectRequest(robot_id=rid, driver="sim", options={"name": name or rid}, control_hz=100,
                             watchdog_s=0.1, **fields)


def test_a_gateway_serves_16_robots_and_refuses_the_17th(fake_gateway):
    """robot_safety.md, "Bounds the gateway keeps": "Up to 16 robots per gateway"."""
    service = fake_gateway.make()
    for i in range(16):
        fake_gateway.call(service.Connect, _connect_request(f"r{i}"))
    assert len(service.loops) == 16
    with pytest.raises(fake_gateway.Aborted) as err:
        fake_gateway.call(service.Connect, _connect_request("r16"))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "16 robots" in err.value.details
    assert "r16" not in service.loops and "sim:r16" not in service.devices  # nothing of it is left behind


def test_a_gateway_remembers_the_safety_state_of_1024_devices_and_refuses_a_1025th(fake_gateway):
    """robot_safety.md: "... and safety state for 1024 devices"; "The gateway remembers this state while it runs
    (up to 1024 devices)". 1023 real arms' latches kept, one more device fits; the next is refused rather than a
    remembered latch dropped. (A simulated arm's record that no one holds is dropped to make room.)"""
    from rlfabric.services.robot_gateway.server import Device

    service = fake_gateway.make()
    for i in range(1023):
        key = f"franka:10.0.{i // 256}.{i % 256}"
        service.devices[key] = Device(key, "franka", estopped=True)
    fake_gateway.call(service.Connect, _connect_request("fits"))  # the 1024th: connected, so held
    assert len(service.devices) == 1024 and service.devices["sim:fits"].holder == "fits"
    with pytest.raises(fake_gateway.Aborted) as err:
        fake_gateway.call(service.Connect, _connect_request("one-more"))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1024 devices" in err.value.details
    assert len(service.devices) == 1024 and sum(d.estopped for d in service.devices.values()) == 1023


def test_a_gateway_restart_forgets_every_latch(fake_gateway):
    """robot_safety.md: "it does not survive a restart of the gateway process. After a restart, treat every arm as
    un-e-stopped and narrow its limits again." The same gateway brings a device's e-stop, fault and limits back on
    a reconnect; a new gateway (a restart: its state is its process's) brings nothing back."""
    first = fake_gateway.make()
    fake_gateway.call(first.Connect, _connect_request("arm"))
    arm = first.loops["arm"]
    arm.estopped, arm.fault = True, "jump: test"
    arm.limits = HARD.merged(velocity_max=np.full(3, 1.0))
    fake_gateway.call(first.Disconnect, pb.RobotRef(robot_id="arm"))
    fake_gateway.call(first.Connect, _connect_request("arm"))
    kinds = [c[0] for c in FakeArmProcess.made[-1].calls]
    assert kinds == ["estop", "latch_fault", "set_limits"], kinds  # the same gateway restores all three
    restarted = fake_gateway.make()
    fake_gateway.call(restarted.Connect, _connect_request("arm"))
    assert FakeArmProcess.made[-1].calls == [] and restarted.devices["sim:arm"].limits is None


class _SlowArmProcess(FakeArmProcess):
    """A fake arm process whose start (a driver's probe) and stop (brake, close) take a while off the event loop, so
    that a Connect and a Disconnect of one id overlap; it notes whether it was stopped."""

    def __init__(self, *args, **kwargs):
        time.sleep(0.02)
        super().__init__(*args, **kwargs)
        self.stopped = False

    def stop(self) -> None:
        time.sleep(0.05)
        self.stopped = True


@pytest.mark.parametrize("first", ["disconnect", "connect"])
def test_a_connect_racing_a_disconnect_of_one_id_leaves_no_arm_process_that_disconnect_cannot_reach(
        fake_gateway, monkeypatch, first):
    """robot_safety.md: "Connect and Disconnect of one id run one at a time, so two concurrent Connects never leave a
    loop that Disconnect cannot reach." A connected arm, then a Connect and a Disconnect of its id at once (either
    call first; the arm process's stop takes a while): afterwards no arm process is left, or one that a later
    Disconnect stops; none runs on unreachable (an orphan would keep ticking, its device record gone)."""
    from rlfabric.services.robot_gateway import server

    monkeypatch.setattr(server, "ArmProcess", _SlowArmProcess)
    service = fake_gateway.make()
    ctx, ref = fake_gateway.context, pb.RobotRef(robot_id="arm")

    async def scenario() -> list:
        await service.Connect(_connect_request("arm"), ctx())
        calls = [service.Disconnect(ref, ctx()), service.Connect(_connect_request("arm"), ctx())]
        raced = await asyncio.gather(*(calls if first == "disconnect" else calls[::-1]), return_exceptions=True)
        if "arm" in service.loops:  # what the race left: a later Disconnect must reach it
            raced += await asyncio.gather(service.Disconnect(ref, ctx()), return_exceptions=True)
        return raced

    raced = asyncio.run(scenario())
    # only a Disconnect that found nothing connected may be refused (NOT_FOUND); nothing else fails
    refused = [r for r in raced if isinstance(r, BaseException)]
    assert all(isinstance(r, fake_gateway.Aborted) and r.code == grpc.StatusCode.NOT_FOUND for r in refused), refused
    made = FakeArmProcess.made
    assert made and all(p.stopped for p in made), [(p.robot_id, p.stopped) for p in made]  # no orphan
    assert service.loops == {} and service.device_of == {} and service.id_locks == {}
    assert all(d.holder is None for d in service.devices.values())


def test_clear_estop_takes_the_hkdf_derived_operator_credential_in_the_metadata_key_rlfabric_operator(fake_gateway):
    """robot_safety.md: "`ClearEStop` takes the operator's credential beside the deployment's bearer: metadata
    `rlfabric-operator`, derived (HKDF-SHA256) from the secret in the gateway's `--operator-token-file`". The key is
    literally "rlfabric-operator" (the constant the gateway reads), and what it accepts there is the secret's HKDF
    (an independent HKDF, the cryptography package's): not the secret itself, not another label's derivation, and
    not the credential under another key."""
    import base64

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from rlfabric.services.core import auth

    def hkdf(label: str) -> str:
        raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"rlfabric/hkdf/v1",
                   info=label.encode()).derive(OPERATOR_SECRET.encode())
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    assert auth.OPERATOR_METADATA_KEY == "rlfabric-operator"
    credential = hkdf("rlfabric/robot-operator")
    service = fake_gateway.make()
    fake_gateway.call(service.Connect, _connect_request("arm"))
    for metadata in ((("rlfabric-operator", OPERATOR_SECRET),),  # the secret itself
                     (("rlfabric-operator", hkdf("rlfabric/grpc-bearer")),),  # another label's derivation
                     (("authorization", f"Bearer {credential}"),), (("x-rlfabric-operator", credential),), ()):
        service.loops["arm"].estopped = True
        with pytest.raises(fake_gateway.Aborted) as err:
            fake_gateway.call(service.ClearEStop, pb.RobotRef(robot_id="arm"), metadata)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, metadata
        assert service.loops["arm"].estopped, metadata  # still latched
    cleared = fake_gateway.call(service.ClearEStop, pb.RobotRef(robot_id="arm"), (("rlfabric-operator", credential),))
    assert not cleared.estopped and not service.loops["arm"].estopped


def test_no_run_service_takes_the_operator_secret_by_flag_environment_launcher_or_compose(monkeypatch, tmp_path,
                                                                                         capsys):
    """robot_safety.md: the operator's credential is "derived (HKDF-SHA256) from the secret in the gateway's
    `--operator-token-file` (`RLFABRIC_OPERATOR_TOKEN_FILE`) ... Run services never hold it." Each role's parser,
    built as `rlfabric serve ROLE` builds it (the shared flags, the role's own, RLFABRIC_* defaults): only
    robot_gateway's takes --operator-token-file (and RLFABRIC_OPERATOR_TOKEN_FILE); the others refuse the flag and
    ignore the variable. A LocalStack gives its services neither (their environment drops it, their flags name no
    operator secret), and compose/docker-compose.yml gives none to coordinator, env, rollout, learner or replay."""
    import argparse
    import importlib
    import shutil

    import yaml

    from rlfabric.services import launcher
    from rlfabric.services.cli import SERVICES
    from rlfabric.services.core import auth
    from rlfabric.services.core.runtime import ServiceOptions, apply_env_defaults

    operator_file = str(tmp_path / "operator-token")
    monkeypatch.setenv(auth.OPERATOR_TOKEN_FILE_ENV, operator_file)
    monkeypatch.setenv("MUJOCO_GL", os.environ.get("MUJOCO_GL", ""))  # (robot_gateway's main may set it: restored)
    assert set(SERVICES) == {"coordinator", "env", "rollout", "learner", "replay"}

    def parser_of(role: str) -> argparse.ArgumentParser:
        module = importlib.import_module(f"rlfabric.services.{role}.server")
        got: dict = {}
        monkeypatch.setattr(module, "run_service", lambda name, build, argv=None, extra_args=None: got.update(
            name=name, extra=extra_args))
        module.main([])
        assert got["name"] == role
        parser = argparse.ArgumentParser(prog=f"rlfabric serve {role}")  # as runtime.run_service builds it
        ServiceOptions.add_arguments(parser)
        if got["extra"]:
            got["extra"](parser)
        apply_env_defaults(parser, ignore=("--coordinator",) if role == "coordinator" else ())
        return parser

    gateway = parser_of("robot_gateway")
    assert gateway.parse_args([]).operator_token_file == operator_file  # the flag, and its variable
    for role in SERVICES:
        parser = parser_of(role)
        assert not [flag for flag in parser._option_string_actions if "operator" in flag], role
        assert not [v for v in vars(parser.parse_args([])).values() if v == operator_file], role
        with pytest.raises(SystemExit):
            parser.parse_args(["--operator-token-file", operator_file])
        assert "unrecognized arguments: --operator-token-file" in capsys.readouterr().err, role

    spawned: list[tuple[str, list[str], dict[str, str]]] = []

    class Process:  # the forkserver's Process, recorded instead of started
        def __init__(self, target, name, args):
            module, argv, _, env, _ = args
            spawned.append((module, argv, env))
            self.pid = None

        def start(self) -> None:
            pass

    monkeypatch.setattr(launcher, "_forkserver_context", lambda threads: SimpleNamespace(Process=Process))
    monkeypatch.setattr(launcher, "prestart", lambda threads=1: None)
    monkeypatch.setattr(auth, "configure", lambda *args, **kwargs: None)  # (this process's own client security)
    stack = launcher.LocalStack(log_dir=tmp_path / "logs", runs_root=tmp_path / "runs", token=auth.generate_token())
    stack.preload = True
    stack.spawn_coordinator()
    try:
        stack.spawn_workers(launcher.WORKER_ROLES)
    finally:
        shutil.rmtree(stack.port_file.parent, ignore_errors=True)
    assert sorted(m.split(".")[-2] for m, _, _ in spawned) == sorted(["coordinator", *launcher.WORKER_ROLES])
    for module, argv, env in spawned:
        assert env[auth.TOKEN_ENV] == stack.token  # the service's own environment, with the stack's secret
        assert not [k for k in env if "OPERATOR" in k.upper()], module
        assert not [a for a in argv if "operator" in a.lower()], module
    assert launcher._service_env(1, stack.token).get(auth.OPERATOR_TOKEN_FILE_ENV) is None

    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())["services"]
    for role in SERVICES:
        service = compose[role]
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        assert not [k for k, v in environment.items() if "OPERATOR" in k.upper() or "operator" in str(v).lower()]
        assert not [a for a in service.get("command") or [] if "operator" in str(a).lower()], role
        assert not [x for key in ("env_file", "secrets", "volumes") for x in service.get(key) or []
                    if "operator" in str(x).lower()], role


@pytest.mark.parametrize("spin_s, used", [(0.0, 0.001), (-1.0, 0.0), (0.002, 0.002)])
def test_connect_gives_the_arm_process_a_1_ms_spin_by_default_and_none_for_minus_1(fake_gateway, spin_s, used):
    """robot_safety.md: "spins the last `spin_s` (default 1 ms; `ConnectRequest.spin_s`, -1: never spin)": what
    Connect hands the arm's process, which builds its loop with it (below)."""
    service = fake_gateway.make()
    fake_gateway.call(service.Connect, _connect_request("arm", spin_s=spin_s))
    assert service.loops["arm"].spin_s == used


def test_the_arm_process_builds_its_loop_with_the_spin_it_was_given():
    """robot_safety.md, spin_s: the arm process's loop runs with the spin Connect gave it (0: never spin)."""
    import socket

    from rlfabric.services.robot_gateway.arm_process import _Serve
    from rlfabric.services.robot_gateway.drivers import DRIVERS

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        for spin in (0.0, 0.001):
            serve = _Serve(a, b)
            serve.build({"target": DRIVERS.target("claims_fake"), "driver": "claims_fake", "options": {},
                         "robot_id": "spin", "hz": HZ, "watchdog_s": 0.1, "spin_s": spin, "camera_size": 0,
                         "camera_hz": 30.0})
            assert serve.loop.spin_s == spin
    finally:
        a.close()
        b.close()


_SPRUNG: list[str] = []  # what unpickling a _Trap does: a pickle a reader loads lands here


def _spring(mark: str) -> None:
    _SPRUNG.append(mark)


class _Trap:
    """Pickled, a call of ``_spring``: whoever unpickles it runs code of the sender's choosing."""

    def __reduce__(self):
        return _spring, ("unpickled",)


def _serving(rid: str) -> tuple:
    """An arm process's server (``_Serve``) on a fake arm, built as the arm process builds it, over a socket pair;
    and the gateway's end of the pair."""
    import socket

    from rlfabric.services.robot_gateway.arm_process import _Serve
    from rlfabric.services.robot_gateway.drivers import DRIVERS

    mine, gateway = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    serve = _Serve(mine, mine)
    serve.build({"target": DRIVERS.target("claims_fake"), "driver": "claims_fake", "options": {}, "robot_id": rid,
                 "hz": HZ, "watchdog_s": 0.1, "spin_s": 0.0, "camera_size": 0, "camera_hz": 30.0})
    mine.setblocking(False)  # as its main() leaves it once built
    return serve, gateway


def _gateway_side(sock, rid: str):
    """The gateway's side of an arm process (``ArmProcess``) reading ``sock``, without starting a process: the
    attributes its reader (``_read``) uses, as its constructor makes them."""
    from rlfabric.services.robot_gateway import arm_process
    from rlfabric.services.robot_gateway.series import robot_series

    arm = arm_process.ArmProcess.__new__(arm_process.ArmProcess)
    arm.robot_id, arm.period, arm.sock = rid, 1 / HZ, sock
    arm.holding_metric, arm.lateness_metric, arm.jitter_metric, arm.overruns_metric, arm.intervened_metric = (
        robot_series(m, rid) for m in (loop_module.HOLDING, loop_module.LATENESS, loop_module.JITTER,
                                       loop_module.OVERRUNS, loop_module.INTERVENED))
    arm.dropped_metric = robot_series(arm_process.STATES_DROPPED, rid)
    arm.lock, arm.listeners, arm.intervention_listeners = threading.Lock(), [], []
    arm.realtime, arm.error, arm.missed, arm.dropped = "not started", None, "", 0
    arm.estopped, arm.fault, arm.episode, arm.target = False, "", 0, np.zeros(3)
    arm._answers, arm._stopped, arm._final = {}, threading.Event(), None
    arm.proc = SimpleNamespace(wait=lambda: 0)  # (no process: its exit code)
    return arm


def test_the_arm_processs_socket_carries_json_and_a_pickle_is_refused_never_loaded():
    """robot_safety.md: "between ticks it serves the gateway's requests on a local socket (JSON; nothing is
    pickled)". A request that is a pickle (one whose loading would run code) is refused by the arm process's reader
    (``_Serve.drain``: a ValueError, and the arm process's loop then dies and brakes) and by the gateway's reader
    alike, and never loaded; a JSON request is served, and its answer and each tick's state go back as JSON."""
    import pickle

    from rlfabric.services.robot_gateway import series

    payload = pickle.dumps(_Trap())
    pickle.loads(payload)  # (the trap works: loading it runs _spring)
    assert _SPRUNG == ["unpickled"]
    _SPRUNG.clear()
    serve, gateway = _serving("json-only")
    try:
        gateway.send(payload)
        with pytest.raises(ValueError):
            serve.drain()
        assert _SPRUNG == [] and not serve.loop.estopped
        gateway.send(json.dumps({"call": "estop", "id": 7, "reason": "test"}).encode())
        gateway.send(json.dumps({"call": "no-such-call", "id": 8}).encode())
        assert serve.drain() and serve.loop.estopped
        assert json.loads(gateway.recv(65536)) == {"id": 7, "ok": True}
        refused = json.loads(gateway.recv(65536))
        assert refused["id"] == 8 and refused["error"][0] == "ValueError", refused
        serve.loop._tick(1, time.monotonic(), 0.0, 0.0)
        serve.publish(serve.loop.last)
        state = json.loads(gateway.recv(65536))
        assert state["tick"]["tick"] == 1 and state["tick"]["estopped"] and state["tick"]["hold_reason"] == "e-stop"
        serve.sock.send(payload)  # and the other way: the gateway's reader refuses a pickle too
        with pytest.raises(ValueError):
            _gateway_side(gateway, "json-only")._read()
        assert _SPRUNG == []
    finally:
        serve.sock.close()
        gateway.close()
        series.forget("json-only")


def test_states_the_gateway_was_too_slow_to_read_are_counted_in_its_own_prometheus_counter():
    """robot_safety.md: "Every tick's state goes back without blocking: a gateway too slow to read loses states
    (counted: `rlfabric_robot_states_dropped_total`), never the loop's time." The arm process's server publishes
    to a gateway that reads nothing until its socket is full (those states are lost, counted there); then the
    gateway's reader (ArmProcess._read) takes the next state, which carries the count, and the gateway's own
    counter rlfabric_robot_states_dropped_total{robot} grows by it."""
    from prometheus_client import REGISTRY

    from rlfabric.services.robot_gateway import series

    rid = "slow-reader"
    serve, gateway = _serving(rid)
    try:
        arm = _gateway_side(gateway, rid)

        def dropped_total() -> float | None:
            return REGISTRY.get_sample_value("rlfabric_robot_states_dropped_total", {"robot": rid})

        assert dropped_total() == 0.0
        for _ in range(5000):  # the gateway reads nothing: the socket fills, then states are lost
            serve.publish(serve.loop.last)
            if serve.dropped:
                break
        lost = serve.dropped
        assert lost > 0 and dropped_total() == 0.0
        reader = threading.Thread(target=arm._read, daemon=True)
        reader.start()
        for _ in range(10_000):  # the gateway reads again: the next state that gets through carries the count
            if arm.dropped:
                break
            serve.publish(serve.loop.last)
            time.sleep(0.001)
        serve.sock.close()
        reader.join(5)
        assert arm.dropped >= lost and dropped_total() == arm.dropped, (lost, arm.dropped, dropped_total())
    finally:
        serve.sock.close()
        gateway.close()
        series.forget(rid)


def test_estop_answers_after_25_periods_anyway_and_logs_the_age_of_the_last_tick(fake_gateway, monkeypatch, caplog):
    """robot_safety.md: "A loop stuck in its driver's I/O ... cannot act on it: after 25 periods EStop answers
    anyway, with `estop_requested` and without `estopped`, and logs an error with the age of the last tick"."""
    from rlfabric.services.robot_gateway import server

    service = fake_gateway.make()
    fake_gateway.call(service.Connect, _connect_request("stuck"))
    arm = service.loops["stuck"]
    arm.applies_estop = False  # no tick comes
    arm.last = Tick(7, time.monotonic() - 5.0, np.zeros(3), np.zeros(3), np.zeros(3), False, "", False, "", 0.0,
                    0.0, 0, 1)
    slept = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(server.asyncio, "sleep", sleep)
    with caplog.at_level(logging.ERROR, logger="rlfabric.services.robot_gateway.server"):
        reply = fake_gateway.call(service.EStop, pb.EStopRequest(robot_id="stuck", reason="test"))
    assert reply.estop_requested and not reply.estopped and reply.seq == 7
    assert sum(slept) == pytest.approx(25 * arm.period)
    record = next(r for r in caplog.records if "not yet applied" in r.getMessage())
    assert record.levelno == logging.ERROR and record.last_tick_age_s >= 5.0 and record.robot == "stuck"


def test_a_missed_deadline_turns_the_health_check_not_serving_until_the_operators_clear(fake_gateway):
    """robot_safety.md: "the gateway's health check turns NOT_SERVING and names the arm and how late the tick was,
    until the operator's ClearEStop"."""
    from grpc_health.v1 import health_pb2

    from rlfabric.services.core.runtime import ServiceOptions, ServiceRuntime

    async def scenario():
        runtime = ServiceRuntime(ServiceOptions(role="robot_gateway"))
        service = fake_gateway.make(runtime)
        await service.Connect(_connect_request("arm"), fake_gateway.context())
        service.loops["arm"].missed = "the control loop of arm missed its deadline (a tick woke 412.0 ms late)"
        runtime.check_components()
        await asyncio.sleep(0.05)
        during = runtime.health._server_status[""]  # noqa: SLF001 — what Check answers
        await service.ClearEStop(pb.RobotRef(robot_id="arm"), fake_gateway.context(as_operator()))
        runtime.check_components()
        await asyncio.sleep(0.05)
        return during, runtime.health._server_status[""]  # noqa: SLF001

    during, after = asyncio.run(scenario())
    assert during == health_pb2.HealthCheckResponse.NOT_SERVING
    assert after == health_pb2.HealthCheckResponse.SERVING


def test_a_dead_recorder_thread_turns_the_gateway_not_serving_with_the_reason_in_its_log(fake_gateway, caplog):
    """robot_safety.md: "A recorder thread that dies fails the gateway's health check (NOT_SERVING, with the reason
    in its log)." (tests/security/test_robot_safety.py kills one on a live gateway; here its probe reaches the
    service runtime that answers the health check.)"""
    from grpc_health.v1 import health_pb2

    from rlfabric.services.core.runtime import ServiceOptions, ServiceRuntime
    from rlfabric.services.robot_gateway.recording import Recorder

    async def scenario():
        runtime = ServiceRuntime(ServiceOptions(role="robot_gateway"))
        service = fake_gateway.make(runtime)
        await service.Connect(_connect_request("arm"), fake_gateway.context())
        rec = Recorder("arm", ["a", "b", "c"], HZ, []).start()
        service.recorders["arm"] = rec
        rec.offer(object())  # a tick it cannot read: its thread dies
        rec.thread.join(5)
        runtime.check_components()
        await asyncio.sleep(0.05)
        return runtime.health._server_status[""], runtime.failed  # noqa: SLF001

    with caplog.at_level(logging.CRITICAL, logger="rlfabric.services.core.runtime"):
        status, failed = asyncio.run(scenario())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert "recorder of arm died" in failed["control-loops"]
    assert any(getattr(r, "reason", "") == failed["control-loops"] for r in caplog.records)


# -- recording bounds ----------------------------------------------------------------------------------------------
def test_a_recording_past_the_memory_cap_is_refused_naming_the_cap_and_the_largest_episode_that_fits():
    """robot_safety.md: "... must fit 256 MiB, or `StartRecording` is refused with `INVALID_ARGUMENT` naming the cap
    and the largest episode that fits." The largest named fits; one tick more does not."""
    from rlfabric.services.robot_gateway.recording import RecordingError, check_memory

    for queue_ticks in (0, 20_000):
        with pytest.raises(RecordingError) as err:
            check_memory(3, queue_ticks, 1 << 26, HZ)
        message = str(err.value)
        assert "memory cap of 256 MiB" in message
        largest = int(re.search(r"at most (\d+) episode ticks", message)[1])
        check_memory(3, queue_ticks, largest, HZ)
        with pytest.raises(RecordingError):
            check_memory(3, queue_ticks, largest + 1, HZ)


def test_the_default_episode_is_an_hour_of_ticks_or_the_largest_that_fits():
    """robot_safety.md: "The default episode (0) is an hour of ticks, or what fits." A recorder asked for
    max_episode_ticks 0: 3 joints at 100 Hz fit an hour (360 000 ticks); 30 joints at 100 Hz do not fit an hour in
    256 MiB beside the default queue, and get the largest episode that fits: one that StartRecording's check
    accepts, one tick more it refuses, naming that largest episode."""
    from rlfabric.services.robot_gateway import series
    from rlfabric.services.robot_gateway.recording import Recorder, RecordingError, check_memory

    try:
        hour = Recorder("sizing-3", ["a", "b", "c"], 100.0, [])
        assert hour.max_episode_ticks == 360_000
        check_memory(3, 0, hour.max_episode_ticks, 100.0)  # (and it fits)
        big = Recorder("sizing-30", [f"j{i}" for i in range(30)], 100.0, [])
        largest = big.max_episode_ticks
        assert 0 < largest < 360_000
        check_memory(30, 0, largest, 100.0)  # it fits ...
        with pytest.raises(RecordingError) as err:  # ... and one tick more does not, naming it
            check_memory(30, 0, largest + 1, 100.0)
        assert int(re.search(r"at most (\d+) episode ticks", str(err.value))[1]) == largest
    finally:
        series.forget("sizing-3")
        series.forget("sizing-30")


def test_the_replay_endpoints_come_from_the_flag_or_rlfabric_replay_endpoints(monkeypatch):
    """robot_safety.md: "`RecordingRequest.replay_endpoint` must be one the operator listed with `--replay-endpoints
    tcp://host:port,...` (or `RLFABRIC_REPLAY_ENDPOINTS`)". The gateway's flags parsed as `rlfabric serve` parses
    them (the command line over RLFABRIC_* over the defaults), then built: its service allows exactly those; a
    StartRecording naming another is refused with PERMISSION_DENIED (tests/security/test_robot_safety.py)."""
    import argparse

    from rlfabric.services.core.runtime import ServiceOptions, apply_env_defaults
    from rlfabric.services.robot_gateway import server

    def built(argv: list[str], environ: dict[str, str]):
        parser = argparse.ArgumentParser()
        ServiceOptions.add_arguments(parser)
        server._storage_args(parser)
        apply_env_defaults(parser, environ)
        made = []
        monkeypatch.setattr(server.robot_gateway_pb2_grpc, "add_RobotGatewayServicer_to_server",
                            lambda servicer, _: made.append(servicer))
        from tests.robot_support import _Runtime

        runtime = _Runtime()
        runtime.server = None  # (the servicer is taken by the patched add_...: nothing serves)
        asyncio.run(server._build(runtime, parser.parse_args(argv)))
        return made[0].replay_endpoints

    env = {"RLFABRIC_REPLAY_ENDPOINTS": "tcp://10.0.0.5:7000,tcp://replay:7001"}
    assert built([], env) == {"tcp://10.0.0.5:7000", "tcp://replay:7001"}
    assert built(["--replay-endpoints", "tcp://other:1"], env) == {"tcp://other:1"}
    assert built([], {}) == frozenset()


# -- the robot env's reset of a latched arm --------------------------------------------------------------------------
class _LatchedGateway:
    """A gateway stub whose arm stays latched; records every call the env makes."""

    def __init__(self, state: pb.RobotState):
        self.state, self.calls = state, []

    def GetState(self, request, timeout=None):  # noqa: N802 — the gRPC stub's name
        self.calls.append(("GetState", request.robot_id))
        return self.state


def _latched_env(monkeypatch, state: pb.RobotState, **options):
    from rlfabric.services.core.config import EnvConfig
    from rlfabric.services.env.adapters import robot

    env = robot.RobotVectorEnv.__new__(robot.RobotVectorEnv)  # its reset's wait, without a gateway
    env.pb, env.ids, env.stub = pb, ["env7-0-0"], _LatchedGateway(state)
    env.opts = robot._options(EnvConfig(adapter="robot", id="reach", options={"gateway": "127.0.0.1:50999",
                                                                               **options}))
    return env


def test_the_reset_of_a_latched_arm_waits_latch_wait_s_default_10_s_then_fails_naming_the_arm_and_the_fix(
        monkeypatch, caplog):
    """robot_safety.md: "Its reset then waits for the operator, up to `env.options.latch_wait_s` (default 10 s ...),
    with the arm held, and logs the arm's id and the command above in the env service's log. ... otherwise the step
    fails with the same message". The default, as the adapter uses it (a fake clock): 10 s of waiting with only
    GetState sent (nothing that moves or clears the arm), then the error naming the arm, the fault and the fix."""
    from rlfabric.services.env.adapters import robot

    clock = FakeClock()
    monkeypatch.setattr(robot, "time", clock)
    env = _latched_env(monkeypatch, pb.RobotState(robot_id="env7-0-0", fault="jump: joint 0", holding=True))
    with caplog.at_level(logging.WARNING, logger=robot.__name__), pytest.raises(RuntimeError) as err:
        env._unlatched(0)
    assert 10.0 <= clock.now - 5000.0 < 10.5  # the default latch_wait_s, waited
    assert {c[0] for c in env.stub.calls} == {"GetState"}  # it only looked
    message = str(err.value)
    assert "env7-0-0" in message and "jump: joint 0" in message and "latch_wait_s" in message
    assert "rlfabric robot clear-estop env7-0-0 --gateway 127.0.0.1:50999 --operator-token-file FILE" in message
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "env7-0-0" in logged and "rlfabric robot clear-estop env7-0-0" in logged


def test_a_small_latch_wait_s_gives_up_after_it_for_an_estop(monkeypatch):
    """robot_safety.md: "up to `env.options.latch_wait_s`": a small value, really waited (a fake clock), then the
    step's error for an e-stopped arm. (tests/integration/test_robot_env.py: the same on a live gateway, and the
    cleared case, where the episode ends truncated with `hold_reason` "e-stop".)"""
    from rlfabric.services.env.adapters import robot

    clock = FakeClock()
    monkeypatch.setattr(robot, "time", clock)
    env = _latched_env(monkeypatch, pb.RobotState(robot_id="env7-0-0", estopped=True, holding=True),
                       latch_wait_s=0.5)
    with pytest.raises(RuntimeError, match=r"env7-0-0 is e-stopped.*waited 0.5 s"):
        env._unlatched(0)
    assert 0.5 <= clock.now - 5000.0 < 1.0


class _ClearedAfter(_LatchedGateway):
    """A latched arm that the operator clears after the first ``reads`` GetStates."""

    def __init__(self, state: pb.RobotState, reads: int, cleared: pb.RobotState):
        super().__init__(state)
        self.reads, self.cleared = reads, cleared

    def GetState(self, request, timeout=None):  # noqa: N802 — the gRPC stub's name
        state = super().GetState(request, timeout)
        return state if len(self.calls) <= self.reads else self.cleared


class _HoldThenStart:
    """A Control stream's states as the env reads them, each answering the env's newest command (``policy_seq``):
    first ``held`` (a latched hold), then the arm still at its start pose (the reset's walk back)."""

    def __init__(self, env, held: pb.RobotState):
        self.env, self.held = env, held

    def __iter__(self):
        return self

    def __next__(self) -> pb.RobotState:
        start = self.env.start.tolist()
        state = self.held or pb.RobotState(position=start, target=start, velocity=[0.0] * 3,
                                           end_effector=[1.0, 1.0, 1.0])
        self.held = None
        state.policy_seq = self.env.seq
        return state


@pytest.mark.parametrize("latch", ["fault", "e-stop"])
def test_a_latched_fault_or_estop_ends_the_robot_envs_episode_truncated_with_the_reason(monkeypatch, latch):
    """robot_safety.md: "**Training never clears a latch.** An e-stop or fault ends the robot env's episode
    (truncated, with the reason)." The env's step on a gateway whose state for its command is a latched hold (a
    fault: `fault` set, hold_reason "fault: ..."; or an e-stop): the episode ends truncated (not terminated) with
    info["hold_reason"] that reason; its reset only looks (GetState) until the operator has cleared the arm."""
    import queue

    from rlfabric.services.env.adapters import robot

    monkeypatch.setattr(robot, "time", FakeClock())
    fault = "jump: joint 0 commanded 0.9 rad from where it is"
    held = pb.RobotState(robot_id="env7-0-0", seq=40, position=[0.0, -0.3, 0.6], velocity=[0.0] * 3,
                         target=[0.0, -0.3, 0.6], end_effector=[1.0, 1.0, 1.0], holding=True,
                         **({"fault": fault, "hold_reason": f"fault: {fault}"} if latch == "fault" else
                            {"estopped": True, "hold_reason": "e-stop"}))
    env = _latched_env(monkeypatch, held, latch_wait_s=5.0)
    cleared = pb.RobotState(robot_id="env7-0-0", position=[0.0, -0.3, 0.6], hold_reason="no command yet",
                            holding=True)
    env.stub = _ClearedAfter(held, 2, cleared)  # the operator clears the arm while the reset waits
    env.num_envs, env.horizon, env.joints, env.realtime = 1, 1, 3, False
    env.start, env.max_step, env.rng = np.array([0.0, -0.3, 0.6]), 0.3, np.random.default_rng(0)
    env.commanded, env.targets = env.start[None].copy(), np.zeros((1, 3))
    env.steps, env.last_tick, env.seq = np.zeros(1, np.int64), np.full(1, -1, np.int64), 0
    env.outbox, env.streams = [queue.Queue()], [_HoldThenStart(env, held)]
    env.tails, env.tail_ticks, env.tail_thread, env.tail_error = [np.zeros((0, 3))], [[]], None, None
    env.tail_stop, env.returned_at, env.delay_s = threading.Event(), None, 0.0

    _, _, terminated, truncated, info = env.step(np.ones((1, 3), np.float32))
    assert truncated[0] and not terminated[0]
    assert info["hold_reason"][0] == held.hold_reason and info["hold_reason"][0].startswith(
        "fault" if latch == "fault" else "e-stop"), info["hold_reason"]
    assert {c[0] for c in env.stub.calls} == {"GetState"} and len(env.stub.calls) == 3  # waited, never cleared


# -- drivers at a clean Disconnect -----------------------------------------------------------------------------------
class _FakeFranky:
    """The part of franky the driver uses; its robot records every motion."""

    class RealtimeConfig:
        Ignore = "ignore"

    class JointMotion:
        def __init__(self, q, return_when_finished=True):
            self.q = q

    class JointStopMotion:
        pass

    class Robot:
        def __init__(self, ip, realtime_config=None):
            self.moves, self.joined, self.recovered = [], 0, 0
            self.current_joint_state = SimpleNamespace(position=[0.0] * 7, velocity=[0.0] * 7)

        def recover_from_errors(self):
            self.recovered += 1

        def move(self, motion, asynchronous=False):
            self.moves.append(motion)

        def join_motion(self, timeout):
            self.joined += 1


class _FakePylibfranka:
    class RealtimeConfig:
        kIgnore = "ignore"

    class Robot:
        def __init__(self, ip, realtime_config):
            self.recovered = 0

        def automatic_error_recovery(self):
            self.recovered += 1

        def read_once(self):
            return SimpleNamespace(q=[0.0] * 7, dq=[0.0] * 7)

    class AsyncPositionControlHandler:
        class Configuration:
            def __init__(self, velocities, tolerance):
                pass

        @staticmethod
        def configure(robot, config):
            handler = SimpleNamespace(stopped=0)
            handler.stop_control = lambda: setattr(handler, "stopped", handler.stopped + 1)
            return SimpleNamespace(error_message="", handler=handler)


@pytest.mark.parametrize("backend", ["franky", "pylibfranka"])
def test_a_franka_at_a_clean_disconnect_stops_its_motion_and_its_next_connect_recovers_errors(monkeypatch, backend):
    """robot_safety.md, the franka row: "a clean Disconnect (or gateway stop): the driver stops the motion
    (`JointStopMotion`, or `stop_control`)"; and "The next Connect recovers the robot's errors
    (`recover_from_errors` / `automatic_error_recovery`)". The arm process's stop, as it runs it: the loop stops
    (brake), then the driver closes."""
    from rlfabric.services.robot_gateway.drivers.franka import FrankaArm

    lib = _FakeFranky if backend == "franky" else _FakePylibfranka
    monkeypatch.setattr(FrankaArm, "_import_backend", lambda self: lib)
    monkeypatch.setattr(FrankaArm, "_probe", lambda self, timeout: None)
    arm = FrankaArm(ip="172.16.0.2", backend=backend)
    robot, handler = arm._robot, arm._handler
    assert robot.recovered == 1  # on connect
    loop = ControlLoop("franka", arm, HZ, 0.1)
    loop.stop()  # what the arm process runs first, then close()
    arm.close()
    if backend == "franky":
        assert [type(m) for m in robot.moves] == [_FakeFranky.JointStopMotion] * 2 and robot.joined == 2
    else:
        assert handler.stopped == 1  # (the second brake finds the control already stopped)
    assert arm._robot is None


@pytest.mark.parametrize("release, dropped", [(None, False), ("false", False), ("true", True)])
def test_an_so_arm_keeps_torque_at_disconnect_unless_release_torque_is_true(monkeypatch, release, dropped):
    """robot_safety.md, the so100/so101 row: "torque stays on ... With `options.release_torque: "true"` the servos'
    torque is turned off at Disconnect". What the driver asks of LeRobot (``disable_torque_on_disconnect``), and
    that closing it disconnects: a fake LeRobot follower, since LeRobot is not installed here. And "torque stays on:
    the servos hold where the arm was when the loop stopped": the last goal sent at Disconnect is the position the
    arm reported then (the arm sagged from its last target while held: the goal is where it is, not the target)."""
    from rlfabric.services.robot_gateway.drivers import so_follower

    class Config(SimpleNamespace):
        pass

    class Follower:
        def __init__(self, config):
            self.config, self.is_connected, self.is_calibrated = config, False, True
            self.calibration = {m: SimpleNamespace(range_min=1024, range_max=3072) for m in so_follower.ARM}
            self.calibration_fpath, self.actions, self.torque_released = "cal.json", [], None
            self.reported = {**{f"{m}.pos": 1.0 for m in so_follower.ARM}, "gripper.pos": 50.0}

        def connect(self, calibrate):
            self.is_connected = True

        def get_observation(self):
            return dict(self.reported)

        def send_action(self, action):
            self.actions.append(action)

        def disconnect(self):  # LeRobot's: torque off only when the config says so
            self.is_connected, self.torque_released = False, self.config.disable_torque_on_disconnect

    monkeypatch.setattr(so_follower, "_robot_classes", lambda model: (Follower, Config))
    options = {"port": "/dev/ttyACM0", "id": "arm", **({"release_torque": release} if release else {})}
    for cls in (so_follower.SO100Arm, so_follower.SO101Arm):
        arm = cls(**options)
        loop = ControlLoop("so", arm, HZ, 0.1)
        arm.robot.reported = {**{f"{m}.pos": -2.5 for m in so_follower.ARM}, "gripper.pos": 40.0}  # it sagged
        sent = len(arm.robot.actions)
        loop.stop()  # the arm process's stop: brake, then close
        arm.close()
        assert len(arm.robot.actions) > sent  # a goal went out at the stop ...
        goal = arm.robot.actions[-1]  # ... and the last one is where the arm was (degrees, gripper %, as reported)
        assert goal.keys() == arm.robot.reported.keys() and all(
            goal[k] == pytest.approx(v, abs=1e-9) for k, v in arm.robot.reported.items()), goal
        assert not np.allclose(loop.target, so_follower.from_lerobot(goal))  # (not the last target)
        assert arm.robot.config.disable_torque_on_disconnect is dropped
        assert not arm.robot.is_connected and arm.robot.torque_released is dropped


# -- a real arm process (sim) on an in-process gateway ---------------------------------------------------------------
@pytest.fixture
def gateway():
    with gateway_in_process() as made:
        yield made


def connect(stub, rid: str, watchdog_s: float = 1.0, driver: str = "sim", **options: str) -> pb.RobotInfo:
    """A 100 Hz arm with a generous watchdog window (a loaded host's late tick must not latch a fault here)."""
    return stub.Connect(pb.ConnectRequest(robot_id=rid, driver=driver, options={"start": "0,-0.3,0.6", **options},
                                          control_hz=100, watchdog_s=watchdog_s), timeout=30)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@needs_mujoco
def test_a_latched_fault_and_narrowed_limits_follow_the_device_to_another_id_until_the_operator_clears(gateway):
    """robot_safety.md: "Disconnect then Connect (under any id) brings the latch, the fault and the narrowed limits
    back: only the operator's `ClearEStop` clears a latch." README: "The e-stop latch, a fault and narrowed limits
    belong to the device ... and survive Disconnect/Connect"; "only the operator clears an e-stop or a fault". A
    jump's fault (not an e-stop), kept across ids; the run's ClearEStop refused; the operator's clears it, over
    gRPC, and the arm then holds until a fresh command."""
    stub, _, _ = gateway
    connect(stub, "left", name="bench")
    narrowed = stub.SetLimits(pb.SafetyLimits(robot_id="left", velocity_max=[1.0, 1.0, 1.0], jump_max=0.3),
                              timeout=5)
    states = stub.Control(iter([pb.JointCommand(robot_id="left", seq=1, position=[0.9, -0.3, 0.6])]), timeout=20)
    faulted = next(s for s in states if s.fault)
    states.cancel()
    assert faulted.fault.startswith("jump") and not faulted.estopped, faulted
    stub.Disconnect(pb.RobotRef(robot_id="left"), timeout=10)
    connect(stub, "right", name="bench")
    state = stub.GetState(pb.RobotRef(robot_id="right"), timeout=5)
    assert state.fault == faulted.fault and state.holding and state.hold_reason.startswith("fault"), state
    kept = stub.SetLimits(pb.SafetyLimits(robot_id="right"), timeout=5)
    assert list(kept.velocity_max) == list(narrowed.velocity_max) and kept.jump_max == pytest.approx(0.3)
    err = _refused(lambda: stub.ClearEStop(pb.RobotRef(robot_id="right"), timeout=5))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "clear-estop" in err.details()
    assert stub.GetState(pb.RobotRef(robot_id="right"), timeout=5).fault == faulted.fault
    cleared = stub.ClearEStop(pb.RobotRef(robot_id="right"), timeout=5, metadata=as_operator())
    assert not cleared.fault and not cleared.estopped and cleared.hold_reason == "no command yet", cleared
    stub.Disconnect(pb.RobotRef(robot_id="right"), timeout=10)
    connect(stub, "third", name="bench")  # cleared stays cleared; the limits stay narrowed
    assert not stub.GetState(pb.RobotRef(robot_id="third"), timeout=5).fault
    assert stub.SetLimits(pb.SafetyLimits(robot_id="third"), timeout=5).jump_max == pytest.approx(0.3)


@needs_mujoco
def test_a_paused_arm_process_latches_a_deadline_fault_and_fails_health_naming_the_arm_and_the_lateness(gateway,
                                                                                                        caplog):
    """robot_safety.md: "A tick later than the watchdog window latches a fault: the arm went that long without
    control (a driver read that stalled, a paused process). The arm holds, and the gateway's health check turns
    NOT_SERVING and names the arm and how late the tick was, until the operator's ClearEStop". The arm's process
    is paused (SIGSTOP) for 0.5 s against a 0.1 s window; its probe, watched by a service runtime as `rlfabric
    serve` watches it, turns the health check NOT_SERVING with the arm and the lateness in the log; the operator's
    ClearEStop clears the fault and the probe (the runtime then serves again: the test above)."""
    from grpc_health.v1 import health_pb2

    from rlfabric.services.core.runtime import ServiceOptions, ServiceRuntime

    stub, service, runtime = gateway
    connect(stub, "paused", watchdog_s=0.1)
    probe = runtime.probes["control-loops"]
    assert probe() is None
    pid = service.loops["paused"].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline, why = time.monotonic() + 10, None
    while why is None and time.monotonic() < deadline:
        time.sleep(0.02)
        why = probe()
    assert why is not None and "paused" in why and "missed its deadline" in why, why
    assert float(re.search(r"a tick woke ([\d.]+) ms late", why)[1]) >= 400, why
    state = stub.GetState(pb.RobotRef(robot_id="paused"), timeout=5)
    assert state.fault.startswith("deadline") and state.holding, state

    async def watched():
        served = ServiceRuntime(ServiceOptions(role="robot_gateway"))
        served.watch("control-loops", probe)
        served.check_components()
        await asyncio.sleep(0.05)
        return served.health._server_status[""]  # noqa: SLF001 — what Check answers

    with caplog.at_level(logging.CRITICAL, logger="rlfabric.services.core.runtime"):
        assert asyncio.run(watched()) == health_pb2.HealthCheckResponse.NOT_SERVING
    reason = next(r.reason for r in caplog.records if getattr(r, "component", "") == "control-loops")
    assert "paused" in reason and "ms late" in reason
    cleared = stub.ClearEStop(pb.RobotRef(robot_id="paused"), timeout=5, metadata=as_operator())
    assert not cleared.fault
    deadline = time.monotonic() + 5
    while probe() is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert probe() is None


@needs_mujoco
def test_the_arm_process_ticks_at_sched_fifo_on_a_core_of_its_own_where_permitted(gateway):
    """robot_safety.md: "In its own process the loop has ... SCHED_FIFO and a pinned core that nothing else
    inherits". README: "Each arm's control loop runs in a process of its own at real-time priority where the host
    allows". Read from the kernel for the arm's process (the loop ticks on its main thread); the gateway's own
    process stays as it was."""
    stub, service, _ = gateway
    gateway_policy, gateway_cpus = os.sched_getscheduler(0), os.sched_getaffinity(0)
    connect(stub, "rt")
    realtime = stub.ListRobots(pb.ListRobotsRequest(), timeout=5).robots[0].realtime
    if not realtime.startswith("SCHED_FIFO"):
        pytest.skip(f"this host refuses real-time priority to the arm's process ({realtime})")
    pid = service.loops["rt"].proc.pid
    assert os.sched_getscheduler(pid) == os.SCHED_FIFO and os.sched_getparam(pid).sched_priority == 10
    if len(gateway_cpus) > 1:
        assert os.sched_getaffinity(pid) == {max(gateway_cpus)}, realtime
    assert os.sched_getscheduler(0) == gateway_policy and os.sched_getaffinity(0) == gateway_cpus


MINI_GATEWAY = """
import sys, time
from rlfabric.services.robot_gateway.drivers import register_driver
register_driver("claims_mark_sim", "tests.security.test_robot_claims:MarkSim")
from rlfabric.services.robot_gateway.arm_process import ArmProcess
arm = ArmProcess("arm", "claims_mark_sim", {"marks": sys.argv[1], "start": "0,-0.3,0.6"}, 100.0, 1.0, 0.001)
arm.start()
print(arm.proc.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@needs_mujoco
def test_an_arm_process_whose_gateway_is_killed_brakes_then_drops_real_time_then_closes_and_exits(tmp_path):
    """robot_safety.md: "if the gateway dies (even SIGKILL), each arm process sees its socket close, stops ticking,
    brakes and exits"; "An arm process that stops drops its real-time priority once it has braked, so closing its
    driver and exiting never stalls the other arms pinned to its core." A gateway of its own (the gateway's side,
    ArmProcess, in a process this test kills with SIGKILL); the arm's driver notes its brake and close with the
    scheduling policy it ran them at."""
    marks, log = tmp_path / "marks", tmp_path / "gateway.log"
    with open(log, "w") as stderr:
        gw = subprocess.Popen([sys.executable, "-c", MINI_GATEWAY, str(marks)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=stderr, stdin=subprocess.DEVNULL, text=True)
    try:
        line = gw.stdout.readline()
        assert line.strip().isdigit(), log.read_text()[-2000:]
        pid = int(line)
        time.sleep(0.2)  # it ticks
        assert not _gone(pid) and not marks.read_text()
        os.kill(gw.pid, signal.SIGKILL)
        gw.wait()
        deadline = time.monotonic() + 15
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the arm process outlived its gateway"
    finally:
        if gw.poll() is None:
            gw.kill()
            gw.wait()
    lines = marks.read_text().splitlines()
    kinds = [line.split()[0] for line in lines]
    assert kinds[-1] == "close" and kinds[:-1] and set(kinds[:-1]) == {"brake"}, lines  # braked (the loop's own
    # brake when its state could not be sent, then its stop's), then closed
    at_brake, at_close = int(lines[0].split()[1]), int(lines[-1].split()[1])
    assert at_close == os.SCHED_OTHER  # closed (and exited) at normal priority
    if at_brake != os.SCHED_FIFO:
        pytest.skip("this host refuses real-time priority: braked at normal priority (nothing to drop)")


@needs_mujoco
def test_an_estop_holds_from_the_moment_it_reaches_the_arm_process_whatever_commands_follow(gateway, tmp_path):
    """robot_safety.md: "An EStop latches in the arm's process as soon as the request reaches it ...: targets change
    only at ticks, so from then on no new target reaches the arm, and the next tick's state confirms the hold." A
    policy ramps the arm and keeps commanding through and after the EStop; the driver's own log of every target it
    was sent (with the time, in the arm's process) shows none changed from the moment the latch was set
    (``estop_at``), and every tick from then on is an e-stop hold on that target."""
    stub, service, _ = gateway
    marks = tmp_path / "marks"
    connect(stub, "arm", driver="claims_mark_sim", marks=str(marks), log_commands="true")
    arm = service.loops["arm"]
    ticks: list[Tick] = []
    arm.listeners.append(ticks.append)
    stop = threading.Event()

    def ramp():
        seq = 0
        while not stop.is_set():
            seq += 1
            yield pb.JointCommand(robot_id="arm", seq=seq, position=[min(0.004 * seq, 0.4), -0.3, 0.6])
            time.sleep(0.01)

    states = stub.Control(ramp(), timeout=30)

    def drain() -> None:
        try:
            for _ in states:
                pass
        except grpc.RpcError as exc:  # cancelled at the end
            assert exc.code() == grpc.StatusCode.CANCELLED

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.monotonic() + 10
        while stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).target[0] < 0.05:
            assert time.monotonic() < deadline, "the arm never followed the ramp"
            time.sleep(0.01)
        reply = stub.EStop(pb.EStopRequest(robot_id="arm", reason="test"), timeout=5)
        time.sleep(0.3)  # the ramp goes on
    finally:
        stop.set()
        states.cancel()
    stub.Disconnect(pb.RobotRef(robot_id="arm"), timeout=10)
    estop_at = next(t.estop_at for t in reversed(ticks) if t.estop_at)
    lines = marks.read_text().splitlines()
    lines = lines[:next(i for i, line in enumerate(lines) if line.startswith("brake"))]  # the ticks' (not Disconnect's)
    sent = [(float(t), np.array(json.loads(q))) for _, t, q in (line.split(" ", 2) for line in lines)]
    before = [q for t, q in sent if t < estop_at]
    after = [q for t, q in sent if t > estop_at]
    assert before[-1][0] > 0.05 and not np.array_equal(before[-1], before[-5])  # it was moving
    held = before[-1]
    assert len(after) >= 10 and all(np.array_equal(q, held) for q in after), (held, after[:3])
    assert reply.estopped and reply.holding and np.allclose(reply.target, held, atol=1e-12)
    later = [t for t in ticks if t.time > estop_at]
    assert later and all(t.estopped and t.holding and t.hold_reason == "e-stop" for t in later)
    assert all(np.array_equal(t.target, held) for t in later)


@needs_mujoco
def test_a_clean_disconnect_of_the_sim_brakes_where_the_arm_is_closes_the_driver_and_ends_its_process(gateway,
                                                                                                      tmp_path):
    """robot_safety.md, the sim row: "a clean Disconnect (or gateway stop): the loop stops and brakes (the servos'
    goal becomes where the arm is); the simulated arm ends with its arm process". Precisely: the loop stops, the
    driver brakes (Driver.brake: its servos' goal becomes the position measured at the stop, at rest within 2e-3
    rad of the last target) and closes, and the sim ends with the arm's process."""
    stub, service, _ = gateway
    marks = tmp_path / "marks"
    connect(stub, "arm", driver="claims_mark_sim", marks=str(marks))
    proc = service.loops["arm"].proc
    last = stub.Disconnect(pb.RobotRef(robot_id="arm"), timeout=10)
    assert proc.poll() is not None
    lines = marks.read_text().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["brake", "close"], lines
    goal_before = np.array(json.loads(lines[0].split(" ", 2)[2]))
    _, _, goal, measured = lines[1].split(" ", 3)
    goal, measured = np.array(json.loads(goal)), np.array(json.loads(measured))
    assert np.allclose(goal_before, last.target, atol=1e-12)  # the last target, up to the brake
    assert np.array_equal(goal, measured) and np.abs(goal - np.asarray(last.target)).max() < 2e-3
