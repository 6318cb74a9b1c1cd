"""The off-policy family end to end: SAC on Pendulum-v1 through real services, under a plan whose stages take
turns and under one whose learner samples the replay window while rollout streams (staleness 1); and SAC-Flow (a
flow-matching actor sampled as a noisy K-step chain) reaching SAC's return in no more env steps on the same seed."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from rlfabric.services.learner import checkpoint

pytestmark = pytest.mark.minutes(1.2)  # on CI's 2 cores: the tiers start long files first

TARGET = -300.0  # random play scores about -1200 to -1500
HYBRID_STREAM = ["scheduling.mode=hybrid", "scheduling.placement={env: a, rollout: a, learner: b}",
                 "scheduling.pipeline_chunks=1", "scheduling.staleness=1"]


def train(run_dir, *sets: str) -> list[dict]:
    args = [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/pendulum_sac.yaml", "--run-dir",
            str(run_dir), "--quiet", "--set", "train.total_env_steps=15000"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reached eval return >= -300" in proc.stderr
    return list(csv.DictReader(open(run_dir / "metrics.csv")))


def steps_to_target(rows: list[dict]) -> int:
    return min(int(r["env_steps"]) for r in rows if r["eval_return_mean"] and float(r["eval_return_mean"]) >= TARGET)


def check_learned(rows: list[dict]) -> None:
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    assert evals[0] < -900, "the first evaluation (uniform random actions so far) should look like random play"
    assert evals[-1] >= TARGET
    # no gradient step before learning_starts (1024 env steps), half a step per env step after
    updates = [(int(r["env_steps"]), float(r["optimizer_steps"])) for r in rows]
    assert all(opt == 0 for steps, opt in updates if steps < 1024)
    assert updates[-1][1] == pytest.approx(0.5 * (updates[-1][0] - 1024), abs=64 * 3)


@pytest.fixture(scope="module")
def sac_rows(tmp_path_factory) -> list[dict]:
    """SAC, collocated, seed 0: the family's test and SAC-Flow's baseline."""
    return train(tmp_path_factory.mktemp("sac") / "run")


@pytest.mark.slow
def test_pendulum_sac_learns_on_seed_0_collocated(sac_rows):
    check_learned(sac_rows)


@pytest.mark.slow
def test_pendulum_sac_learns_on_seed_0_hybrid_stream(tmp_path):
    check_learned(train(tmp_path / "run", *HYBRID_STREAM))


@pytest.mark.slow
def test_sac_flow_reaches_sacs_return_in_no_more_env_steps(sac_rows, tmp_path):
    """The same spec with algorithm.name=sac_flow: everything SAC's but the actor, a gated flow of 4 noisy steps.
    Seeds 0/1/2: 5,120 env steps each, SAC 6,400/5,120/6,400."""
    rows = train(tmp_path / "run", "algorithm.name=sac_flow")
    check_learned(rows)
    assert steps_to_target(rows) <= steps_to_target(sac_rows), (steps_to_target(rows), steps_to_target(sac_rows))
    policy = checkpoint.unpack((tmp_path / "run" / "checkpoints" / "final.pt").read_bytes())["policy"]
    # the actor is the flow: a velocity network over (features, x, t) and a noise scale, no Gaussian head
    assert any(k.startswith("velocity.") for k in policy) and not any(k.startswith("net.") for k in policy)
    assert all(float(r["entropy"]) == float(r["entropy"]) for r in rows if r["entropy"])  # (finite chain log-probs)
