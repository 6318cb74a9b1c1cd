"""Issue 19, the robot gateway's safety model: limits that cannot drive the arm against its commands (property tests
of the filter, and SetLimits fuzzed on a live gateway), safety state that belongs to the device, a takeover owned by
its stream, EStop that answers while a driver blocks, a hold that keeps the arm still, and the gateway's bounds and
failures (recording memory, lost episodes, a dead recorder, replay endpoints)."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlfabric.services.robot_gateway.safety import LimitError, Limits, SafetyFilter

HARD = Limits(position_min=np.array([-2.6, -1.6, -2.3]), position_max=np.array([2.6, 1.6, 2.3]),
              velocity_max=np.full(3, 2.0), slew_max=np.full(3, 0.05), jump_max=0.5,
              workspace_min=np.array([-0.6, -0.6, -0.2]), workspace_max=np.array([0.6, 0.6, 0.8]))
INSIDE = lambda q: np.zeros(3)  # noqa: E731 — kinematics whose hand is always inside the workspace
EPS = 1e-9


@st.composite
def accepted_limits(draw) -> tuple[Limits, np.ndarray]:
    """Limits as a client may send them to SetLimits (narrowed from HARD, some negative or reversed: the ones
    SetLimits accepts are kept), and a current target inside their position limits (SetLimits asks that)."""
    joint = st.integers(0, 2)
    lo, hi = [], []
    for j in range(3):
        a = draw(st.floats(HARD.position_min[j], HARD.position_max[j]))
        b = draw(st.floats(HARD.position_min[j], HARD.position_max[j]))
        lo.append(a), hi.append(b)
    if draw(st.booleans()):  # most draws in order; some reversed, which SetLimits refuses
        lo, hi = [min(p) for p in zip(lo, hi, strict=True)], [max(p) for p in zip(lo, hi, strict=True)]
    velocity = np.array([draw(st.floats(-0.3 * HARD.velocity_max[j], HARD.velocity_max[j])) for j in range(3)])
    slew = np.array([draw(st.floats(-0.3 * HARD.slew_max[j], HARD.slew_max[j])) for j in range(3)])
    if draw(st.booleans()):
        velocity[draw(joint)] = 0.0  # a frozen joint is allowed
    jump = draw(st.floats(-0.1, HARD.jump_max))
    limits = HARD.merged(position_min=np.array(lo), position_max=np.array(hi), velocity_max=velocity, slew_max=slew,
                         jump_max=jump)
    try:
        limits.within(HARD)
    except LimitError:
        assume(False)
    target = np.array([draw(st.floats(lo[j], hi[j])) for j in range(3)])
    return limits, target


commands = st.lists(st.lists(st.floats(-3.0, 3.0), min_size=3, max_size=3), min_size=1, max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(accepted_limits(), commands, st.floats(1e-4, 0.1))
def test_any_accepted_limits_keep_every_target_inside_and_each_step_within_the_rate(limits_target, stream, dt):
    limits, target = limits_target
    safety, step = SafetyFilter(limits, INSIDE), np.minimum(limits.velocity_max * dt, limits.slew_max)
    for command in stream:
        measured = target.copy()  # an arm that tracks its target
        new = safety.apply(np.array(command), measured, target, dt).target
        assert (new >= limits.position_min - EPS).all() and (new <= limits.position_max + EPS).all()
        assert (np.abs(new - target) <= step + EPS).all(), (new - target, step)
        target = new


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(accepted_limits(), st.lists(st.floats(-3.0, 3.0), min_size=3, max_size=3), st.floats(1e-4, 0.1),
       st.integers(1, 60))
def test_a_held_command_moves_the_target_monotonically_toward_it_never_away(limits_target, command, dt, ticks):
    limits, target = limits_target
    command = np.array(command)
    goal = np.clip(command, limits.position_min, limits.position_max)
    safety = SafetyFilter(limits, INSIDE)
    for _ in range(ticks):
        new = safety.apply(command, target.copy(), target, dt).target
        assert ((new - target) * (goal - target) >= -EPS).all(), (target, new, goal)  # never opposite to it
        assert (np.abs(goal - new) <= np.abs(goal - target) + EPS).all()  # never further from it
        target = new


@pytest.mark.parametrize("change, named", [
    ({"velocity_max": np.array([-1.0, -1.0, -1.0])}, "velocity_max[0]=-1 is negative"),
    ({"slew_max": np.array([0.01, -0.01, 0.01])}, "slew_max[1]=-0.01 is negative"),
    ({"jump_max": 0.0}, "jump_max=0 must be > 0"),
    ({"jump_max": -0.2}, "jump_max=-0.2 must be > 0"),
    ({"jump_max": math.nan}, "jump_max holds a non-finite value"),
    ({"velocity_max": np.array([1.0, math.nan, 1.0])}, "velocity_max holds a non-finite value"),
])
def test_limits_refuse_negative_zero_and_nan_bounds_naming_the_field_and_the_fix(change, named):
    with pytest.raises(LimitError, match="Fix") as err:
        HARD.merged(**change).within(HARD)
    assert named in str(err.value)


def test_a_negative_velocity_limit_no_longer_drives_a_still_arm():
    """The finding, at the filter: velocity_max -1 moved a target commanded to stay by -0.01 rad every tick."""
    bad = HARD.merged(velocity_max=np.full(3, -1.0))
    target = np.zeros(3)
    new = SafetyFilter(bad, INSIDE).apply(np.zeros(3), target, target, 0.01).target
    assert np.allclose(new, 0.0)  # even were such limits installed, a command to stay keeps the target
    with pytest.raises(LimitError):
        bad.within(HARD)


# -- a live gateway --------------------------------------------------------------------------------------------------
mujoco = pytest.importorskip("mujoco")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc  # noqa: E402
from rlfabric.services.core.runtime import GRPC_OPTIONS  # noqa: E402
from rlfabric.services.robot_gateway.drivers import register_driver  # noqa: E402
from rlfabric.services.robot_gateway.drivers.sim import SimArm  # noqa: E402
from rlfabric.services.robot_gateway.loop import ControlLoop  # noqa: E402
from rlfabric.services.robot_gateway.recording import Recorder  # noqa: E402
from tests.robot_support import as_operator, gateway_in_process, gateway_process  # noqa: E402

pytestmark = pytest.mark.minutes(0.4)  # on CI's 2 cores: the tiers start long files first

# every test below drives a live 100 Hz gateway loop: timed, so never beside another test
live_loop = pytest.mark.serial

TOKEN = "robot-safety-test-token"
START = [0.0, -0.3, 0.6]


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@live_loop
def test_setlimits_fuzz_on_a_live_gateway_refuses_bad_values_and_a_still_arm_stays_still(tmp_path):
    """SetLimits with negative, zero, NaN and reversed values: each refused with INVALID_ARGUMENT naming the field;
    afterwards (and with a frozen joint, which is allowed) a client commanding "stay" does not move the arm."""
    with gateway_process(tmp_path, TOKEN) as address:
        channel = auth.sync_channel(address, GRPC_OPTIONS, auth.Security(TOKEN))
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
        info = stub.Connect(pb.ConnectRequest(robot_id="arm", driver="sim", options={"start": "0,-0.3,0.6"},
                                              control_hz=100, watchdog_s=0.1), timeout=30)
        hard = info.limits
        bad = [
            (dict(velocity_max=[-1.0, -1.0, -1.0]), "velocity_max[0]"),
            (dict(velocity_max=[2.0, -0.001, 2.0]), "velocity_max[1]"),
            (dict(slew_max=[-0.05, 0.05, 0.05]), "slew_max[0]"),
            (dict(jump_max=-0.1), "jump_max"),
            (dict(jump_max=0.0), "jump_max"),
            (dict(jump_max=math.nan), "jump_max"),
            (dict(velocity_max=[math.nan, 1.0, 1.0]), "velocity_max"),
            (dict(slew_max=[0.01, math.inf, 0.01]), "slew_max"),
            (dict(position_min=[0.5, -1.6, -2.3], position_max=[-0.5, 1.6, 2.3]), "position_min <= position_max"),
            (dict(workspace_min=[0.3, -0.6, -0.2], workspace_max=[-0.3, 0.6, 0.8]), "workspace_min <= workspace_max"),
            (dict(position_min=[0.2, -1.6, -2.3]), "current target"),  # leaves out where the arm is
        ]
        for fields, named in bad:
            err = _refused(lambda f=fields: stub.SetLimits(pb.SafetyLimits(robot_id="arm", **f), timeout=5))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.details(), (fields, err.details())
        current = stub.SetLimits(pb.SafetyLimits(robot_id="arm"), timeout=5)  # no change: reads them back
        assert list(current.velocity_max) == list(hard.velocity_max) and current.jump_max == hard.jump_max
        stub.SetLimits(pb.SafetyLimits(robot_id="arm", velocity_max=[0.0, 2.0, 2.0]), timeout=5)  # yaw frozen

        before = np.array(stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).position)

        def stay():
            for seq in range(1000):
                yield pb.JointCommand(robot_id="arm", seq=seq, position=before.tolist())
                time.sleep(0.01)

        control = stub.Control(stay(), timeout=20)
        states = [s for s, _ in zip(control, range(60), strict=False)]
        control.cancel()
        assert any(not s.holding for s in states)  # it was commanded, not merely holding
        after = np.array(stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).position)
        assert np.abs(after - before).max() < 1e-3, after - before
        assert max(np.abs(np.array(s.target) - before).max() for s in states) < 1e-9
        channel.close()


@live_loop
def test_a_hold_keeps_the_sim_arm_still_and_at_rest_it_sits_on_its_target():
    """Acceptance: after a hold begins (the client goes silent) the arm moves < 1e-3 rad over the next second; at
    rest it sits within 2e-3 rad of its target. The hold keeps the last target, never the measured position."""
    loop = ControlLoop("hold", SimArm(start="0,-0.3,0.6"), 100.0, 0.1)
    ticks: list = []
    loop.listeners.append(ticks.append)
    loop.start()
    try:
        goal = np.array([0.3, -0.6, 1.0])  # a reach: the shoulder and elbow carry the arm's weight here
        end, seq = time.monotonic() + 2.0, 0
        while time.monotonic() < end:
            seq += 1
            loop.submit(goal, seq)
            time.sleep(0.01)
        silent = time.monotonic()
        time.sleep(1.5)
    finally:
        loop.stop()
    commanded = [t for t in ticks if t.time < silent and not t.holding]
    at_rest = commanded[-1]
    assert np.allclose(at_rest.target, goal) and np.abs(at_rest.position - at_rest.target).max() < 2e-3, \
        at_rest.position - at_rest.target
    hold = next(t for t in ticks if t.time > silent and t.hold_reason.startswith("watchdog"))
    assert np.array_equal(hold.target, at_rest.target)  # the last target, not the measured position
    second = [t for t in ticks if hold.time <= t.time <= hold.time + 1.0]
    assert second[-1].time - hold.time > 0.9
    moved = max(np.abs(t.position - hold.position).max() for t in second)
    assert moved < 1e-3, moved


# -- device identity, ownership, the event loop (the service in-process) ----------------------------------------
class SlowSim(SimArm):
    """A sim arm whose constructor, first read and close block (a Franka probe, a serial bus that hangs). With
    ``stage_file`` it writes each stage's name there as the stage begins (it lives in the arm's own process)."""

    def __init__(self, **options: str):
        self.stage_file = options.pop("stage_file", "")
        self._stage("build")
        time.sleep(float(options.pop("build_s", "0")))
        self.read_s = float(options.pop("read_s", "0"))
        self.close_s = float(options.pop("close_s", "0"))
        super().__init__(**options)

    def _stage(self, name: str) -> None:
        if self.stage_file:
            Path(self.stage_file).write_text(name)

    def read(self):
        if self.read_s:  # the first read only: the loop's, made once the driver is built
            self._stage("read")
            time.sleep(self.read_s)
            self.read_s = 0.0
        return super().read()

    def close(self) -> None:
        self._stage("close")
        time.sleep(self.close_s)


register_driver("slow_sim", f"{__name__}:SlowSim")


@pytest.fixture
def gateway(tmp_path):
    from rlfabric.services.core.config import StorageConfig

    with gateway_in_process(storage=StorageConfig(kind="filesystem", root=str(tmp_path / "rec")),
                            replay_endpoints=frozenset({"tcp://127.0.0.1:1"})) as made:
        yield made


def connect(stub, rid: str, **options: str) -> pb.RobotInfo:
    return stub.Connect(pb.ConnectRequest(robot_id=rid, driver=options.pop("driver", "sim"),
                                          options={"start": "0,-0.3,0.6", **options}, control_hz=100,
                                          watchdog_s=0.1), timeout=30)


@live_loop
def test_the_estop_latch_and_narrowed_limits_survive_disconnect_and_connect(gateway):
    stub, _, _ = gateway
    connect(stub, "arm")
    narrowed = stub.SetLimits(pb.SafetyLimits(robot_id="arm", velocity_max=[1.0, 1.0, 1.0], jump_max=0.2), timeout=5)
    assert stub.EStop(pb.EStopRequest(robot_id="arm", reason="test"), timeout=5).estopped
    stub.Disconnect(pb.RobotRef(robot_id="arm"), timeout=10)
    connect(stub, "arm")
    state = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5)
    assert state.estopped and state.holding, state  # no ClearEStop: still latched
    kept = stub.SetLimits(pb.SafetyLimits(robot_id="arm"), timeout=5)
    assert list(kept.velocity_max) == list(narrowed.velocity_max) and kept.jump_max == pytest.approx(0.2)
    assert not stub.ClearEStop(pb.RobotRef(robot_id="arm"), timeout=5, metadata=as_operator()).estopped


@live_loop
def test_one_device_is_connected_under_one_robot_id(gateway):
    stub, _, _ = gateway
    connect(stub, "left", name="bench-arm")
    err = _refused(lambda: connect(stub, "right", name="bench-arm"))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "'left'" in err.details(), err.details()
    assert [r.robot_id for r in stub.ListRobots(pb.ListRobotsRequest(), timeout=5).robots] == ["left"]
    stub.EStop(pb.EStopRequest(robot_id="left"), timeout=5)
    stub.Disconnect(pb.RobotRef(robot_id="left"), timeout=10)
    connect(stub, "right", name="bench-arm")  # free again, under another id: the latch follows the device
    assert stub.GetState(pb.RobotRef(robot_id="right"), timeout=5).estopped


@live_loop
def test_concurrent_connects_of_one_id_build_one_loop(tmp_path):
    """Connect yields to the event loop while it builds (a camera here): a second Connect of the id then must not
    build a second loop, which Disconnect could no longer reach (the gateway's log counts the loops it started)."""
    with gateway_process(tmp_path, TOKEN) as address:
        channel = auth.sync_channel(address, GRPC_OPTIONS, auth.Security(TOKEN))
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
        request = pb.ConnectRequest(robot_id="twin", driver="sim", options={"start": "0,-0.3,0.6"}, control_hz=100,
                                    watchdog_s=0.1, camera_size=16, camera_hz=5)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: stub.Connect(request, timeout=60), range(4)))
        assert {r.robot_id for r in replies} == {"twin"}
        stub.Disconnect(pb.RobotRef(robot_id="twin"), timeout=20)
        channel.close()
        log = (tmp_path / "robot_gateway.log").read_text()
    started = [line for line in log.splitlines() if "control loop started" in line and "twin" in line]
    assert len(started) == 1, f"{len(started)} control loops of 'twin' started for one robot"


