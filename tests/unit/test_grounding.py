"""warm_start.vision (services/policies/grounding.py): a VLM policy's image encoder learns to read the env's scene
state off its camera before imitation, and pi0 starts from it. Here on a small env of a red square placed at
random: the pretrained encoder's held-out error falls far below its start, the stage refuses envs that cannot
feed it, and the saved encoder is exactly what pi0's VLM then holds."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric.services.core.config import PolicyConfig, RunConfig
from rlfabric.services.policies import grounding

pytest.importorskip("transformers.models.siglip")


class Square(gym.Env):
    """A 32x32 grey camera image with a 6x6 red square; scene_state is the square's centre in [-1, 1]^2."""

    def __init__(self, reports: bool = True):
        self.observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (32, 32, 3), np.uint8),
                                                  "proprio": gym.spaces.Box(-1, 1, (2,), np.float32)})
        self.action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.reports, self.corner = reports, np.zeros(2, int)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.corner = self.np_random.integers(0, 26, 2)
        image = np.full((32, 32, 3), 180, np.uint8)
        image[self.corner[0]:self.corner[0] + 6, self.corner[1]:self.corner[1] + 6] = (220, 30, 30)
        return {"image": image, "proprio": np.zeros(2, np.float32)}, {}

    def step(self, action):
        raise NotImplementedError

    def __getattr__(self, name):
        if name == "scene_state" and self.__dict__.get("reports"):
            return lambda: (self.corner + 3) / 16.0 - 1.0
        raise AttributeError(name)


def envs(reports: bool = True):
    return gym.vector.SyncVectorEnv([lambda: Square(reports)])


def test_the_encoder_learns_where_the_square_is_and_pi0_starts_from_it(tmp_path):
    images, states = grounding.scenes(envs(), 600, seed=0)
    assert images.shape == (600, 1, 32, 32, 3) and images.dtype == np.uint8 and states.shape == (600, 2)
    again, _ = grounding.scenes(envs(), 3, seed=0)
    assert np.array_equal(again, images[:3])  # scenes are the seeded resets
    sizes = PolicyConfig(name="pi0", pi0={"patch": 8, "vision_width": 32}).pi0
    model = grounding.encoder(sizes, 32, seed=0)
    log = grounding.pretrain(model, images, states, updates=300, batch_size=32, learning_rate=1e-3, seed=0)
    start, end = log[0]["heldout_rmse"], log[-1]["heldout_rmse"]
    # a random encoder read linearly knows nothing (the targets' spread, ~0.45); trained, a few pixels
    assert end < 0.3 * start and end < 0.15, log
    assert [r["update"] for r in log][-1] == 300 and len(log) == 11

    model.save_pretrained(str(tmp_path / "encoder"))
    from rlfabric.services.core.models import build_policy
    from tests.vla_support import OBS_SPACE, chunk_space

    torch.manual_seed(0)
    pol = build_policy("pi0", {"observation_space": OBS_SPACE, "action_space": chunk_space(3, 2)},
                       PolicyConfig(name="pi0", pi0={"patch": 8, "vision_width": 32, "flow_steps": 3,
                                                     "vlm_path": str(tmp_path / "encoder")}))
    saved = model.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in pol.pi0.model.vlm.vision_tower.state_dict().items())
    tokens = build_policy("vla_tokens", {"observation_space": OBS_SPACE, "action_space": chunk_space(3, 2)},
                          PolicyConfig(name="vla_tokens", vla_tokens={"patch": 8, "vision_width": 32, "bins": 16,
                                                                      "vlm_path": str(tmp_path / "encoder")}))
    assert all(torch.equal(v, saved[k]) for k, v in tokens.vlm.model.vision_tower.state_dict().items())
    with pytest.raises(ValueError, match="vlm_path starts a PaliGemma.*Fix: family: paligemma"):
        PolicyConfig(name="vla_tokens", vla_tokens={"family": "qwen2_5_vl", "vlm_path": str(tmp_path)})


def test_the_vision_stage_repeats_from_its_seed():
    """The stage's encoder is drawn from the run's seed, so a second run of one spec starts its imitation (and RL)
    from the same encoder, and the seed is what changes it: the gates of the e2e recipes rest on this."""
    images, states = grounding.scenes(envs(), 40, seed=0)
    sizes = PolicyConfig(name="pi0", pi0={"patch": 8, "vision_width": 32}).pi0
    torch.manual_seed(123)  # whatever the process drew before does not matter
    first = grounding.encoder(sizes, 32, seed=0)
    first_log = grounding.pretrain(first, images, states, updates=10, batch_size=8, learning_rate=1e-3, seed=0)
    torch.manual_seed(456)
    second = grounding.encoder(sizes, 32, seed=0)
    second_log = grounding.pretrain(second, images, states, updates=10, batch_size=8, learning_rate=1e-3, seed=0)
    assert first_log[1:] == second_log[1:] and first_log[0]["heldout_rmse"] == second_log[0]["heldout_rmse"]
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())
    other = grounding.encoder(sizes, 32, seed=1).state_dict()
    assert not all(torch.equal(v, other[k]) for k, v in grounding.encoder(sizes, 32, seed=0).state_dict().items())


def test_the_stage_refuses_an_env_that_cannot_feed_it():
    with pytest.raises(ValueError, match="no scene_state.*Fix"):
        grounding.scenes(envs(reports=False), 2, seed=0)
    blind = gym.vector.SyncVectorEnv([lambda: gym.make("Pendulum-v1")])
    with pytest.raises(ValueError, match="no camera images.*Fix"):
        grounding.scenes(blind, 2, seed=0)
    images, states = grounding.scenes(envs(), 2, seed=0)
    with pytest.raises(ValueError, match="scenes=2 leaves no held-out scene"):
        grounding.pretrain(grounding.encoder(PolicyConfig(name="pi0", pi0={"patch": 8}).pi0, 32, seed=0), images,
                           states, updates=1, batch_size=2, learning_rate=1e-3, seed=0)


def test_a_vision_stage_alone_enables_the_warm_start():
    run = RunConfig.model_validate({"warm_start": {"vision": {"scenes": 100}}})
    assert run.warm_start.enabled and run.warm_start.vision.updates == 3000
    with pytest.raises(ValueError, match="scenes"):
        RunConfig.model_validate({"warm_start": {"vision": {"scenes": -1}}})


@pytest.mark.parametrize("policy, message", [
    ("{name: vla}", "policy.name=vla has none. Fix: a VLM policy (pi0, vla_tokens, vlm)"),
    ("{name: pi0, pi0: {path: models/pi0}}", "policy.pi0.path loads a whole model. Fix"),
    ("{name: vla_tokens, vla_tokens: {family: smolvlm}}", "family='smolvlm' has its own. Fix: family: paligemma"),
])
def test_train_refuses_a_vision_stage_for_a_policy_without_an_encoder_to_start(tmp_path, policy, message):
    import subprocess
    import sys

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"env: {{id: rlfabric/ArmReachLang-v0}}\npolicy: {policy}\nalgorithm: {{name: ppo}}\n"
                    f"warm_start: {{vision: {{scenes: 20}}}}\n")
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(spec), "--run-dir", str(tmp_path / "r"),
                           "--quiet"], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and message in " ".join(proc.stderr.split()), proc.stderr[-2000:]
    assert not (tmp_path / "r" / "warm_start" / "vision").exists()
