"""The LM policy-gradient losses on hand-made batches: GSPO's sequence ratio and its per-sequence clip, CISPO's
stop-gradient clipped IS weight, the rollout correction (TIS and MIS, token and sequence level) and what it logs,
and, with the correction off, the very numbers the GRPO family gave before it existed."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import Ragged, TensorBatch

ANSWERS = [" 4", " 1234567", " 5", " 12", " 98765", " 3", " 777777777", " 0"]
REWARDS = [1, 0, 1, 0, 0, 1, 0, 1]


def lm_step(body: str, noise: float = 0.0):
    """One update by the algorithm ``body`` (its YAML mapping) on 8 uneven responses, 4 to each of 2 questions,
    whose engine log-probs are the policy's own plus ``noise`` * N(0, 1) per response token (an engine that does not
    quite agree with the learner), with a reference policy a little away from the policy: the parameters after the
    update, and its stats."""
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.models import build_policy

    text = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
    run = parse_config(f"""
name: t
seed: 0
env: {{adapter: text, id: arith, num_envs: 8, eval_envs: 4, options: {{group_size: 4}}}}
policy: {{lm: {{hidden_size: 64, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}}}
algorithm: {{learning_rate: 0.01, minibatch_size: 8, {body}}}
""")
    torch.manual_seed(0)
    policy = build_policy(run.spec.policy, {"observation_space": text, "action_space": text}, run.policy)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    tok = policy.tokenizer
    rows, masks = [], []
    for i, a in enumerate(ANSWERS):
        prompt = [1, *tok.encode(("Q: 2+2= A:", "Q: 10+15= A:")[i // 4], add_special_tokens=False)]
        rows.append(prompt + tok.encode(a, add_special_tokens=False) + [2])
        masks.append([0] * len(prompt) + [1] * (len(rows[-1]) - len(prompt)))
    jitter = torch.Generator().manual_seed(1)
    engine = []
    with torch.no_grad():
        for r, m in zip(rows, masks, strict=True):
            t = torch.tensor([r])
            lp = policy.token_logprobs(t, torch.ones_like(t))[0]
            lp = lp + noise * torch.randn(lp.shape, generator=jitter)
            engine.append(np.concatenate([[0.0], lp.numpy() * np.array(m[1:])]))
    batch = TensorBatch({
        "tokens": Ragged.from_rows(rows, dtype=np.int64), "loss_mask": Ragged.from_rows(masks, dtype=np.uint8),
        "logp": Ragged.from_rows(engine, dtype=np.float32), "rewards": np.array(REWARDS, np.float32),
        "group": np.arange(8) // 4, "response_tokens": np.array([sum(m) for m in masks]),
        "truncated": np.zeros(8, np.float32),
    }, dims=("env",))
    algo = run.spec(policy, run, torch.Generator().manual_seed(0), reference=reference)
    stats = algo.update(batch.to_torch())
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}, stats


# -- GSPO -------------------------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_is_the_exp_of_the_mean_token_log_ratio():
    from rlfabric.services.learner.algorithms.gspo import gspo_surrogate, sequence_log_ratio

    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.2, -0.3, 5.0, 5.0]])
    old = torch.tensor([[-1.5, -1.0, -0.25, 0.0], [-0.1, -0.6, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # masked positions play no part
    s = sequence_log_ratio(logp, old, mask).exp()
    want = torch.tensor([[np.exp((0.5 - 1.0 - 0.25) / 3)], [np.exp((-0.1 + 0.3) / 2)]], dtype=torch.float32)
    torch.testing.assert_close(s, want)
    adv = torch.tensor([[1.0], [-2.0]]).expand(2, 4)
    loss, outside = gspo_surrogate(logp, old, adv, mask, low=0.5, high=0.5)  # a wide band: nothing clipped
    torch.testing.assert_close(loss, (-want * adv[:, :1]).expand(2, 4))
    assert outside.sum() == 0


def test_gspo_clips_per_sequence_and_zeroes_the_whole_response_pushed_outward():
    """Response 0: s_i inside the band, every token learns. 1: s_i above it with A > 0, no token learns, although its
    first token's own ratio is below 1. 2: s_i below it with A < 0, no gradient. 3: s_i above it with A < 0: the
    advantage pulls it back in, so it learns."""
    from rlfabric.services.learner.algorithms.gspo import gspo_surrogate

    old = torch.zeros(4, 2)
    logp = torch.tensor([[0.0001, -0.0001], [-0.01, 0.05], [-0.02, -0.02], [0.03, 0.01]], requires_grad=True)
    mask = torch.ones(4, 2)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])[:, None].expand(4, 2)
    loss, outside = gspo_surrogate(logp, old, adv, mask, low=3e-4, high=4e-4)
    assert outside[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0]
    (loss * mask).sum(1).div(2).sum().backward()  # the mean of each response's tokens (loss_agg: sequence)
    g = logp.grad
    assert (g[0] != 0).all() and (g[1] == 0).all() and (g[2] == 0).all() and (g[3] != 0).all()
    s0, s3 = float(np.exp(0.0)), float(np.exp(0.02))
    # inside: d(-s A)/d logp_t = -s A / |y| for every token of the response
    torch.testing.assert_close(g[0], torch.full((2,), -s0 * 1.0 / 2))
    torch.testing.assert_close(g[3], torch.full((2,), -s3 * -1.0 / 2))


def test_gspo_token_has_gspos_value_and_gradient_with_one_advantage_per_response():
    from rlfabric.services.learner.algorithms.gspo import gspo_surrogate

    torch.manual_seed(0)
    base, old = 0.01 * torch.randn(3, 5), torch.zeros(3, 5)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]])
    adv = torch.tensor([0.5, -1.0, 2.0])[:, None].expand(3, 5)
    out = []
    for token in (False, True):
        logp = base.clone().requires_grad_()
        loss, outside = gspo_surrogate(logp, old, adv, mask, 3e-4, 4e-4, token_gradient=token)
        (loss * mask).sum().backward()
        out.append((loss.detach(), outside, logp.grad))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a * mask, b * mask)


# -- CISPO ------------------------------------------------------------------------------------------------------
def test_cispo_weight_has_no_gradient_and_clipped_tokens_still_learn():
    from rlfabric.services.learner.algorithms.cispo import cispo_surrogate
    from rlfabric.services.learner.algorithms.grpo import clipped_surrogate

    ratios = torch.tensor([[1.0, 2.0, 0.1, 1.1]])  # inside, above 1 + 0.28, far below 1, inside
    old = torch.full((1, 4), -1.0)
    logp = (old + ratios.log()).requires_grad_()
    adv = torch.ones(1, 4)
    loss, clipped = cispo_surrogate(logp, old, adv, low=None, high=0.28)
    w = torch.tensor([[1.0, 1.28, 0.1, 1.1]])  # no lower bound: 0.1 stays 0.1
    torch.testing.assert_close(loss.detach(), -w * logp.detach())
    assert clipped.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    loss.sum().backward()
    # the gradient is -sg(w) A d log pi: no term from w (which would add -A * w * log pi per token)
    torch.testing.assert_close(logp.grad, -w)
    assert (logp.grad != 0).all()  # the clipped token still learns...
    ppo = logp.detach().clone().requires_grad_()
    clipped_surrogate(ppo, old, adv, 0.2, 0.28)[0].sum().backward()
    assert ppo.grad[0, 1] == 0  # ... where PPO's clip drops it
    _, clipped = cispo_surrogate(logp, old, adv, low=0.2, high=0.28)
    assert clipped.tolist() == [[0.0, 1.0, 1.0, 0.0]]  # a lower bound when asked for one


# -- rollout correction -----------------------------------------------------------------------------------------
# rho per token (engine at 0): response 0 has 3 tokens, response 1 two (its last position masked out), response
# 2 four
RHO = torch.tensor([[1.0, 3.0, 0.25, 1.0], [1.5, 0.8, 7.0, 1.0], [0.9, 1.1, 1.2, 0.6]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])


def _correct(**kw):
    from rlfabric.services.learner.algorithms.rollout_correction import RolloutCorrection, rollout_weights

    learner = RHO.log().requires_grad_()
    return rollout_weights(learner, torch.zeros(3, 4), MASK, RolloutCorrection(**kw))


def test_tis_truncates_each_token_at_the_cap():
    w, stats = _correct(mode="tis", level="token", cap=2.0)
    want = torch.tensor([[1.0, 2.0, 0.25, 1.0], [1.5, 0.8, 1.0, 1.0], [0.9, 1.1, 1.2, 0.6]])  # masked-out: 1
    torch.testing.assert_close(w, want)
    assert not w.requires_grad
    live = RHO[MASK > 0]
    assert stats["rollout_is_truncated_fraction"] == pytest.approx(1 / 9)  # the 3.0
    assert stats["rollout_is_ratio_mean"] == pytest.approx(float(live.mean()), rel=1e-6)
    assert stats["rollout_is_ratio_std"] == pytest.approx(float(live.std(correction=0)), rel=1e-5)
    assert "rollout_is_masked_fraction" not in stats


def test_mis_masks_each_token_outside_the_band():
    w, stats = _correct(mode="mis", level="token", low=0.5, high=2.0)
    want = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(w, want)
    assert stats["rollout_is_masked_fraction"] == pytest.approx(2 / 9)  # 3.0 and 0.25 (7.0 is masked out)


def test_sequence_level_weighs_and_masks_whole_responses():
    seq = torch.tensor([3.0 * 0.25, 1.5 * 0.8, 0.9 * 1.1 * 1.2 * 0.6])  # 0.75, 1.2, 0.7128
    w, stats = _correct(mode="tis", level="sequence", cap=1.0)
    torch.testing.assert_close(w, torch.where(MASK > 0, seq.clamp(max=1.0)[:, None], torch.ones(3, 4)))
    assert stats["rollout_is_truncated_fraction"] == pytest.approx(1 / 3)  # response 1 (1.2), as 1 of 3 responses
    assert stats["rollout_is_ratio_mean"] == pytest.approx(float(seq.mean()), rel=1e-6)
    assert stats["rollout_is_ratio_std"] == pytest.approx(float(seq.std(correction=0)), rel=1e-5)
    w, stats = _correct(mode="mis", level="sequence", low=0.74, high=1.3)
    torch.testing.assert_close(w, torch.tensor([[1.0] * 4, [1.0] * 4, [0.0, 0.0, 0.0, 0.0]]))
    assert stats["rollout_is_masked_fraction"] == pytest.approx(1 / 3)  # response 2 (0.7128), all its tokens
    geo = torch.stack([RHO[i][MASK[i] > 0].log().mean().exp() for i in range(3)])
    w, stats = _correct(mode="mis", level="geometric", low=0.915, high=1.3)
    assert (geo > 0.915).tolist() == [False, True, True]  # 0.909, 1.095, 0.919
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0] * 4, [1.0] * 4]))
    assert stats["rollout_is_masked_fraction"] == pytest.approx(1 / 3)
    assert stats["rollout_is_ratio_mean"] == pytest.approx(float(geo.mean()), rel=1e-6)


def test_rollout_correction_config_is_checked():
    from rlfabric.services.core.config import ConfigError, parse_config

    def parse(body: str):
        return parse_config(f"""
name: t
env: {{adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {{group_size: 2}}}}
policy: {{lm: {{hidden_size: 64, intermediate_size: 128, layers: 1, heads: 1, max_positions: 32}}}}
algorithm: {{{body}}}
""")

    assert parse("name: grpo").algorithm.rollout_correction.mode == "none"
    run = parse("name: cispo, behaviour: proximal, rollout_correction: {mode: mis, level: sequence}")
    assert run.algorithm.rollout_correction.high == 2.0
    for body, says in [("name: gspo, rollout_correction: {mode: tis}", "behaviour: proximal"),
                       ("name: grpo, behaviour: proximal, tis_cap: 2, rollout_correction: {mode: tis}", "tis_cap"),
                       ("name: dapo, behaviour: proximal, rollout_correction: {mode: mis, low: 1, high: 1}", "low"),
                       ("name: ppo_lm, behaviour: proximal, rollout_correction: {mode: is}", "mode")]:
        with pytest.raises((ConfigError, ValueError), match=says):
            parse(body)


# -- one update of every LM policy-gradient algorithm -----------------------------------------------------------
LM_PG = ["grpo", "dapo, train_groups: 2", "reinforce_pp", "ppo_lm", "gspo", "cispo"]


@pytest.mark.parametrize("algorithm", LM_PG)
def test_every_lm_algorithm_applies_the_rollout_correction(algorithm):
    """The same correction section on each: a band no response's ratio is inside masks every one, so the policy-
    gradient loss is 0 (ppo_lm keeps its value loss); a band every ratio is inside changes nothing; TIS weighs by
    rho; and what is logged is there."""
    mis = "behaviour: proximal, rollout_correction: {mode: mis, level: sequence, low: 0.999, high: 1.001}"
    _, stats = lm_step(f"name: {algorithm}, {mis}", noise=0.3)
    assert stats["rollout_is_masked_fraction"] == 1.0 and stats["rollout_is_ratio_std"] > 0
    if algorithm == "ppo_lm":
        assert stats["loss"] == pytest.approx(0.1 * stats["value_loss"], rel=1e-5)
    else:
        assert stats["loss"] == 0.0
    plain, s1 = lm_step(f"name: {algorithm}, behaviour: proximal", noise=0.3)
    wide, s2 = lm_step(f"name: {algorithm}, behaviour: proximal, rollout_correction: {{mode: mis, low: 1e-9, "
                       f"high: 1e9}}", noise=0.3)
    assert s1["loss"] == s2["loss"] and all(torch.equal(plain[k], wide[k]) for k in plain)
    assert s2["rollout_is_masked_fraction"] == 0.0 and "rollout_is_ratio_mean" not in s1
    tis, s3 = lm_step(f"name: {algorithm}, behaviour: proximal, rollout_correction: {{mode: tis, cap: 1.1}}",
                      noise=0.3)
    assert 0 < s3["rollout_is_truncated_fraction"] < 1 and not all(torch.equal(plain[k], tis[k]) for k in plain)
    _, clean = lm_step(f"name: {algorithm}, behaviour: proximal, rollout_correction: {{mode: mis}}")
    assert clean["rollout_is_masked_fraction"] == 0.0  # an engine that agrees with the learner
    assert clean["rollout_is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)


# the numbers these updates gave before GSPO, CISPO and the rollout correction existed (rollout_correction: none,
# engine log-probs 0.3 * N(0, 1) off the learner's): loss, grad_norm, clip_fraction, and the sum of |parameters|
BEFORE = {
    "name: grpo": (0.06169982999563217, 1.5986621379852295, 0.5581395348837209, 1148.968931838056),
    "name: grpo, loss_agg: token, kl_coef: 0.1, epochs: 2, minibatch_size: 4":
        (0.5532491654157639, 2.799460470676422, 0.690836124659654, 1481.5794184632805),
    "name: dapo, train_groups: 2": (0.46821483969688416, 2.3515703678131104, 0.4883720930232558, 1150.6678915467355),
    "name: reinforce_pp, kl_coef: 0.05": (0.07064218819141388, 1.5225231647491455, 0.5581395348837209,
                                          1150.184405561683),
    "name: ppo_lm, epochs: 2, minibatch_size: 4": (0.07786012161523104, 2.148677945137024, 0.7044891383126677,
                                                   1472.2932790886161),
    "name: grpo, behaviour: proximal, tis_cap: 1.2, epochs: 2, minibatch_size: 4":
        (0.052665382623672485, 2.355160117149353, 0.5178155178155177, 1460.257215578852),
}


@pytest.mark.parametrize("body", list(BEFORE))
def test_without_a_rollout_correction_the_losses_are_the_ones_from_before(body):
    state, stats = lm_step(body, noise=0.3)
    loss, grad_norm, clip_fraction, params = BEFORE[body]
    assert stats["loss"] == pytest.approx(loss, rel=1e-4)
    assert stats["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert stats["clip_fraction"] == pytest.approx(clip_fraction, rel=1e-4)
    assert float(sum(v.double().abs().sum() for v in state.values())) == pytest.approx(params, rel=1e-4)
