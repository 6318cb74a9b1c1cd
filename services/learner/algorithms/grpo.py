"""GRPO (Shao et al. 2024): group-relative advantages for language-model policies, no value function.

    for each prompt, G sampled responses o_1..o_G with rewards r_1..r_G (one group):
    advantage   A_i = (r_i - mean(r)) / (std(r) + eps)          (scale_rewards: none keeps r_i - mean(r))
    ratio       rho_t = pi(o_t | o_<t) / pi_old(o_t | o_<t)     per response token t
    surrogate   L_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)
    KL          + beta * (pi_ref / pi - log(pi_ref / pi) - 1)   (the k3 estimator, per token; beta > 0 only)
    loss        mean over each response's tokens, then over responses (loss_agg: sequence), or over all response
                tokens of the batch (loss_agg: token)

Prompt and tool-output tokens are masked out (``loss_mask``). pi_old is the policy that sampled: the engine's
log-probs (``behaviour: engine``), or the learner's own recomputation before the update (``behaviour: proximal``,
decoupled PPO: the engine's log-probs then only weight each token by min(pi_prox / pi_engine, tis_cap), the
truncated importance-sampling correction for stale or mismatched samples). Every update reports the mismatch
between the engine's and the learner's log-probs of the same tokens under the same weights.

Rollout correction (``rollout_correction``, rollout_correction.py; off by default) multiplies each token's L_t by
w_t, a function with no gradient of the engine-vs-learner ratio k_t = pi_learner_old(o_t) / pi_engine(o_t):
truncated (tis: min(k, C)) or masked (mis: 1 inside [low, high], else 0), per token or per response; the KL term
is not weighed. It needs ``behaviour: proximal``, so that the surrogate's ratio is the learner's own and the
engine's part is in w_t alone. ``tis_cap`` is its older spelling of ``{mode: tis, level: token, cap: tis_cap}``.
The surrogate is a hook (``surrogate``): GSPO clips a sequence ratio, CISPO the stop-gradient weight of a
REINFORCE term.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfabric.services.core.algorithm import (
    Algorithm,
    AlgorithmConfig,
    DataAccess,
    Roles,
    Trajectory,
    register,
)
from rlfabric.services.core.batch import Ragged
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.rollout_correction import RolloutCorrection, rollout_weights

torch = lazy_import("torch")
nn = lazy_import("torch.nn")


class GRPOConfig(AlgorithmConfig):
    name: Literal["grpo"] = "grpo"
    learning_rate: float = Field(1e-4, gt=0, allow_inf_nan=False, description="AdamW's step size")
    epochs: int = Field(1, ge=1, le=100, description="passes over each batch")
    minibatch_size: int = Field(64, ge=1, le=1 << 16, description="responses per gradient step")
    micro_batch_size: int = Field(
        0, ge=0, le=1 << 16,
        description="responses per forward/backward pass inside a minibatch, grouped by length so each pass is "
                    "padded only to its own longest row; the gradients add up to the same step (long, uneven "
                    "responses: less padding, less memory). 0: the whole minibatch in one pass")
    share_prompt: bool = Field(
        False, description="run each group's prompt once per pass and let its responses read the prompt's KV cache "
                           "(gradients flow back through it): the same loss and gradient with fewer tokens, "
                           "worth most when prompts are long next to responses; passes then hold whole groups")
    clip_low: float = Field(0.2, gt=0, lt=1, allow_inf_nan=False, description="eps_low of the ratio clip")
    clip_high: float = Field(0.2, gt=0, allow_inf_nan=False, description="eps_high (DAPO's clip-higher: > eps_low)")
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False, description="beta; > 0 keeps a frozen reference policy")
    scale_rewards: Literal["group", "none"] = Field(
        "group", description="divide each advantage by its group's reward std (none: only subtract the mean)")
    loss_agg: Literal["sequence", "token"] = Field(
        "sequence", description="average the loss per response, then over responses (sequence), or over all "
                                "response tokens of the batch (token: long responses weigh more)")
    behaviour: Literal["engine", "proximal"] = Field(
        "engine", description="pi_old of the ratio: the engine's sampling log-probs, or the learner's own "
                              "recomputation before the update (decoupled PPO, with tis_cap)")
    tis_cap: float | None = Field(None, gt=0, allow_inf_nan=False,
                                  description="truncated importance weight cap (behaviour: proximal); None: no "
                                              "weight. The same as rollout_correction: {mode: tis, cap: tis_cap}")
    rollout_correction: RolloutCorrection = Field(
        default_factory=RolloutCorrection,
        description="importance weights on rho = pi_learner_old / pi_engine of each sampled token (needs behaviour: "
                    "proximal): {mode: none|tis|mis, level: token|sequence|geometric, cap, low, high}; logs "
                    "rollout_is_ratio_mean/_std and the truncated or masked fraction per update")
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False, description="clip of the gradient's global norm")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="AdamW's decoupled weight decay")

    @model_validator(mode="after")
    def _correction_needs_the_learners_old_logprobs(self) -> GRPOConfig:
        if self.rollout_correction.on and self.behaviour != "proximal":
            raise ValueError("rollout_correction weighs each token by pi_learner_old / pi_engine, so the surrogate's "
                             "pi_old must be the learner's own (else the engine's part counts twice). Fix: set "
                             "behaviour: proximal")
        if self.rollout_correction.on and self.tis_cap is not None:
            raise ValueError("tis_cap and rollout_correction are two spellings of one weight: keep "
                             "rollout_correction and drop tis_cap")
        return self

    @property
    def correction(self) -> RolloutCorrection:
        """The rollout correction in force: ``rollout_correction``, or ``tis_cap``'s token-level TIS."""
        if self.tis_cap is not None and self.behaviour == "proximal":
            return RolloutCorrection(mode="tis", level="token", cap=self.tis_cap)
        return self.rollout_correction


