"""SAC (Haarnoja et al. 2018), continuous actions, twin critics, target critics, auto-tuned entropy, as CleanRL
writes it. Off-policy: the learner samples minibatches from the replay window instead of consuming each batch
once, ``updates_per_env_step`` gradient steps per env step collected.

    critic:  y = r + gamma * (1 - terminated) * (min_j Q'_j(s', a') - alpha * log pi(a'|s')),  a' ~ pi(s')
             L_Q = sum_j E[(Q_j(s, a) - y)^2]
    actor:   L_pi = E[alpha * log pi(a|s) - min_j Q_j(s, a)],  a ~ pi(s) (reparameterised)
    alpha:   L_alpha = E[-log alpha * (log pi(a|s) + target_entropy)]
    targets: Q'_j <- tau * Q_j + (1 - tau) * Q'_j

Actions are the actor's squashed actions in [-1, 1] (the replay stores them so); ``terminated`` (not truncated)
stops bootstrapping: a time limit is not a terminal state.
"""

from __future__ import annotations

import copy
from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import Algorithm, AlgorithmConfig, DataAccess, Trajectory, register
from rlfabric.services.core.lazy import lazy_import

torch = lazy_import("torch")
nn = lazy_import("torch.nn")
critics = lazy_import("rlfabric.services.core.models.critics")
optim = lazy_import("rlfabric.services.learner.optim")


class SACConfig(AlgorithmConfig):
    name: Literal["sac"] = "sac"
    n_steps: int = Field(32, ge=1, le=1_000_000,
                         description="steps per env per iteration (one epoch: collect, then update)")
    batch_size: int = Field(256, ge=1, description="minibatch size sampled from the replay window")
    learning_rate: float = Field(3e-4, gt=0, allow_inf_nan=False, description="Adam's step size (critics, actor, temperature)")
    gamma: float = Field(0.99, gt=0, le=1, description="discount of the TD target")
    tau: float = Field(0.005, gt=0, le=1, description="Polyak factor of the target critics")
    learning_starts: int = Field(1000, ge=0, description="env steps of uniform random actions before updates")
    updates_per_env_step: float = Field(1.0, gt=0, le=64, description="gradient steps per env step collected")
    ent_coef: float | Literal["auto"] = Field("auto", description="entropy weight alpha, or auto-tuned")
    target_entropy: float | None = Field(None, allow_inf_nan=False, description="auto alpha target; default -action_dim")


def critic_target(rewards: torch.Tensor, terminated: torch.Tensor, next_q1: torch.Tensor, next_q2: torch.Tensor,
                  next_logp: torch.Tensor, gamma: float, alpha: float) -> torch.Tensor:
    return rewards + gamma * (1.0 - terminated) * (torch.min(next_q1, next_q2) - alpha * next_logp)


