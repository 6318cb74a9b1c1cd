"""Weight receivers: how a backend takes in a published weight version. A strategy per kind of model: a state
dict loaded into a torch module (every backend's; an engine reloads from the module it fills)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class StateDictReceiver:
    """Loads a version's tensors (numpy arrays or torch tensors, CPU or CUDA) into a module's parameters and
    buffers, on the module's device. Every tensor of the module must be in the version: a partial load would
    silently mix two policies."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def load(self, version: int, tensors: dict[str, Any]) -> None:
        state = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)) for k, v in tensors.items()}
        missing = set(self.module.state_dict()) - set(state)
        if missing:
            raise ValueError(f"weight version {version} lacks tensors {sorted(missing)}; learner and rollout "
                             f"were configured with different policies")
        self.module.load_state_dict(state)

