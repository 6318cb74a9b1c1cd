"""Simulators that pin their own MuJoCo and so live in an environment of their own: gym-hil's Franka
(``env.adapter: franka_sim``) and LIBERO (``env.adapter: libero``). Each is smoke-tested through the env pool (reset,
step, both cameras, the instruction, a success the sim is put into) and through every service in its own process.

ManiSkill (``env.adapter: maniskill``) needs a Vulkan device besides: without one, its adapter's error must name
the fix, and the smoke test skips.

The main venv has none of these packages, so these skip there; ``bash tests/own_env.sh gym-hil`` (or ``libero``,
``maniskill``) builds that environment and runs this file's cases for it."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import yaml

from rlfabric.services.core.config import EnvConfig
from rlfabric.services.env.adapters.instruction import decode_instruction
from rlfabric.services.env.pool import EnvPool


def _lift_the_cube(env) -> None:
    """Put PandaPickCube's block 30 cm above the table: still 10 cm up after the step's fall, which gym-hil scores
    as picked."""
    import mujoco

    sim = env.unwrapped
    sim._data.jnt("block").qpos[2] += 0.3
    mujoco.mj_forward(sim._model, sim._data)


def _bowl_onto_the_plate(env) -> None:
    """Put libero_spatial task 0's bowl 2 cm above the plate's centre: its goal, (On akita_black_bowl_1 plate_1),
    holds once the bowl rests on the plate."""
    sim = env.unwrapped.sim.env  # robosuite's env under LIBERO's wrapper
    plate = sim.sim.data.body_xpos[sim.obj_body_id["plate_1"]].copy()
    qpos = sim.sim.data.get_joint_qpos("akita_black_bowl_1_joint0").copy()
    qpos[:3] = plate + np.array([0.0, 0.0, 0.02])
    sim.sim.data.set_joint_qpos("akita_black_bowl_1_joint0", qpos)
    sim.sim.forward()


CASES = {  # adapter -> what it needs, its env section, the cameras, the words, how to make it succeed, the arm's move
    "franka_sim": {
        "package": "gym_hil", "extra": "gym-hil",
        "env": {"id": "PandaPickCube", "options": {"image_size": 32, "instruction": True}},
        "cameras": ["front", "wrist"], "words": "pick up the cube", "succeed": _lift_the_cube,
        "move": [1.0, 0.0, -1.0, 1.0], "hold": [0.0, 0.0, 0.0, 1.0],
    },
    "libero": {
        "package": "libero", "extra": "libero",
        "env": {"id": "libero_spatial", "options": {"image_size": 32, "task_ids": [0], "max_episode_steps": 24,
                                                    "settle_steps": 2}},
        "cameras": ["agentview", "wrist"], "succeed": _bowl_onto_the_plate,
        "words": "pick up the black bowl between the plate and the ramekin and place it on the plate",
        "move": [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0], "hold": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0],
    },
}


def _case(adapter: str) -> dict:
    case = CASES[adapter]
    if importlib.util.find_spec(case["package"]) is None:
        pytest.skip(f"env.adapter {adapter} needs {case['package']}, which pins its own mujoco and so is not in this "
                    f"venv. Fix: bash tests/own_env.sh {case['extra']}")
    return case


@pytest.mark.parametrize("adapter", sorted(CASES))
def test_reset_step_cameras_instruction_and_success_through_the_pool(adapter):
    case = _case(adapter)
    pool = EnvPool(EnvConfig(adapter=adapter, **case["env"]), 2)
    try:
        spaces = pool.obs_spec["spaces"]
        for cam in case["cameras"]:
            assert spaces[cam] == {"kind": "box", "shape": [32, 32, 3], "dtype": "uint8", "low": 0.0, "high": 255.0}
        assert spaces["state"]["dtype"] == "float32" and spaces["instruction"]["dtype"] == "int64"
        first = pool.reset(7)[0]
        assert [decode_instruction(row) for row in first["instruction"]] == [case["words"]] * 2
        assert all(first[cam].std() > 0 for cam in case["cameras"])  # rendered scenes, not blank buffers
        again = pool.reset(7)[0]
        np.testing.assert_array_equal(first["state"], again["state"])  # a seeded reset repeats

        move = np.tile(np.asarray(case["move"], np.float32), (2, 1))
        for _ in range(4):
            out = pool.step(0, move)
        assert not out["terminated"].any()
        moved = out["obs"]
        assert np.abs(moved["state"] - first["state"]).max() > 1e-3  # the arm followed the action
        for cam in case["cameras"]:
            assert np.abs(moved[cam].astype(int) - first[cam]).mean() > 0.5, cam  # and the cameras saw it

        case["succeed"](pool.envs[0].envs[0])
        hold = np.tile(np.asarray(case["hold"], np.float32), (2, 1))
        for _ in range(5):  # the sim settles into success within a step or two
            out = pool.step(0, hold)
            if out["terminated"].any():
                break
        assert out["terminated"].tolist() == [True, False]  # success ends sub-env 0's episode, not sub-env 1's
        assert out["episode_success"][0] == 1.0 and out["reward"][0] > 0
    finally:
        pool.close()


@pytest.mark.parametrize("adapter", sorted(CASES))
def test_a_run_with_every_service_in_its_own_process(tmp_path, adapter):
    """The env service steps the sim, the rollout worker acts on both cameras and the instruction, the final
    evaluation reports a success rate."""
    case = _case(adapter)
    spec = {"name": f"smoke-{adapter}", "env": {"adapter": adapter, **case["env"], "num_envs": 2, "eval_envs": 2},
            "algorithm": {"name": "ppo", "n_steps": 16, "batch_size": 32, "n_epochs": 1},
            "train": {"total_env_steps": 64, "eval_every_iterations": 0, "eval_episodes": 2},
            "scheduling": {"mode": "disaggregated"}}
    if adapter == "franka_sim":
        spec["env"]["options"] = {**spec["env"]["options"], "max_episode_steps": 24}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(config), "--run-dir", str(run_dir),
                           "--quiet"], capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert int(rows[-1]["env_steps"]) == 64
    assert rows[-1]["eval_success_rate"] in ("0.0", "0.5", "1.0")


def test_franka_sim_places_the_cube_from_the_reset_seed_not_numpys_global_generator():
    _case("franka_sim")
    env = EnvConfig(adapter="franka_sim", id="PandaPickCube", options={"cameras": [], "random_block_position": True})
    pool = EnvPool(env, 2)
    try:
        def cubes(seed: int) -> np.ndarray:
            np.random.seed(123)  # gym-hil's own draws would repeat this; ours must not depend on it
            return pool.reset(seed)[0]["state"][:, -3:]  # state-only mode ends with the block's position

        first, again, other = cubes(1), cubes(1), cubes(2)
        np.testing.assert_array_equal(first, again)
        assert np.abs(first - other).max() > 1e-3 and np.abs(first[0] - first[1]).max() > 1e-3
    finally:
        pool.close()


def _maniskill_pool():
    """A ManiSkill PushCube pool, or a skip when mani-skill is missing; SAPIEN's missing Vulkan comes back as the
    adapter's error."""
    if importlib.util.find_spec("mani_skill") is None:
        pytest.skip("env.adapter maniskill needs mani-skill (SAPIEN). Fix: bash tests/own_env.sh maniskill")
    return EnvPool(EnvConfig(adapter="maniskill", id="PushCube-v1", options={"image_size": 32}), 2)


