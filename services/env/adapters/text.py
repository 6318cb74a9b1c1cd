"""Text adapter: a text task (services/env/tasks) as a vector env with Text observation and action spaces.

    env: {adapter: text, id: arith, num_envs: 64, options: {level: 2, group_size: 8, reward: exact_match}}
    env: {adapter: text, id: dataset, options: {path: gsm8k.jsonl, prompt_field: question, reward: gsm8k}}

An observation is the text to append to the model's context (the prompt at reset; a tool's reply later); an
action is the model's turn. Single-turn tasks end after one turn. Tool tasks go on until an answer or
``max_turns`` turns (truncated, reward 0); a malformed turn costs ``parse_penalty`` and the episode continues.

Rewards run in the env process's reward pool (services/env/reward_pool.py): a step submits all the answers that
finished in it at once and waits for them, so N envs score N samples concurrently, and a reward that raises,
hangs or kills its worker costs only its sample (``failure_reward``; the step's info says ``reward_failed``).
The envs themselves step in this process whatever ``env.vectorization`` says: their work is string handling.

Groups: with ``group_size`` G, envs i and j with i // G == j // G draw the same problems from a seeded reset (the
G samples of one group answer the same prompt). Text crosses the data plane as UTF-8 bytes (a Ragged uint8
field), bounded by ``max_chars``.
"""

from __future__ import annotations

import inspect
import string
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from rlfabric.services.core.textdata import chat_messages, plain_chat
from rlfabric.services.env import reward_pool
from rlfabric.services.env.tasks import task_class
from rlfabric.services.env.tasks.rewards import REWARDS
from rlfabric.services.env.tasks.tools import run_turn

collector = "llm"  # rollout.collector auto: LLM turns (generation, tools)
CHARSET = string.printable

# name -> (type, default, what it is). The adapter's own options, for every task:
ADAPTER_OPTIONS: dict[str, tuple[type, Any, str]] = {
    "reward": (str, "exact_match", "the reward: a built-in (exact_match, format_match, signed_match, gsm8k, math), "
                                   "an entry point of group rlfabric.rewards, or package.module:function"),
    "group_size": (int, 1, "samples per prompt: envs i // group_size answer the same prompt (default 1)"),
    "max_turns": (int, 4, "model turns per episode of a tool task before it is truncated (default 4)"),
    "parse_penalty": (float, 0.1, "reward subtracted for a malformed tool turn (default 0.1)"),
    "max_chars": (int, 512, "the longest model turn, in UTF-8 bytes (default 512)"),
    "reward_timeout_s": (float, 10.0, "seconds one reward call may run before its sample scores failure_reward "
                                      "(default 10)"),
    "reward_step_timeout_s": (float, 20.0, "seconds one env step may spend scoring all its answers, queueing "
                                           "included; answers unscored by then score failure_reward. Keep it under "
                                           "data_plane.timeout_s (default 20)"),
    "reward_memory_mb": (int, 0, "address-space limit of each reward worker process, in MiB, at most the "
                                 "service operator's --reward-memory-mb (default: that limit, 2048 unless set)"),
    "reward_workers": (int, 2, "reward worker processes per env process (default 2)"),
    "failure_reward": (float, 0.0, "the reward of a sample whose reward raised, timed out or killed its worker "
                                   "(default 0.0)"),
}
# ... and the options tasks take (passed to the task's constructor; a task that does not take one refuses it):
TASK_OPTIONS: dict[str, tuple[type, Any, str]] = {
    "level": (int, None, "arith, arith_tool: difficulty level 1-5 (default 2; arith_tool 1)"),
    "split": (str, None, "train or held_out: which problems the task draws (default train)"),
    "held_out_fraction": (float, None, "share of problems held out by a hash of the problem (default 0.2)"),
    "path": (str, None, "dataset: the JSONL or Parquet file of rows (required)"),
    "prompt_field": (str, None, "dataset: the field that holds the prompt, a string or chat messages "
                                "(default prompt)"),
    "answer_field": (str, None, "dataset: the field that holds the reference answer (default answer)"),
    "system_prompt": (str, None, "dataset: a system message put before each chat prompt (default none)"),
    "template": (str, None, "dataset: a plain-text prompt, e.g. 'Question: {prompt}\\nAnswer:' (default: chat)"),
    "eval_path": (str, None, "dataset: a held-out file, read by split held_out (default: a hash split of path)"),
    "tools": (list, None, "dataset: the tools the model may call: [search] (default none)"),
    "corpus": (str, None, "dataset: a JSONL file of passages ('text', optional 'title') that search looks in"),
}
OPTIONS = {**ADAPTER_OPTIONS, **TASK_OPTIONS}


def _kind_ok(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float) and bool(np.isfinite(value))
    if kind is list:
        return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    return isinstance(value, kind)


