"""Pixel env adapters: MuJoCo tasks, gymnasium-robotics and MetaWorld observed as small uint8 images rendered
headless on the CPU (OSMesa), with their state, auto-reset and success flags. Small images, few steps.

These cases run in a process of their own (tests/unit/test_pixel_adapters.py starts it): MuJoCo picks its OpenGL
backend when it is first imported, and other tests in the suite's process import it without one."""

from __future__ import annotations

import ctypes.util
import importlib.util

import numpy as np
import pytest

from rlfabric.services.core.config import EnvConfig
from rlfabric.services.env.adapters import adapter
from rlfabric.services.env.adapters import metaworld as mw_adapter
from rlfabric.services.env.adapters.instruction import decode_instruction, encode_instruction
from rlfabric.services.env.pool import EnvPool


def _missing(*modules: str) -> str | None:
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(gone)} (pip install 'gymnasium[mujoco]' gymnasium-robotics)" if gone else None


NO_GL = None if ctypes.util.find_library("OSMesa") else "needs Debian's libosmesa6 to render MuJoCo headless"
needs_mujoco = pytest.mark.skipif(bool(_missing("mujoco", "imageio") or NO_GL),
                                  reason=_missing("mujoco", "imageio") or NO_GL or "")
needs_robotics = pytest.mark.skipif(bool(_missing("mujoco", "imageio", "gymnasium_robotics") or NO_GL),
                                    reason=_missing("mujoco", "imageio", "gymnasium_robotics") or NO_GL or "")
needs_metaworld = pytest.mark.skipif(
    importlib.util.find_spec("metaworld") is None or bool(NO_GL),
    reason="metaworld is not installed: it pins mujoco==3.3.0, which conflicts with the dev extra's mujoco; install "
           "the metaworld extra in an environment of its own to run this")


def cfg(adapter_name: str, env_id: str, **fields) -> EnvConfig:
    return EnvConfig(adapter=adapter_name, id=env_id, **fields)


def make(c: EnvConfig, n: int = 2):
    return adapter(c.adapter).make_vector_env(c, n, "sync")


def actions(envs, n: int) -> np.ndarray:
    return np.stack([envs.single_action_space.sample() for _ in range(n)])


# -- mujoco_pixels ------------------------------------------------------------------------------------------------
@needs_mujoco
def test_mujoco_pixels_spaces_dtypes_through_the_pool():
    pool = EnvPool(cfg("mujoco_pixels", "Reacher-v5", options={"image_size": [32, 48]}), 2)
    try:
        spaces = pool.obs_spec["spaces"]
        assert spaces["image"] == {"kind": "box", "shape": [32, 48, 3], "dtype": "uint8", "low": 0.0, "high": 255.0}
        assert spaces["state"]["shape"] == [10] and spaces["state"]["dtype"] == "float32"
        obs = pool.reset(0)[0]
        assert obs["image"].shape == (2, 32, 48, 3) and obs["image"].dtype == np.uint8
        assert obs["state"].dtype == np.float32
        out = pool.step(0, actions(pool.envs[0], 2))
        assert out["obs"]["image"].dtype == np.uint8 and out["obs"]["image"].shape == (2, 32, 48, 3)
    finally:
        pool.close()


@needs_mujoco
def test_mujoco_pixels_image_only_is_a_uint8_box():
    envs = make(cfg("mujoco_pixels", "InvertedPendulum-v5", options={"image_size": 24, "state": False}))
    try:
        space = envs.single_observation_space
        assert space.shape == (24, 24, 3) and space.dtype == np.uint8
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 24, 24, 3) and obs.dtype == np.uint8
    finally:
        envs.close()


@needs_mujoco
def test_frames_are_not_constant_and_follow_the_state():
    envs = make(cfg("mujoco_pixels", "InvertedPendulum-v5", options={"image_size": 32}), 1)
    try:
        obs, _ = envs.reset(seed=0)
        first = obs["image"][0].copy()
        assert first.std() > 5, "a rendered frame should show the scene, not one colour"
        for _ in range(5):  # push the cart hard one way: it moves, so the picture must change
            obs, *_ = envs.step(np.full((1, 1), 3.0, np.float32))
        assert abs(obs["state"][0, 0]) > 1e-3
        assert np.abs(obs["image"][0].astype(int) - first).sum() > 0
    finally:
        envs.close()


@needs_mujoco
def test_same_step_auto_reset_hands_back_the_final_frame():
    envs = make(cfg("mujoco_pixels", "Reacher-v5", kwargs={"max_episode_steps": 3}, options={"image_size": 32}), 2)
    try:
        envs.reset(seed=1)
        for _ in range(2):
            _, _, terminated, truncated, _ = envs.step(actions(envs, 2))
            assert not (terminated | truncated).any()
        obs, _, _, truncated, info = envs.step(actions(envs, 2))
        assert truncated.all()
        final = info["final_obs"]
        assert final[0]["image"].dtype == np.uint8 and final[0]["image"].shape == (32, 32, 3)
        assert not np.array_equal(final[0]["state"], obs["state"][0]), "obs after the last step is the reset one"
    finally:
        envs.close()


