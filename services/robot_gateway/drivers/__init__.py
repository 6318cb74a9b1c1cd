"""Robot drivers behind one interface; a driver is one file here, registered by name (ConnectRequest.driver), or a
``Driver`` subclass that an installed package names under the ``rlfabric.drivers`` entry point. A Connect names an
installed driver only, never a module to import: the name comes from the network, to the process beside the arm.

A driver knows its joints, its hard limits and its forward kinematics, reads the measured state and takes a
joint-position target each tick. It never decides what is safe: the gateway's loop does, for every driver alike.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rlfabric.services.core.registry import Registry
from rlfabric.services.robot_gateway.safety import Limits

DRIVERS = Registry("drivers", "driver", {
    "sim": "rlfabric.services.robot_gateway.drivers.sim:SimArm",
    "franka": "rlfabric.services.robot_gateway.drivers.franka:FrankaArm",  # optional: franky-control or pylibfranka
    "so100": "rlfabric.services.robot_gateway.drivers.so_follower:SO100Arm",  # optional: lerobot[feetech]
    "so101": "rlfabric.services.robot_gateway.drivers.so_follower:SO101Arm",
}, home="services/robot_gateway/drivers", literals=False)


class DriverOptionError(ValueError):
    """A driver option that is missing or malformed (the message names ``options.<name>`` and the fix)."""


class DriverUnavailable(ValueError):
    """The driver's library is not installed here (the message names the package to install)."""


class DriverConnectionError(ConnectionError, ValueError):
    """The robot did not answer where the options say it is; a ValueError too, so Connect reports it as the
    caller's to fix rather than as a gateway fault."""


class Driver:
    joint_names: list[str]

    @classmethod
    def device_key(cls, options: dict[str, str], robot_id: str) -> str:
        """Which physical device ``options`` address (its bus, port or IP), read before anything opens it: the
        gateway connects one device under one robot id and keeps its e-stop latch and narrowed limits under this
        key across reconnects. A driver with no address of its own is keyed by the robot id."""
        return f"{cls.__module__}.{cls.__name__}:{robot_id}"

    def hard_limits(self) -> Limits:
        raise NotImplementedError

    def forward_kinematics(self, q: np.ndarray) -> np.ndarray:
        """End-effector position (x, y, z) at joint positions ``q``."""
        raise NotImplementedError

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """Measured (joint positions, joint velocities)."""
        raise NotImplementedError

    def command(self, target: np.ndarray, dt: float) -> None:
        """Track ``target`` for the next ``dt`` seconds (a simulator advances its physics by ``dt``)."""
        raise NotImplementedError

    def camera(self, size: int) -> Callable[[], np.ndarray]:
        """A capture function for square uint8 RGB frames [size, size, 3]. The gateway calls it from one camera
        thread only (never the control loop's), so a driver may bind a renderer or a device to that thread."""
        raise DriverOptionError(f"driver {type(self).__name__} has no camera. Fix: set camera_size: 0")

    def brake(self) -> None:
        """Hold still by the driver's own means (a real arm's brakes); default: track the measured position."""
        self.command(self.read()[0], 0.0)

    def close(self) -> None:
        pass


def driver_class(name: str) -> type[Driver]:
    cls = DRIVERS.load(name)
    if not (isinstance(cls, type) and issubclass(cls, Driver)):
        raise ValueError(f"driver {name!r}: {DRIVERS.target(name)!r} is not a Driver subclass "
                         f"(rlfabric.services.robot_gateway.drivers.Driver)")
    return cls


def build_driver(name: str, options: dict[str, str]) -> Driver:
    """The driver, connected (blocking: a real arm's library may take seconds; the gateway calls this off its
    event loop)."""
    return driver_class(name)(**options)


def register_driver(name: str, target: str) -> None:
    DRIVERS.register(name, target)


__all__ = ["DRIVERS", "Driver", "DriverConnectionError", "DriverOptionError", "DriverUnavailable", "build_driver",
           "driver_class", "register_driver"]
