"""``critic: own`` on the VLM policies (pi0, vla_tokens): a value function with its own encoder of the raw
observation. It gives the same value when acting, when the learner re-scores and alone; it sees where things are
in the image and which words were said; and its loss leaves the VLM, which the actor shares, untouched."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import PolicyConfig
from rlfabric.services.core.models import build_policy
from tests.vla_support import OBS_SPACE, TEXTS, chunk_space, observations

pytest.importorskip("transformers.models.paligemma")

SECTIONS = {"pi0": {"patch": 8, "flow_steps": 3}, "vla_tokens": {"patch": 8, "bins": 16, "parallel": True}}


def policy(name: str, critic: str):
    if name == "pi0":
        pytest.importorskip("transformers.models.pi0")
    torch.manual_seed(0)
    cfg = PolicyConfig(name=name, cnn={"channels": [8, 16], "kernels": [4, 3], "strides": [2, 1], "features": 32},
                       **{name: {**SECTIONS[name], "critic": critic}})
    return build_policy(name, {"observation_space": OBS_SPACE, "action_space": chunk_space(3, 2)}, cfg)


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_the_own_critic_values_alike_acting_rescoring_and_alone(name):
    pol = policy(name, "own")
    obs = observations(TEXTS)
    actions, _, value = pol.act(obs, generator=torch.Generator().manual_seed(1))
    _, _, rescored = pol.evaluate(obs, actions)
    assert value.shape == (4,)
    assert torch.allclose(value, rescored, atol=1e-6) and torch.allclose(value, pol.value(obs), atol=1e-6)


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_the_own_critic_reads_the_image_and_the_words_and_trains_alone(name):
    pol = policy(name, "own")
    obs = observations(TEXTS)
    base = pol.value(obs)
    moved = dict(obs, image=torch.roll(obs["image"], 8, dims=1))  # the same scene, shifted
    said = dict(obs, instruction=observations(TEXTS[::-1])["instruction"])  # other words
    assert (pol.value(moved) - base).abs().max() > 1e-4 and (pol.value(said) - base).abs().max() > 1e-4
    pol.value(obs).pow(2).sum().backward()
    grads = {n: p.grad for n, p in pol.named_parameters() if p.grad is not None}
    assert grads and all(n.startswith("value_head.") for n in grads), sorted(grads)[:5]


def test_the_prefix_critic_shares_the_vlm():
    pol = policy("pi0", "prefix")
    pol.value(observations(TEXTS)).sum().backward()
    assert any(".vlm." in n and p.grad is not None for n, p in pol.named_parameters())


def test_the_critic_setting_is_checked():
    with pytest.raises(ValueError, match="critic"):
        PolicyConfig(name="pi0", pi0={"critic": "cnn"})
