"""On-policy distillation (OPD; Agarwal et al. 2024 "GKD", Gu et al. 2024 "MiniLLM"): the student samples its own
responses and a frozen teacher grades every position the student reached. The loss is the student's reverse KL
to the teacher on the student's own states; nothing of the task's reward is used.

    for each prompt x, the student samples y ~ pi_old(. | x)              (the rollout: on-policy states h_t = x, y_<t)
    reverse KL per position   KL_t = sum_v pi(v | h_t) [log pi(v | h_t) - log pi_T(v | h_t)]

    estimator: full (default) -- the exact KL_t over the vocabulary at every sampled prefix, differentiated
        through pi at that position (GKD with beta = 1, on-policy data):
        loss = mean over each response's tokens of KL_t, then over responses (loss_agg: sequence)
    estimator: sampled -- one sample per position (the sampled token), as a per-token policy gradient with
        discount 0 (each token's reward is its own log-ratio):
        A_t = -kl_scale * (log pi_old(y_t | h_t) - log pi_T(y_t | h_t))
        L_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t),   rho_t = pi(y_t | h_t) / pi_old(y_t | h_t)
        (GRPO's surrogate; with one minibatch, rho = 1 and the gradient is E[-A_t grad log pi(y_t)], the score-
        function estimate of grad KL_t). Cheaper for huge vocabularies, far noisier: on the arithmetic task a
        small student that the full estimator brings to its teacher does not move under this one in 100 updates.

Both drop the future positions' dependence on y_t (discount 0), as the on-policy distillation recipes do. The
teacher is a frozen policy checkpoint (``expert_checkpoint``: the learner's expert role), of any size, that speaks
the student's tokenizer: its vocabulary must be the student's. Everything else (behaviour, micro-batches, ranks)
is GRPO's (grpo.py). Each update logs ``reverse_kl``: the mean per-token reverse KL on the batch before the step
(the exact one under the full estimator, the sampled estimate under the other).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfabric.services.core.algorithm import Roles, register
from rlfabric.services.core.lazy import lazy_import
from rlfabric.services.learner.algorithms.grpo import GRPO, GRPOConfig, aggregate, chunked_logprobs

torch = lazy_import("torch")


class OPDConfig(GRPOConfig):
    name: Literal["opd"] = "opd"  # type: ignore[assignment]
    expert_checkpoint: str = Field("", max_length=4096,
                                   description="the teacher: a checkpoint file of a language-model run on the same "
                                               "task, with the student's tokenizer (any model size)")
    teacher_temperature: float = Field(1.0, gt=0, allow_inf_nan=False,
                                       description="temperature of the teacher's distribution the student is "
                                                   "pulled to (1: the teacher as trained)")
    estimator: Literal["full", "sampled"] = Field(
        "full", description="full: the exact reverse KL over the vocabulary at each sampled prefix; sampled: its "
                            "one-token estimate as a per-token policy gradient (cheaper, much noisier)")
    kl_scale: float = Field(1.0, gt=0, allow_inf_nan=False,
                            description="sampled estimator: multiplies each token's advantage -(log pi_old - "
                                        "log pi_T), the step size of the signal relative to learning_rate")


@register
class OPD(GRPO):
    Config = OPDConfig
    grouped = False  # the teacher grades each token: no group baseline, any group_size

    @classmethod
    def needs(cls, cfg: Any) -> Roles:
        return Roles(reference=cfg.kl_coef > 0, expert=True)

    @classmethod
    def check(cls, run: Any) -> None:
        super().check(run)
        if not run.algorithm.expert_checkpoint:
            raise ValueError("algorithm.expert_checkpoint is empty: on-policy distillation needs a teacher. Fix: set "
                             "it to a checkpoint file of a language-model run on the same task")

    def __init__(self, policy, run, generator=None, **kw):
        super().__init__(policy, run, generator, **kw)
        student, teacher = self.vocabulary(self.policy), self.vocabulary(self.expert)
        if student != teacher:
            raise ValueError(f"algorithm.expert_checkpoint: the teacher's vocabulary ({teacher} tokens) is not the "
                             f"student's ({student}); distillation compares log-probs of the same token ids. Fix: "
                             f"use a teacher trained with the student's tokenizer")

    @staticmethod
    def vocabulary(policy) -> int:
        return int(policy.model.get_output_embeddings().weight.shape[0])

    def advantages(self, batch: dict, seq: dict[str, torch.Tensor], mask: torch.Tensor, old: torch.Tensor,
                   ref: torch.Tensor | None) -> torch.Tensor:
        """Sampled: A_t = -kl_scale * (log pi_old(y_t) - log pi_T(y_t)) on every response token [B, L-1]. Full: 0
        (no policy-gradient term: the loss is the auxiliary KL)."""
        if self.cfg.estimator == "full":
            return torch.zeros_like(old)
        teacher = chunked_logprobs(self.expert, seq["tokens"], seq["attention_mask"], self.cfg.minibatch_size,
                                   self.cfg.teacher_temperature)
        log_ratio = (old - teacher) * mask
        self.kl_sum, self.kl_tokens = float(log_ratio.sum()), float(mask.sum())
        return -self.cfg.kl_scale * log_ratio

    def forward(self, tokens: torch.Tensor, attn: torch.Tensor, shared=None) -> tuple[torch.Tensor, Any]:
        """Sampled: GRPO's log-probs. Full: the log-probs and, for the loss, each position's reverse KL [b, L-1]."""
        if self.cfg.estimator == "sampled":
            return super().forward(tokens, attn, shared)
        student = self.policy.next_token_logprobs(tokens, attn, self.temperature)
        with torch.no_grad():
            teacher = self.expert.next_token_logprobs(tokens, attn, self.cfg.teacher_temperature)
        kl = (student.exp() * (student - teacher)).sum(-1)
        return student.gather(-1, tokens[:, 1:, None]).sum(-1), kl

    def auxiliary_loss(self, aux: Any, idx: torch.Tensor, mask: torch.Tensor,
                       whole: torch.Tensor) -> tuple[torch.Tensor | float, dict[str, float]]:
        if aux is None:
            return 0.0, {}
        if self.optimizer_steps == self.steps_before:  # the first minibatch's passes: before any step
            self.kl_sum += float((aux.detach() * mask).sum())
            self.kl_tokens += float(mask.sum())
        return aggregate(aux, mask, self.cfg.loss_agg, whole), {}

    def update(self, batch: dict) -> dict[str, float]:
        self.steps_before, self.kl_sum, self.kl_tokens = self.optimizer_steps, 0.0, 0.0
        stats = super().update(batch)
        return stats | {"reverse_kl": self.kl_sum / self.kl_tokens if self.kl_tokens else float("nan")}


__all__ = ["OPD", "OPDConfig"]
