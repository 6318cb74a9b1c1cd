"""How the PaliGemma-backed policies (vla_tokens, vlm) run their VLM: one prefix of camera images (SigLIP features
in the image placeholders), the instruction's ids and a proprioception token, attended bidirectionally as
PaliGemma's prefix, then causal tokens after it, with or without a KV cache. A mixin: the policy builds
``self.model`` (the transformers model, maybe inside peft), ``self.read`` (VLMInputs) and ``self.state_proj``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.policies.vlm_inputs import unwrapped


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


class PaliGemmaBody(nn.Module):
    model: nn.Module
    read: Any
    state_proj: nn.Module

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
        pixels = x["pixel_values"].flatten(0, 1)
        image = self.vlm.model.get_image_features(pixels).pooler_output
        emb = emb.masked_scatter(placeholders.unsqueeze(-1), image.to(emb.dtype))
        emb = torch.cat([emb, self.state_proj(x["state"]).unsqueeze(1)], 1)
        return emb, torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)

    def _run(self, emb: torch.Tensor, mask: torch.Tensor, prefix_len: int, cache: Any = None,
             offset: torch.Tensor | None = None, use_cache: bool = False):
        """The language model over embeddings: the first ``prefix_len`` positions bidirectional (PaliGemma's
        prefix), the rest causal; positions count unmasked tokens (1-based, as PaliGemma's)."""
        B, L = emb.shape[:2]
        if cache is None:
            position = mask.cumsum(-1)
            token_type = torch.ones(B, L, dtype=torch.long, device=emb.device)
            token_type[:, :prefix_len] = 0
        else:  # one decoded token after the cached ones
            position = offset.unsqueeze(1)
            token_type = None
        return self.vlm.model(inputs_embeds=emb, attention_mask=mask, position_ids=position, past_key_values=cache,
                              token_type_ids=token_type, use_cache=use_cache or cache is not None,
                              return_dict=True)

    def _pooled(self, hidden: torch.Tensor, mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
        m = mask[:, :prefix_len].unsqueeze(-1).to(hidden.dtype)
        return (hidden[:, :prefix_len] * m).sum(1) / m.sum(1).clamp(min=1.0)