@live_loop
def test_a_takeover_belongs_to_the_stream_that_began_it(gateway):
    import queue

    stub, _, _ = gateway
    connect(stub, "arm")
    kinds = pb.TeleopEvent.Kind
    start = pb.TeleopEvent(robot_id="arm", kind=kinds.INTERVENE_START,
                           command=pb.JointCommand(robot_id="arm", seq=1, position=START))
    mine: queue.Queue = queue.Queue()
    mine.put(start)
    owner = stub.Teleop(iter(mine.get, None), timeout=30)
    assert next(s for s in owner if s.intervening).intervening
    for event in (pb.TeleopEvent(robot_id="arm", kind=kinds.INTERVENE_STOP),
                  pb.TeleopEvent(robot_id="arm", kind=kinds.COMMAND,
                                 command=pb.JointCommand(robot_id="arm", seq=2, position=[0.1, -0.3, 0.6])),
                  pb.TeleopEvent(robot_id="arm", kind=kinds.SUCCESS), start):
        other = stub.Teleop(iter([event]), timeout=10)
        err = _refused(lambda o=other: [s for s, _ in zip(o, range(50), strict=False)])
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "Teleop stream" in err.details(), err.details()
        state = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5)
        assert state.intervening and state.episode == 0
    mine.put(None)  # the owner goes away: its takeover stays (holding), and anyone may now stop it
    owner.cancel()
    time.sleep(0.2)
    held = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5)  # it stays, its stale commands held by the watchdog
    assert held.intervening and held.hold_reason.startswith("watchdog: no teleop command"), held
    stopper = stub.Teleop(iter([pb.TeleopEvent(robot_id="arm", kind=kinds.INTERVENE_STOP)]), timeout=10)
    next(stopper)
    stopper.cancel()
    deadline = time.monotonic() + 3.0  # the first reply can precede the loop's handling of the stop (CI once saw it)
    while stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).intervening and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).intervening


