"""CrossQ's pieces: BatchRenorm against BatchNorm and its own formula, the critics' joint forward of (s, a) and
(s', a'), no target networks, and a few update steps that fit a fixed regression target."""

from __future__ import annotations

import torch

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models.batch_renorm import BatchRenorm
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.learner.algorithms.crossq import CrossQ

SPEC = {"observation_space": {"kind": "box", "shape": [3], "dtype": "float32"},
        "action_space": {"kind": "box", "shape": [2], "dtype": "float32", "low": [-2.0, 0.0], "high": [2.0, 1.0]}}


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 4, generator=g) * 3 + 2 for _ in range(n)]


def test_brn_is_batchnorm_during_warm_up():
    brn, bn = BatchRenorm(4, momentum=0.99, eps=1e-3, warmup_steps=5), torch.nn.BatchNorm1d(4, eps=1e-3, momentum=0.01)
    for x in batches(5):  # (torch's momentum is the new batch's weight: 1 - 0.99)
        assert torch.allclose(brn(x), bn(x), atol=1e-5)
    assert torch.allclose(brn.running_mean, bn.running_mean, atol=1e-5)
    assert int(brn.steps) == 5


def test_brn_renormalises_with_the_running_stats_after_warm_up():
    brn = BatchRenorm(4, warmup_steps=2, r_max=3.0, d_max=5.0)
    for x in batches(2):
        brn(x)
    x = batches(1, seed=1)[0] * 0.5 + 1  # a batch whose statistics differ from the running ones
    mu, var = brn.running_mean.clone(), brn.running_var.clone()
    std_b = (x.var(0, unbiased=False) + 1e-3).sqrt()
    sigma = (var + 1e-3).sqrt()
    r = (std_b / sigma).clamp(1 / 3, 3)
    d = ((x.mean(0) - mu) / sigma).clamp(-5, 5)
    want = (x - x.mean(0)) / std_b * r + d
    got = brn(x)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, (x - x.mean(0)) / std_b, atol=1e-2)  # not plain BatchNorm any more


def test_brn_in_eval_mode_uses_running_stats_and_leaves_them_alone():
    brn = BatchRenorm(4)
    for x in batches(3):
        brn(x)
    brn.eval()
    mu, var, steps = brn.running_mean.clone(), brn.running_var.clone(), int(brn.steps)
    x = batches(1, seed=2)[0]
    assert torch.allclose(brn(x), (x - mu) / (var + 1e-3).sqrt(), atol=1e-6)
    assert torch.allclose(brn(x[:1]), ((x - mu) / (var + 1e-3).sqrt())[:1], atol=1e-6)  # row by row alike
    assert torch.equal(brn.running_mean, mu) and int(brn.steps) == steps


def crossq(**algorithm) -> CrossQ:
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"algorithm": {"name": "crossq", "batch_size": 16, "learning_starts": 0,
                                                  "critic_hidden_sizes": [32, 32], **algorithm},
                                    "policy": {"hidden_sizes": [32], "activation": "relu"}})
    actor = SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy)
    return CrossQ(actor, cfg, torch.Generator().manual_seed(0), env_spec=SPEC)


def test_joint_forward_normalises_over_the_concatenated_batch():
    algo = crossq()  # in BatchRenorm's warm-up: each layer is BatchNorm over the batch it is given
    g = torch.Generator().manual_seed(3)
    obs, nxt = torch.randn(16, 3, generator=g), torch.randn(16, 3, generator=g) + 1
    a, a2 = torch.rand(16, 2, generator=g) * 2 - 1, torch.rand(16, 2, generator=g) * 2 - 1
    reference = {k: v.clone() for k, v in algo.q1.state_dict().items()}
    q, q_next = algo.q1(torch.cat([obs, nxt]), torch.cat([a, a2])).chunk(2)
    # by hand: every layer normalises over all 32 rows, (s, a) and (s', a') together
    x = torch.cat([torch.cat([obs, nxt]), torch.cat([a, a2])], -1)
    for layer in algo.q1.q:
        if isinstance(layer, BatchRenorm):
            x = (x - x.mean(0)) / (x.var(0, unbiased=False) + layer.eps).sqrt() * layer.weight + layer.bias
        else:
            x = layer(x)
    assert torch.allclose(torch.cat([q, q_next]), x.squeeze(-1), atol=1e-4)
    # two separate forwards normalise each half by its own statistics: different numbers
    algo.q1.load_state_dict(reference)
    separate = torch.cat([algo.q1(obs, a), algo.q1(nxt, a2)])
    assert not torch.allclose(separate, torch.cat([q, q_next]), atol=1e-3)


def test_no_target_network_and_the_update_fits_a_fixed_target():
    algo = crossq(learning_rate=0.003, policy_delay=3)
    modules = {name for name, v in vars(algo).items() if isinstance(v, torch.nn.Module)}
    assert modules == {"policy", "actor", "q1", "q2"} and not any("target" in k for k in algo.state_dict())
    assert algo.q_optimizer.param_groups[0]["betas"] == (0.5, 0.999) and \
        algo.actor_optimizer.param_groups[0]["betas"][0] == 0.5
    g = torch.Generator().manual_seed(1)
    batch = {"obs": torch.randn(1, 16, 3, generator=g), "actions": torch.rand(1, 16, 2, generator=g) * 2 - 1,
             "rewards": torch.randn(1, 16, generator=g), "next_obs": torch.randn(1, 16, 3, generator=g),
             "terminated": torch.ones(1, 16)}  # terminal: the target is the reward, a fixed regression problem
    actor_before = [p.detach().clone() for p in algo.actor.parameters()]
    first = algo.update(batch)
    assert all(torch.equal(a, b) for a, b in zip(actor_before, algo.actor.parameters(), strict=True))  # delay 3
    for _ in range(2):
        algo.update(batch)
    assert not all(torch.equal(a, b) for a, b in zip(actor_before, algo.actor.parameters(), strict=True))
    assert algo.q1.training and algo.q2.training  # back in train mode after the actor's eval-mode pass
    for _ in range(200):
        last = algo.update(batch)
    assert last["q_loss"] < 0.4 * first["q_loss"] and algo.optimizer_steps == 203
    restored = crossq(learning_rate=0.003)
    restored.load_state_dict(algo.state_dict())
    assert restored.optimizer_steps == 203
    assert torch.equal(restored.q1.q[0].running_mean, algo.q1.q[0].running_mean)
