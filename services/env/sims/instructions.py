"""Instruction text and its tokenizer for language-conditioned tasks: a byte-pair-encoding vocabulary learned
here (``tokenizers``' BPE trainer over the task's instruction templates), deterministic on every machine, so
instructions become token ids in the env and a VLA policy embeds them."""

from __future__ import annotations

import functools

import numpy as np

TEMPLATES = ("reach the {} ball", "move to the {} ball", "touch the {} one", "go to the {} target",
             "put the gripper on the {} ball")
COLORS = ("red", "blue", "green", "yellow")
PAD = 0
MAX_TOKENS = 12


@functools.cache
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<pad>", "<unk>"], show_progress=False)
    corpus = [t.format(c) for t in TEMPLATES for c in COLORS]
    tok.train_from_iterator(corpus * 4, trainer)
    return tok


def vocab_size() -> int:
    return tokenizer().get_vocab_size()


def encode(text: str, length: int = MAX_TOKENS) -> np.ndarray:
    """Token ids of ``text``, padded with PAD (0) to ``length``; longer instructions are an error, not truncated."""
    ids = tokenizer().encode(text).ids
    if len(ids) > length:
        raise ValueError(f"instruction {text!r} has {len(ids)} tokens, more than the {length} the task allows")
    out = np.full(length, PAD, np.int64)
    out[:len(ids)] = ids
    return out
