"""ManiSkill adapter: ManiSkill3's SAPIEN manipulation tasks (PushCube-v1, PickCube-v1, StackCube-v1, ...) seen
through their sensor cameras and the robot's state, with ``info["is_success"]`` on every step.

    env: {adapter: maniskill, id: PickCube-v1, options: {image_size: 64, control_mode: pd_ee_delta_pos}}
    env: {adapter: maniskill, id: PushCube-v1, options: {cameras: []}}   # state only

Each sub-env is one ManiSkill env on SAPIEN's CPU physics (``num_envs=1`` wrapped by ManiSkill's CPUGymWrapper,
which returns unbatched NumPy); our vector env steps them (sync or async). Observations: each sensor camera's RGB
as a uint8 image under the camera's name (``base_camera``, ...) and ``state``, the agent's and the task's extra
vectors flattened (float32); with ``cameras: []`` the task's flat state observation alone. ``control_mode`` is
ManiSkill's (its default when unset), and ``max_episode_steps`` overrides the task's own limit.

Needs ``mani-skill`` (and ``sapien``), and a Vulkan device for SAPIEN even with rendering off: a GPU with its
driver's Vulkan ICD, or Mesa's lavapipe from Mesa >= 24.3 (Debian 13). Debian 12's lavapipe (Mesa 22.3) lacks
``VK_KHR_external_semaphore_fd`` and is refused. A GPU image without the Vulkan loader and glvnd (``libvulkan1``,
``libglvnd0``, ``libglx0``, ``libegl1``) is refused too, although its driver ships the ICD: SAPIEN's bundled loader
cannot open ``libGLX_nvidia``. This was seen on an H100; with those four packages the same host ran PushCube
(``bench/gpu_check.py``'s ``maniskill`` check). Either way the adapter fails with the fix instead of SAPIEN's
``vk::createInstanceUnique: ErrorIncompatibleDriver``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.adapters.gymnasium import vectorize
from rlfabric.services.env.adapters.mujoco_pixels import SuccessFrom, check_options, image_shape

collector = "gym"  # rollout.collector auto: gym stepping
EXTRA_OPTIONS = ("cameras", "control_mode", "max_episode_steps")
NO_VULKAN = ("SAPIEN, which ManiSkill simulates with, found no usable Vulkan device ({detail}). Fix: on a GPU host, "
             "the driver's Vulkan ICD (nvidia_icd.json; VK_ICD_FILENAMES names it if it is not in "
             "/usr/share/vulkan/icd.d) and the loader libraries it needs: apt-get install libvulkan1 libglvnd0 libglx0 "
             "libegl1. Without a GPU, install Mesa >= 24.3's lavapipe (Debian 13: apt-get install mesa-vulkan-drivers); "
             "Debian 12's Mesa 22.3 lacks VK_KHR_external_semaphore_fd")


def _import() -> Any:
    try:
        import mani_skill.envs  # noqa: F401  (registers the tasks)
        from mani_skill.utils.registration import REGISTERED_ENVS
    except ImportError as exc:
        raise ValueError("env.adapter maniskill needs the mani-skill package (SAPIEN). Fix: pip install "
                         "'mani-skill==3.0.1' in an environment with a Vulkan device") from exc
    return REGISTERED_ENVS


def check(env_cfg: Any) -> None:
    check_options(env_cfg, EXTRA_OPTIONS)
    opts = env_cfg.options
    cameras = opts.get("cameras", None)
    if cameras is not None and (not isinstance(cameras, list) or not all(isinstance(c, str) for c in cameras)):
        raise ValueError(f"env.options.cameras={cameras!r}: a list of the task's sensor camera names, [] for state "
                         f"only (unset: every camera)")
    if not isinstance(opts.get("control_mode", ""), str):
        raise ValueError(f"env.options.control_mode={opts['control_mode']!r}: a ManiSkill control mode name, e.g. "
                         f"pd_ee_delta_pos or pd_joint_delta_pos")
    steps = opts.get("max_episode_steps", 1)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"env.options.max_episode_steps={steps!r}: a positive integer")
    registered = _import()
    if env_cfg.id not in registered:
        raise ValueError(f"env.id {env_cfg.id!r} is not a ManiSkill task. Fix: one of "
                         f"{sorted(registered)[:12]}... (mani_skill.utils.registration.REGISTERED_ENVS)")


def _leaves(space: gym.Space) -> list[gym.spaces.Box]:
    if isinstance(space, gym.spaces.Dict):
        return [leaf for key in sorted(space.spaces) for leaf in _leaves(space[key])]
    return [space]


def _values(obs: Any) -> list[np.ndarray]:
    if isinstance(obs, dict):
        return [v for key in sorted(obs) for v in _values(obs[key])]
    return [np.asarray(obs, np.float32).reshape(-1)]


class FlatObservation(gym.ObservationWrapper):
    """ManiSkill's nested ``rgb`` observation as flat entries: each kept camera's RGB under its own name, and
    ``state``, the agent's and the task's extra vectors (sorted by key) flattened to float32."""

    def __init__(self, env: gym.Env, cameras: list[str]):
        super().__init__(env)
        space = env.observation_space
        sensors = space["sensor_data"]
        unknown = sorted(set(cameras) - set(sensors.spaces))
        if unknown:
            raise ValueError(f"env.options.cameras {unknown}: this task's cameras are {sorted(sensors.spaces)}")
        self.cameras = cameras
        dim = sum(int(np.prod(s.shape)) for key in ("agent", "extra") if key in space.spaces
                  for s in _leaves(space[key]))
        parts: dict[str, gym.Space] = {c: gym.spaces.Box(0, 255, sensors[c]["rgb"].shape, np.uint8) for c in cameras}
        parts["state"] = gym.spaces.Box(-np.inf, np.inf, (dim,), np.float32)
        self.observation_space = gym.spaces.Dict(parts)

    def observation(self, obs: dict[str, Any]) -> dict[str, np.ndarray]:
        out = {c: np.ascontiguousarray(obs["sensor_data"][c]["rgb"], dtype=np.uint8) for c in self.cameras}
        out["state"] = np.concatenate([v for key in ("agent", "extra") if key in obs for v in _values(obs[key])])
        return out


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    opts = dict(env_cfg.options)
    height, width = image_shape(opts)
    cameras = opts.get("cameras", None)
    kwargs: dict[str, Any] = {"obs_mode": "state" if cameras == [] else "rgb", "num_envs": 1,
                              "sensor_configs": {"width": width, "height": height}, "render_mode": "rgb_array",
                              **({"control_mode": opts["control_mode"]} if opts.get("control_mode") else {}),
                              **({"max_episode_steps": opts["max_episode_steps"]} if "max_episode_steps" in opts
                                 else {})}

    def make() -> gym.Env:
        from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

        try:
            env: gym.Env = CPUGymWrapper(gym.make(env_cfg.id, **kwargs, **dict(env_cfg.kwargs)))
        except RuntimeError as exc:
            if "vk::" in str(exc) or "Vulkan" in str(exc):
                raise RuntimeError(NO_VULKAN.format(detail=exc)) from exc
            raise
        env = SuccessFrom(env, lambda info: bool(np.asarray(info.get("success", False)).any()))
        if cameras != []:
            names = cameras if cameras is not None else sorted(env.observation_space["sensor_data"].spaces)
            env = FlatObservation(env, names)
        return env

    return vectorize(make, num_envs, vectorization, env_cfg.action_chunk)
