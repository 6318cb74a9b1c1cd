"""Run by tests/unit/test_action_chunks.py in a process that renders (tests/rendering_support.py): a chunk of
ArmReach steps renders only the frame it returns (services/env/chunking.py)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.env.chunking import ActionChunk  # noqa: E402
from rlfabric.services.env.sims.arm_reach import ArmReach  # noqa: E402


class Opaque(gym.Wrapper):
    """A wrapper ActionChunk cannot see through (it might read every step's observation): every frame renders."""


def test_a_chunk_renders_only_its_last_frame_and_the_same_bytes(monkeypatch):
    """ArmReach renders a camera frame per step (~60% of a step's time); a chunk returns one observation, so the
    steps before its last keep the previous frame. Where a chunk ends early (a success, the 40-step time limit),
    that step's observation is taken again with its frame. Every observation equals the one of an env that rendered
    every frame, byte for byte, over episodes that end inside chunks and on their last step."""
    renders = {"skipping": 0, "every": 0}
    original = ArmReach.render_frame

    def counted(self):
        renders[self.name] += 1
        return original(self)

    monkeypatch.setattr(ArmReach, "render_frame", counted)
    envs = {}
    for name, wrap in (("skipping", lambda e: e), ("every", Opaque)):
        env = gym.make("rlfabric/ArmReachLang-v0", image_size=32, success_radius=0.08)
        env.unwrapped.name = name
        envs[name] = ActionChunk(wrap(env), 3)  # 40 steps: a time limit inside the 14th chunk
    assert envs["skipping"].frames is not None and envs["every"].frames is None
    rng = np.random.default_rng(0)
    first = {name: env.reset(seed=0)[0] for name, env in envs.items()}
    assert all(np.array_equal(first["skipping"][k], first["every"][k]) for k in first["every"])
    ends = {"early": 0, "on_the_last_step": 0}
    for step in range(300):
        # toward the goal ball now and then (successes), at random otherwise
        actions = rng.uniform(-1, 1, (3, 2)).astype(np.float32)
        if step % 3:
            actions[:] = envs["skipping"].unwrapped.expert_action(3)
        out = {name: env.step(actions) for name, env in envs.items()}
        for key in out["every"][0]:
            assert np.array_equal(out["skipping"][0][key], out["every"][0][key]), (step, key)
        assert out["skipping"][1:4] == out["every"][1:4]
        if out["every"][2] or out["every"][3]:
            ends["early" if out["every"][4]["executed"] < 3 else "on_the_last_step"] += 1
            for env in envs.values():
                env.reset(seed=1000 + step)
    assert min(ends.values()) >= 3, ends  # both kinds of ending were checked
    assert renders["skipping"] < 0.45 * renders["every"], renders
    print(ends, renders)
