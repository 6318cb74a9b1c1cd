"""What a policy is, as Protocols (torch-free: annotations only). Every service that builds a policy reads it
through these, never by probing for attribute names.

A policy is a ``torch.nn.Module`` class built as ``cls(obs_space, action_space, policy_config)`` (the env's spaces
as dicts, the run's ``policy`` section, whose ``policy.<name>`` is its own options: services/core/options.py). It
is registered by name (``rlfabric.policies``, services/core/policy_names.py) and

- is a ``Policy``: the members every service uses;
- serves one interface (its class's ``serves``, by default its own name), which the algorithms that train it
  use: ``INTERFACES`` maps the names algorithms declare to their Protocols, and ``build_policy`` checks a built
  policy against the one it serves;
- may have optional capabilities, each a small runtime-checkable Protocol below: a service asks
  ``isinstance(policy, Capability)`` and uses what the capability declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch


@runtime_checkable
class Policy(Protocol):
    """Every policy: a torch module (its state dict is what weight versions and checkpoints carry)."""

    has_value: bool  # whether it gives state values (``value``; the rollout records them for its algorithm)

    def parameters(self, recurse: bool = True) -> Any: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any: ...


@runtime_checkable
class Acting(Policy, Protocol):
    """A policy the torch backend acts with for a batch of observations (gym stepping)."""

    def act(self, obs: Any, deterministic: bool = False, generator: torch.Generator | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(raw actions as recorded, their log-probs, state values or zeros), without gradients."""
        ...

    def env_actions(self, actions: torch.Tensor) -> np.ndarray:
        """What the env executes for raw actions (ids, clipped or rescaled Box actions, chunks)."""
        ...


@runtime_checkable
class ActorCriticPolicy(Acting, Protocol):
    """``serves = "actor_critic"``: policy-gradient algorithms with a critic, and imitation before them."""

    def evaluate(self, obs: Any, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probs, entropy, values) of given raw actions, differentiable."""
        ...

    def value(self, obs: Any) -> torch.Tensor: ...


@runtime_checkable
class SquashedGaussianPolicy(Acting, Protocol):
    """``serves = "squashed_gaussian"``: off-policy and offline continuous control."""

    def sample(self, obs: Any, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions in [-1, 1] and their log-probs, differentiable."""
        ...

    def log_prob(self, obs: Any, actions: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class AdvantageConditionedPolicy(Acting, Protocol):
    """``serves = "advantage_conditioned"``: continuous control conditioned on an improvement indicator (an
    advantage label); it acts with guidance toward the indicator's "improving" value."""

    def log_prob(self, obs: Any, actions: torch.Tensor, indicator: torch.Tensor | None = None) -> torch.Tensor:
        """log pi(a|s, I) (I None: the unconditional policy), differentiable."""
        ...


@runtime_checkable
class FlowChainPolicy(Acting, Protocol):
    """``serves = "flow_chain"``: off-policy continuous control with a sampled, differentiable action chain (its
    log-likelihood is the chain's, so it has no ``log_prob`` of an action alone)."""

    def sample(self, obs: Any, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions in [-1, 1] and their log-probs, differentiable."""
        ...


@runtime_checkable
class SteeredNoisePolicy(Acting, Protocol):
    """``serves = "steered_noise"``: off-policy control in the initial noise of a frozen flow policy (its ``base``, a
    ``DecodesNoise``): it samples a latent w, the base decodes it into the action. A recorded action holds the
    latent and the decoded action both, so the env needs no observation to execute it."""

    act_dim: int  # the latent's width: what critics read
    base: Any  # the frozen flow policy (a DecodesNoise): its algorithm loads its weights
    actor: Any  # the latent's own actor: what trains

    def sample(self, obs: Any, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised latents in [-1, 1] and their log-probs, differentiable."""
        ...

    def latent(self, actions: torch.Tensor) -> torch.Tensor:
        """The latent part [B, act_dim] of recorded actions."""
        ...


@runtime_checkable
class CausalLMPolicyProtocol(Policy, Protocol):
    """``serves = "causal_lm"``: a language model the LM backends (hf, vllm, sglang) serve."""

    def token_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor, *args: Any,
                       **kwargs: Any) -> torch.Tensor: ...

    def shared_prompt_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor, prefix: torch.Tensor,
                               *args: Any, **kwargs: Any) -> torch.Tensor: ...