@live_loop
def test_estop_answers_within_a_tick_while_a_driver_builds_reads_first_or_closes_for_seconds(gateway, tmp_path):
    """robot_safety.md: "Whatever may block on a device runs off the gateway's event loop: a driver's constructor
    ..., the loop's first read, and `close()`." Each of the three blocks for 1.5 s in turn (the driver says when
    each begins) while EStop on another arm answers within a period plus 0.25 s."""
    stub, _, _ = gateway
    info = connect(stub, "fast")
    period = 1 / info.control_hz
    stage, took = tmp_path / "stage", {}

    def estop_during(name: str) -> None:
        deadline = time.monotonic() + 30
        while not (stage.exists() and stage.read_text() == name):
            assert time.monotonic() < deadline, f"the slow driver never began its {name}"
            time.sleep(0.01)
        t0 = time.monotonic()
        assert stub.EStop(pb.EStopRequest(robot_id="fast", reason="test"), timeout=10).estopped
        took[name] = time.monotonic() - t0
        stub.ClearEStop(pb.RobotRef(robot_id="fast"), timeout=5, metadata=as_operator())

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(connect, stub, "slow", driver="slow_sim", build_s="1.5", read_s="1.5", close_s="1.5",
                           stage_file=str(stage))
        estop_during("build")
        estop_during("read")
        assert not slow.done()  # Connect waits for the first read
        slow.result(timeout=30)
        gone = pool.submit(stub.Disconnect, pb.RobotRef(robot_id="slow"), timeout=30)
        estop_during("close")
        assert not gone.done()
        gone.result(timeout=30)
    # one period to the next tick, a quarter period of polling, and scheduling slack on a loaded 2-core host
    assert all(t < period + 0.25 for t in took.values()), took