def _task_params(cls: Any) -> tuple[set[str], bool]:
    """The option names a task's constructor takes, and whether it takes **kwargs (passed on to a base task)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def _required(cls: Any) -> set[str]:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _options(env_cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the adapter's options with defaults, the options for the task's constructor), checked."""
    cls = task_class(env_cfg.id)
    named, var_kw = _task_params(cls)
    given = dict(env_cfg.options)
    unknown = sorted(k for k in given if k not in OPTIONS and k not in named)
    if unknown:
        raise ValueError(f"env.options {unknown} are not text-task options; use {sorted(OPTIONS)}")
    task_opts = {}
    for key in sorted(k for k in given if k not in ADAPTER_OPTIONS):
        if key not in named and not (var_kw and key in TASK_OPTIONS):
            raise ValueError(f"env.options.{key} does not apply to env.id {env_cfg.id!r} (it takes "
                             f"{sorted(named & set(TASK_OPTIONS)) or 'no task options'}). Fix: remove it")
        task_opts[key] = given[key]
    opts = {k: default for k, (_, default, _) in ADAPTER_OPTIONS.items()} | {
        k: v for k, v in given.items() if k in ADAPTER_OPTIONS}
    for key, value in (opts | task_opts).items():
        if key in OPTIONS and not _kind_ok(value, OPTIONS[key][0]):
            kind, _, what = OPTIONS[key]
            shown = "list of names" if kind is list else f"finite {kind.__name__}" if kind is float else kind.__name__
            raise ValueError(f"env.options.{key}={value!r}: expected a {shown} ({what})")
    if not 1 <= opts["group_size"] <= 1024:
        raise ValueError(f"env.options.group_size={opts['group_size']}: samples per prompt, in [1, 1024]")
    if env_cfg.num_envs % opts["group_size"]:
        raise ValueError(f"env.num_envs={env_cfg.num_envs} is not a multiple of env.options.group_size="
                         f"{opts['group_size']}. Fix: num_envs = prompts per step x group_size")
    if not 1 <= opts["max_turns"] <= 64:
        raise ValueError(f"env.options.max_turns={opts['max_turns']}: in [1, 64]")
    if not 16 <= opts["max_chars"] <= 1 << 16:
        raise ValueError(f"env.options.max_chars={opts['max_chars']}: in [16, 65536]")
    limits = reward_pool.operator_limits()
    if "reward_timeout_s" not in given:
        opts["reward_timeout_s"] = min(opts["reward_timeout_s"], limits.timeout_s)
    if not 0 < opts["reward_timeout_s"] <= limits.timeout_s:
        raise ValueError(f"env.options.reward_timeout_s={opts['reward_timeout_s']}: seconds in (0, "
                         f"{limits.timeout_s:g}], the most this service's operator allows (--reward-timeout-s)")
    if not opts["reward_timeout_s"] <= opts["reward_step_timeout_s"] <= 3600:
        raise ValueError(f"env.options.reward_step_timeout_s={opts['reward_step_timeout_s']}: seconds in "
                         f"[reward_timeout_s={opts['reward_timeout_s']}, 3600] (a step waits for at least one call)")
    if "reward_memory_mb" not in given:
        opts["reward_memory_mb"] = limits.memory_mb
    elif opts["reward_memory_mb"] == 0 and limits.memory_mb == 0:
        pass  # no limit, as the operator chose (--reward-memory-mb 0)
    elif not 256 <= opts["reward_memory_mb"] <= (limits.memory_mb or 1 << 20):
        raise ValueError(f"env.options.reward_memory_mb={opts['reward_memory_mb']}: MiB in [256, "
                         f"{limits.memory_mb or 1 << 20}]; a run spec may lower this service operator's limit "
                         f"(--reward-memory-mb), never lift it (0, no limit, only where the operator set 0)")
    if not 1 <= opts["reward_workers"] <= 64:
        raise ValueError(f"env.options.reward_workers={opts['reward_workers']}: processes in [1, 64]")
    for key in _required(cls) - set(task_opts):
        what = f" ({TASK_OPTIONS[key][2]})" if key in TASK_OPTIONS else ""
        raise ValueError(f"env.options.{key} is required for env.id {env_cfg.id!r}{what}")
    if "tools" in task_opts:
        task_opts["tools"] = list(task_opts["tools"])
    return opts, task_opts


def check(env_cfg: Any) -> None:
    """The options, the task (a data-set task reads its file) and the reward's name, checked in this process."""
    _, task_opts = _options(env_cfg)
    make_task(env_cfg.id, task_opts)
    REWARDS.load(dict(env_cfg.options).get("reward", ADAPTER_OPTIONS["reward"][1]))


def make_task(name: str, task_opts: dict[str, Any]) -> Any:
    try:
        return task_class(name)(**task_opts)
    except TypeError as exc:
        raise ValueError(f"env.id {name!r} could not be built from env.options {sorted(task_opts)}: {exc}") from None


def reward_prompt(text: str) -> str:
    """The prompt as a reward reads it: a chat's message contents, a blank line apart; plain text as it is."""
    messages = chat_messages(text)
    return plain_chat(messages) if messages is not None else text


