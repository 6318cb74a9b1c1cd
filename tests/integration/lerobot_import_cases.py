"""LeRobot data sets as demonstrations (services/env/lerobot_data.py), on tests/data/lerobot_arm_reach: eight
ArmReachLang episodes of the scripted expert that LeRobot's own library wrote (tests/data/make_lerobot_arm_reach.py;
episode e is the env reset with seed 7000 + e, one frame per step). Replaying each episode in the env shows the
import puts every frame, state, instruction and action chunk where the env would: the decoded video frame is the
env's own frame up to the codec's loss, and closer to it than to the frames a step before or after. Run by
test_lerobot_import.py in a process of its own (the env renders with OSMesa, chosen before MuJoCo loads)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mujoco")
pytest.importorskip("av")

from rlfabric.services.core.config import load_config  # noqa: E402
from rlfabric.services.env.lerobot_data import LeRobotDataError, import_dataset, import_for_run  # noqa: E402

FIXTURE = Path(__file__).parents[1] / "data" / "lerobot_arm_reach"
SPEC = "examples/arm_reach_pi0.yaml"
SEED = 7000


@pytest.fixture(scope="module")
def imported():
    config = load_config(SPEC, ["env.eval_envs=1"])
    return import_for_run(FIXTURE, config)


def replay(seed: int):
    """The episode the fixture recorded at ``seed``: each step's observation and the expert's move."""
    import gymnasium as gym

    import rlfabric.services.env.sims  # noqa: F401

    env = gym.make("rlfabric/ArmReachLang-v0", image_size=64)
    obs, _ = env.reset(seed=seed)
    steps, done = [], False
    while not done:
        move = env.unwrapped.expert_action(1)[0]
        steps.append((obs, move))
        obs, _, terminated, truncated, _ = env.step(move)
        done = terminated or truncated
    env.close()
    return steps


def test_every_frame_state_instruction_and_chunk_lands_where_the_env_puts_it(imported):
    batch, summary = imported
    t = batch.tensors
    assert summary["episodes"] == 8 and summary["chunk"] == 4
    assert summary["keys"] == {"image": "observation.images.top", "proprio": "observation.state"}
    assert t["actions"].shape[1:] == (4, 2) and t["obs/image"].shape[1:] == (64, 64, 3)
    near, own = [], []
    for e in range(8):
        steps = replay(SEED + e)
        rows = np.flatnonzero(t["episode"] == e)
        assert len(rows) == len(steps) - 3  # a chunk starts wherever 4 actions remain
        for k, row in enumerate(rows):
            obs = steps[k][0]
            np.testing.assert_array_equal(t["obs/proprio"][row], obs["proprio"])
            np.testing.assert_array_equal(t["obs/instruction"][row], obs["instruction"])
            np.testing.assert_allclose(t["actions"][row], np.stack([m for _, m in steps[k:k + 4]]), atol=1e-6)
            diff = np.abs(t["obs/image"][row].astype(int) - obs["image"].astype(int)).mean()
            own.append(diff)
            for j in (k - 1, k + 1):
                if 0 <= j < len(steps):
                    near.append(diff < np.abs(t["obs/image"][row].astype(int) - steps[j][0]["image"]).mean())
    assert max(own) < 8 and np.mean(own) < 4, (max(own), np.mean(own))  # AV1's loss at crf 30
    assert np.mean(near) > 0.9, np.mean(near)  # the frame of that step, not a neighbour's
    assert summary["transitions"] == len(t["actions"]) and summary["actions_out_of_bounds"] == 0.0


def test_images_kept_in_the_parquet_files_import_exactly(imported):
    """tests/data/lerobot_arm_reach_images: the same first two episodes with the camera as PNGs inside the parquet
    files (LeRobot's use_videos=False): lossless, so every frame is the env's own render."""
    config = load_config(SPEC, ["env.eval_envs=1"])
    batch, summary = import_for_run(FIXTURE.with_name("lerobot_arm_reach_images"), config)
    video = imported[0].tensors
    first2 = video["episode"] < 2
    assert summary["episodes"] == 2 and batch.rows == int(first2.sum())
    for k in ("obs/proprio", "obs/instruction", "actions"):
        np.testing.assert_array_equal(batch.tensors[k], video[k][first2])
    for e in range(2):
        steps = replay(SEED + e)
        rows = np.flatnonzero(batch.tensors["episode"] == e)
        for k, row in enumerate(rows):
            np.testing.assert_array_equal(batch.tensors["obs/image"][row], steps[k][0]["image"])


def test_the_older_format_v2_1_imports_the_same_episodes(imported):
    """tests/data/lerobot_arm_reach_v21: the first three episodes as LeRobot 0.3.3 wrote them (format v2.1: one
    parquet file and one video per episode, meta/*.jsonl)."""
    config = load_config(SPEC, ["env.eval_envs=1"])
    batch, summary = import_for_run(FIXTURE.with_name("lerobot_arm_reach_v21"), config)
    video = imported[0].tensors
    first3 = video["episode"] < 3
    assert summary["episodes"] == 3 and batch.rows == int(first3.sum())
    for k in ("obs/proprio", "obs/instruction", "actions", "episode"):
        np.testing.assert_array_equal(batch.tensors[k], video[k][first3])
    for e in range(3):
        steps = replay(SEED + e)
        rows = np.flatnonzero(batch.tensors["episode"] == e)
        diffs = [np.abs(batch.tensors["obs/image"][row].astype(int) - steps[k][0]["image"].astype(int)).mean()
                 for k, row in enumerate(rows)]
        assert max(diffs) < 8, diffs


def test_what_the_env_cannot_take_is_refused_with_the_fix(tmp_path, imported):
    batch, _ = imported
    config = load_config(SPEC, ["env.eval_envs=1"])
    copy = tmp_path / "data"
    shutil.copytree(FIXTURE, copy)
    info = json.loads((copy / "meta" / "info.json").read_text())
    obs_spec = {"kind": "dict", "shape": [], "dtype": "", "spaces": {
        "front": {"kind": "box", "shape": [32, 32, 3], "dtype": "uint8", "low": 0.0, "high": 255.0},
        "wrist": {"kind": "box", "shape": [32, 32, 3], "dtype": "uint8", "low": 0.0, "high": 255.0}}}
    act_spec = {"kind": "box", "shape": [2], "dtype": "float32", "low": -1.0, "high": 1.0}
    with pytest.raises(LeRobotDataError, match="--key front=<feature>"):  # two cameras, one video: which is which?
        import_dataset(copy, obs_spec, act_spec, None)
    # named: both cameras from the one video, resized to the env's 32x32, one action per step (no chunks)
    out, summary = import_dataset(copy, obs_spec, act_spec, None,
                                  keys={"front": "observation.images.top", "wrist": "observation.images.top"})
    assert out.tensors["obs/front"].shape == (171, 32, 32, 3) and out.tensors["actions"].shape == (171, 2)
    narrow = act_spec | {"low": [-1.0, -0.5], "high": [1.0, 0.5]}  # per dimension; the 2nd narrower than the moves
    _, outside = import_dataset(copy, obs_spec, narrow, None, keys={"front": "observation.images.top",
                                                                    "wrist": "observation.images.top"})
    moves = out.tensors["actions"]
    assert outside["actions_out_of_bounds"] == pytest.approx((np.abs(moves[:, 1]) > 0.5).mean() / 2)
    assert 0 < outside["actions_out_of_bounds"] and summary["actions_out_of_bounds"] == 0.0
    np.testing.assert_array_equal(out.tensors["obs/front"], out.tensors["obs/wrist"])
    # an env whose observation is one Box (state): the data set's observation.state, stored as collect names it
    box = {"kind": "box", "shape": [8], "dtype": "float32", "low": -1.0, "high": 1.0}
    flat, _ = import_dataset(copy, box, act_spec, None)
    assert set(flat.tensors) >= {"obs", "actions"} and flat.tensors["obs"].shape == (171, 8)
    np.testing.assert_array_equal(flat.tensors["obs"][:len(batch.tensors["obs/proprio"])][:4],
                                  batch.tensors["obs/proprio"][:4])
    with pytest.raises(LeRobotDataError, match="no feature 'observation.images.side'"):
        import_dataset(copy, obs_spec, act_spec, None, keys={"front": "observation.images.side",
                                                             "wrist": "observation.images.top"})
    with pytest.raises(LeRobotDataError, match="continuous \\(Box\\) actions"):
        import_dataset(copy, obs_spec, {"kind": "discrete", "shape": [], "dtype": "int64", "n": 3}, None,
                       keys={"front": "observation.images.top", "wrist": "observation.images.top"})
    with pytest.raises(LeRobotDataError, match="acts with 3 per step"):
        import_dataset(copy, obs_spec, act_spec | {"shape": [3]}, None, keys={"front": "observation.images.top",
                                                                             "wrist": "observation.images.top"})
    state_spec = {"kind": "dict", "shape": [], "dtype": "", "spaces": {
        "image": obs_spec["spaces"]["front"],
        "joints": {"kind": "box", "shape": [6], "dtype": "float32", "low": -1.0, "high": 1.0}}}
    with pytest.raises(LeRobotDataError, match="holds \\[6\\] values"):  # observation.state has 8
        import_dataset(copy, state_spec, act_spec, None, keys={"joints": "observation.state"})
    video = next((copy / "videos").rglob("*.mp4"))
    video.write_bytes(video.read_bytes()[:2000])  # a truncated copy
    with pytest.raises(LeRobotDataError, match="file-000.mp4"):
        import_dataset(copy, obs_spec, act_spec, None, keys={"front": "observation.images.top",
                                                             "wrist": "observation.images.top"})
    info["codebase_version"] = "v1.6"
    (copy / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(LeRobotDataError, match="format v1.6; this reads v2.x and v3.x.*convert_dataset_v1_to_v2"):
        import_for_run(copy, config)
    with pytest.raises(LeRobotDataError, match="not a LeRobot data set"):
        import_for_run(tmp_path, config)


def test_import_lerobot_writes_a_data_set_the_replay_service_loads(tmp_path, imported):
    from rlfabric.services.replay.datasets import load_dataset

    out = tmp_path / "demos.npz"
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "import-lerobot", str(FIXTURE), SPEC, "--out",
                           str(out), "--episodes", "3", "--set", "env.eval_envs=1"],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    loaded = load_dataset(out, max_rows=1 << 20)
    batch, _ = imported
    first3 = batch.tensors["episode"] < 3
    assert loaded.rows == int(first3.sum())
    for k in ("obs/image", "obs/proprio", "obs/instruction", "actions"):
        np.testing.assert_array_equal(loaded.tensors[k], batch.tensors[k][first3])
    bad = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "import-lerobot", str(FIXTURE), SPEC, "--out",
                          str(tmp_path / "x.npz"), "--key", "camera"], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "<env observation key>=<LeRobot feature>" in bad.stdout + bad.stderr
