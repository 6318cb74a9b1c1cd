"""Models shared by the learner (which trains them) and the rollout (which acts with them), by registered name.

An algorithm spec names the policy it needs (``policy = "actor_critic"``); ``build_policy`` makes it for an env's
observation and action spaces and the run's ``policy`` config section. ``policy.name`` resolves through POLICIES
(services/core/registry.py): the built-ins below, ``rlfabric.policies`` entry points, or ``package.module:Class``.
"""

from __future__ import annotations

from typing import Any

from services.core.models.actor_critic import ActorCritic
from services.core.models.encoders import build_encoder, is_privileged
from services.core.models.mlp import mlp
from services.core.models.squashed_gaussian import SquashedGaussianActor
from services.core.registry import Registry

POLICIES = Registry("policies", "policy.name", {
    "actor_critic": "services.core.models.actor_critic:ActorCritic",
    "squashed_gaussian": "services.core.models.squashed_gaussian:SquashedGaussianActor",
    "causal_lm": "services.core.models.lm:CausalLMPolicy",  # imported when used: it needs transformers
    "causal_lm_value": "services.core.models.lm:CausalLMValuePolicy",
    "vla": "services.core.models.vla:VLAPolicy",
    "pi0": "services.policies.pi0:PI0Policy",  # transformers' PI0ForConditionalGeneration
    "vla_tokens": "services.policies.vla_tokens:VLATokensPolicy",  # a transformers VLM, actions as tokens
    "vlm": "services.policies.vlm_text:VLMTextPolicy",  # a transformers VLM writing text about its images
}, home="services/core/models", noun="policy")


def register_policy(name: str):
    def wrap(cls):
        POLICIES.register(name, cls)
        return cls

    return wrap


def policy_class(name: str) -> type:
    return POLICIES.load(name)


def check_policy(name: str, needed: str, who: str) -> None:
    """A policy chosen by name (``policy.name``) must serve the interface ``who`` trains (``serves``: e.g. the
    VLA policy serves as an actor_critic: act, evaluate, value)."""
    cls = policy_class(name)  # its errors name policy.name
    serves = getattr(cls, "serves", name)
    if serves != needed:
        raise ValueError(f"policy.name={name!r} serves as {serves!r}, but {who} trains a {needed!r} policy. Fix: "
                         f"choose a policy that serves {needed!r}, or leave policy.name empty")


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
