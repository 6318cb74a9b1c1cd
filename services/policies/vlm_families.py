"""The transformers VLM families the VLM policies (vla_tokens, vlm) run on, and what differs between them: how a tiny
one is built from ``TinyVLMSizes``, how many tokens a camera image becomes, how its image features are computed,
and how its language model attends over the prefix and counts positions. A loaded checkpoint's family is its
config's ``model_type``; a tiny one's is the policy section's ``family``.

    paligemma   SigLIP patches, one token each, projected; a Gemma whose prefix (images, words, state) attends both
                ways (token_type_ids 0) and whose positions count from 1
    smolvlm     SigLIP patches pixel-shuffled (``scale_factor`` x ``scale_factor`` patches per token) through a
                connector; a Llama, causal throughout, positions from 0 (SmolVLM, Idefics3: SmolVLA's backbone)
    qwen2_5_vl  Qwen2.5-VL's ViT over patches (CLIP-normalised, two frames per patch for a still image) merged
                2 x 2 per token; a Qwen2, causal, with multimodal rotary positions (M-RoPE): an image's tokens
                carry (t, row, column) from the position where it starts and advance it by its larger side, text
                tokens one each (as the model's own get_rope_index counts them)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    """A family's facts, and PaliGemma's ways where a family keeps them: image features straight from the vision
    tower, positions counting unmasked tokens. A family that differs overrides the method."""

    name: str
    model_types: tuple[str, ...]
    bidirectional_prefix: bool  # the prefix attends both ways (PaliGemma's token_type_ids)
    first_position: int  # the position id of the first token
    encoder: str  # the image encoder's attribute on the inner model (PaliGemmaModel, SmolVLMModel, ...)

    def tiny(self, p: Any, vocab: int, image_size: int):
        """A randomly initialised model from a policy section's sizes: ``vocab`` text ids (the env's, then any the
        policy adds), the image placeholder id just past them, 0 pads, no bos/eos."""
        from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

        from rlfabric.services.policies.vlm_inputs import siglip_paligemma_config

        config = siglip_paligemma_config(p, vocab, image_size)
        return PaliGemmaForConditionalGeneration(PaliGemmaConfig(**{k: v for k, v in config.items()
                                                                    if k != "model_type"}))

    def image_encoder(self, inner: Any) -> Any:
        """The image encoder (the ViT, before any projector or connector) of an inner model (``model.model`` of a
        ForConditionalGeneration, pi0's ``model.vlm``)."""
        return getattr(inner, self.encoder)

    def vision(self, config: Any, env_size: int) -> tuple[int, tuple[int, int]]:
        """(the square size the model reads images at, its grid of tokens per image) for a model's config."""
        grid = config.vision_config.image_size // config.vision_config.patch_size
        return config.vision_config.image_size, (grid, grid)

    def image_features(self, model: Any, pixels: torch.Tensor) -> torch.Tensor:
        """[N, tokens, width] of images [N, 3, S, S] in [-1, 1] (the transformers model, unwrapped)."""
        return model.model.get_image_features(pixels).pooler_output

    def positions(self, mask: torch.Tensor, cameras: int, grid: tuple[int, int]) -> torch.Tensor:
        """Each token's (text) position [B, L] in a sequence of ``cameras`` images first, then text: unmasked tokens
        counted from the first position."""
        return mask.cumsum(-1) - 1 + self.first_position

    def model_positions(self, position: torch.Tensor, cameras: int, grid: tuple[int, int],
                        images: bool) -> torch.Tensor:
        """What the language model takes as position_ids (``images``: the sequence starts with the images)."""
        return position

    def check_grid(self, image_size: int, patch: int, merge: int = 1) -> int:
        """Patches per side of a tiny model's image; an error naming the fix unless they tile it (and its merge)."""
        grid = image_size // patch
        if grid * patch != image_size or grid % merge:
            raise ValueError(f"policy family {self.name}: the image size {image_size} is not a multiple of "
                             f"{patch * merge} (the patch{' times the merge' if merge > 1 else ''}). Fix: a patch "
                             f"that divides it (or set the policy's image size)")
        return grid


class SmolVLMFamily(Family):
    """SigLIP patches pixel-shuffled through a connector; a Llama, causal throughout."""

    def tiny(self, p: Any, vocab: int, image_size: int):
        from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

        grid = self.check_grid(image_size, p.patch)
        llama = {"model_type": "llama", "hidden_size": p.width, "intermediate_size": 4 * p.width,
                 "num_hidden_layers": p.layers, "num_attention_heads": p.heads, "num_key_value_heads": 1,
                 "head_dim": p.head_dim, "vocab_size": vocab, "pad_token_id": 0, "bos_token_id": None,
                 "eos_token_id": None}
        vision = {"model_type": "smolvlm_vision", "hidden_size": p.vision_width,
                  "intermediate_size": 4 * p.vision_width, "num_hidden_layers": p.vision_layers,
                  "num_attention_heads": p.heads, "patch_size": p.patch, "image_size": image_size}
        return SmolVLMForConditionalGeneration(SmolVLMConfig(
            text_config=llama, vision_config=vision, scale_factor=2 if grid % 2 == 0 else 1,
            image_token_id=vocab, pad_token_id=0))

    def vision(self, config: Any, env_size: int) -> tuple[int, tuple[int, int]]:
        size, (grid, _) = super().vision(config, env_size)
        return size, (grid // config.scale_factor, grid // config.scale_factor)

    def image_features(self, model: Any, pixels: torch.Tensor) -> torch.Tensor:
        out = model.model.get_image_features(pixels.unsqueeze(1)).pooler_output  # images per sample on a dim
        # transformers 5.24 returns one [tokens, width] tensor per sample, 5.19 a [N, tokens, width] tensor
        return torch.stack(out) if isinstance(out, list | tuple) else out


class QwenVLFamily(Family):
    """Qwen2.5-VL: merged ViT patches; a causal Qwen2 whose image tokens take M-RoPE (t, row, column) positions."""

    def tiny(self, p: Any, vocab: int, image_size: int):
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        self.check_grid(image_size, p.patch, merge=2)
        if p.head_dim * p.heads != p.width or p.head_dim % 8:
            raise ValueError(f"policy family qwen2_5_vl: a Qwen2's head is width / heads = {p.width}/{p.heads}, and "
                             f"head_dim is {p.head_dim} (it must match, and be a multiple of 8 for M-RoPE's three "
                             f"sections). Fix: head_dim = width / heads")
        # rotary frequencies split over (t, row, column) as Qwen2.5-VL splits its 64: 16/24/24. Time takes the fastest
        # and a still image has one frame, so rows and columns turn slowly: with a tiny head (16 frequencies) and
        # the usual base 10000 a column apart barely rotates, and the tiny model learns where things are ~2x slower
        # than at base 10 (measured on the four-quadrant captions of tests/unit/test_vlm_text_policy.py)
        half = p.head_dim // 2
        sections = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]
        text = {"vocab_size": vocab, "hidden_size": p.width, "intermediate_size": 4 * p.width,
                "num_hidden_layers": p.layers, "num_attention_heads": p.heads, "num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "default", "mrope_section": sections, "rope_theta": 10.0},
                "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
        vision = {"depth": p.vision_layers, "hidden_size": p.vision_width, "intermediate_size": 4 * p.vision_width,
                  "num_heads": p.heads, "patch_size": p.patch, "spatial_merge_size": 2, "temporal_patch_size": 2,
                  "window_size": image_size, "out_hidden_size": p.width,
                  "fullatt_block_indexes": list(range(p.vision_layers))}
        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=vocab, video_token_id=vocab,
            vision_start_token_id=vocab, vision_end_token_id=vocab))

    def vision(self, config: Any, env_size: int) -> tuple[int, tuple[int, int]]:
        """Qwen2.5-VL reads any multiple of its patch x merge: the env's size rounded to one."""
        unit = config.vision_config.patch_size * config.vision_config.spatial_merge_size
        size = max(unit, round(env_size / unit) * unit)
        return size, (size // unit, size // unit)

    def image_features(self, model: Any, pixels: torch.Tensor) -> torch.Tensor:
        return torch.stack(model.model.get_image_features(*qwen_patches(pixels, model.config.vision_config))
                           .pooler_output)

    def positions(self, mask: torch.Tensor, cameras: int, grid: tuple[int, int]) -> torch.Tensor:
        """An image advances the position by its larger side, not by its tokens."""
        position = super().positions(mask, cameras, grid)
        position[:, cameras * grid[0] * grid[1]:] -= cameras * (grid[0] * grid[1] - max(grid))
        return position

    def model_positions(self, position: torch.Tensor, cameras: int, grid: tuple[int, int],
                        images: bool) -> torch.Tensor:
        """[3, B, L]: each image token at (start, start + row, start + column), text at its position thrice (a
        decoded token's [B, 1] the model repeats itself)."""
        if not images:
            return position
        out = position.unsqueeze(0).repeat(3, 1, 1)
        rows, cols = torch.meshgrid(torch.arange(grid[0], device=position.device),
                                    torch.arange(grid[1], device=position.device), indexing="ij")
        offsets = torch.stack([torch.zeros_like(rows), rows, cols]).reshape(3, 1, -1)
        for c in range(cameras):
            start = self.first_position + c * max(grid)
            span = slice(c * grid[0] * grid[1], (c + 1) * grid[0] * grid[1])
            out[:, :, span] = start + offsets
        return out


def qwen_patches(pixels: torch.Tensor, vision: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's input of images [N, 3, S, S] in [-1, 1]: CLIP-normalised patches, each still image repeated
    over the temporal patch, in its processor's order (merge blocks together), and the grid (1, rows, columns) of
    each image."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    N, C, S, _ = pixels.shape
    mean = torch.tensor(OPENAI_CLIP_MEAN, dtype=pixels.dtype, device=pixels.device).view(1, C, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD, dtype=pixels.dtype, device=pixels.device).view(1, C, 1, 1)
    x = ((pixels + 1.0) * 0.5 - mean) / std
    p, m, T = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    g = S // p
    x = x.reshape(N, C, g // m, m, p, g // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)  # (N, gh, gw, mh, mw, C, p, p)
    x = x.unsqueeze(6).expand(*x.shape[:6], T, p, p)
    grid = torch.tensor([[1, g, g]] * N, device=pixels.device)
    return x.reshape(N * g * g, C * T * p * p), grid


FAMILIES = {f.name: f for f in (
    Family("paligemma", ("paligemma",), bidirectional_prefix=True, first_position=1, encoder="vision_tower"),
    SmolVLMFamily("smolvlm", ("smolvlm", "idefics3"), bidirectional_prefix=False, first_position=0,
                  encoder="vision_model"),
    QwenVLFamily("qwen2_5_vl", ("qwen2_5_vl",), bidirectional_prefix=False, first_position=0, encoder="visual"),
)}


def family_of(config: Any, field: str) -> Family:
    """The family of a loaded model's config; an error naming the supported ones otherwise."""
    model_type = getattr(config, "model_type", "")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    supported = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"{field}: a {model_type or 'unknown'} model; the VLM policies run on {supported}. Fix: a "
                     f"checkpoint of one of those families")
