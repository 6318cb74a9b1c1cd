"""The math of the language-model algorithms, on hand-made batches: group advantages, the clipped surrogate,
the KL estimator, and one GRPO update moving probability toward the better response of a group (GSPO's and
CISPO's losses and the rollout correction: test_lm_losses.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import Ragged, TensorBatch
from rlfabric.services.learner.algorithms.grpo import clipped_surrogate, group_advantages, k3


def test_group_advantages_centre_and_scale_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0])
    group = torch.tensor([7, 7, 7, 7, 3, 3])
    adv = group_advantages(rewards, group, scale=True)
    first = rewards[:4] - rewards[:4].mean()
    assert torch.allclose(adv[:4], first / (rewards[:4].std() + 1e-6))
    assert torch.allclose(adv[4:], torch.zeros(2))  # an all-same group carries no signal
    assert torch.allclose(group_advantages(rewards, group, scale=False)[:4], first)


def test_clip_higher_lets_good_tokens_rise_further_than_bad_ones_fall():
    logp = torch.log(torch.tensor([1.5, 0.5]))  # ratios 1.5 and 0.5 against old = 0
    old = torch.zeros(2)
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([1.0, -1.0]), low=0.2, high=0.28)
    assert torch.allclose(loss, torch.tensor([-1.28, 0.8]))  # both clipped, at 1 + high and 1 - low
    assert clipped.tolist() == [1.0, 1.0]


def test_k3_is_a_non_negative_kl_estimate_that_vanishes_at_equality():
    a, b = torch.randn(1000), torch.randn(1000)
    assert (k3(a, b) >= 0).all() and torch.allclose(k3(a, a), torch.zeros(1000))


@pytest.fixture
def lm_run():
    from rlfabric.services.core.config import parse_config

    return parse_config("""
