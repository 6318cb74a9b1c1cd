"""Export recorded episodes to LeRobot's dataset format, through LeRobot's own library (``LeRobotDataset.create``,
``add_frame``, ``save_episode``, ``finalize``), so the files are what LeRobot's loaders and policies expect rather
than our reading of its layout.

``lerobot`` is an optional extra: it pins torch and needs torchvision, which the services do not use. This module
imports it only when exporting, and says how to get it when it is missing.

    python -m rlfabric.services.robot_gateway.export --store-root DIR --prefix recordings/demos/ --out OUT --repo-id me/demos

Per tick one frame: ``observation.state`` (joint positions, named by joint), ``observation.velocity``,
``observation.end_effector`` (x, y, z), ``action`` (the target sent after the safety filter), ``intervened``,
``holding``, ``next.reward``, ``next.done``, ``next.success``; the recording's task is the frame's task. LeRobot
times frames as frame_index / fps, so an episode with a gap (ticks the recorder dropped, or the loop skipped after an
overrun) would be played back faster than it happened: such episodes are skipped unless ``--allow-gaps``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlfabric.services.core.objectstore import FilesystemObjectStore, ObjectStore
from rlfabric.services.robot_gateway.recording import read_episodes

log = logging.getLogger(__name__)
INSTALL = ("pip install 'lerobot>=0.4' (an extra: it needs Python >= 3.10, torch < 2.11 and torchvision for "
           "lerobot 0.4.x; install it in its own environment if this one pins another torch)")


class ExportError(ValueError):
    """Episodes that cannot be exported as asked; the message names the field and the fix."""


@dataclass
class ExportSummary:
    root: Path
    episodes: int = 0
    frames: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # why -> episodes


def lerobot_dataset_class():
    """LeRobot's dataset class, or an ImportError that says how to install it."""
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError as exc:
        raise ImportError(f"exporting to LeRobot needs the lerobot package ({exc}). Fix: {INSTALL}") from exc
    return LeRobotDataset


def features(joint_names: list[str]) -> dict:
    """LeRobot feature specs (numpy dtype strings, tuple shapes: its validator compares shapes as tuples)."""
    j = len(joint_names)

    def scalar(dtype: str) -> dict:
        return {"dtype": dtype, "shape": (1,), "names": None}

    return {
        "observation.state": {"dtype": "float32", "shape": (j,), "names": list(joint_names)},
        "observation.velocity": {"dtype": "float32", "shape": (j,), "names": list(joint_names)},
        "observation.end_effector": {"dtype": "float32", "shape": (3,), "names": ["x", "y", "z"]},
        "action": {"dtype": "float32", "shape": (j,), "names": list(joint_names)},
        "intervened": scalar("bool"),
        "holding": scalar("bool"),
        "next.reward": scalar("float32"),
        "next.done": scalar("bool"),
        "next.success": scalar("bool"),
    }


def frames(meta: dict, cols: dict[str, np.ndarray]):
    """The episode's frames as LeRobot's ``add_frame`` takes them."""
    done = cols["terminated"] | cols["truncated"]
    task = meta.get("task") or f"{meta['robot_id']} episode"
    for i in range(len(cols["tick"])):
        yield {
            "observation.state": cols["obs/position"][i].astype(np.float32),
            "observation.velocity": cols["obs/velocity"][i].astype(np.float32),
            "observation.end_effector": cols["obs/end_effector"][i].astype(np.float32),
            "action": cols["actions"][i].astype(np.float32),
            "intervened": np.array([cols["intervened"][i]], dtype=bool),
            "holding": np.array([cols["holding"][i]], dtype=bool),
            "next.reward": np.array([cols["rewards"][i]], dtype=np.float32),
            "next.done": np.array([done[i]], dtype=bool),
            "next.success": np.array([done[i] and meta["outcome"] == "success"], dtype=bool),
            "task": task,
        }


