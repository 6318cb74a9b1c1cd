"""Text tasks: problems a language-model policy answers in text, verified by rule (no learned reward model).

A task makes problems from a seed (``problem(rng)``), splits them into train and held-out sets by a hash of the
problem (so the two never overlap, whatever the seeds), and scores a finished answer with a reward chosen by name
(``rewards.py``, run in the env's reward pool: services/env/reward_pool.py). A problem has ``answer`` (the
reference), ``id`` (what a log line names it by) and ``fields`` (what the reward gets as ``**fields``). The
``dataset`` task reads its problems from a user's JSONL or Parquet file (``dataset.py``). Tasks and rewards come from the registry (services/core/registry.py): the built-ins, entry points
of groups ``rlfabric.tasks`` and ``rlfabric.rewards``, or ``package.module:attr`` in the run spec. The ``text`` env
adapter (services/env/adapters/text.py) turns a task into gymnasium envs with Text spaces, single-turn or
multi-turn with tools.
"""

from __future__ import annotations

from typing import Any

from rlfabric.services.core.registry import Registry


def check_task(value: Any) -> None:
    """A task is a class with ``problem(rng)``, built with the run's ``env.options``: checked before that call, so a
    name that resolves to another callable (``subprocess:Popen``) is never called with options from a spec."""
    if not isinstance(value, type) or not callable(getattr(value, "problem", None)):
        raise ValueError("a text task is a class with a problem(rng) method")


TASKS = Registry("tasks", "env.id", {
    "arith": "rlfabric.services.env.tasks.arith:ArithTask",  # "Q: 12+7= A:" -> "19"
    "arith_tool": "rlfabric.services.env.tasks.tools:ToolArithTask",  # the same problems, with a calculator and a search tool
    "dataset": "rlfabric.services.env.tasks.dataset:DatasetTask",  # rows of a user's JSONL/Parquet file (GSM8K, MATH, ...)
}, home="services/env/tasks", noun="text task", check=check_task)


def register_task(name: str, target: Any) -> None:
    TASKS.register(name, target)


def task_class(name: str) -> Any:
    return TASKS.load(name)
