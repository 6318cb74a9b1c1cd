"""How the VLM policies (vla_tokens, vlm) run their VLM: one prefix of camera images (the family's image features in
the image placeholders), the instruction's ids and a proprioception token, then causal tokens after it, with or
without a KV cache. The prefix attends both ways where the family's does (PaliGemma), causally otherwise
(services/policies/vlm_families.py). A mixin: the policy builds ``self.model`` (the transformers model, maybe inside
peft), ``self.family``, ``self.read`` (VLMInputs) and ``self.state_proj``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfabric.services.core.models.hf_cache import cache_arg
from rlfabric.services.policies.vlm_families import FAMILIES, Family, family_of
from rlfabric.services.policies.vlm_inputs import VLMInputs, freeze, start_vlm, unwrapped


def load_pretrained(path: str, trust_remote_code: bool, field: str):
    """A local save_pretrained directory of an image-text-to-text VLM (the policy section's ``path``, named by
    ``field``); never a hub id."""
    from pathlib import Path

    from transformers import AutoModelForImageTextToText

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{field}={path!r} is not a save_pretrained directory (no config.json). Fix: a local "
                         f"directory written by save_pretrained; nothing is downloaded")
    return AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                       trust_remote_code=trust_remote_code)


def build_vlm(p: Any, read: VLMInputs, vocab: int, field: str) -> tuple[Any, Family]:
    """The policy section ``p``'s model and its family: loaded from ``p.path`` (its config says the family), or
    tiny from the sizes (``p.family``) with ``vocab`` text ids, reading the env's images at their size; ``read`` is
    bound to the model's image size, tokens per image, placeholder id and vocabulary."""
    if p.path:
        model = load_pretrained(p.path, p.trust_remote_code, f"{field}.path")
        family = family_of(model.config, f"{field}.path={p.path!r}")
    else:
        family = FAMILIES[p.family]
        model = family.tiny(p, vocab, read.env_image_size)
        if p.vlm_path:  # (a PaliGemma: the config allows no other family here)
            start_vlm(model.model, p.vlm_path, f"{field}.vlm_path")
    size, grid = family.vision(model.config, read.env_image_size)
    read.bind(size, grid, model.config.image_token_id, model.config.text_config.vocab_size)
    return model, family


class VLMBody(nn.Module):
    model: nn.Module
    family: Family
    read: Any
    state_proj: nn.Module

    def freeze_vision(self, p: Any) -> None:
        """``p.freeze_vision``: the image encoder, any LoRA adapters in it included, takes no gradient (called once
        the model is wrapped)."""
        if p.freeze_vision:
            freeze(self.family.image_encoder(self.vlm.model))

    @property
    def vlm(self):
        """The transformers model (inside peft's wrapper when LoRA is on)."""
        return unwrapped(self.model)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vlm.get_input_embeddings()(ids)

    def _prefix(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings [B, P, W] and mask [B, P] of images, instruction and the proprioception token."""
        x = self.read(obs, max(self.read.state_dim, 1))
        ids, mask = x["input_ids"], x["attention_mask"]
        placeholders = ids == self.read.image_token_id
        emb = self._embed(ids.masked_fill(placeholders, 0))
        image = self.family.image_features(self.vlm, x["pixel_values"].flatten(0, 1))
        emb = emb.masked_scatter(placeholders.unsqueeze(-1), image.to(emb.dtype))
        emb = torch.cat([emb, self.state_proj(x["state"]).unsqueeze(1)], 1)
        return emb, torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)

    def _positions(self, mask: torch.Tensor) -> torch.Tensor:
        """Each token's position [B, L] (images first, then text), as the family counts them."""
        return self.family.positions(mask, self.read.cameras, self.read.grid)

    def _lm(self, emb: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, prefix_len: int | None,
            cache: Any = None, use_cache: bool = False):
        """The language model over embeddings; ``prefix_len`` positions attend both ways where the family's prefix
        does (None: every position is prefix, as action queries read the whole prefix)."""
        extra = {}
        if self.family.bidirectional_prefix and cache is None:
            token_type = torch.ones(emb.shape[:2], dtype=torch.long, device=emb.device)
            token_type[:, :emb.shape[1] if prefix_len is None else prefix_len] = 0
            extra["token_type_ids"] = token_type
        position = self.family.model_positions(position, self.read.cameras, self.read.grid, images=cache is None)
        return self.vlm.model(inputs_embeds=emb, attention_mask=mask, position_ids=position,
                              use_cache=use_cache or cache is not None, return_dict=True,
                              **{cache_arg(self.vlm.model): cache}, **extra)

    def _run(self, emb: torch.Tensor, mask: torch.Tensor, prefix_len: int, cache: Any = None,
             offset: torch.Tensor | None = None, use_cache: bool = False):
        """The prefix (and causal tokens after it), or with ``cache`` one decoded token at position ``offset``."""
        position = self._positions(mask) if cache is None else offset.unsqueeze(1)
        return self._lm(emb, mask, position, prefix_len, cache, use_cache)

    def _pooled(self, hidden: torch.Tensor, mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
        m = mask[:, :prefix_len].unsqueeze(-1).to(hidden.dtype)
        return (hidden[:, :prefix_len] * m).sum(1) / m.sum(1).clamp(min=1.0)
