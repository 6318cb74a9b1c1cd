"""``sim``: a MuJoCo arm (3 revolute joints: base yaw, shoulder and elbow pitch; position servos) whose physics
advances in real time behind the gateway's loop: each tick steps it by the tick's period. Its model is written
here, so nothing is downloaded. Its camera renders a private copy of the arm's pose (taken under a lock held only
for the copy), so rendering never races the physics nor holds up a tick.

Its servos are compensated for gravity (``gravcomp`` on every link), as a real arm's controller is: a plain
position servo sags by gravity's torque over its gain (0.024 rad at the shoulder), so the arm would sit off every
target and a hold could never keep it still. Options: ``start`` (comma-separated joint positions) and ``name``
(which simulated arm this is; its e-stop latch and narrowed limits are kept under that name across reconnects,
default: the robot id)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from rlfabric.services.robot_gateway.drivers import Driver, DriverOptionError
from rlfabric.services.robot_gateway.safety import Limits

MJCF = """
<mujoco model="rlfabric-arm">
  <compiler angle="radian"/>
  <option timestep="0.002" gravity="0 0 -9.81" integrator="implicitfast"/>
  <default><joint armature="0.01"/></default>
  <visual><global offwidth="256" offheight="256"/></visual>
  <worldbody>
    <light pos="0.5 0 2" dir="0 0 -1"/>
    <geom name="floor" type="plane" size="1 1 0.01" rgba="0.8 0.8 0.8 1" contype="0" conaffinity="0"/>
    <camera name="front" pos="1.2 0 0.5" xyaxes="0 1 0 -0.38 0 0.92"/>
    <body name="base" pos="0 0 0.1" gravcomp="1">
      <joint name="yaw" type="hinge" axis="0 0 1" range="-2.6 2.6" damping="0.5"/>
      <geom type="cylinder" size="0.05 0.05" mass="1"/>
      <body name="upper" pos="0 0 0.05" gravcomp="1">
        <joint name="shoulder" type="hinge" axis="0 1 0" range="-1.6 1.6" damping="0.5"/>
        <geom type="capsule" fromto="0 0 0 0.3 0 0" size="0.03" mass="0.5"/>
        <body name="fore" pos="0.3 0 0" gravcomp="1">
          <joint name="elbow" type="hinge" axis="0 1 0" range="-2.3 2.3" damping="0.5"/>
          <geom type="capsule" fromto="0 0 0 0.25 0 0" size="0.025" mass="0.3"/>
          <site name="ee" pos="0.25 0 0"/>
        </body>
      </body>
    </body>
  </worldbody>
  <actuator>
    <position joint="yaw" kp="60" kv="4"/>
    <position joint="shoulder" kp="80" kv="5"/>
    <position joint="elbow" kp="60" kv="4"/>
  </actuator>
</mujoco>
"""


class SimArm(Driver):
    joint_names = ["yaw", "shoulder", "elbow"]

    def __init__(self, **options: str):
        import mujoco

        unknown = sorted(set(options) - {"start", "name"})
        if unknown:
            raise DriverOptionError(f"driver sim takes the options start (comma-separated joint positions) and "
                                    f"name, not {unknown}")
        self.mujoco = mujoco
        self.model = mujoco.MjModel.from_xml_string(MJCF)
        self.data = mujoco.MjData(self.model)
        self._fk_data = mujoco.MjData(self.model)
        self.site = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_SITE, "ee")
        self.lock = threading.Lock()  # the physics step vs the camera's copy of the pose
        if "start" in options:
            try:
                start = np.array([float(v) for v in options["start"].split(",")])
            except ValueError:
                start = np.zeros(0)
            if start.shape != (len(self.joint_names),) or not np.isfinite(start).all():
                raise DriverOptionError(f"options.start={options['start'][:80]!r}: give {len(self.joint_names)} "
                                        f"finite comma-separated joint positions in radians, e.g. 0,0.3,0.5")
            self.data.qpos[:] = start
            self.data.ctrl[:] = start
        mujoco.mj_forward(self.model, self.data)

    @classmethod
    def device_key(cls, options: dict[str, str], robot_id: str) -> str:
        return f"sim:{options.get('name') or robot_id}"

    def hard_limits(self) -> Limits:
        lo, hi = self.model.jnt_range[:, 0].copy(), self.model.jnt_range[:, 1].copy()
        return Limits(position_min=lo, position_max=hi, velocity_max=np.full(3, 2.0), slew_max=np.full(3, 0.05),
                      jump_max=0.5, workspace_min=np.array([-0.6, -0.6, -0.2]),
                      workspace_max=np.array([0.6, 0.6, 0.8]))

    def forward_kinematics(self, q: np.ndarray) -> np.ndarray:
        self._fk_data.qpos[:] = q
        self.mujoco.mj_kinematics(self.model, self._fk_data)
        return self._fk_data.site_xpos[self.site].copy()

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        return self.data.qpos.copy(), self.data.qvel.copy()

    def command(self, target: np.ndarray, dt: float) -> None:
        with self.lock:
            self.data.ctrl[:] = target
            for _ in range(max(1, round(dt / self.model.opt.timestep)) if dt > 0 else 0):
                self.mujoco.mj_step(self.model, self.data)

    def camera(self, size: int) -> Callable[[], np.ndarray]:
        if not 8 <= size <= 256:
            raise DriverOptionError(f"camera_size={size}: the sim camera renders 8..256 pixels a side")
        mujoco, view = self.mujoco, self.mujoco.MjData(self.model)
        renderer = None

        def capture() -> np.ndarray:
            nonlocal renderer
            if renderer is None:  # made in the calling thread: an OpenGL context belongs to the thread that made it
                renderer = mujoco.Renderer(self.model, size, size)
            with self.lock:
                view.qpos[:] = self.data.qpos
            mujoco.mj_forward(self.model, view)
            renderer.update_scene(view, camera="front")
            return renderer.render()

        return capture
