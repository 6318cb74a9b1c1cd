"""Collectors by name: how a rollout worker acts. A collector records one iteration's trajectory shard with the
fields the algorithm's spec asks for (``collect``), plays evaluation episodes (``evaluate``) and measures its env
channel (``probe``). ``gym`` steps vector envs (gymnasium and the adapters built on it); LLM generation with tools
and the robot gateway join here. Collectors come from COLLECTORS (services/core/registry.py): the built-ins below,
entry points of group ``rlfabric.collectors``, or ``package.module:Class`` in the run spec. ``rollout.collector:
auto`` takes the collector the env adapter declares (its ``collector`` attribute), in this process, so an adapter
from a user's package brings its own collector with no table to edit here."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlfabric.services.core.registry import Registry
from rlfabric.services.env.adapters import ENV_ADAPTERS

if TYPE_CHECKING:
    from rlfabric.services.rollout.collectors.gym import Collected, Evaluation


@runtime_checkable
class Collector(Protocol):
    """Built as ``cls(config, backend, env, shard_envs, chunks, pool, env_offset)`` by the rollout worker."""

    def reset(self, seed: int) -> None: ...

    def collect(self, batch_index: int, version: int, stop: threading.Event | None) -> Collected: ...

    def evaluate(self, episodes: int, deterministic: bool, seed: int,
                 stop: threading.Event | None = None) -> Evaluation: ...

    def probe(self, round_trips: int, stop: threading.Event | None = None) -> tuple[float, int]: ...


COLLECTORS = Registry("collectors", "rollout.collector", {
    "gym": "rlfabric.services.rollout.collectors.gym:GymCollector",
    "llm": "rlfabric.services.rollout.collectors.llm:LLMCollector",
}, home="services/rollout/collectors", protocol=Collector)


def register_collector(name: str, target: str) -> None:
    COLLECTORS.register(name, target)


def collector_name(config: Any) -> str:
    """The collector a run's rollout uses: its own ``rollout.collector``, or with ``auto`` its env adapter's."""
    name = config.rollout.collector
    if name != "auto":
        return name
    declared = ENV_ADAPTERS.load(config.env.adapter).collector
    if not isinstance(declared, str) or not declared or declared == "auto":
        raise ValueError(f"env.adapter {config.env.adapter!r} declares collector {declared!r}, not a collector "
                         f"name. Fix: the adapter sets collector to a name in {sorted(COLLECTORS.available())}, "
                         f"or set rollout.collector")
    return declared


def collector_class(config: Any) -> type[Collector]:
    return COLLECTORS.load(collector_name(config))
