"""The robot gateway as a service (sim driver): only authenticated clients connect or command; a Control stream
gets one state per tick with its timing; a dead commanding process (SIGKILL) leaves the arm in safe hold within
the watchdog window plus one tick; e-stop latches; limits cannot be widened through the API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc  # noqa: E402
from rlfabric.services.core.runtime import GRPC_OPTIONS  # noqa: E402
from tests.robot_support import OPERATOR_SECRET, as_operator, gateway_process  # noqa: E402

pytestmark = pytest.mark.serial  # a 100 Hz deadline loop: timed, so never beside another test

TOKEN = "robot-gateway-test-token"
START = [0.0, -0.3, 0.6]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with gateway_process(tmp_path_factory.mktemp("gw"), TOKEN) as address:
        channel = auth.sync_channel(address, GRPC_OPTIONS, auth.Security(TOKEN))
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
        info = stub.Connect(pb.ConnectRequest(robot_id="arm", driver="sim", options={"start": "0,-0.3,0.6"},
                                              control_hz=100, watchdog_s=0.05), timeout=30)
        yield address, stub, info
        channel.close()


def test_a_client_without_the_token_is_refused(gateway):
    address, _, _ = gateway
    with grpc.insecure_channel(address) as ch:
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(ch)
        for call in (lambda: stub.Connect(pb.ConnectRequest(robot_id="x", driver="sim"), timeout=5),
                     lambda: stub.EStop(pb.EStopRequest(robot_id="arm"), timeout=5),
                     lambda: next(stub.Control(iter([pb.JointCommand(robot_id="arm", position=START)]),
                                               timeout=5))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_control_stream_gets_a_state_per_tick_with_its_timing(gateway):
    _, stub, info = gateway
    assert list(info.joint_names) == ["yaw", "shoulder", "elbow"] and info.realtime

    def commands():
        for seq in range(40):
            yield pb.JointCommand(robot_id="arm", seq=seq, position=[0.1, -0.3, 0.6])
            time.sleep(0.01)

    states = []
    for state in stub.Control(commands(), timeout=10):
        states.append(state)
        if len(states) == 30:
            break
    ticks = [s.seq for s in states]
    assert ticks == list(range(ticks[0], ticks[0] + 30))  # every tick, in order
    assert any(not s.holding and s.command_seq >= 0 for s in states)
    assert all(s.loop_lateness_s >= 0 and s.loop_jitter_s >= 0 for s in states)
    assert max(s.target[0] for s in states) > 0.05  # it followed the command, at the slew limit


def test_a_killed_commanding_process_leaves_the_arm_in_safe_hold(gateway, tmp_path):
    """A learner/rollout that dies mid-episode: its stream breaks, no command arrives, the watchdog holds."""
    address, stub, info = gateway
    client = tmp_path / "client.py"
    client.write_text(textwrap.dedent(f"""
        import sys, time
        from rlfabric.services.core import auth
        from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb, robot_gateway_pb2_grpc
        from rlfabric.services.core.runtime import GRPC_OPTIONS
        ch = auth.sync_channel({address!r}, GRPC_OPTIONS, auth.Security({TOKEN!r}))
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(ch)
        def commands():
            seq = 0
            while True:
                seq += 1
                yield pb.JointCommand(robot_id="arm", seq=seq, position=[0.1, -0.3, 0.6])
                time.sleep(0.01)
        for state in stub.Control(commands()):
            if not state.holding:
                print("FOLLOWING", flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(client)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=os.getcwd(), stdin=subprocess.DEVNULL)
    assert proc.stdout.readline().strip() == b"FOLLOWING", proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    proc.wait()
    deadline = killed + 3
    while time.monotonic() < deadline:
        state = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5)
        if state.holding:
            break
        time.sleep(0.005)
    assert state.holding and state.hold_reason.startswith("watchdog"), state
    # the last command arrived before the kill: the hold began within the window plus one tick of it
    assert time.monotonic() - killed < info.watchdog_s + 1 / info.control_hz + 0.5


