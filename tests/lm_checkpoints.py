"""Tiny Hugging Face checkpoint directories built locally, shaped like the real ones a user brings: a Qwen2/Qwen3
(byte-level BPE, ``<|im_start|>`` chat template, eos ``<|im_end|>``, no bos) or a Llama 3 (bos
``<|begin_of_text|>``, header-style chat template, eos ``<|eot_id|>``), each with a generation_config.json naming
its eos ids. Nothing is downloaded: the tokenizer is trained here on ``texts``, the model randomly initialised."""

from __future__ import annotations

from pathlib import Path

TEXTS = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(20) for b in range(0, 20, 3)]
QWEN_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
LLAMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
                  "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def make_checkpoint(directory: str | Path, arch: str = "qwen2", texts: list[str] | None = None, hidden: int = 64,
                    layers: int = 2, heads: int = 1, vocab: int = 400, positions: int = 256, seed: int = 0) -> Path:
    """A save_pretrained directory of a tiny ``arch`` model (qwen2, qwen3 or llama) with its own tokenizer, chat
    template and generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from rlfabric.services.core.models.tokenizer import train_bpe

    directory = Path(directory)
    texts = list(texts or TEXTS)
    if arch not in ("qwen2", "qwen3", "llama"):
        raise ValueError(f"arch={arch!r}: make_checkpoint builds qwen2, qwen3 or llama")
    qwen = arch != "llama"
    # special tokens after the learned vocabulary, as in the real checkpoints (ids nothing else hard-codes)
    tok = train_bpe(texts, vocab, specials=(), pad=None, bos=None, eos=None)
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS if qwen else LLAMA_SPECIALS)})
    if qwen:
        tok.pad_token, tok.eos_token = "<|endoftext|>", "<|im_end|>"
        tok.chat_template = QWEN_TEMPLATE
        eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        pad, bos = tok.convert_tokens_to_ids("<|endoftext|>"), None
    else:
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
        tok.chat_template = LLAMA_TEMPLATE
        eos = [tok.convert_tokens_to_ids("<|end_of_text|>"), tok.convert_tokens_to_ids("<|eot_id|>")]
        pad, bos = None, tok.convert_tokens_to_ids("<|begin_of_text|>")
    config = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        max_position_embeddings=positions, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(str(directory), safe_serialization=True)
    tok.save_pretrained(str(directory))
    return directory
