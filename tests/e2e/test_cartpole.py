"""The README's main job through real service processes: PPO solves CartPole-v1 on seed 0."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

THRESHOLD = 475.0


def _train(tmp_path, *sets: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/cartpole_ppo.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    rows = list(csv.DictReader(open(run_dir / "metrics.csv"))) if (run_dir / "metrics.csv").exists() else []
    return proc, rows


def _assert_solved(proc, rows, tmp_path):
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [(int(r["env_steps"]), float(r["eval_return_mean"])) for r in rows if r["eval_return_mean"]]
    assert rows[-1]["eval_weight_version"] == rows[-1]["weight_version"]  # eval saw the newest version
    assert evals and evals[-1][1] >= THRESHOLD, evals
    assert evals[-1][0] <= 100_000
    run_dir = tmp_path / "run"
    for name in ("config.yaml", "curve.png", "checkpoints/final.pt"):
        assert (run_dir / name).is_file()
    assert list(run_dir.glob("events.out.tfevents.*"))
    # the checkpoint is the evaluated policy: replayed in a fresh process without services, on the run's eval
    # seeds, it reproduces the run's last evaluation exactly
    played = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "eval", str(run_dir / "checkpoints/final.pt"),
                             "--episodes", "10"], capture_output=True, text=True, timeout=300)
    assert played.returncode == 0, played.stderr
    assert float(played.stdout.strip().splitlines()[-1]) == pytest.approx(evals[-1][1], abs=1e-3)


@pytest.mark.smoke
def test_cartpole_ppo_collocated_solves_on_seed_0(tmp_path):
    proc, rows = _train(tmp_path)
    _assert_solved(proc, rows, tmp_path)
    assert "SUCCEEDED" in proc.stderr and "reached eval return >= 475" in proc.stderr


@pytest.mark.slow
def test_cartpole_ppo_disaggregated_pipelined_solves_on_seed_0(tmp_path):
    proc, rows = _train(tmp_path, "scheduling.mode=disaggregated", "scheduling.pipeline_chunks=2")
    _assert_solved(proc, rows, tmp_path)
    assert {int(r["weight_version"]) - 1 - int(r["batch_version"]) for r in rows} == {0}  # strictly on-policy


HYBRID = ["scheduling.mode=hybrid", "scheduling.placement={env: a, rollout: a, learner: b}",
          "scheduling.pipeline_chunks=1"]


@pytest.mark.slow
def test_cartpole_ppo_hybrid_two_rollout_workers_solves_on_seed_0(tmp_path):
    proc, rows = _train(tmp_path, *HYBRID, "scheduling.rollout_workers=2")
    _assert_solved(proc, rows, tmp_path)
    assert {int(r["weight_version"]) - 1 - int(r["batch_version"]) for r in rows} == {0}  # strictly on-policy
    assert {r["rollout_workers"] for r in rows} == {"2"}


@pytest.mark.slow
def test_one_logical_workflow_same_learning_under_turns_and_streams(tmp_path):
    """On-policy (staleness 0), the collocated plan (stages take turns) and the hybrid plan (learner on its own
    pool, consuming a stream) run the same workflow: the same batches, hence bit-identical updates."""
    curves = []
    for name, sets in (("collocated", []), ("hybrid", HYBRID)):
        proc, rows = _train(tmp_path / name, *sets, "train.total_env_steps=5120", "train.eval_every_iterations=0")
        assert proc.returncode == 0, proc.stderr[-3000:]
        curves.append([(r["env_steps"], r["batch_version"], r["policy_loss"], r["value_loss"], r["train_return_mean"])
                       for r in rows])
    assert len(curves[0]) == 20 and curves[0] == curves[1]
