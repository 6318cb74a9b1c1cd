"""bench/reasoning_data.py: the generated reasoning sets both sides of bench/grpo_vs_trl.py train on. Its rows must
be right (a wrong worked step would teach wrong arithmetic), train and held-out disjoint, and the long-tail variant
must really have a long tail: responses ~10x apart in length, mixed in nearly every batch."""

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import reasoning_data as rd  # noqa: E402


@pytest.mark.parametrize("variant", list(rd.VARIANTS))
def test_rows_are_verified_and_the_splits_disjoint(variant):
    train, held = rd.build(600, 100, seed=3, variant=variant)
    assert len(train) == 600 and len(held) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for row in train + held:
        rd.verify(row)  # raises on a wrong step or a misplaced answer line


def test_the_reasoning_variant_has_only_worked_solutions():
    train, _ = rd.build(300, 50, seed=0)
    assert all("Step 1:" in r["completion"] for r in train)
    assert min(len(r["completion"].split()) for r in train) > 15


def test_the_long_tail_variant_spans_ten_times_in_length_in_almost_every_batch():
    train, _ = rd.build(2000, 100, seed=0, variant="longtail")
    words = [len(r["completion"].split()) for r in train]
    short = [len(r["completion"]) for r, w in zip(train, words, strict=True) if w <= 10]  # in characters
    long = [len(r["completion"]) for r, w in zip(train, words, strict=True) if w > 10]
    assert 0.4 < len(short) / len(words) < 0.6  # half one-line sums, half worked problems
    assert statistics.median(long) >= 8 * statistics.median(short)  # ~10x (and so in the profile's BPE tokens)
    # batches of 4 prompts (the profile's): the share holding both a one-line sum and a worked problem
    mixed = sum(1 for i in range(0, len(words) - 3, 4) if min(words[i:i + 4]) <= 10 < max(words[i:i + 4]))
    assert mixed / (len(words) // 4) > 0.8
