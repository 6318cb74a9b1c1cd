"""A reward of your own, named in a run spec as ``module:function`` (veRL's and TRL's signature):

    PYTHONPATH=examples rlfabric train examples/reasoning_grpo.yaml --set env.options.reward=user_reward:gsm8k_shaped

Every service process that scores (the env service's reward workers) imports it, so it must be importable there
(PYTHONPATH, or an installed package with an ``rlfabric.rewards`` entry point). It runs in a worker process with a
time and memory limit (env.options.reward_timeout_s, reward_memory_mb): if it raises, hangs or crashes, only that
sample scores env.options.failure_reward and metrics.csv's reward_failures counts it.
"""

from __future__ import annotations

from rlfabric.services.env.tasks.answers import gsm8k_answer, to_number


def gsm8k_shaped(prompt: str, completion: str, answer: str, **fields) -> float:
    """1 for the right "#### N" answer, 0.1 for a wrong one in the right format, else 0. ``fields`` holds the data
    row's other columns (e.g. a difficulty you could weight by)."""
    ref = to_number(gsm8k_answer(answer))
    if "####" not in completion:
        return 0.0
    return 1.0 if to_number(gsm8k_answer(completion)) == ref else 0.1
