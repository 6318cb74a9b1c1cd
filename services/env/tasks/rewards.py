"""Rewards by name: how a task's verifier turns a finished answer into a scalar (``env.options.reward``).

    exact_match     1 when the answer is the right integer, else 0
    format_match    exact_match, plus 0.1 for an answer that is an integer at all (a shaping term for cold starts)
    signed_match    1 when right, -1 when wrong or unparseable (zero-mean for a policy at chance)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.core.registry import Registry
from services.env.tasks.arith import parse_int

Reward = Callable[[Any, Any, str], float]  # (task, problem, answer text) -> reward


def exact_match(task: Any, problem: Any, answer: str) -> float:
    return 1.0 if task.correct(problem, answer) else 0.0


def format_match(task: Any, problem: Any, answer: str) -> float:
    if task.correct(problem, answer):
        return 1.0
    return 0.1 if parse_int(answer) is not None else 0.0


def signed_match(task: Any, problem: Any, answer: str) -> float:
    return 1.0 if task.correct(problem, answer) else -1.0


REWARDS = Registry("rewards", "env.options.reward", {
    "exact_match": "services.env.tasks.rewards:exact_match",
    "format_match": "services.env.tasks.rewards:format_match",
    "signed_match": "services.env.tasks.rewards:signed_match",
}, home="services/env/tasks/rewards.py")  # entry points rlfabric.rewards, or package.module:function in the spec


def register_reward(name: str, fn: Reward | str) -> None:
    REWARDS.register(name, fn)


def reward_fn(name: str) -> Reward:
    return REWARDS.load(name)
