"""policy.name vla_tokens: a transformers VLM (PaliGemma, or SmolVLM with a causal prefix) whose action dimensions
are tokens over the vocabulary's last ids. Token-by-token decoding with the prefix's KV cache and the learner's teacher-forced pass score the same
tokens; imitation makes the words steer the chunk; OFT-style parallel decoding does the same in one pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.core.config import PolicyConfig
from services.core.models import build_policy
from tests.vla_support import OBS_SPACE, TEXTS, VOCAB, chunk_space, observations

pytest.importorskip("transformers.models.paligemma")

ACT_SPACE = chunk_space(2, 2)


FAMILIES = pytest.mark.parametrize("family", ["paligemma", "smolvlm"])


def policy(**section):
    torch.manual_seed(0)
    cfg = PolicyConfig(name="vla_tokens", vla_tokens={"patch": 8, "bins": 16, **section})
    return build_policy("vla_tokens", {"observation_space": OBS_SPACE, "action_space": ACT_SPACE}, cfg)


@FAMILIES
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("level", ["token", "chunk"])
def test_the_learner_rescores_the_decoded_tokens_to_1e_5(parallel, level, family):
    pol = policy(parallel=parallel, logprob_level=level, family=family)
    obs = observations(TEXTS)
    bins, logp, value = pol.act(obs, generator=torch.Generator().manual_seed(1))
    assert bins.shape == (4, 2, 2) and bins.min() >= 0 and bins.max() < 16
    new_logp, entropy, new_value = pol.evaluate(obs, bins)
    assert (new_logp - logp).abs().max() < 1e-5 and (new_value - value).abs().max() < 1e-5
    assert entropy.shape == logp.shape and bool((entropy > 0).all())
    assert torch.allclose(pol.value(obs), value, atol=1e-5)


def test_the_bins_are_the_vocabularys_last_ids_and_map_onto_the_bounds():
    pol = policy()
    vocab = pol.model.config.text_config.vocab_size
    assert pol.bin_ids.tolist() == list(range(vocab - 16, vocab)) and vocab == VOCAB + 16
    out = pol.env_actions(torch.tensor([[[0, 15], [15, 0]]]))
    assert np.allclose(out, [[[-2.0, 2.0], [2.0, -2.0]]])


@FAMILIES
@pytest.mark.parametrize("parallel", [False, True])
def test_imitation_makes_the_instruction_steer_the_chunk(parallel, family):
    pol = policy(parallel=parallel, family=family)
    texts = ["reach the red ball", "reach the blue ball"] * 8
    target = torch.tensor([1.5 if "red" in t else -1.5 for t in texts])[:, None, None].expand(-1, 2, 2)
    optimizer = torch.optim.AdamW(pol.parameters(), lr=2e-3)
    losses = []
    for step in range(80):
        loss = pol.imitation_loss(observations(texts, seed=step), target)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert np.mean(losses[-5:]) < 0.3 * losses[0]
    bins, _, _ = pol.act(observations(["touch the red one", "touch the blue one"], seed=999), deterministic=True)
    chunk = pol.env_actions(bins)
    assert chunk[0].mean() > 1.0 and chunk[1].mean() < -1.0, chunk


@FAMILIES
def test_save_pretrained_reloads_the_vlm(tmp_path, family):
    from transformers import AutoModelForImageTextToText

    pol = policy(family=family)
    pol.save_pretrained(str(tmp_path))
    plain = AutoModelForImageTextToText.from_pretrained(str(tmp_path), local_files_only=True)
    assert all(torch.equal(a, b) for a, b in zip(pol.model.state_dict().values(), plain.state_dict().values(),
                                                   strict=True))
    again = build_policy("vla_tokens", {"observation_space": OBS_SPACE, "action_space": ACT_SPACE},
                         PolicyConfig(name="vla_tokens", vla_tokens={"path": str(tmp_path), "bins": 16}))
    again.state_proj.load_state_dict(pol.state_proj.state_dict())
    again.value_head.load_state_dict(pol.value_head.state_dict())
    assert again.family.name == family  # the loaded config's model_type says it
    obs = observations(TEXTS)
    assert torch.equal(again.act(obs, deterministic=True)[0], pol.act(obs, deterministic=True)[0])
    with pytest.raises(ValueError, match="policy.vla_tokens.path"):
        policy(path=str(tmp_path / "missing"))


@FAMILIES
def test_lora_adapters_train_and_fold_into_the_saved_vlm(tmp_path, family):
    from transformers import AutoModelForImageTextToText

    pol = policy(lora={"rank": 4, "alpha": 8.0}, family=family)
    trainable = {n for n, p in pol.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and not any("embed_tokens" in n for n in trainable)
    assert {"state_proj.weight", "value_head.net.0.weight"} <= trainable
    obs = observations(TEXTS)
    bins, logp, _ = pol.act(obs, generator=torch.Generator().manual_seed(1))
    assert (pol.evaluate(obs, bins)[0] - logp).abs().max() < 1e-5
    pol.save_pretrained(str(tmp_path))
    plain = AutoModelForImageTextToText.from_pretrained(str(tmp_path), local_files_only=True)
    assert not any("lora" in k for k in plain.state_dict())


def test_a_model_of_another_family_is_refused_with_the_supported_ones():
    from types import SimpleNamespace

    from services.policies.vlm_families import family_of

    assert family_of(SimpleNamespace(model_type="idefics3"), "x").name == "smolvlm"
    with pytest.raises(ValueError, match=r"x: a qwen2_5_vl model; the VLM policies run on \['idefics3', "
                                         r"'paligemma', 'smolvlm'\]"):
        family_of(SimpleNamespace(model_type="qwen2_5_vl"), "x")
