"""The gateway's control loop on the sim arm (MuJoCo, real time): watchdog, e-stop latch, the safety filter's clips
and faults, and limits that narrow but never widen past the driver's hard limits."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.robot_gateway.drivers import build_driver  # noqa: E402
from rlfabric.services.robot_gateway.loop import ControlLoop, Tick  # noqa: E402
from rlfabric.services.robot_gateway.safety import LimitError  # noqa: E402

pytestmark = pytest.mark.serial  # the deadline loop's timing: never beside another test

HZ, WATCHDOG = 100.0, 0.05


class Recorder:
    def __init__(self, loop: ControlLoop):
        self.ticks: list[Tick] = []
        self.cond = threading.Condition()
        loop.listeners.append(self.add)

    def add(self, tick: Tick) -> None:
        with self.cond:
            self.ticks.append(tick)
            self.cond.notify_all()

    def wait(self, pred, timeout: float = 3.0) -> Tick:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                hit = next((t for t in self.ticks if pred(t)), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                assert left > 0, f"no tick matched in {timeout} s; last: {self.ticks[-1] if self.ticks else None}"
                self.cond.wait(left)

    def after(self, t0: float) -> list[Tick]:
        with self.cond:
            return [t for t in self.ticks if t.time > t0]


@pytest.fixture
def arm():
    loop = ControlLoop("arm", build_driver("sim", {"start": "0,-0.3,0.6"}), HZ, WATCHDOG)
    rec = Recorder(loop)
    loop.start()
    yield loop, rec
    loop.stop()
    assert loop.health() is None


def stream(loop: ControlLoop, position, seconds: float) -> float:
    """Send ``position`` at the loop's rate for ``seconds``; returns when the last one was sent."""
    end, seq = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        seq += 1
        loop.submit(np.asarray(position, float), seq)
        time.sleep(1 / HZ)
    return time.monotonic()


def test_the_arm_holds_until_commanded_and_the_watchdog_holds_within_its_window_plus_one_tick(arm):
    loop, rec = arm
    assert rec.wait(lambda t: t.tick >= 3).hold_reason == "no command yet"
    last_sent = stream(loop, [0.0, -0.3, 0.6], 0.3)
    assert any(not t.holding for t in rec.after(last_sent - 0.2))  # it followed while commanded
    hold = rec.wait(lambda t: t.time > last_sent and t.hold_reason.startswith("watchdog"))
    assert hold.time - last_sent <= WATCHDOG + 1 / HZ + hold.lateness_s
    later = rec.wait(lambda t: t.time > hold.time + 0.1)
    assert later.holding and np.allclose(later.target, hold.target)  # it stays put


def test_an_estop_latches_until_cleared_and_a_fresh_command(arm):
    loop, rec = arm
    stream(loop, [0.0, -0.3, 0.6], 0.1)
    loop.estop("test")
    stopped = rec.wait(lambda t: t.estopped)
    t_clear = stream(loop, [0.2, -0.3, 0.6], 0.2)  # commands while e-stopped move nothing
    assert all(t.holding and np.allclose(t.target, stopped.target) for t in rec.after(stopped.time))
    loop.clear()
    assert rec.wait(lambda t: t.time > t_clear + 0.02).holding  # cleared, still holding: no fresh command yet
    stream(loop, [0.2, -0.3, 0.6], 0.3)
    moved = rec.wait(lambda t: not t.holding and t.time > t_clear)
    assert not moved.estopped


def test_out_of_limit_commands_are_clipped_and_fast_ones_slowed_to_the_slew_limit(arm):
    loop, rec = arm
    hard = loop.hard
    stream(loop, [0.0, -0.3, 0.6], 0.1)
    t0 = stream(loop, [0.3, -0.3, 0.6], 0.15)  # 0.3 rad away: under jump_max, over the 0.05 rad slew per tick
    steps = np.diff([t.target[0] for t in rec.ticks if not t.holding and t.time <= t0])
    assert steps.max() <= hard.slew_max[0] + 1e-9 and any(t.slowed for t in rec.ticks)
    # near the elbow's hard maximum, a command beyond it is clipped to it
    loop.set_limits(hard.merged(position_max=hard.position_max - [0, 0, 1.6]))  # elbow max 0.7
    t1 = stream(loop, [0.3, -0.3, 0.9], 0.4)
    clipped = [t for t in rec.ticks if 0 < t.time <= t1 and t.clipped]
    assert clipped and max(t.target[2] for t in rec.ticks) <= 0.7 + 1e-9


