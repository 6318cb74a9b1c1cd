"""Causal language-model policies through ``transformers``: built from a config and randomly initialised, or
loaded from a local Hugging Face checkpoint directory (never from a hub) with its own tokenizer, chat template and
generation config.

Tokenizers and special tokens live in services/core/models/tokenizer.py: ``load_tokenizer`` picks the checkpoint's
tokenizer, a byte-level BPE trained on a data file, or the character tokenizer of the shipped text tasks (ids
``PAD``/``BOS``/``EOS``, re-exported here); ``TextCodec`` is what backends, collector and supervised data loader
ask for eos, pad and bos ids and how to render a prompt.

``CausalLMPolicy`` is what the learner trains and the ``hf`` backend generates with. ``token_logprobs`` gives the
log-probability of every token given its prefix, the quantity every LM algorithm's loss is built from.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlfabric.services.core.models.hf_cache import cache_arg, cache_of
from rlfabric.services.core.models.tokenizer import (
    BOS,
    CHARS,
    EOS,
    PAD,
    SPECIALS,
    TextCodec,
    build_tokenizer,
    load_tokenizer,
)


def model_config(cfg: Any, codec: TextCodec, vocab_size: int) -> Any:
    """The transformers config of a built model: ``cfg``'s sizes and the tokenizer's special ids."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        cfg.arch, vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        head_dim=cfg.hidden_size // cfg.heads, max_position_embeddings=cfg.max_positions,
        pad_token_id=codec.pad_id, bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_ids[0] if len(codec.eos_ids) == 1 else list(codec.eos_ids),
        tie_word_embeddings=cfg.tie_embeddings, dtype="float32")


def build_lm(cfg: Any, tokenizer: Any) -> nn.Module:
    """A causal LM: from ``cfg.path`` (a local checkpoint directory, loaded in float32) or built from the config,
    randomly initialised."""
    from transformers import AutoModelForCausalLM

    if cfg.path:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"policy.lm.path={cfg.path!r} is not a saved model directory (no config.json). Fix: "
                             f"point it at a directory written by save_pretrained, or leave it empty to build one")
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32,
                                                    attn_implementation=cfg.attention)
    return AutoModelForCausalLM.from_config(model_config(cfg, TextCodec(tokenizer), len(tokenizer)),
                                            dtype=torch.float32, attn_implementation=cfg.attention)


