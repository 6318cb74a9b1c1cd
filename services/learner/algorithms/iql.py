"""IQL, Implicit Q-Learning (Kostrikov et al. 2022), offline: learns from a stored data set with no rollout
collecting, as CORL writes it. The value function fits an upper expectile of the target critics' Q over the data's
own actions (no action outside the data is ever queried), the critics regress on it, and the policy is extracted
by advantage-weighted regression onto the data's actions.

    value:   L_V  = E[|tau - 1(u < 0)| * u^2],  u = min_j Q'_j(s, a) - V(s)         (expectile regression)
    critic:  L_Q  = sum_j E[(Q_j(s, a) - (r + gamma * (1 - terminated) * V(s')))^2]
    policy:  L_pi = -E[min(exp(beta * (min_j Q'_j(s, a) - V(s))), max_weight) * log pi(a|s)]
    targets: Q'_j <- polyak * Q_j + (1 - polyak) * Q'_j

Actions are the policy's own (squashed into [-1, 1]), as ``rlfabric collect`` records them.
"""

from __future__ import annotations

import copy
from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import OfflineAlgorithm, OfflineConfig, register
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")
critics = lazy_import("rlfabric.services.core.models.critics")


class IQLConfig(OfflineConfig):
    name: Literal["iql"] = "iql"
    learning_rate: float = Field(3e-4, gt=0, allow_inf_nan=False, description="Adam's step size (critics and actor)")
    gamma: float = Field(0.99, gt=0, le=1, description="discount of the TD target")
    polyak: float = Field(0.005, gt=0, le=1, description="Polyak factor of the target critics")
    expectile: float = Field(0.7, gt=0, lt=1, description="tau: the upper expectile V fits (0.5 = the mean)")
    beta: float = Field(3.0, ge=0, allow_inf_nan=False, description="inverse temperature of the advantage weights")
    max_weight: float = Field(100.0, gt=0, allow_inf_nan=False, description="advantage weights are clipped here")


def expectile_loss(diff: torch.Tensor, tau: float) -> torch.Tensor:
    """Asymmetric squared error: positive errors (Q above V) weigh tau, negative ones 1 - tau."""
    weight = torch.where(diff > 0, tau, 1 - tau)
    return (weight * diff.pow(2)).mean()


@register
class IQL(OfflineAlgorithm):
    Config = IQLConfig
    policy = "squashed_gaussian"

    def __init__(self, actor: nn.Module, run, generator: torch.Generator | None = None, **kw):
        super().__init__(actor, run, generator, **kw)
        cfg: IQLConfig = self.cfg
        device = next(actor.parameters()).device
        obs_space = self.env_spec["observation_space"]
        self.q1 = critics.QNetwork(obs_space, actor.act_dim, run.policy).to(device)
        self.q2 = critics.QNetwork(obs_space, actor.act_dim, run.policy).to(device)
        self.q1_target, self.q2_target = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        self.value = critics.ValueNetwork(obs_space, run.policy).to(device)
        self.q_optimizer = torch.optim.Adam([*self.q1.parameters(), *self.q2.parameters()], lr=cfg.learning_rate)
        self.v_optimizer = torch.optim.Adam(self.value.parameters(), lr=cfg.learning_rate)
        self.actor_optimizer = torch.optim.Adam(actor.parameters(), lr=cfg.learning_rate)

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch of a [U, B, ...] batch."""
        return self.step_minibatches(batch)

    def step(self, b: dict) -> dict[str, float]:
        cfg: IQLConfig = self.cfg
        obs, actions, rewards = b["obs"], b["actions"].float(), b["rewards"].float()
        next_obs, terminated = b["next_obs"], b["terminated"].float()
        with torch.no_grad():
            target_q = torch.min(self.q1_target(obs, actions), self.q2_target(obs, actions))
            next_v = self.value(next_obs)
        v = self.value(obs)
        advantage = target_q - v
        v_loss = expectile_loss(advantage, cfg.expectile)
        self.v_optimizer.zero_grad(set_to_none=True)
        v_loss.backward()
        self.v_optimizer.step()

        target = rewards + cfg.gamma * (1.0 - terminated) * next_v
        q1, q2 = self.q1(obs, actions), self.q2(obs, actions)
        q_loss = (q1 - target).pow(2).mean() + (q2 - target).pow(2).mean()
        self.q_optimizer.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_optimizer.step()

        weights = torch.exp(cfg.beta * advantage.detach()).clamp(max=cfg.max_weight)
        log_prob = self.policy.log_prob(obs, actions)
        actor_loss = -(weights * log_prob).mean()
        self.actor_optimizer.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_optimizer.step()

        critics.soft_update(self.q1_target, self.q1, cfg.polyak)
        critics.soft_update(self.q2_target, self.q2, cfg.polyak)
        self.optimizer_steps += 1
        return {"v_loss": v_loss.item(), "q_loss": q_loss.item(), "actor_loss": actor_loss.item(),
                "advantage_mean": advantage.mean().item(), "weight_mean": weights.mean().item(),
                "log_prob_mean": log_prob.mean().item(), "q_mean": q1.mean().item()}

    def state_dict(self) -> dict:
        return {name: getattr(self, name).state_dict() for name in (
            "q1", "q2", "q1_target", "q2_target", "value", "q_optimizer", "v_optimizer", "actor_optimizer")} | {
            "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        for name in ("q1", "q2", "q1_target", "q2_target", "value", "q_optimizer", "v_optimizer", "actor_optimizer"):
            getattr(self, name).load_state_dict(state[name])
        self.optimizer_steps = int(state["optimizer_steps"])
