"""RLPD, Reinforcement Learning with Prior Data (Ball et al., ICML 2023, "Efficient Online Reinforcement Learning
with Offline Data"): SAC learning online from scratch, with a small offline data set (demonstrations) mixed into
every minibatch, an ensemble of LayerNorm critics, and several critic steps per env step. No pre-training, no
behaviour-cloning term: the offline rows are just more transitions for the TD target.

    data:    each minibatch of B rows holds (1 - w) * B rows sampled uniformly from the online window and
             w * B from the offline source ("symmetric sampling": w = offline_weight = 0.5), in every minibatch
             (replay's stratified mix of named sources, DataAccess.mix; a fractional w * B rounds at random)
    critics: N critics Q_1..Q_N (num_critics), each hidden layer Linear -> LayerNorm -> ReLU (critics.QEnsemble),
             N target critics Q'_j
    target:  a' ~ pi(s'),  K = a random subset of M of the N indices (critic_subset, drawn anew per minibatch)
             y = r + gamma * (1 - terminated) * (min_{j in K} Q'_j(s', a') - alpha * log pi(a'|s'))
             (N = M = 2: the min over both, exactly SAC's target)
    critic:  L_Q = sum_j E[(Q_j(s, a) - y)^2]                      (every member on the same y)
    actor:   every ``policy_delay`` critic steps (default: once per env step, as RLPD's UTD loop):
             L_pi = E[alpha * log pi(a|s) - mean_j Q_j(s, a)],  a ~ pi(s) (reparameterised; the ensemble's mean,
             as RLPD and REDQ, not its min)
    alpha:   L_alpha = E[-log alpha * (log pi(a|s) + target_entropy)]   (with the actor's step; alpha starts at
             init_alpha)
    targets: Q'_j <- tau * Q_j + (1 - tau) * Q'_j                   (every critic step)
    UTD:     ``updates_per_env_step`` critic steps per env step collected, after ``learning_starts``

Everything else is SAC's (``sac.py``): the squashed-Gaussian actor, uniform random actions until learning_starts,
``terminated`` (not truncated) stops bootstrapping. With ``offline_weight: 0`` no offline source is read: the same
agent (ensemble, LayerNorm, UTD) without prior data, the baseline RLPD is measured against.
"""

from __future__ import annotations

import copy
from typing import Literal

from pydantic import Field, model_validator

from rlfabric.services.core.algorithm import DEFAULT_SOURCE, AlgorithmConfig, DataAccess, register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.sac import SAC, critic_target

torch = lazy_import("torch")
critics = lazy_import("rlfabric.services.core.models.critics")


class RLPDConfig(AlgorithmConfig):
    name: Literal["rlpd"] = "rlpd"
    n_steps: int = Field(32, ge=1, le=1_000_000,
                         description="steps per env per iteration (one epoch: collect, then update)")
    batch_size: int = Field(256, ge=2, le=1 << 16,
                            description="rows per critic step, online and offline together (paper: 256 = 128 + 128)")
    offline_weight: float = Field(0.5, ge=0, lt=1, allow_inf_nan=False,
                                  description="share of each minibatch from the offline source (0.5: symmetric "
                                              "sampling; 0: online only, no data set read)")
    offline_source: str = Field("offline", min_length=1, max_length=64,
                                description="the replay source of the prior data: a name in replay.datasets")
    learning_rate: float = Field(3e-4, gt=0, allow_inf_nan=False,
                                 description="Adam's step size (critics, actor, temperature; the paper's)")
    gamma: float = Field(0.99, gt=0, le=1, description="discount of the TD target")
    tau: float = Field(0.005, gt=0, le=1, description="Polyak factor of the target critics (the paper's)")
    learning_starts: int = Field(1000, ge=0, description="env steps of uniform random actions before updates")
    updates_per_env_step: float = Field(4.0, gt=0, le=64, description="critic steps per env step collected, the "
                                                                      "update-to-data ratio (paper: 20)")
    policy_delay: int | None = Field(None, ge=1, le=1000,
                                     description="critic steps per actor (and temperature) step; default "
                                                 "round(updates_per_env_step): one actor step per env step, as RLPD")
    num_critics: int = Field(10, ge=1, le=64, description="N: critics in the ensemble (paper: 10)")
    critic_subset: int = Field(2, ge=1, le=64, description="M: critics the target takes the min over, a random "
                                                           "subset of the N per minibatch (paper, REDQ: 2)")
    critic_layer_norm: bool = Field(True, description="LayerNorm after each critic hidden layer (the paper's: it "
                                                      "keeps Q bounded on the offline data's actions)")
    critic_hidden_sizes: list[int] = Field([256, 256], min_length=1, max_length=8,
                                           description="hidden widths of each critic (paper: 256 x 2)")
    ent_coef: float | Literal["auto"] = Field("auto", description="entropy weight alpha, or auto-tuned")
    init_alpha: float = Field(1.0, gt=0, allow_inf_nan=False,
                              description="auto-tuned alpha's starting value (the paper's init_temperature: 1)")
    target_entropy: float | None = Field(None, allow_inf_nan=False,
                                         description="auto alpha target; default -action_dim (paper: -action_dim/2)")

    @model_validator(mode="after")
    def _subset_fits(self) -> RLPDConfig:
        if self.critic_subset > self.num_critics:
            raise ValueError(f"critic_subset={self.critic_subset} exceeds num_critics={self.num_critics}: the target "
                             f"takes the min over a subset of the ensemble. Fix: critic_subset <= num_critics")
        if self.offline_source == DEFAULT_SOURCE:
            raise ValueError(f"offline_source={DEFAULT_SOURCE!r} is the online window itself. Fix: name the data "
                             f"set's source (a key of replay.datasets), e.g. offline")
        return self


