"""MetaWorld adapter: Sawyer-arm manipulation tasks (one task, or the MT10/MT25/MT50 multi-task benchmarks) observed
as small rendered images next to the 39-dim state, optionally with the task's instruction, and
``info["is_success"]`` on every step.

    env: {adapter: metaworld, id: MT10, options: {image_size: 64, camera: corner2, instruction: true}}
    env: {adapter: metaworld, id: pick-place-v3, options: {state: false}}

``env.id`` is a MetaWorld v3 task name (MetaWorld's MT1 benchmark: 50 goal placements of that task) or MT10, MT25,
MT50. Sub-envs take the benchmark's tasks round-robin across every vector env this process builds, so the chunks and
shards of a run together cover every task when ``num_envs`` is a multiple of the task count; each reset samples one
of the task's goal placements (MetaWorld's RandomTaskSelectWrapper), seeded by the vector env's reset seed.
``instruction: true`` adds the task as text ("pick place" for pick-place-v3) in UTF-8 bytes shifted by one (0 pads):
an int64 ``instruction`` entry a VLA policy embeds with a 257-token vocabulary. Episodes truncate at
``max_episode_steps`` (MetaWorld's 500 at most) and end on success only with ``terminate_on_success``.

Needs the ``metaworld`` package, which pins its own MuJoCo (metaworld 3.1.1: mujoco==3.3.0), so it lives in its own
environment (the metaworld extra), not beside the dev extra's MuJoCo.
"""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.adapters.gymnasium import vectorize_fns
from rlfabric.services.env.adapters.instruction import Instruction
from rlfabric.services.env.adapters.mujoco_pixels import (
    SuccessFrom,
    check_options,
    headless,
    image_shape,
    pixel_env,
)
from rlfabric.services.env.chunking import ActionChunk

collector = "gym"  # rollout.collector auto: gym stepping
BENCHMARKS = ("MT10", "MT25", "MT50")
CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")
EXTRA_OPTIONS = ("camera", "instruction", "terminate_on_success", "max_episode_steps")
MAX_STEPS = 500  # SawyerXYZEnv.max_path_length: stepping past it raises
INSTRUCTION_BYTES = 32
_next_env: dict[str, itertools.count] = {}  # per env.id: the next sub-env's place in the round-robin


def _import() -> Any:
    headless()  # metaworld imports mujoco
    try:
        import metaworld
    except ImportError as exc:
        raise ValueError("env.adapter metaworld needs the metaworld package, which pins its own mujoco. Fix: pip "
                         "install the metaworld extra in an environment of its own") from exc
    return metaworld


def check(env_cfg: Any) -> None:
    check_options(env_cfg, EXTRA_OPTIONS)
    opts = env_cfg.options
    if opts.get("camera", "corner2") not in CAMERAS:
        raise ValueError(f"env.options.camera={opts['camera']!r} is not a MetaWorld camera. Fix: one of {CAMERAS}")
    for key in ("instruction", "terminate_on_success"):
        if not isinstance(opts.get(key, False), bool):
            raise ValueError(f"env.options.{key}={opts[key]!r} must be true or false")
    steps = opts.get("max_episode_steps", MAX_STEPS)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"env.options.max_episode_steps={steps!r}: an integer in [1, {MAX_STEPS}] (MetaWorld "
                         f"envs refuse to step past {MAX_STEPS})")
    metaworld = _import()
    if env_cfg.id not in BENCHMARKS and env_cfg.id not in metaworld.ALL_V3_ENVIRONMENTS:
        raise ValueError(f"env.id {env_cfg.id!r} is not a MetaWorld v3 task or benchmark. Fix: one of {BENCHMARKS} "
                         f"or a task name such as reach-v3, pick-place-v3 (metaworld.ALL_V3_ENVIRONMENTS)")


def instruction_of(task_name: str) -> str:
    """The task's words: 'pick-place-v3' -> 'pick place'."""
    return " ".join(task_name.removesuffix("-v3").split("-"))


def succeeded(info: dict) -> bool:
    """MetaWorld's ``info["success"]`` is 0.0 or 1.0."""
    return info.get("success", 0.0) >= 1.0


class SeedTasks(gym.Wrapper):
    """SawyerXYZEnv.reset ignores its seed; the reset seed seeds the env's generator (the goal placement MetaWorld's
    task wrapper draws) instead, so seeded resets repeat."""

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.unwrapped.seed(seed)
        return self.env.reset(seed=seed, options=options)


class Upright(gym.ObservationWrapper):
    """MetaWorld's corner cameras are rolled 180 degrees in its XML (``corner``: xyaxes "-1 1 0 -0.2 -0.2 -1", image
    up pointing down), so their frames come out upside down; rotating the image back keeps left and right true
    (a vertical flip alone would mirror the scene)."""

    def observation(self, obs: Any) -> Any:
        if isinstance(obs, dict):
            return {**obs, "image": np.ascontiguousarray(obs["image"][::-1, ::-1])}
        return np.ascontiguousarray(obs[::-1, ::-1])


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    metaworld = _import()
    env_id, options = env_cfg.id, dict(env_cfg.options)
    height, width = image_shape(options)
    benchmark = getattr(metaworld, env_id)() if env_id in BENCHMARKS else metaworld.MT1(env_id)
    classes = list(benchmark.train_classes.items())
    counter = _next_env.setdefault(env_id, itertools.count())
    kwargs, chunk, camera = dict(env_cfg.kwargs), env_cfg.action_chunk, options.get("camera", "corner2")

    def factory(name: str, cls: type) -> Any:
        tasks = [t for t in benchmark.train_tasks if t.env_name == name]

        def make() -> gym.Env:
            headless()
            from metaworld.wrappers import AutoTerminateOnSuccessWrapper, RandomTaskSelectWrapper

            env: gym.Env = cls(render_mode="rgb_array", width=width, height=height, camera_name=camera, **kwargs)
            env = gym.wrappers.TimeLimit(env, options.get("max_episode_steps", MAX_STEPS))
            env = AutoTerminateOnSuccessWrapper(env)
            env.toggle_terminate_on_success(options.get("terminate_on_success", False))
            env = SuccessFrom(SeedTasks(RandomTaskSelectWrapper(env, tasks)), succeeded)
            env = pixel_env(env, name, options)
            if camera.startswith("corner"):
                env = Upright(env)
            if options.get("instruction", False):
                env = Instruction(env, instruction_of(name), INSTRUCTION_BYTES)
            return ActionChunk(env, chunk) if chunk > 1 else env

        return make

    fns = [factory(*classes[next(counter) % len(classes)]) for _ in range(num_envs)]
    return vectorize_fns(fns, vectorization)
