"""Observation encoders: what turns an observation (a vector, a uint8 image, a Dict of both) into features.

    flat    Box of any rank -> flattened float32 (no parameters: an MLP policy's bodies start right after it)
    cnn     Box uint8 image [H, W, C] (or [C, H, W]) -> /255 -> conv stack -> linear features
    dict    Dict space -> each entry encoded by the rule above -> concatenated

Images stay uint8 until this point: env, data plane, replay and the learner's batch all carry bytes, and the
conversion to float happens on the device, inside the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rlfabric.services.core.models.mlp import ACTIVATIONS

PRIVILEGED = "privileged"


def is_privileged(key: str) -> bool:
    """An observation entry for the critic alone (asymmetric actor-critic): a simulator's true state, which a robot
    cannot give, so no actor may read it. Only a policy whose class sets ``critic_only_privileged`` accepts an env
    that has one (build_policy refuses the rest)."""
    return key == PRIVILEGED or key.startswith(PRIVILEGED + "_")


def is_image(space: dict[str, Any]) -> bool:
    """A uint8 Box of rank 3 is an image (channels last when the last dim is 1, 3 or 4, else first)."""
    return space.get("kind") == "box" and space.get("dtype") == "uint8" and len(space.get("shape", [])) == 3


class Flat(nn.Module):
    def __init__(self, space: dict[str, Any]):
        super().__init__()
        self.out_dim = int(math.prod(space["shape"])) if space.get("shape") else 1

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.reshape(obs.shape[0], self.out_dim).float()


class CNN(nn.Module):
    """A conv stack over one image (Nature-CNN shaped by default); configurable channels, kernels and strides. A
    kernel larger than what is left of the image covers all of it instead, so the default stack, made for 84x84,
    also serves small renders (a 32x32 camera leaves 2x2 for its 3x3 layer); stacks that fit are unchanged."""

    def __init__(self, space: dict[str, Any], cfg: Any, activation: str = "relu"):
        super().__init__()
        shape = list(space["shape"])
        self.channels_last = shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4)
        c, h, w = (shape[2], shape[0], shape[1]) if self.channels_last else shape
        layers: list[nn.Module] = []
        left = (h, w)
        for out, k, s in zip(cfg.channels, cfg.kernels, cfg.strides, strict=True):
            kernel = (min(k, left[0]), min(k, left[1]))
            layers += [nn.Conv2d(c, out, kernel, s), ACTIVATIONS[activation]()]
            left = ((left[0] - kernel[0]) // s + 1, (left[1] - kernel[1]) // s + 1)
            c = out
        self.convs = nn.Sequential(*layers, nn.Flatten())
        with torch.no_grad():
            n = self.convs(torch.zeros(1, shape[2] if self.channels_last else shape[0], h, w,
                                       device=layers[0].weight.device)).shape[1]
        if n == 0:
            raise ValueError(f"policy.cnn shrinks a {h}x{w} image to nothing; use smaller kernels or strides")
        self.linear = nn.Sequential(nn.Linear(n, cfg.features), ACTIVATIONS[activation]())
        self.out_dim = cfg.features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.float() / 255.0
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return self.linear(self.convs(x))


class DictEncoder(nn.Module):
    def __init__(self, space: dict[str, Any], cfg: Any):
        super().__init__()
        self.keys = sorted(space["spaces"])
        self.parts = nn.ModuleDict({k: build_encoder(space["spaces"][k], cfg) for k in self.keys})
        self.out_dim = sum(p.out_dim for p in self.parts.values())

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([self.parts[k](obs[k]) for k in self.keys], dim=-1)


def build_encoder(space: dict[str, Any], cfg: Any) -> nn.Module:
    """The encoder for an observation space description (see rlfabric.services.env.adapters.gymnasium.describe_space)."""
    kind = space.get("kind")
    if kind == "dict":
        return DictEncoder(space, cfg)
    if is_image(space):
        return CNN(space, cfg.cnn)
    if kind in ("box", "discrete"):
        return Flat(space)
    raise ValueError(f"no encoder for observation space kind {kind!r}; supported: box (vectors, uint8 images), "
                     f"discrete, dict")


def box_bound(space: dict[str, Any], key: str) -> torch.Tensor:
    """A Box description's ``low``/``high`` (one number when uniform) as one float32 per action element."""
    n = int(math.prod(space["shape"])) if space["shape"] else 1
    return torch.as_tensor(space[key], dtype=torch.float32).reshape(-1).expand(n).clone()


def batch_size_of(obs: Any) -> int:
    """Rows of an observation batch (a tensor, or a Dict of them)."""
    if isinstance(obs, dict):
        return batch_size_of(next(iter(obs.values())))
    return int(obs.shape[0])
