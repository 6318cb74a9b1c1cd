"""TorchBackend: batched acting with the run's policy (the one its algorithm spec names) for all envs of a step,
on the run's device, and weight-version loading through a state-dict receiver."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from rlfabric.services.core.batch import tree_map
from rlfabric.services.core.models import build_policy
from rlfabric.services.core.policy import Acting, DrawsRandomActions, FlatActions
from rlfabric.services.rollout.backends.receivers import StateDictReceiver


def _tensor(x: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(x if x.flags.writeable else x.copy())
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


class TorchBackend:
    def __init__(self, config: Any, env_spec: dict, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.policy = build_policy(config.policy_name, env_spec, config.policy).to(self.device)
        if not isinstance(self.policy, Acting):
            raise ValueError(f"rollout.backend torch acts through a policy's act() and env_actions(), and policy.name "
                             f"{config.policy_name!r} has no act(). Fix: a backend that serves it (hf or vllm for a "
                             f"language model)")
        self.policy.eval()
        self.has_value = bool(self.policy.has_value)
        self.receiver = StateDictReceiver(self.policy)
        self.version = -1
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed + 1)

    def load(self, version: int, tensors: dict[str, Any]) -> None:
        self.receiver.load(version, tensors)
        self.version = version

    def act(self, obs: Any, deterministic: bool = False):
        """(raw actions, env actions, log-probs, values) for a batch of observations (an array or a Dict)."""
        with torch.no_grad():
            t = tree_map(lambda x: _tensor(x, self.device), obs)
            actions, logp, values = self.policy.act(t, deterministic, self.generator)
        return (actions.cpu().numpy(), self.policy.env_actions(actions), logp.cpu().numpy(),
                values.cpu().numpy())

    def add_expert(self, state: dict) -> None:
        """A frozen expert policy from a checkpoint's state (its own config and env spec: any policy that acts)."""
        from rlfabric.services.core.config import RunConfig

        config = RunConfig.from_json(state["config_json"])
        expert = build_policy(config.policy_name, json.loads(state["env_spec_json"]), config.policy)
        if not isinstance(expert, Acting):
            raise ValueError(f"algorithm.expert_checkpoint: its policy {config.policy_name!r} has no act(), so it "
                             f"cannot act in the env")
        expert.load_state_dict(state["policy"])
        self.expert = expert.to(self.device).eval().requires_grad_(False)

    def expert_actions(self, obs: Any) -> np.ndarray:
        """The expert's env actions (its mode) for a batch of observations."""
        with torch.no_grad():
            t = tree_map(lambda x: _tensor(x, self.device), obs)
            return self.expert.env_actions(self.expert.act(t, True, self.generator)[0])

    def random_actions(self, n: int):
        """Uniform actions in the policy's action space (off-policy warm-up), as (recorded, executed) actions; a
        policy whose own action form is not a flat vector (a chunk policy) draws them itself."""
        if isinstance(self.policy, DrawsRandomActions):
            return self.policy.random_actions(n, self.generator)
        if not isinstance(self.policy, FlatActions):
            raise ValueError(f"{type(self.policy).__name__} acts in no flat action space (discrete, act_dim) and "
                             f"draws no random_actions of its own. Fix: give the policy random_actions(n, generator)")
        if self.policy.discrete:
            raw = torch.randint(0, self.policy.act_dim, (n,), generator=self.generator, device=self.device)
        else:
            raw = torch.rand((n, self.policy.act_dim), generator=self.generator, device=self.device) * 2 - 1
        return raw.cpu().numpy(), self.policy.env_actions(raw)

    def value(self, obs: Any) -> np.ndarray:
        with torch.no_grad():
            t = tree_map(lambda x: _tensor(np.ascontiguousarray(x), self.device), obs)
            return self.policy.value(t).cpu().numpy()
