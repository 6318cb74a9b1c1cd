"""Modules imported on first use, so that a process that only reads declarations never imports them.

Every process imports the config schema, and the schema imports every algorithm spec: their config models and
declarations are read everywhere, their update only in the learner. An algorithm file binds ``torch`` (and any
module that imports torch) with ``lazy_import`` instead of ``import``, and the coordinator, replay, env and the
robot gateway start without torch (0.9 s and 180 MB less each, bench/startup.py). This is PEP 810's
``lazy import torch``, which Python 3.11 does not have.

Names the module body uses at import time (a decorator such as ``@torch.no_grad()``, a base class, a default
argument) would import it at once: write those inside the function instead.
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for module ``__name__`` that imports it on the first attribute read. The module itself is not
    in ``sys.modules`` until then; afterwards the stand-in holds the module's attributes, so reads cost what a
    module's do (attributes the module gains later are read through)."""

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)

    def __repr__(self) -> str:
        loaded = "loaded" if "__file__" in self.__dict__ else "not imported yet"
        return f"<lazy module {self.__name__!r} ({loaded})>"


def lazy_import(name: str) -> types.ModuleType:
    """The module ``name`` (a dotted absolute name), imported when first used."""
    return LazyModule(name)


__all__ = ["LazyModule", "lazy_import"]
