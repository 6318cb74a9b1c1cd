"""``franka``: a Franka arm (Panda or FR3) through franky (``franky-control``) or Franka's own ``pylibfranka``.

Both libraries run libfranka's 1 kHz loop in C++ and take a joint target at any rate, so the gateway's tick only
hands them the next target: franky replans a jerk-limited trajectory towards it (``JointMotion``, preempting the
last), pylibfranka's ``AsyncPositionControlHandler`` does the same with Franka's own planner (it moves only
while its state is read, as the gateway's loop does every tick). Neither offers
kinematics without a robot, so forward kinematics is the arm's published (modified, Craig) DH table.

Options (strings, as the gateway passes them):
    ip          the robot's FCI address (required)
    backend     franky (default) or pylibfranka; one per process: both bind libfranka's types into Python
    model       panda (default) or fr3: which published joint limits hold
    dynamics    0 < factor <= 1 of the arm's velocity/acceleration/jerk limits the planner may use (default 0.2)
    tcp_z       metres from the flange to the tool centre point along the flange's z (default 0; Franka Hand 0.1034)
    connect_timeout_s   how long to wait for the robot to answer on its command port (default 3)

The PyPI wheels of both libraries carry libfranka 0.21 (FR3 system 5+); a Panda (system 4.x) needs a libfranka
0.9 build of franky from its GitHub releases: the driver is the same, only the installed library differs.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading

import numpy as np

from rlfabric.services.robot_gateway.drivers import (
    Driver,
    DriverConnectionError,
    DriverOptionError,
    DriverUnavailable,
)
from rlfabric.services.robot_gateway.safety import Limits

FCI_PORT = 1337  # libfranka's command port (TCP) on the robot
BACKENDS = ("franky", "pylibfranka")

# Published joint limits (Franka's "Robot and interface specifications"): position [rad], velocity [rad/s].
JOINT_LIMITS = {
    "panda": (np.array([-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973]),
              np.array([2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973]),
              np.array([2.1750, 2.1750, 2.1750, 2.1750, 2.6100, 2.6100, 2.6100])),
    "fr3": (np.array([-2.7437, -1.7837, -2.9007, -3.0421, -2.8065, 0.5445, -3.0159]),
            np.array([2.7437, 1.7837, 2.9007, -0.1518, 2.8065, 4.5169, 3.0159]),
            np.array([2.62, 2.62, 2.62, 2.62, 5.26, 4.18, 5.26])),
}

# Modified DH (a_{i-1}, d_i, alpha_{i-1}) of joints 1..7 and the flange; the same for Panda and FR3.
DH = np.array([
    [0.0, 0.333, 0.0],
    [0.0, 0.0, -math.pi / 2],
    [0.0, 0.316, math.pi / 2],
    [0.0825, 0.0, math.pi / 2],
    [-0.0825, 0.384, -math.pi / 2],
    [0.0, 0.0, math.pi / 2],
    [0.088, 0.0, math.pi / 2],
    [0.0, 0.107, 0.0],  # flange, no joint
])
# Nothing on the arm gets further from the shoulder (at z = 0.333) than the sum of its link offsets.
REACH = float(np.abs(DH[1:, :2]).sum())


def _dh(a: float, d: float, alpha: float, theta: float) -> np.ndarray:
    ca, sa, ct, st = math.cos(alpha), math.sin(alpha), math.cos(theta), math.sin(theta)
    return np.array([[ct, -st, 0.0, a],
                     [st * ca, ct * ca, -sa, -d * sa],
                     [st * sa, ct * sa, ca, d * ca],
                     [0.0, 0.0, 0.0, 1.0]])


def flange_pose(q: np.ndarray) -> np.ndarray:
    """The flange's 4x4 pose in the base frame at joint positions ``q`` (7 values, rad)."""
    pose = np.eye(4)
    for (a, d, alpha), theta in zip(DH, [*np.asarray(q, float), 0.0], strict=True):
        pose = pose @ _dh(a, d, alpha, theta)
    return pose


