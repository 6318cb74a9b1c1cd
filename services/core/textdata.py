"""Text data files and chat prompts: what the env (data-set tasks), replay (supervised data sets) and the LM policies (a
tokenizer trained on a data set) read alike.

A data file is JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``), read through the ``datasets`` library from a
local path only (never a hub), under the worker's data roots, into plain rows (dicts).

A chat prompt crosses the data plane as text: a JSON list of ``{"role", "content"}`` messages. Whoever owns the
tokenizer (the rollout backend, the supervised data loader) renders it with the checkpoint's chat template; plain text stays
plain. ``chat_text`` writes one, ``chat_messages`` reads one back (None for plain text).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlfabric.services.core.paths import DataRoots, PathRefused

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
MAX_FILE_BYTES = 4 << 30  # a data set for one run; larger ones belong in a replay store, not a run spec
CHAT_START = '[{"role"'


class DataFileError(ValueError):
    """A data file that cannot be used; the message names the option, the file and the fix."""


def read_rows(path: str | Path, field: str, roots: DataRoots | None = None, max_rows: int = 1 << 22
              ) -> list[dict[str, Any]]:
    """Every row of a local JSONL or Parquet file, as dicts. ``field`` names the run-spec option in errors."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataFileError(f"{field}={str(path)!r}: not a data file this reads (use {', '.join(FORMATS)})")
    roots = roots if roots is not None else DataRoots.anywhere()
    try:
        resolved = roots.confine(path, field)
        if not resolved.exists():
            raise DataFileError(f"{field}={str(path)!r}: no such file. Fix: give the path of a JSONL or Parquet "
                                f"file on this worker (relative paths are from the service's working directory)")
        with roots.open(path, field):  # a regular file only (a FIFO or a device is refused, never read)
            pass
    except PathRefused as exc:
        raise DataFileError(str(exc)) from None
    if resolved.stat().st_size > MAX_FILE_BYTES:
        raise DataFileError(f"{field}={str(path)!r}: {resolved.stat().st_size} bytes exceeds the "
                            f"{MAX_FILE_BYTES}-byte bound of a run spec's data file")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    try:
        data = datasets.load_dataset(fmt, data_files=str(resolved), split="train", keep_in_memory=True)
    except Exception as exc:  # noqa: BLE001 — the library's many parse errors, named with the file
        raise DataFileError(f"{field}={str(path)!r}: cannot read it as {fmt} ({exc.__class__.__name__}: "
                            f"{str(exc)[:300]})") from None
    if len(data) == 0:
        raise DataFileError(f"{field}={str(path)!r}: holds no rows")
    if len(data) > max_rows:
        raise DataFileError(f"{field}={str(path)!r}: {len(data)} rows exceeds the bound of {max_rows}")
    return data.to_list()


def is_messages(value: Any) -> bool:
    """A list of chat messages: dicts with a string role and string content."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def chat_text(messages: list[dict[str, str]]) -> str:
    """A chat prompt as the text that crosses the data plane."""
    if not is_messages(messages):
        raise ValueError("a chat prompt is a non-empty list of {'role': str, 'content': str} messages")
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=False)


def chat_messages(text: str) -> list[dict[str, str]] | None:
    """The messages of a chat prompt, or None when ``text`` is plain text."""
    if not text.startswith(CHAT_START):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if is_messages(value) else None


def plain_chat(messages: list[dict[str, str]]) -> str:
    """A chat as plain text, for a tokenizer with no chat template: the contents, a blank line apart."""
    return "\n\n".join(m["content"] for m in messages)


def render_prompt(value: Any, system_prompt: str | None = None, template: str | None = None) -> str:
    """A data row's prompt as the text that crosses the data plane, the one rule the env's data-set task and the
    supervised data loader share: with ``template`` plain text (``template.format(prompt=...)``); otherwise a chat
    (a string becomes a user message), ``system_prompt`` first when given."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif is_messages(value):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise ValueError(f"a prompt is a string or a list of {{'role': str, 'content': str}} messages, not a "
                         f"{type(value).__name__}")
    if template is not None:
        try:
            return template.format(prompt=value if isinstance(value, str) else plain_chat(messages))
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(f"env.options.template={template[:80]!r} cannot be filled ({exc.__class__.__name__}: "
                             f"{exc}). Fix: name only {{prompt}}, and write literal braces as {{{{ and }}}}") from None
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return chat_text(messages)


def row_texts(row: dict[str, Any]) -> list[str]:
    """Every string in a row (message contents included): what a tokenizer built from a data set learns from."""
    out: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(row)
    return out


__all__ = ["DataFileError", "chat_messages", "chat_text", "is_messages", "plain_chat", "read_rows", "render_prompt", "row_texts"]
