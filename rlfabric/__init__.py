"""rlfabric: reinforcement-learning post-training as independent services. This is what a notebook imports.

    import rlfabric
    client = rlfabric.Client("127.0.0.1:50051", token_file="runs/.rlfabric/token")   # `rlfabric up` printed both
    config = rlfabric.load_config("examples/cartpole_ppo.yaml", ["seed=3"])
    run = client.submit(config)
    for event in client.watch(run.run_id):          # history first, then live: metrics rows, logs, status
        ...
    rlfabric.registries.algorithms()                # {"ppo": PPO, "sac": SAC, "iql": IQL, "bc": BC, ...}

Against services that serve TLS (`rlfabric up --tls auto`, or `serve` with --tls-*), a client made with
``token_file=`` (or none, reading RLFABRIC_TOKEN_FILE / RLFABRIC_TOKEN) takes the deployment's CA, and for mTLS a
client certificate, from RLFABRIC_TLS_CA / RLFABRIC_TLS_CERT / RLFABRIC_TLS_KEY (what `up --tls auto` and
`rlfabric certs` print).

Everything here is a name for something the services define (services/ stays the service code): the client of
the coordinator's API, the run-spec schema, the batch type, a local stack, and the registries where algorithms,
policies, collectors, backends and env adapters are found.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from rlfabric import registries

_EXPORTS = {
    "Client": ("rlfabric.services.coordinator.client", "CoordinatorClient"),
    "LocalStack": ("rlfabric.services.launcher", "LocalStack"),
    "RunConfig": ("rlfabric.services.core.config", "RunConfig"),
    "ConfigError": ("rlfabric.services.core.config", "ConfigError"),
    "load_config": ("rlfabric.services.core.config", "load_config"),
    "parse_config": ("rlfabric.services.core.config", "parse_config"),
    "TensorBatch": ("rlfabric.services.core.batch", "TensorBatch"),
    "Ragged": ("rlfabric.services.core.batch", "Ragged"),
    "generate_token": ("rlfabric.services.core.auth", "generate_token"),
}


def __getattr__(name: str) -> Any:
    """Imported on first use: ``import rlfabric`` stays light (no torch) until a name needs it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlfabric' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*_EXPORTS, "registries"])


__all__ = [*_EXPORTS, "registries"]