class StuckSim(SimArm):
    """A sim arm whose command blocks for ``stuck_s`` once the test creates the file ``stuck_file`` (a bus that
    hangs mid-write). A file, since the arm's driver lives in a process of its own."""

    def __init__(self, **options: str):
        self.stuck_s = float(options.pop("stuck_s", "1"))
        self.stuck_file = Path(options.pop("stuck_file"))
        super().__init__(**options)

    def command(self, target, dt: float) -> None:
        if self.stuck_file.exists():
            self.stuck_file.unlink()
            time.sleep(self.stuck_s)
        super().command(target, dt)


register_driver("stuck_sim", f"{__name__}:StuckSim")


@live_loop
def test_an_estop_a_stuck_loop_cannot_apply_says_so_and_holds_on_the_next_tick(gateway, tmp_path, caplog):
    """Issue 39, finding 6: EStop only set a flag, and a loop stuck in its driver's I/O answered estopped=false as
    if nothing were wrong. The reply now tells an applied stop from one only requested, and the stop holds the
    arm on the loop's first tick back."""
    stub, _, _ = gateway
    stuck = tmp_path / "stuck"
    connect(stub, "arm", driver="stuck_sim", stuck_s="1.5", stuck_file=str(stuck))
    applied = stub.EStop(pb.EStopRequest(robot_id="arm", reason="test"), timeout=5)
    assert applied.estopped and applied.estop_requested and applied.holding  # a live loop applies it at once
    stub.ClearEStop(pb.RobotRef(robot_id="arm"), timeout=5, metadata=as_operator())
    stuck.touch()
    time.sleep(0.2)  # the loop is inside the driver's command now
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="rlfabric.services.robot_gateway.server"):
        requested = stub.EStop(pb.EStopRequest(robot_id="arm", reason="test"), timeout=5)
    assert time.monotonic() - t0 < 1.0  # answered while the loop is still stuck
    assert requested.estop_requested and not requested.estopped, requested
    logged = next(r for r in caplog.records if "not yet applied" in r.getMessage())  # an error, with the last
    assert logged.levelno == logging.ERROR and logged.robot == "arm" and logged.last_tick_age_s >= 0.2  # tick's age
    time.sleep(1.6)
    back = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5)
    assert back.estopped and back.holding and back.hold_reason == "e-stop", back
    assert back.seq > requested.seq


