"""Rewards by name: how a finished answer becomes a scalar (``env.options.reward``).

Every reward has the signature veRL's and TRL's users write::

    reward(prompt: str, completion: str, answer: str, **fields) -> float

``prompt`` is the prompt as text (a chat prompt's message contents, a blank line apart), ``completion`` the
model's final answer (for tool tasks the body of its ``<answer>`` tag), ``answer`` the reference answer, and
``fields`` the data row's other fields (a data-set task) or the task's own (arith: ``question``). A reward that
names no ``**kwargs`` gets only the fields it names as parameters. Rewards run in the env's reward pool
(services/env/reward_pool.py): a reward that raises, hangs or kills its process costs only its sample.

    exact_match     1 when the completion is the answer: integers compare as integers, other answers as stripped
                    strings; else 0
    format_match    exact_match, plus 0.1 for a wrong answer that is an integer at all (a shaping term for cold
                    starts)
    signed_match    1 when right, -1 when wrong or unparseable (zero-mean for a policy at chance)
    gsm8k           GSM8K: the reference is what follows "####"; the completion's answer follows "####" if it has
                    one, else it is its last number; numbers compare exactly (commas removed)
    math            MATH: the completion's last \\boxed{...} and the reference (its last \\boxed{...} if it has one)
                    are parsed and compared by math-verify (1/2, 0.5 and \\frac{1}{2} are equal); 0 when either
                    does not parse

Names resolve through the registry: these built-ins, entry points of group ``rlfabric.rewards``, or
``package.module:function`` written in ``env.options.reward``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from rlfabric.services.core.registry import Registry
from rlfabric.services.env.tasks.answers import gsm8k_answer, last_boxed, to_number
from rlfabric.services.env.tasks.arith import parse_int

Reward = Callable[..., float]  # (prompt, completion, answer, **fields) -> reward


def _correct(completion: str, answer: str) -> bool:
    ref = parse_int(answer)
    if ref is not None:
        value = parse_int(completion)
        return value is not None and value == ref
    return completion.strip() == answer.strip()


def exact_match(prompt: str, completion: str, answer: str, **fields: Any) -> float:
    return 1.0 if _correct(completion, answer) else 0.0


def format_match(prompt: str, completion: str, answer: str, **fields: Any) -> float:
    if _correct(completion, answer):
        return 1.0
    return 0.1 if parse_int(completion) is not None else 0.0


def signed_match(prompt: str, completion: str, answer: str, **fields: Any) -> float:
    return 1.0 if _correct(completion, answer) else -1.0


def gsm8k(prompt: str, completion: str, answer: str, **fields: Any) -> float:
    ref = to_number(gsm8k_answer(answer))
    value = to_number(gsm8k_answer(completion))
    return 1.0 if ref is not None and value is not None and value == ref else 0.0


def math_verify_match(prompt: str, completion: str, answer: str, **fields: Any) -> float:
    """The ``math`` reward (math-verify compares the two as mathematical objects)."""
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    reference = last_boxed(answer) or answer.strip()
    from math_verify import parse, verify  # sympy and an ANTLR parser: only for runs that name this reward

    # math-verify bounds its own parse and compare with SIGALRM, which only the main thread may set; elsewhere
    # the reward pool's per-call timeout bounds it
    main = threading.current_thread() is threading.main_thread()
    limit = {"parsing_timeout": 5} if main else {"parsing_timeout": None}
    gold, pred = parse(f"${reference}$", **limit), parse(f"${boxed}$", **limit)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=5 if main else None) else 0.0


def check_reward(fn: Any) -> None:
    """A reward is a Python function (or a callable object) that takes ``(prompt, completion, answer)``: checked
    before the pool calls it, so a name that resolves to something else (``os:system``) is never called."""
    if isinstance(fn, type) or not callable(fn) or inspect.isbuiltin(fn):
        raise ValueError("a reward is a Python function reward(prompt, completion, answer, **fields) -> float")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError("it has no Python signature (a builtin?); a reward is a function reward(prompt, "
                         "completion, answer, **fields) -> float") from None
    try:
        signature.bind_partial("prompt", "completion", "answer")  # (its other parameters are data fields)
    except TypeError as exc:
        raise ValueError(f"it cannot take (prompt, completion, answer): {exc}") from None


REWARDS = Registry("rewards", "env.options.reward", {
    "exact_match": "rlfabric.services.env.tasks.rewards:exact_match",
    "format_match": "rlfabric.services.env.tasks.rewards:format_match",
    "signed_match": "rlfabric.services.env.tasks.rewards:signed_match",
    "gsm8k": "rlfabric.services.env.tasks.rewards:gsm8k",
    "math": "rlfabric.services.env.tasks.rewards:math_verify_match",
}, home="services/env/tasks/rewards.py", check=check_reward)  # entry points rlfabric.rewards, or package.module:function in the spec


def register_reward(name: str, fn: Reward | str) -> None:
    """In this process only; the reward pool's workers import a reward by its ``module:function`` target, so
    register module-level functions (not lambdas or closures)."""
    REWARDS.register(name, fn)


def reward_fn(name: str) -> Reward:
    return REWARDS.load(name)


_PARAMS: dict[Any, tuple[bool, frozenset[str], frozenset[str]]] = {}


def _params(fn: Reward) -> tuple[bool, frozenset[str], frozenset[str]]:
    """(takes **kwargs, the keyword names it takes, the names its three positional arguments bind)."""
    key = getattr(fn, "__wrapped__", fn)
    try:
        return _PARAMS[key]
    except (KeyError, TypeError):
        pass
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: give it the three arguments only
        return False, frozenset(), frozenset()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    bound = frozenset(p.name for p in positional)
    out = (var_kw, named - bound, bound)
    try:
        _PARAMS[key] = out
    except TypeError:  # an unhashable callable object
        pass
    return out


def call_reward(fn: Reward, prompt: str, completion: str, answer: str, fields: dict[str, Any]) -> float:
    """``fn(prompt, completion, answer, **fields)``, passing only the fields ``fn`` takes (all of them when it
    has ``**kwargs``; never one that would bind a positional argument twice). The value must be a finite number."""
    var_kw, named, bound = _params(fn)
    kwargs = {k: v for k, v in fields.items() if k not in bound and (var_kw or k in named)}
    value = fn(prompt, completion, answer, **kwargs)
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        raise TypeError(f"a reward returns a number, got {type(value).__name__}")
    out = float(value)
    if out != out or out in (float("inf"), float("-inf")):
        raise ValueError(f"a reward returns a finite number, got {out}")
    return out
