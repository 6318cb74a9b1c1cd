"""RECAP, RL with Experience and Corrections via Advantage-conditioned Policies (Physical Intelligence, pi*0.6,
2025), offline: learns from a stored data set with no rollout collecting. A value model labels every transition as
an improvement over the data's average behaviour or not, and the policy is behaviour-cloned on all the data with
that label as an extra input; acting asks for "improvement" with classifier-free guidance.

Value model: TD, not Monte-Carlo. A data set is a ("sample",) batch of transitions (obs, actions, rewards,
next_obs, terminated; ``rlfabric collect`` also writes ``truncated`` and per-row ``episode`` ids, rows in step
order), and an offline algorithm reads it as uniform samples of single rows (sequence windows need ("time", ...)
batches), so no minibatch holds an episode's rest and returns-to-go cannot be summed. V is fitted by TD(0) on the
data's own transitions (in-sample: it never queries an action outside the data) and the advantage is the one-step
one. The paper fits a distributional value on Monte-Carlo returns of whole episodes and picks a threshold per task;
here the threshold is a quantile per minibatch:

    value:      L_V = E[(V(s) - (r + gamma * (1 - terminated) * V'(s')))^2]       V ~ V^beta, the data's own value
    target:     V' <- polyak * V + (1 - polyak) * V'
    advantage:  A = r + gamma * (1 - terminated) * V(s') - V(s)                      (one-step; = Q^beta(s,a) - V^beta(s)
                                                                                     in a deterministic env)
    indicator:  I = 1[A > q],  q = the (1 - positive_fraction) quantile of A over the minibatch
                (so about ``positive_fraction`` of every minibatch is labelled "improving", as the paper's threshold
                per task labels ~30% of the data)
    dropout:    I <- NULL with probability indicator_dropout  (one network: pi(a|s, I) and pi(a|s) = pi(a|s, NULL))
    policy:     L_pi = -E[log pi(a | s, I)]                                           (behaviour cloning, all data)
    acting:     mu_w(s) = mu(s, NULL) + w * (mu(s, 1) - mu(s, NULL)),  w = guidance
                (services/core/models/advantage_conditioned.py; w = 1: pi(a|s, I=1); w > 1 extrapolates)

Truncated episodes (time limits) are bootstrapped through V(s') as a non-terminal step. The first
``value_warmup_updates`` steps train V alone, so the labels the policy first sees come from a value that has begun
to fit. The guidance weight lives in the policy (a buffer of its state dict, set here from the config): every
checkpoint and weight version carries it, so ``rlfabric eval`` and the rollout act with it. Actions are the
policy's own (squashed into [-1, 1]), as ``rlfabric collect`` records them.
"""

from __future__ import annotations

import copy
from typing import Literal

from pydantic import Field, model_validator

from rlfabric.services.core.algorithm import OfflineAlgorithm, OfflineConfig, register
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")
encoders = lazy_import("rlfabric.services.core.models.encoders")
mlp = lazy_import("rlfabric.services.core.models.mlp")
conditioned = lazy_import("rlfabric.services.core.models.advantage_conditioned")


class RECAPConfig(OfflineConfig):
    name: Literal["recap"] = "recap"
    learning_rate: float = Field(3e-4, gt=0, allow_inf_nan=False, description="Adam's step size (value and policy)")
    gamma: float = Field(0.99, gt=0, le=1, description="discount of the value's TD target and of the advantage")
    polyak: float = Field(0.005, gt=0, le=1, description="Polyak factor of the value's target network")
    value_hidden_sizes: list[int] = Field([256, 256], min_length=1, description="the value MLP's hidden widths")
    positive_fraction: float = Field(0.3, gt=0, lt=1, description="fraction of each minibatch labelled improving "
                                     "(I = 1): the threshold is the (1 - positive_fraction) quantile of A")
    indicator_dropout: float = Field(0.3, ge=0, lt=1, description="probability that a row's indicator is replaced "
                                     "by the NULL token in training (trains the unconditional policy too)")
    guidance: float = Field(1.0, ge=0, le=10, allow_inf_nan=False, description="w, the classifier-free guidance "
                            "weight the policy acts with: 0 unconditional, 1 conditioned on I = 1, > 1 extrapolated")
    value_warmup_updates: int = Field(1000, ge=0, description="gradient steps that train the value alone before "
                                      "the policy's first step (its labels come from a value that has begun to fit)")

    @model_validator(mode="after")
    def _warmup_leaves_policy_steps(self) -> RECAPConfig:
        if self.value_warmup_updates >= self.total_updates:
            raise ValueError(f"algorithm.value_warmup_updates={self.value_warmup_updates} leaves the policy no step "
                             f"of algorithm.total_updates={self.total_updates}. Fix: a warm-up below total_updates")
        if self.indicator_dropout == 0 and self.guidance != 1:
            raise ValueError(f"algorithm.guidance={self.guidance} needs the unconditional policy, which "
                             f"algorithm.indicator_dropout=0 never trains. Fix: indicator_dropout > 0, or guidance: 1")
        return self


