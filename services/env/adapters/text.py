"""Text adapter: a text task (services/env/tasks) as gymnasium envs with Text observation and action spaces.

    env: {adapter: text, id: arith, num_envs: 64, options: {level: 2, group_size: 8, reward: exact_match}}

An observation is the text to append to the model's context (the prompt at reset; a tool's reply later); an
action is the model's turn. Single-turn tasks end after one turn. Tool tasks go on until an answer or
``max_turns`` turns (truncated, reward 0); a malformed turn costs ``parse_penalty`` and the episode continues.

Groups: with ``group_size`` G, envs i and j with i // G == j // G draw the same problems from a seeded reset (the
G samples of one group answer the same prompt). Text crosses the data plane as UTF-8 bytes (a Ragged uint8
field), bounded by ``max_chars``.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
import numpy as np

from services.env.adapters.gymnasium import vectorize_fns
from services.env.tasks import task_class
from services.env.tasks.rewards import reward_fn
from services.env.tasks.tools import run_turn

collector = "llm"  # rollout.collector auto: LLM turns (generation, tools)
OPTIONS = {"level": int, "split": str, "held_out_fraction": float, "reward": str, "group_size": int,
           "max_turns": int, "parse_penalty": float, "max_chars": int}
CHARSET = string.printable


def _options(env_cfg: Any) -> dict[str, Any]:
    unknown = sorted(set(env_cfg.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"env.options {unknown} are not text-task options; use {sorted(OPTIONS)}")
    opts = {"level": 2, "split": "train", "held_out_fraction": 0.2, "reward": "exact_match", "group_size": 1,
            "max_turns": 4, "parse_penalty": 0.1, "max_chars": 512} | dict(env_cfg.options)
    for key, kind in OPTIONS.items():
        value = opts[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is float and not np.isfinite(value)):
            if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
                raise ValueError(f"env.options.{key}={value!r}: expected a finite {kind.__name__}")
    if not 1 <= opts["group_size"] <= 1024:
        raise ValueError(f"env.options.group_size={opts['group_size']}: samples per prompt, in [1, 1024]")
    if env_cfg.num_envs % opts["group_size"]:
        raise ValueError(f"env.num_envs={env_cfg.num_envs} is not a multiple of env.options.group_size="
                         f"{opts['group_size']}. Fix: num_envs = prompts per step x group_size")
    if not 1 <= opts["max_turns"] <= 64:
        raise ValueError(f"env.options.max_turns={opts['max_turns']}: in [1, 64]")
    if not 16 <= opts["max_chars"] <= 1 << 16:
        raise ValueError(f"env.options.max_chars={opts['max_chars']}: in [16, 65536]")
    return opts


def check(env_cfg: Any) -> None:
    opts = _options(env_cfg)
    make_task(env_cfg.id, opts)
    reward_fn(opts["reward"])


def make_task(name: str, opts: dict[str, Any]) -> Any:
    return task_class(name)(level=opts["level"], split=opts["split"], held_out_fraction=opts["held_out_fraction"])


class TextTaskEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, task: Any, opts: dict[str, Any], index: int):
        self.task, self.opts = task, opts
        self.reward = reward_fn(opts["reward"])
        self.multi_turn = bool(getattr(task, "multi_turn", False))
        self.member = index % opts["group_size"]  # position in its group: seeds shift back to the group's first
        self.observation_space = gym.spaces.Text(opts["max_chars"], charset=CHARSET)
        self.action_space = gym.spaces.Text(opts["max_chars"], charset=CHARSET)
        self.rng = np.random.default_rng(index)
        self.problem = None
        self.turns = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.rng = np.random.default_rng(seed - self.member)
        self.problem = self.task.problem(self.rng)
        self.turns = 0
        return self.task.prompt(self.problem), {"answer": self.problem.answer}

    def step(self, action: str):
        self.turns += 1
        if not self.multi_turn:
            return "", self.reward(self.task, self.problem, action), True, False, {}
        turn = run_turn(action)
        if turn.done:
            return "", self.reward(self.task, self.problem, turn.answer), True, False, {}
        penalty = -self.opts["parse_penalty"] if turn.malformed else 0.0
        return turn.reply, penalty, False, self.turns >= self.opts["max_turns"], {"malformed": turn.malformed}


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    opts = _options(env_cfg)
    task = make_task(env_cfg.id, opts)
    return vectorize_fns([lambda i=i: TextTaskEnv(task, opts, i) for i in range(num_envs)], vectorization)
