"""Tokenizers of the causal-LM policies and ``TextCodec``, the one place that knows a checkpoint's special tokens.

Three tokenizers, all local (nothing is fetched from a hub):

- a checkpoint's own (``policy.lm.path``): whatever ``AutoTokenizer`` opens there, chat template included;
- ``bpe``: a byte-level BPE trained at start-up on a data file (``policy.lm.tokenizer_corpus``). Learner, rollout
  and replay each train it from the same file, so training is deterministic: the same texts give the same
  vocabulary in every process;
- ``chars``: one token per printable ASCII character plus ``<pad>``, ``<bos>``, ``<eos>`` (ids 0, 1, 2), what tiny
  models learn arithmetic with digit by digit.

This module imports no torch or transformers at import time (the replay service tokenizes supervised data through it).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD, BOS, EOS = 0, 1, 2  # the char tokenizer's (and a trained BPE's) special ids
CHARS = string.printable
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def build_tokenizer() -> Any:
    """The character-level tokenizer of the text tasks (deterministic: the same ids on every machine)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)


SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: list[str], vocab_size: int, specials: tuple[str, ...] = SPECIALS,
              pad: str | None = "<pad>", bos: str | None = "<bos>", eos: str | None = "<eos>") -> Any:
    """A byte-level BPE over ``texts`` (every byte is a token, so no text is unknown), wrapped as a
    PreTrainedTokenizerFast. Deterministic: equal texts give an equal vocabulary and merges in every process."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(f"policy.lm.vocab_size={vocab_size} cannot hold the {len(alphabet)} bytes and "
                         f"{len(specials)} special tokens of a byte-level BPE. Fix: at least "
                         f"{len(alphabet) + len(specials)}")
    tok = Tokenizer(models.BPE())
    # Qwen2's pre-tokenizer: words, single digits (numbers are read digit by digit, as arithmetic needs), runs of
    # punctuation and of whitespace; then bytes
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos,
                                   clean_up_tokenization_spaces=False)


def tokenizer_kind(lm: Any) -> str:
    """What ``policy.lm.tokenizer`` means for this config: path, bpe or chars."""
    if lm.path:
        return "path"
    if lm.tokenizer == "auto":
        return "bpe" if lm.tokenizer_corpus else "chars"
    return lm.tokenizer


def load_tokenizer(lm: Any, roots: Any = None) -> Any:
    """The tokenizer a ``policy.lm`` config names: the checkpoint's own (``path``), a BPE trained on
    ``tokenizer_corpus``, or the char tokenizer. ``roots``: the data roots the corpus must lie under."""
    kind = tokenizer_kind(lm)
    if kind == "path":
        from transformers import AutoTokenizer

        path = Path(lm.path)
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"policy.lm.path={lm.path!r} holds no tokenizer (no tokenizer.json or "
                             f"tokenizer_config.json). Fix: save the tokenizer beside the model "
                             f"(tokenizer.save_pretrained(path))")
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if kind == "bpe":
        from rlfabric.services.core import textdata

        if not lm.tokenizer_corpus:
            raise ValueError("policy.lm.tokenizer=bpe needs policy.lm.tokenizer_corpus (a JSONL or Parquet file "
                             "whose texts it is trained on). Fix: set it, or use tokenizer: chars")
        rows = textdata.read_rows(lm.tokenizer_corpus, "policy.lm.tokenizer_corpus", roots)
        return train_bpe([t for row in rows for t in textdata.row_texts(row)], lm.vocab_size)
    return build_tokenizer()


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class TextCodec:
    """Text <-> token ids with a checkpoint's special tokens: what the backends stop on and pad with, how the
    collector and the supervised data loader render a prompt, and what ends a response."""

    def __init__(self, tokenizer: Any, generation_config: Any = None):
        self.tokenizer = tokenizer
        # the tokenizer's eos first: the token its chat template ends a turn with (Llama 3: <|eot_id|>, not the
        # generation config's first, <|end_of_text|>), so a trained response ends as a templated turn does
        eos = _ids(tokenizer.eos_token_id) + _ids(getattr(generation_config, "eos_token_id", None))
        self.eos_ids: list[int] = list(dict.fromkeys(eos))
        if not self.eos_ids:
            raise ValueError("the tokenizer and generation config name no end-of-sequence token. Fix: set "
                             "eos_token_id in the checkpoint's generation_config.json or the tokenizer's eos_token")
        self.bos_id: int | None = tokenizer.bos_token_id
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = getattr(generation_config, "pad_token_id", None)
        self.pad_id: int = int(pad) if pad is not None else self.eos_ids[0]
        stops = getattr(generation_config, "stop_strings", None) or []
        self.stop_strings: list[str] = [stops] if isinstance(stops, str) else list(stops)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._ends = set(self.eos_ids) | {self.pad_id}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Any) -> str:
        """Text of ``ids``, eos and pad tokens dropped (other special tokens stay: they are part of a turn)."""
        return self.tokenizer.decode([int(t) for t in ids if int(t) not in self._ends], skip_special_tokens=False)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat through the chat template, ending with the assistant's generation prompt."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        if hasattr(out, "keys"):  # a BatchEncoding where return_dict is not honoured
            out = out["input_ids"]
        return [int(t) for t in out]

    def prompt_ids(self, text: str) -> list[int]:
        """The context a prompt starts: a chat prompt (textdata.chat_text) through the chat template where the
        tokenizer has one; plain text (or a chat without a template, its contents joined) after the bos token."""
        from rlfabric.services.core import textdata

        messages = textdata.chat_messages(text)
        if messages is not None:
            if self.has_template:
                return self.render(messages)
            text = textdata.plain_chat(messages)
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(text)

    def response_ids(self, text: str) -> list[int]:
        """A model turn as generation ends it: its tokens, then the first eos (what supervised training targets)."""
        return self.encode(text) + [self.eos_ids[0]]

    def stop_at(self, ids: Any) -> int | None:
        """The length of the shortest prefix of ``ids`` whose text ends with a stop string (None: none does)."""
        if not self.stop_strings:
            return None
        ids = [int(t) for t in ids]
        if not any(s in self.decode(ids) for s in self.stop_strings):
            return None
        for n in range(1, len(ids) + 1):
            text = self.decode(ids[:n])
            if any(text.endswith(s) or s in text for s in self.stop_strings):
                return n
        return None

    def end(self, ids: Any) -> tuple[int, bool]:
        """(tokens the sample keeps, whether it finished): up to and including the first eos, or through the first
        stop string; else all of them, unfinished (cut by the length limit)."""
        ids = [int(t) for t in ids]
        eos = set(self.eos_ids)
        n = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
        stop = self.stop_at(ids[:n] if n is not None else ids)
        if stop is not None:
            return stop, True
        return (n, True) if n is not None else (len(ids), False)


__all__ = ["BOS", "CHARS", "EOS", "PAD", "SPECIALS", "TextCodec", "build_tokenizer", "load_tokenizer",
           "tokenizer_kind", "train_bpe"]
