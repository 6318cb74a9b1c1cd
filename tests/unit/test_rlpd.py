"""RLPD's pieces: the target's min over a random subset of the critic ensemble, the LayerNorm ensemble against a
member-by-member computation, the critic loss against a hand-computed target, symmetric sampling (every minibatch
half online, half offline, through replay's mix and the learner's feed), and the config's refusals."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlfabric.services.core.algorithm import DataAccess
from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.config import ConfigError, RunConfig
from rlfabric.services.core.models.critics import LayerNormEnsemble, LinearEnsemble, QEnsemble
from rlfabric.services.core.models.squashed_gaussian import SquashedGaussianActor
from rlfabric.services.learner.algorithms.rlpd import RLPD, subset_min
from rlfabric.services.learner.feeds import SampledFeed
from rlfabric.services.replay.server import ReplayService, stratified_counts
from rlfabric.services.replay.stores.memory import MemoryStore

SPEC = {"observation_space": {"kind": "box", "shape": [3], "dtype": "float32"},
        "action_space": {"kind": "box", "shape": [1], "dtype": "float32", "low": [-2.0], "high": [2.0]}}
DATASETS = {"replay": {"datasets": {"offline": "demos.npz"}}}  # (check() reads the name; nothing opens the file)


def rlpd(**algorithm) -> RLPD:
    torch.manual_seed(0)
    cfg = RunConfig.model_validate({"algorithm": {"name": "rlpd", "batch_size": 8, "learning_starts": 0,
                                                  "num_critics": 4, "critic_hidden_sizes": [16, 16], **algorithm},
                                    "policy": {"hidden_sizes": [16], "activation": "relu"}, **DATASETS})
    actor = SquashedGaussianActor(SPEC["observation_space"], SPEC["action_space"], cfg.policy)
    return RLPD(actor, cfg, torch.Generator().manual_seed(0), env_spec=SPEC)


def test_subset_min_over_all_members_when_the_subset_is_the_ensemble():
    q = torch.tensor([[1.0, 5.0, -2.0], [3.0, 0.0, -1.0]])
    assert torch.equal(subset_min(q, 2), torch.tensor([1.0, 0.0, -2.0]))


def test_subset_min_draws_a_uniform_pair_of_the_ensemble():
    # members are the constants 1, 2, 3, 4: the min of a random pair is 1 when the pair holds member 0 (3 of the
    # 6 pairs), 2 when it holds member 1 but not 0 (2 of 6), 3 for the pair (2, 3), never 4
    q = torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None].expand(4, 5)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([subset_min(q, 2, g) for _ in range(6000)])
    assert (draws == draws[:, :1]).all()  # one pair per call, for every row of the minibatch
    freq = [(draws[:, 0] == v).float().mean().item() for v in (1.0, 2.0, 3.0, 4.0)]
    assert freq == pytest.approx([3 / 6, 2 / 6, 1 / 6, 0.0], abs=0.02)


def test_layer_norm_ensemble_is_n_independent_layer_normed_mlps():
    torch.manual_seed(1)
    ens = QEnsemble(SPEC["observation_space"], 1, SimpleNamespace(hidden_sizes=[8]), n=5, hidden_sizes=[16, 12],
                    layer_norm=True)
    kinds = [type(m) for m in ens.q]
    assert kinds == [LinearEnsemble, LayerNormEnsemble, torch.nn.ReLU, LinearEnsemble, LayerNormEnsemble,
                     torch.nn.ReLU, LinearEnsemble]
    assert [tuple(p.shape) for p in ens.q[0].parameters()] == [(5, 4, 16), (5, 1, 16)]
    for ln in (ens.q[1], ens.q[4]):  # give every member its own LayerNorm gain and bias
        torch.nn.init.normal_(ln.weight)
        torch.nn.init.normal_(ln.bias)
    obs, act = torch.randn(7, 3), torch.rand(7, 1) * 2 - 1
    out = ens(obs, act)
    assert out.shape == (5, 7)
    x = torch.cat([obs, act], -1)
    for j in range(5):  # member j by hand: Linear, LayerNorm (zero mean, unit variance per row), gain, bias, ReLU
        h = x
        for lin, ln in ((ens.q[0], ens.q[1]), (ens.q[3], ens.q[4])):
            h = h @ lin.weight[j] + lin.bias[j]
            h = (h - h.mean(-1, keepdim=True)) / (h.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
            h = torch.relu(h * ln.weight[j] + ln.bias[j])
        want = (h @ ens.q[6].weight[j] + ens.q[6].bias[j]).squeeze(-1)
        assert torch.allclose(out[j], want, atol=1e-5)
    out[2].sum().backward()  # members share no parameter: member 2's loss moves only member 2
    grads = ens.q[0].weight.grad.abs().sum((1, 2))
    assert grads[2] > 0 and (grads[[0, 1, 3, 4]] == 0).all()
    plain = QEnsemble(SPEC["observation_space"], 1, SimpleNamespace(hidden_sizes=[8]), n=2)
    assert [type(m) for m in plain.q] == [LinearEnsemble, torch.nn.ReLU, LinearEnsemble]  # the policy's width, no LN
    assert tuple(plain.q[0].weight.shape) == (2, 4, 8)


def constant(ensemble: QEnsemble, values: list[float]) -> None:
    """Make member j output values[j] for every input (the output layer's weights zero, its bias the constant)."""
    last = ensemble.q[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(torch.tensor(values).reshape(-1, 1, 1))


def test_critic_loss_against_a_hand_computed_target():
    algo = rlpd(num_critics=2, critic_subset=2, ent_coef=0.5, gamma=0.9, tau=0.5)
    constant(algo.q_target, [3.0, 2.0])
    constant(algo.q, [1.0, 4.0])
    obs, nxt = torch.randn(4, 3), torch.randn(4, 3)
    batch = {"obs": obs, "actions": torch.zeros(4, 1), "rewards": torch.tensor([1.0, -1.0, 0.0, 2.0]),
             "next_obs": nxt, "terminated": torch.tensor([0.0, 0.0, 1.0, 0.0])}
    replay = torch.Generator().set_state(algo.generator.get_state())  # the step's own draw of a' ~ pi(s')
    with torch.no_grad():
        _, next_logp = algo.actor.sample(nxt, replay)
    # y = r + 0.9 * (1 - terminated) * (min(3, 2) - 0.5 * log pi(a'|s'));  L = mean (1 - y)^2 + mean (4 - y)^2
    y = batch["rewards"] + 0.9 * (1 - batch["terminated"]) * (2.0 - 0.5 * next_logp)
    want = ((1.0 - y) ** 2).mean() + ((4.0 - y) ** 2).mean()
    stats = algo.step(batch)
    assert stats["q_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert stats["q_mean"] == pytest.approx(2.5)
    assert algo.optimizer_steps == 1


def test_update_to_data_ratio_and_one_actor_step_per_env_step():
    algo = rlpd(updates_per_env_step=3.0, init_alpha=0.1)
    assert algo.policy_delay == 3 and algo.updates_for(5) == 15
    assert algo.log_alpha.exp().item() == pytest.approx(0.1) and algo.alpha_optimizer is not None
    assert rlpd(ent_coef=0.3).log_alpha.exp().item() == pytest.approx(0.3)  # a fixed alpha ignores init_alpha
    g = torch.Generator().manual_seed(2)
    batch = {"obs": torch.randn(6, 8, 3, generator=g), "actions": torch.rand(6, 8, 1, generator=g) * 2 - 1,
             "rewards": torch.randn(6, 8, generator=g), "next_obs": torch.randn(6, 8, 3, generator=g),
             "terminated": torch.zeros(6, 8), "source": torch.tensor([0, 1] * 4).expand(6, 8)}
    actor_before = [p.clone() for p in algo.actor.parameters()]
    target_before = [p.clone() for p in algo.q_target.parameters()]
    stats = algo.update(batch)
    assert algo.optimizer_steps == 6 and np.isfinite(stats["actor_loss"])
    assert stats["offline_fraction"] == 0.5  # source 1 is the offline one ("online" comes first in the mix)
    assert any(not torch.equal(a, b) for a, b in zip(actor_before, algo.actor.parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(target_before, algo.q_target.parameters(), strict=True))
    state = algo.state_dict()
    assert {"q", "q_target", "q_optimizer", "actor_optimizer"} <= set(state) and "q1" not in state
    fresh = rlpd(updates_per_env_step=3.0, init_alpha=0.1)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.q.parameters(), algo.q.parameters(), strict=True))


def test_stratified_counts_hold_each_share_per_minibatch():
    rng = np.random.default_rng(0)
    assert (stratified_counts(4, 256, np.array([0.5, 0.5]), rng) == 128).all()
    counts = stratified_counts(5000, 5, np.array([0.5, 0.3, 0.2]), rng)  # shares 2.5, 1.5, 1: only 1 row is drawn
    assert (counts.sum(1) == 5).all()
    assert set(map(tuple, counts)) == {(3, 1, 1), (2, 2, 1)}
    assert counts.mean(0) == pytest.approx([2.5, 1.5, 1.0], abs=0.05)


def replay_with(online_rows: int, offline_rows: int) -> ReplayService:
    """The replay service's sampling, without its servers: an online window of (time, env) trajectories tagged
    obs = 1, and an offline data set tagged obs = 0 with a column the online rows lack."""
    svc = ReplayService.__new__(ReplayService)
    svc.rng, svc.data = np.random.default_rng(0), SimpleNamespace(max_bytes=1 << 24)
    online, offline = MemoryStore(10_000), MemoryStore(10_000)
    for _ in range(online_rows // 16):
        online.put(TensorBatch({"obs": np.ones((4, 4, 3), np.float32), "actions": np.zeros((4, 4, 1), np.float32),
                                "rewards": np.ones((4, 4), np.float32), "next_obs": np.ones((4, 4, 3), np.float32),
                                "terminated": np.zeros((4, 4), bool)}, version=3, dims=("time", "env")))
    offline.put(TensorBatch({"obs": np.zeros((offline_rows, 3), np.float32),
                             "actions": np.zeros((offline_rows, 1), np.float32),
                             "rewards": np.zeros(offline_rows, np.float32),
                             "next_obs": np.zeros((offline_rows, 3), np.float32),
                             "terminated": np.zeros(offline_rows, np.float32),
                             "episode": np.arange(offline_rows)}, version=0, dims=("sample",)))
    svc.stores = {"online": online, "offline": offline}
    return svc


def test_every_minibatch_of_a_symmetric_mix_is_half_online_half_offline():
    access = RLPD.data(RunConfig.model_validate({"algorithm": {"name": "rlpd", "batch_size": 64},
                                                 **DATASETS}).algorithm)
    assert access == DataAccess.mix(64, {"online": 0.5, "offline": 0.5})
    sent = []

    class Replay:  # the learner's feed against replay's sampling
        def request(self, kind, batch, timeout_s):
            sent.append(batch.meta)
            return "batch", svc._sample(batch.meta)

    svc = replay_with(online_rows=320, offline_rows=200)
    algo = SimpleNamespace(updates_for=lambda env_steps: 6)
    fed = SampledFeed(Replay(), access, collects=False, num_envs=4).next(algo, 0, 0, 1.0)
    assert sent == [{"n": 384, "mix": {"online": 0.5, "offline": 0.5}, "minibatch": 64}]
    batch = fed.batch
    assert batch.dims == ("update", "sample") and batch["obs"].shape == (6, 64, 3)
    assert (batch["source"] == 1).sum(1).tolist() == [32] * 6  # each minibatch: 32 offline rows, 32 online
    np.testing.assert_array_equal(batch["obs"][..., 0], batch["source"] == 0)  # rows stay with their source
    assert "episode" not in batch.tensors  # only the fields both sources have
    assert (batch["terminated"] == 0).all()
    # an empty source is left out (before the first online rows): all offline, still whole minibatches
    svc.stores["online"] = MemoryStore(10)
    out = svc._sample({"n": 128, "mix": {"online": 0.5, "offline": 0.5}, "minibatch": 64})
    assert (out["source"] == 1).all() and "episode" in out.tensors
    with pytest.raises(ValueError, match="minibatch=48 does not divide n=128"):
        svc._sample({"n": 128, "mix": {"online": 0.5, "offline": 0.5}, "minibatch": 48})


def test_offline_weight_zero_reads_only_the_online_window():
    cfg = RunConfig.model_validate({"algorithm": {"name": "rlpd", "offline_weight": 0, "batch_size": 32}})
    assert RLPD.data(cfg.algorithm) == DataAccess.uniform(32)
    for weight in (0.25, 0.75):
        access = RLPD.data(RunConfig.model_validate({"algorithm": {"name": "rlpd", "offline_weight": weight},
                                                     **DATASETS}).algorithm)
        assert dict(access.sources) == pytest.approx({"online": 1 - weight, "offline": weight})


@pytest.mark.parametrize(("spec", "says"), [
    ({"algorithm": {"name": "rlpd"}}, "algorithm.offline_source='offline' names no data set"),
    ({"algorithm": {"name": "rlpd", "num_critics": 3, "critic_subset": 4}, **DATASETS},
     "critic_subset=4 exceeds num_critics=3"),
    ({"algorithm": {"name": "rlpd", "offline_weight": 1.0}, **DATASETS}, "offline_weight"),
    ({"algorithm": {"name": "rlpd", "offline_source": "online"}, **DATASETS}, "offline_source='online'"),
    ({"algorithm": {"name": "rlpd", "critic_layer_norm": "maybe"}, **DATASETS}, "critic_layer_norm"),
])
def test_bad_configs_are_refused_naming_the_field(spec, says):
    with pytest.raises((ConfigError, ValueError), match=says):
        RunConfig.model_validate(spec)


def test_subset_pairs_cover_the_ensemble():
    g = torch.Generator().manual_seed(1)
    q = torch.eye(4) * -1  # member j is -1 on column j only: a pair's min marks the pair's columns
    seen = {tuple(torch.nonzero(subset_min(q, 2, g) < 0).flatten().tolist()) for _ in range(300)}
    assert seen == set(itertools.combinations(range(4), 2))
