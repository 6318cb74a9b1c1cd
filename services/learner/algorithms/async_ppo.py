"""Asynchronous PPO: the decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for policy
optimization"), as AReaL uses it, for batches collected by a behaviour policy up to a few weight versions old (a
pipelined plan: a learner on its own pool streams batches while rollout produces the next ones within
``scheduling.staleness``). Everything else is PPO's (ppo.py): GAE from the batch's own values, the value loss,
the entropy bonus, the linear lr/clip schedules, minibatches and epochs.

The batch was sampled by a behaviour policy mu (the weights the rollout held: each step's trajectory field
``weight_version``); before the update's first step the learner scores the batch with its current weights, the
proximal policy pi_prox (no gradient). PPO's trust region is centred on pi_prox, not on mu, and an importance
weight corrects for the policy that sampled:

    version lag     lag_i = v_learner - v_i                      v_learner: the version the update starts from
    drop            keep_i = lag_i <= max_staleness              a dropped sample leaves the loss (counted)
    behaviour w     w_i = pi_prox(a_i|s_i) / mu(a_i|s_i)         no gradient; per element of the log-probs
    truncation      w_i = min(w_i, C)                            C = behaviour_weight_cap (None: not truncated)
    ratio           r_i = pi_theta(a_i|s_i) / pi_prox(a_i|s_i)
    policy          L_pi = -E_keep[ w_i * min(r_i A_i, clip(r_i, 1 - eps, 1 + eps) A_i) ]
    total           L = L_pi + vf_coef * L_v - ent_coef * entropy          (L_v, entropy: PPO's, on kept samples)

Since w >= 0, w * min(r A, clip(r) A) = min(r (w A), clip(r) (w A)): the loss is ``ppo_loss`` with old log-probs
pi_prox and advantages w * A (normalised before weighting, as PPO normalises). With pi_prox == mu (an on-policy
batch) w = 1 and it is PPO's clipped loss exactly. Truncation clamps w at C (as truncated IS does); AReaL instead
masks a token whose w exceeds its cap (weight 0), which drops the samples the learner has moved furthest from.

Any actor-critic policy (MLP, CNN, VLA): log-probs per decision, per action or per token each get their own w
and r, and their decision's advantage, as in PPO. Each sample's lag comes from its ``weight_version`` field
(shards of different rollout workers may differ) and the learner's version (``Algorithm.weight_version``, set
before each update). GAE runs over the whole [T, N] batch
before the drop, so a dropped step still passes on its successors' advantages. Per update it logs the lag's
``version_lag_mean``/``version_lag_max``, the share of samples at least one version old (``version_lag_stale_fraction``),
the share dropped (``stale_dropped_fraction``), and the behaviour weight's mean over kept elements
(``behaviour_weight_mean``, before truncation) with the share truncated (``behaviour_weight_truncated_fraction``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from rlfabric.services.core.algorithm import Trajectory, register
from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.ppo import (
    PPO,
    PPOConfig,
    compute_gae,
    linear,
    per_step_discounting,
    ppo_loss,
)

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class AsyncPPOConfig(PPOConfig):
    name: Literal["async_ppo"] = "async_ppo"
    max_staleness: int | None = Field(
        None, ge=0, le=64,
        description="drop samples whose version lag (the learner's version minus the version that sampled them) "
                    "exceeds this; None: the run's scheduling.staleness (what the plan already bounds, so nothing "
                    "is dropped unless workers lag beyond it)")
    behaviour_weight_cap: float | None = Field(
        2.0, ge=1, allow_inf_nan=False,
        description="C: the behaviour weight pi_prox/mu is truncated at min(w, C); None: not truncated. >= 1, so an "
                    "on-policy sample (w = 1) is never truncated")


def behaviour_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                      cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w = pi_prox / mu per element, truncated at ``cap`` (no gradient), and where it was truncated."""
    log_w = (prox_logp - behaviour_logp).detach()
    if cap is None:
        return log_w.exp(), torch.zeros_like(log_w, dtype=torch.bool)
    truncated = log_w > math.log(cap)
    return log_w.clamp(max=math.log(cap)).exp(), truncated


