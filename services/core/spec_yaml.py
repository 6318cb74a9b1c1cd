"""A run spec as YAML text and ``--set`` overrides, read into a raw dict before the schema sees it.

Kept apart from the schema (services/core/config.py) because the schema imports every algorithm spec, and with
them torch: a launcher peeks at a spec's name and thread count from here while its services are starting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_SPEC_BYTES = 1 << 20  # a run spec is a few KiB; data belongs in files the spec names
MAX_ALIASES = 64  # YAML aliases a spec may use (each one can double what the schema has to walk)
MAX_NODES = 100_000  # values in the spec with every alias expanded, as the schema and JSON see it


class ConfigError(ValueError):
    """A run config that cannot be used. The message names each bad field and the fix."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a spec with more than MAX_ALIASES aliases (a "billion laughs" spec is a handful of
    lines that expands to billions of values)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise ConfigError(f"the spec uses more than {MAX_ALIASES} YAML aliases (*name). Fix: write the "
                                  f"values out; a run spec needs few or none")
        return super().compose_node(parent, index)


def _check_expanded(data: Any, source: str) -> None:
    """Count the spec's values with aliases expanded (shared objects walked every time), stopping at the bound."""
    seen, stack = 0, [data]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise ConfigError(f"{source}: the spec expands to more than {MAX_NODES} values (aliases repeat "
                              f"sections). Fix: keep the spec small; put data in files it names")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _load(text: str) -> Any:
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _parse_value(text: str) -> Any:
    if len(text) > MAX_SPEC_BYTES:
        raise ConfigError(f"an override of {len(text)} characters is over the {MAX_SPEC_BYTES} a run spec may have")
    try:
        return _load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML scalars) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. --set train.total_env_steps=50000")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"--set {item!r}: empty key. Fix: name a field, e.g. seed=1")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return data


def read_spec(text: str, source: str = "config", overrides: list[str] | None = None) -> dict[str, Any]:
    """The spec's sections as a dict with the overrides applied; malformed YAML names the line and column. Specs
    over MAX_SPEC_BYTES, with more than MAX_ALIASES aliases or more than MAX_NODES values expanded are refused."""
    size = len(text.encode())
    if size > MAX_SPEC_BYTES:
        raise ConfigError(f"{source}: the spec is {size} bytes, over the {MAX_SPEC_BYTES} a run spec may have. Fix: "
                          f"put data sets and long prompts in files the spec names (env.options paths)")
    try:
        data = _load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"{source}:{where}: malformed YAML ({problem}). Fix: check indentation and 'key: value' syntax there"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (env:, train:, ...), "
                          f"got {type(data).__name__}")
    data = apply_overrides(data, overrides or [])
    _check_expanded(data, source)
    return data


def read_spec_file(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file. Fix: pass a YAML run spec, e.g. examples/cartpole_ppo.yaml")
    return read_spec(path.read_text(), str(path), overrides)
