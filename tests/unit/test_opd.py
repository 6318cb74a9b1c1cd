"""On-policy distillation (algorithms/opd.py) on hand-made batches: the full estimator's loss is the exact reverse
KL of the student to the teacher over the vocabulary at every response position; a few updates on the student's
responses move it toward the teacher (the KL falls); the sampled estimator's advantages are the per-token
log-ratios; a teacher with another vocabulary is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import Ragged, TensorBatch

TEXT = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
SPEC = {"observation_space": TEXT, "action_space": TEXT}
OPD = "{name: opd, expert_checkpoint: teacher.pt}"


def run_config(algorithm: str, hidden: int = 64):
    from rlfabric.services.core.config import parse_config

    return parse_config(f"""
name: t
seed: 0
env: {{adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {{group_size: 1}}}}
policy: {{lm: {{hidden_size: {hidden}, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}}}
rollout: {{backend: hf}}
algorithm: {algorithm}
""")


def policies(student_hidden: int = 32, seed: int = 0):
    from rlfabric.services.core.models import build_policy

    torch.manual_seed(seed)
    teacher = build_policy("causal_lm", SPEC, run_config(OPD, 64).policy)
    student = build_policy("causal_lm", SPEC, run_config(OPD, student_hidden).policy)
    with torch.no_grad():  # a confident teacher (random models are near uniform: nothing to distil)
        teacher.model.get_output_embeddings().weight.mul_(30.0)
    return student, teacher


def responses(student):
    """Four of the student's 'responses' to one prompt, as a batch with the student's log-probs as the engine's."""
    tok = student.tokenizer
    prompt = [1, *tok.encode("Q: 2+2= A:", add_special_tokens=False)]
    rows = [prompt + tok.encode(a, add_special_tokens=False) + [2] for a in (" 4", " 15", " 6", " 27")]
    masks = [[0] * len(prompt) + [1] * (len(r) - len(prompt)) for r in rows]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])[:, 1:].float()
    with torch.no_grad():
        lp = student.token_logprobs(tokens, attn)
    engine = [np.concatenate([[0.0], (lp[i, :len(rows[i]) - 1] * mask[i, :len(rows[i]) - 1]).numpy()])
              for i in range(4)]
    batch = TensorBatch({
        "tokens": Ragged.from_rows(rows, dtype=np.int64), "loss_mask": Ragged.from_rows(masks, dtype=np.uint8),
        "logp": Ragged.from_rows(engine, dtype=np.float32), "rewards": np.zeros(4, np.float32),
        "group": np.arange(4), "response_tokens": np.array([sum(m) for m in masks]),
        "truncated": np.zeros(4, np.float32),
    }, dims=("env",))
    return batch.to_torch(), tokens, attn, mask


def exact_reverse_kl(student, teacher, tokens, attn, mask, per_token: bool = False) -> float:
    """sum_v p(v) (log p(v) - log q(v)) at every response position, in float64, averaged per response then over
    responses (loss_agg: sequence), or over all response tokens (``per_token``: what the update logs)."""
    with torch.no_grad():
        p = student.next_token_logprobs(tokens, attn).double()
        q = teacher.next_token_logprobs(tokens, attn).double()
    per = (p.exp() * (p - q)).sum(-1)
    if per_token:
        return float((per * mask).sum() / mask.sum())
    return float(((per * mask).sum(1) / mask.sum(1)).mean())


def test_the_full_estimators_loss_is_the_exact_reverse_kl_and_updates_lower_it():
    student, teacher = policies()
    run = run_config("{name: opd, expert_checkpoint: teacher.pt, learning_rate: 0.01, minibatch_size: 4}")
    batch, tokens, attn, mask = responses(student)
    kl0 = exact_reverse_kl(student, teacher, tokens, attn, mask)
    assert kl0 > 0.5
    kl0_tokens = exact_reverse_kl(student, teacher, tokens, attn, mask, per_token=True)
    algo = run.spec(student, run, torch.Generator().manual_seed(0), expert=teacher)
    stats = algo.update(batch)
    # the logged KL and the loss are the KL before the step (the policy-gradient term is zero under this estimator)
    assert stats["reverse_kl"] == pytest.approx(kl0_tokens, rel=1e-4)
    assert stats["loss"] == pytest.approx(kl0, rel=1e-4)
    for _ in range(20):
        stats = algo.update(batch)
    assert exact_reverse_kl(student, teacher, tokens, attn, mask) < 0.5 * kl0
    assert all(not p.requires_grad or p.grad is None or p.grad.abs().sum() == 0 for p in teacher.parameters())


def test_the_sampled_estimators_advantages_are_the_negative_per_token_log_ratios():
    student, teacher = policies()
    run = run_config("{name: opd, expert_checkpoint: t.pt, estimator: sampled, kl_scale: 2.0, minibatch_size: 4}")
    batch, tokens, attn, mask = responses(student)
    algo = run.spec(student, run, torch.Generator().manual_seed(0), expert=teacher)
    with torch.no_grad():
        old, teach = student.token_logprobs(tokens, attn), teacher.token_logprobs(tokens, attn)
    seq = {"tokens": tokens, "attention_mask": attn}
    adv = algo.advantages(batch, seq, mask, old, None)
    assert torch.allclose(adv, -2.0 * (old - teach) * mask, atol=1e-6)
    assert algo.kl_sum / algo.kl_tokens == pytest.approx(float(((old - teach) * mask).sum() / mask.sum()), rel=1e-5)
    stats = algo.update(batch)
    assert stats["reverse_kl"] == pytest.approx(float(((old - teach) * mask).sum() / mask.sum()), rel=1e-4)


def test_opd_refuses_a_missing_teacher_and_a_teacher_with_another_vocabulary():
    from rlfabric.services.core.spec_yaml import ConfigError

    with pytest.raises(ConfigError, match="expert_checkpoint is empty"):
        run_config("{name: opd}")
    run = run_config(OPD)
    student, teacher = policies()
    teacher.model.resize_token_embeddings(teacher.model.get_output_embeddings().weight.shape[0] + 8)
    with pytest.raises(ValueError, match="vocabulary"):
        run.spec(student, run, torch.Generator().manual_seed(0), expert=teacher)
