"""bfloat16 where it pays: the learner's bf16-mixed updates (runtime.precision), a bf16 hf engine
(rollout.dtype) and the attention implementation (policy.lm.attention), each checked against fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import Ragged, TensorBatch
from rlfabric.services.core.runtime import learner_precision
from tests.lm_support import SPEC, lm_run, perturb

TEXT = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}


def test_bf16_mixed_drops_its_weight_copies_at_every_optimizer_step():
    """autocast keeps one bf16 copy of each weight per context; without the step hook a second minibatch in the
    same update would run on the weights from before the first step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    with learner_precision("bf16-mixed", "cpu"):
        first = layer(x)
        assert first.dtype == torch.bfloat16
        first.sum().backward()
        opt.step()
        second = layer(x)
    fresh = torch.nn.functional.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16())
    assert not torch.equal(first, second)
    assert torch.equal(second, fresh)
    assert layer.weight.dtype == torch.float32  # the master weights stay fp32
    with learner_precision("fp32", "cpu"):
        assert layer(x).dtype == torch.float32


def _grpo_batch(policy, answers: list[str]) -> tuple[TensorBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    tok = policy.tokenizer
    prompt = [1, *tok.encode("Q: 2+2= A:", add_special_tokens=False)]
    rows = [prompt + tok.encode(a, add_special_tokens=False) + [2] for a in answers]
    masks = [[0] * len(prompt) + [1] * (len(r) - len(prompt)) for r in rows]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])[:, 1:].float()
    with torch.no_grad():
        before = policy.token_logprobs(tokens, attn)
    engine = [np.concatenate([[0.0], (before[i, :len(r) - 1] * mask[i, :len(r) - 1]).numpy()])
              for i, r in enumerate(rows)]
    batch = TensorBatch({
        "tokens": Ragged.from_rows(rows, dtype=np.int64), "loss_mask": Ragged.from_rows(masks, dtype=np.uint8),
        "logp": Ragged.from_rows(engine, dtype=np.float32), "rewards": np.array([1, 0, 0, 0], np.float32),
        "group": np.zeros(len(rows), np.int64), "response_tokens": np.array([sum(m) for m in masks]),
        "truncated": np.zeros(len(rows), np.float32)}, dims=("env",))
    return batch, tokens, attn, mask


@pytest.mark.parametrize("micro", [0, 2])
def test_a_bf16_mixed_grpo_update_moves_toward_the_rewarded_response_like_fp32(micro):
    """The same update under fp32 and bf16-mixed (one pass, and passes of 2): the rewarded response gains in
    both, the parameters move alike, and the weights and optimizer state stay fp32."""
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.models import build_policy

    run = parse_config(f"""
name: t
seed: 0
env: {{adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {{group_size: 4}}}}
policy: {{lm: {{hidden_size: 64, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}}}
algorithm: {{name: grpo, learning_rate: 0.01, minibatch_size: 2, epochs: 2, micro_batch_size: {micro}}}
""")
    moved = {}
    for precision in ("fp32", "bf16-mixed"):
        torch.manual_seed(0)
        policy = build_policy("causal_lm", {"observation_space": TEXT, "action_space": TEXT}, run.policy)
        start = {k: v.clone() for k, v in policy.state_dict().items()}
        batch, tokens, attn, mask = _grpo_batch(policy, [" 4", " 5", " 61", " 7"])
        algo = run.spec(policy, run, torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = (policy.token_logprobs(tokens, attn) * mask).sum(1)
        with learner_precision(precision, "cpu"):
            stats = algo.update(batch.to_torch())
        with torch.no_grad():
            after = (policy.token_logprobs(tokens, attn) * mask).sum(1)
        assert after[0] > before[0] and after[1:].mean() < before[1:].mean(), precision
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        assert all(s.dtype == torch.float32 for st in algo.optimizer.state.values() for s in st.values()
                   if torch.is_tensor(s) and s.is_floating_point())
        assert np.isfinite(stats["loss"]) and stats["updated"] == 1.0
        moved[precision] = torch.cat([(v - start[k]).flatten() for k, v in policy.state_dict().items()])
    cosine = torch.nn.functional.cosine_similarity(moved["fp32"], moved["bf16-mixed"], dim=0)
    assert cosine > 0.9, f"bf16-mixed moved the weights elsewhere than fp32 (cosine {cosine:.3f})"


def test_eager_attention_gives_the_log_probs_of_sdpa():
    from rlfabric.services.core.models import build_policy

    out = {}
    for attention in ("sdpa", "eager"):
        run = lm_run()
        run.policy.lm.attention = attention
        torch.manual_seed(0)
        policy = build_policy("causal_lm", SPEC, run.policy)
        assert policy.model.config._attn_implementation == attention
        tokens = torch.randint(3, 90, (3, 12), generator=torch.Generator().manual_seed(1))
        attn = torch.ones_like(tokens)
        attn[1, 8:] = 0  # right padding
        with torch.no_grad():
            out[attention] = policy.token_logprobs(tokens, attn)[:, :7]
    assert torch.allclose(out["sdpa"], out["eager"], atol=1e-5)


def test_a_bfloat16_hf_engine_samples_what_an_fp32_learner_scores_closely():
    """rollout.dtype bfloat16: the engine's weights are bf16 (fp32 versions cast on load) and its log-probs of
    its own samples stay within bf16 rounding of the fp32 learner's; float32 stays exact."""
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.rollout.backends.hf import HFBackend

    gaps = {}
    for dtype in ("float32", "bfloat16"):
        run = lm_run()
        run.rollout.dtype = dtype
        backend = HFBackend(run, SPEC, "cpu")
        learner = perturb(build_policy("causal_lm", SPEC, run.policy), 5)
        backend.load(1, learner.state_dict())
        assert next(backend.policy.parameters()).dtype == getattr(torch, dtype)
        prompts = [[1, *backend.encode(p)] for p in ("Q: 1+2= A:", "Q: 13+4= A:")] * 4
        deltas = []
        for prompt, g in zip(prompts, backend.generate(prompts, 8, sample=True), strict=True):
            assert len(g.tokens) > 0 and np.isfinite(g.logp).all()
            seq = torch.tensor([prompt + g.tokens.tolist()])
            with torch.no_grad():
                lp = learner.token_logprobs(seq, torch.ones_like(seq))[0, len(prompt) - 1:]
            deltas.append(np.abs(lp.numpy() - g.logp))
        gaps[dtype] = float(np.concatenate(deltas).mean())
    assert gaps["float32"] < 1e-4
    assert 0 < gaps["bfloat16"] < 0.1
