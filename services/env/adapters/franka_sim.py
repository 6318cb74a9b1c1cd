"""Franka sim adapter: HIL-SERL's simulated Franka Panda tasks from gym-hil (MuJoCo, assets shipped in the wheel),
seen through its front and wrist cameras and the arm's state, with ``info["is_success"]`` on every step.

    env: {adapter: franka_sim, id: PandaPickCube, options: {image_size: 64, instruction: true}}
    env: {adapter: franka_sim, id: PandaPickCube, options: {cameras: [], reward: dense}}   # state only

``env.id`` is a gym-hil task: PandaPickCube (lift the cube 10 cm) or PandaArrangeBoxes. Actions are gym-hil's
end-effector control (its EEActionWrapper): a displacement in x, y, z in [-1, 1] (2.5 cm per unit) and a gripper
command in [0, 2] (below 1 opens, above 1 closes). Observations: ``front`` and ``wrist`` uint8 images (the cameras
named in ``options.cameras``) and ``state`` (joint positions and velocities, gripper, tool position; with no camera,
the block's position too, as gym-hil's state-only mode gives it), and with ``instruction: true`` the task's words
as an int64 ``instruction`` entry. ``reward`` is gym-hil's ``sparse`` (1 once lifted) or ``dense`` (reach and lift
shaping). Episodes end on success or when the cube leaves the table, and truncate at ``max_episode_steps`` (gym-hil
registers 100).

Needs the ``gym-hil`` package (the gym-hil extra), which brings its own MuJoCo, so install it in an environment of its
own. gym-hil draws block placements from NumPy's global generator; each sub-env here keeps a generator state of its
own, seeded by the vector env's reset seed, so seeded resets repeat.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.adapters.gymnasium import vectorize
from rlfabric.services.env.adapters.instruction import Instruction
from rlfabric.services.env.adapters.mujoco_pixels import (
    SuccessFrom,
    cheap_rendering,
    check_options,
    headless,
    image_shape,
)

collector = "gym"  # rollout.collector auto: gym stepping
TASKS = {  # env.id -> (gym-hil's env class, its instruction)
    "PandaPickCube": ("PandaPickCubeGymEnv", "pick up the cube"),
    "PandaArrangeBoxes": ("PandaArrangeBoxesGymEnv", "arrange the boxes"),
}
CAMERAS = ("front", "wrist")
REWARDS = ("sparse", "dense")
EXTRA_OPTIONS = ("cameras", "instruction", "reward", "random_block_position", "max_episode_steps")
MAX_STEPS = 100  # what gym-hil registers its tasks with


def _import() -> Any:
    headless()  # gym-hil imports mujoco and builds a renderer in every env's constructor
    try:
        import gym_hil.envs
        from gym_hil.wrappers.hil_wrappers import DEFAULT_EE_STEP_SIZE, EEActionWrapper
    except ImportError as exc:
        raise ValueError("env.adapter franka_sim needs the gym-hil package, which brings its own mujoco. Fix: pip "
                         "install the gym-hil extra (pip install -e '.[gym-hil]') in an environment of its own") from exc
    return gym_hil.envs, EEActionWrapper, DEFAULT_EE_STEP_SIZE


def check(env_cfg: Any) -> None:
    if env_cfg.id not in TASKS:
        raise ValueError(f"env.id {env_cfg.id!r} is not a gym-hil task. Fix: one of {sorted(TASKS)}")
    check_options(env_cfg, EXTRA_OPTIONS)
    opts = env_cfg.options
    cameras = opts.get("cameras", list(CAMERAS))
    if not isinstance(cameras, list) or len(set(cameras)) != len(cameras) or not set(cameras) <= set(CAMERAS):
        raise ValueError(f"env.options.cameras={cameras!r}: a list of distinct cameras among {list(CAMERAS)} ([] for "
                         f"state only)")
    if not cameras and not opts.get("state", True):
        raise ValueError("env.options: cameras [] with state false leaves nothing to observe. Fix: keep a camera or "
                         "the state")
    if opts.get("reward", "sparse") not in REWARDS:
        raise ValueError(f"env.options.reward={opts['reward']!r}: one of {list(REWARDS)}")
    if "random_block_position" in opts and env_cfg.id != "PandaPickCube":
        raise ValueError(f"env.options.random_block_position: only PandaPickCube places a block at random "
                         f"({env_cfg.id} shuffles its boxes on every reset). Fix: remove it")
    for key in ("instruction", "random_block_position"):
        if not isinstance(opts.get(key, False), bool):
            raise ValueError(f"env.options.{key}={opts[key]!r} must be true or false")
    steps = opts.get("max_episode_steps", MAX_STEPS)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"env.options.max_episode_steps={steps!r}: a positive integer (gym-hil: {MAX_STEPS})")
    if env_cfg.kwargs:
        raise ValueError(f"env.kwargs {sorted(env_cfg.kwargs)}: the franka_sim adapter takes its settings from "
                         f"env.options only. Fix: move them to env.options ({list(EXTRA_OPTIONS)})")
    _import()


def render_cheaply(env: Any, height: int, width: int) -> None:
    """gym-hil builds its renderer with MuJoCo's default quality (4096-pixel shadow maps, 4x multisampling), which a
    CPU rasteriser pays for on every frame: ~0.7 s per step for two 32x32 cameras. Turn those off and rebuild its
    renderer (``_viewer``: its buffers are sized when it is made) so frames cost ~10-60 ms."""
    import mujoco

    cheap_rendering(env.model, height, width)
    env._viewer.close()
    env._viewer = mujoco.Renderer(env.model, height=height, width=width)


class OwnGlobalRNG(gym.Wrapper):
    """gym-hil places blocks with ``np.random`` (NumPy's global generator). Give this env a generator state of its
    own, swapped in around each reset: seeded resets repeat, and sub-envs do not draw from one shared stream."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.state = np.random.RandomState().get_state()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.state = np.random.RandomState(seed).get_state()
        outer = np.random.get_state()
        np.random.set_state(self.state)
        try:
            return self.env.reset(seed=seed, options=options)
        finally:
            self.state = np.random.get_state()
            np.random.set_state(outer)


class FlatObservation(gym.ObservationWrapper):
    """gym-hil's nested observation as flat entries: each kept camera under its own name, ``state`` as float32
    (the arm's state, plus the block's position in state-only mode), or no state when ``state`` is false."""

    def __init__(self, env: gym.Env, cameras: list[str], keep_state: bool):
        super().__init__(env)
        self.cameras, self.keep_state = cameras, keep_state
        space = env.observation_space
        parts = {name: space["pixels"][name] for name in cameras}
        if keep_state:
            dim = space["agent_pos"].shape[0] + (0 if cameras else space["environment_state"].shape[0])
            parts["state"] = gym.spaces.Box(-np.inf, np.inf, (dim,), np.float32)
        self.observation_space = gym.spaces.Dict(parts)

    def observation(self, obs: dict[str, Any]) -> dict[str, np.ndarray]:
        out = {name: np.ascontiguousarray(obs["pixels"][name]) for name in self.cameras}
        if self.keep_state:
            state = [obs["agent_pos"]] + ([] if self.cameras else [obs["environment_state"]])
            out["state"] = np.concatenate(state).astype(np.float32)
        return out


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    opts = dict(env_cfg.options)
    height, width = image_shape(opts)
    cameras = list(opts.get("cameras", list(CAMERAS)))
    class_name, words = TASKS[env_cfg.id]

    def make() -> gym.Env:
        envs, ee_action, step_size = _import()
        from gym_hil.mujoco_gym_env import GymRenderingSpec

        kwargs: dict[str, Any] = {"render_spec": GymRenderingSpec(height=height, width=width),
                                  "image_obs": bool(cameras), "reward_type": opts.get("reward", "sparse")}
        if env_cfg.id == "PandaPickCube":
            kwargs["random_block_position"] = opts.get("random_block_position", False)
        env: gym.Env = getattr(envs, class_name)(**kwargs)
        render_cheaply(env, height, width)
        env = ee_action(OwnGlobalRNG(env), ee_action_step_size=step_size, use_gripper=True)
        env = gym.wrappers.TimeLimit(env, opts.get("max_episode_steps", MAX_STEPS))
        env = SuccessFrom(env, lambda info: bool(info.get("succeed", False)))
        env = FlatObservation(env, cameras, opts.get("state", True))
        return Instruction(env, words) if opts.get("instruction", False) else env

    return vectorize(make, num_envs, vectorization, env_cfg.action_chunk)
