"""ArmReach: a planar two-joint MuJoCo arm on a table reaches a coloured ball, seen by a top-down camera.

An action is a Cartesian move of the end effector in the table plane, ``action * max_move`` metres, turned into
joint-servo targets by damped least squares on the site Jacobian (as an arm's Cartesian controller does); each
step simulates ``frame_skip`` physics steps. The balls are placed at random in the arm's reach at reset; with
several colours an instruction names the goal ball and the others are distractors.

Reward: progress toward the goal ball, normalised by the starting distance (so it sums to at most 1 over an
episode), plus 1 on success (the end effector within ``success_radius``), which ends the episode. An episode's
return is above 1 exactly when it succeeds: the success rate is the fraction of returns > 1.

``expert_speed`` (default 1) is the scripted expert's fraction of the arm's top speed: demonstrations from a
cautious operator, who moves the same way but slower and so runs out of time in more episodes. RL from their
imitation has something the demonstrator left to learn (docs/benchmarks.md); the RL task itself is unchanged.

``privileged=True`` adds ``privileged`` to a pixel observation: the end effector's, the goal ball's and the other
balls' positions and the distance to the goal, for a critic alone (an asymmetric actor-critic; the VLM policies'
actors never read it, and other policies refuse it).

Pixels are rendered headless on the CPU (``MUJOCO_GL=osmesa``, Debian's libosmesa6, set here unless the process
says otherwise; ``egl`` works too) with shadows and multisampling off: ~0.4 ms a 64x64 frame instead of ~30 ms
with the defaults. Inside an action chunk only the frame the policy reads is rendered (``skip_frames``): the
chunk's earlier steps keep the last frame, which nothing reads.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.sims import instructions
from rlfabric.services.env.sims.offscreen import use_osmesa

RGBA = {"red": "0.9 0.1 0.1 1", "blue": "0.1 0.2 0.9 1", "green": "0.1 0.8 0.2 1", "yellow": "0.9 0.8 0.1 1"}
LINKS = (0.2, 0.15)


def mjcf(colors: tuple[str, ...]) -> str:
    balls = "\n".join(
        f'<body name="{c}" mocap="true" pos="0.2 0 0.02"><geom type="sphere" size="0.035" rgba="{RGBA[c]}" '
        f'contype="0" conaffinity="0"/></body>' for c in colors)
    return f"""
<mujoco model="rlfabric-arm-reach">
  <compiler angle="radian"/>
  <option timestep="0.01" integrator="implicitfast"/>
  <visual><quality shadowsize="0" offsamples="0"/><global offwidth="256" offheight="256"/></visual>
  <worldbody>
    <light pos="0 0 2" dir="0 0 -1" castshadow="false"/>
    <camera name="top" pos="0 0 0.95" xyaxes="1 0 0 0 1 0"/>
    <geom type="plane" size="0.5 0.5 0.05" rgba="0.75 0.75 0.72 1" contype="0" conaffinity="0"/>
    <body name="upper" pos="0 0 0.03">
      <joint name="shoulder" type="hinge" axis="0 0 1" damping="0.2"/>
      <geom type="capsule" fromto="0 0 0 {LINKS[0]} 0 0" size="0.018" rgba="0.25 0.25 0.25 1" mass="0.3"/>
      <body name="fore" pos="{LINKS[0]} 0 0">
        <joint name="elbow" type="hinge" axis="0 0 1" range="-2.6 2.6" damping="0.2"/>
        <geom type="capsule" fromto="0 0 0 {LINKS[1]} 0 0" size="0.014" rgba="0.4 0.4 0.4 1" mass="0.2"/>
        <site name="ee" pos="{LINKS[1]} 0 0" size="0.02" rgba="1 1 1 1"/>
        <geom type="sphere" pos="{LINKS[1]} 0 0" size="0.02" rgba="1 1 1 1" contype="0" conaffinity="0" mass="0.01"/>
      </body>
    </body>
    {balls}
  </worldbody>
  <actuator>
    <position joint="shoulder" kp="60" kv="4"/>
    <position joint="elbow" kp="40" kv="3"/>
  </actuator>
