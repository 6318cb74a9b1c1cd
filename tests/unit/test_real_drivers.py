"""The real-arm drivers without the arms: kinematics against known poses and against pinocchio on the URDFs, the
published limits, unit conversions, option errors that name the option, connection failures that name it fast,
and the franka driver end to end against franky-sim (a libfranka-protocol simulator served on a loopback address).
Whatever needs a library that is not installed is skipped, saying which."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rlfabric.services.robot_gateway.drivers import DriverConnectionError, DriverOptionError, build_driver
from rlfabric.services.robot_gateway.drivers.franka import JOINT_LIMITS, FrankaArm, flange_pose
from rlfabric.services.robot_gateway.drivers.so_follower import (
    ARM,
    URDF_MAX,
    URDF_MIN,
    SO101Arm,
    calibrated_limits,
    from_lerobot,
    gripper_frame,
    to_lerobot,
)
from rlfabric.services.robot_gateway.safety import SafetyFilter

HAS = {m: importlib.util.find_spec(m) is not None for m in ("franky", "pylibfranka", "franky_sim", "pinocchio")}
READY = np.array([0.0, -math.pi / 4, 0.0, -3 * math.pi / 4, 0.0, math.pi / 2, math.pi / 4])


def free_loopback() -> str:
    """A 127.x.y.z address nobody listens on at libfranka's port, so parallel runs never meet."""
    for _ in range(50):
        host = f"127.{np.random.randint(1, 255)}.{np.random.randint(1, 255)}.{np.random.randint(2, 255)}"
        with socket.socket() as s:
            if s.connect_ex((host, 1337)) != 0:
                return host
    raise RuntimeError("no free loopback address")


# -- Franka kinematics and limits -----------------------------------------------------------------------------
def test_panda_dh_at_known_poses():
    # q = 0: the arm stands straight up; the flange is 0.088 m forward of the axis at 0.333+0.316+0.384-0.107 m
    assert np.allclose(flange_pose(np.zeros(7))[:3, 3], [0.088, 0.0, 0.926], atol=1e-9)
    # joint 1 turns the whole arm about z
    assert np.allclose(flange_pose([math.pi / 2, 0, 0, 0, 0, 0, 0])[:3, 3], [0.0, 0.088, 0.926], atol=1e-9)
    # the "ready" pose: flange pointing down, 0.107 m above the hand's TCP at about (0.307, 0, 0.487)
    pose = flange_pose(READY)
    assert np.allclose(pose[:3, 2], [0, 0, -1], atol=1e-9)
    assert np.allclose(pose[:3, 3] + 0.1034 * pose[:3, 2], [0.3069, 0.0, 0.4867], atol=1e-3)


@pytest.mark.skipif(not (HAS["franky_sim"] and HAS["pinocchio"]),
                    reason="needs franky-sim (ships Franka's fr3.urdf) and pin (pinocchio) to cross-check the DH")
def test_dh_matches_pinocchio_on_franka_urdf():
    import franky_sim
    import pinocchio as pin

    urdf = next(iter(__import__("pathlib").Path(franky_sim.__file__).parent.glob("assets/fr3.urdf")))
    model = pin.buildModelFromUrdf(str(urdf))
    data, frame = model.createData(), model.getFrameId("fr3_link8")
    lo, hi, _ = JOINT_LIMITS["fr3"]
    rng = np.random.default_rng(0)
    for _ in range(20):
        q = rng.uniform(lo, hi)
        qp = pin.neutral(model)
        qp[:7] = q
        pin.framesForwardKinematics(model, data, qp)
        assert np.allclose(flange_pose(q), data.oMf[frame].homogeneous, atol=1e-9)


@pytest.mark.skipif(not HAS["franky_sim"], reason="needs franky-sim, which ships Franka's fr3.urdf")
def test_published_fr3_limits_lie_within_the_urdf():
    import xml.etree.ElementTree as ET

    import franky_sim

    root = ET.parse(__import__("pathlib").Path(franky_sim.__file__).parent / "assets/fr3.urdf").getroot()
    joints = {j.get("name"): j.find("limit") for j in root.iter("joint")}
    lo, hi, vmax = JOINT_LIMITS["fr3"]
    for i in range(7):
        limit = joints[f"fr3_joint{i + 1}"]
        assert float(limit.get("lower")) <= lo[i] < hi[i] <= float(limit.get("upper"))
        assert vmax[i] == pytest.approx(float(limit.get("velocity")))


