"""Collectors by name: how a rollout worker acts. A collector records one iteration's trajectory shard with the
fields the algorithm's spec asks for (``collect``), plays evaluation episodes (``evaluate``) and measures its env
channel (``probe``). ``gym`` steps vector envs (gymnasium and the adapters built on it); LLM generation with tools
and the robot gateway join here. ``rollout.collector: auto`` picks the env adapter's collector."""

from __future__ import annotations

import importlib
from typing import Any

COLLECTORS: dict[str, str] = {"gym": "services.rollout.collectors.gym:GymCollector",
                              "llm": "services.rollout.collectors.llm:LLMCollector"}
BY_ADAPTER: dict[str, str] = {"gymnasium": "gym", "minigrid": "gym", "robot": "gym", "text": "llm"}


def register_collector(name: str, target: str, adapters: tuple[str, ...] = ()) -> None:
    COLLECTORS[name] = target
    BY_ADAPTER.update({a: name for a in adapters})


def collector_name(config: Any) -> str:
    name = config.rollout.collector
    if name == "auto":
        name = BY_ADAPTER.get(config.env.adapter, "")
        if not name:
            raise ValueError(f"rollout.collector auto: no collector serves env.adapter {config.env.adapter!r}; "
                             f"set rollout.collector to one of {sorted(COLLECTORS)}")
    if name not in COLLECTORS:
        raise ValueError(f"rollout.collector {name!r} is not a registered collector; available: {sorted(COLLECTORS)}")
    return name


def collector_class(config: Any) -> type:
    module, _, cls = COLLECTORS[collector_name(config)].partition(":")
    return getattr(importlib.import_module(module), cls)