name: t
seed: 0
env: {adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {group_size: 4}}
policy: {lm: {hidden_size: 64, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}
rollout: {backend: hf}
algorithm: {name: grpo, learning_rate: 0.01, minibatch_size: 4}
""")


def test_a_grpo_update_raises_the_likelihood_of_the_rewarded_response(lm_run):
    from rlfabric.services.core.models import build_policy

    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
    torch.manual_seed(0)
    policy = build_policy("causal_lm", {"observation_space": text, "action_space": text}, lm_run.policy)
    tok = policy.tokenizer
    prompt = [1, *tok.encode("Q: 2+2= A:", add_special_tokens=False)]
    answers = [" 4", " 5", " 6", " 7"]
    rows = [prompt + tok.encode(a, add_special_tokens=False) + [2] for a in answers]
    masks = [[0] * len(prompt) + [1] * (len(r) - len(prompt)) for r in rows]
    tokens = torch.tensor(rows)
    attn = torch.ones_like(tokens)
    mask = torch.tensor(masks)[:, 1:].float()
    with torch.no_grad():
        before = policy.token_logprobs(tokens, attn)
    engine = [np.concatenate([[0.0], (before[i] * mask[i]).numpy()]) for i in range(4)]
    batch = TensorBatch({
        "tokens": Ragged.from_rows(rows, dtype=np.int64), "loss_mask": Ragged.from_rows(masks, dtype=np.uint8),
        "logp": Ragged.from_rows(engine, dtype=np.float32), "rewards": np.array([1, 0, 0, 0], np.float32),
        "group": np.zeros(4, np.int64), "response_tokens": np.full(4, 3), "truncated": np.zeros(4, np.float32),
    }, dims=("env",))
    algo = lm_run.spec(policy, lm_run, torch.Generator().manual_seed(0))
    stats = algo.update(batch.to_torch())
    with torch.no_grad():
        after = policy.token_logprobs(tokens, attn)
    seq = lambda lp: (lp * mask).sum(1)  # noqa: E731
    assert seq(after)[0] > seq(before)[0] and seq(after)[1:].mean() < seq(before)[1:].mean()
    assert stats["logprob_mismatch_abs"] < 1e-5  # the "engine" log-probs were the learner's own
    assert stats["reward_mean"] == pytest.approx(0.25)


def test_gae_over_response_tokens_skips_masked_positions_and_matches_a_hand_computation():
    from rlfabric.services.learner.algorithms.ppo_lm import gae

    # one row: response tokens at positions 0, 1, 3 (position 2 is a tool output, masked out); reward at the end
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 0.4]])  # the masked value (9) must play no part
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    gamma, lam = 0.9, 0.8
    d3 = 1.0 - 0.4                        # last response token: no bootstrap
    d1 = 0.0 + gamma * 0.4 - 0.2          # bootstraps from position 3 across the tool output
    d0 = 0.0 + gamma * 0.2 - 0.5
    a3, a1 = d3, d1 + gamma * lam * d3
    a0 = d0 + gamma * lam * a1
    torch.testing.assert_close(gae(rewards, values, mask, gamma, lam), torch.tensor([[a0, a1, 0.0, a3]]))


def test_a_ppo_update_with_a_value_head_raises_the_rewarded_response_and_fits_the_values():
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.models import build_policy

    run = parse_config("""
name: t
seed: 0
env: {adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {group_size: 1}}
policy: {lm: {hidden_size: 64, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}
algorithm: {name: ppo_lm, learning_rate: 0.003, minibatch_size: 4, epochs: 2, vf_coef: 0.5}
""")
    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
    torch.manual_seed(0)
    policy = build_policy(run.spec.policy, {"observation_space": text, "action_space": text}, run.policy)
    assert policy.has_value and run.spec.policy == "causal_lm_value"
    tok = policy.tokenizer
    prompt = [1, *tok.encode("Q: 2+2= A:", add_special_tokens=False)]
    rows = [prompt + tok.encode(a, add_special_tokens=False) + [2] for a in (" 4", " 5", " 6", " 7")]
    masks = [[0] * len(prompt) + [1] * (len(r) - len(prompt)) for r in rows]
    tokens, attn = torch.tensor(rows), torch.ones(4, len(rows[0]), dtype=torch.long)
    mask = torch.tensor(masks)[:, 1:].float()
    with torch.no_grad():
        before, v_before = policy.token_logprobs_values(tokens, attn)
    engine = [np.concatenate([[0.0], (before[i] * mask[i]).numpy()]) for i in range(4)]
    batch = TensorBatch({
        "tokens": Ragged.from_rows(rows, dtype=np.int64), "loss_mask": Ragged.from_rows(masks, dtype=np.uint8),
        "logp": Ragged.from_rows(engine, dtype=np.float32), "rewards": np.array([1, 0, 0, 0], np.float32),
        "group": np.arange(4), "response_tokens": np.full(4, 3), "truncated": np.zeros(4, np.float32),
    }, dims=("env",))
    stats = run.spec(policy, run, torch.Generator().manual_seed(0)).update(batch.to_torch())
    with torch.no_grad():
        after, v_after = policy.token_logprobs_values(tokens, attn)
    digit = len(prompt)  # log p of the answer's digit (the space before it and the end token are shared by all rows)
    assert after[0, digit] > before[0, digit] and after[1:, digit].mean() < before[1:, digit].mean()
    last = mask.cumsum(1) == mask.sum(1, keepdim=True)  # each response's last token: V there should approach r
    target = torch.tensor([1.0, 0, 0, 0])
    err = lambda v: (v[last & (mask > 0)] - target).abs().mean()  # noqa: E731
    assert float(err(v_after)) < float(err(v_before))
    assert stats["value_loss"] > 0 and "explained_variance" in stats


def _step_on_uneven_responses(algorithm: str, questions: tuple[str, str] = ("Q: 2+2= A:", "Q: 2+2= A:")):
    """One update by ``algorithm`` (the body of its YAML mapping) on 8 responses of uneven length, 4 to each
    question, whose engine log-probs are the policy's own: the parameters after it, and its stats."""
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.models import build_policy

    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
    answers = [" 4", " 1234567", " 5", " 12", " 98765", " 3", " 777777777", " 0"]
    run = parse_config(f"""
name: t
seed: 0
env: {{adapter: text, id: arith, num_envs: 8, eval_envs: 4, options: {{group_size: 4}}}}
policy: {{lm: {{hidden_size: 64, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}}}
algorithm: {{learning_rate: 0.01, minibatch_size: 8, {algorithm}}}
""")
    torch.manual_seed(0)
    policy = build_policy(run.spec.policy, {"observation_space": text, "action_space": text}, run.policy)
    tok = policy.tokenizer
    rows, masks = [], []
    for i, a in enumerate(answers):
        prompt = [1, *tok.encode(questions[i // 4], add_special_tokens=False)]
        rows.append(prompt + tok.encode(a, add_special_tokens=False) + [2])
        masks.append([0] * len(prompt) + [1] * (len(rows[-1]) - len(prompt)))
    engine = []
    with torch.no_grad():
        for r, m in zip(rows, masks, strict=True):
            t = torch.tensor([r])
            lp = policy.token_logprobs(t, torch.ones_like(t))[0].numpy()
            engine.append(np.concatenate([[0.0], lp * np.array(m[1:])]))
    batch = TensorBatch({
        "tokens": Ragged.from_rows(rows, dtype=np.int64), "loss_mask": Ragged.from_rows(masks, dtype=np.uint8),
        "logp": Ragged.from_rows(engine, dtype=np.float32),
        "rewards": np.array([1, 0, 1, 0, 0, 1, 0, 1], np.float32), "group": np.arange(8) // 4,
        "response_tokens": np.array([sum(m) for m in masks]), "truncated": np.zeros(8, np.float32),
    }, dims=("env",))
    stats = run.spec(policy, run, torch.Generator().manual_seed(0)).update(batch.to_torch())
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}, stats


@pytest.mark.parametrize("algorithm, agg", [("grpo", "sequence"), ("grpo", "token"), ("ppo_lm", "token"),
                                            ("gspo", "sequence"), ("cispo", "token")])
def test_length_grouped_micro_batches_take_the_same_step_as_one_pass(algorithm, agg):
    """algorithm.micro_batch_size splits a minibatch into passes of similar length (each padded only to its own
    longest row) whose gradients add up to exactly the one-pass step, for uneven responses."""
    (one, s1), (micro, s2) = [
        _step_on_uneven_responses(f"name: {algorithm}, loss_agg: {agg}, micro_batch_size: {size}") for size in (0, 3)]
    # the same loss and gradient; parameters agree to float summation order (Adam's first step is about lr * sign
    # of each gradient entry, so an entry near zero may differ by a fraction of lr = 0.01)
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)
    assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-4)
    moved = max(float((one[k] - v).abs().max()) for k, v in micro.items())
    assert moved < 1e-3, f"micro-batched step differs from the one-pass step by {moved}"
    assert s2["logprob_mismatch_abs"] < 1e-5 and s1["clip_fraction"] == pytest.approx(s2["clip_fraction"])


def test_shared_prompt_log_probs_equal_the_full_passes_for_uneven_prompts_and_responses():
    """shared_prompt_logprobs runs each distinct prompt once (left-padded together) and each response on its
    owner's KV cache: every response token's log-prob and the gradient equal the plain full-row pass."""
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.learner.algorithms.grpo import shared_prefixes

    run = parse_config("""
name: t
env: {adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {group_size: 2}}
policy: {lm: {hidden_size: 64, intermediate_size: 128, layers: 2, heads: 1, max_positions: 48}}
algorithm: {name: grpo, share_prompt: true}
""")
    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
    torch.manual_seed(0)
    policy = build_policy("causal_lm", {"observation_space": text, "action_space": text}, run.policy)
    tok = policy.tokenizer
    prompts = {0: "Q: 2+2= A:", 1: "Q: 117+29= A:", 2: "Q: 3*3= A:"}
    groups = [0, 0, 0, 1, 1, 2, 2]
    answers = [" 4", " 1234", " 5", " 146", " 9", " 99999", " 1"]
    rows = [[1, *tok.encode(prompts[g], add_special_tokens=False)] + tok.encode(a, add_special_tokens=False) + [2]
            for g, a in zip(groups, answers, strict=True)]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attn = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    plen = torch.tensor([1 + len(tok.encode(prompts[g], add_special_tokens=False)) for g in groups])
    loss_mask = ((torch.arange(width)[None] >= plen[:, None]) & (attn > 0)).long()
    loss_mask[5, :] = 0  # a row with nothing trained stays in its group's prompt
    loss_mask[5, plen[5] + 2] = 1
    prefix, owner = shared_prefixes(tokens, attn, loss_mask, torch.tensor(groups) * 10)
    assert prefix.tolist() == plen.tolist() and len(set(owner.tolist())) == 3
    mask = loss_mask[:, 1:].float()
    full = policy.token_logprobs(tokens, attn)
    (full * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    shared = policy.shared_prompt_logprobs(tokens, attn, prefix, owner)
    (shared * mask).sum().backward()
    assert torch.allclose((shared * mask), (full * mask).detach(), atol=1e-5)
    for n, p in policy.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-5, rtol=1e-4), n
    # a group whose rows part early shares only what they have in common; one that differs at once does not share
    odd = tokens.clone()
    odd[1, 2] += 1
    prefix, owner = shared_prefixes(odd, attn, loss_mask, torch.tensor(groups))
    assert prefix[:3].tolist() == [2, 2, 2] and len(set(owner[:3].tolist())) == 1
    odd[1, 0] += 1
    prefix, owner = shared_prefixes(odd, attn, loss_mask, torch.tensor(groups))
    assert prefix[:3].tolist() == plen[:3].tolist() and len(set(owner[:3].tolist())) == 3
    assert torch.allclose(policy.shared_prompt_logprobs(odd, attn, prefix, owner) * mask,
                          policy.token_logprobs(odd, attn) * mask, atol=1e-5)


@pytest.mark.parametrize("algorithm, micro", [("grpo", 0), ("grpo", 4), ("gspo", 4), ("cispo", 0)])
def test_share_prompt_takes_the_same_grpo_step(algorithm, micro):
    """algorithm.share_prompt: the same loss, gradient norm and parameters as the plain update."""
    (plain, s1), (shared, s2) = [
        _step_on_uneven_responses(f"name: {algorithm}, micro_batch_size: {micro}, share_prompt: {share}",
                                  ("Q: 2+2= A:", "Q: 10+15= A:")) for share in ("false", "true")]
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)
    assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-4)
    moved = max(float((plain[k] - v).abs().max()) for k, v in shared.items())
    assert moved < 1e-3, f"the shared-prompt step differs from the plain step by {moved}"
    assert s2["logprob_mismatch_abs"] < 1e-5


def test_share_prompt_is_refused_where_the_forward_pass_has_a_value_head():
    from rlfabric.services.core.config import ConfigError, parse_config

    with pytest.raises((ConfigError, ValueError), match="share_prompt"):
        parse_config("""
name: t
env: {adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {group_size: 2}}
policy: {lm: {hidden_size: 64, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}
algorithm: {name: ppo_lm, share_prompt: true}
""")
