"""Verifiable arithmetic: generated problems at difficulty levels, a train/held-out split, exact-match answers.

    level 1   a+b            a, b in [0, 9]
    level 2   a+b            a, b in [0, 29]
    level 3   a+b, a-b       a, b in [0, 99]
    level 4   a*b            a in [0, 99], b in [0, 9]
    level 5   a+b-c, a*b+c   a, b in [0, 99] (a*b: b in [0, 9]), c in [0, 99]

A problem is held out when a hash of its text falls in the held-out share (``held_out_fraction``), so train and
held-out never share a problem. The prompt is ``"Q: 12+7= A:"``; the answer is the integer, then the end of the
response (the tokenizer's eos).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

LEVELS = (1, 2, 3, 4, 5)
INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only (str.isdigit would take other scripts' digits)
PROMPT = "Q: {question}= A:"


@dataclass(frozen=True)
class Problem:
    question: str  # "12+7"
    answer: str  # "19"

    @property
    def prompt(self) -> str:
        return PROMPT.format(question=self.question)

    @property
    def id(self) -> str:
        """What a log line names the problem by."""
        return self.question

    @property
    def fields(self) -> dict[str, str]:
        """What a reward gets as ``**fields``."""
        return {"question": self.question}


def held_out(question: str, fraction: float) -> bool:
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def parse_int(text: str) -> int | None:
    """The integer a response states (surrounding spaces allowed), or None: exact match, no partial credit."""
    text = text.strip()
    return int(text) if len(text) <= 32 and INTEGER.fullmatch(text) else None


class ArithTask:
    """Problems of one difficulty level from one split ("train" or "held_out")."""

    def __init__(self, level: int = 2, split: str = "train", held_out_fraction: float = 0.2):
        if level not in LEVELS:
            raise ValueError(f"env.options.level={level!r}: arithmetic levels are {list(LEVELS)}")
        if split not in ("train", "held_out"):
            raise ValueError(f"env.options.split={split!r}: use train or held_out")
        if not 0 < held_out_fraction < 1:
            raise ValueError(f"env.options.held_out_fraction={held_out_fraction!r}: a share in (0, 1)")
        self.level, self.split, self.fraction = level, split, held_out_fraction

    def _draw(self, rng: np.random.Generator) -> Problem:
        r = lambda hi: int(rng.integers(0, hi + 1))  # noqa: E731
        if self.level == 1:
            a, b = r(9), r(9)
            return Problem(f"{a}+{b}", str(a + b))
        if self.level == 2:
            a, b = r(29), r(29)
            return Problem(f"{a}+{b}", str(a + b))
        if self.level == 3:
            a, b = r(99), r(99)
            return Problem(f"{a}+{b}", str(a + b)) if rng.random() < 0.5 else Problem(f"{a}-{b}", str(a - b))
        if self.level == 4:
            a, b = r(99), r(9)
            return Problem(f"{a}*{b}", str(a * b))
        a, c = r(99), r(99)
        if rng.random() < 0.5:
            b = r(99)
            return Problem(f"{a}+{b}-{c}", str(a + b - c))
        b = r(9)
        return Problem(f"{a}*{b}+{c}", str(a * b + c))

    def problem(self, rng: np.random.Generator) -> Problem:
        """A problem of this task's split (rejection sampling over the hash split)."""
        want = self.split == "held_out"
        for _ in range(10_000):
            p = self._draw(rng)
            if held_out(p.question, self.fraction) == want:
                return p
        raise RuntimeError(f"level {self.level} has no {self.split} problems at held_out_fraction {self.fraction}")

    def prompt(self, problem: Problem) -> str:
        return problem.prompt

    def transcript(self, problem: Problem) -> list[tuple[str, bool]]:
        """A correct episode as (text, said by the model) segments: what supervised warm starts train on."""
        return [(self.prompt(problem), False), (" " + problem.answer, True)]

    def problems(self, n: int, seed: int) -> list[Problem]:
        rng = np.random.default_rng(seed)
        return [self.problem(rng) for _ in range(n)]

    @staticmethod
    def correct(problem: Problem, answer: str) -> bool:
        value = parse_int(answer)
        return value is not None and value == int(problem.answer)
