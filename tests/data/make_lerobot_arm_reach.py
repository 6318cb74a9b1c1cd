"""Writes tests/data/lerobot_arm_reach: ArmReachLang episodes of the scripted expert as a LeRobot data set, written
by LeRobot's own library (LeRobotDataset.create, add_frame, save_episode, finalize), so the importer's test reads
files LeRobot made, not our idea of its layout. Run it where lerobot imports (lerobot 0.4.x needs torch < 2.11: an
environment of its own, with rlfabric's [embodied] extra), from the repository root:

    python tests/data/make_lerobot_arm_reach.py --episodes 8 --out tests/data/lerobot_arm_reach
    python tests/data/make_lerobot_arm_reach.py --episodes 2 --images --out tests/data/lerobot_arm_reach_images

and with lerobot 0.3.x, which writes the older format v2.1 (one parquet file and one video per episode):

    python tests/data/make_lerobot_arm_reach.py --episodes 3 --out tests/data/lerobot_arm_reach_v21

One frame per env step: the top camera (a video feature; with ``--images`` PNG images inside the parquet files), the proprioception, the move the expert made (one step of
its plan, re-planned every step), the reward, done and success flags, and the instruction as the frame's task.
Episode e is the env reset with seed ``--seed + e``, so a test can replay it.
"""

from __future__ import annotations

import argparse
import inspect
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np

import rlfabric.services.env.sims  # noqa: F401  (registers rlfabric/ArmReachLang-v0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7000)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--out", default="tests/data/lerobot_arm_reach")
    parser.add_argument("--images", action="store_true", help="the camera as images in the parquet files (LeRobot's "
                                                              "use_videos=False) instead of a video")
    args = parser.parse_args()
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    s = args.image_size
    features = {
        "observation.images.top": {"dtype": "image" if args.images else "video", "shape": (s, s, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (8,), "names": [
            "cos_shoulder", "cos_elbow", "sin_shoulder", "sin_elbow", "vel_shoulder", "vel_elbow", "ee_x", "ee_y"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["dx", "dy"]},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
        "next.done": {"dtype": "bool", "shape": (1,), "names": None},
        "next.success": {"dtype": "bool", "shape": (1,), "names": None},
    }
    data = LeRobotDataset.create("rlfabric/arm_reach_lang_expert", fps=20, root=out, features=features,
                                 robot_type="rlfabric_planar_arm", use_videos=not args.images)
    env = gym.make("rlfabric/ArmReachLang-v0", image_size=s)
    task_apart = "task" in inspect.signature(LeRobotDataset.add_frame).parameters
    for e in range(args.episodes):
        obs, info = env.reset(seed=args.seed + e)
        done = False
        while not done:
            move = env.unwrapped.expert_action(1)[0]
            nxt, reward, terminated, truncated, step_info = env.step(move)
            done = terminated or truncated
            frame = {"observation.images.top": obs["image"], "observation.state": obs["proprio"],
                     "action": move.astype(np.float32), "next.reward": np.array([reward], np.float32),
                     "next.done": np.array([done]), "next.success": np.array([step_info["is_success"]])}
            if task_apart:  # lerobot 0.3.x: add_frame(frame, task)
                data.add_frame(frame, task=info["instruction"])
            else:
                data.add_frame({**frame, "task": info["instruction"]})
            obs = nxt
        data.save_episode()
    if hasattr(data, "finalize"):  # v3.0 writes its metadata files at the end; v2.1 wrote them per episode
        data.finalize()
    env.close()
    print(f"{args.episodes} episodes, {data.meta.total_frames} frames -> {out}")


if __name__ == "__main__":
    main()
