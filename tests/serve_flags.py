"""The RLFABRIC_* variables `rlfabric serve ROLE` reads, from the real parsers: what the compose file and the
Kubernetes manifests may set (tests/integration/test_compose.py, tests/unit/test_kubernetes.py)."""

from __future__ import annotations

import argparse
import functools
import importlib

from rlfabric.services.core.runtime import ServiceOptions, env_var


@functools.cache
def service_flags(role: str) -> frozenset[str]:
    """The flags every service shares and the ones its main adds, each as its RLFABRIC_<FLAG> name."""
    extras = []
    module = importlib.import_module(f"rlfabric.services.{role}.server")
    real = module.run_service
    try:  # what the service's main hands run_service as its own flags
        module.run_service = lambda _role, _build, _argv=None, extra=None: extras.append(extra)
        module.main([])
    finally:
        module.run_service = real
    parser = argparse.ArgumentParser()
    ServiceOptions.add_arguments(parser)
    if extras and extras[0] is not None:
        extras[0](parser)
    return frozenset(env_var(o) for a in parser._actions for o in a.option_strings if o.startswith("--"))