def take(batch: dict, rows: torch.Tensor) -> dict:
    """The batch's samples ``rows`` (Ragged fields included)."""
    idx = rows.cpu().numpy()
    return {k: v.take(idx) if isinstance(v, Ragged) else v[rows] for k, v in batch.items()}


def padded(batch: dict, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Ragged per-sample fields (of equal lengths) as right-padded ``[B, L]`` tensors, plus their
    ``attention_mask``."""
    out = {name: batch[name].padded(0)[0] for name in names}
    out["attention_mask"] = batch[names[0]].padded(0)[1].long()
    return out


def chunked_logprobs(model: nn.Module, tokens: torch.Tensor, attn: torch.Tensor, chunk: int,
                     temperature: float) -> torch.Tensor:
    """``model.token_logprobs`` over the batch, ``chunk`` sequences at a time (bounded activation memory), without
    gradients (a ``with`` block, not the decorator: that would import torch with the spec)."""
    with torch.no_grad():
        return torch.cat([model.token_logprobs(tokens[i:i + chunk], attn[i:i + chunk], temperature)
                          for i in range(0, tokens.shape[0], chunk)])


def shared_prefixes(tokens: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor,
                    group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the prompt it shares with its group: (prefix, owner). ``prefix`` is the leading tokens every row of
    the group has in common, up to the group's first trained token and short of each row's last token; rows with
    nothing in common with their group own their prefix alone (up to their own first trained token)."""
    B = tokens.shape[0]
    lengths = attn.sum(1)
    trained = loss_mask > 0
    first = torch.where(trained.any(1), trained.float().argmax(1), lengths)  # each row's first trained token
    prefix = torch.minimum(first, lengths - 1).clamp(min=1)
    owner = torch.arange(B, device=tokens.device) + B  # alone
    groups, inverse = torch.unique(group, return_inverse=True)
    for g in range(len(groups)):
        rows = torch.nonzero(inverse == g).squeeze(1)
        agree = ((tokens[rows] == tokens[rows[:1]]) & (attn[rows] > 0)).all(0)
        common = int(agree.long().cumprod(0).sum())
        p = min(common, int(first[rows].min()), int(lengths[rows].min()) - 1)
        if p >= 1:
            prefix[rows], owner[rows] = p, g
    return prefix, owner


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, scale: bool, eps: float = 1e-6) -> torch.Tensor:
    """r_i - mean of its group (divided by the group's std when ``scale``)."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]
    centred = rewards - mean
    if not scale:
        return centred
    var = torch.zeros(len(counts), dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, centred.pow(2))
    std = (var / (counts - 1).clamp(min=1)).sqrt()[inverse]
    return centred / (std + eps)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str,
              whole: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over each response's tokens then over responses (sequence), or over all tokens (token). With ``whole``
    (the mask of the whole minibatch when ``mask`` is one rank's share of it) the denominators are the whole
    minibatch's: the shares then add up to the minibatch loss."""
    whole = mask if whole is None else whole
    if how == "token":
        return (per_token * mask).sum() / whole.sum().clamp(min=1)
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / max(whole.shape[0], 1)


