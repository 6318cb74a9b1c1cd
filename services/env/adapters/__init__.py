"""Env adapters: how a run's ``env`` section becomes the vector envs an EnvPool steps, one module per adapter.

An adapter (a module, or any object) is an ``EnvAdapter``: ``check(env_cfg)`` raises a ValueError naming the field
and the fix before anything is built, ``make_vector_env(env_cfg, num_envs, vectorization)`` returns a gymnasium
VectorEnv with same-step auto-reset (a finished env hands back ``final_obs``), and ``collector`` names the rollout
collector that acts in its envs (what ``rollout.collector: auto`` picks). Adapters come from ENV_ADAPTERS (services/
core/registry.py): the built-ins below, entry points of group ``rlfabric.env_adapters``, or ``package.module`` in
the run spec. Modules are imported when first used, so an adapter whose simulator is an optional extra costs
nothing until a run names it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from rlfabric.services.core.registry import Registry


@runtime_checkable
class EnvAdapter(Protocol):
    collector: str  # a name in rlfabric.services.rollout.collectors.COLLECTORS (or an entry point / literal there)

    def check(self, env_cfg: Any) -> None: ...

    def make_vector_env(self, env_cfg: Any, num_envs: int, vectorization: str = "sync") -> Any: ...


ENV_ADAPTERS = Registry("env_adapters", "env.adapter", {
    "gymnasium": "rlfabric.services.env.adapters.gymnasium",  # any registered gymnasium id (state observations)
    "mujoco_pixels": "rlfabric.services.env.adapters.mujoco_pixels",  # gymnasium MuJoCo tasks seen as rendered images (+ state)
    "robotics": "rlfabric.services.env.adapters.robotics",  # gymnasium-robotics Fetch/FrankaKitchen: images, goals, is_success
    "metaworld": "rlfabric.services.env.adapters.metaworld",  # MetaWorld MT1/MT10/MT50: images, state, instruction, is_success
    "captions": "rlfabric.services.env.adapters.captions",  # image-to-text rows (JSONL/Parquet naming images) for VLMs
    "franka_sim": "rlfabric.services.env.adapters.franka_sim",  # gym-hil's MuJoCo Franka: front/wrist cameras, is_success
    "libero": "rlfabric.services.env.adapters.libero",  # LIBERO suites: two cameras, proprio, instruction, init states
    "maniskill": "rlfabric.services.env.adapters.maniskill",  # ManiSkill3 (SAPIEN): cameras, state, is_success; needs Vulkan
    "minigrid": "rlfabric.services.env.adapters.minigrid",  # MiniGrid/BabyAI grid worlds as RGB pixels (+ mission text)
    "text": "rlfabric.services.env.adapters.text",  # text tasks for language-model policies (arithmetic, tool use)
    "robot": "rlfabric.services.env.adapters.robot",  # arms behind a robot gateway (real-world RL through the env service)
}, home="services/env/adapters", protocol=EnvAdapter, noun="env adapter")


def register_adapter(name: str, module: str) -> None:
    ENV_ADAPTERS.register(name, module)


def adapter(name: str) -> EnvAdapter:
    return ENV_ADAPTERS.load(name)
