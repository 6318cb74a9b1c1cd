"""Models shared by the learner (which trains them) and the rollout (which acts with them), by registered name.

An algorithm spec names the policy it needs (``policy = "actor_critic"``); ``build_policy`` makes it for an env's
observation and action spaces and the run's ``policy`` config section. ``policy.name`` resolves through POLICIES
(services/core/policy_names.py, torch-free): the built-ins, ``rlfabric.policies`` entry points, or
``package.module:Class``.
"""

from __future__ import annotations

from typing import Any

from rlfabric.services.core.models.actor_critic import ActorCritic
from rlfabric.services.core.models.encoders import build_encoder, is_privileged
from rlfabric.services.core.models.mlp import mlp
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.core.policy_names import POLICIES, check_policy, policy_class, register_policy


def build_policy(name: str, env_spec: dict[str, Any], policy_config: Any):
    cls = policy_class(name)
    obs_space = env_spec["observation_space"]
    hidden = sorted(k for k in obs_space.get("spaces", {}) if is_privileged(k)) if obs_space.get("kind") == "dict" \
        else []
    if hidden and not getattr(cls, "critic_only_privileged", False):
        raise ValueError(f"the env observes {hidden}, privileged state for a critic alone, and policy.name {name!r} "
                         f"would feed it to its actor. Fix: turn the env's privileged observation off, or use a "
                         f"policy whose critic alone reads it (pi0 or vla_tokens with policy.<name>.critic: own)")
    return cls(obs_space, env_spec["action_space"], policy_config)


__all__ = ["ActorCritic", "POLICIES", "SquashedGaussianActor", "build_encoder", "build_policy", "check_policy", "mlp",
           "policy_class", "register_policy"]