</mujoco>
"""


class ArmReach(gym.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, colors: tuple[str, ...] = ("red",), instruction: bool = False, observation: str = "pixels",
                 image_size: int = 64, frame_skip: int = 5, max_move: float = 0.03, success_radius: float = 0.04,
                 render_mode: str | None = None, privileged: bool = False, expert_speed: float = 1.0):
        if observation == "pixels":
            use_osmesa()
        import mujoco

        unknown = sorted(set(colors) - set(RGBA))
        if unknown or not colors:
            raise ValueError(f"colors {list(colors)}: each must be one of {sorted(RGBA)}")
        if observation not in ("pixels", "state"):
            raise ValueError(f"observation={observation!r}: use 'pixels' or 'state'")
        if privileged and observation != "pixels":
            raise ValueError("privileged=True adds the true state to pixel observations; observation='state' already "
                             "is the true state. Fix: drop privileged, or use observation='pixels'")
        if not 16 <= image_size <= 256:
            raise ValueError(f"image_size={image_size} must lie in [16, 256]")
        self.mujoco, self.colors, self.use_instruction = mujoco, tuple(colors), instruction
        self.observation, self.image_size, self.render_mode = observation, image_size, render_mode
        self.privileged = privileged
        if not 0.0 < expert_speed <= 1.0:
            raise ValueError(f"expert_speed={expert_speed} must lie in (0, 1]: it is the scripted expert's fraction "
                             f"of the arm's top speed. Fix: env.kwargs.expert_speed between 0 and 1")
        self.expert_speed = expert_speed
        self.frame_skip, self.max_move, self.success_radius = frame_skip, max_move, success_radius
        self.model = mujoco.MjModel.from_xml_string(mjcf(self.colors))
        self.data = mujoco.MjData(self.model)
        self.site = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_SITE, "ee")
        self.mocap = [self.model.body_mocapid[mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, c)]
                      for c in self.colors]
        self.renderer = None
        self.skip_frames = False  # set by ActionChunk (services/env/chunking.py) for steps whose observation it drops
        self._frame: np.ndarray | None = None
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        proprio = gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)
        text = gym.spaces.Box(0, instructions.vocab_size() - 1, (instructions.MAX_TOKENS,), np.int64)
        if observation == "state":
            state = gym.spaces.Box(-np.inf, np.inf, (8 + 2 * len(self.colors),), np.float32)
            self.observation_space = gym.spaces.Dict({"state": state, "instruction": text}) if instruction else state
        else:
            spaces: dict[str, gym.Space] = {
                "image": gym.spaces.Box(0, 255, (image_size, image_size, 3), np.uint8), "proprio": proprio}
            if instruction:
                spaces["instruction"] = text
            if privileged:
                spaces["privileged"] = gym.spaces.Box(-np.inf, np.inf, (3 + 2 * len(self.colors),), np.float32)
            self.observation_space = gym.spaces.Dict(spaces)
        self.goal = 0
        self.text = ""
        self.start_distance = 1.0
        self.last_distance = 1.0

    # -- episode -------------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        self.mujoco.mj_resetData(self.model, self.data)
        q = rng.uniform([-np.pi, -2.0], [np.pi, 2.0])
        self.data.qpos[:], self.data.ctrl[:] = q, q
        positions = self._place_balls(rng)
        for mocap, pos in zip(self.mocap, positions, strict=True):
            self.data.mocap_pos[mocap] = [pos[0], pos[1], 0.03]
        self.mujoco.mj_forward(self.model, self.data)
        self.goal = int(rng.integers(len(self.colors)))
        template = instructions.TEMPLATES[int(rng.integers(len(instructions.TEMPLATES)))]
        self.text = template.format(self.colors[self.goal])
        self.start_distance = self.last_distance = max(self._distance(), 1e-3)
        return self._observe(), {"instruction": self.text}

    def _place_balls(self, rng: np.random.Generator) -> list[np.ndarray]:
        """Balls in the arm's reach (radius 0.1..0.32), at least 0.12 apart and away from the end effector."""
        out: list[np.ndarray] = []
        ee = self._ee()
        while len(out) < len(self.colors):
            r, a = rng.uniform(0.1, 0.32), rng.uniform(-np.pi, np.pi)
            p = np.array([r * np.cos(a), r * np.sin(a)])
            if np.linalg.norm(p - ee) > 0.1 and all(np.linalg.norm(p - o) > 0.12 for o in out):
                out.append(p)
        return out

    def step(self, action: np.ndarray):
        move = self.max_move * np.clip(np.asarray(action, np.float64).reshape(2), -1.0, 1.0)
        jacp = np.zeros((3, self.model.nv))
        self.mujoco.mj_jacSite(self.model, self.data, jacp, None, self.site)
        J = jacp[:2]
        dq = J.T @ np.linalg.solve(J @ J.T + 1e-4 * np.eye(2), move)
        target = np.clip(self.data.ctrl + dq, self.data.qpos - 0.3, self.data.qpos + 0.3)  # servo lag, no windup
        target[1] = np.clip(target[1], *self.model.jnt_range[1])
        self.data.ctrl[:] = target
        self.mujoco.mj_step(self.model, self.data, nstep=self.frame_skip)
        distance = self._distance()
        success = distance < self.success_radius
        reward = (self.last_distance - distance) / self.start_distance + (1.0 if success else 0.0)
        self.last_distance = distance
        return self._observe(), float(reward), bool(success), False, {"is_success": bool(success)}

    def expert_action(self, horizon: int = 1) -> np.ndarray:
        """The scripted expert's next ``horizon`` moves [horizon, 2], from privileged state (where the goal ball
        is): straight at the goal, at full speed while it is more than a chunk away, then the rest spread over the
        chunk; all of it scaled by ``expert_speed``. Demonstrations to imitate (``rlfabric collect --expert``); a
        policy never sees this."""
        delta = self.data.mocap_pos[self.mocap[self.goal]][:2] - self._ee()
        move = delta / (self.max_move * max(horizon, 1))
        move = self.expert_speed * move / max(1.0, float(np.abs(move).max()))
        return np.repeat(move[None].astype(np.float32), max(horizon, 1), 0)

    def scene_state(self) -> np.ndarray:
        """Where each ball is ([x, y] per colour, in the state observation's units: 5 x metres): what an image
        encoder learns to read off the camera before imitation (``warm_start.vision``). Privileged, like
        ``expert_action``: no policy sees it."""
        return np.concatenate([5 * self.data.mocap_pos[m][:2] for m in self.mocap]).astype(np.float32)

    def encode_instruction(self, text: str) -> np.ndarray:
        """An instruction as this task's ``instruction`` entry (its BPE ids): what a data set's task text becomes
        (services/env/lerobot_data.py)."""
        return instructions.encode(text)

    # -- observation ---------------------------------------------------------------------------------------
    def _ee(self) -> np.ndarray:
        return self.data.site_xpos[self.site][:2].copy()

    def _distance(self) -> float:
        return float(np.linalg.norm(self._ee() - self.data.mocap_pos[self.mocap[self.goal]][:2]))

    def _proprio(self) -> np.ndarray:
        """Joint angles and velocities, and the end effector's position (an arm's controller reports its pose)."""
        return np.concatenate([np.cos(self.data.qpos), np.sin(self.data.qpos), 0.2 * self.data.qvel,
                               5 * self._ee()]).astype(np.float32)

    def _observe(self) -> Any:
        if self.observation == "state":
            state = np.concatenate([self._proprio(), *(5 * self.data.mocap_pos[m][:2] for m in self.mocap)])
            if self.use_instruction:  # which ball is the goal is only in the words
                return {"state": state.astype(np.float32), "instruction": instructions.encode(self.text)}
            return state.astype(np.float32)
        if not self.skip_frames or self._frame is None:
            self._frame = self.render_frame()
        obs = {"image": self._frame, "proprio": self._proprio()}
        if self.use_instruction:
            obs["instruction"] = instructions.encode(self.text)
        if self.privileged:
            order = [self.goal, *(i for i in range(len(self.mocap)) if i != self.goal)]
            obs["privileged"] = np.concatenate([5 * self._ee(), *(5 * self.data.mocap_pos[self.mocap[i]][:2]
                                                                  for i in order), [5 * self._distance()]]
                                               ).astype(np.float32)
        return obs

    def observe(self) -> Any:
        """The observation of the current state, camera frame included: what ``step`` returned had it rendered
        (ActionChunk's chunk that ended on a step with ``skip_frames`` set)."""
        skip, self.skip_frames = self.skip_frames, False
        try:
            return self._observe()
        finally:
            self.skip_frames = skip

    def render_frame(self) -> np.ndarray:
        if self.renderer is None:
            try:
                self.renderer = self.mujoco.Renderer(self.model, self.image_size, self.image_size)
            except Exception as exc:
                raise RuntimeError(
                    f"MuJoCo found no off-screen OpenGL context (MUJOCO_GL={os.environ.get('MUJOCO_GL', '')!r}): "
                    f"{exc}. Fix: apt-get install libosmesa6 (or set MUJOCO_GL=egl on a GPU host) before the process "
                    f"imports mujoco") from exc
            for flag in ("SKYBOX", "HAZE", "REFLECTION", "SHADOW", "FOG"):
                self.renderer.scene.flags[getattr(self.mujoco.mjtRndFlag, f"mjRND_{flag}")] = 0
        self.renderer.update_scene(self.data, camera="top")
        return self.renderer.render()

    def render(self) -> np.ndarray:
        return self.render_frame()

    def close(self) -> None:
        if self.renderer is not None:
            self.renderer.close()
            self.renderer = None