def test_franka_workspace_box_holds_every_reachable_point():
    arm = object.__new__(FrankaArm)
    arm.model, arm.tcp_z = "panda", 0.1034
    limits = arm.hard_limits()
    rng = np.random.default_rng(1)
    for q in rng.uniform(limits.position_min, limits.position_max, size=(200, 7)):
        xyz = arm.forward_kinematics(q)
        assert (xyz >= limits.workspace_min).all() and (xyz <= limits.workspace_max).all()


# -- Franka options and connection ---------------------------------------------------------------------------
@pytest.mark.parametrize("options, named", [
    ({}, "options.ip"),
    ({"ip": "127.0.0.1", "backend": "ros"}, "options.backend"),
    ({"ip": "127.0.0.1", "model": "ur5"}, "options.model"),
    ({"ip": "127.0.0.1", "dynamics": "2"}, "options.dynamics"),
    ({"ip": "127.0.0.1", "dynamics": "fast"}, "options.dynamics"),
    ({"ip": "127.0.0.1", "connect_timeout_s": "0"}, "options.connect_timeout_s"),
    ({"ip": "127.0.0.1", "speed": "1"}, "speed"),
])
def test_franka_option_errors_name_the_option_and_the_fix(options, named):
    with pytest.raises(DriverOptionError, match="Fix") as err:
        build_driver("franka", options)
    assert named in str(err.value)


@pytest.mark.skipif(not HAS["franky"], reason="needs franky-control (the default backend) installed")
def test_franka_no_robot_fails_fast_naming_ip():
    host = free_loopback()
    t0 = time.monotonic()
    with pytest.raises(DriverConnectionError, match=f"options.ip={host}.*Fix") as err:
        build_driver("franka", {"ip": host, "connect_timeout_s": "1"})
    assert time.monotonic() - t0 < 5
    assert isinstance(err.value, ValueError)  # the gateway's Connect answers INVALID_ARGUMENT with the message