def test_maniskill_without_a_vulkan_device_says_what_to_install():
    try:
        pool = _maniskill_pool()
    except RuntimeError as exc:
        assert "Vulkan" in str(exc) and "Fix:" in str(exc) and "Mesa >= 24.3" in str(exc), str(exc)[:500]
        return
    pool.close()
    pytest.skip("this host has a Vulkan device SAPIEN accepts: the smoke test below runs instead")


def test_maniskill_reset_step_camera_and_success_flag_through_the_pool():
    try:
        pool = _maniskill_pool()
    except RuntimeError as exc:
        pytest.skip(f"no Vulkan device here: {str(exc)[:300]}")
    try:
        cams = [k for k, s in pool.obs_spec["spaces"].items() if s["dtype"] == "uint8"]
        assert cams and all(pool.obs_spec["spaces"][c]["shape"] == [32, 32, 3] for c in cams)
        first = pool.reset(3)[0]
        assert first["state"].dtype == np.float32 and all(first[c].std() > 0 for c in cams)
        np.testing.assert_array_equal(first["state"], pool.reset(3)[0]["state"])
        actions = np.stack([pool.envs[0].single_action_space.sample() for _ in range(2)])
        for _ in range(5):
            out = pool.step(0, actions)
        assert np.abs(out["obs"]["state"] - first["state"]).max() > 1e-4
    finally:
        pool.close()