@runtime_checkable
class CausalLMValuePolicyProtocol(CausalLMPolicyProtocol, Protocol):
    """``serves = "causal_lm_value"``: the language model with a value head (a critic over tokens)."""

    def token_logprobs_values(self, tokens: torch.Tensor, attention_mask: torch.Tensor, *args: Any,
                              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


INTERFACES: dict[str, type] = {  # what ``serves`` names -> what the algorithms that train it call
    "actor_critic": ActorCriticPolicy,
    "squashed_gaussian": SquashedGaussianPolicy,
    "advantage_conditioned": AdvantageConditionedPolicy,
    "flow_chain": FlowChainPolicy,
    "steered_noise": SteeredNoisePolicy,
    "causal_lm": CausalLMPolicyProtocol,
    "causal_lm_value": CausalLMValuePolicyProtocol,
}


# -- optional capabilities --------------------------------------------------------------------------------------
@runtime_checkable
class DrawsRandomActions(Protocol):
    """Draws its own uniform actions (off-policy warm-up, ``rlfabric collect --random``) where its action form is no
    flat vector (a chunk, token ids); others get uniform ids or Box vectors from ``FlatActions``."""

    def random_actions(self, n: int, generator: torch.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(recorded, executed) actions for ``n`` envs."""
        ...


@runtime_checkable
class FlatActions(Protocol):
    """Acts in a flat Discrete (``act_dim`` ids) or Box (``act_dim`` values in [-1, 1] before ``env_actions``)
    space: uniform actions are drawn for it."""

    discrete: bool
    act_dim: int


@runtime_checkable
class DecodesNoise(Protocol):
    """A flow policy whose denoising ODE, started from a given initial noise, is a deterministic map from noise to
    action (deterministic acting starts it from zero): a latent-noise policy steers it. ``act_dim`` is the noise's
    width."""

    act_dim: int

    def decode_noise(self, obs: Any, noise: torch.Tensor) -> torch.Tensor:
        """The chunks in [-1, 1] [B, H, A] the ODE carries ``noise`` [B, act_dim] to, without gradients."""
        ...

    def to_env(self, unit: torch.Tensor) -> np.ndarray:
        """Chunks in [-1, 1] onto the env's action bounds and shape."""
        ...


@runtime_checkable
class Imitates(Protocol):
    """Learns from demonstrations (supervised warm starts): its own loss on demonstrated env actions."""

    def imitation_loss(self, obs: Any, actions: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class OwnCritic(Protocol):
    """Names the modules that are its critic's alone (the encoder may be shared): an algorithm may step them at a
    rate of their own, and a warm start may bring another critic than the run's."""

    value_modules: tuple[str, ...]


@runtime_checkable
class ShardUnits(Protocol):
    """Splits into FSDP units (each one all-gather group: an LM's decoder layers) on a learner of N ranks."""

    def shard_units(self) -> list[torch.nn.Module]: ...


@runtime_checkable
class ForwardMethods(Protocol):
    """Entry points besides ``forward()`` that a sharded learner calls (they gather the weights too)."""

    forward_methods: tuple[str, ...]


@runtime_checkable
class SavesPretrained(Protocol):
    """Exports itself for its library (``checkpoints/hf/``: transformers' ``save_pretrained``)."""

    def save_pretrained(self, directory: str) -> None: ...


@runtime_checkable
class PrivilegedCritic(Protocol):
    """Its critic alone reads an env's privileged observation entries (``critic_only_privileged = True`` on the
    class): ``build_policy`` refuses such an env for every other policy, so no actor learns from state a robot
    lacks. Asked of the class, before it is built."""

    critic_only_privileged: ClassVar[bool]


def reads_privileged(cls: type) -> bool:
    return isinstance(cls, PrivilegedCritic) and bool(cls.critic_only_privileged)


__all__ = ["Acting", "ActorCriticPolicy", "AdvantageConditionedPolicy", "CausalLMPolicyProtocol",
           "CausalLMValuePolicyProtocol", "DecodesNoise", "DrawsRandomActions", "FlatActions", "FlowChainPolicy", "ForwardMethods", "INTERFACES",
           "Imitates", "OwnCritic", "Policy", "PrivilegedCritic", "SavesPretrained", "ShardUnits",
           "SquashedGaussianPolicy", "SteeredNoisePolicy", "reads_privileged"]