def test_estop_latches_and_limits_cannot_be_widened_through_the_api(gateway):
    _, stub, info = gateway
    stopped = stub.EStop(pb.EStopRequest(robot_id="arm", reason="test"), timeout=5)
    assert stopped.estopped and stopped.holding and stopped.hold_reason == "e-stop"
    states = stub.Control(iter([pb.JointCommand(robot_id="arm", seq=1, position=START)]), timeout=5)
    assert all(s.estopped and s.holding for s, _ in zip(states, range(10), strict=False))
    for metadata in ((), as_operator("a-guess-at-the-operators-secret")):  # a token holder's, a wrong one
        with pytest.raises(grpc.RpcError) as err:
            stub.ClearEStop(pb.RobotRef(robot_id="arm"), timeout=5, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "clear-estop" in err.value.details()
    assert stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).estopped
    cleared = stub.ClearEStop(pb.RobotRef(robot_id="arm"), timeout=5, metadata=as_operator())
    assert not cleared.estopped and cleared.holding  # no fresh command yet

    hard = info.limits
    with pytest.raises(grpc.RpcError) as err:
        stub.SetLimits(pb.SafetyLimits(robot_id="arm", velocity_max=[v * 2 for v in hard.velocity_max]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "velocity_max[0]" in err.value.details()
    narrowed = stub.SetLimits(pb.SafetyLimits(robot_id="arm", jump_max=0.2), timeout=5)
    assert narrowed.jump_max == pytest.approx(0.2) and list(narrowed.velocity_max) == list(hard.velocity_max)
    with pytest.raises(grpc.RpcError) as err:
        stub.Control(iter([pb.JointCommand(robot_id="arm", position=[0.0, 0.1])]), timeout=5).next()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3 finite values" in err.value.details()


def test_a_scripted_expert_takes_over_when_the_policy_drifts_and_hands_back(gateway):
    """HG-DAgger's takeover at the gateway: the policy drifts the base joint away; a scripted expert watching the
    states intervenes past 0.25 rad, its commands replace the policy's (through the same limits) and bring the arm
    back, then it hands back and calls the episode a success; the counts say the episode had an intervention."""
    import queue
    import threading

    address, stub, info = gateway
    stub.ClearEStop(pb.RobotRef(robot_id="arm"), timeout=5, metadata=as_operator())
    stub.SetLimits(pb.SafetyLimits(robot_id="arm", jump_max=info.limits.jump_max), timeout=5)
    expert_events: queue.Queue = queue.Queue()
    watch = stub.StreamInterventions(pb.RobotRef(robot_id="arm"), timeout=20)
    interventions: list = []

    def watcher() -> None:
        try:
            interventions.extend(watch)
        except grpc.RpcError as exc:  # cancelled at the end of the test
            assert exc.code() == grpc.StatusCode.CANCELLED

    threading.Thread(target=watcher, daemon=True).start()
    stop = threading.Event()

    def policy():  # drifts: the base joint's command creeps up every tick
        seq, yaw = 0, 0.0
        while not stop.is_set():
            seq += 1
            yaw = min(yaw + 0.01, 0.6)
            yield pb.JointCommand(robot_id="arm", seq=seq, position=[yaw, -0.3, 0.6])
            time.sleep(0.01)

    def expert():
        while True:
            event = expert_events.get()
            if event is None:
                return
            yield event

    policy_states = stub.Control(policy(), timeout=20)
    teleop_states = stub.Teleop(expert(), timeout=20)
    kinds = pb.TeleopEvent.Kind
    took_over = handed_back = False
    seen = []
    for state in policy_states:
        seen.append(state)
        if not took_over and state.position[0] > 0.25:
            took_over = True
            expert_events.put(pb.TeleopEvent(robot_id="arm", kind=kinds.INTERVENE_START,
                                              command=pb.JointCommand(robot_id="arm", seq=1000,
                                                                      position=[0.2, -0.3, 0.6])))
        elif took_over and not handed_back:
            goal = max(0.0, state.target[0] - 0.04)  # the expert walks the arm back, within the slew limit
            expert_events.put(pb.TeleopEvent(robot_id="arm", kind=kinds.COMMAND, command=pb.JointCommand(
                robot_id="arm", seq=1000 + len(seen), position=[goal, -0.3, 0.6])))
            if abs(state.position[0]) < 0.05:
                handed_back = True
                expert_events.put(pb.TeleopEvent(robot_id="arm", kind=kinds.INTERVENE_STOP))
                expert_events.put(pb.TeleopEvent(robot_id="arm", kind=kinds.SUCCESS))
        elif handed_back and state.episode >= 1 and not state.intervening:
            break
        assert len(seen) < 1500, "the expert never brought the arm back"
    stop.set()
    expert_events.put(None)
    teleop_states.cancel()
    watch.cancel()
    intervened = [s for s in seen if s.intervening]
    assert intervened and all(s.command_seq >= 1000 for s in intervened[1:])  # the human's commands drove it
    assert min(s.target[0] for s in intervened) < 0.05  # ... back to the start, against the policy's drift
    assert all(s.episode_intervened_ticks > 0 for s in intervened[1:])
    assert seen[-1].episode == 1 and not seen[-1].intervening and seen[-1].command_seq < 1000  # the policy again
    assert [i.active for i in interventions][:2] == [True, False]


def test_disconnect_stops_and_frees_a_robot(gateway):
    _, stub, _ = gateway
    stub.Connect(pb.ConnectRequest(robot_id="spare", driver="sim"), timeout=30)
    last = stub.Disconnect(pb.RobotRef(robot_id="spare"), timeout=10)
    assert last.robot_id == "spare"
    with pytest.raises(grpc.RpcError) as err:
        stub.GetState(pb.RobotRef(robot_id="spare"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    stub.Connect(pb.ConnectRequest(robot_id="spare", driver="sim"), timeout=30)  # the id is free again
    stub.Disconnect(pb.RobotRef(robot_id="spare"), timeout=10)


def test_rlfabric_robot_clear_estop_clears_with_the_operators_file_and_only_with_it(gateway, tmp_path):
    address, stub, _ = gateway
    assert stub.EStop(pb.EStopRequest(robot_id="arm", reason="test"), timeout=5).estopped
    right = auth.write_token_file(tmp_path / "operator", OPERATOR_SECRET)
    wrong = auth.write_token_file(tmp_path / "guess", "a-guess-at-the-operators-secret")

    def clear(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")}
        return subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "robot", "clear-estop", "arm", "--gateway",
                               address, *args], env={**env, "RLFABRIC_TOKEN": TOKEN}, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)

    missing = clear()
    assert missing.returncode == 2 and "--operator-token-file" in missing.stderr + missing.stdout
    refused = clear("--operator-token-file", str(wrong))
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr + refused.stdout
    assert stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5).estopped
    cleared = clear("--operator-token-file", str(right))
    assert cleared.returncode == 0, cleared.stderr
    state = stub.GetState(pb.RobotRef(robot_id="arm"), timeout=5)
    assert not state.estopped and state.holding  # cleared, and still holding until a fresh command
