"""A run spec as YAML text and ``--set`` overrides, read into a raw dict before the schema sees it.

Kept apart from the schema (services/core/config.py) because the schema imports every algorithm spec, and with
them torch: a launcher peeks at a spec's name and thread count from here while its services are starting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A run config that cannot be used. The message names each bad field and the fix."""


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
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
    """The spec's sections as a dict with the overrides applied; malformed YAML names the line and column."""
    try:
        data = yaml.safe_load(text)
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
    return apply_overrides(data, overrides or [])


def read_spec_file(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file. Fix: pass a YAML run spec, e.g. examples/cartpole_ppo.yaml")
    return read_spec(path.read_text(), str(path), overrides)
