"""Models shared by the learner (which trains them) and the rollout (which acts with them), by registered name.

An algorithm spec names the policy it needs (``policy = "actor_critic"``); ``build_policy`` makes it for an env's
observation and action spaces and the run's ``policy`` config section. ``policy.name`` resolves through POLICIES
(services/core/policy_names.py, torch-free): core's models here, ``rlfabric.policies`` entry points (rlfabric's
model families and any installed package's), or ``package.module:Class``. What a built policy must provide is
services/core/policy.py's Protocols.
"""

from __future__ import annotations

from typing import Any

from rlfabric.services.core.models.actor_critic import ActorCritic
from rlfabric.services.core.models.encoders import build_encoder, is_privileged
from rlfabric.services.core.models.mlp import mlp
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.core.policy import INTERFACES, Policy, reads_privileged
from rlfabric.services.core.policy_names import POLICIES, check_policy, policy_class, register_policy
from rlfabric.services.core.registry import missing_members


def build_policy(name: str, env_spec: dict[str, Any], policy_config: Any):
    """Policy ``name`` built for the env, checked against the Protocol of the interface it serves."""
    cls = policy_class(name)
    obs_space = env_spec["observation_space"]
    hidden = sorted(k for k in obs_space.get("spaces", {}) if is_privileged(k)) if obs_space.get("kind") == "dict" \
        else []
    if hidden and not reads_privileged(cls):
        raise ValueError(f"the env observes {hidden}, privileged state for a critic alone, and policy.name {name!r} "
                         f"would feed it to its actor. Fix: turn the env's privileged observation off, or use a "
                         f"policy whose critic alone reads it (one that declares critic_only_privileged, e.g. a VLM "
                         f"policy with policy.<name>.critic: own)")
    policy = cls(obs_space, env_spec["action_space"], policy_config)
    serves = getattr(cls, "serves", name)
    interface = INTERFACES.get(serves, Policy)
    missing = missing_members(policy, interface)
    if missing:
        raise ValueError(f"policy.name {name!r}: {cls.__qualname__} serves {serves!r} and lacks {missing}, which "
                         f"such a policy provides (see {interface.__module__}.{interface.__qualname__})")
    return policy


__all__ = ["ActorCritic", "POLICIES", "SquashedGaussianActor", "build_encoder", "build_policy", "check_policy", "mlp",
           "policy_class", "register_policy"]
