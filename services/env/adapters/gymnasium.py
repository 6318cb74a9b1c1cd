"""Gymnasium adapter: any registered id, sync or async vectorisation, same-step auto-reset.

Same-step auto-reset means every step is a real transition: a finished sub-env returns its reset observation
and hands the last observation of the episode in ``final_obs`` (needed to bootstrap truncated episodes).
Observations keep their dtype (uint8 images stay uint8); Dict observation spaces come through as dicts.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

import rlfabric.services.env.sims  # noqa: F401  (registers rlfabric's own simulated tasks as gymnasium ids)
from rlfabric.services.core.registry import import_paths_allowed, refuse_import_path
from rlfabric.services.env.chunking import ActionChunk

collector = "gym"  # rollout.collector auto: gym stepping


class UnknownEnvError(ValueError):
    pass


def check_env_id(env_id: str) -> None:
    if ":" in env_id and not import_paths_allowed():  # gymnasium imports "module:EnvId"'s module to find the id
        raise refuse_import_path("env.id", env_id)
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        close = difflib.get_close_matches(env_id, list(gym.registry.keys()), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
            "see gymnasium.pprint_registry() for the ids installed here"
        raise UnknownEnvError(
            f"env.id {env_id!r} is not a registered gymnasium id ({exc.__class__.__name__}). Fix: {hint} "
            f"(ids from extra packages need that package installed and imported)") from None


def check(env_cfg: Any) -> None:
    check_env_id(env_cfg.id)
    if env_cfg.kwargs.get("render_mode") not in (None, "rgb_array"):
        raise ValueError(f"env.kwargs.render_mode={env_cfg.kwargs['render_mode']!r}: services render off-screen. "
                         f"Fix: remove it (or use rgb_array)")


def vectorize(make: Callable[[], gym.Env], num_envs: int, vectorization: str = "sync",
              action_chunk: int = 1) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``make``'s env; with ``action_chunk`` > 1 each steps a chunk of actions per call."""
    if action_chunk > 1:
        make = functools.partial(_chunked, make, action_chunk)
    return vectorize_fns([make] * num_envs, vectorization)


def _chunked(make: Callable[[], gym.Env], horizon: int) -> gym.Env:
    return ActionChunk(make(), horizon)


def vectorize_fns(fns: list[Callable[[], gym.Env]], vectorization: str = "sync") -> gym.vector.VectorEnv:
    if vectorization == "async":
        # spawn, not fork: the parent runs gRPC and ZeroMQ threads that must not be forked.
        return gym.vector.AsyncVectorEnv(fns, context="spawn", autoreset_mode=AutoresetMode.SAME_STEP)
    return gym.vector.SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    kwargs = dict(env_cfg.kwargs)
    env_id = env_cfg.id

    def make() -> gym.Env:
        return gym.make(env_id, **kwargs)

    return vectorize(make, num_envs, vectorization, env_cfg.action_chunk)


def final_observations(obs: Any, info: dict[str, Any], done: np.ndarray) -> Any:
    """Last observation of each finished episode (zeros elsewhere), stacked like ``obs`` (a dict for Dict spaces)."""
    if isinstance(obs, dict):
        finals = info.get("final_obs")
        rows = np.flatnonzero(info.get("_final_obs", done)) if done.any() and finals is not None else []
        out = {}
        for key, value in obs.items():
            final = np.zeros_like(value)
            for i in rows:
                final[i] = finals[i][key]
            out[key] = final
        return out
    final = np.zeros_like(obs)
    if done.any() and "final_obs" in info:
        for i in np.flatnonzero(info.get("_final_obs", done)):
            final[i] = info["final_obs"][i]
    return final


def _bounds(values: np.ndarray) -> float | list[float]:
    flat = np.asarray(values, dtype=np.float64).ravel()
    return float(flat[0]) if flat.size and np.all(flat == flat[0]) else flat.tolist()


def describe_space(space: gym.Space) -> dict[str, Any]:
    """A space as JSON-able facts the policy and the rollout need (bounds collapse to one number when uniform)."""
    if isinstance(space, gym.spaces.Discrete):
        return {"kind": "discrete", "shape": [], "dtype": "int64", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.Box):
        return {"kind": "box", "shape": list(space.shape), "dtype": str(space.dtype),
                "low": _bounds(space.low), "high": _bounds(space.high)}
    if isinstance(space, gym.spaces.Text):  # UTF-8 bytes on the wire (a Ragged uint8 field)
        return {"kind": "text", "shape": [], "dtype": "uint8", "max_length": int(space.max_length)}
    if isinstance(space, gym.spaces.Dict):
        return {"kind": "dict", "shape": [], "dtype": "", "spaces": {k: describe_space(s) for k, s in space.items()}}
    raise ValueError(f"space {space} is not supported yet (Box, Discrete, Text and Dict of them are); wrap the env to "
                     f"convert it")


def bounds(spec: dict[str, Any], key: str) -> list[float]:
    """A Box description's low/high as one value per element."""
    value = spec[key]
    n = int(np.prod(spec["shape"])) if spec["shape"] else 1
    return [float(value)] * n if isinstance(value, int | float) else list(value)
