"""Writes a supervised data set for a text task: prompts with their correct answers, tokenized with the LM
policies' char tokenizer (built models without a corpus), as the .npz a supervised LM algorithm reads (tokens,
lengths, loss_mask). For a checkpoint's own tokenizer, give replay.datasets a JSONL/Parquet file of prompt and
completion rows instead (services/replay/datasets.py tokenizes it at start-up).

    python -m rlfabric.services.env.tasks.sft_data OUT.npz --task arith --level 2 --rows 4000 --seed 0

Only the train split is written: held-out problems never reach training.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from rlfabric.services.env.tasks import task_class


def build(task_name: str, rows: int, seed: int, level: int = 2, held_out_fraction: float = 0.2) -> dict:
    """Correct episodes of the task's train split: every model turn ends with <eos> (as generation does) and is
    in the loss; prompts and tool replies are context only."""
    from rlfabric.services.core.models.tokenizer import TextCodec, build_tokenizer

    codec = TextCodec(build_tokenizer())
    task = task_class(task_name)(level=level, split="train", held_out_fraction=held_out_fraction)
    seqs, masks = [], []
    for p in task.problems(rows, seed):
        ids = codec.prompt_ids("")  # the bos an episode starts with
        mask = [0] * len(ids)
        for text, said in task.transcript(p):
            part = codec.response_ids(text) if said else codec.encode(text)
            ids += part
            mask += [int(said)] * len(part)
        seqs.append(ids)
        masks.append(mask)
    longest = max(len(s) for s in seqs)
    tokens = np.full((rows, longest), codec.pad_id, dtype=np.int64)
    loss_mask = np.zeros((rows, longest), dtype=np.uint8)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        tokens[i, :len(s)] = s
        loss_mask[i, :len(m)] = m
    return {"tokens": tokens, "lengths": np.array([len(s) for s in seqs], dtype=np.int64), "loss_mask": loss_mask}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--task", default="arith")
    ap.add_argument("--level", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    arrays = build(args.task, args.rows, args.seed, args.level)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **arrays)
    print(f"wrote {args.rows} {args.task} level-{args.level} examples to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
