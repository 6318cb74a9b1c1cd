"""MuJoCo pixels adapter: gymnasium's MuJoCo tasks (Reacher-v5, InvertedPendulum-v5, HalfCheetah-v5, ...) observed
as small uint8 images rendered headless on the CPU, with or without the task's usual state vector.

    env: {adapter: mujoco_pixels, id: Reacher-v5, options: {image_size: 64, state: true}}

The env renders at ``image_size`` itself (MuJoCo envs take ``width``/``height``), so nothing is resized, and
gymnasium's AddRenderObservation puts each frame in the observation: ``{"image": [H, W, 3] uint8, "state": float32
vector}``, or the image alone with ``state: false``. Rendering is made cheap on the model before the first frame
(no multisampling, shadows or reflections; an off-screen buffer the size of the image): HalfCheetah-v5 at 64x64
steps ~30x faster than with MuJoCo's defaults. Other camera settings pass through ``env.kwargs`` (``camera_name``,
``camera_id``, ``default_camera_config``).

Needs ``gymnasium[mujoco]`` (mujoco and imageio) and, headless, Debian's libosmesa6 (``MUJOCO_GL=osmesa``).
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.adapters.gymnasium import check_env_id, vectorize
from rlfabric.services.env.sims.offscreen import use_osmesa

collector = "gym"  # rollout.collector auto: gym stepping (images and state are ordinary observations)
OPTIONS = ("image_size", "state")
SIZE_RANGE = (16, 512)
RENDER_KWARGS = ("render_mode", "width", "height")  # the adapter sets these; env.kwargs may not


def headless() -> None:
    """Pick OSMesa (CPU) rendering for this process if it has not imported mujoco yet (see sims/offscreen.py)."""
    use_osmesa()


def image_shape(options: dict[str, Any]) -> tuple[int, int]:
    """``image_size``: one number (square) or ``[height, width]``."""
    size = options.get("image_size", 64)
    pair = [size, size] if isinstance(size, int) else size
    lo, hi = SIZE_RANGE
    if not (isinstance(pair, list | tuple) and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi for v in pair)):
        raise ValueError(f"env.options.image_size={size!r}: pixels per side, an integer in [{lo}, {hi}] or a "
                         f"[height, width] pair of them. Fix: e.g. image_size: 64")
    return int(pair[0]), int(pair[1])


def check_options(env_cfg: Any, extra: tuple[str, ...] = ()) -> None:
    """The options every pixel adapter shares (``image_size``, ``state``) plus ``extra`` ones it checks itself."""
    allowed = (*OPTIONS, *extra)
    unknown = sorted(set(env_cfg.options) - set(allowed))
    if unknown:
        raise ValueError(f"env.options {unknown} are not {env_cfg.adapter} options. Fix: use only {sorted(allowed)}")
    image_shape(env_cfg.options)
    if not isinstance(env_cfg.options.get("state", True), bool):
        raise ValueError(f"env.options.state={env_cfg.options['state']!r}: true keeps the state vector next to the "
                         f"image, false observes the image alone. Fix: set true or false")
    for key in RENDER_KWARGS:
        if key in env_cfg.kwargs:
            raise ValueError(f"env.kwargs.{key}: the {env_cfg.adapter} adapter renders rgb_array frames of "
                             f"env.options.image_size itself. Fix: remove env.kwargs.{key} (set image_size instead)")


def check(env_cfg: Any) -> None:
    check_options(env_cfg)
    check_env_id(env_cfg.id)


def cheap_rendering(model: Any, height: int, width: int) -> None:
    """Rendering settings that cost little on a CPU rasteriser and matter little to a 64-pixel policy; must run
    before the first frame (the GL context sizes its buffers then)."""
    model.vis.quality.offsamples = 0
    model.light_castshadow[:] = 0
    model.mat_reflectance[:] = 0
    model.vis.global_.offwidth, model.vis.global_.offheight = width, height


class Float32State(gym.ObservationWrapper):
    """float64 vectors (MuJoCo's default) as float32: half the bytes on the data plane, what policies compute in."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = _float32_space(env.observation_space)

    def observation(self, obs: Any) -> Any:
        if isinstance(obs, dict):
            return {k: v if np.asarray(v).dtype == np.uint8 else np.asarray(v, np.float32) for k, v in obs.items()}
        return obs if np.asarray(obs).dtype == np.uint8 else np.asarray(obs, np.float32)


class OwnContext(gym.Wrapper):
    """Each MuJoCo env renders with its own GL context, but gymnasium makes a context current only when it creates
    it: with several envs in one process (a sync vector env, or an env built after another was closed) a frame
    would be drawn with another env's context, or none (black). Make this env's context current before each frame."""

    def render(self):
        viewer = getattr(_renderer(self.env.unwrapped), "viewer", None)
        if viewer is not None:
            viewer.make_context_current()
        return self.env.render()

    def close(self):
        """Free MuJoCo's GL objects in this env's own context before it is destroyed: left to the garbage collector,
        they are deleted in whatever context is current then, which blanks a newer env's frames."""
        viewer = getattr(_renderer(self.env.unwrapped), "viewer", None)
        if getattr(viewer, "con", None) is not None:
            viewer.make_context_current()
            viewer.con.free()
        super().close()


def _renderer(env: Any) -> Any:
    """gymnasium's MujocoRenderer of a MuJoCo env (FrankaKitchen keeps it on its robot env)."""
    return getattr(env, "mujoco_renderer", None) or getattr(getattr(env, "robot_env", None), "mujoco_renderer", None)


def _float32_space(space: gym.Space) -> gym.Space:
    if isinstance(space, gym.spaces.Dict):
        return gym.spaces.Dict({k: _float32_space(s) for k, s in space.items()})
    if isinstance(space, gym.spaces.Box) and space.dtype == np.float64:
        return gym.spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32), space.shape, np.float32)
    return space