def td_advantages(rewards: torch.Tensor, terminated: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
                  gamma: float) -> torch.Tensor:
    """A = r + gamma * (1 - terminated) * V(s') - V(s), per transition."""
    return rewards + gamma * (1.0 - terminated) * next_values - values


def improvement_indicator(advantages: torch.Tensor, positive_fraction: float) -> torch.Tensor:
    """I = 1[A > q], q the (1 - positive_fraction) quantile of ``advantages``: long tokens 0 / 1."""
    threshold = torch.quantile(advantages.float(), 1.0 - positive_fraction)
    return (advantages > threshold).long()


def drop_indicator(indicator: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each row's token replaced by NULL with probability p (the generator lives on the tokens' device)."""
    drop = torch.rand(indicator.shape, generator=generator, device=indicator.device) < p
    return torch.where(drop, torch.full_like(indicator, conditioned.NULL), indicator)


def value_model(obs_space: dict, policy_cfg, hidden_sizes: list[int]) -> nn.Module:
    """V(s): the run's observation encoder, an MLP of ``hidden_sizes`` (the policy's activation), one number per row."""
    encoder = encoders.build_encoder(obs_space, policy_cfg)
    return nn.Sequential(encoder, mlp.mlp([encoder.out_dim, *hidden_sizes], policy_cfg.activation, 1), nn.Flatten(0))


@register
class RECAP(OfflineAlgorithm):
    Config = RECAPConfig
    policy = "advantage_conditioned"

    def __init__(self, actor: nn.Module, run, generator: torch.Generator | None = None, **kw):
        super().__init__(actor, run, generator, **kw)
        cfg: RECAPConfig = self.cfg
        device = next(actor.parameters()).device
        self.value = value_model(self.env_spec["observation_space"], run.policy, cfg.value_hidden_sizes).to(device)
        self.value_target = copy.deepcopy(self.value)
        self.v_optimizer = torch.optim.Adam(self.value.parameters(), lr=cfg.learning_rate)
        self.actor_optimizer = torch.optim.Adam(actor.parameters(), lr=cfg.learning_rate)
        with torch.no_grad():
            actor.guidance.fill_(cfg.guidance)  # the policy acts with it wherever its weights go

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch."""
        return self.step_minibatches(batch)

    def step(self, b: dict) -> dict[str, float]:
        cfg: RECAPConfig = self.cfg
        obs, actions, rewards = b["obs"], b["actions"].float(), b["rewards"].float()
        next_obs, terminated = b["next_obs"], b["terminated"].float()
        with torch.no_grad():
            target = rewards + cfg.gamma * (1.0 - terminated) * self.value_target(next_obs)
        v = self.value(obs)
        v_loss = (v - target).pow(2).mean()
        self.v_optimizer.zero_grad(set_to_none=True)
        v_loss.backward()
        self.v_optimizer.step()
        for p, tp in zip(self.value.parameters(), self.value_target.parameters(), strict=True):
            tp.data.lerp_(p.data, cfg.polyak)
        stats = {"v_loss": v_loss.item(), "v_mean": v.mean().item()}

        if self.optimizer_steps >= cfg.value_warmup_updates:
            with torch.no_grad():
                advantage = td_advantages(rewards, terminated, self.value(obs), self.value(next_obs), cfg.gamma)
                indicator = improvement_indicator(advantage, cfg.positive_fraction)
                tokens = drop_indicator(indicator, cfg.indicator_dropout, self.generator)
            log_prob = self.policy.log_prob(obs, actions, tokens)
            actor_loss = -log_prob.mean()
            self.actor_optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_optimizer.step()
            stats |= {"actor_loss": actor_loss.item(), "advantage_mean": advantage.mean().item(),
                      "advantage_improving_mean": advantage[indicator == 1].mean().item(),
                      "indicator_rate": indicator.float().mean().item()}
        self.optimizer_steps += 1
        return stats

    def state_dict(self) -> dict:
        return {name: getattr(self, name).state_dict() for name in (
            "value", "value_target", "v_optimizer", "actor_optimizer")} | {"optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        for name in ("value", "value_target", "v_optimizer", "actor_optimizer"):
            getattr(self, name).load_state_dict(state[name])
        self.optimizer_steps = int(state["optimizer_steps"])