def token_logprobs(model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """``[B, L-1]``: log p(tokens[:, t+1] | tokens[:, :t+1]) for right-padded ``[B, L]`` sequences."""
    logits = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    return gathered_logprobs(logits, tokens)


def shared_prompt_logprobs(model: nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor,
                           prefix: torch.Tensor, owner: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``token_logprobs`` for rows that share prompts (a group of G responses to one prompt), with each prompt
    run once. Row b's first ``prefix[b]`` tokens are the prompt of ``owner[b]`` (rows of one owner share them).

    Two passes: the distinct prompts, left-padded into one batch, fill a KV cache; each row's continuation reads
    its owner's cache (indexed per row: gradients flow back into the prompt pass) at its true positions. Positions
    before ``prefix[b] - 1`` (log-probs of prompt tokens, which no loss trains) come back as 0.
    """
    B, L = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    lengths = attention_mask.sum(1)
    owners, inverse = torch.unique(owner, return_inverse=True)
    first = torch.zeros(len(owners), dtype=torch.long, device=tokens.device).scatter_(0, inverse, rows)
    p = prefix[first]  # each distinct prompt's length
    width = int(p.max())
    col = torch.arange(width, device=tokens.device)
    real = col[None] >= (width - p)[:, None]  # left padding: every prompt ends in the last column
    src = (col[None] - (width - p)[:, None]).clamp(min=0)
    prompt_ids = torch.where(real, tokens[first[:, None], src], 0)
    prompt_mask = real.long()
    head = model(input_ids=prompt_ids, attention_mask=prompt_mask,
                 position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0), use_cache=True)
    cache = cache_of(head)
    cache.batch_select_indices(inverse)
    span = lengths - prefix  # each row's continuation
    cont = int(span.max())
    j = torch.arange(cont, device=tokens.device)
    live = j[None] < span[:, None]
    cont_ids = torch.where(live, tokens[rows[:, None], (prefix[:, None] + j[None]).clamp(max=L - 1)], 0)
    tail = model(input_ids=cont_ids, attention_mask=torch.cat([prompt_mask[inverse], live.long()], 1),
                 position_ids=prefix[:, None] + j[None], use_cache=True, **{cache_arg(model): cache}).logits
    # the prompt's last position predicts the first continuation token; continuation position j the next
    logits = torch.cat([head.logits[inverse, -1:], tail[:, :-1]], 1)
    if temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, cont_ids[..., None]).sum(-1) * live
    # into the [B, L-1] layout of token_logprobs: continuation token j of row b sits at prefix[b] - 1 + j;
    # padding positions go past column L-2 and are cut off
    at = torch.where(live, prefix[:, None] - 1 + j[None], L - 1 + j[None])
    return lp.new_zeros(B, L - 1 + cont).scatter(1, at, lp)[:, :L - 1]


def gathered_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p of each next token from the (already shifted and tempered) logits [B, L-1, V]."""
    # .sum(-1) of the one gathered value, not .squeeze(-1): a new tensor, not a view (a sharded learner's FSDP hooks
    # attach to its output, and a view would lose them)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).sum(-1)


def with_lora(model: nn.Module, cfg: Any, targets: str | None = None, train: tuple[str, ...] = ()) -> nn.Module:
    """LoRA adapters (peft) on ``cfg.targets`` (or ``targets``, a regex of module paths); only they and the
    modules named in ``train`` train, the base weights stay frozen. Rollout backends build the same wrapped model,
    so a published version carries base and adapters under the same names."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, bias="none",
                                            target_modules=targets or list(cfg.targets),
                                            modules_to_save=list(train) or None))


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict with LoRA adapters folded in (W + B A * alpha / r), leaving ``model`` as it
    was: what an engine that serves no adapters loads."""
    if not hasattr(model, "merge_and_unload"):
        return model.state_dict()
    return copy.deepcopy(model).merge_and_unload().state_dict()


def bias_end_token(state: dict[str, torch.Tensor], logit: float, eos: int = EOS) -> dict[str, torch.Tensor]:
    """A copy of a (random) Llama-style model's weights that end responses early: the end token's logit gets a
    fixed bias of about ``logit`` x a constant. One residual coordinate is held at 1 (its embedding column set,
    every layer's writes to it zeroed) and only the end token's output row reads it. Benchmarks and tests use it
    for responses of varied length (the long tail of RL sampling) without training a model."""
    state = {k: v.clone() for k, v in state.items()}
    k = 0
    next(v for name, v in state.items() if name.endswith("embed_tokens.weight"))[:, k] = 1.0
    for name, v in state.items():  # what writes the residual stream: o_proj, down_proj (and their LoRA B)
        if ("o_proj" in name or "down_proj" in name) and "lora_A" not in name and v.dim() == 2:
            v[k, :] = 0.0
    head = next(v for name, v in state.items() if name.endswith("lm_head.weight"))
    head[:, k] = 0.0
    head[eos, k] = logit
    return state


class CausalLMPolicy(nn.Module):
    """A causal LM as a policy: its action is a text turn; its trainable state is the model's parameters."""

    has_value = False
    discrete = True
    # what a sharded (FSDP) learner calls
    forward_methods = ("token_logprobs", "shared_prompt_logprobs", "next_token_logprobs")

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__()
        try:
            import tokenizers  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"policy causal_lm needs transformers and tokenizers ({exc.name} is missing). Fix: "
                             f"pip install -e '.[llm]'") from None
        if obs_space.get("kind") != "text" or action_space.get("kind") != "text":
            raise ValueError(f"policy causal_lm acts in text spaces (env.adapter: text), not observation "
                             f"{obs_space.get('kind')!r} / action {action_space.get('kind')!r}")
        self.cfg = cfg.lm
        self.tokenizer = load_tokenizer(self.cfg)
        self.model = build_lm(self.cfg, self.tokenizer)
        self.codec = TextCodec(self.tokenizer, getattr(self.model, "generation_config", None))
        # the longest context (prompt, turns and replies): a checkpoint's own max_position_embeddings, unless the
        # spec sets policy.lm.max_positions lower; a built model has exactly max_positions
        own = int(getattr(self.model.config, "max_position_embeddings", 0) or self.cfg.max_positions)
        self.context = min(own, self.cfg.max_positions) if not self.cfg.path or \
            "max_positions" in self.cfg.model_fields_set else own
        if self.cfg.lora.rank:
            self.model = with_lora(self.model, self.cfg.lora)
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.max_chars = int(action_space["max_length"])

    def token_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
        return token_logprobs(self.model, tokens, attention_mask, temperature)

    def shared_prompt_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor, prefix: torch.Tensor,
                               owner: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return shared_prompt_logprobs(self.model, tokens, attention_mask, prefix, owner, temperature)

    def next_token_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
        """``[B, L-1, V]``: the whole next-token distribution (log-softmax) after every prefix, for losses that
        compare two policies over the vocabulary (distillation), not only at the sampled token."""
        logits = self.model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        return torch.log_softmax(logits.float() / temperature, dim=-1)

    def shard_units(self) -> list[nn.Module]:
        """The FSDP units of a multi-rank learner: the decoder layers (each all-gathered on its own)."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return list(base.model.layers)

    def save_pretrained(self, path: str | Path) -> None:
        """A Hugging Face checkpoint directory that plain transformers and vLLM open with no conversion: the model
        (LoRA adapters merged in, on a copy), its generation config, and the tokenizer with its chat template."""
        model = self.model
        if hasattr(model, "merge_and_unload"):
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(str(path), safe_serialization=True)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))


class CausalLMValuePolicy(CausalLMPolicy):
    """A causal LM with a value head on its last hidden state (one trunk for actor and critic, the RLHF recipe).
    Engines serve only the LM (``self.model``); the head lives with the learner and travels in its state."""

    has_value = True
    forward_methods = ("token_logprobs", "token_logprobs_values")

    def __init__(self, obs_space: dict[str, Any], action_space: dict[str, Any], cfg: Any):
        super().__init__(obs_space, action_space, cfg)
        hidden = self.model.config.hidden_size if hasattr(self.model, "config") else cfg.lm.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def token_logprobs_values(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, L-1] log p of each next token, [B, L-1] V of the state that predicts it), one forward pass."""
        out = self.model(input_ids=tokens, attention_mask=attention_mask, use_cache=False,
                         output_hidden_states=True)
        logits = out.logits[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        values = self.value_head(out.hidden_states[-1][:, :-1].float()).sum(-1)  # (not a view: see above)
        return gathered_logprobs(logits, tokens), values


__all__ = ["BOS", "CHARS", "EOS", "PAD", "SPECIALS", "CausalLMPolicy", "CausalLMValuePolicy", "TextCodec",
           "bias_end_token", "build_lm", "build_tokenizer", "gathered_logprobs", "load_tokenizer", "merged_state_dict",
           "model_config", "token_logprobs", "with_lora"]
