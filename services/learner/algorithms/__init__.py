"""Algorithm registry: one file per algorithm, each registers itself under its config name.

An algorithm takes (policy, RunConfig) and exposes ``update(batch: dict[str, Tensor]) -> dict[str, float]``
plus ``state_dict()/load_state_dict()`` for checkpoints. Later algorithms (GRPO, SAC, ...) join here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ALGORITHMS: dict[str, Callable[..., Any]] = {}


def register(name: str):
    def wrap(cls):
        ALGORITHMS[name] = cls
        return cls

    return wrap


def build(name: str, *args: Any, **kwargs: Any) -> Any:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm.name {name!r} is not registered; available: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name](*args, **kwargs)


from services.learner.algorithms import ppo, sac  # noqa: E402,F401  (each registers itself)
