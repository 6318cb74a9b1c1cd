"""Captions adapter: an image-to-text data set (JSONL or Parquet rows that name local image files) as one-step
episodes for a VLM that writes text (``policy.name: vlm``): supervised training from its rows, RL on its reward,
evaluation on a held-out file.

    env: {adapter: captions, id: data/captions/train.jsonl, options: {image_size: 64, max_tokens: 48}}

A row: ``{"images": ["frames/00001.png"], "prompt": "describe the balls", "completion": "red top left, blue bottom
right"}`` (``image`` for one file; paths relative to the data file). Each reset shows one row: its images (resized
to ``image_size``) as uint8 entries ``image`` (``image_1``, ... for more), its prompt as the ``instruction`` entry,
and the text is the action: ``max_tokens`` ids, UTF-8 bytes shifted by one, 0 ending it (services/env/adapters/
instruction.py). The step scores it against the row's completion: reward is the word-level F1, ``is_success`` an
exact match, and the episode ends. A seeded reset starts at row ``seed % rows``, and each sub-env then steps by
the vector env's size, so an evaluation of ``rows`` episodes reads every row once. ``expert_action()`` is the row's
completion (what ``rlfabric collect --expert`` records as demonstrations).

Files are read under the env service's data roots (``--data-root``; RLFABRIC_DATA_ROOT), images too, and every row
is checked before the first reset: a missing image or an over-long text names the row and the fix. Images are
read with Pillow (which matplotlib, a core dependency, brings).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from rlfabric.services.env.adapters.gymnasium import vectorize
from rlfabric.services.env.adapters.instruction import VOCAB_HIGH, decode_instruction, encode_instruction
from rlfabric.services.env.adapters.mujoco_pixels import image_shape

collector = "gym"  # rollout.collector auto: gym stepping (one step per episode)
OPTIONS = ("image_size", "max_tokens", "prompt_tokens", "prompt_field", "completion_field")
MAX_ROWS = 100_000


def check(env_cfg: Any) -> None:
    unknown = sorted(set(env_cfg.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"env.options {unknown} are not captions options. Fix: use only {list(OPTIONS)}")
    image_shape(env_cfg.options)
    for key, default in (("max_tokens", 48), ("prompt_tokens", 32)):
        value = env_cfg.options.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
            raise ValueError(f"env.options.{key}={value!r}: an integer in [1, 1024]")
    if env_cfg.action_chunk != 1:
        raise ValueError("env.action_chunk: a caption is one action (its tokens). Fix: env.action_chunk: 1")
    if Path(env_cfg.id).suffix.lower() not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"env.id={env_cfg.id!r}: the captions adapter reads a JSONL or Parquet data set. Fix: the "
                         f"path of one (rows with images, prompt and completion)")


def word_f1(text: str, reference: str) -> float:
    """Word-level F1 of a text against the reference (SQuAD's answer overlap): partial credit for RL."""
    got, want = text.replace(",", " ").split(), reference.replace(",", " ").split()
    common = sum((Counter(got) & Counter(want)).values())
    if not got or not want or common == 0:
        return float(got == want)
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


class CaptionRows(gym.Env):
    """One row per episode: its images and prompt in, the text out, scored against its completion."""

    metadata = {"render_modes": []}

    def __init__(self, rows: list[dict[str, Any]], images: list[list[np.ndarray]], max_tokens: int,
                 prompt_tokens: int, first: int, stride: int):
        self.rows, self.images, self.max_tokens, self.prompt_tokens = rows, images, max_tokens, prompt_tokens
        self.next_row, self.stride, self.row = first % len(rows), stride, 0
        parts = {("image" if i == 0 else f"image_{i}"): gym.spaces.Box(0, 255, frame.shape, np.uint8)
                 for i, frame in enumerate(images[0])}
        parts["instruction"] = gym.spaces.Box(0, VOCAB_HIGH, (prompt_tokens,), np.int64)
        self.observation_space = gym.spaces.Dict(parts)
        self.action_space = gym.spaces.Box(0, VOCAB_HIGH, (max_tokens,), np.int64)

    def _observe(self) -> dict[str, np.ndarray]:
        obs = {("image" if i == 0 else f"image_{i}"): frame for i, frame in enumerate(self.images[self.row])}
        obs["instruction"] = encode_instruction(self.rows[self.row]["prompt"], self.prompt_tokens)
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:  # the vector env seeds sub-env k with seed + k
            self.next_row = seed % len(self.rows)
        self.row, self.next_row = self.next_row, (self.next_row + self.stride) % len(self.rows)
        return self._observe(), {}

    def step(self, action: np.ndarray):
        text = decode_instruction(_ended(np.asarray(action, np.int64)), errors="replace")
        reference = self.rows[self.row]["completion"]
        success = text == reference
        obs = self._observe()
        return obs, word_f1(text, reference), True, False, {"is_success": success, "text": text}

    def expert_action(self, horizon: int = 1) -> np.ndarray:
        """The row's completion: what a demonstration of this episode writes."""
        return encode_instruction(self.rows[self.row]["completion"], self.max_tokens)


def _ended(ids: np.ndarray) -> np.ndarray:
    """The ids up to the first 0 (the text's end)."""
    stop = np.flatnonzero(ids <= 0)
    return ids[:stop[0]] if len(stop) else ids


def load_rows(env_cfg: Any) -> tuple[list[dict[str, Any]], list[list[np.ndarray]]]:
    """The data set's rows (prompt, completion) and their images, checked row by row."""
    from PIL import Image

    from rlfabric.services.core.paths import PathRefused
    from rlfabric.services.core.textdata import DataFileError, read_rows
    from rlfabric.services.env.tasks.dataset import data_roots

    opts = env_cfg.options
    height, width = image_shape(opts)
    prompt_field, completion_field = opts.get("prompt_field", "prompt"), opts.get("completion_field", "completion")
    roots = data_roots()
    try:
        raw = read_rows(env_cfg.id, "env.id", roots, max_rows=MAX_ROWS)
    except DataFileError as exc:
        raise ValueError(str(exc)) from None
    base = Path(env_cfg.id).parent
    rows, images = [], []
    for i, row in enumerate(raw):
        where = f"env.id={env_cfg.id!r} row {i}"
        files = row.get("images", [row["image"]] if "image" in row else None)
        prompt, completion = row.get(prompt_field), row.get(completion_field)
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise ValueError(f"{where}: needs 'images' (a list of image files) or 'image' (one), relative to the "
                             f"data file")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where}: needs a {prompt_field!r} and a {completion_field!r} string (or set "
                             f"env.options.prompt_field / completion_field)")
        for text, key, limit in ((prompt, "prompt_tokens", opts.get("prompt_tokens", 32)),
                                 (completion, "max_tokens", opts.get("max_tokens", 48) - 1)):
            if len(text.encode()) > limit:
                raise ValueError(f"{where}: {len(text.encode())} bytes of text, more than env.options.{key} allows "
                                 f"({limit}). Fix: raise env.options.{key}")
        frames = []
        for name in files:
            try:
                path = roots.confine(base / name, "env.id")
                with Image.open(path) as img:
                    frames.append(np.asarray(img.convert("RGB").resize((width, height), Image.BILINEAR), np.uint8))
            except PathRefused as exc:
                raise ValueError(f"{where}: {exc}") from None
            except OSError as exc:
                raise ValueError(f"{where}: image {name!r} cannot be read ({exc}). Fix: a PNG or JPEG file beside "
                                 f"the data file") from None
        if images and len(frames) != len(images[0]):
            raise ValueError(f"{where}: {len(frames)} images where row 0 has {len(images[0])}: every row needs the "
                             f"same number")
        rows.append({"prompt": prompt, "completion": completion})
        images.append(frames)
    return rows, images


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    check(env_cfg)
    rows, images = load_rows(env_cfg)
    opts = env_cfg.options
    counter = iter(range(num_envs))

    def make() -> gym.Env:  # sub-env k reads rows k, k + num_envs, ...: together they read each row in turn
        return CaptionRows(rows, images, opts.get("max_tokens", 48), opts.get("prompt_tokens", 32), next(counter),
                           num_envs)

    return vectorize(make, num_envs, vectorization, 1)
