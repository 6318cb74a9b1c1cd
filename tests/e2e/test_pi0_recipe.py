"""SFT then RL in one command (examples/arm_reach_pi0.yaml, shrunk to CI's budget): pi0's image encoder learns to
locate the balls (warm_start.vision), the scripted expert records demonstrations, a supervised run teaches them to
transformers' pi0 through its own flow loss over the frozen encoder, and PPO starts from that checkpoint through
every service. The encoder's held-out error falls and it stays exactly as pretrained through SFT and RL; the
supervised stage learns (its loss falls, and its policy moves to the named ball and touches it in some episodes);
the RL run starts from exactly that policy (with the critic warming up alone and the value head detached, its first
evaluation is the supervised run's last, on the same seeds, and the learner re-scores the rollout's chains to
numerics); and the final model reloads in plain transformers."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers.models.pi0")
pytest.importorskip("mujoco")

pytestmark = pytest.mark.minutes(3.4)  # on CI's 2 cores: the tiers start long files first


def rows(path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path)))


@pytest.mark.slow
def test_pi0_sft_then_rl_in_one_command(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/arm_reach_pi0.yaml", "--run-dir", str(run_dir),
         "--quiet", "--set", "warm_start.vision.scenes=1500", "--set", "warm_start.vision.updates=600",
         "--set", "warm_start.demos=200", "--set", "warm_start.supervised.total_updates=600",
         "--set", "warm_start.supervised.updates_per_iteration=100", "--set", "train.eval_every_iterations=1",
         "--set", "train.eval_episodes=32", "--set", "algorithm.critic_warmup=2", "--set", "algorithm.n_steps=8",
         "--set", "train.total_env_steps=512", "--set", "train.held_out_episodes=32"],
        capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = run_dir / "warm_start"
    vision = rows(stage / "vision" / "metrics.csv")
    errors = [float(r["heldout_rmse"]) for r in vision]
    # where each ball is (5 x metres): a random encoder read linearly ~1.1 (their spread); pretrained, a few cm
    assert errors[-1] < 0.3 * errors[0] and errors[-1] < 0.3, errors
    assert (stage / "demos.npz").is_file() and (stage / "supervised" / "config.yaml").is_file()
    with np.load(stage / "demos.npz") as demos:  # what the supervised stage reads, no next_obs
        assert {"obs/image", "obs/instruction", "actions"} <= set(demos.files) and "next_obs/image" not in demos.files
    sft = rows(stage / "supervised" / "metrics.csv")
    losses = [float(r["sft_loss"]) for r in sft if r["sft_loss"]]
    assert losses[-1] < 0.5 * losses[0], losses
    sft_success = [float(r["eval_success_rate"]) for r in sft if r["eval_success_rate"]]
    sft_return = [float(r["eval_return_mean"]) for r in sft if r["eval_return_mean"]]
    # an untrained pi0 barely moves (return ~0); the expert's moves toward the named ball earn progress and touches
    assert sft_success[-1] >= 0.1 and sft_return[-1] >= 0.3, (sft_success, sft_return)
    config = (run_dir / "config.yaml").read_text()
    assert str((stage / "supervised" / "checkpoints" / "final.pt").resolve()) in config
    rl = rows(run_dir / "metrics.csv")
    first_eval = next(float(r["eval_success_rate"]) for r in rl if r["eval_success_rate"])
    assert first_eval == pytest.approx(sft_success[-1]), (first_eval, sft_success)
    # both stages end on the same held-out scenes: the supervised policy's score there is the RL run's baseline
    held_out = [float(r[-1]["held_out_success_rate"]) for r in (sft, rl)]
    assert all(r[-1]["held_out_episodes"] == "32" for r in (sft, rl)) and held_out[0] >= 0.05, held_out
    warm = [float(r["critic_warmup"]) for r in rl if r.get("critic_warmup")]
    assert warm[:2] == [1.0, 1.0] and warm[-1] == 0.0
    mismatch = [float(r["logprob_mismatch_abs"]) for r in rl if r.get("logprob_mismatch_abs")]
    # while the critic warms up (value head detached) the policy's weights do not change, so the learner re-scores
    # exactly the chains the rollout scored: the mismatch is numerics alone
    assert len(mismatch) >= 3 and max(mismatch[:3]) < 1e-4, mismatch

    from transformers import PI0ForConditionalGeneration, SiglipVisionModel

    model = PI0ForConditionalGeneration.from_pretrained(str(run_dir / "checkpoints" / "hf"), local_files_only=True)
    assert model.config.chunk_size == 4 and model.config.max_action_dim == 2
    encoder = SiglipVisionModel.from_pretrained(str(stage / "vision"), local_files_only=True).state_dict()
    final = model.model.vlm.vision_tower.state_dict()  # freeze_vision: untouched by SFT and RL
    assert all(final[k].equal(v) for k, v in encoder.items())
    assert "vlm_path" in (stage / "supervised" / "config.yaml").read_text()


@pytest.mark.slow
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
