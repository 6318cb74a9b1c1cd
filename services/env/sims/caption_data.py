"""A generated image-caption data set for supervised VLM training: ArmReachLang frames (a red and a blue ball placed at random
around the arm, top-down camera) captioned with where each ball is.

    python -m rlfabric.services.env.sims.caption_data data/captions --frames 800 --heldout 200

writes ``frames/NNNNN.png``, ``train.jsonl`` and ``heldout.jsonl`` (different scenes), one row per frame:
``{"images": ["frames/00007.png"], "prompt": "where are the balls", "completion": "red top left, blue bottom right"}``.
Each ball's words are the half of the image it lies in, vertically then horizontally (the camera looks down the z
axis with +x to the right and +y up), so a caption follows from the pixels alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PROMPT = "where are the balls"
COLORS = ("red", "blue")


def caption(positions: list[np.ndarray], colors: tuple[str, ...] = COLORS) -> str:
    return ", ".join(f"{c} {'top' if p[1] > 0 else 'bottom'} {'left' if p[0] < 0 else 'right'}"
                     for c, p in zip(colors, positions, strict=True))


def write(out: str | Path, frames: int, heldout: int, seed: int = 0, image_size: int = 64) -> dict[str, Path]:
    """Render ``frames + heldout`` scenes (seeds ``seed``, ``seed + 1``, ...) and write the two JSONL files."""
    from PIL import Image

    from rlfabric.services.env.sims.arm_reach import ArmReach

    out = Path(out)
    (out / "frames").mkdir(parents=True, exist_ok=True)
    env = ArmReach(colors=COLORS, observation="pixels", image_size=image_size)
    rows = []
    try:
        for k in range(frames + heldout):
            obs, _ = env.reset(seed=seed + k)
            name = f"frames/{seed + k:05d}.png"
            Image.fromarray(obs["image"]).save(out / name)
            positions = [env.data.mocap_pos[m][:2].copy() for m in env.mocap]
            rows.append({"images": [name], "prompt": PROMPT, "completion": caption(positions)})
    finally:
        env.close()
    files = {"train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
    for split, part in (("train", rows[:frames]), ("heldout", rows[frames:])):
        files[split].write_text("".join(json.dumps(r) + "\n" for r in part))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--frames", type=int, default=800, help="training rows")
    parser.add_argument("--heldout", type=int, default=200, help="held-out rows (other scenes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()
    files = write(args.out, args.frames, args.heldout, args.seed, args.image_size)
    print(" ".join(str(p) for p in files.values()))


if __name__ == "__main__":
    main()
