"""Writes the small GSM8K-format data set the agentic quick start trains on: one-step word problems over numbers
below 30, each answer a worked step and the final number after "####" (GSM8K's own convention, so a real GSM8K
JSONL file drops in with the same options).

    python examples/data/make_sums.py examples/data     # sums_train.jsonl (2000 rows), sums_test.jsonl (200 rows)

Train and test never share a question (test questions are drawn first and excluded from train).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
THINGS = ["apples", "books", "coins", "shells", "stamps", "marbles", "pencils", "cards"]
ADD = ["{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
       "{n} picked {a} {t} in the morning and {b} in the afternoon. How many {t} did {n} pick?"]
SUB = ["{n} has {a} {t} and gives away {b}. How many {t} are left?",
       "There were {a} {t} on the table. {n} took {b}. How many {t} remain?"]


def problem(rng: random.Random) -> dict[str, str]:
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(0, 29), rng.randint(0, 29)
    if rng.random() < 0.5:
        q, step, value = rng.choice(ADD), f"{a} + {b} = {a + b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        q, step, value = rng.choice(SUB), f"{a} - {b} = {a - b}", a - b
    return {"question": q.format(n=n, a=a, b=b, t=t), "answer": f"{step}\n#### {value}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    test: dict[str, dict] = {}
    while len(test) < args.test:
        p = problem(rng)
        test.setdefault(p["question"], p)
    train: list[dict] = []
    while len(train) < args.train:
        p = problem(rng)
        if p["question"] not in test:
            train.append(p)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("sums_train.jsonl", train), ("sums_test.jsonl", list(test.values()))):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} train and {len(test)} test problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
