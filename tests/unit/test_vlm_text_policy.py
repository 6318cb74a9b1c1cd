"""policy.name vlm: a PaliGemma (or SmolVLM, Qwen2.5-VL) that writes text about its images. What it decodes with
its KV cache the learner re-scores to the same log-prob; a text ends at its first 0; next-token SFT makes it write
what it was shown; an env whose actions are not token ids is refused naming the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.config import PolicyConfig
from rlfabric.services.core.models import build_policy
from rlfabric.services.env.adapters.instruction import encode_instruction
from rlfabric.services.policies.vlm_text import live_tokens

pytest.importorskip("transformers.models.paligemma")

L = 12
OBS = {"kind": "dict", "spaces": {
    "image": {"kind": "box", "dtype": "uint8", "shape": [32, 32, 3], "low": 0, "high": 255},
    "instruction": {"kind": "box", "dtype": "int64", "shape": [8], "low": 0, "high": 256}}}
ACTIONS = {"kind": "box", "dtype": "int64", "shape": [L], "low": 0, "high": 256}
TEXTS = ["red left", "blue right", "red right", "blue left"]


def policy(**section):
    torch.manual_seed(0)
    return build_policy("vlm", {"observation_space": OBS, "action_space": ACTIONS},
                        PolicyConfig(name="vlm", vlm={"patch": 8, **section}))


def observations() -> dict[str, torch.Tensor]:
    """Four scenes: a bright square in one of four places."""
    image = torch.zeros(4, 32, 32, 3, dtype=torch.uint8)
    for i, (r, c) in enumerate([(0, 0), (0, 16), (16, 0), (16, 16)]):
        image[i, r:r + 16, c:c + 16] = 255
    prompt = torch.as_tensor(np.stack([encode_instruction("where", 8)] * 4))
    return {"image": image, "instruction": prompt}


def texts() -> torch.Tensor:
    return torch.as_tensor(np.stack([encode_instruction(t, L) for t in TEXTS]))


@pytest.mark.parametrize("family", ["paligemma", "smolvlm", "qwen2_5_vl"])
def test_decoded_texts_end_at_their_first_zero_and_rescore_to_1e_4(family):
    pol = policy(family=family)
    obs = observations()
    ids, logp, value = pol.act(obs, generator=torch.Generator().manual_seed(1))
    assert ids.shape == (4, L) and logp.shape == (4,) and value.shape == (4,)
    live = live_tokens(ids)
    assert (ids * (1 - live)).abs().sum() == 0  # nothing after a text's end
    new_logp, entropy, new_value = pol.evaluate(obs, ids)
    assert (new_logp - logp).abs().max() < 1e-4 and torch.allclose(new_value, value, atol=1e-5)
    assert (entropy > 0).all()
    greedy, _, _ = pol.act(obs, deterministic=True)
    assert torch.equal(greedy, pol.act(obs, deterministic=True)[0])


# Qwen2.5-VL's M-RoPE turns rows and columns slowly (services/policies/vlm_families.py), so where the square is
# takes it longer to learn, and 3e-3 oscillates. The steps leave a margin: on one thread (as CI runs) SmolVLM still
# confused one scene at 200 steps and Qwen2.5-VL at 300, and both were exact from 300 / 400 on.
@pytest.mark.parametrize("family, lr, steps", [("paligemma", 3e-3, 150), ("smolvlm", 3e-3, 400),
                                               ("qwen2_5_vl", 1e-3, 500)])
def test_next_token_sft_makes_it_write_what_each_image_shows(family, lr, steps):
    pol = policy(family=family)
    obs, target = observations(), texts()
    optimizer = torch.optim.AdamW(pol.parameters(), lr=lr)
    start = float(pol.imitation_loss(obs, target).detach())
    for _ in range(steps):
        loss = pol.imitation_loss(obs, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.05 * start
    written, _, _ = pol.act(obs, deterministic=True)
    assert torch.equal(written, target)  # each scene's own words, ended where the text ends


def test_an_env_whose_actions_are_not_token_ids_is_refused():
    with pytest.raises(ValueError, match="integer Box"):
        build_policy("vlm", {"observation_space": OBS, "action_space": {
            "kind": "box", "dtype": "float32", "shape": [2], "low": -1.0, "high": 1.0}}, PolicyConfig(name="vlm"))
