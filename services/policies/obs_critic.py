"""A critic with an encoder of its own (``critic: own`` on a VLM policy), beside the VLM rather than on it.

The default critic (``critic: prefix``) is a value head on the mean of the VLM prefix's hidden states: pooling over
image patches and words keeps what is in the scene but not where, and its loss flows into the VLM the actor shares
(unless ``value_detach``, which VLMCritic applies). This critic reads the raw observation the way the CNN
actor-critic does: a conv stack per camera (``policy.cnn``), the state vector, and the instruction as the mean of
learned embeddings of its ids, then an MLP. It shares no weight with the actor, so its loss cannot disturb the
supervised features the actor starts from.
On ArmReachLang its explained variance stayed as low as the prefix critic's (docs/benchmarks.md). It alone reads
an env's ``privileged`` entries (a simulator's true state: asymmetric actor-critic), as part of its state vector.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from rlfabric.services.core.models.encoders import CNN, is_image


class ObsCritic(nn.Module):
    def __init__(self, obs_space: dict[str, Any], cnn: Any, hidden: int, words: int = 32):
        super().__init__()
        spaces = obs_space["spaces"] if obs_space["kind"] == "dict" else {"image": obs_space}
        self.dict_obs = obs_space["kind"] == "dict"
        self.cameras = nn.ModuleDict({k: CNN(s, cnn) for k, s in sorted(spaces.items()) if is_image(s)})
        self.text_key = "instruction" if "instruction" in spaces else None
        self.state_keys = sorted(k for k in spaces if k not in self.cameras and k != self.text_key)
        width = sum(c.linear[0].out_features for c in self.cameras.values())
        width += sum(math.prod(spaces[k]["shape"]) for k in self.state_keys)  # (an empty shape: 1)
        if self.text_key is not None:
            vocab = int(max(np.max(spaces[self.text_key]["high"]), 1)) + 1
            self.words = nn.EmbeddingBag(vocab, words, mode="mean", padding_idx=0)
            width += words
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))

    def forward(self, obs: Any) -> torch.Tensor:
        parts: dict[str, torch.Tensor] = obs if self.dict_obs else {"image": obs}
        B = next(iter(parts.values())).shape[0]
        feats = [cam(parts[k]) for k, cam in self.cameras.items()]
        feats += [parts[k].reshape(B, -1).float() for k in self.state_keys]
        if self.text_key is not None:
            ids = parts[self.text_key].long().clamp(0, self.words.num_embeddings - 1)
            feats.append(self.words(ids))
        return self.mlp(torch.cat(feats, -1)).squeeze(-1)


class VLMCritic(nn.Module):
    """The value function of a VLM policy (its ``critic`` setting): a head on the pooled prefix features the policy
    computes anyway, or an ObsCritic on the raw observation."""

    def __init__(self, obs_space: dict[str, Any], cnn: Any, p: Any, width: int):
        super().__init__()
        self.reads_prefix = p.critic == "prefix"
        self.detach = p.value_detach
        self.net = nn.Sequential(nn.Linear(width, p.value_hidden), nn.Tanh(), nn.Linear(p.value_hidden, 1)) \
            if self.reads_prefix else ObsCritic(obs_space, cnn, p.value_hidden)

    def forward(self, obs: Any, pooled: torch.Tensor | None = None) -> torch.Tensor:
        if not self.reads_prefix:
            return self.net(obs)
        return self.net(pooled.detach() if self.detach else pooled).squeeze(-1)