class TextTaskEnv:
    """One env's episode: its problem, its turns, its place in its group."""

    def __init__(self, task: Any, opts: dict[str, Any], index: int):
        self.task, self.opts, self.index = task, opts, index
        self.multi_turn = bool(getattr(task, "multi_turn", False))
        self.tools = getattr(task, "tools", None)
        self.member = index % opts["group_size"]  # position in its group: seeds shift back to the group's first
        self.rng = np.random.default_rng(index)
        self.problem = None
        self.turns = 0

    def reset(self, seed: int | None = None) -> str:
        if seed is not None:
            self.rng = np.random.default_rng(seed - self.member)
        self.problem = self.task.problem(self.rng)
        self.turns = 0
        return self.task.prompt(self.problem)

    def act(self, action: str) -> tuple[str, float, bool, bool, str | None, bool]:
        """(reply, reward so far, terminated, truncated, the answer to score or None, malformed)."""
        self.turns += 1
        if not self.multi_turn:
            return "", 0.0, True, False, action, False
        turn = run_turn(action, self.tools)
        if turn.done:
            return "", 0.0, True, False, turn.answer, False
        penalty = -self.opts["parse_penalty"] if turn.malformed else 0.0
        return turn.reply, penalty, False, self.turns >= self.opts["max_turns"], None, turn.malformed

    def call(self, target: str, completion: str) -> reward_pool.RewardCall:
        p = self.problem
        return reward_pool.RewardCall(
            sample=f"env {self.index}, {getattr(p, 'id', p)}", reward=target,
            prompt=reward_prompt(self.task.prompt(p)), completion=completion, answer=str(p.answer),
            fields=reward_pool.fields_json(dict(getattr(p, "fields", {}))))


class TextVectorEnv(gym.vector.VectorEnv):
    """Text envs stepped together with same-step auto-reset; the answers that finish in a step are scored at once
    in the reward pool. A finished env's info (``final_info``) says ``reward_failed`` (1.0 where its reward
    failed) and ``malformed``."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, task: Any, opts: dict[str, Any], num_envs: int):
        self.opts = opts
        self.num_envs = num_envs
        self.single_observation_space = gym.spaces.Text(opts["max_chars"], charset=CHARSET)
        self.single_action_space = gym.spaces.Text(opts["max_chars"], charset=CHARSET)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.envs = [TextTaskEnv(task, opts, i) for i in range(num_envs)]
        self.target = REWARDS.target(opts["reward"])
        self.pool: reward_pool.RewardPool | None = reward_pool.acquire(opts["reward_workers"],
                                                                       opts["reward_memory_mb"])
        try:
            self.pool.resolve(self.target, opts["reward"])
        except BaseException:
            self.close()
            raise

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        n = self.num_envs
        seeds = [None] * n if seed is None else [seed + i for i in range(n)] if isinstance(seed, int) else list(seed)
        if len(seeds) != n:
            raise ValueError(f"reset got {len(seeds)} seeds for {n} envs")
        obs = tuple(env.reset(s) for env, s in zip(self.envs, seeds, strict=True))
        return obs, {}

    def step(self, actions):
        n = self.num_envs
        obs = [""] * n
        rewards = np.zeros(n)
        terminated, truncated = np.zeros(n, bool), np.zeros(n, bool)
        malformed, failed = np.zeros(n, bool), np.zeros(n, np.float32)
        calls, owners = [], []
        for i, (env, action) in enumerate(zip(self.envs, actions, strict=True)):
            obs[i], rewards[i], terminated[i], truncated[i], answer, malformed[i] = env.act(action)
            if answer is not None:
                calls.append(env.call(self.target, answer))
                owners.append(i)
        if calls:
            if self.pool is None:
                raise RuntimeError("the text env is closed")
            scores = self.pool.score(calls, self.opts["reward_timeout_s"], self.opts["failure_reward"],
                                     self.opts["reward_step_timeout_s"])
            for i, scored in zip(owners, scores, strict=True):
                rewards[i] += scored.value
                failed[i] = scored.failure is not None
        done = terminated | truncated
        info: dict[str, Any] = {}
        if any(env.multi_turn for env in self.envs):
            info |= {"malformed": malformed, "_malformed": ~done}
        if done.any():
            final_obs = np.array(obs, dtype=object)
            for i in np.flatnonzero(done):
                obs[i] = self.envs[i].reset()
            info |= {"final_obs": final_obs, "_final_obs": done.copy(), "_final_info": done.copy(),
                     "final_info": {"reward_failed": failed, "_reward_failed": done.copy(),
                                    "malformed": malformed, "_malformed": done.copy()}}
        return tuple(obs), rewards, terminated, truncated, info

    def close_extras(self, **kwargs: Any) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            reward_pool.release(pool)


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    opts, task_opts = _options(env_cfg)
    return TextVectorEnv(make_task(env_cfg.id, task_opts), opts, num_envs)
