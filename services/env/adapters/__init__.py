"""Env adapters: how a run's ``env`` section becomes the vector envs an EnvPool steps, one module per adapter.

An adapter module exposes ``check(env_cfg)`` (raise a ValueError naming the field and the fix, before anything is
built) and ``make_vector_env(env_cfg, num_envs, vectorization)`` returning a gymnasium VectorEnv with same-step
auto-reset (a finished env hands back ``final_obs``). Modules are imported when first used, so an adapter whose
simulator is an optional extra costs nothing until a run names it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

ADAPTERS: dict[str, str] = {
    "gymnasium": "services.env.adapters.gymnasium",  # any registered gymnasium id (state observations)
    "mujoco_pixels": "services.env.adapters.mujoco_pixels",  # gymnasium MuJoCo tasks seen as rendered images (+ state)
    "robotics": "services.env.adapters.robotics",  # gymnasium-robotics Fetch/FrankaKitchen: images, goals, is_success
    "metaworld": "services.env.adapters.metaworld",  # MetaWorld MT1/MT10/MT50: images, state, instruction, is_success
    "minigrid": "services.env.adapters.minigrid",  # MiniGrid/BabyAI grid worlds as RGB pixels (+ mission text)
    "text": "services.env.adapters.text",  # text tasks for language-model policies (arithmetic, tool use)
    "robot": "services.env.adapters.robot",  # arms behind a robot gateway (real-world RL through the env service)
}


def register_adapter(name: str, module: str) -> None:
    ADAPTERS[name] = module


def adapter(name: str) -> ModuleType:
    if name not in ADAPTERS:
        raise ValueError(f"env.adapter {name!r} is not a registered env adapter; available: {sorted(ADAPTERS)}")
    try:
        return importlib.import_module(ADAPTERS[name])
    except ImportError as exc:
        raise ValueError(f"env.adapter {name!r} needs a package that is not installed ({exc.name}). Fix: pip "
                         f"install the extra that brings it (see README)") from None
