"""Multi-turn tool use, Search-R1 style: arithmetic over facts the model must look up, with a calculator.

Turn protocol (every tag on one model turn; the first complete tag counts):

    <search>legs of a spider</search>   the env answers  <result>8</result>      (best match in a shipped corpus)
    <calc>8*7+3</calc>                   the env answers  <result>59</result>     (integers, + - * and parentheses)
    <answer>59</answer>                  the episode ends; reward by the task's verifier

A turn without a complete tag, or with a tool call the env cannot run (an unknown fact, a malformed expression),
ends that turn with ``<error>...</error>`` and a parse penalty; the episode goes on until ``max_turns``. Tool
output is context, not the model's action: the collector masks it out of the loss.

``run_turn`` takes the tools a task offers (a name -> function of the call's body); data-set tasks offer a BM25
search over a user's corpus through the same protocol (services/env/tasks/dataset.py).
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlfabric.services.env.tasks.arith import ArithTask, Problem, held_out

FACTS: dict[str, int] = json.loads((Path(__file__).parent / "data" / "facts.json").read_text())
MAX_EXPR = 64


class ToolError(ValueError):
    """A tool call the env cannot run; its message is what the model reads back."""


def search(query: str) -> int:
    """The fact whose name shares the most words with the query (ties: the shorter name); an error if none does."""
    words = set(re.findall(r"[a-z]+", query.lower()))
    best = max(FACTS, key=lambda k: (len(words & set(k.split())), -len(k)))
    if not words & set(best.split()) - {"a", "an", "the", "of", "in", "on"}:
        raise ToolError(f"no fact matches {query[:40]!r}")
    return FACTS[best]


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
        left, right = _eval(node.left), _eval(node.right)
        value = left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
            else left * right
        if abs(value) > 10**12:
            raise ToolError("result too large")
        return value
    raise ToolError("only integers, + - * and parentheses")


def calc(expr: str) -> int:
    """An integer expression, evaluated by walking its syntax tree (never ``eval``), bounded in size."""
    if len(expr) > MAX_EXPR:
        raise ToolError(f"expression longer than {MAX_EXPR} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ToolError("malformed expression") from None
    return _eval(tree)


@dataclass(frozen=True)
class Turn:
    """What the env makes of one model turn: the text it answers with, whether the episode ends, the answer given
    (when it ends with one) and whether the turn was malformed (a parse penalty)."""

    reply: str
    done: bool
    answer: str | None = None
    malformed: bool = False


Tool = Callable[[str], object]  # the body of a call -> its result (the model reads str(result)); ToolError if it cannot
ARITH_TOOLS: dict[str, Tool] = {"search": search, "calc": calc}


@functools.lru_cache(maxsize=16)
def _tags(names: tuple[str, ...]) -> tuple[re.Pattern, str]:
    """The pattern of one complete tag of these tools or <answer>, and how an error names them."""
    shown = [f"<{n}>" for n in (*names, "answer")]
    listed = f"{', '.join(shown[:-1])} or {shown[-1]}"
    return re.compile(rf"<({'|'.join(map(re.escape, (*names, 'answer')))})>(.*?)</\1>", re.DOTALL), listed


def run_turn(text: str, tools: Mapping[str, Tool] | None = None) -> Turn:
    """One model turn under the tool protocol, with ``tools`` (default: arithmetic's search and calculator)."""
    tools = ARITH_TOOLS if tools is None else tools
    tag, listed = _tags(tuple(tools))
    match = tag.search(text)
    if match is None:
        return Turn(f"<error>no complete {listed} tag</error>", False, malformed=True)
    kind, body = match.group(1), match.group(2)
    if kind == "answer":
        return Turn("", True, answer=body)
    try:
        value = tools[kind](body)
    except ToolError as exc:
        return Turn(f"<error>{exc}</error>", False, malformed=True)
    return Turn(f"<result>{value}</result>", False)


class ToolArithTask(ArithTask):
    """Problems "<fact> * b + c" (e.g. "legs of a spider*7+3"): look the fact up, compute, answer. The split,
    the verifier and ``problems`` are arithmetic's."""

    multi_turn = True
    tools = ARITH_TOOLS
    prompt_suffix = " Use <search>, <calc>, then <answer>."

    def __init__(self, level: int = 1, split: str = "train", held_out_fraction: float = 0.2):
        super().__init__(level, split, held_out_fraction)
        self.names = sorted(FACTS)

    def problem(self, rng: np.random.Generator) -> Problem:
        want = self.split == "held_out"
        for _ in range(10_000):
            name = self.names[int(rng.integers(len(self.names)))]
            b, c = int(rng.integers(2, 10)), int(rng.integers(0, 100))
            question = f"{name}*{b}+{c}"
            if held_out(question, self.fraction) == want:
                return Problem(question, str(FACTS[name] * b + c))
        raise RuntimeError(f"no {self.split} problems at held_out_fraction {self.fraction}")

    def prompt(self, problem: Problem) -> str:
        return problem.prompt + self.prompt_suffix

    def transcript(self, problem: Problem) -> list[tuple[str, bool]]:
        """A correct episode: search the fact, compute with it, answer (tool replies are not the model's)."""
        name, rest = problem.question.split("*")
        expr = f"{FACTS[name]}*{rest}"
        out: list[tuple[str, bool]] = [(self.prompt(problem), False)]
        for turn in (f"<search>{name}</search>", f"<calc>{expr}</calc>", f"<answer>{problem.answer}</answer>"):
            out.append((turn, True))
            reply = run_turn(turn)
            if not reply.done:
                out.append((reply.reply, False))
        return out

