"""Data sets on disk: named replay sources loaded at the start of a run (offline RL, demonstrations).

A data set is an ``.npz`` file of equally long arrays, one row per transition: ``obs`` (or ``obs/<key>`` for Dict
observations), ``actions``, ``rewards``, ``next_obs``, ``terminated``, and whatever else an algorithm reads. It is
read with ``allow_pickle=False`` (numpy refuses object arrays), checked, and stored into its source in chunks, so
both replay stores hold it like collected data. ``rlfabric collect`` writes such files from a checkpoint.

A supervised language-model run may name a JSONL or Parquet file instead: its rows are tokenized here into the
arrays the .npz form gives (``tokens`` right-padded with the codec's pad id, ``lengths``, ``loss_mask``) with the
run's tokenizer (``load_tokenizer(policy.lm)``: the checkpoint's, a BPE trained on its corpus, or chars). A row is
a prompt (env.options ``prompt_field``, default ``prompt``) and a response (``completion`` when the row has one,
else the ``answer_field``: a GSM8K row's worked answer), or ``messages``, a chat whose assistant turns carry the
loss. The prompt is rendered exactly as an RL rollout renders it: ``textdata.render_prompt`` (the rule the env's
data-set task applies) and the codec's ``prompt_ids`` (chat template where the tokenizer has one). Only this path imports transformers (lazily: the replay service stays torch-free at import).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from rlfabric.services.core.batch import SEP, TensorBatch
from rlfabric.services.core.paths import DataRoots, PathRefused

CHUNK_ROWS = 1 << 15
TEXT_SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetError(ValueError):
    """A data set file that cannot be used; the message names the file, the array and the fix."""


def load_dataset(path: str | Path, max_rows: int, max_bytes: int = 8 << 30, roots: DataRoots | None = None,
                 field: str = "replay.datasets", config: Any = None) -> TensorBatch:
    """The file's arrays as one ("sample",) batch of version 0. Sizes are checked from the archive's directory
    before any array is read. ``roots``: the directories a run spec's data set must lie in (any, without them);
    either way only a regular file is opened (a FIFO or a device is refused, not read). A JSONL/Parquet file is
    tokenized for the LM run ``config`` (see text_dataset)."""
    path = Path(path)
    roots = roots if roots is not None else DataRoots.anywhere()
    if path.suffix.lower() in TEXT_SUFFIXES:
        if config is None:
            raise DatasetError(f"{field}={str(path)!r}: a text data set is tokenized with the run's tokenizer, and "
                               f"no run config came with it. Fix: pass config= (the replay service does)")
        return text_dataset(path, config, max_rows, roots, field)
    try:
        if not roots.confine(path, field).exists():
            raise DatasetError(f"{path}: no such data set file. Fix: write one with `rlfabric collect` (an .npz of "
                               f"obs, actions, rewards, next_obs, terminated) and point replay.datasets at it")
        file = roots.open(path, field)
    except PathRefused as exc:
        raise DatasetError(str(exc)) from None
    with file:
        try:
            with zipfile.ZipFile(file) as archive:
                size = sum(info.file_size for info in archive.infolist())
        except zipfile.BadZipFile:
            raise DatasetError(f"{path}: not an .npz archive") from None
        if size > max_bytes:
            raise DatasetError(f"{path}: {size} bytes uncompressed exceeds the {max_bytes}-byte bound for a data set")
        file.seek(0)
        tensors: dict[str, np.ndarray] = {}
        try:
            with np.load(file, allow_pickle=False) as npz:
                for name in npz.files:
                    if not name or "" in name.split(SEP):
                        raise DatasetError(f"{path}: array name {name!r} is not a field name")
                    tensors[name] = np.ascontiguousarray(npz[name])
        except ValueError as exc:  # object arrays (pickle) are refused here
            raise DatasetError(f"{path}: cannot read safely ({exc})") from None
    if not tensors:
        raise DatasetError(f"{path}: holds no arrays")
    rows = {name: (a.shape[0] if a.ndim else -1) for name, a in tensors.items()}
    if len(set(rows.values())) != 1 or -1 in rows.values():
        raise DatasetError(f"{path}: every array needs the same number of rows (one per transition), got {rows}")
    n = next(iter(rows.values()))
    if n == 0 or n > max_rows:
        raise DatasetError(f"{path}: {n} rows; a data set source holds 1..{max_rows} (replay.capacity_transitions)")
    for name, a in tensors.items():
        if a.dtype.kind not in "biuf":
            raise DatasetError(f"{path}: array {name!r} has dtype {a.dtype}; only numbers and booleans")
    return TensorBatch(tensors, version=0, dims=("sample",))


def _messages_row(codec: Any, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
    """A chat row: each assistant turn in the loss (its tokens + eos), every other turn context as the chat
    template renders the conversation up to that turn."""
    from rlfabric.services.core import textdata

    ids: list[int] = []
    mask: list[int] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = codec.prompt_ids(textdata.chat_text(messages[:k])) if k else list(
            [codec.bos_id] if codec.bos_id is not None else [])
        if context[:len(ids)] != ids:
            raise DatasetError(f"{where}: the chat template renders earlier turns differently once later ones "
                               f"follow (turn {k}), so the loss cannot be placed. Fix: give such rows as "
                               f"prompt/completion, one assistant turn each")
        extra = context[len(ids):]
        response = codec.response_ids(message["content"])
        ids += extra + response
        mask += [0] * len(extra) + [1] * len(response)
    if not any(mask):
        raise DatasetError(f"{where}: its messages hold no assistant turn to train on")
    return ids, mask


def text_dataset(path: str | Path, config: Any, max_rows: int, roots: DataRoots | None = None,
                 field: str = "replay.datasets") -> TensorBatch:
    """A JSONL/Parquet file of prompts and responses as supervised arrays (tokens, lengths, loss_mask), tokenized with
    the run's tokenizer; the loss covers only response tokens (codec.response_ids: text + eos)."""
    from rlfabric.services.core import textdata
    from rlfabric.services.core.models.tokenizer import TextCodec, load_tokenizer
    from rlfabric.services.core.paths import confine_model

    try:
        rows = textdata.read_rows(path, field, roots, max_rows=max_rows)
    except textdata.DataFileError as exc:
        raise DatasetError(str(exc)) from None
    roots = roots if roots is not None else DataRoots.anywhere()
    try:
        lm = confine_model(config, roots).policy.lm
    except PathRefused as exc:
        raise DatasetError(str(exc)) from None
    tokenizer = load_tokenizer(lm, roots)
    generation = None
    if lm.path and (Path(lm.path) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        generation = GenerationConfig.from_pretrained(lm.path, local_files_only=True)
    codec = TextCodec(tokenizer, generation)
    options = config.env.options
    prompt_field = str(options.get("prompt_field", "prompt"))
    answer_field = str(options.get("answer_field", "answer"))
    seqs, masks = [], []
    for i, row in enumerate(rows):
        where = f"{field}={str(path)!r} row {i}"
        if textdata.is_messages(row.get("messages")):
            ids, mask = _messages_row(codec, row["messages"], where)
        elif isinstance(row.get(prompt_field), (str, list)) and isinstance(row.get(completion_field := (
                "completion" if "completion" in row else answer_field)), str):
            try:  # the prompt exactly as the env's data-set task sends it, so supervised and RL runs see the same context
                prompt = textdata.render_prompt(row[prompt_field], options.get("system_prompt"),
                                                options.get("template"))
            except ValueError as exc:
                raise DatasetError(f"{where}: {exc}") from None
            context = codec.prompt_ids(prompt)
            response = codec.response_ids(row[completion_field])
            ids, mask = context + response, [0] * len(context) + [1] * len(response)
        else:
            raise DatasetError(f"{where}: needs a {prompt_field!r} prompt and a 'completion' (or {answer_field!r}) "
                               f"string, or 'messages' (a chat list with assistant turns); it has "
                               f"{sorted(row)[:10]}. Fix: rename the fields, or set env.options.prompt_field / "
                               f"answer_field")
        if len(ids) > lm.max_positions:
            raise DatasetError(f"{where}: {len(ids)} tokens exceeds policy.lm.max_positions={lm.max_positions}. "
                               f"Fix: raise policy.lm.max_positions (up to the model's context) or shorten the row")
        seqs.append(ids)
        masks.append(mask)
    longest = max(len(s) for s in seqs)
    tokens = np.full((len(seqs), longest), codec.pad_id, dtype=np.int64)
    loss_mask = np.zeros((len(seqs), longest), dtype=np.uint8)
    for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        tokens[i, :len(s)] = s
        loss_mask[i, :len(m)] = m
    return TensorBatch({"tokens": tokens, "lengths": np.array([len(s) for s in seqs], dtype=np.int64),
                        "loss_mask": loss_mask}, version=0, dims=("sample",))


def chunks(batch: TensorBatch, rows: int = CHUNK_ROWS) -> list[TensorBatch]:
    """The data set cut into batches of at most ``rows`` rows (each a separate stored batch)."""
    total = batch.rows
    return [TensorBatch({k: v[a:a + rows] for k, v in batch.tensors.items()}, version=batch.version,
                        dims=batch.dims, meta={"dataset_rows": total}) for a in range(0, total, rows)]


def save_dataset(path: str | Path, batch: TensorBatch) -> Path:
    """Write a ("sample",) batch of dense fields as an .npz data set."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: np.asarray(v) for k, v in batch.tensors.items()})
    return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")
