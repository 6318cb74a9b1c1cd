"""runtime.device: resolved on each worker's host; a PPO update and a rollout act on CUDA where a GPU exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.config import ConfigError, parse_config
from rlfabric.services.core.devices import resolve_device
from rlfabric.services.core.models import build_policy
from rlfabric.services.rollout.backends.torch import TorchBackend

SPEC = {"observation_space": {"kind": "box", "shape": [4], "dtype": "float32"},
        "action_space": {"kind": "discrete", "shape": [], "dtype": "int64", "n": 2}}
NO_GPU = "no CUDA device on this host (a CPU build of torch): the GPU path runs where one exists"


def test_device_names_are_checked_and_resolved_per_host():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="runtime.device"):
        parse_config("runtime: {device: gpu0}")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device on this host.*Fix: set runtime.device to cpu"):
            resolve_device("cuda:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_ppo_update_and_rollout_act_on_cuda():
    cfg = parse_config("runtime: {device: cuda}\nalgorithm: {n_epochs: 2, batch_size: 64}")
    device = resolve_device(cfg.runtime.device)
    torch.manual_seed(0)
    policy = build_policy(cfg.spec.policy, SPEC, cfg.policy).to(device)
    algo = cfg.spec(policy, cfg, torch.Generator(device=device).manual_seed(7), env_spec=SPEC)
    T, N = 16, 8
    batch = TensorBatch({"obs": np.random.default_rng(0).standard_normal((T, N, 4)).astype(np.float32),
                         "actions": np.zeros((T, N), np.int64), "logp": np.full((T, N), -0.69, np.float32),
                         "values": np.zeros((T, N), np.float32), "rewards": np.ones((T, N), np.float32),
                         "dones": np.zeros((T, N), np.float32), "last_values": np.zeros(N, np.float32)},
                        dims=("time", "env"), field_dims={"last_values": ("env",)})
    before = [p.detach().clone() for p in policy.parameters()]
    stats = algo.update(batch.to_torch(device, pin=True))  # pinned host memory, copied asynchronously
    assert np.isfinite(stats["policy_loss"]) and algo.optimizer_steps == 4
    assert all(p.is_cuda for p in policy.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    backend = TorchBackend(cfg, SPEC, device)  # the rollout: loads the learner's weights (from the host) and acts
    backend.load(1, {k: v.cpu().numpy() for k, v in policy.state_dict().items()})
    raw, env_actions, logp, values = backend.act(np.zeros((8, 4), np.float32))
    assert raw.shape == (8,) and env_actions.dtype == np.int64 and np.isfinite(logp).all()
    assert next(backend.policy.parameters()).is_cuda
