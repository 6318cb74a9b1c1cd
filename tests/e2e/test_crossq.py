"""CrossQ end to end: Pendulum-v1 through real services (`rlfabric train examples/pendulum_crossq.yaml`), from
uniform random play to a mean evaluation return of -200 over 20 episodes in a few thousand env steps, with no
target network. That run's checkpoint is then DAgger's expert: the expert labels every state the policy visits,
and the policy, from random weights, comes within 25 of the expert's return over the same 20 evaluation episodes
in 2,048 env steps. Its checkpoint also records RLPD's 10 demonstration episodes: RLPD with them reaches -200 in
fewer env steps than the same agent without them (SAC with RLPD's critics and update-to-data ratio). The CrossQ run
is built once (tests/artefacts.py) for all three."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlfabric.services.learner import checkpoint
from tests.artefacts import cached, undisturbed

pytestmark = pytest.mark.minutes(3.1)  # on CI's 2 cores: the tiers start long files first

TARGET = -200.0  # random play scores about -1200 to -1500
CLI = [sys.executable, "-m", "rlfabric.services.cli", "train"]


def train(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args, "--quiet"], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def crossq_expert(config) -> Path:
    """The CrossQ example's run on seed 0, built once (tests/artefacts.py; tests/prebuild.py builds it ahead)."""
    def build(out):
        proc = train("examples/pendulum_crossq.yaml", "--run-dir", str(out / "run"))
        undisturbed(out / "run")
        (out / "stderr.txt").write_text(proc.stderr)

    return cached(config, "pendulum-crossq", {}, build)


@pytest.fixture(scope="module")
def crossq_run(request):
    """The example's run directory and what its CLI printed."""
    out = crossq_expert(request.config)
    return out / "run", (out / "stderr.txt").read_text()


@pytest.mark.slow
def test_crossq_reaches_minus_200_on_pendulum_seed_0(crossq_run):
    run_dir, stderr = crossq_run
    assert "reached eval return >= -200" in stderr
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    assert evals[0] < -900, "the first evaluation (uniform random actions so far) should look like random play"
    assert evals[-1] >= TARGET
    assert int(rows[-1]["env_steps"]) <= 6016
    # no gradient step before learning_starts (512 env steps), one per env step after
    updates = [(int(r["env_steps"]), float(r["optimizer_steps"])) for r in rows]
    assert all(opt == 0 for steps, opt in updates if steps < 512)
    assert updates[-1][1] == pytest.approx(updates[-1][0] - 512, abs=128)
    algo = checkpoint.unpack((run_dir / "checkpoints" / "final.pt").read_bytes())["algorithm"]
    assert "q1" in algo and not any("target" in k for k in algo), sorted(algo)


@pytest.mark.slow
def test_dagger_imitates_a_checkpoint_expert_on_pendulum(crossq_run, tmp_path):
    expert_dir, _ = crossq_run
    expert = expert_dir / "checkpoints" / "final.pt"
    proc = train("examples/pendulum_sac.yaml", "--run-dir", str(tmp_path / "dagger"),
                 "--set", f"algorithm={{name: dagger, expert_checkpoint: {expert}, n_steps: 64, batch_size: 256, "
                          f"updates_per_iteration: 100, learning_rate: 0.003}}",
                 "--set", "train.total_env_steps=2048", "--set", "train.eval_every_iterations=2",
                 "--set", "env.eval_envs=20", "--set", "train.eval_episodes=20",
                 "--set", "train.stop_at_eval_return=null")  # the whole budget: compared with the expert at its end
    assert "SUCCEEDED" in proc.stderr
    expert_evals = [float(r["eval_return_mean"]) for r in csv.DictReader(open(expert_dir / "metrics.csv"))
                    if r["eval_return_mean"]]
    rows = list(csv.DictReader(open(tmp_path / "dagger" / "metrics.csv")))
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    # the same 20 evaluation episodes: the expert about -199; DAgger (an actor-critic student, Gaussian) -244, -233,
    # -213, -194 at 512..2,048 env steps
    assert evals[-1] >= expert_evals[-1] - 25 and evals[-1] >= -230, (expert_evals[-1], evals)
    gaps = [float(r["expert_gap"]) for r in rows]
    assert gaps[-1] < 0.5 * gaps[0], gaps  # the policy's mode approaches the expert's on the visited states


def first_eval_at(run_dir, target: float) -> tuple[int | None, list[tuple[int, float]], list[dict]]:
    """(env steps of the first evaluation >= target or None, every (env steps, mean return), the metrics rows)."""
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    evals = [(int(r["env_steps"]), float(r["eval_return_mean"])) for r in rows if r["eval_return_mean"]]
    return next((steps for steps, mean in evals if mean >= target), None), evals, rows


@pytest.mark.slow
def test_rlpd_with_expert_demos_reaches_minus_200_in_fewer_env_steps_than_sac_without(crossq_run, tmp_path,
                                                                                        request):
    expert = crossq_run[0] / "checkpoints" / "final.pt"
    demos = tmp_path / "demos.npz"
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "collect", str(expert), "--episodes", "10",
                           "--out", str(demos)], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(demos) as data:
        episodes = np.unique(data["episode"])
        returns = [data["rewards"][data["episode"] == e].sum() for e in episodes]
    assert len(episodes) == 10 and np.mean(returns) > -260, returns  # expert play (random: about -1200)

    run_dir = tmp_path / "rlpd"
    proc = train("examples/pendulum_rlpd.yaml", "--run-dir", str(run_dir),
                 "--set", f"replay.datasets={{offline: {demos}}}")
    assert "reached eval return >= -200" in proc.stderr
    reached, evals, rows = first_eval_at(run_dir, TARGET)
    assert evals[0][1] < -900, "the first evaluation (uniform random actions so far) should look like random play"
    assert reached is not None and reached == evals[-1][0]
    # symmetric sampling: every minibatch of every update was half demos, half online
    fractions = [float(r["offline_fraction"]) for r in rows if r["offline_fraction"]]
    assert fractions and all(f == 0.5 for f in fractions), fractions

    def without_demos(out):  # the same spec, run as far as RLPD needed, with no data set and no offline rows
        train("examples/pendulum_rlpd.yaml", "--run-dir", str(out / "run"), "--set", "algorithm.offline_weight=0",
              "--set", "replay.datasets={}", "--set", f"train.total_env_steps={reached}")

    baseline = cached(request.config, "pendulum-rlpd-without-demos", {"total_env_steps": reached}, without_demos)
    never, base_evals, base_rows = first_eval_at(baseline / "run", TARGET)
    assert base_evals[-1][0] == reached and base_evals[0][0] == evals[0][0]  # evaluated at the same env steps
    assert all(float(r["offline_fraction"]) == 0 for r in base_rows if r["offline_fraction"])
    assert never is None, f"without the demos -200 came at {never} env steps, with them at {reached}: {base_evals}"