def subset_min(q: torch.Tensor, m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """min over a random subset of m of the N rows of ``q`` [N, B] -> [B] (all N when m == N: no draw)."""
    n = q.shape[0]
    if m >= n:
        return q.min(0).values
    pick = torch.randperm(n, generator=generator, device=q.device)[:m]
    return q.index_select(0, pick).min(0).values


@register
class RLPD(SAC):
    Config = RLPDConfig
    SAVED = ("q", "q_target", "q_optimizer", "actor_optimizer")

    @classmethod
    def data(cls, cfg: RLPDConfig) -> DataAccess:
        if cfg.offline_weight == 0:
            return DataAccess.uniform(cfg.batch_size)
        return DataAccess.mix(cfg.batch_size, {DEFAULT_SOURCE: 1.0 - cfg.offline_weight,
                                               cfg.offline_source: cfg.offline_weight})

    @classmethod
    def check(cls, run) -> None:
        cfg: RLPDConfig = run.algorithm
        if cfg.offline_weight > 0 and cfg.offline_source not in run.replay.datasets:
            raise ValueError(f"algorithm.offline_source={cfg.offline_source!r} names no data set, and "
                             f"algorithm.offline_weight={cfg.offline_weight} samples from it. Fix: add "
                             f"replay.datasets: {{{cfg.offline_source}: PATH.npz}} (rlfabric collect CHECKPOINT "
                             f"--episodes 10 --out PATH.npz writes one), or set algorithm.offline_weight: 0")

    def __init__(self, actor, run, generator: torch.Generator | None = None, **kw):
        super().__init__(actor, run, generator, **kw)
        if self.auto_alpha:
            self.log_alpha.data.fill_(self.cfg.init_alpha).log_()

    def build_critics(self, device: torch.device) -> None:
        """The critic ensemble (one module, [N, B] out), its target copy, and the critics' optimiser."""
        cfg: RLPDConfig = self.cfg
        obs_space = self.env_spec.get("observation_space", {"kind": "box", "shape": [self.actor.obs_dim]})
        self.q = critics.QEnsemble(obs_space, self.actor.act_dim, self.run.policy, cfg.num_critics,
                                   cfg.critic_hidden_sizes, cfg.critic_layer_norm).to(device)
        self.q_target = copy.deepcopy(self.q)
        self.q_optimizer = self.adam(self.q.parameters())
        self.policy_delay = cfg.policy_delay or max(1, round(cfg.updates_per_env_step))
        self.offline_index = (self.data(cfg).source_names.index(cfg.offline_source)
                              if cfg.offline_weight > 0 else -1)  # its number in a mix's per-row "source"
        self.last_actor = {"actor_loss": float("nan"), "entropy": float("nan")}  # (until the first actor step)

    def update(self, batch: dict) -> dict[str, float]:
        """SAC's loop over the [U, B] minibatches, and the share of offline rows they held."""
        stats = super().update(batch)
        source = batch.get("source")
        offline = (source == self.offline_index).float().mean().item() if source is not None else 0.0
        return {**stats, "offline_fraction": offline}

    def step(self, b: dict) -> dict[str, float]:
        cfg: RLPDConfig = self.cfg
        obs, actions, rewards = b["obs"], b["actions"].float(), b["rewards"].float()
        next_obs, terminated = b["next_obs"], b["terminated"].float()
        alpha = self.log_alpha.exp().item()
        with torch.no_grad():
            next_actions, next_logp = self.actor.sample(next_obs, self.generator)
            next_q = subset_min(self.q_target(next_obs, next_actions), cfg.critic_subset, self.generator)
            y = critic_target(rewards, terminated, next_q, next_q, next_logp, cfg.gamma, alpha)
        qs = self.q(obs, actions)  # [N, B]
        q_loss = (qs - y).pow(2).mean(1).sum()
        self.q_optimizer.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_optimizer.step()
        critics.soft_update(self.q_target, self.q, cfg.tau)
        self.optimizer_steps += 1

        if self.optimizer_steps % self.policy_delay == 0:
            new_actions, logp = self.actor.sample(obs, self.generator)
            with critics.frozen(self.q):
                q_new = self.q(obs, new_actions).mean(0)
            actor_loss = (alpha * logp - q_new).mean()
            self.actor_optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_optimizer.step()
            self.alpha_step(logp)
            self.last_actor = {"actor_loss": actor_loss.item(), "entropy": -logp.mean().item()}
        return {"q_loss": q_loss.item(), "alpha": alpha, "q_mean": qs.mean().item(),
                "q_std": qs.std(0).mean().item() if qs.shape[0] > 1 else 0.0, **self.last_actor}


__all__ = ["RLPD", "RLPDConfig", "subset_min"]
