"""``so100`` / ``so101``: the SO-100/SO-101 follower arm (six Feetech STS3215 servos) through LeRobot's robot class.

LeRobot owns the bus, the calibration and the servo setup; the gateway speaks radians. The robot is built with
``use_degrees=True`` (LeRobot's degrees are centred on the middle of each joint's calibrated range, the zero of
TheRobotStudio's ``so101_new_calib.urdf``), so a joint's radians are its degrees times pi/180. The gripper is not
an angle in LeRobot (0..100 % of its calibrated range): here it is that fraction, 0..1.

Options (strings):
    port             the serial port of the arm's bus board, e.g. /dev/ttyACM0 (required)
    id               the calibration's name: LeRobot reads <calibration_dir>/<id>.json (required)
    calibration_dir  where that file is (default: LeRobot's, ~/.cache/huggingface/lerobot/calibration/robots/...)
    release_torque   true: Disconnect (and a stopping gateway) turns the servos' torque off, so the arm drops under
                     gravity; false (default): the servos keep torque and hold the last target until their power
                     is cut (LeRobot's default would drop the arm, so the gateway asks it not to)

The arm must be calibrated beforehand (``lerobot-calibrate``): calibrating asks a person to move the arm, which a
gateway cannot do. Hard position limits are each joint's calibrated range intersected with the URDF's.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from pathlib import Path

import numpy as np

from rlfabric.services.robot_gateway.drivers import (
    Driver,
    DriverConnectionError,
    DriverOptionError,
    DriverUnavailable,
)
from rlfabric.services.robot_gateway.safety import Limits

ARM = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll"]
JOINTS = [*ARM, "gripper"]
STEPS = 4096  # STS3215 encoder resolution per turn
# URDF joint limits [rad] of so101_new_calib.urdf (TheRobotStudio/SO-ARM100), and the gripper's 0..1.
URDF_MIN = np.array([-1.91986, -1.74533, -1.69, -1.65806, -2.79253, 0.0])
URDF_MAX = np.array([1.91986, 1.74533, 1.69, 1.65806, 2.79253, 1.0])
# STS3215 no-load speed is 0.222 s per 60 degrees at 7.4 V (4.7 rad/s); the gateway allows 3 rad/s, the gripper 2/s.
VELOCITY_MAX = np.array([3.0, 3.0, 3.0, 3.0, 3.0, 2.0])
# Joint origins (xyz, rpy) of so101_new_calib.urdf from the base to each arm joint, then to the gripper frame.
CHAIN = [
    ((0.0207909, -0.0230745, 0.0948817), (-3.14159, 6.03684e-16, 1.5708)),
    ((-0.0303992, -0.0182778, -0.0542), (-1.5708, -1.5708, 0.0)),
    ((-0.11257, -0.028, 2.46331e-16), (-1.22818e-15, 5.75928e-16, 1.5708)),
    ((-0.1349, 0.0052, 1.65232e-16), (3.2474e-15, 2.86219e-15, -1.5708)),
    ((0.0, -0.0611, 0.0181), (1.5708, -9.38083e-08, 3.14159)),
]
GRIPPER_FRAME = ((-0.0079, -0.000218121, -0.0981274), (1.5708, 1.22465e-16, 1.5708))
REACH = 0.0948817 + 0.0542 + 0.11257 + 0.028 + 0.1349 + 0.0611 + 0.0981274 + 0.05  # every offset, and a margin


def _origin(xyz, rpy) -> np.ndarray:
    """A URDF joint origin as a 4x4 transform (rpy: fixed-axis roll, pitch, yaw)."""
    r, p, y = rpy
    cr, sr, cp, sp, cy, sy = math.cos(r), math.sin(r), math.cos(p), math.sin(p), math.cos(y), math.sin(y)
    t = np.eye(4)
    t[:3, :3] = [[cy * cp, cy * sp * sr - sy * cr, cy * sp * cr + sy * sr],
                 [sy * cp, sy * sp * sr + cy * cr, sy * sp * cr - cy * sr],
                 [-sp, cp * sr, cp * cr]]
    t[:3, 3] = xyz
    return t


def _rot_z(theta: float) -> np.ndarray:
    t = np.eye(4)
    t[:2, :2] = [[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]]
    return t


def gripper_frame(q: np.ndarray) -> np.ndarray:
    """The gripper frame's 4x4 pose in the base frame at the five arm joints ``q[:5]`` (rad; every axis is z)."""
    pose = np.eye(4)
    for (xyz, rpy), theta in zip(CHAIN, np.asarray(q, float)[:5], strict=True):
        pose = pose @ _origin(xyz, rpy) @ _rot_z(theta)
    return pose @ _origin(*GRIPPER_FRAME)


def to_lerobot(q: np.ndarray) -> dict[str, float]:
    """Gateway units (rad, gripper 0..1) to LeRobot's action (degrees, gripper 0..100)."""
    q = np.asarray(q, float)
    return {**{f"{m}.pos": math.degrees(v) for m, v in zip(ARM, q[:5], strict=True)}, "gripper.pos": 100.0 * q[5]}


def from_lerobot(obs: dict[str, float]) -> np.ndarray:
    """LeRobot's observation (degrees, gripper 0..100) to gateway units (rad, gripper 0..1)."""
    return np.array([*(math.radians(obs[f"{m}.pos"]) for m in ARM), obs["gripper.pos"] / 100.0])


