"""On-policy distillation end to end (examples/arith_opd.yaml): a small student (64 wide, 1 layer) imitates the
arithmetic data for 150 updates (about 0.08 held-out accuracy), then learns from its teacher alone (the 128 x 2 SFT
checkpoint test_arith_grpo.py's artefact holds, with its held-out accuracy over the same 512 problems): no task
reward. It must end within 5 points of the teacher (seed 0 here: teacher 0.31, student 0.08 -> 0.37 over the 512
problems, 82 s alone on 2 cores; with one update per batch of 64 prompts instead of two per 128, 0.40 over 256 in
~110 s)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from tests.e2e.test_arith_grpo import EVAL_EPISODES, _accuracy, _cli, warm_start  # noqa: F401 (a fixture)

pytestmark = pytest.mark.minutes(3)
STUDENT = "policy.lm={arch: llama, hidden_size: 64, intermediate_size: 128, layers: 1, heads: 2, max_positions: 64}"


@pytest.mark.slow
def test_a_small_student_distilled_on_its_own_samples_comes_within_5_points_of_its_teacher(warm_start, tmp_path):  # noqa: F811
    from rlfabric.services.env.tasks.sft_data import build

    teacher, teacher_accuracy = warm_start
    data = tmp_path / "arith_sft.npz"
    np.savez(data, **build("arith", 4000, seed=0))
    _cli("train", "examples/arith_sft.yaml", "--run-dir", str(tmp_path / "student"), "--quiet",
         "--set", f"replay.datasets.offline={data}", "--set", "algorithm.total_updates=150", "--set", STUDENT)
    student = tmp_path / "student" / "checkpoints" / "final.pt"
    before = _accuracy(student)
    _cli("train", "examples/arith_opd.yaml", "--run-dir", str(tmp_path / "opd"), "--quiet",
         "--set", f"policy.init_checkpoint={student}", "--set", f"algorithm.expert_checkpoint={teacher}",
         "--set", "train.eval_every_iterations=0")
    after = _accuracy(tmp_path / "opd" / "checkpoints" / "final.pt")
    assert before < teacher_accuracy - 0.15, (before, teacher_accuracy)  # a gap to close
    assert after >= teacher_accuracy - 0.05, f"student {before:.3f} -> {after:.3f}, teacher {teacher_accuracy:.3f} " \
                                             f"({EVAL_EPISODES} held-out problems)"
    with open(tmp_path / "opd" / "metrics.csv") as f:
        kl = [float(r["reverse_kl"]) for r in csv.DictReader(f) if r.get("reverse_kl")]
    assert np.mean(kl[-50:]) < 0.5 * np.mean(kl[:50]), (kl[:3], kl[-3:])  # it got there by matching the teacher