@register
class SAC(Algorithm):
    Config = SACConfig
    policy = "squashed_gaussian"

    @classmethod
    def trajectory(cls, cfg: SACConfig) -> Trajectory:
        return Trajectory(fields=("obs", "actions", "rewards", "next_obs", "terminated"),
                          random_until_env_steps=cfg.learning_starts)

    @classmethod
    def data(cls, cfg: SACConfig) -> DataAccess:
        return DataAccess.uniform(cfg.batch_size)

    def __init__(self, actor: nn.Module, run, generator: torch.Generator | None = None, **kw):
        super().__init__(actor, run, generator, **kw)
        cfg: SACConfig = self.cfg
        self.actor = actor
        device = next(actor.parameters()).device
        self.build_critics(device)
        self.actor_optimizer = self.adam([p for p in actor.parameters() if p.requires_grad])  # (a frozen part stays)
        self.auto_alpha = cfg.ent_coef == "auto"
        self.target_entropy = cfg.target_entropy if cfg.target_entropy is not None else -float(actor.act_dim)
        self.log_alpha = torch.zeros(1, requires_grad=self.auto_alpha, device=device)
        if not self.auto_alpha:
            self.log_alpha.data.fill_(float(cfg.ent_coef)).log_()
        self.alpha_optimizer = self.adam([self.log_alpha]) if self.auto_alpha else None

    def adam(self, params, betas: tuple[float, float] = (0.9, 0.999)) -> optim.Adam:
        """torch's fused Adam update without torch.optim's import of torch._dynamo (learner/optim.py): one kernel
        per step, where the Python loop over tensors of torch.optim.Adam was ~14% of a step on 64x64 MLPs."""
        return optim.Adam(params, lr=self.cfg.learning_rate, betas=betas)

    def build_critics(self, device: torch.device) -> None:
        """Twin critics, their targets, and the critics' optimiser."""
        obs_space = self.env_spec.get("observation_space", {"kind": "box", "shape": [self.actor.obs_dim]})
        self.q1 = critics.QNetwork(obs_space, self.actor.act_dim, self.run.policy).to(device)
        self.q2 = critics.QNetwork(obs_space, self.actor.act_dim, self.run.policy).to(device)
        self.q1_target, self.q2_target = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        self.q_optimizer = self.adam([*self.q1.parameters(), *self.q2.parameters()])

    def updates_for(self, env_steps: int) -> int:
        """Gradient steps owed for ``env_steps`` more env steps (none before learning_starts)."""
        self.env_steps += env_steps
        if self.env_steps < self.cfg.learning_starts:
            return 0
        return max(1, round(self.cfg.updates_per_env_step * env_steps))

    def update(self, batch: dict) -> dict[str, float]:
        """One gradient step per minibatch: tensors are [U, B, ...] (U minibatches of B transitions)."""
        return self.step_minibatches(batch)

    def step(self, b: dict) -> dict[str, float]:
        obs, actions, rewards = b["obs"], self.critic_actions(b["actions"]), b["rewards"].float()
        next_obs, terminated = b["next_obs"], b["terminated"].float()
        alpha = self.log_alpha.exp().item()
        with torch.no_grad():
            next_actions, next_logp = self.actor.sample(next_obs, self.generator)
            y = critic_target(rewards, terminated, self.q1_target(next_obs, next_actions),
                              self.q2_target(next_obs, next_actions), next_logp, self.cfg.gamma, alpha)
        q1, q2 = self.q1(obs, actions), self.q2(obs, actions)
        q_loss = (q1 - y).pow(2).mean() + (q2 - y).pow(2).mean()
        self.q_optimizer.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_optimizer.step()

        new_actions, logp = self.actor.sample(obs, self.generator)
        with critics.frozen(self.q1, self.q2):
            q_new = torch.min(self.q1(obs, new_actions), self.q2(obs, new_actions))
        actor_loss = (alpha * logp - q_new).mean()
        self.actor_optimizer.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_optimizer.step()

        self.alpha_step(logp)
        critics.soft_update(self.q1_target, self.q1, self.cfg.tau)
        critics.soft_update(self.q2_target, self.q2, self.cfg.tau)
        self.optimizer_steps += 1
        return {"q_loss": q_loss.item(), "actor_loss": actor_loss.item(), "alpha": alpha,
                "q_mean": q1.mean().item(), "entropy": -logp.mean().item()}

    def critic_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """What the critics read of recorded actions: all of them (the squashed actions the actor samples)."""
        return actions.float()

    def alpha_step(self, logp: torch.Tensor) -> None:
        """The temperature's gradient step (auto-tuned alpha only) on the actor's log-probs."""
        if self.auto_alpha:
            alpha_loss = (-self.log_alpha * (logp.detach() + self.target_entropy)).mean()
            self.alpha_optimizer.zero_grad(set_to_none=True)
            alpha_loss.backward()
            self.alpha_optimizer.step()

    SAVED = ("q1", "q2", "q1_target", "q2_target", "q_optimizer", "actor_optimizer")  # state_dict()'s modules

    def state_dict(self) -> dict:
        return {**{name: getattr(self, name).state_dict() for name in self.SAVED},
                "log_alpha": self.log_alpha.detach().clone(),
                "alpha_optimizer": self.alpha_optimizer.state_dict() if self.alpha_optimizer else {},
                "env_steps": self.env_steps, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        for name in self.SAVED:
            getattr(self, name).load_state_dict(state[name])
        self.log_alpha.data.copy_(state["log_alpha"])
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.env_steps = int(state["env_steps"])
        self.optimizer_steps = int(state["optimizer_steps"])