@live_loop
def test_each_arm_ticks_in_a_process_of_its_own_whose_death_fails_health(gateway):
    """Issue 39, finding 6: the loop's tick waited for the GIL behind the gateway's event loop (bench/robot_loop.py:
    a p99 jitter of 1.5 ms under load). Each arm now ticks in a process of its own; if that process dies, the
    gateway's health check names it (nothing keeps answering from a dead loop's last state). robot_safety.md: "The
    gateway re-exports each tick's lateness, jitter, holding and overruns as its own Prometheus series"."""
    stub, service, runtime = gateway
    connect(stub, "arm")
    arm = service.loops["arm"]
    assert arm.proc.pid != os.getpid() and arm.proc.poll() is None
    realtime = stub.ListRobots(pb.ListRobotsRequest(), timeout=5).robots[0].realtime
    assert realtime.startswith(("SCHED_FIFO", "no real-time priority")), realtime  # what the arm's process got
    assert runtime.probes["control-loops"]() is None
    before = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).seq
    time.sleep(0.1)
    assert stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).seq > before  # ticking, there
    from prometheus_client import REGISTRY

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"robot": "arm"})

    ticks = sample("rlfabric_robot_loop_lateness_seconds_count")
    assert ticks is not None and ticks >= 10  # the arm process's ticks, re-exported by the gateway
    # and each tick's jitter, holding (no command yet: 1) and overruns (a count, maybe 0), on the gateway too
    jitter = sample("rlfabric_robot_loop_jitter_seconds_count")
    assert jitter is not None and jitter >= 10, jitter
    assert sample("rlfabric_robot_holding") == 1.0
    assert sample("rlfabric_robot_loop_overruns_total") is not None
    stub.Disconnect(pb.RobotRef(robot_id="arm"), timeout=20)
    assert arm.proc.poll() is not None  # Disconnect ends the arm's process
    connect(stub, "arm")
    arm = service.loops["arm"]
    os.kill(arm.proc.pid, signal.SIGKILL)
    deadline, why = time.monotonic() + 5, None
    while why is None and time.monotonic() < deadline:
        time.sleep(0.05)
        why = runtime.probes["control-loops"]()
    assert why is not None and "exited (code -9)" in why, why