def _option(options: dict[str, str], name: str, default: str, convert, check, fix: str):
    raw = options.get(name, default)
    try:
        value = convert(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or not check(value):
        raise DriverOptionError(f"options.{name}={raw!r} is not valid. Fix: {fix}")
    return value


class FrankaArm(Driver):
    joint_names = [f"panda_joint{i}" for i in range(1, 8)]

    def __init__(self, **options: str):
        unknown = sorted(set(options) - {"ip", "backend", "model", "dynamics", "tcp_z", "connect_timeout_s"})
        if unknown:
            raise DriverOptionError(f"driver franka has no option {unknown}. Fix: use ip, backend, model, dynamics, "
                                    f"tcp_z, connect_timeout_s")
        if not options.get("ip"):
            raise DriverOptionError("options.ip is missing. Fix: give the robot's FCI address, e.g. ip=172.16.0.2")
        self.ip = options["ip"]
        self.backend = _option(options, "backend", "franky", str, lambda v: v in BACKENDS, f"one of {BACKENDS}")
        self.model = _option(options, "model", "panda", str, lambda v: v in JOINT_LIMITS, f"one of {sorted(JOINT_LIMITS)}")
        self.dynamics = _option(options, "dynamics", "0.2", float, lambda v: 0 < v <= 1, "a number in (0, 1]")
        self.tcp_z = _option(options, "tcp_z", "0", float, lambda v: -0.5 <= v <= 0.5, "metres in [-0.5, 0.5]")
        timeout = _option(options, "connect_timeout_s", "3", float, lambda v: 0 < v <= 60, "seconds in (0, 60]")
        self.joint_names = [f"{'panda' if self.model == 'panda' else 'fr3'}_joint{i}" for i in range(1, 8)]
        self._lock = threading.Lock()
        self._target: list[float] | None = None
        self._lib = self._import_backend()
        self._probe(timeout)
        self._robot, self._handler = None, None
        try:
            self._connect()
        except DriverConnectionError:
            raise
        except Exception as exc:  # the libraries raise their own NetworkException/IncompatibleVersionException
            raise DriverConnectionError(f"options.ip={self.ip}: {self.backend} could not connect ({exc}). Fix: "
                                        f"check FCI is activated in Desk and that the installed libfranka matches "
                                        f"the robot's system version (FR3 system 5+: libfranka >= 0.10; Panda: "
                                        f"0.9)") from exc

    @classmethod
    def device_key(cls, options: dict[str, str], robot_id: str) -> str:
        """The address the driver would connect to, as the resolver reads ``ip`` (172.16.0.02, 172.16.2 and a host
        name for 172.16.0.2 are one robot, so one latch). A name that does not resolve cannot connect: it is kept
        as written."""
        ip = options.get("ip", "").strip()
        try:
            ip = str(ipaddress.ip_address(ip))
        except ValueError:
            try:
                ip = socket.getaddrinfo(ip, FCI_PORT, type=socket.SOCK_STREAM)[0][4][0] if ip else ""
            except (OSError, UnicodeError):
                ip = ip.lower()
        return f"franka:{ip or robot_id}"

    # -- connection ------------------------------------------------------------------------------------------
    def _import_backend(self):
        module = "franky" if self.backend == "franky" else "pylibfranka"
        package = "franky-control" if self.backend == "franky" else "pylibfranka"
        try:
            return __import__(module)
        except ImportError as exc:
            raise DriverUnavailable(f"options.backend={self.backend} needs the {package} package ({exc}). Fix: pip "
                                    f"install {package}, or choose the other backend") from exc

    def _probe(self, timeout: float) -> None:
        """Fail fast, naming the option: libfranka itself waits up to a minute for an address that never answers."""
        try:
            socket.create_connection((self.ip, FCI_PORT), timeout=timeout).close()
        except OSError as exc:
            raise DriverConnectionError(f"options.ip={self.ip}: nothing answers on the FCI port {FCI_PORT} within "
                                        f"{timeout:g} s ({exc}). Fix: give the address of the robot's control "
                                        f"unit, check the cable, and activate FCI in Desk") from exc

    def _connect(self) -> None:
        lib = self._lib
        if self.backend == "franky":
            self._robot = lib.Robot(self.ip, realtime_config=lib.RealtimeConfig.Ignore)
            self._robot.relative_dynamics_factor = self.dynamics
            self._robot.recover_from_errors()
        else:
            self._robot = lib.Robot(self.ip, lib.RealtimeConfig.kIgnore)
            self._robot.automatic_error_recovery()
            config = lib.AsyncPositionControlHandler.Configuration(
                list(self.dynamics * JOINT_LIMITS[self.model][2]), 1e-3)
            result = lib.AsyncPositionControlHandler.configure(self._robot, config)
            if result.error_message:
                raise DriverConnectionError(f"options.ip={self.ip}: pylibfranka refused position control "
                                            f"({result.error_message}). Fix: unlock the brakes in Desk and clear "
                                            f"the robot's errors")
            self._handler = result.handler
        self._last = self._measure()

    def _measure(self) -> tuple[np.ndarray, np.ndarray]:
        if self.backend == "franky":
            state = self._robot.current_joint_state
            return np.asarray(state.position, float).copy(), np.asarray(state.velocity, float).copy()
        state = self._robot.read_once()
        return np.asarray(state.q, float), np.asarray(state.dq, float)

    # -- the Driver interface -----------------------------------------------------------------------------------
    def hard_limits(self) -> Limits:
        lo, hi, vmax = JOINT_LIMITS[self.model]
        reach = REACH + abs(self.tcp_z)
        return Limits(position_min=lo.copy(), position_max=hi.copy(), velocity_max=vmax.copy(),
                      slew_max=vmax * 0.01,  # one 100 Hz tick at full speed
                      jump_max=0.3, workspace_min=np.array([-reach, -reach, 0.333 - reach]),
                      workspace_max=np.array([reach, reach, 0.333 + reach]))

    def forward_kinematics(self, q: np.ndarray) -> np.ndarray:
        pose = flange_pose(q)
        return pose[:3, 3] + self.tcp_z * pose[:3, 2]

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            self._last = self._measure()
            return self._last

    def command(self, target: np.ndarray, dt: float) -> None:
        q = [float(v) for v in target]
        with self._lock:
            if self.backend == "franky":
                if q == self._target:  # a hold: the running plan already ends there; replanning it overshoots
                    return
                self._target = q
                self._robot.move(self._lib.JointMotion(q, return_when_finished=False), asynchronous=True)
            else:
                if self._handler is None:
                    raise RuntimeError("the franka driver was braked (pylibfranka's control stopped); reconnect it")
                result = self._handler.set_joint_position_target(
                    self._lib.AsyncPositionControlHandler.JointPositionTarget(q))
                if not result.was_successful:
                    raise RuntimeError(f"pylibfranka rejected the target: {result.error_message}")

    def brake(self) -> None:
        """Decelerate to a stop and hold (the arm's mechanical brakes engage only from Desk)."""
        with self._lock:
            if self._robot is None:
                return
            if self.backend == "franky":
                self._robot.move(self._lib.JointStopMotion(), asynchronous=True)
                self._robot.join_motion(2.0)
            elif self._handler is not None:
                self._handler.stop_control()
                self._handler = None

    def close(self) -> None:
        try:
            self.brake()
        finally:
            self._robot, self._handler = None, None


__all__ = ["DH", "JOINT_LIMITS", "FrankaArm", "flange_pose"]
