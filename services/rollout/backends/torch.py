"""TorchBackend: batched acting with the run's policy (an ActorCritic on-policy, a squashed Gaussian actor for
SAC) for all envs of a step, and weight-version loading."""

from __future__ import annotations

import numpy as np
import torch

from services.core.actor import build_policy
from services.core.config import RunConfig


class TorchBackend:
    def __init__(self, config: RunConfig, env_spec: dict):
        self.policy = build_policy(config, env_spec)
        self.policy.eval()
        self.version = -1
        self.generator = torch.Generator().manual_seed(config.seed + 1)

    def load(self, version: int, tensors: dict[str, np.ndarray]) -> None:
        state = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)) for k, v in tensors.items()}
        missing = set(self.policy.state_dict()) - set(state)
        if missing:
            raise ValueError(f"weight version {version} lacks tensors {sorted(missing)}; learner and rollout "
                             f"were configured with different policies")
        self.policy.load_state_dict(state)
        self.version = version

    def act(self, obs: np.ndarray, deterministic: bool = False):
        """(raw actions, env actions, log-probs, values) for a batch of observations."""
        with torch.no_grad():
            t = torch.from_numpy(obs if obs.flags.writeable else obs.copy())
            actions, logp, values = self.policy.act(t, deterministic, self.generator)
        return actions.numpy(), self.policy.env_actions(actions), logp.numpy(), values.numpy()

    def random_actions(self, n: int):
        """Uniform actions in the policy's action space (off-policy warm-up, before learning_starts)."""
        raw = torch.rand((n, self.policy.act_dim), generator=self.generator) * 2 - 1
        return raw.numpy(), self.policy.env_actions(raw)

    def value(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.policy.value(torch.from_numpy(np.ascontiguousarray(obs))).numpy()
