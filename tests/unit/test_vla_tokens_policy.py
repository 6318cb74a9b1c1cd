"""policy.name vla_tokens: a transformers VLM (PaliGemma; SmolVLM and Qwen2.5-VL with a causal prefix) whose action
dimensions are tokens over the vocabulary's last ids. Token-by-token decoding with the prefix's KV cache and the
learner's teacher-forced pass score the same tokens; imitation makes the words steer the chunk; OFT-style parallel
decoding does the same in one pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.services.core.config import PolicyConfig
from rlfabric.services.core.models import build_policy
from tests.vla_support import OBS_SPACE, TEXTS, VOCAB, chunk_space, imitate, observations

pytest.importorskip("transformers.models.paligemma")

ACT_SPACE = chunk_space(2, 2)


FAMILIES = pytest.mark.parametrize("family", ["paligemma", "smolvlm", "qwen2_5_vl"])


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


@pytest.mark.parametrize("parallel", [False, True])
def test_a_sampling_temperature_is_scored_as_sampled_and_leaves_the_argmax_and_imitation_alone(parallel):
    """temperature: the rollouts sample softmax(logits / T) and the learner scores the same distribution, so the
    ratio starts at 1; a hotter policy is flatter (more entropy), while its argmax and the bins' cross-entropy
    (what SFT trains) are the T = 1 model's."""
    cold, hot = policy(parallel=parallel), policy(parallel=parallel, temperature=2.0)
    obs = observations(TEXTS)
    bins, logp, _ = hot.act(obs, generator=torch.Generator().manual_seed(1))
    new_logp, hot_entropy, _ = hot.evaluate(obs, bins)
    assert (new_logp - logp).abs().max() < 1e-5
    cold_logp, cold_entropy, _ = cold.evaluate(obs, bins)
    assert not torch.allclose(cold_logp, logp, atol=1e-3) and bool((hot_entropy > cold_entropy).all())
    assert torch.equal(hot.act(obs, deterministic=True)[0], cold.act(obs, deterministic=True)[0])
    demo = torch.rand(len(TEXTS), 2, 2) * 4.0 - 2.0  # env actions within the bounds [-2, 2]
    assert torch.equal(hot.imitation_loss(obs, demo), cold.imitation_loss(obs, demo))


def test_a_gaussian_imitation_target_keeps_the_neighbouring_bins_probable_and_the_argmax_nearest():
    """imitation_sigma: imitating one action against a Gaussian over the bins leaves the same argmax (the
    nearest bin) as the one-hot target, but the neighbouring bins keep mass that falls with their distance,
    where the one-hot policy has put nearly all of it on one bin: what RL's samples explore from."""
    obs = observations(TEXTS)
    probs = {}
    for sigma in (0.0, 1.0):
        pol = policy(parallel=True, imitation_sigma=sigma)
        imitate(pol, 150, (2, 2), value=0.5, lr=3e-3)  # 0.5 of [-2, 2]: 0.25 in [-1, 1], bin 9.375 -> 9
        with torch.no_grad():
            log_probs, _ = pol._score(obs, None)
        probs[sigma] = log_probs.exp().mean((0, 1))  # [bins], over the batch and the chunk's positions
        assert pol.act(obs, deterministic=True)[0].eq(9).all(), sigma
    one_hot, gauss = probs[0.0], probs[1.0]
    assert one_hot[9] > 0.9, one_hot
    assert 0.25 < gauss[9] < 0.7 and gauss[10] > gauss[8] > gauss[7] > gauss[6], gauss
    assert gauss[8:11].sum() > 0.75 and gauss[10] > 5 * one_hot[10], (gauss, one_hot)
    with pytest.raises(ValueError, match="imitation_sigma"):
        PolicyConfig(name="vla_tokens", vla_tokens={"imitation_sigma": -1})


