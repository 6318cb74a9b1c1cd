"""Gymnasium adapter: any registered id, sync or async vectorisation, same-step auto-reset.

Same-step auto-reset means every step is a real transition: a finished sub-env returns its reset observation
and hands the last observation of the episode in ``final_obs`` (needed to bootstrap truncated episodes).
"""

from __future__ import annotations

import difflib
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode


class UnknownEnvError(ValueError):
    pass


def check_env_id(env_id: str) -> None:
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        close = difflib.get_close_matches(env_id, list(gym.registry.keys()), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
            "see gymnasium.pprint_registry() for the ids installed here"
        raise UnknownEnvError(
            f"env.id {env_id!r} is not a registered gymnasium id ({exc.__class__.__name__}). Fix: {hint} "
            f"(ids from extra packages need that package installed and imported)") from None


def make_vector_env(env_id: str, num_envs: int, vectorization: str = "sync",
                    kwargs: dict[str, Any] | None = None) -> gym.vector.VectorEnv:
    check_env_id(env_id)
    kwargs = dict(kwargs or {})

    def make() -> gym.Env:
        return gym.make(env_id, **kwargs)

    fns = [make] * num_envs
    if vectorization == "async":
        # spawn, not fork: the parent runs gRPC and ZeroMQ threads that must not be forked.
        return gym.vector.AsyncVectorEnv(fns, context="spawn", autoreset_mode=AutoresetMode.SAME_STEP)
    return gym.vector.SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)


def final_observations(obs: np.ndarray, info: dict[str, Any], done: np.ndarray) -> np.ndarray:
    """Last observation of each finished episode (zeros elsewhere), stacked into one array."""
    final = np.zeros_like(obs)
    if done.any() and "final_obs" in info:
        for i in np.flatnonzero(info.get("_final_obs", done)):
            final[i] = info["final_obs"][i]
    return final


def describe_space(space: gym.Space) -> dict[str, Any]:
    if isinstance(space, gym.spaces.Discrete):
        return {"kind": "discrete", "shape": [], "dtype": "int64", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.Box):
        return {"kind": "box", "shape": list(space.shape), "dtype": str(space.dtype),
                "low": np.asarray(space.low, dtype=np.float64).ravel().tolist(),
                "high": np.asarray(space.high, dtype=np.float64).ravel().tolist()}
    raise ValueError(f"space {space} is not supported yet (Box and Discrete are); wrap the env to flatten it")