@live_loop
def test_a_gateway_without_an_operator_secret_lets_no_call_clear_a_latch():
    with gateway_in_process(operator_secret="") as (stub, _, _):
        connect(stub, "arm")
        assert stub.EStop(pb.EStopRequest(robot_id="arm", reason="test"), timeout=5).estopped
        err = _refused(lambda: stub.ClearEStop(pb.RobotRef(robot_id="arm"), timeout=5, metadata=as_operator()))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--operator-token-file" in err.details()
        assert stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).estopped


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line), read from /proc."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                found[int(d.name)] = (int(fields[1]), fields[0], (d / "cmdline").read_bytes().replace(b"\0", b" ")
                                      .decode(errors="replace"))
            except (OSError, IndexError, ValueError):  # (a process that ended while read)
                continue
    return found


def test_a_killed_gateway_leaves_no_arm_process_behind(tmp_path):
    """An arm process whose gateway dies (SIGKILL: nothing runs its shutdown) stops ticking, brakes and exits."""
    with gateway_process(tmp_path, TOKEN) as address:
        channel = auth.sync_channel(address, GRPC_OPTIONS, auth.Security(TOKEN))
        connect(robot_gateway_pb2_grpc.RobotGatewayStub(channel), "arm")
        channel.close()
        procs = _processes()
        gateway = next(pid for pid, (parent, _, cmd) in procs.items()
                       if parent == os.getpid() and "robot_gateway" in cmd)
        arms = [pid for pid, (parent, _, cmd) in procs.items()
                if parent == gateway and "rlfabric.services.robot_gateway.arm_process" in cmd]
        assert len(arms) == 1, procs
        os.kill(gateway, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_processes().get(pid, (0, "Z"))[1] != "Z" for pid in arms):
            time.sleep(0.05)
        assert all(_processes().get(pid, (0, "Z"))[1] == "Z" for pid in arms), "an arm process outlived its gateway"


