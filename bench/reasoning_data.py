"""A generated GSM8K-like data set for the reasoning profile of bench/grpo_vs_trl.py: multi-step word problems
(2-4 steps of + - * over small numbers, varied people, things and sentences) whose completions are worked solutions
ending in ``#### N`` (GSM8K's answer line), so RL samples are long and uneven as in real reasoning RL.

Rows are ``{"prompt", "completion", "answer"}``: ``prompt`` is the question already in its ``Question: ...
Answer:`` frame (no template is needed on either side), ``completion`` starts with a space and ends with the
answer line. Train and held-out files are disjoint by question text.

The ``longtail`` variant (the long-tail profile) mixes in as many one-line sums (``Compute 7 + 5.`` ->
`` 7 + 5 = 12`` and the answer line, ~13 tokens with the digit-by-digit BPE) as worked problems (up to ~150): correct responses then range
over ~10x in length, and almost every batch holds both, as when an RL prompt set mixes easy and hard problems.

    python bench/reasoning_data.py DIR --train 6000 --held-out 500 [--variant longtail]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

NAMES = ["Ava", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Milo", "Nina",
         "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vik", "Wes", "Yara", "Zoe"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "shells", "cards", "stamps",
         "beads", "eggs", "oranges", "toy cars", "seeds", "buttons"]
BOXES = ["boxes", "bags", "baskets", "jars", "shelves", "trays"]
ADD = ["{n} buys {k} more {item}.", "A friend gives {n} {k} {item}.", "{n} finds {k} {item} in the park.",
       "Later, {n} picks up {k} more {item}.", "{n} wins {k} {item} at a fair."]
ADD_WHY = ["{n} gets {k} more", "{n} adds {k}", "{k} more are added"]
SUB = ["{n} gives {k} {item} to {m}.", "{n} loses {k} {item}.", "{n} sells {k} {item} at the market.",
       "Then {n} uses {k} of the {item}.", "{m} borrows {k} {item} from {n}."]
SUB_WHY = ["{k} are taken away", "{n} has {k} fewer", "{k} are gone"]
MUL = ["Then the number of {item} {n} has becomes {k} times as large.",
       "{n} gets enough {item} to have {k} times as many as before.",
       "Next, {n} makes {k} copies of the whole pile, so the pile is {k} times as big."]
MUL_WHY = ["the amount is multiplied by {k}", "{n} now has {k} times as many", "it grows {k} times"]


def _running(rng: random.Random) -> tuple[str, str, int]:
    """One person's count through 2-4 events."""
    n, m = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x = rng.randint(3, 20)
    steps = rng.randint(2, 4)
    q = [f"{n} has {x} {item}."]
    a = [f" {n} starts with {x} {item}."]
    used_mul = False
    for i in range(steps):
        ops = ["+", "-"] + ([] if used_mul or x > 40 else ["*"])
        op = rng.choice(ops)
        if op == "-" and x < 2:
            op = "+"
        if op == "+":
            k = rng.randint(2, 20)
            q.append(rng.choice(ADD).format(n=n, m=m, k=k, item=item))
            why, y = rng.choice(ADD_WHY), x + k
            a.append(f"Step {i + 1}: {why.format(n=n, k=k)}, so {x} + {k} = {y}. {n} now has {y} {item}.")
        elif op == "-":
            k = rng.randint(1, min(x - 1, 15))
            q.append(rng.choice(SUB).format(n=n, m=m, k=k, item=item))
            why, y = rng.choice(SUB_WHY), x - k
            a.append(f"Step {i + 1}: {why.format(n=n, k=k)}, so {x} - {k} = {y}. {n} now has {y} {item}.")
        else:
            k = rng.randint(2, 3)
            used_mul = True
            q.append(rng.choice(MUL).format(n=n, k=k, item=item))
            why, y = rng.choice(MUL_WHY), x * k
            a.append(f"Step {i + 1}: {why.format(n=n, k=k)}, so {x} * {k} = {y}. {n} now has {y} {item}.")
        x = y
    q.append(rng.choice([f"How many {item} does {n} have now?", f"How many {item} does {n} have at the end?"]))
    return " ".join(q), "\n".join(a), x


def _packing(rng: random.Random) -> tuple[str, str, int]:
    """Containers of things, some added and some removed: 2-4 steps."""
    n = rng.choice(NAMES)
    item, box = rng.choice(ITEMS), rng.choice(BOXES)
    b, per = rng.randint(2, 9), rng.randint(2, 9)
    total = b * per
    q = [f"{n} has {b} {box} with {per} {item} in each."]
    a = [f" Step 1: there are {b} {box} of {per} {item}, so {b} * {per} = {total} {item}."]
    extra = rng.randint(1, 3)
    for i in range(extra):
        if rng.random() < 0.5 or total < 3:
            k = rng.randint(2, 15)
            q.append(f"{n} puts {k} loose {item} on the table too.")
            a.append(f"Step {i + 2}: {k} loose {item} are added, so {total} + {k} = {total + k}.")
            total += k
        else:
            k = rng.randint(1, min(total - 1, 12))
            q.append(f"{rng.choice(NAMES)} takes {k} {item} away.")
            a.append(f"Step {i + 2}: {k} {item} are taken away, so {total} - {k} = {total - k}.")
            total -= k
    q.append(f"How many {item} are there in all?")
    a.append(f"There are {total} {item} in all.")
    return " ".join(q), "\n".join(a), total