def export_lerobot(store: ObjectStore, prefix: str, out: str | Path, repo_id: str, *,
                   outcomes: tuple[str, ...] = ("success", "failure", "terminate"), allow_gaps: bool = False,
                   robot_type: str | None = None) -> ExportSummary:
    """Write every recorded episode under ``prefix`` whose outcome is in ``outcomes`` (and, unless ``allow_gaps``,
    whose ticks are contiguous) as a new LeRobot data set at ``out``, which must not exist: LeRobot creates it.
    Episodes of different shapes (joints, rate) are refused."""
    LeRobotDataset = lerobot_dataset_class()
    episodes = read_episodes(store, prefix)
    summary = ExportSummary(Path(out))
    chosen = []
    for meta, cols in episodes:
        why = f"outcome {meta['outcome']}" if meta["outcome"] not in outcomes else \
            "gaps in its ticks" if not allow_gaps and (np.diff(cols["tick"]) != 1).any() else ""
        if why:
            summary.skipped[why] = summary.skipped.get(why, 0) + 1
            log.warning("episode not exported", extra={"episode": meta["episode"], "session": meta["session"],
                                                       "why": why})
        else:
            chosen.append((meta, cols))
    if not chosen:
        raise ExportError(f"no recorded episode under prefix {prefix!r} to export (found {len(episodes)}, skipped "
                          f"{summary.skipped}). Fix: check --prefix (recordings/<dataset>/...), --outcomes, "
                          f"--allow-gaps")
    first = chosen[0][0]
    joints, hz = list(first["joint_names"]), float(first["control_hz"])
    fps = round(hz)
    if abs(fps - hz) > 1e-6:
        raise ExportError(f"control_hz={hz} is not a whole number of frames per second, which LeRobot's fps must be. "
                          f"Fix: record at an integer control_hz")
    for meta, _ in chosen:
        if list(meta["joint_names"]) != joints or float(meta["control_hz"]) != hz:
            raise ExportError(f"episode {meta['episode']} of {meta['robot_id']} has joints {meta['joint_names']} at "
                              f"{meta['control_hz']} Hz, the first has {joints} at {hz} Hz: one data set holds one "
                              f"shape. Fix: narrow --prefix to one robot")
    dataset = LeRobotDataset.create(repo_id=repo_id, fps=fps, features=features(joints), root=Path(out),
                                    robot_type=robot_type or first["robot_id"], use_videos=False)
    for meta, cols in chosen:
        for frame in frames(meta, cols):
            dataset.add_frame(frame)
            summary.frames += 1
        dataset.save_episode()
        summary.episodes += 1
    if hasattr(dataset, "finalize"):  # lerobot >= 0.4: closes the parquet writers (their footers)
        dataset.finalize()
    log.info("exported to LeRobot", extra={"root": str(out), "episodes": summary.episodes, "frames": summary.frames})
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfabric export-lerobot",
                                     description="Export recorded robot episodes to a LeRobot data set.")
    parser.add_argument("--store-root", required=True, help="the gateway's filesystem object store "
                                                            "(its --storage-root)")
    parser.add_argument("--prefix", default="recordings/", help="which episodes: recordings/<dataset>/<robot>/...")
    parser.add_argument("--out", required=True, help="the new data set's folder (must not exist)")
    parser.add_argument("--repo-id", required=True, help="LeRobot's repo_id, e.g. me/arm_demos (nothing is uploaded)")
    parser.add_argument("--outcomes", default="success,failure,terminate",
                        help="comma-separated outcomes to export (default: every kept episode)")
    parser.add_argument("--allow-gaps", action="store_true", help="export episodes with dropped or skipped ticks "
                                                                  "too (LeRobot then plays them back faster)")
    args = parser.parse_args(argv)
    outcomes = tuple(o.strip() for o in args.outcomes.split(",") if o.strip())
    if not Path(args.store_root).is_dir():
        parser.exit(2, f"{parser.prog}: error: --store-root {args.store_root} is not a folder. Fix: give the gateway's "
                       f"--storage-root\n")
    if Path(args.out).exists():
        parser.exit(2, f"{parser.prog}: error: --out {args.out} exists; LeRobot creates the folder. Fix: give a new "
                       f"path\n")
    try:
        summary = export_lerobot(FilesystemObjectStore(args.store_root), args.prefix, args.out, args.repo_id,
                                 outcomes=outcomes, allow_gaps=args.allow_gaps)
    except (ImportError, ExportError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {summary.episodes} episodes ({summary.frames} frames) to {summary.root}"
          + (f"; skipped {summary.skipped}" if summary.skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