# -- recording: memory, lost episodes, a dead recorder, replay endpoints --------------------------------------------
@live_loop
def test_recording_bounds_memory_and_replay_endpoints_come_from_the_operator(gateway):
    stub, _, _ = gateway
    connect(stub, "arm")
    err = _refused(lambda: stub.StartRecording(pb.RecordingRequest(robot_id="arm", dataset="d",
                                                                   max_episode_ticks=1 << 26), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "memory cap of 256 MiB" in err.details()
    err = _refused(lambda: stub.StartRecording(pb.RecordingRequest(robot_id="arm", dataset="d",
                                                                   queue_ticks=1 << 20), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "Fix" in err.details()
    err = _refused(lambda: stub.StartRecording(pb.RecordingRequest(
        robot_id="arm", dataset="d", replay_endpoint="tcp://169.254.169.254:80", replay_source="r"), timeout=10))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--replay-endpoints" in err.details()
    assert not stub.GetRecording(pb.RobotRef(robot_id="arm"), timeout=5).recording


class _FailingSink:
    name = "object_store"

    def write(self, episode) -> str:
        raise OSError("disk full")


def _tick(loop_tick, episode: int):
    from dataclasses import replace

    return replace(loop_tick, episode=episode)


@live_loop
def test_an_episode_no_sink_took_counts_failed_not_kept():
    from rlfabric.services.robot_gateway.loop import Tick

    base = Tick(0, 0.0, np.zeros(3), np.zeros(3), np.zeros(3), False, "", False, "", 0.0, 0.0, 0, 1)
    fates: list = []
    from prometheus_client import REGISTRY

    def failed_total() -> float:
        return REGISTRY.get_sample_value("rlfabric_robot_recorded_episodes_total",
                                         {"robot": "lost", "fate": "failed"}) or 0.0

    before = failed_total()
    rec = Recorder("lost", ["a", "b", "c"], 100.0, [_FailingSink()], on_episode=lambda e, f: fates.append(f))
    rec.start()
    for _ in range(5):
        rec.offer(_tick(base, 0))
    rec.episode_ended(0, "success")
    rec.offer(_tick(base, 1))
    deadline = time.monotonic() + 5
    while not fates and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.stop()
    assert fates[0] == "failed" and rec.stats.episodes_kept == 0 and rec.stats.episodes_failed == 1
    assert "disk full" in rec.stats.last_error and rec.stats.write_errors == 1
    assert failed_total() == before + 1  # rlfabric_robot_recorded_episodes_total{fate="failed"}


@live_loop
def test_a_dead_recorder_thread_fails_the_gateways_health_check(gateway):
    stub, service, runtime = gateway
    connect(stub, "arm")
    assert stub.StartRecording(pb.RecordingRequest(robot_id="arm", dataset="d"), timeout=10).recording
    assert all(probe() is None for probe in runtime.probes.values())
    rec = service.recorders["arm"]
    rec.offer(object())  # a tick it cannot read: the recorder thread dies
    rec.thread.join(5)
    assert not rec.thread.is_alive()
    why = [w for probe in runtime.probes.values() if (w := probe())]
    assert why and "recorder of arm died" in why[0], why


@live_loop
def test_kept_limits_that_no_longer_hold_the_arm_latch_a_fault_and_never_yank_it(gateway):
    """The arm was moved while disconnected (here: it starts elsewhere): its kept limits leave it out. The loop
    holds on a latched fault, with the limits widened only as far as the arm is, never yanking it back."""
    stub, _, _ = gateway
    connect(stub, "arm", name="moved")
    stub.SetLimits(pb.SafetyLimits(robot_id="arm", position_max=[0.1, 1.6, 2.3]), timeout=5)
    stub.Disconnect(pb.RobotRef(robot_id="arm"), timeout=10)
    connect(stub, "arm", name="moved", start="0.5,-0.3,0.6")
    state = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5)
    assert state.holding and "do not fit" in state.fault and state.target[0] == pytest.approx(0.5), state
    limits = stub.SetLimits(pb.SafetyLimits(robot_id="arm"), timeout=5)
    assert limits.position_max[0] == pytest.approx(0.5) and limits.position_max[1] == pytest.approx(1.6)


@live_loop
def test_robots_that_come_and_go_leave_no_series_and_no_lock_behind(gateway):
    """Robot ids are the clients': each fresh id used to add Prometheus series, an id-lock entry and a recorder
    for good."""
    from prometheus_client import REGISTRY

    stub, service, _ = gateway

    def series_of(rid: str) -> int:
        return sum(s.labels.get("robot") == rid for m in REGISTRY.collect() for s in m.samples)

    for n in range(4):
        rid = f"visitor-{n}"
        connect(stub, rid)
        stub.StartRecording(pb.RecordingRequest(robot_id=rid, dataset="d"), timeout=10)
        stub.EStop(pb.EStopRequest(robot_id=rid, reason="test"), timeout=5)  # (the device keeps its latch)
        assert series_of(rid) > 0 and rid in service.recorders
        stub.Disconnect(pb.RobotRef(robot_id=rid), timeout=10)
        assert series_of(rid) == 0, rid
    with pytest.raises(grpc.RpcError):  # a refused Connect leaves nothing either
        stub.Connect(pb.ConnectRequest(robot_id="bad", driver="no-such-driver"), timeout=10)
    assert service.id_locks == {} and service.recorders == {} and service.recording_requests == {}