def test_a_jump_faults_and_holds_instead_of_following(arm):
    loop, rec = arm
    stream(loop, [0.0, -0.3, 0.6], 0.1)
    stream(loop, [1.2, -0.3, 0.6], 0.1)  # 1.2 rad from where it is: a jump
    fault = rec.wait(lambda t: t.fault.startswith("jump"))
    assert fault.holding and abs(fault.target[0]) < 0.05
    t = stream(loop, [0.0, -0.3, 0.6], 0.1)  # a sane command does not clear a fault
    assert rec.wait(lambda x: x.time > t).fault.startswith("jump")


def test_a_tick_later_than_the_watchdog_window_latches_a_fault_and_fails_health_until_cleared(arm):
    """A driver read that stalls for 4 watchdog windows: the next tick wakes that late, the arm went that long
    without control. It latches a fault (the arm holds, sane commands do not clear it) and the loop's health names
    the miss, until the operator's clear; then a fresh command moves the arm again."""
    loop, rec = arm
    stream(loop, [0.0, -0.3, 0.6], 0.1)
    read, stalled = loop.driver.read, threading.Event()

    def stalls_once():
        if not stalled.is_set():
            stalled.set()
            time.sleep(4 * WATCHDOG)
        return read()

    loop.driver.read = stalls_once
    t_sent = stream(loop, [0.05, -0.3, 0.6], 0.4)
    missed = rec.wait(lambda t: t.fault.startswith("deadline"))
    assert missed.holding and missed.lateness_s > WATCHDOG, missed
    assert all(t.holding for t in rec.after(missed.time))  # commands kept coming: the arm stayed put
    assert rec.wait(lambda t: t.time > t_sent).fault.startswith("deadline")
    assert "missed its deadline" in (loop.health() or "")
    loop.clear()
    assert loop.health() is None
    stream(loop, [0.05, -0.3, 0.6], 0.2)
    assert not rec.wait(lambda t: not t.holding and t.time > missed.time).fault


def test_a_target_outside_the_workspace_faults(arm):
    loop, rec = arm
    hard = loop.hard
    stream(loop, [0.0, -0.3, 0.6], 0.1)
    loop.set_limits(hard.merged(workspace_max=np.array([0.6, 0.6, 0.3])))  # the hand must stay below 0.3 m
    stream(loop, [0.0, -0.6, 0.6], 0.3)  # raising the shoulder lifts the hand
    assert rec.wait(lambda t: t.fault.startswith("workspace")).holding


def test_limits_narrow_but_never_widen_past_the_hard_limits(arm):
    loop, _ = arm
    hard = loop.hard
    narrow = hard.merged(velocity_max=hard.velocity_max / 2)
    assert loop.set_limits(narrow) is narrow
    with pytest.raises(LimitError, match=r"position_max\[1\].*wider than the driver's hard limit"):
        loop.set_limits(hard.merged(position_max=hard.position_max + [0, 0.1, 0]))
    with pytest.raises(LimitError, match="workspace_min"):
        loop.set_limits(hard.merged(workspace_min=hard.workspace_min - 1))
    with pytest.raises(LimitError, match="one value per joint"):
        loop.set_limits(hard.merged(slew_max=np.ones(2)))
    assert loop.safety.limits is narrow  # a refused request changes nothing
    assert loop.set_limits(hard) is hard  # back to the hard limits: allowed


def test_the_loop_keeps_its_schedule_with_and_without_a_spin():
    """spin_s trades precision for CPU (many arms on one host): without a spin the loop sleeps to each deadline and
    still ticks in order. What the spin costs in CPU is measured by bench/robot_loop.py, not asserted here."""
    for spin in (0.002, 0.0):
        loop = ControlLoop("spin", build_driver("sim", {"start": "0,-0.3,0.6"}), HZ, WATCHDOG, spin_s=spin)
        rec = Recorder(loop)
        loop.start()
        try:
            rec.wait(lambda t: t.tick >= 40, timeout=10.0)
        finally:
            loop.stop()
        ticks = [t.tick for t in rec.ticks]
        assert ticks == sorted(ticks) and len(set(ticks)) == len(ticks), ticks


def test_an_arm_process_never_waits_for_a_gateway_that_does_not_read_and_counts_what_it_lost():
    """The arm process sends every tick's state without blocking: a gateway too slow to read loses states, counted
    (its rlfabric_robot_states_dropped_total), never the loop's time."""
    import socket

    from rlfabric.services.robot_gateway.arm_process import _Serve

    mine, gateway = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # the gateway end is never read
    mine.setblocking(False)
    serve = _Serve(mine, mine)
    serve.loop = ControlLoop("arm", build_driver("sim", {"start": "0,-0.3,0.6"}), HZ, WATCHDOG)
    for _ in range(5000):  # a blocking send would hang here: the socket holds far fewer
        serve.publish(serve.loop.last)
    assert serve.dropped > 0
    mine.close()
    gateway.close()
