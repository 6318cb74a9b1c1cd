"""Observations of an ArmReachLang-shaped pixel task for the VLM policy tests: a 32x32 camera, proprioception and
instruction ids of the env's own vocabulary."""

from __future__ import annotations

import numpy as np
import torch

from rlfabric.services.env.sims import instructions

VOCAB = instructions.vocab_size()
OBS_SPACE = {"kind": "dict", "spaces": {
    "image": {"kind": "box", "dtype": "uint8", "shape": [32, 32, 3], "low": 0, "high": 255},
    "proprio": {"kind": "box", "dtype": "float32", "shape": [8], "low": -np.inf, "high": np.inf},
    "instruction": {"kind": "box", "dtype": "int64", "shape": [instructions.MAX_TOKENS],
                    "low": np.zeros(instructions.MAX_TOKENS), "high": np.full(instructions.MAX_TOKENS, VOCAB - 1)}}}
TEXTS = ["reach the red ball", "touch the blue one", "go to the green target", "reach the red ball"]


def chunk_space(H: int, A: int, bound: float = 2.0) -> dict:
    return {"kind": "box", "dtype": "float32", "shape": [H, A], "low": np.full((H, A), -bound),
            "high": np.full((H, A), bound)}


def observations(texts: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = len(texts)
    return {"image": torch.randint(0, 256, (B, 32, 32, 3), generator=g, dtype=torch.uint8),
            "proprio": torch.randn(B, 8, generator=g),
            "instruction": torch.as_tensor(np.stack([instructions.encode(t) for t in texts]))}


def imitate(pol, steps: int, chunk: tuple[int, int], value: float = 0.5, lr: float = 1e-2) -> None:
    """``steps`` AdamW steps of the policy's imitation loss toward constant chunks, on the parameters that take
    gradients (as vla_sft optimises)."""
    optimizer = torch.optim.AdamW([p for p in pol.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        loss = pol.imitation_loss(observations(TEXTS, seed=step), torch.full((len(TEXTS), *chunk), value))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
