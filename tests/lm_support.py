"""Shared by the language-model tests: a tiny LM run config and the text spaces of the text adapter."""

from __future__ import annotations

import torch

from rlfabric.services.core.config import RunConfig, parse_config

TEXT = {"kind": "text", "shape": [], "dtype": "uint8", "max_length": 64}
SPEC = {"observation_space": TEXT, "action_space": TEXT}


def lm_run(backend: str = "hf", lora: int = 0, hidden: int = 64, heads: int = 1, positions: int = 48) -> RunConfig:
    """A GRPO run on arithmetic with a tiny causal LM (vLLM on CPU needs hidden/heads = 64)."""
    return parse_config(f"""
name: t
seed: 3
env: {{adapter: text, id: arith, num_envs: 4, eval_envs: 4, options: {{group_size: 2}}}}
policy: {{lm: {{hidden_size: {hidden}, intermediate_size: {2 * hidden}, layers: 2, heads: {heads},
              max_positions: {positions}, lora: {{rank: {lora}}}}}}}
rollout: {{backend: {backend}, max_new_tokens: 8}}
algorithm: {{name: grpo}}
""")


def perturb(module: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """Move every parameter by seeded noise: a distinct, reproducible weight version."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module
