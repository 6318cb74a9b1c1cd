"""SFT then RL in one command (examples/arm_reach_pi0.yaml, shrunk to seconds): `rlfabric train` runs the vision
stage, the scripted expert's demonstrations and the supervised run, and PPO starts from that checkpoint through
every service: the stages leave their directories, the run's config names the supervised checkpoint, and its
first evaluation is the supervised run's last (same weights, same seeds), both ending on the same held-out scenes.
That the stages learn (the encoder localises, the supervised loss falls) and hand over exactly (the frozen encoder,
the critic's warm-up re-scoring to numerics, the reload in plain transformers) the cautious-demonstrator test checks
on the recipe at full size (tests/e2e/test_cautious_demonstrator.py)."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers.models.pi0")
pytest.importorskip("mujoco")

pytestmark = pytest.mark.minutes(1.2)  # on CI's 2 cores: the tiers start long files first


def rows(path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path)))


@pytest.mark.slow
def test_pi0_sft_then_rl_in_one_command(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/arm_reach_pi0.yaml", "--run-dir", str(run_dir),
         "--quiet", "--set", "warm_start.vision.scenes=200", "--set", "warm_start.vision.updates=20",
         "--set", "warm_start.demos=16", "--set", "warm_start.supervised.total_updates=40",
         "--set", "warm_start.supervised.updates_per_iteration=20", "--set", "train.eval_every_iterations=1",
         "--set", "train.eval_episodes=16", "--set", "algorithm.critic_warmup=2", "--set", "algorithm.n_steps=8",
         "--set", "train.total_env_steps=256", "--set", "train.held_out_episodes=16"],
        capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = run_dir / "warm_start"
    assert len(rows(stage / "vision" / "metrics.csv")) >= 1 and (stage / "vision" / "config.json").is_file()
    assert (stage / "demos.npz").is_file() and (stage / "supervised" / "config.yaml").is_file()
    with np.load(stage / "demos.npz") as demos:  # what the supervised stage reads, no next_obs
        assert {"obs/image", "obs/instruction", "actions"} <= set(demos.files) and "next_obs/image" not in demos.files
    assert "vlm_path" in (stage / "supervised" / "config.yaml").read_text()  # it starts from the grounded encoder
    assert str((stage / "supervised" / "checkpoints" / "final.pt").resolve()) in (run_dir / "config.yaml").read_text()
    sft, rl = rows(stage / "supervised" / "metrics.csv"), rows(run_dir / "metrics.csv")
    sft_return = [float(r["eval_return_mean"]) for r in sft if r["eval_return_mean"]]
    first = next(float(r["eval_return_mean"]) for r in rl if r["eval_return_mean"])
    assert first == pytest.approx(sft_return[-1]), (first, sft_return)  # RL starts from exactly that policy
    assert all(r[-1]["held_out_episodes"] == "16" for r in (sft, rl))  # a paired score on the same scenes
    assert (run_dir / "checkpoints" / "hf" / "config.json").is_file()


def test_a_lerobot_data_set_and_expert_demos_warm_start_pi0(tmp_path):
    """warm_start.dataset: a LeRobot data set (tests/data/lerobot_arm_reach, written by LeRobot's own library) is
    imported into the env's format beside 20 expert episodes, and the supervised stage learns from both."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/arm_reach_pi0.yaml", "--run-dir", str(run_dir),
         "--quiet", "--set", "warm_start.vision.scenes=0", "--set", "warm_start.demos=20",
         "--set", "warm_start.dataset=tests/data/lerobot_arm_reach",
         "--set", "warm_start.supervised.total_updates=200", "--set", "warm_start.supervised.updates_per_iteration=50",
         "--set", "train.eval_every_iterations=100", "--set", "train.eval_episodes=16",
         "--set", "algorithm.n_steps=8", "--set", "train.total_env_steps=128", "--set", "train.held_out_episodes=0"],
        capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = run_dir / "warm_start"
    with np.load(stage / "demos.npz") as demos, np.load(stage / "lerobot.npz") as imported, \
            np.load(stage / "demonstrations.npz") as both:
        assert len(imported["actions"]) == 147 and imported["episode"].max() == 7  # 171 frames, 8 episodes
        assert len(both["actions"]) == len(demos["actions"]) + 147
        assert both["episode"].max() == demos["episode"].max() + 8  # the imported episodes numbered after
        np.testing.assert_array_equal(both["obs/image"][-147:], imported["obs/image"])
    assert "demonstrations.npz" in (stage / "supervised" / "config.yaml").read_text()
    losses = [float(r["sft_loss"]) for r in rows(stage / "supervised" / "metrics.csv")]
    assert losses[-1] < 0.5 * losses[0], losses
    assert str((stage / "supervised" / "checkpoints" / "final.pt").resolve()) in (run_dir / "config.yaml").read_text()
    assert rows(run_dir / "metrics.csv"), "the RL run after the warm start left no metrics"
