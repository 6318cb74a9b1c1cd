"""Which policies a run may name, and what each serves, without torch: the coordinator validates run specs and never
imports a model (a policy's module imports torch).

``POLICIES`` resolves ``policy.name`` (services/core/registry.py): core's own small models below, ``rlfabric.policies``
entry points (rlfabric's model families in services/policies are entry points of its own pyproject.toml, as a
plug-in's are of its package), or ``package.module:Class`` where the operator allows import paths. What a policy
serves (the interface an algorithm trains: ``serves`` on its class, the policy's own name by default;
services/core/policy.py) is read without importing it: from the table below for core's models, from the policy's
options model (``PolicyOptions.serves``, services/core/options.py) for a registered one; tests/unit/test_registry.py
holds both to the classes. Otherwise it is read from the class where torch is loaded already (the learner and the
rollout, which check every spec they are given).
"""

from __future__ import annotations

import sys

from rlfabric.services.core.options import POLICY_OPTIONS
from rlfabric.services.core.registry import Registry

BUILTINS = {  # name: (class, what it serves): core's own models
    "actor_critic": ("rlfabric.services.core.models.actor_critic:ActorCritic", "actor_critic"),
    "squashed_gaussian": ("rlfabric.services.core.models.squashed_gaussian:SquashedGaussianActor", "squashed_gaussian"),
    "advantage_conditioned": ("rlfabric.services.core.models.advantage_conditioned:AdvantageConditionedActor",
                              "advantage_conditioned"),
    "causal_lm": ("rlfabric.services.core.models.lm:CausalLMPolicy", "causal_lm"),  # imported when used: transformers
    "causal_lm_value": ("rlfabric.services.core.models.lm:CausalLMValuePolicy", "causal_lm_value"),
}


def check_policy_class(value) -> None:
    """A policy is a torch module class, built with the env's spec and the policy section: checked when a worker
    loads it and before that call, so a name that resolves to another callable (``os:system``) is never called."""
    if not isinstance(value, type):
        raise ValueError("a policy is a class (a torch.nn.Module subclass)")
    torch = sys.modules.get("torch")
    if torch is not None and not issubclass(value, torch.nn.Module):
        raise ValueError("a policy is a torch.nn.Module subclass")


POLICIES = Registry("policies", "policy.name", {name: target for name, (target, _) in BUILTINS.items()},
                    home="services/core/models (core's small models), or a module of services/policies listed as an "
                         "entry point in rlfabric's pyproject.toml (model families)",
                    noun="policy", check=check_policy_class)


def register_policy(name: str):
    """In this process only (tests, a notebook). Its options section comes from an installed package's
    ``rlfabric.policy_options`` entry point: the schema reads those when it loads."""
    def wrap(cls):
        POLICIES.register(name, cls)
        return cls

    return wrap


def policy_class(name: str) -> type:
    return POLICIES.load(name)


def options_model(name: str) -> type | None:
    """The options model of policy ``name`` (its ``policy.<name>`` section), or None when it registers none."""
    return POLICY_OPTIONS.load(name) if name in POLICY_OPTIONS else None


def serves(name: str) -> str | None:
    """What policy ``name`` serves; None where telling would import torch into a process that has none."""
    target = POLICIES.target(name)  # (its errors name policy.name)
    if name in BUILTINS and BUILTINS[name][0] == target:
        return BUILTINS[name][1]
    options = options_model(name)
    if options is not None and getattr(options, "serves", None):
        return options.serves
    if "torch" not in sys.modules:
        return None
    return getattr(policy_class(name), "serves", name)


def check_policy(name: str, needed: str, who: str) -> None:
    """A policy chosen by name (``policy.name``) must serve the interface ``who`` trains (``serves``: e.g. the
    chunk policy serves as an actor_critic: act, evaluate, value). Its errors name policy.name."""
    got = serves(name)
    if got is not None and got != needed:
        raise ValueError(f"policy.name={name!r} serves as {got!r}, but {who} trains a {needed!r} policy. Fix: "
                         f"choose a policy that serves {needed!r}, or leave policy.name empty")


__all__ = ["BUILTINS", "POLICIES", "check_policy", "options_model", "policy_class", "register_policy", "serves"]
