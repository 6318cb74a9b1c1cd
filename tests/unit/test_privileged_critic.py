"""An asymmetric actor-critic: a simulator's true state (an observation's ``privileged`` entry) reaches the critic
alone. The VLM policies' actors act the same whatever it holds, their ``critic: own`` reads it, every other policy
refuses an env that has one, and a supervised checkpoint (whose critic never trained) starts such an RL run."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

import rlfabric.services.env.sims  # noqa: F401  (registers rlfabric/ArmReachLang-v0)
from rlfabric.services.core.config import PolicyConfig
from rlfabric.services.core.models import build_policy
from rlfabric.services.learner.ranks import load_starting_weights
from tests.vla_support import OBS_SPACE, TEXTS, chunk_space, observations

pytest.importorskip("transformers.models.pi0")

PRIVILEGED = {"kind": "box", "dtype": "float32", "shape": [7], "low": -np.inf, "high": np.inf}
SPEC = {"observation_space": {"kind": "dict", "spaces": {**OBS_SPACE["spaces"], "privileged": PRIVILEGED}},
        "action_space": chunk_space(3, 2)}


def pi0(critic: str, name: str = "pi0"):
    torch.manual_seed(0)
    section = {"patch": 8, "critic": critic, **({"flow_steps": 3} if name == "pi0" else {"bins": 16})}
    return build_policy(name, SPEC, PolicyConfig(name=name, **{name: section}))


def with_privileged(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {**observations(TEXTS), "privileged": torch.randn(len(TEXTS), 7, generator=g)}


def test_arm_reach_observes_its_true_state_for_the_critic(monkeypatch):
    from rlfabric.services.env.sims.arm_reach import ArmReach

    # the camera is beside the point here, and this process may hold no OpenGL context (mujoco imported before)
    monkeypatch.setattr(ArmReach, "render_frame", lambda self: np.zeros((32, 32, 3), np.uint8))
    env = gym.make("rlfabric/ArmReachLang-v0", image_size=32, privileged=True)
    obs, _ = env.reset(seed=3)
    sim = env.unwrapped
    hand, goal, other, distance = np.split(obs["privileged"], [2, 4, 6])
    np.testing.assert_allclose(hand, obs["proprio"][-2:], atol=1e-6)  # the end effector, as the proprio has it
    balls = sim.scene_state().reshape(-1, 2)
    np.testing.assert_allclose(goal, balls[sim.goal], atol=1e-6)
    np.testing.assert_allclose(other, balls[1 - sim.goal], atol=1e-6)
    assert distance[0] == pytest.approx(5 * sim._distance(), abs=1e-5) and distance[0] > 0
    assert env.observation_space["privileged"].shape == (7,)
    with pytest.raises(ValueError, match="privileged=True.*observation='state'"):
        gym.make("rlfabric/ArmReachLang-v0", observation="state", privileged=True)


@pytest.mark.parametrize("name", ["pi0", "vla_tokens"])
def test_the_actor_ignores_it_and_the_critic_reads_it(name):
    pol = pi0("own", name).eval()
    a, b = with_privileged(1), with_privileged(2)
    chunk_a = pol.act(a, deterministic=True)[0]
    chunk_b = pol.act(b, deterministic=True)[0]
    assert torch.equal(chunk_a, chunk_b)  # the actor acts on the camera, the words and the proprio alone
    assert (pol.value(a) - pol.value(b)).abs().max() > 1e-4  # the critic's value moves with the true state
    prefix = pi0("prefix", name)
    assert (prefix.value(a) - prefix.value(b)).abs().max() == 0  # a critic on the VLM's prefix cannot see it


@pytest.mark.parametrize("name", ["vla", "actor_critic"])
def test_a_policy_that_would_feed_it_to_its_actor_refuses_it(name):
    with pytest.raises(ValueError, match=r"\['privileged'\].*Fix: turn the env's privileged observation off"):
        build_policy(name, SPEC, PolicyConfig(name=name))


def test_a_supervised_checkpoint_starts_a_run_with_its_own_critic():
    supervised = pi0("prefix").state_dict()  # vla_sft's checkpoint: a prefix value head it never trained
    pol = pi0("own")
    with pytest.raises(RuntimeError, match="value_head"):  # resuming a run is exact
        load_starting_weights(pol, supervised, warm=False)
    load_starting_weights(pol, supervised, warm=True)
    mine = pol.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in supervised.items() if not k.startswith("value_head."))
    broken = {k: v for k, v in supervised.items() if not k.startswith("model.")}  # the actor's weights missing
    with pytest.raises(RuntimeError, match="Missing key"):
        load_starting_weights(pi0("own"), broken, warm=True)
