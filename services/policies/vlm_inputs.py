"""What a VLM policy reads from an env's observation: camera images, the instruction's token ids and the rest as a
proprioceptive state vector. Shared by the VLM-backed policies (pi0, vla_tokens), so they read observations alike.

Every uint8 image entry is a camera (sorted by name); ``instruction`` (int64 ids, 0 pads) is the instruction; every
other entry, flattened, is state, except ``privileged`` ones (a simulator's true state: the critic's alone).
Images become SigLIP's input, [-1, 1] at the model's size; each camera takes ``image_tokens`` placeholder ids (the
model's ``image_token_id``) ahead of the instruction's ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlfabric.services.core.models.encoders import is_image, is_privileged


def to_pixels(images: torch.Tensor, size: int, channels_last: bool = True) -> torch.Tensor:
    """uint8 images [N, H, W, C] (or [N, C, H, W]) as SigLIP reads them: [N, C, size, size] in [-1, 1]."""
    x = images.float() / 127.5 - 1.0
    x = x.permute(0, 3, 1, 2) if channels_last else x
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x


class VLMInputs:
    def __init__(self, obs_space: dict[str, Any], policy: str):
        spaces = obs_space["spaces"] if obs_space["kind"] == "dict" else {"image": obs_space}
        self.dict_obs = obs_space["kind"] == "dict"
        self.image_keys = sorted(k for k, s in spaces.items() if is_image(s))
        if not self.image_keys:
            raise ValueError(f"policy.name={policy} reads camera images (uint8 [H, W, C] observations) and the env "
                             f"gives none. Fix: an env with pixel observations (e.g. env.kwargs: {{observation: "
                             f"pixels}})")
        self.text_key = "instruction" if "instruction" in spaces else None
        self.state_keys = sorted(k for k in spaces
                                 if k not in (*self.image_keys, self.text_key) and not is_privileged(k))
        self.state_dim = sum(int(np.prod(spaces[k]["shape"])) if spaces[k]["shape"] else 1 for k in self.state_keys)
        shape = list(spaces[self.image_keys[0]]["shape"])
        self.channels_last = shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4)
        self.env_image_size = shape[0] if self.channels_last else shape[1]
        self.text_vocab = int(np.max(spaces[self.text_key]["high"])) + 1 if self.text_key else 2
        self.cameras = len(self.image_keys)
        self.image_size = self.image_tokens = self.image_token_id = self.vocab = 0
        self.grid = (0, 0)

    def bind(self, image_size: int, grid: tuple[int, int], image_token_id: int, vocab: int) -> None:
        """The size the model reads images at, the grid of tokens each becomes, its image placeholder id and its
        text vocabulary."""
        self.image_size, self.grid, self.image_tokens = image_size, grid, grid[0] * grid[1]
        self.image_token_id, self.vocab = image_token_id, vocab

    def __call__(self, obs: Any, state_dim: int | None = None) -> dict[str, torch.Tensor]:
        """``pixel_values`` [B, cams, 3, S, S], ``input_ids`` (each camera's placeholders, then the instruction),
        ``attention_mask`` (0 on the instruction's padding), ``pixel_attention_mask`` [B, cams] and ``state``
        (zero-padded to ``state_dim``)."""
        parts: dict[str, torch.Tensor] = obs if self.dict_obs else {"image": obs}
        pixels = torch.stack([to_pixels(parts[k], self.image_size, self.channels_last) for k in self.image_keys], 1)
        B, device = pixels.shape[0], pixels.device
        ids = torch.full((B, self.cameras * self.image_tokens), self.image_token_id, dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        if self.text_key is not None:
            text = parts[self.text_key].long().clamp(0, self.vocab - 1)
            ids, mask = torch.cat([ids, text], 1), torch.cat([mask, (text != 0).long()], 1)
        state = torch.zeros(B, state_dim if state_dim is not None else self.state_dim, device=device)
        if self.state_keys:
            flat = torch.cat([parts[k].reshape(B, -1).float() for k in self.state_keys], -1)
            state[:, :flat.shape[1]] = flat
        return {"pixel_values": pixels, "input_ids": ids, "attention_mask": mask, "state": state,
                "pixel_attention_mask": torch.ones(B, self.cameras, dtype=torch.bool, device=device)}


def siglip_paligemma_config(p: Any, vocab: int, image_size: int) -> dict[str, Any]:
    """A tiny PaliGemma config (a dict for transformers) from a policy section's sizes: one KV head per layer, the
    image placeholder id just past the vocabulary, the env's ids as they are (0 pads, no bos/eos)."""
    gemma = {"model_type": "gemma", "num_hidden_layers": p.layers, "num_attention_heads": p.heads,
             "num_key_value_heads": 1, "head_dim": p.head_dim, "vocab_size": vocab, "pad_token_id": 0,
             "bos_token_id": None, "eos_token_id": None}
    return {"model_type": "paligemma", "image_token_id": vocab, "projection_dim": p.width,
            "text_config": gemma | {"hidden_size": p.width, "intermediate_size": 4 * p.width},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": p.vision_width,
                              "intermediate_size": 4 * p.vision_width, "num_hidden_layers": p.vision_layers,
                              "num_attention_heads": p.heads, "patch_size": p.patch, "image_size": image_size,
                              "vision_use_head": False}}


def freeze(module: Any) -> None:
    """No gradient into ``module`` (policy.<section>.freeze_vision): the optimizers take only parameters that need
    one, and its LoRA adapters, if any, stay as they start too."""
    module.requires_grad_(False)


def start_vlm(vlm: Any, path: str, field: str) -> list[str]:
    """A PaliGemma VLM built from sizes (its inner PaliGemmaModel: pi0's ``model.vlm``, a policy's ``model.model``)
    started from a save_pretrained directory (``field``, a ``vlm_path``): a PaliGemma VLM, as pi0 starts from
    PaliGemma (every tensor whose name and shape agree), or a SigLIP vision model (the image encoder alone). The
    image encoder must agree entirely; what does not come from the directory (an embedding of another vocabulary,
    or all but the encoder) keeps its random init and is returned."""
    import json
    from pathlib import Path

    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"{field}={path!r} is not a save_pretrained directory (no config.json). Fix: "
                         f"a local directory of a PaliGemma VLM or a SigLIP vision model")
    kind = json.loads(config.read_text()).get("model_type")
    if kind == "paligemma":
        from transformers import PaliGemmaForConditionalGeneration

        source = PaliGemmaForConditionalGeneration.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        weights = source.model.state_dict()
    elif kind == "siglip_vision_model":
        from transformers import SiglipVisionModel

        source = SiglipVisionModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        weights = {f"vision_tower.{k}": v for k, v in source.state_dict().items()}
    else:
        raise ValueError(f"{field}={path!r} holds a {kind} model; the VLM is a PaliGemma with a "
                         f"SigLIP image encoder. Fix: a PaliGemma VLM's or a SigLIP vision model's directory")
    target = vlm.state_dict()
    same = {k: v for k, v in weights.items() if k in target and target[k].shape == v.shape}
    encoder = sorted(k for k in target if k.startswith("vision_tower.") and k not in same)
    if encoder:
        raise ValueError(f"{field}={path!r}: its image encoder differs from this model's (first: "
                         f"{encoder[0]}). Fix: build the policy with the encoder's sizes (vision_width, "
                         f"vision_layers, patch, heads) and image size")
    vlm.load_state_dict(same, strict=False)
    return sorted(set(target) - set(same))


def unwrapped(model: Any) -> Any:
    """The transformers model inside a peft wrapper (its LoRA layers are injected in place), or the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def save_merged(model: Any, directory: str) -> None:
    """save_pretrained of the plain transformers model, LoRA adapters folded in on a copy."""
    import copy

    plain = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model
    plain.save_pretrained(directory)