def calibrated_limits(calibration: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each arm joint's calibrated range in radians about its middle (LeRobot's degrees zero), within the URDF's."""
    half = np.array([(calibration[m].range_max - calibration[m].range_min) / 2 * 2 * math.pi / (STEPS - 1)
                     for m in ARM])
    lo, hi = np.maximum(URDF_MIN, [*-half, 0.0]), np.minimum(URDF_MAX, [*half, 1.0])
    return lo, hi


def _robot_classes(model: str):
    """LeRobot's follower class and its config: ``so_follower`` from 0.4.4 on, ``so10Xfollower`` before."""
    try:
        module = importlib.import_module("lerobot.robots.so_follower")
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("lerobot.robots"):
            raise
        module = importlib.import_module(f"lerobot.robots.{model}_follower")
    name = model.upper()
    return getattr(module, f"{name}Follower"), getattr(module, f"{name}FollowerConfig")


class _SOArm(Driver):
    model = "so101"
    joint_names = JOINTS

    def __init__(self, **options: str):
        unknown = sorted(set(options) - {"port", "id", "calibration_dir", "release_torque"})
        if unknown:
            raise DriverOptionError(f"driver {self.model} has no option {unknown}. Fix: use port, id, calibration_dir, "
                                    f"release_torque")
        release = options.get("release_torque", "false")
        if release not in ("true", "false"):
            raise DriverOptionError(f"options.release_torque={release!r} is not valid. Fix: true (the arm drops on "
                                    f"Disconnect) or false (default: it keeps holding)")
        for name, example in (("port", "/dev/ttyACM0"), ("id", "my_follower")):
            if not options.get(name):
                raise DriverOptionError(f"options.{name} is missing. Fix: give it, e.g. {name}={example}")
        try:
            follower, config_cls = _robot_classes(self.model)
        except (ImportError, RuntimeError) as exc:  # 0.4.x imports torchvision, which fails beside a CPU torch
            raise DriverUnavailable(f"driver {self.model} needs LeRobot's robot classes ({exc!r}). Fix: pip install "
                                    f"'lerobot[feetech]' with a torchvision that matches torch") from exc
        config = config_cls(port=options["port"], id=options["id"], use_degrees=True,
                            calibration_dir=Path(options["calibration_dir"]) if options.get("calibration_dir")
                            else None, disable_torque_on_disconnect=release == "true")
        self.robot = follower(config)
        if not self.robot.calibration:
            raise DriverOptionError(f"options.id={options['id']}: no calibration at {self.robot.calibration_fpath}. "
                                    f"Fix: run lerobot-calibrate --robot.type={self.model}_follower --robot.port="
                                    f"{options['port']} --robot.id={options['id']}, or point options.calibration_dir "
                                    f"at the folder holding {options['id']}.json")
        self.limits = calibrated_limits(self.robot.calibration)
        try:
            self.robot.connect(calibrate=False)  # calibrating would wait on input() from a person
        except (ConnectionError, OSError) as exc:
            said = " ".join(str(exc).split())  # LeRobot's message spans lines
            raise DriverConnectionError(f"options.port={options['port']}: no {self.model} arm answers there ({said})."
                                        f" Fix: give the bus board's serial port (lerobot-find-port lists them)") from exc
        if not self.robot.is_calibrated:
            self.robot.disconnect()
            raise DriverOptionError(f"options.id={options['id']}: the motors' calibration differs from "
                                    f"{self.robot.calibration_fpath}. Fix: run lerobot-calibrate for this arm")
        self._last = (from_lerobot(self.robot.get_observation()), time.monotonic())

    @classmethod
    def device_key(cls, options: dict[str, str], robot_id: str) -> str:
        """The bus's serial port, symlinks resolved (/dev/serial/by-id/... and /dev/ttyACM0 are one arm)."""
        port = options.get("port", "")
        return f"feetech:{os.path.realpath(port) if port else robot_id}"

    def hard_limits(self) -> Limits:
        lo, hi = self.limits
        return Limits(position_min=lo.copy(), position_max=hi.copy(), velocity_max=VELOCITY_MAX.copy(),
                      slew_max=VELOCITY_MAX * 0.02, jump_max=0.5, workspace_min=np.array([-REACH, -REACH, -0.1]),
                      workspace_max=np.array([REACH, REACH, REACH]))

    def forward_kinematics(self, q: np.ndarray) -> np.ndarray:
        return gripper_frame(q)[:3, 3]

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """Positions from the bus; velocities by difference, since LeRobot's observation holds positions only."""
        q, now = from_lerobot(self.robot.get_observation()), time.monotonic()
        q0, t0 = self._last
        self._last = (q, now)
        return q, (q - q0) / (now - t0) if now > t0 else np.zeros_like(q)

    def command(self, target: np.ndarray, dt: float) -> None:
        self.robot.send_action(to_lerobot(target))

    def close(self) -> None:
        if self.robot.is_connected:
            self.robot.disconnect()  # torque stays on (the arm holds) unless options.release_torque=true


class SO100Arm(_SOArm):
    """SO-100: the same servos, joint names and LeRobot class; its kinematics here are the SO-101's."""

    model = "so100"


class SO101Arm(_SOArm):
    model = "so101"


__all__ = ["SO100Arm", "SO101Arm", "calibrated_limits", "from_lerobot", "gripper_frame", "to_lerobot"]
