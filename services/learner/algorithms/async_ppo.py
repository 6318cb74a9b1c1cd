"""Asynchronous PPO: the decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for policy
optimization"), as AReaL uses it, for batches collected by a behaviour policy up to a few weight versions old (a
pipelined plan: a learner on its own pool streams batches while rollout produces the next ones within
``scheduling.staleness``). Everything else is PPO's (ppo.py): GAE from the batch's own values, the value loss,
the entropy bonus, the linear lr/clip schedules, minibatches and epochs; this file fills PPO's three hooks (the
rows that enter the loss, pi_prox scored before the first step, the minibatch loss).

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
from rlfabric.services.learner.algorithms.ppo import PPO, PPOConfig, ppo_loss

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

    def rows(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The samples within the staleness bound, and the lags' metrics."""
        lags, keep = version_lags(self.weight_version, batch["weight_version"].reshape(-1), self.bound)
        kept = keep.nonzero().squeeze(1)
        return kept, {"version_lag_mean": float(lags.float().mean()), "version_lag_max": float(lags.max()),
                      "version_lag_stale_fraction": float((lags >= 1).float().mean()),
                      "stale_dropped_fraction": 1.0 - kept.numel() / lags.numel()}

    def score(self, flat: dict, mb: int) -> dict[str, float]:
        """pi_prox and the truncated behaviour weights of the kept rows, before the first step."""
        flat["prox"] = self.proximal_logp(flat["obs"], flat["actions"], mb)
        flat["w"], truncated = behaviour_weights(flat["prox"], flat["logp"], self.cfg.behaviour_weight_cap)
        gap = flat["prox"] - flat["logp"]
        return {"logprob_mismatch_abs": float(gap.abs().mean()), "behaviour_weight_mean": float(gap.exp().mean()),
                "behaviour_weight_truncated_fraction": float(truncated.float().mean())}

    def minibatch_loss(self, flat: dict, idx: torch.Tensor, new_logp: torch.Tensor, entropy: torch.Tensor,
                       new_values: torch.Tensor, adv: torch.Tensor, clip: float
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        return decoupled_ppo_loss(new_logp, flat["prox"][idx], flat["w"][idx], adv, new_values, flat["values"][idx],
                                  flat["returns"][idx], entropy, clip, cfg.clip_range_vf, cfg.vf_coef, cfg.ent_coef)


__all__ = ["AsyncPPO", "AsyncPPOConfig", "behaviour_weights", "decoupled_ppo_loss", "version_lags"]