def decoupled_ppo_loss(new_logp: torch.Tensor, prox_logp: torch.Tensor, weights: torch.Tensor,
                       advantages: torch.Tensor, new_values: torch.Tensor, old_values: torch.Tensor,
                       returns: torch.Tensor, entropy: torch.Tensor, clip: float, clip_vf: float | None,
                       vf_coef: float, ent_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-E[w * min(r A, clip(r) A)] with r = pi_theta / pi_prox, plus PPO's value and entropy terms: ``ppo_loss``
    with pi_prox as the old policy and advantages w * A (w >= 0 factors out of the min)."""
    return ppo_loss(new_logp, prox_logp, weights * advantages, new_values, old_values, returns, entropy, clip,
                    clip_vf, vf_coef, ent_coef)


def version_lags(learner_version: int, sample_versions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's lag (learner version minus the version that sampled it) and whether it is kept (lag <= bound)."""
    lags = learner_version - sample_versions.to(torch.int64)
    return lags, lags <= bound


@register
class AsyncPPO(PPO):
    Config = AsyncPPOConfig
    default = False

    @classmethod
    def trajectory(cls, cfg: AsyncPPOConfig) -> Trajectory:
        base = PPO.trajectory(cfg)
        return Trajectory(fields=(*base.fields, "weight_version"), bootstrap_truncated=base.bootstrap_truncated)

    def __init__(self, policy: nn.Module, run, generator: torch.Generator | None = None, **kw):
        super().__init__(policy, run, generator, **kw)
        self.bound = self.cfg.max_staleness if self.cfg.max_staleness is not None else run.scheduling.staleness

    def proximal_logp(self, obs, actions: torch.Tensor, mb: int) -> torch.Tensor:
        """pi_prox: the learner's log-probs of the batch before any step of this update (no gradient), in
        minibatch-sized chunks (a VLA's activations for the whole batch need not fit at once)."""
        size = actions.shape[0]
        out = []
        with torch.no_grad():
            for start in range(0, size, mb):
                sl = slice(start, start + mb)
                logp, _, _ = self.policy.evaluate(tree_map(lambda x, s=sl: x[s], obs), actions[sl])
                out.append(logp.detach())
        return torch.cat(out)

    def update(self, batch: dict) -> dict[str, float]:
        cfg = self.cfg
        rewards, values, dones = batch["rewards"], batch["values"], batch["dones"].float()
        T, N = rewards.shape
        self.env_steps += T * N
        progress_remaining = max(0.0, 1.0 - self.env_steps / self.total_env_steps)
        lr = linear(cfg.learning_rate, progress_remaining, cfg.lr_schedule)
        clip = linear(cfg.clip_range, progress_remaining, cfg.clip_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["scale"]

        gamma: float | torch.Tensor = cfg.gamma
        if cfg.reward_level == "action" and "step_rewards" in batch:
            rewards, gamma = per_step_discounting(rewards, batch["step_rewards"], batch["step_valid"], cfg.gamma)
        # GAE over the whole trajectory (values from the batch, as PPO), before any sample is dropped
        advantages, returns = compute_gae(rewards, values, dones, batch["last_values"], gamma, cfg.gae_lambda)
        size = T * N
        lags, keep = version_lags(self.weight_version, batch["weight_version"].reshape(-1), self.bound)
        kept = keep.nonzero().squeeze(1)
        n = int(kept.numel())
        lag_stats = {"version_lag_mean": float(lags.float().mean()), "version_lag_max": float(lags.max()),
                     "version_lag_stale_fraction": float((lags >= 1).float().mean()),
                     "stale_dropped_fraction": 1.0 - n / size}
        warming = self.updates < cfg.critic_warmup
        self.updates += 1
        base = {"learning_rate": lr, "clip_range": clip, "critic_warmup": float(warming), **lag_stats}
        if n == 0:  # every sample is older than the bound: no step
            return base

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(size, *x.shape[2:])[kept]

        flat = {"obs": tree_map(rows, batch["obs"]), "actions": rows(batch["actions"]), "logp": rows(batch["logp"]),
                "values": values.reshape(-1)[kept], "advantages": advantages.reshape(-1)[kept],
                "returns": returns.reshape(-1)[kept]}
        mb = min(cfg.batch_size, n)
        flat["prox"] = self.proximal_logp(flat["obs"], flat["actions"], mb)
        flat["w"], truncated = behaviour_weights(flat["prox"], flat["logp"], cfg.behaviour_weight_cap)
        raw_w = (flat["prox"] - flat["logp"]).exp()
        sums: dict[str, torch.Tensor] = {}
        count = 0
        stop = False
        for _ in range(cfg.n_epochs):
            order = torch.randperm(n, generator=self.generator,
                                   device=self.generator.device if self.generator is not None else "cpu")
            for start in range(0, n, mb):
                idx = order[start:start + mb].to(kept.device)
                adv = flat["advantages"][idx]
                if cfg.normalize_advantage and len(idx) > 1:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                if warming:  # no policy gradient: the clipped surrogate of a zero advantage is zero
                    adv = torch.zeros_like(adv)
                obs = tree_map(lambda x, i=idx: x[i], flat["obs"])
                new_logp, entropy, new_values = self.policy.evaluate(obs, flat["actions"][idx])
                adv = adv.reshape(-1, *(1,) * (new_logp.dim() - 1))  # each action/token of a decision gets its
                loss, stats = decoupled_ppo_loss(new_logp, flat["prox"][idx], flat["w"][idx], adv, new_values,
                                                 flat["values"][idx], flat["returns"][idx], entropy, clip,
                                                 cfg.clip_range_vf, cfg.vf_coef, cfg.ent_coef)
                if cfg.target_kl is not None and stats["approx_kl"] > 1.5 * cfg.target_kl:
                    stop = True
                    break
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm, foreach=True)
                self.optimizer.step()
                self.optimizer_steps += 1
                for k, v in stats.items():  # tensors: one conversion per update, not per minibatch
                    sums[k] = sums[k] + v if k in sums else v
                count += 1
            if stop:
                break
        out = {k: float(v) / max(count, 1) for k, v in sums.items()}
        y, y_hat = flat["returns"], flat["values"]
        var_y = float(y.var()) if n > 1 else 0.0
        out.update(base, logprob_mismatch_abs=float((flat["prox"] - flat["logp"]).abs().mean()),
                   behaviour_weight_mean=float(raw_w.mean()),
                   behaviour_weight_truncated_fraction=float(truncated.float().mean()),
                   explained_variance=float("nan") if var_y == 0 else 1 - float((y - y_hat).var()) / var_y)
        return out


__all__ = ["AsyncPPO", "AsyncPPOConfig", "behaviour_weights", "decoupled_ppo_loss", "version_lags"]