def mismatch(learner: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the learner's under the same weights: mean
    |delta| and the k3 estimate of KL(learner || engine), over the response tokens."""
    n = mask.sum().clamp(min=1)
    return {"logprob_mismatch_abs": float(((learner - engine) * mask).abs().sum() / n),
            "logprob_mismatch_kl": float((k3(engine, learner) * mask).sum() / n)}


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) result as a plain tensor; a plain one as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def k3(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, unbiased and non-negative: exp(d) - d - 1 with d = log pi_ref - log pi."""
    d = logp_ref - logp
    return d.exp() - d - 1


def clipped_surrogate(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float,
                      high: float) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = (logp - old).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    return per_token, ((ratio < 1 - low) | (ratio > 1 + high)).float()


@register
class GRPO(Algorithm):
    Config = GRPOConfig
    policy = "causal_lm"
    data_parallel = True
    grouped = True  # advantages relative to a prompt's group (variants with their own baseline set False)

    @classmethod
    def trajectory(cls, cfg: Any) -> Trajectory:
        return Trajectory(fields=("tokens", "loss_mask", "logp", "rewards", "group", "response_tokens",
                                  "truncated", "kept"))

    @classmethod
    def data(cls, cfg: Any) -> DataAccess:
        return DataAccess.on_policy()

    @classmethod
    def needs(cls, cfg: Any) -> Roles:
        return Roles(reference=cfg.kl_coef > 0)

    @classmethod
    def steps_per_env(cls, cfg: Any) -> int:
        return 1  # one episode (a prompt's response, all its turns) per env per iteration

    @classmethod
    def check(cls, run: Any) -> None:
        if run.env.adapter != "text":
            raise ValueError(f"algorithm {run.algorithm.name} trains language-model policies on text tasks: set "
                             f"env.adapter: text (got {run.env.adapter!r})")
        if getattr(run.algorithm, "share_prompt", False) and cls.forward is not GRPO.forward:
            raise ValueError(f"algorithm.share_prompt: {run.algorithm.name} computes more than log-probs in its "
                             f"forward pass (a value head); set share_prompt: false")
        if cls.grouped and run.env.options.get("group_size", 1) < 2:
            raise ValueError("env.options.group_size must be >= 2: group-relative advantages compare the responses "
                             "to one prompt")

    def __init__(self, policy: nn.Module, run: Any, generator: torch.Generator | None = None, **kw):
        super().__init__(policy, run, generator, **kw)
        self.temperature = run.rollout.temperature
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # torch's AdamW: transformers imports torch.optim anyway, so the thin Adam of the MLP learners buys nothing
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)

    # -- hooks variants override (dapo.py, reinforce_pp.py) ----------------------------------------------------
    kl_in_loss = True  # beta * KL(pi || pi_ref) per token in the loss (Reinforce++ puts it in the reward)

    def advantages(self, batch: dict, seq: dict[str, torch.Tensor], mask: torch.Tensor, old: torch.Tensor,
                   ref: torch.Tensor | None) -> torch.Tensor:
        """Per-token advantages [B, L-1]: here one per response (group-relative), broadcast over its tokens.
        ``seq``: the padded tokens and attention_mask; ``old``/``ref``: log-probs of the sampler and reference."""
        adv = group_advantages(self.rewards(batch), batch["group"], self.cfg.scale_rewards == "group")
        return adv[:, None].expand_as(mask)

    def rewards(self, batch: dict) -> torch.Tensor:
        """Each response's scalar reward (DAPO shapes overlong responses here)."""
        return batch["rewards"].float()

    def forward(self, tokens: torch.Tensor, attn: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
        """The minibatch's per-token log-probs [b, L-1], and whatever else the loss needs (a critic's values).
        ``shared``: each row's (prefix, owner) when share_prompt runs each prompt once."""
        if shared is not None:
            return self.policy.shared_prompt_logprobs(tokens, attn, *shared, self.temperature), None
        return self.policy.token_logprobs(tokens, attn, self.temperature), None

    def auxiliary_loss(self, aux: Any, idx: torch.Tensor, mask: torch.Tensor,
                       whole: torch.Tensor) -> tuple[torch.Tensor | float, dict[str, float]]:
        """A loss term added to the surrogate (a value loss), aggregated like it, and its stats (none here)."""
        return 0.0, {}

    def surrogate(self, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token policy-gradient loss [b, T] of a pass, and which tokens its clip acted on: PPO's clipped
        surrogate here (gspo.py clips a sequence ratio, cispo.py weighs a REINFORCE term). ``mask``: the pass's
        response tokens."""
        return clipped_surrogate(logp, old, adv, self.cfg.clip_low, self.cfg.clip_high)

    def select(self, batch: dict) -> dict | None:
        """The responses this iteration trains on, or None to train on nothing yet (all of them here; DAPO drops
        groups with no signal and waits for enough)."""
        return batch

    def micro_batches(self, idx: torch.Tensor, attn: torch.Tensor,
                      owner: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``idx`` in passes of ``micro_batch_size`` rows of similar length (all of it when 0); with ``owner``
        (share_prompt), rows of one prompt stay together, prompts ordered by their longest row."""
        size = self.cfg.micro_batch_size
        if not size or size >= len(idx):
            return [idx]
        lengths = attn[idx].sum(1)
        if owner is not None:  # rows of one prompt together (sorted by prompt), prompts by their longest row
            order = torch.argsort(owner[idx], stable=True)
            idx, lengths = idx[order], lengths[order]
            _, inverse = torch.unique(owner[idx], return_inverse=True)
            longest = torch.zeros(int(inverse.max()) + 1, dtype=lengths.dtype, device=lengths.device).scatter_reduce_(
                0, inverse, lengths, "amax")
            lengths = longest[inverse]
        by_length = idx[torch.argsort(lengths, stable=True)]
        return [by_length[i:i + size] for i in range(0, len(by_length), size)]

    # -- the update ---------------------------------------------------------------------------------------------
    def update(self, batch: dict) -> dict[str, float]:
        cfg = self.cfg
        self.env_steps += int(batch["rewards"].shape[0])
        stats: dict[str, float] = {}
        if "kept" in batch:  # groups cut from an over-sampled round (rollout.finish_fraction) are not trained on
            kept = batch["kept"] > 0
            stats["cut_fraction"] = 1.0 - float(kept.float().mean())
            batch = take(batch, torch.nonzero(kept).squeeze(1))
        if not len(batch["rewards"]):
            return stats | {"reward_mean": 0.0, "updated": 0.0}
        stats["reward_mean"] = float(batch["rewards"].float().mean())
        batch = self.select(batch)
        if batch is None:
            return stats | {"updated": 0.0}
        seq = padded(batch, ("tokens", "loss_mask", "logp"))
        tokens, attn = seq["tokens"], seq["attention_mask"]
        mask = seq["loss_mask"][:, 1:].float()
        engine = seq["logp"][:, 1:].float()
        B = tokens.shape[0]
        prefix = owner = None
        if cfg.share_prompt:
            prefix, owner = shared_prefixes(tokens, attn, seq["loss_mask"], batch["group"])
        # the learner's log-probs before the update (the mismatch, the proximal policy) and pi_ref's. When the
        # engine's log-probs are pi_old and the batch is one minibatch, the first training forward pass is taken
        # before any step: the mismatch comes from it, and no separate pass is spent
        one_pass = cfg.behaviour == "engine" and B <= cfg.minibatch_size
        prox = None if one_pass else chunked_logprobs(self.policy, tokens, attn, cfg.minibatch_size,
                                                      self.temperature)
        ref = chunked_logprobs(self.reference, tokens, attn, cfg.minibatch_size, self.temperature) \
            if cfg.kl_coef > 0 else None
        if prox is not None:
            stats.update(mismatch(prox, engine, mask))
        old = engine if cfg.behaviour == "engine" else prox
        adv = self.advantages(batch, seq, mask, old, ref)
        weight = torch.ones_like(engine)  # the rollout correction's w_t (none: 1)
        if prox is not None and cfg.correction.on:
            weight, correction_stats = rollout_weights(prox, engine, mask, cfg.correction)
            stats.update(correction_stats)
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.epochs):
            order = torch.randperm(B, generator=self.generator,
                                   device=self.generator.device if self.generator is not None else "cpu")
            for start in range(0, B, cfg.minibatch_size):
                whole = order[start:start + cfg.minibatch_size]
                idx, share = self.shard(whole)  # this rank's rows (all of them on one rank)
                self.optimizer.zero_grad()
                parts = self.micro_batches(idx, attn, owner)
                for part in parts:
                    width = int(attn[part].sum(1).max())  # this pass pads only to its own longest row
                    shared = () if prefix is None else ((prefix[part], owner[part]),)
                    logp, aux = self.forward(tokens[part, :width], attn[part, :width], *shared)
                    cut = width - 1
                    if prox is None and count == 0:  # pre-update log-probs of this rank's rows
                        mm = mismatch(logp.detach(), engine[part, :cut], mask[part, :cut])
                        for k, v in mm.items():  # token-weighted over the passes
                            sums["_" + k] = sums.get("_" + k, 0.0) + v * float(mask[part].sum())
                        sums["_mismatch_tokens"] = sums.get("_mismatch_tokens", 0.0) + float(mask[part].sum())
                    m = mask[part, :cut]
                    per_token, clipped = self.surrogate(logp, old[part, :cut], adv[part, :cut], m)
                    per_token = per_token * weight[part, :cut]
                    if ref is not None and self.kl_in_loss:
                        kl = k3(ref[part, :cut], logp)
                        per_token = per_token + cfg.kl_coef * kl
                        sums["kl_ref"] = sums.get("kl_ref", 0.0) + float((kl.detach() * m).sum() / m.sum().clamp(min=1)) / len(
                            parts)
                    # denominators of the whole minibatch: the passes' losses add up to the minibatch loss
                    extra, extra_stats = self.auxiliary_loss(aux, part, m, mask[whole])
                    loss = (aggregate(per_token, m, cfg.loss_agg, mask[whole]) + extra) * share
                    for k, v in extra_stats.items():  # a statistic of each pass, averaged over the passes
                        sums[k] = sums.get(k, 0.0) + v / len(parts)
                    loss.backward()
                    sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
                    sums["clip_fraction"] = sums.get("clip_fraction", 0.0) + float((clipped * m).sum()) / float(
                        mask[idx].sum().clamp(min=1))
                grad_norm = full(nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm, foreach=True))
                self.optimizer.step()
                self.optimizer_steps += 1
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm)
                count += 1
        tokens_seen = sums.pop("_mismatch_tokens", 0.0)
        for k in [k for k in sums if k.startswith("_")]:
            stats[k[1:]] = sums.pop(k) / max(tokens_seen, 1.0)
        stats.update({k: v / max(count, 1) for k, v in sums.items()})
        stats["response_tokens"] = float(batch["response_tokens"].float().mean())
        stats["truncated"] = float(batch["truncated"].float().mean())
        stats["samples"], stats["updated"] = float(B), 1.0
        return stats


__all__ = ["GRPO", "GRPOConfig", "aggregate", "chunked_logprobs", "clipped_surrogate", "full", "group_advantages",
           "k3", "mismatch", "padded", "shared_prefixes", "take"]