def pixel_env(env: gym.Env, env_id: str, options: dict[str, Any]) -> gym.Env:
    """``env`` (made with render_mode rgb_array at the image size) with its frame as the ``image`` observation,
    next to the state (a Dict state keeps its keys) unless ``options.state`` is false."""
    model = getattr(env.unwrapped, "model", None)
    if not hasattr(model, "vis"):  # an MjModel
        env.close()
        raise ValueError(f"env.id {env_id!r} is not a MuJoCo env (it has no MjModel). Fix: use "
                         f"env.adapter: gymnasium (state observations) or minigrid (grid worlds)")
    height, width = image_shape(options)
    cheap_rendering(model, height, width)
    try:  # the wrapper renders a first frame to learn the image's shape
        env = gym.wrappers.AddRenderObservation(OwnContext(env), render_only=not options.get("state", True),
                                                render_key="image", obs_key="state")
    except Exception as exc:
        raise RuntimeError(
            f"{env_id} could not render off-screen (MUJOCO_GL={os.environ.get('MUJOCO_GL', '')!r}): {exc}. Fix: "
            f"apt-get install libosmesa6 (or MUJOCO_GL=egl on a GPU host), set before the process imports mujoco "
            f"or OpenGL") from exc
    return Float32State(env)


def make_rendered(env_id: str, height: int, width: int, kwargs: dict[str, Any]) -> gym.Env:
    try:
        return gym.make(env_id, render_mode="rgb_array", width=width, height=height, **kwargs)
    except TypeError as exc:
        if "width" not in str(exc) and "height" not in str(exc):
            raise
        raise ValueError(f"env.id {env_id!r} does not take a render size (width/height), so it is not a MuJoCo env. "
                         f"Fix: use env.adapter: gymnasium (state observations) or minigrid (grid worlds)") from None


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    height, width = image_shape(env_cfg.options)
    env_id, kwargs, options = env_cfg.id, dict(env_cfg.kwargs), dict(env_cfg.options)

    def make() -> gym.Env:
        headless()
        return pixel_env(make_rendered(env_id, height, width, kwargs), env_id, options)

    return vectorize(make, num_envs, vectorization, env_cfg.action_chunk)


class SuccessFrom(gym.Wrapper):
    """A task's own success signal as the boolean ``info["is_success"]`` every adapter reports (False at reset):
    ``succeeded(info)`` reads it from the task's step info."""

    def __init__(self, env: gym.Env, succeeded: Any):
        super().__init__(env)
        self.succeeded = succeeded

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {**info, "is_success": False}

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, "is_success": bool(self.succeeded(info))}

