"""CrossQ (Bhatt et al., ICLR 2024): SAC without target networks. The critics are batch-renormalised
(``rlfabric.services.core.models.batch_renorm``), and each critic step forwards (s, a) and (s', a') as ONE batch
in training mode, so the normalisation statistics cover both halves; the halves are split after the forward.

    a' ~ pi(s'),  [Q_j(s, a); Q_j(s', a')] = Q_j([s; s'], [a; a'])       (joint forward, train mode, j = 1, 2)
    critic:  y = r + gamma * (1 - terminated) * (min_j sg(Q_j(s', a')) - alpha * log pi(a'|s'))   (sg: no gradient)
             L_Q = sum_j E[(Q_j(s, a) - y)^2]
    actor:   every ``policy_delay`` critic steps, critics in eval mode (running statistics):
             L_pi = E[alpha * log pi(a|s) - min_j Q_j(s, a)],  a ~ pi(s) (reparameterised)
    alpha:   L_alpha = E[-log alpha * (log pi(a|s) + target_entropy)]   (with the actor's step)

Adam with beta1 = ``adam_beta1`` (0.5 in the paper) for critics, actor and temperature. Everything else is SAC's
(``sac.py``): the squashed-Gaussian actor, the target formula, the temperature, the replay access (uniform samples
of the window, ``updates_per_env_step`` gradient steps per env step after ``learning_starts``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import AlgorithmConfig, register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.sac import SAC, critic_target

torch = lazy_import("torch")
critics = lazy_import("rlfabric.services.core.models.critics")
batch_renorm = lazy_import("rlfabric.services.core.models.batch_renorm")


class CrossQConfig(AlgorithmConfig):
    name: Literal["crossq"] = "crossq"
    n_steps: int = Field(32, ge=1, le=1_000_000,
                         description="steps per env per iteration (one epoch: collect, then update)")
    batch_size: int = Field(256, ge=1, description="minibatch size sampled from the replay window")
    learning_rate: float = Field(1e-3, gt=0, allow_inf_nan=False, description="Adam's step size (critics, actor, temperature)")
    adam_beta1: float = Field(0.5, ge=0, lt=1, description="Adam's beta1 (0.5 in the paper: BN critics move fast)")
    gamma: float = Field(0.99, gt=0, le=1, description="discount of the TD target")
    learning_starts: int = Field(5000, ge=0, description="env steps of uniform random actions before updates")
    updates_per_env_step: float = Field(1.0, gt=0, le=64, description="gradient steps per env step collected")
    policy_delay: int = Field(3, ge=1, le=1000, description="critic steps per actor (and temperature) step")
    ent_coef: float | Literal["auto"] = Field("auto", description="entropy weight alpha, or auto-tuned")
    target_entropy: float | None = Field(None, allow_inf_nan=False, description="auto alpha target; default -action_dim")
    critic_hidden_sizes: list[int] = Field([2048, 2048], min_length=1, max_length=8,
                                           description="hidden widths of each critic (2048 x 2 in the paper)")
    brn_momentum: float = Field(0.99, gt=0, lt=1, description="BatchRenorm's running-statistics momentum")
    brn_warmup_steps: int = Field(100_000, ge=0, description="critic steps of plain BatchNorm (r_max=1, d_max=0) "
                                                             "before BatchRenorm's r_max, d_max apply")
    brn_r_max: float = Field(3.0, ge=1, description="BatchRenorm's bound on r = sigma_B / sigma after warm-up")
    brn_d_max: float = Field(5.0, ge=0, description="BatchRenorm's bound on d = (mu_B - mu) / sigma after warm-up")


def cat(a, b):
    """[a; b] along the batch dimension (per key of a Dict observation)."""
    if isinstance(a, dict):
        return {k: cat(a[k], b[k]) for k in a}
    return torch.cat([a, b], 0)


@register
class CrossQ(SAC):
    Config = CrossQConfig
    SAVED = ("q1", "q2", "q_optimizer", "actor_optimizer")  # no target networks

    def adam(self, params, betas: tuple[float, float] | None = None):
        return super().adam(params, betas=betas or (self.cfg.adam_beta1, 0.999))

    def build_critics(self, device: torch.device) -> None:
        """Twin batch-renormalised critics and their optimiser; no targets."""
        cfg: CrossQConfig = self.cfg
        obs_space = self.env_spec.get("observation_space", {"kind": "box", "shape": [self.actor.obs_dim]})
        brn = {"momentum": cfg.brn_momentum, "warmup_steps": cfg.brn_warmup_steps, "r_max": cfg.brn_r_max,
               "d_max": cfg.brn_d_max}
        self.q1, self.q2 = (batch_renorm.RenormQNetwork(obs_space, self.actor.act_dim, self.run.policy,
                                                        cfg.critic_hidden_sizes, **brn).to(device) for _ in range(2))
        self.q_optimizer = self.adam([*self.q1.parameters(), *self.q2.parameters()])
        self.last_actor = {"actor_loss": float("nan"), "entropy": float("nan")}  # (until the first actor step)

    def step(self, b: dict) -> dict[str, float]:
        cfg: CrossQConfig = self.cfg
        obs, actions, rewards = b["obs"], b["actions"].float(), b["rewards"].float()
        next_obs, terminated = b["next_obs"], b["terminated"].float()
        alpha = self.log_alpha.exp().item()
        with torch.no_grad():
            next_actions, next_logp = self.actor.sample(next_obs, self.generator)
        both_obs, both_actions = cat(obs, next_obs), torch.cat([actions, next_actions], 0)
        q1, next_q1 = self.q1(both_obs, both_actions).chunk(2)  # one train-mode forward: BRN sees s and s'
        q2, next_q2 = self.q2(both_obs, both_actions).chunk(2)
        y = critic_target(rewards, terminated, next_q1.detach(), next_q2.detach(), next_logp, cfg.gamma, alpha)
        q_loss = (q1 - y).pow(2).mean() + (q2 - y).pow(2).mean()
        self.q_optimizer.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_optimizer.step()
        self.optimizer_steps += 1

        if self.optimizer_steps % cfg.policy_delay == 0:
            self.q1.eval(), self.q2.eval()  # the actor climbs the critics at their running statistics
            new_actions, logp = self.actor.sample(obs, self.generator)
            with critics.frozen(self.q1, self.q2):
                q_new = torch.min(self.q1(obs, new_actions), self.q2(obs, new_actions))
            actor_loss = (alpha * logp - q_new).mean()
            self.actor_optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_optimizer.step()
            self.q1.train(), self.q2.train()
            self.alpha_step(logp)
            self.last_actor = {"actor_loss": actor_loss.item(), "entropy": -logp.mean().item()}
        return {"q_loss": q_loss.item(), "alpha": alpha, "q_mean": q1.mean().item(), **self.last_actor}


__all__ = ["CrossQ", "CrossQConfig"]
