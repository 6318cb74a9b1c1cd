"""Offload/onload of a stage's model state between turns: device memory is freed while offloaded, values come
back bit for bit, and training across offload cycles is the training without them."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.models import build_policy
from rlfabric.services.core.offload import ModelOffload, state_tensors

SPEC = {"observation_space": {"kind": "box", "shape": [4]}, "action_space": {"kind": "discrete", "n": 2, "shape": []}}
BOX = {"observation_space": {"kind": "box", "shape": [3]},
       "action_space": {"kind": "box", "shape": [1], "low": [-2.0], "high": [2.0]}}


def _batch(seed: int, T: int = 16, N: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(T, N, 4, generator=g), "actions": torch.randint(0, 2, (T, N), generator=g),
            "logp": torch.full((T, N), -0.69), "values": torch.randn(T, N, generator=g),
            "rewards": torch.ones(T, N), "dones": torch.zeros(T, N), "last_values": torch.zeros(N)}


def _ppo(seed: int = 0):
    config = RunConfig.model_validate({"seed": seed, "algorithm": {"name": "ppo", "n_steps": 16, "batch_size": 32,
                                                                   "n_epochs": 2}})
    torch.manual_seed(seed)
    policy = build_policy(config.spec.policy, SPEC, config.policy)
    return policy, config.spec(policy, config, torch.Generator().manual_seed(seed + 7))


@pytest.mark.parametrize("target", ["disk", "host"])
def test_offload_frees_tensors_and_onload_restores_them_bit_for_bit(tmp_path, target):
    policy, algo = _ppo()
    algo.update(_batch(0))  # optimiser state exists now
    before = [t.clone() for t in state_tensors(policy, algo)]
    assert len(before) > len(list(policy.parameters()))  # moments and step counters are included
    off = ModelOffload(lambda: state_tensors(policy, algo), target, tmp_path, name="learner")
    moved = off.offload()
    assert moved == sum(t.numel() * t.element_size() for t in before)
    assert all(t.numel() == 0 for t in state_tensors(policy, algo))  # the memory is released
    if target == "disk":
        assert off.path.stat().st_size == moved
    assert off.offload() == 0  # already offloaded: nothing moves twice
    off.onload()
    after = list(state_tensors(policy, algo))
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    off.close()
    assert not off.path.exists()


def test_training_across_offload_cycles_equals_training_without(tmp_path):
    plain_policy, plain = _ppo()
    policy, algo = _ppo()
    off = ModelOffload(lambda: state_tensors(policy, algo), "disk", tmp_path)
    for i in range(4):  # the turns of a collocated plan: onload, update, offload
        off.onload()
        stats = algo.update(_batch(i))
        off.offload()
        assert stats == plain.update(_batch(i))
    off.onload()
    for a, b in zip(policy.state_dict().values(), plain_policy.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert algo.optimizer_steps == plain.optimizer_steps


def test_onloaded_restores_the_offloaded_state_after_the_block(tmp_path):
    policy, algo = _ppo()
    off = ModelOffload(lambda: state_tensors(policy, algo), "disk", tmp_path)
    off.offload()
    with off.onloaded():  # e.g. a checkpoint between turns
        assert all(p.numel() > 0 for p in policy.parameters())
        policy.state_dict()
    assert off.offloaded and all(p.numel() == 0 for p in policy.parameters())
    off.onload()
    with off.onloaded():  # not offloaded at entry: left on the device
        pass
    assert not off.offloaded


def test_a_truncated_offload_file_is_a_clear_error(tmp_path):
    policy, algo = _ppo()
    off = ModelOffload(lambda: state_tensors(policy, algo), "disk", tmp_path)
    off.offload()
    with open(off.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(OSError, match="truncated"):
        off.onload()


def test_state_tensors_finds_every_model_and_optimiser_of_sac():
    config = RunConfig.model_validate({"algorithm": {"name": "sac", "learning_starts": 0}})
    actor = build_policy(config.spec.policy, BOX, config.policy)
    sac = config.spec(actor, config, torch.Generator().manual_seed(0), env_spec=BOX)
    owned = {id(t) for t in state_tensors(actor, sac)}
    for module in (actor, sac.q1, sac.q2, sac.q1_target, sac.q2_target):
        assert all(id(p) in owned for p in module.parameters())
    assert id(sac.log_alpha) in owned


def test_offload_config_is_checked_against_the_plan():
    from rlfabric.services.core.config import ConfigError, load_config

    collocated = RunConfig.model_validate({"scheduling": {"offload": "auto"}})
    assert collocated.scheduling.offload_target("cpu") == "disk"
    stream = RunConfig.model_validate({"scheduling": {"offload": "disk", "mode": "disaggregated"}})
    assert stream.scheduling.offload_target("cpu") is None  # stages do not take turns: nothing to offload
    with pytest.raises(ConfigError, match="offload: disk"):
        load_config("examples/cartpole_ppo.yaml", ["scheduling.offload=host"])