@pytest.mark.parametrize("parallel", [False, True])
def test_a_detached_value_head_learns_without_moving_the_vlm(parallel):
    """value_detach: the value loss trains the head alone, and the VLM the actor reads is left as it is."""
    obs = observations(TEXTS)
    for detach in (False, True):
        pol = policy(parallel=parallel, value_detach=detach)
        pol.value(obs).square().sum().backward()
        vlm = [p.grad for p in pol.model.parameters() if p.requires_grad]
        moved = any(g is not None and bool(g.abs().sum() > 0) for g in vlm)
        assert moved != detach, detach
        assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in pol.value_head.parameters())


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

    from rlfabric.services.policies.vlm_families import family_of

    assert family_of(SimpleNamespace(model_type="idefics3"), "x").name == "smolvlm"
    with pytest.raises(ValueError, match=r"x: a llava model; the VLM policies run on \['idefics3', "
                                         r"'paligemma', 'qwen2_5_vl', 'smolvlm'\]"):
        family_of(SimpleNamespace(model_type="llava"), "x")


def test_qwen_positions_and_patches_are_the_models_own():
    """Qwen2.5-VL's M-RoPE positions of a camera, padded words and the state token, and its image patches, as the
    model's get_rope_index and the image processor compute them."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlfabric.services.policies.vlm_families import FAMILIES, qwen_patches

    qwen = FAMILIES["qwen2_5_vl"]
    pol = policy(family="qwen2_5_vl")
    model, grid = pol.vlm, pol.read.grid
    image_id = model.config.image_token_id
    words = torch.tensor([[5, 6, 7, 0, 0, 8], [9, 0, 0, 0, 0, 8]])  # padded words, then a state token's slot
    ids = torch.cat([torch.full((2, grid[0] * grid[1]), image_id), words], 1)
    mask = (ids != 0).long()
    theirs, _ = model.model.get_rope_index(ids, (ids == image_id).int(), image_grid_thw=torch.tensor(
        [[1, 2 * grid[0], 2 * grid[1]]] * 2), attention_mask=mask)
    ours = qwen.model_positions(qwen.positions(mask, 1, grid), 1, grid, images=True)
    live = mask.bool().unsqueeze(0).expand(3, -1, -1)
    assert torch.equal(ours[live], theirs[live])
    assert ours[0, 0, -1] == max(grid) + 3  # the image advanced the position by its side, then a word each
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    flat, thw = qwen_patches(pixels, model.config.vision_config)
    v = model.config.vision_config
    normalised = (((pixels[1] + 1) / 2) - torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)) / torch.tensor(
        OPENAI_CLIP_STD).view(3, 1, 1)
    expected, gh, gw = Qwen2VLImageProcessorPil().patchify(normalised.numpy(), v.patch_size, v.spatial_merge_size,
                                                           v.temporal_patch_size)
    assert thw.tolist() == [[1, gh, gw]] * 2
    np.testing.assert_allclose(flat[gh * gw:].numpy(), expected, atol=1e-6)


@FAMILIES
@pytest.mark.parametrize("lora", [0, 4])
def test_a_frozen_image_encoder_stays_as_it_started_while_the_rest_learns(family, lora):
    """freeze_vision: the encoder (and LoRA adapters on its attention, which targets q_proj/v_proj reach) gets no
    gradient, so imitation steps leave it exactly as it started; the language model still learns."""
    pol = policy(family=family, freeze_vision=True, lora={"rank": lora, "targets": ["q_proj", "v_proj"]})
    encoder = pol.family.image_encoder(pol.vlm.model)
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    rest = {k: v.clone() for k, v in pol.named_parameters() if v.requires_grad}
    assert before and rest and not any(p.requires_grad for p in encoder.parameters())
    imitate(pol, 3, (2, 2))
    assert all(torch.equal(v, encoder.state_dict()[k]) for k, v in before.items())
    moved = [k for k, v in pol.named_parameters() if k in rest and not torch.equal(v, rest[k])]
    assert any("lora_" in k for k in moved) if lora else any("language_model" in k or "text_model" in k
                                                             for k in moved), moved
