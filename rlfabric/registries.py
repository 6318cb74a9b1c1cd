"""Where rlfabric finds its extensions, by name. Each extension point is one new file behind one of these:

    algorithms()       services/learner/algorithms/<name>.py, or a package's ``rlfabric.algorithms`` entry point
    policies()         services/core/models (core's small models), entry points ``rlfabric.policies`` (rlfabric's
                       model families, services/policies, are entry points of its own pyproject.toml)
    policy_options()   each policy's options section ``policy.<name>``, a torch-free pydantic model: entry points
                       ``rlfabric.policy_options`` (services/policies/options.py for rlfabric's own)
    collectors()       services/rollout/collectors, entry points ``rlfabric.collectors``
    backends()         services/rollout/backends, entry points ``rlfabric.backends``
    backend_options()  each backend's options section ``rollout.<name>``: entry points ``rlfabric.backend_options``
    env_adapters()     services/env/adapters, entry points ``rlfabric.env_adapters``
    tasks()            services/env/tasks (text tasks), entry points ``rlfabric.tasks``
    rewards()          services/env/tasks/rewards.py, entry points ``rlfabric.rewards``
    drivers()          services/robot_gateway/drivers, entry points ``rlfabric.drivers`` (the gateway's arms)

Policies, collectors, backends, env adapters, text tasks and rewards resolve through services/core/registry.py
in whichever process reads the run spec: a built-in, an entry point of an installed package, or
``package.module:attr`` written in the spec. Options models (services/core/options.py) come from entry points
only, read when the run-spec schema loads: each becomes a section of the schema, as strict as a built-in's. The
``register_*`` calls change only the calling process (tests, a notebook's in-process evaluation); to reach the
services, ship an entry point or name the code literally.
"""

from __future__ import annotations

from typing import Any


def algorithms() -> dict[str, Any]:
    """Registered algorithm specs by ``algorithm.name``."""
    from rlfabric.services.core.algorithm import load_algorithms

    return dict(load_algorithms())


def policies() -> dict[str, Any]:
    """Policy names (``policy.name``) and their classes: built-ins and entry points."""
    from rlfabric.services.core.policy_names import POLICIES

    return POLICIES.available()


def policy_options() -> dict[str, str]:
    """Policy names and their options models (``module:Model``, the section ``policy.<name>``): entry points."""
    from rlfabric.services.core.options import POLICY_OPTIONS

    return POLICY_OPTIONS.available()


def collectors() -> dict[str, str]:
    """Collector names and where each lives (``module:Class``): built-ins and entry points."""
    from rlfabric.services.rollout.collectors import COLLECTORS

    return COLLECTORS.available()


def backends() -> dict[str, str]:
    """Backend names and where each lives (``module:Class``): built-ins and entry points."""
    from rlfabric.services.rollout.backends import BACKENDS

    return BACKENDS.available()


def backend_options() -> dict[str, str]:
    """Backend names and their options models (``module:Model``, the section ``rollout.<name>``): entry points."""
    from rlfabric.services.core.options import BACKEND_OPTIONS

    return BACKEND_OPTIONS.available()


def env_adapters() -> dict[str, str]:
    """Env adapter names and their modules: built-ins and entry points."""
    from rlfabric.services.env.adapters import ENV_ADAPTERS

    return ENV_ADAPTERS.available()


def tasks() -> dict[str, str]:
    """Text task names (``env.id`` of the text adapter) and their classes: built-ins and entry points."""
    from rlfabric.services.env.tasks import TASKS

    return TASKS.available()


def rewards() -> dict[str, str]:
    """Reward names (``env.options.reward``) and their functions: built-ins and entry points. A reward is
    ``reward(prompt, completion, answer, **fields) -> float``, run in the env's reward pool (a worker process)."""
    from rlfabric.services.env.tasks.rewards import REWARDS

    return REWARDS.available()


def drivers() -> dict[str, str]:
    """Robot driver names (``ConnectRequest.driver``, ``env.options.driver``) and where each lives: built-ins and
    entry points. A gateway resolves only these: a Connect never names a module to import."""
    from rlfabric.services.robot_gateway.drivers import DRIVERS

    return DRIVERS.available()


def register_policy(name: str):
    from rlfabric.services.core.policy_names import register_policy as register

    return register(name)


def register_collector(name: str, target: str) -> None:
    """In this process only. An adapter names its collector itself (its ``collector`` attribute)."""
    from rlfabric.services.rollout.collectors import register_collector as register

    register(name, target)


def register_backend(name: str, target: str) -> None:
    from rlfabric.services.rollout.backends import register_backend as register

    register(name, target)


def register_adapter(name: str, module: str) -> None:
    from rlfabric.services.env.adapters import register_adapter as register

    register(name, module)
