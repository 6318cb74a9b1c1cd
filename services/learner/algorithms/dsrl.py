"""DSRL (Wagenmaker et al. 2025, "Steering your diffusion policy with latent space reinforcement learning"): SAC
whose action is the initial noise of a frozen flow policy. The base's denoising ODE maps noise to an action chunk
deterministically, so choosing the noise per observation steers the base without changing a weight of it; RL only
has to learn a small actor over a low-dimensional, bounded latent.

    actor     w = b * tanh(u),  u ~ N(mu(s), sigma(s))             (policy latent_noise; b = noise_bound)
    env       chunk = ODE_base(s, x_0 = w)                          (the base's deterministic decoding, frozen)
    critic    y = r + gamma * (1 - terminated) * (min_j Q'_j(s', w') - alpha * log pi(w'|s')),  w' ~ pi(s')
              L_Q = sum_j E[(Q_j(s, w) - y)^2]                     (the critics read the latent: DSRL-SAC)
    actor     L_pi = E[alpha * log pi(w|s) - min_j Q_j(s, w)]
    alpha     L_alpha = E[-log alpha * (log pi(w|s) + target_entropy)]

Everything but the action space is SAC's (sac.py). The base is the learner's expert role: ``expert_checkpoint``, a
checkpoint of a flow policy (``policy.vla`` with head flow, ``policy.pi0``) whose policy section the run repeats,
loaded into the latent-noise policy's ``base`` once; weight versions carry it to the rollouts with the actor.
There is no uniform warm-up (a latent is decoded with the observation): the first ``learning_starts`` env steps act
with the untrained actor, whose latents spread over the base's prior.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import Roles, Trajectory, register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.sac import SAC, SACConfig

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class DSRLConfig(SACConfig):
    name: Literal["dsrl"] = "dsrl"  # type: ignore[assignment]
    expert_checkpoint: str = Field("", max_length=4096, description="checkpoint file of the frozen flow policy to "
                                   "steer (a run with the same env and the policy section this run repeats)")


@register
class DSRL(SAC):
    Config = DSRLConfig
    policy = "steered_noise"  # policy.name latent_noise
    roles = Roles(expert=True)

    @classmethod
    def trajectory(cls, cfg: DSRLConfig) -> Trajectory:
        return Trajectory(fields=("obs", "actions", "rewards", "next_obs", "terminated"))

    @classmethod
    def check(cls, run: Any) -> None:
        if not run.algorithm.expert_checkpoint:
            raise ValueError("algorithm.expert_checkpoint is empty: DSRL steers a frozen flow policy. Fix: set it to "
                             "a checkpoint file of a flow policy's run on the same env (e.g. a vla_sft run with "
                             "policy.vla.head: flow)")

    def __init__(self, actor: nn.Module, run: Any, generator: torch.Generator | None = None, **kw: Any):
        super().__init__(actor, run, generator, **kw)
        try:
            actor.base.load_state_dict(self.expert.state_dict())
        except RuntimeError as exc:
            raise ValueError(f"algorithm.expert_checkpoint holds another policy than policy.latent_noise.base builds "
                             f"from this run's policy section: {str(exc)[:300]}. Fix: repeat the checkpoint run's "
                             f"policy.{run.policy.latent_noise.base} section") from None
        self.expert = None  # its weights are the base's now (frozen: SAC's actor optimiser leaves it out)

    def critic_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """The latent tanh(u) of recorded [latent; chunk] actions."""
        return self.actor.latent(actions).float()


__all__ = ["DSRL", "DSRLConfig"]
