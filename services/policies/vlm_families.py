"""The transformers VLM families the VLM policies (vla_tokens, vlm) run on, and what differs between them: how a tiny
one is built from ``TinyVLMSizes``, how many tokens a camera image becomes, how its image features are computed,
and how its language model attends over the prefix and counts positions. A loaded checkpoint's family is its
config's ``model_type``; a tiny one's is the policy section's ``family``.

    paligemma   SigLIP patches, one token each, projected; a Gemma whose prefix (images, words, state) attends both
                ways (token_type_ids 0) and whose positions count from 1
    smolvlm     SigLIP patches pixel-shuffled (``scale_factor`` x ``scale_factor`` patches per token) through a
                connector; a Llama, causal throughout, positions from 0 (SmolVLM, Idefics3: SmolVLA's backbone)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    bidirectional_prefix: bool  # the prefix attends both ways (PaliGemma's token_type_ids)
    first_position: int  # the position id of the first token

    def tiny(self, p: Any, vocab: int, image_size: int):
        """A randomly initialised model from a policy section's sizes: ``vocab`` text ids (the env's, then any the
        policy adds), the image placeholder id just past them, 0 pads, no bos/eos."""
        if self.name == "paligemma":
            from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

            from services.policies.vlm_inputs import siglip_paligemma_config

            config = siglip_paligemma_config(p, vocab, image_size)
            return PaliGemmaForConditionalGeneration(PaliGemmaConfig(**{k: v for k, v in config.items()
                                                                        if k != "model_type"}))
        from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

        grid = image_size // p.patch
        if grid * p.patch != image_size:
            raise ValueError(f"policy family smolvlm: the image size {image_size} is not a multiple of the patch "
                             f"{p.patch}. Fix: a patch that divides it (or set the policy's image size)")
        llama = {"model_type": "llama", "hidden_size": p.width, "intermediate_size": 4 * p.width,
                 "num_hidden_layers": p.layers, "num_attention_heads": p.heads, "num_key_value_heads": 1,
                 "head_dim": p.head_dim, "vocab_size": vocab, "pad_token_id": 0, "bos_token_id": None,
                 "eos_token_id": None}
        vision = {"model_type": "smolvlm_vision", "hidden_size": p.vision_width,
                  "intermediate_size": 4 * p.vision_width, "num_hidden_layers": p.vision_layers,
                  "num_attention_heads": p.heads, "patch_size": p.patch, "image_size": image_size}
        return SmolVLMForConditionalGeneration(SmolVLMConfig(
            text_config=llama, vision_config=vision, scale_factor=2 if grid % 2 == 0 else 1, image_token_id=vocab,
            pad_token_id=0))

    def vision(self, config: Any) -> tuple[int, int]:
        """(image size the model reads, tokens per image) of a model's config."""
        v = config.vision_config
        grid = v.image_size // v.patch_size
        if self.name == "smolvlm":
            grid //= config.scale_factor
        return v.image_size, grid * grid

    def image_features(self, model: Any, pixels: torch.Tensor) -> torch.Tensor:
        """[N, tokens, width] of images [N, 3, S, S] in [-1, 1] (the transformers model, unwrapped)."""
        if self.name == "smolvlm":  # images per sample on a dim of their own
            return model.model.get_image_features(pixels.unsqueeze(1)).pooler_output
        return model.model.get_image_features(pixels).pooler_output


FAMILIES = {f.name: f for f in (
    Family("paligemma", ("paligemma",), bidirectional_prefix=True, first_position=1),
    Family("smolvlm", ("smolvlm", "idefics3"), bidirectional_prefix=False, first_position=0),
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