@pytest.mark.parametrize("fields, names", [
    ({"options": {"image_size": 8}}, "env.options.image_size"),
    ({"options": {"image_size": [32]}}, "env.options.image_size"),
    ({"options": {"state": "yes"}}, "env.options.state"),
    ({"options": {"tile_size": 4}}, "env.options ['tile_size']"),
    ({"kwargs": {"width": 64}}, "env.kwargs.width"),
    ({"kwargs": {"render_mode": "human"}}, "env.kwargs.render_mode"),
])
def test_mujoco_pixels_config_errors_name_the_field(fields, names):
    with pytest.raises(ValueError, match="Fix") as err:
        adapter("mujoco_pixels").check(cfg("mujoco_pixels", "Reacher-v5", **fields))
    assert names in str(err.value)


def test_mujoco_pixels_names_unknown_and_non_mujoco_ids():
    with pytest.raises(ValueError, match="env.id 'Reacher-v9'"):
        adapter("mujoco_pixels").check(cfg("mujoco_pixels", "Reacher-v9"))
    with pytest.raises(ValueError, match="not a MuJoCo env.*Fix"):
        make(cfg("mujoco_pixels", "CartPole-v1"), 1)


# -- robotics -----------------------------------------------------------------------------------------------------
@needs_robotics
def test_fetch_reach_pixels_goals_and_success_flag():
    """is_success reaches the vector env's info every step, and ``final_info`` on the step an episode ends (where
    the env pool reads it for finished episodes)."""
    steps = 15
    envs = make(cfg("robotics", "FetchReach-v4", kwargs={"max_episode_steps": steps}, options={"image_size": 32}), 2)
    try:
        space = envs.single_observation_space
        assert space["image"].shape == (32, 32, 3) and space["image"].dtype == np.uint8
        assert {k: space[k].shape for k in ("observation", "achieved_goal", "desired_goal")} == {
            "observation": (10,), "achieved_goal": (3,), "desired_goal": (3,)}
        assert all(space[k].dtype == np.float32 for k in ("observation", "achieved_goal", "desired_goal"))
        obs, _ = envs.reset(seed=0)
        assert obs["image"].std() > 5
        for t in range(steps):  # move the gripper straight at the goal: FetchReach succeeds within 5 cm
            move = np.clip(10 * (obs["desired_goal"] - obs["achieved_goal"]), -1, 1)
            obs, _, _, truncated, info = envs.step(np.concatenate([move, np.zeros((2, 1), np.float32)], 1))
            if t == 0:
                assert not np.asarray(info["is_success"]).any()
        assert truncated.all()
        final = info["final_info"]
        assert final["_is_success"].all() and np.asarray(final["is_success"], bool).all()
    finally:
        envs.close()


@needs_robotics
def test_franka_kitchen_goal_dicts_become_vectors_and_report_success():
    envs = make(cfg("robotics", "FrankaKitchen-v1", kwargs={"tasks_to_complete": ["microwave"]},
                    options={"image_size": 32}), 1)
    try:
        space = envs.single_observation_space
        assert space["desired_goal"].shape == (1,) and space["image"].dtype == np.uint8
        obs, _ = envs.reset(seed=0)
        assert obs["desired_goal"].shape == (1, 1) and obs["image"].shape == (1, 32, 32, 3)
        _, _, _, _, info = envs.step(np.zeros((1, 9), np.float32))
        assert not info["is_success"][0]
    finally:
        envs.close()


# -- metaworld ----------------------------------------------------------------------------------------------------
def test_instruction_bytes_round_trip():
    assert mw_adapter.instruction_of("pick-place-v3") == "pick place"
    tokens = encode_instruction("pick place", mw_adapter.INSTRUCTION_BYTES)
    assert tokens.dtype == np.int64 and tokens.shape == (mw_adapter.INSTRUCTION_BYTES,)
    assert decode_instruction(tokens) == "pick place" and tokens[10:].max() == 0
    with pytest.raises(ValueError, match="more than the 4"):
        encode_instruction("pick place", 4)


@pytest.mark.parametrize("options, names", [
    ({"camera": "front"}, "env.options.camera"),
    ({"max_episode_steps": 501}, "env.options.max_episode_steps"),
    ({"instruction": "yes"}, "env.options.instruction"),
    ({"image_size": 1000}, "env.options.image_size"),
])
def test_metaworld_config_errors_name_the_field(options, names):
    """Checked before metaworld is imported, so they hold where it is not installed."""
    with pytest.raises(ValueError) as err:
        mw_adapter.check(cfg("metaworld", "reach-v3", options=options))
    assert names in str(err.value)


@needs_metaworld
def test_metaworld_mt10_pixels_state_instruction_success():
    envs = make(cfg("metaworld", "MT10", options={"image_size": 32, "instruction": True, "max_episode_steps": 3}), 2)
    try:
        space = envs.single_observation_space
        assert space["image"].shape == (32, 32, 3) and space["image"].dtype == np.uint8
        assert space["state"].shape == (39,) and space["state"].dtype == np.float32
        obs, _ = envs.reset(seed=0)
        words = [bytes((row[row > 0] - 1).astype(np.uint8)).decode() for row in obs["instruction"]]
        assert len(set(words)) == 2, f"sub-envs take different MT10 tasks round-robin, got {words}"
        assert obs["image"].std() > 5
        for _ in range(3):
            obs, _, _, truncated, info = envs.step(actions(envs, 2))
        assert truncated.all() and "is_success" in info["final_info"]
        assert obs["image"].dtype == np.uint8
    finally:
        envs.close()
