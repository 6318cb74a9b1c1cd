"""Text tasks: problems a language-model policy answers in text, verified by rule (no learned reward model).

A task makes problems from a seed (``problem(rng)``), splits them into train and held-out sets by a hash of the
problem (so the two never overlap, whatever the seeds), and scores a finished answer with a reward chosen by name
(``rewards.py``). The ``text`` env adapter (services/env/adapters/text.py) turns a task into gymnasium envs with
Text spaces, single-turn or multi-turn with tools.
"""

from __future__ import annotations

import importlib
from typing import Any

TASKS: dict[str, str] = {
    "arith": "services.env.tasks.arith:ArithTask",  # "Q: 12+7= A:" -> "19"
    "arith_tool": "services.env.tasks.tools:ToolArithTask",  # the same problems, with a calculator and a search tool
}


def register_task(name: str, target: str) -> None:
    TASKS[name] = target


def task_class(name: str) -> Any:
    if name not in TASKS:
        raise ValueError(f"env.id {name!r} is not a text task; available: {sorted(TASKS)}")
    module, _, cls = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
