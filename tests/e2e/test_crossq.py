"""CrossQ end to end: Pendulum-v1 through real services (`rlfabric train examples/pendulum_crossq.yaml`), from
uniform random play to a mean evaluation return of -200 over 20 episodes in a few thousand env steps, with no
target network. That run's checkpoint is then DAgger's expert: the expert labels every state the policy visits,
and the policy, from random weights, comes within 25 of the expert's return over the same 20 evaluation episodes
in 2,048 env steps. The CrossQ run is built once (tests/artefacts.py) for both."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from rlfabric.services.learner import checkpoint
from tests.artefacts import cached

pytestmark = pytest.mark.minutes(1.6)  # on CI's 2 cores: the tiers start long files first

TARGET = -200.0  # random play scores about -1200 to -1500
CLI = [sys.executable, "-m", "rlfabric.services.cli", "train"]


def train(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args, "--quiet"], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def crossq_run(request):
    """The example's run directory and what its CLI printed."""
    def build(out):
        proc = train("examples/pendulum_crossq.yaml", "--run-dir", str(out / "run"))
        (out / "stderr.txt").write_text(proc.stderr)

    out = cached(request.config, "pendulum-crossq", {}, build)
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
                          f"updates_per_iteration: 100}}",
                 "--set", "train.total_env_steps=2048", "--set", "train.eval_every_iterations=2",
                 "--set", "env.eval_envs=20", "--set", "train.eval_episodes=20")
    assert "SUCCEEDED" in proc.stderr
    expert_evals = [float(r["eval_return_mean"]) for r in csv.DictReader(open(expert_dir / "metrics.csv"))
                    if r["eval_return_mean"]]
    rows = list(csv.DictReader(open(tmp_path / "dagger" / "metrics.csv")))
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    # the same 20 evaluation episodes: the expert about -199, DAgger about -205 from 1,024 env steps on
    assert evals[-1] >= expert_evals[-1] - 25 and evals[-1] >= -230, (expert_evals[-1], evals)
    gaps = [float(r["expert_gap"]) for r in rows]
    assert gaps[-1] < 0.5 * gaps[0], gaps  # the policy's mode approaches the expert's on the visited states