@pytest.fixture
def franka_sim():
    """franky-sim's MuJoCo FR3 served on a fresh loopback address; stopped after the test."""
    host = free_loopback()
    proc = subprocess.Popen([sys.executable, "-m", "franky_sim.run_server", "-s", "mujoco", "--hostname", host],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # it prints this once it serves; probing its port early upsets its one client slot
        if "Connect to the server using" in line:
            break
    assert proc.poll() is None, proc.communicate()[0]
    yield host
    proc.terminate()
    proc.communicate(timeout=10)


@pytest.mark.skipif(not (HAS["franky"] and HAS["franky_sim"]),
                    reason="needs franky-control and franky-sim (a libfranka-protocol simulator)")
@pytest.mark.serial  # libfranka's 1 kHz real-time exchange with the simulator: never beside another test
def test_franka_franky_backend_tracks_targets_on_franky_sim(franka_sim):
    arm = build_driver("franka", {"ip": franka_sim, "model": "fr3", "dynamics": "0.3"})
    try:
        q0, dq0 = arm.read()
        assert q0.shape == (7,) and np.abs(dq0).max() < 1e-2
        start = arm.forward_kinematics(q0)
        target = q0.copy()
        for k in range(200):  # 2 s of 100 Hz ticks, the gateway's way: a slew-limited ramp of 0.1 rad, then a hold
            target[0] += 0.005 if k < 20 else 0.0
            arm.read()  # every tick measures before it commands
            arm.command(target, 0.01)
            time.sleep(0.01)
        q1, _ = arm.read()
        assert abs(q1[0] - target[0]) < 5e-3 and np.abs(q1[1:] - q0[1:]).max() < 5e-3
        assert not np.allclose(arm.forward_kinematics(q1), start)
        # the gateway's filter accepts the driver as it is
        verdict = SafetyFilter(arm.hard_limits(), arm.forward_kinematics).apply(q1, q1, q1, 0.01)
        assert not verdict.fault
    finally:
        arm.close()


PYLIBFRANKA_RUN = """
import sys, time, numpy as np
from rlfabric.services.robot_gateway.drivers import build_driver
arm = build_driver("franka", {"ip": sys.argv[1], "model": "fr3", "backend": "pylibfranka", "dynamics": "0.3"})
q0, _ = arm.read()
target = q0.copy()
for k in range(200):
    target[0] += 0.005 if k < 20 else 0.0
    arm.read(); arm.command(target, 0.01); time.sleep(0.01)
q1, _ = arm.read()
arm.close()
print("MOVED", q1[0] - q0[0], np.abs(q1[1:] - q0[1:]).max())
"""


@pytest.mark.skipif(not (HAS["pylibfranka"] and HAS["franky_sim"]),
                    reason="needs pylibfranka and franky-sim (a libfranka-protocol simulator)")
@pytest.mark.serial  # libfranka's 1 kHz real-time exchange with the simulator: never beside another test
def test_franka_pylibfranka_backend_tracks_targets_on_franky_sim(franka_sim):
    # its own process: pylibfranka and franky register the same libfranka types and refuse to share one
    out = subprocess.run([sys.executable, "-c", PYLIBFRANKA_RUN, franka_sim], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    moved, others = map(float, out.stdout.split("MOVED")[1].split())
    assert abs(moved - 0.1) < 5e-3 and others < 5e-3


# -- SO-100/SO-101 --------------------------------------------------------------------------------------------
URDF_JOINTS = """<robot name="so101">{links}
  <joint name="shoulder_pan" type="revolute"><parent link="base"/><child link="shoulder"/>
    <origin xyz="0.0207909 -0.0230745 0.0948817" rpy="-3.14159 6.03684e-16 1.5708"/><axis xyz="0 0 1"/>
    <limit effort="10" velocity="10" lower="-1.91986" upper="1.91986"/></joint>
  <joint name="shoulder_lift" type="revolute"><parent link="shoulder"/><child link="upper_arm"/>
    <origin xyz="-0.0303992 -0.0182778 -0.0542" rpy="-1.5708 -1.5708 0"/><axis xyz="0 0 1"/>
    <limit effort="10" velocity="10" lower="-1.74533" upper="1.74533"/></joint>
  <joint name="elbow_flex" type="revolute"><parent link="upper_arm"/><child link="lower_arm"/>
    <origin xyz="-0.11257 -0.028 2.46331e-16" rpy="-1.22818e-15 5.75928e-16 1.5708"/><axis xyz="0 0 1"/>
    <limit effort="10" velocity="10" lower="-1.69" upper="1.69"/></joint>
  <joint name="wrist_flex" type="revolute"><parent link="lower_arm"/><child link="wrist"/>
    <origin xyz="-0.1349 0.0052 1.65232e-16" rpy="3.2474e-15 2.86219e-15 -1.5708"/><axis xyz="0 0 1"/>
    <limit effort="10" velocity="10" lower="-1.65806" upper="1.65806"/></joint>
  <joint name="wrist_roll" type="revolute"><parent link="wrist"/><child link="gripper"/>
    <origin xyz="0 -0.0611 0.0181" rpy="1.5708 -9.38083e-08 3.14159"/><axis xyz="0 0 1"/>
    <limit effort="10" velocity="10" lower="-2.79253" upper="2.79253"/></joint>
  <joint name="gripperframe_frame" type="fixed"><parent link="gripper"/><child link="gripperframe"/>
    <origin xyz="-0.0079 -0.000218121 -0.0981274" rpy="1.5708 1.22465e-16 1.5708"/></joint>
</robot>"""


@pytest.mark.skipif(not HAS["pinocchio"], reason="needs pin (pinocchio) to parse the SO-101 URDF's joints")
def test_so101_kinematics_match_pinocchio_on_the_urdf_joints():
    import pinocchio as pin

    links = "".join(f'<link name="{n}"/>' for n in ("base", "shoulder", "upper_arm", "lower_arm", "wrist",
                                                     "gripper", "gripperframe"))
    model = pin.buildModelFromXML(URDF_JOINTS.format(links=links))
    data, frame = model.createData(), model.getFrameId("gripperframe")
    for q in np.random.default_rng(2).uniform(URDF_MIN[:5], URDF_MAX[:5], size=(20, 5)):
        pin.framesForwardKinematics(model, data, q)
        assert np.allclose(gripper_frame(q), data.oMf[frame].homogeneous, atol=1e-9)


def test_so101_zero_pose_reaches_forward_and_up():
    # mid-range zero: the arm stands folded up in front of the base (x along the base's -y in the URDF)
    xyz = gripper_frame(np.zeros(5))[:3, 3]
    assert 0.1 < np.linalg.norm(xyz) < 0.6 and xyz[2] > 0.05


def test_lerobot_units_round_trip():
    q = np.array([0.1, -0.5, 1.2, -1.0, 2.0, 0.25])
    action = to_lerobot(q)
    assert set(action) == {f"{j}.pos" for j in [*ARM, "gripper"]}
    assert action["shoulder_pan.pos"] == pytest.approx(math.degrees(0.1)) and action["gripper.pos"] == 25.0
    assert np.allclose(from_lerobot(action), q)


def test_calibrated_limits_are_the_range_about_its_middle_within_the_urdf():
    # 4095 steps are 360 degrees; a 2048-step range is about +-90 degrees; wrist_roll's full turn meets the URDF's
    cal = {m: SimpleNamespace(range_min=1024, range_max=3072) for m in ARM}
    cal["wrist_roll"] = SimpleNamespace(range_min=0, range_max=4095)
    lo, hi = calibrated_limits(cal)
    half = 1024 * 2 * math.pi / 4095
    assert hi[0] == pytest.approx(min(half, URDF_MAX[0])) and lo[2] == pytest.approx(max(-half, URDF_MIN[2]))
    assert hi[4] == pytest.approx(URDF_MAX[4]) and (lo[5], hi[5]) == (0.0, 1.0)


@pytest.mark.parametrize("options, named", [
    ({"id": "arm"}, "options.port"),
    ({"port": "/dev/ttyACM0"}, "options.id"),
    ({"port": "/dev/ttyACM0", "id": "arm", "baud": "1"}, "baud"),
])
def test_so_option_errors_name_the_option(options, named):
    with pytest.raises(DriverOptionError, match="Fix") as err:
        build_driver("so101", options)
    assert named in str(err.value)


def _lerobot_so_follower() -> str:
    """Why LeRobot's follower class cannot be imported here, or '' when it can."""
    try:
        from rlfabric.services.robot_gateway.drivers.so_follower import _robot_classes

        _robot_classes("so101")
        return ""
    except Exception as exc:  # noqa: BLE001 - any failure to import is the reason to skip
        return f"LeRobot's SO101Follower cannot be imported here ({exc!r}); lerobot>=0.5 needs Python 3.12 and " \
               f"0.4.x imports torchvision, which needs a torch it matches"


LEROBOT_MISSING = _lerobot_so_follower()


@pytest.mark.skipif(bool(LEROBOT_MISSING), reason=LEROBOT_MISSING or "lerobot importable")
def test_so101_without_calibration_names_id(tmp_path):
    with pytest.raises(DriverOptionError, match="options.id=nobody.*lerobot-calibrate"):
        SO101Arm(port="/dev/rgd-no-such-port", id="nobody", calibration_dir=str(tmp_path))


@pytest.mark.skipif(bool(LEROBOT_MISSING), reason=LEROBOT_MISSING or "lerobot importable")
def test_so101_without_an_arm_on_the_port_names_port(tmp_path):
    cal = {m: {"id": i + 1, "drive_mode": 0, "homing_offset": 0, "range_min": 1024, "range_max": 3072}
           for i, m in enumerate([*ARM, "gripper"])}
    (tmp_path / "arm.json").write_text(json.dumps(cal))
    t0 = time.monotonic()
    with pytest.raises(DriverConnectionError, match="options.port=/dev/rgd-no-such-port.*Fix"):
        SO101Arm(port="/dev/rgd-no-such-port", id="arm", calibration_dir=str(tmp_path))
    assert time.monotonic() - t0 < 5


def test_device_keys_name_the_physical_device_however_it_is_written(tmp_path):
    from rlfabric.services.robot_gateway.drivers.franka import FrankaArm
    from rlfabric.services.robot_gateway.drivers.so_follower import SO100Arm, SO101Arm

    assert FrankaArm.device_key({"ip": "172.16.0.2"}, "a") == FrankaArm.device_key({"ip": " 172.16.0.2 "}, "b")
    assert FrankaArm.device_key({"ip": "172.16.0.2"}, "a") != FrankaArm.device_key({"ip": "172.16.0.3"}, "a")
    # the forms the resolver (and so libfranka) reads as one address each get the one latch, a host name too
    for alias in ("172.16.0.02", "172.16.2"):
        assert FrankaArm.device_key({"ip": alias}, "c") == FrankaArm.device_key({"ip": "172.16.0.2"}, "a"), alias
    assert FrankaArm.device_key({"ip": "localhost"}, "d") == FrankaArm.device_key({"ip": "127.0.0.1"}, "a")
    port = tmp_path / "ttyACM0"
    port.touch()
    (tmp_path / "by-id").symlink_to(port)
    assert SO101Arm.device_key({"port": str(tmp_path / "by-id")}, "a") == SO100Arm.device_key({"port": str(port)}, "b")


def test_so_release_torque_is_true_or_false():
    with pytest.raises(DriverOptionError, match="options.release_torque='yes'.*Fix"):
        build_driver("so101", {"port": "/dev/ttyACM0", "id": "arm", "release_torque": "yes"})