def _two_people(rng: random.Random) -> tuple[str, str, int]:
    """Two people's counts compared, then summed: 3-4 steps."""
    n, m = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x = rng.randint(2, 15)
    if rng.random() < 0.5:
        k = rng.randint(2, 12)
        y = x + k
        q = [f"{n} has {x} {item}. {m} has {k} more {item} than {n}."]
        a = [f" Step 1: {m} has {k} more than {n}, so {x} + {k} = {y}. {m} has {y} {item}."]
    else:
        k = rng.randint(2, 3)
        y = x * k
        q = [f"{n} has {x} {item}. {m} has {k} times as many {item} as {n}."]
        a = [f" Step 1: {m} has {k} times as many as {n}, so {x} * {k} = {y}. {m} has {y} {item}."]
    s = 2
    if rng.random() < 0.5:
        k = rng.randint(1, min(y - 1, 10))
        q.append(f"Then {m} gives away {k} {item}.")
        a.append(f"Step {s}: {m} gives away {k}, so {y} - {k} = {y - k}. {m} has {y - k} {item}.")
        y -= k
        s += 1
    q.append(f"How many {item} do {n} and {m} have together?")
    a.append(f"Step {s}: together they have {x} + {y} = {x + y} {item}.")
    return " ".join(q), "\n".join(a), x + y


def _direct(rng: random.Random) -> tuple[str, str, int]:
    """One operation asked and answered in a line: the short end of the long-tail variant."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    if op == "-":
        a, b = max(a, b), min(a, b)
    if op == "*":
        b = rng.randint(2, 9)
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Compute {a} {op} {b}.", f" {a} {op} {b} = {c}", c


FAMILIES = (_running, _running, _packing, _two_people)
VARIANTS = {"reasoning": FAMILIES, "longtail": (_direct, _direct, _direct, _running, _packing, _two_people)}


EQUATION = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def verify(row: dict) -> None:
    """Every ``a op b = c`` of a worked solution holds, the last result is the answer, and the answer line says it:
    a generator bug must not teach the model wrong arithmetic."""
    steps = EQUATION.findall(row["completion"])
    for a, op, b, c in steps:
        if {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] != int(c):
            raise AssertionError(f"wrong step {a} {op} {b} = {c} in {row['completion']!r}")
    if not steps or steps[-1][3] != row["answer"] or not row["completion"].endswith(f"#### {row['answer']}"):
        raise AssertionError(f"the answer {row['answer']} is not where the solution ends: {row['completion']!r}")


def problem(rng: random.Random, families: tuple = FAMILIES) -> dict:
    question, work, answer = rng.choice(families)(rng)
    row = {"prompt": f"Question: {question}\nAnswer:", "completion": f"{work}\n#### {answer}",
           "answer": str(answer)}
    verify(row)
    return row


def build(train: int, held_out: int, seed: int = 0, variant: str = "reasoning") -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), disjoint by prompt: held-out prompts are drawn first and never trained on."""
    rng, families = random.Random(seed), VARIANTS[variant]
    held: dict[str, dict] = {}
    while len(held) < held_out:
        row = problem(rng, families)
        held.setdefault(row["prompt"], row)
    rows: list[dict] = []
    seen = set(held)
    for _ in range(train * 50):
        if len(rows) == train:
            break
        row = problem(rng, families)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    if len(rows) < train:
        raise ValueError(f"only {len(rows)} distinct train problems; ask for fewer (--train)")
    return rows, list(held.values())


def write(directory: str | Path, train: int, held_out: int, seed: int = 0, variant: str = "reasoning"
          ) -> tuple[Path, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows, held = build(train, held_out, seed, variant)
    paths = directory / "train.jsonl", directory / "held_out.jsonl"
    for path, part in zip(paths, (rows, held), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def token_lengths(tokenizer, rows: list[dict]) -> dict:
    """Completion token lengths (with the end token) and prompt lengths under ``tokenizer``: what RL samples."""
    comp = [len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    prompt = [len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows]
    return {"completion_tokens_mean": sum(comp) / len(comp), "completion_tokens_max": max(comp),
            "completion_tokens_min": min(comp), "prompt_tokens_mean": sum(prompt) / len(prompt),
            "prompt_tokens_max": max(prompt)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--held-out", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", choices=list(VARIANTS), default="reasoning")
    args = ap.parse_args()
    for path in write(args.dir, args.train, args.held_out, args.seed, args.variant):
        print(path)


if __name__ == "__main__":
    main()
