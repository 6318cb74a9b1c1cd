"""Gymnasium-Robotics adapter: the Fetch arm tasks (FetchReach, FetchPush, FetchPickAndPlace, FetchSlide) and
FrankaKitchen, observed as small rendered images next to their proprioception and goals, with
``info["is_success"]`` on every step.

    env: {adapter: robotics, id: FetchReach-v4, options: {image_size: 64, state: true}}

Observations: ``{"image": [H, W, 3] uint8, "observation", "achieved_goal", "desired_goal": float32 vectors}``
(FrankaKitchen's per-task goal dicts are concatenated into vectors, in the order of its tasks), or the image alone
with ``state: false``; rendering is set up as in the mujoco_pixels adapter. Fetch reports ``is_success`` itself;
FrankaKitchen succeeds when no task is left to complete.

Needs the ``gymnasium-robotics`` package (its Fetch/Kitchen models ship in the wheel: nothing is downloaded).
"""

from __future__ import annotations

import types
from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.adapters.gymnasium import check_env_id, vectorize
from rlfabric.services.env.adapters.mujoco_pixels import (
    SuccessFrom,
    check_options,
    headless,
    image_shape,
    make_rendered,
    pixel_env,
)

collector = "gym"  # rollout.collector auto: gym stepping


def _import() -> Any:
    headless()  # gymnasium_robotics imports mujoco
    try:
        import gymnasium_robotics
    except ImportError as exc:
        raise ValueError("env.adapter robotics needs the gymnasium-robotics package. Fix: pip install "
                         "gymnasium-robotics (the robotics extra)") from exc
    gym.register_envs(gymnasium_robotics)
    _mujoco4_joint_types()
    return gymnasium_robotics


def _mujoco4_joint_types() -> None:
    """gymnasium-robotics 1.4.2 asserts ``joint_type in (mjtJoint.mjJNT_HINGE, ...)``; MuJoCo 4's enums compare
    unequal to the numpy ints of ``model.jnt_type`` when on the left of ``==``, so every Fetch and Kitchen env fails
    that assertion at construction. Its joint helpers get a view of mujoco whose joint types are plain ints (only
    where the comparison is broken; the module's other names are mujoco's own)."""
    import mujoco
    from gymnasium_robotics.utils import mujoco_utils

    hinge = mujoco.mjtJoint.mjJNT_HINGE
    if isinstance(mujoco_utils.mujoco, types.SimpleNamespace) or hinge == np.int32(int(hinge)):
        return
    names = dict(vars(mujoco))
    names["mjtJoint"] = types.SimpleNamespace(**{k: int(v) for k, v in mujoco.mjtJoint.__members__.items()})
    mujoco_utils.mujoco = types.SimpleNamespace(**names)


class FlatGoals(gym.ObservationWrapper):
    """Goal entries that are dicts of per-task vectors (FrankaKitchen) as one vector each, so every observation
    entry is an array the data plane carries."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        spaces = dict(env.observation_space.spaces)
        self.nested = [k for k, s in spaces.items() if isinstance(s, gym.spaces.Dict)]
        for key in self.nested:
            parts = list(spaces[key].values())
            spaces[key] = gym.spaces.Box(np.concatenate([p.low.ravel() for p in parts]),
                                         np.concatenate([p.high.ravel() for p in parts]), dtype=np.float64)
        self.observation_space = gym.spaces.Dict(spaces)

    def observation(self, obs: dict[str, Any]) -> dict[str, Any]:
        out = dict(obs)
        for key in self.nested:
            space = self.env.observation_space[key]
            out[key] = np.concatenate([np.asarray(obs[key][k], np.float64).ravel() for k in space])
        return out


def kitchen_succeeded(info: dict) -> bool:
    """FrankaKitchen's episode succeeds when none of its tasks is left (``info["tasks_to_complete"]`` empty)."""
    return not info.get("tasks_to_complete")


def check(env_cfg: Any) -> None:
    check_options(env_cfg)
    _import()
    check_env_id(env_cfg.id)


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    height, width = image_shape(env_cfg.options)
    env_id, kwargs, options = env_cfg.id, dict(env_cfg.kwargs), dict(env_cfg.options)

    def make() -> gym.Env:
        _import()
        from gymnasium_robotics.envs.franka_kitchen import kitchen_env as kitchen

        env = make_rendered(env_id, height, width, kwargs)
        if isinstance(env.unwrapped, kitchen.KitchenEnv):
            env = SuccessFrom(env, kitchen_succeeded)
        return pixel_env(FlatGoals(env), env_id, options)

    return vectorize(make, num_envs, vectorization, env_cfg.action_chunk)
