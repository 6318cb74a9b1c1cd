"""Which policies a run may name, and what each serves, without torch: the coordinator validates run specs and never
imports a model (a policy's module imports torch).

``POLICIES`` resolves ``policy.name`` (services/core/registry.py): the built-ins below, ``rlfabric.policies`` entry
points, or ``package.module:Class`` where the operator allows import paths. What a built-in serves (the interface an
algorithm trains: ``serves`` on its class, the policy's own name by default) is written here too, so checking a spec
imports nothing; tests/unit/test_registry.py holds the table to the classes. A plug-in's is read from its class
where torch is loaded already (the learner and the rollout, which check every spec they are given).
"""

from __future__ import annotations

import sys

from rlfabric.services.core.registry import Registry

BUILTINS = {  # name: (class, what it serves)
    "actor_critic": ("rlfabric.services.core.models.actor_critic:ActorCritic", "actor_critic"),
    "squashed_gaussian": ("rlfabric.services.core.models.squashed_gaussian:SquashedGaussianActor", "squashed_gaussian"),
    "causal_lm": ("rlfabric.services.core.models.lm:CausalLMPolicy", "causal_lm"),  # imported when used: transformers
    "causal_lm_value": ("rlfabric.services.core.models.lm:CausalLMValuePolicy", "causal_lm_value"),
    "vla": ("rlfabric.services.policies.vla:VLAPolicy", "actor_critic"),
    "pi0": ("rlfabric.services.policies.pi0:PI0Policy", "actor_critic"),  # transformers' PI0ForConditionalGeneration
    "vla_tokens": ("rlfabric.services.policies.vla_tokens:VLATokensPolicy", "actor_critic"),  # a VLM, actions as tokens
    "vlm": ("rlfabric.services.policies.vlm_text:VLMTextPolicy", "actor_critic"),  # a VLM writing text about its images
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
                    home="services/core/models", noun="policy", check=check_policy_class)


def register_policy(name: str):
    def wrap(cls):
        POLICIES.register(name, cls)
        return cls

    return wrap


def policy_class(name: str) -> type:
    return POLICIES.load(name)


def serves(name: str) -> str | None:
    """What policy ``name`` serves; None where telling would import torch into a process that has none."""
    target = POLICIES.target(name)  # (its errors name policy.name)
    if name in BUILTINS and BUILTINS[name][0] == target:
        return BUILTINS[name][1]
    if "torch" not in sys.modules:
        return None
    return getattr(policy_class(name), "serves", name)


def check_policy(name: str, needed: str, who: str) -> None:
    """A policy chosen by name (``policy.name``) must serve the interface ``who`` trains (``serves``: e.g. the
    VLA policy serves as an actor_critic: act, evaluate, value). Its errors name policy.name."""
    got = serves(name)
    if got is not None and got != needed:
        raise ValueError(f"policy.name={name!r} serves as {got!r}, but {who} trains a {needed!r} policy. Fix: "
                         f"choose a policy that serves {needed!r}, or leave policy.name empty")


__all__ = ["BUILTINS", "POLICIES", "check_policy", "policy_class", "register_policy", "serves"]
