"""LeRobot data sets on disk as demonstrations for a run's env (``rlfabric import-lerobot``, ``warm_start.dataset``).

A LeRobot data set (format v3.0, what LeRobot >= 0.4 writes: ``meta/info.json``, ``meta/episodes/*.parquet``,
``meta/tasks.parquet``, frames in ``data/*.parquet``, cameras as AV1/H.264 videos holding many episodes each; or
v2.x, as LeRobot 0.1-0.3 wrote and most published sets are: ``meta/episodes.jsonl``, ``meta/tasks.jsonl``, one
parquet file and one video per episode) becomes
the ``.npz`` transitions ``rlfabric collect --expert`` writes, in the env's own observation format, so a supervised
stage trains on it exactly as on our demonstrations:

    obs/<camera>       the camera's frame (decoded with PyAV at the frame's timestamp, or a PNG in the parquet
                       files when the data set keeps images there; resized to the env's size)
    obs/<state>        a state feature, reshaped to the env's entry
    obs/instruction    the frame's task, encoded by the env itself (its ``encode_instruction``)
    actions            [N, H, A]: the frame's action and the next H-1 (H = env.action_chunk); a frame without H
                       actions left in its episode starts no chunk (padding would teach moves nobody made)
    rewards            ``next.reward`` summed over the chunk (0 without it); ``terminated``: ``next.done`` at its end

Which feature feeds which env entry: ``keys`` ({env key: feature}) where given; else ``observation.images.<key>`` /
``observation.<key>``, else the only camera to the only camera and ``observation.state`` to the only state entry.
Parquet is read through ``datasets`` (as text data sets are); nothing is downloaded and nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.env.adapters.gymnasium import bounds

CONVERT = ("LeRobot 0.3.x's python -m lerobot.datasets.v2.convert_dataset_v1_to_v2, where that lerobot imports "
           "(v1.x to v2.0)")
MAX_FILE_BYTES = 8 << 30


class LeRobotDataError(ValueError):
    """A data set that cannot become this env's demonstrations; the message names the file or feature and the fix."""


def read_info(root: Path) -> dict[str, Any]:
    path = root / "meta" / "info.json"
    if not path.is_file():
        raise LeRobotDataError(f"{root}: no meta/info.json, so not a LeRobot data set. Fix: the directory LeRobot "
                               f"wrote (LeRobotDataset.create/finalize or a downloaded snapshot), which holds meta/, "
                               f"data/ and videos/")
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LeRobotDataError(f"{path}: not readable JSON ({exc})") from None
    version = str(info.get("codebase_version", ""))
    if not version.startswith(("v2.", "v3.")):
        raise LeRobotDataError(f"{root}: LeRobot format {version or '(none)'}; this reads v2.x and v3.x. Fix: "
                               f"convert it with {CONVERT}")
    for field in ("fps", "features", "data_path") + (("chunks_size",) if version.startswith("v2.") else ()):
        if field not in info:
            raise LeRobotDataError(f"{path}: no {field!r}; a {version} info.json has fps, features and data_path")
    return info


def _parquet(files: list[Path], columns: list[str] | None = None):
    """Rows of parquet files through ``datasets``, in memory, as numpy."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    for f in files:
        if not f.is_file():
            raise LeRobotDataError(f"{f}: missing. Fix: the data set is incomplete; copy it whole")
        if f.stat().st_size > MAX_FILE_BYTES:
            raise LeRobotDataError(f"{f}: {f.stat().st_size} bytes exceeds the {MAX_FILE_BYTES}-byte bound of a file")
    try:
        data = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                                     keep_in_memory=True, columns=columns)
    except Exception as exc:  # noqa: BLE001 — the library's many parse errors, named with the files
        raise LeRobotDataError(f"{files[0].parent}: cannot read {[f.name for f in files]} as parquet "
                               f"({exc.__class__.__name__}: {str(exc)[:300]})") from None
    return data


@dataclass
class Episode:
    """Where one episode's frames are: its data file, and per video feature the file and the time it starts at
    (v3.0 puts many episodes in one file of each; v2.x one episode per file, starting at 0)."""

    index: int
    data: Path
    videos: dict[str, tuple[Path, float]]


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """A v2.x metadata file (meta/episodes.jsonl, meta/tasks.jsonl): one JSON object per line."""
    if not path.is_file():
        raise LeRobotDataError(f"{path}: missing. Fix: the data set is incomplete; copy it whole")
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except ValueError as exc:
        raise LeRobotDataError(f"{path}: not JSON lines ({exc})") from None


def read_episodes(root: Path, info: dict[str, Any]) -> list[Episode]:
    """The data set's episodes in order (v3.0: ``meta/episodes/*.parquet``; v2.x: ``meta/episodes.jsonl``)."""
    video_keys = [f for f, spec in info["features"].items() if spec.get("dtype") == "video"]
    if str(info["codebase_version"]).startswith("v2."):
        out = []
        for r in sorted(_json_lines(root / "meta" / "episodes.jsonl"), key=lambda r: r["episode_index"]):
            e, chunk = int(r["episode_index"]), int(r["episode_index"]) // int(info["chunks_size"])
            out.append(Episode(e, root / info["data_path"].format(episode_chunk=chunk, episode_index=e), {
                f: (root / info["video_path"].format(episode_chunk=chunk, video_key=f, episode_index=e), 0.0)
                for f in video_keys}))
        return out
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise LeRobotDataError(f"{root}: no meta/episodes/chunk-*/file-*.parquet. Fix: a data set LeRobot finalized "
                               f"(LeRobotDataset.finalize() writes the episodes' metadata)")
    data = _parquet(files)
    data = data.select_columns([c for c in data.column_names if not c.startswith("stats/")])
    return [Episode(int(r["episode_index"]),
                    root / info["data_path"].format(chunk_index=r["data/chunk_index"],
                                                    file_index=r["data/file_index"]),
                    {f: (root / info["video_path"].format(video_key=f, chunk_index=r[f"videos/{f}/chunk_index"],
                                                          file_index=r[f"videos/{f}/file_index"]),
                         float(r[f"videos/{f}/from_timestamp"])) for f in video_keys})
            for r in sorted(data.to_list(), key=lambda r: r["episode_index"])]


def read_tasks(root: Path, info: dict[str, Any]) -> dict[int, str]:
    """task_index -> the task's text (v3.0: meta/tasks.parquet, the text as its pandas index; v2.x:
    meta/tasks.jsonl)."""
    if str(info["codebase_version"]).startswith("v2."):
        path = root / "meta" / "tasks.jsonl"
        try:
            return {int(r["task_index"]): str(r["task"]) for r in _json_lines(path)}
        except (ValueError, KeyError) as exc:
            raise LeRobotDataError(f"{path}: each line needs task_index and task ({exc})") from None
    import pandas as pd

    path = root / "meta" / "tasks.parquet"
    if not path.is_file():
        raise LeRobotDataError(f"{path}: missing. Fix: the data set is incomplete; copy it whole")
    tasks = pd.read_parquet(path)
    if "task_index" not in tasks.columns:
        raise LeRobotDataError(f"{path}: no task_index column; LeRobot v3.0 writes one per task")
    text = tasks["task"] if "task" in tasks.columns else tasks.index
    return {int(i): str(t) for i, t in zip(tasks["task_index"], text, strict=True)}


def match_keys(obs_spec: dict[str, Any], features: dict[str, Any], keys: dict[str, str] | None) -> dict[str, str]:
    """{env observation key: feature} for every env entry but the instruction (which comes from the tasks); an env
    whose observation is not a Dict has the one entry ``obs``."""
    spaces = obs_spec["spaces"] if obs_spec["kind"] == "dict" else {"obs": obs_spec}
    keys = dict(keys or {})
    unknown = sorted(set(keys) - set(spaces))
    if unknown:
        raise LeRobotDataError(f"keys {unknown} are not observation entries of the env (it has {sorted(spaces)}). "
                               f"Fix: map env entries: <env key>=<LeRobot feature>")
    cameras = sorted(k for k, s in spaces.items() if s["dtype"] == "uint8" and len(s["shape"]) == 3)
    states = sorted(k for k in spaces if k not in cameras and k != "instruction")
    videos = sorted(f for f, s in features.items() if s.get("dtype") in ("video", "image"))
    vectors = sorted(f for f, s in features.items() if f.startswith("observation.") and f not in videos)
    out: dict[str, str] = {}
    for k in cameras + states:
        if k in keys:
            out[k] = keys[k]
            continue
        guesses = [f"observation.images.{k}", f"observation.{k}"] if k in cameras else [f"observation.{k}"]
        found = next((g for g in guesses if g in features), None)
        if found is None and k in cameras and len(cameras) == 1 and len(videos) == 1:
            found = videos[0]
        if found is None and k in states and len(states) == 1 and "observation.state" in features:
            found = "observation.state"
        if found is None:
            have = videos if k in cameras else vectors
            raise LeRobotDataError(f"the env's observation {k!r} matches no feature of the data set (it has {have}). "
                                   f"Fix: name it: --key {k}=<feature> (warm_start.dataset_keys: {{{k}: <feature>}})")
        out[k] = found
    for k, f in out.items():
        if f not in features:
            raise LeRobotDataError(f"keys: {k}={f}: the data set has no feature {f!r} (it has {sorted(features)})")
        want, have = spaces[k]["shape"], list(features[f]["shape"])
        if k in cameras:
            if features[f].get("dtype") not in ("video", "image"):
                raise LeRobotDataError(f"keys: {k}={f}: {k!r} is a camera and {f!r} is {features[f].get('dtype')}, "
                                       f"not a video or image feature")
        elif int(np.prod(want)) != int(np.prod(have)):
            raise LeRobotDataError(f"keys: {k}={f}: the env's {k!r} holds {want} values and {f!r} {have}. Fix: map "
                                   f"a feature of the same size")
    return out


def fit_image(image: Any, size: tuple[int, int]) -> Any:
    """A PIL image at the env's (height, width), resized bilinearly when it differs."""
    from PIL import Image

    return image if image.size == (size[1], size[0]) else image.resize((size[1], size[0]), Image.BILINEAR)


def decode_frames(path: Path, wanted: dict[int, list[int]], fps: float, size: tuple[int, int],
                  out: np.ndarray) -> None:
    """Frames of one video file into ``out`` rows: ``wanted`` maps a frame number (time x fps, rounded) to the rows
    that take it. The file is decoded once, in order (a seek per frame would decode from the keyframe each time)."""
    import av

    if not path.is_file():
        raise LeRobotDataError(f"{path}: missing. Fix: the data set is incomplete; copy it whole (videos/ too)")
    found: set[int] = set()
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                if frame.time is None:
                    continue
                n = round(frame.time * fps)
                if n not in wanted:
                    continue
                out[wanted[n]] = np.asarray(fit_image(frame.to_image(), size), dtype=np.uint8)  # RGB
                found.add(n)
    except av.error.FFmpegError as exc:
        raise LeRobotDataError(f"{path}: cannot decode ({exc}). Fix: re-encode it, or check the file is "
                               f"whole") from None
    missing = sorted(set(wanted) - found)
    if missing:
        raise LeRobotDataError(f"{path}: no frame at {len(missing)} of the timestamps the episodes name (first: "
                               f"{missing[0] / fps:.3f} s). Fix: the video does not match meta/episodes; re-export "
                               f"the data set")


def import_dataset(root: str | Path, obs_spec: dict[str, Any], act_spec: dict[str, Any], encode: Any,
                   keys: dict[str, str] | None = None, max_episodes: int = 0, max_rows: int = 1 << 24,
                   progress: Any = None) -> tuple[TensorBatch, dict[str, Any]]:
    """The data set's episodes as this env's transitions (see the module's docstring) and a summary. ``encode``:
    the env's instruction encoder (text -> its ``instruction`` entry); None serves an env that takes no words.
    ``progress(what, done, total)`` is told as videos decode."""
    root = Path(root)
    info = read_info(root)
    features, fps = info["features"], float(info["fps"])
    spaces = obs_spec["spaces"] if obs_spec["kind"] == "dict" else {"obs": obs_spec}
    name = (lambda k: f"obs/{k}") if obs_spec["kind"] == "dict" else (lambda k: "obs")  # as collect names them
    mapping = match_keys(obs_spec, features, keys)
    if act_spec.get("kind") != "box":
        raise LeRobotDataError(f"the env's actions are {act_spec.get('kind')}; a LeRobot data set's are vectors of "
                               f"numbers. Fix: an env with continuous (Box) actions")
    if "action" not in features:
        raise LeRobotDataError(f"{root}: no 'action' feature; demonstrations need the actions taken")
    shape = list(act_spec["shape"])
    H, A = (shape[0], int(np.prod(shape[1:]))) if len(shape) >= 2 else (1, int(np.prod(shape)) if shape else 1)
    if int(np.prod(features["action"]["shape"])) != A:
        raise LeRobotDataError(f"{root}: actions of {features['action']['shape']} values, and the env acts with {A} "
                               f"per step. Fix: a data set recorded with this env's action space")
    episodes = read_episodes(root, info)
    if max_episodes:
        episodes = episodes[:max_episodes]
    tasks = read_tasks(root, info)
    files = sorted({e.data for e in episodes})
    vectors = [f for f in mapping.values() if features[f].get("dtype") != "video"]
    extras = [c for c in ("next.reward", "next.done") if c in features]
    data = _parquet(files, ["episode_index", "frame_index", "timestamp", "task_index", "action", *vectors, *extras])
    raw, data = data, data.with_format("numpy")  # raw: images stored in the parquet files decode to PIL
    column = {c: np.asarray(data[c]) for c in data.column_names if features.get(c, {}).get("dtype") != "image"}
    wanted_eps = {e.index for e in episodes}
    by_episode: dict[int, np.ndarray] = {}
    order = np.lexsort((column["frame_index"], column["episode_index"]))
    ep_sorted = column["episode_index"][order]
    for e in wanted_eps:
        lo, hi = np.searchsorted(ep_sorted, e), np.searchsorted(ep_sorted, e, side="right")
        by_episode[e] = order[lo:hi]
    # one decision per frame with H actions left in its episode
    starts: list[tuple[int, int]] = []  # (episode, position in the episode)
    for e in sorted(wanted_eps):
        rows = by_episode[e]
        frames = column["frame_index"][rows]
        if len(rows) == 0:
            raise LeRobotDataError(f"{root}: episode {e} is in meta/episodes and has no frames in data/")
        if not np.array_equal(frames, np.arange(len(rows))):
            raise LeRobotDataError(f"{root}: episode {e}'s frame_index is not 0..{len(rows) - 1} without gaps, so "
                                   f"consecutive rows are not consecutive steps. Fix: re-record or drop the episode")
        starts += [(e, t) for t in range(len(rows) - H + 1)]
    if not starts:
        raise LeRobotDataError(f"{root}: no episode has {H} frames, so no chunk of env.action_chunk={H} actions")
    if len(starts) > max_rows:
        raise LeRobotDataError(f"{root}: {len(starts)} transitions exceed the bound of {max_rows}. Fix: import fewer "
                               f"episodes (--episodes / warm_start.dataset_episodes)")
    N = len(starts)
    first = np.array([by_episode[e][t] for e, t in starts])
    chunk_rows = np.stack([by_episode[e][t:t + H] for e, t in starts])
    action = column["action"].reshape(len(column["action"]), A).astype(np.float32)
    tensors: dict[str, np.ndarray] = {"actions": action[chunk_rows].reshape(N, *shape) if len(shape) >= 2
                                      else action[first].reshape(N, *shape)}
    reward = column["next.reward"].reshape(-1) if "next.reward" in column else np.zeros(len(action))
    tensors["rewards"] = reward[chunk_rows].sum(1).astype(np.float32)
    done = column["next.done"].reshape(-1) if "next.done" in column else np.zeros(len(action))
    tensors["terminated"] = done[chunk_rows[:, -1]].astype(np.float32)
    tensors["truncated"] = np.zeros(N, np.float32)
    tensors["episode"] = np.array([e for e, _ in starts], np.int64)
    for k, f in mapping.items():
        if features[f].get("dtype") in ("video", "image"):
            continue
        tensors[name(k)] = column[f][first].reshape(N, *spaces[k]["shape"]).astype(spaces[k]["dtype"])
    if "instruction" in spaces:
        task_index = column["task_index"].reshape(-1)[first]
        used = sorted(set(task_index.tolist()))
        unknown = [i for i in used if i not in tasks]
        if unknown:
            raise LeRobotDataError(f"{root}: frames name task_index {unknown[:5]}, which the data set's tasks lack")
        if encode is None:
            raise LeRobotDataError("the env observes an instruction and no encoder came with it. Fix: pass the env's "
                                   "encode_instruction (import_for_run does)")
        codes = {i: np.asarray(encode(tasks[i])) for i in used}  # the tasks these episodes do
        tensors["obs/instruction"] = np.stack([codes[int(i)] for i in task_index]).astype(
            spaces["instruction"]["dtype"])
    timestamp = column["timestamp"].reshape(-1)
    episode_meta = {e.index: e for e in episodes}
    for k, f in mapping.items():
        kind = features[f].get("dtype")
        if kind not in ("video", "image"):
            continue
        size = tuple(spaces[k]["shape"][:2])
        out = np.zeros((N, *spaces[k]["shape"]), np.uint8)
        if kind == "image":  # PNGs inside the parquet files (LeRobot's use_videos=False), decoded by datasets
            for row, image in enumerate(raw.select(first.tolist())[f]):
                out[row] = np.asarray(fit_image(image.convert("RGB"), size), dtype=np.uint8)
            tensors[name(k)] = out
            continue
        per_file: dict[Path, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for row, ((e, _), r) in enumerate(zip(starts, first, strict=True)):
            path, start = episode_meta[e].videos[f]
            per_file[path][round((start + float(timestamp[r])) * fps)].append(row)
        for i, (path, wanted) in enumerate(sorted(per_file.items())):
            decode_frames(path, wanted, fps, size, out)
            if progress is not None:
                progress(f"{f}", i + 1, len(per_file))
        tensors[name(k)] = out
    actions = tensors["actions"]
    low = np.asarray(bounds(act_spec, "low"), np.float64).reshape(actions.shape[1:])
    high = np.asarray(bounds(act_spec, "high"), np.float64).reshape(actions.shape[1:])
    summary = {"episodes": len(wanted_eps), "frames": int(sum(len(by_episode[e]) for e in wanted_eps)),
               "transitions": N, "keys": mapping, "chunk": H, "tasks": len(tasks),
               "actions_out_of_bounds": float(((actions < low) | (actions > high)).mean())}
    return TensorBatch(tensors, version=0, dims=("sample",)), summary


def import_for_run(root: str | Path, config: Any, keys: dict[str, str] | None = None, max_episodes: int = 0,
                   progress: Any = None) -> tuple[TensorBatch, dict[str, Any]]:
    """import_dataset into the env of run config ``config`` (its eval pool, built here, says the format)."""
    from rlfabric.services.env.local import LocalEnvChannel

    channel = LocalEnvChannel(config)
    try:
        pool = channel.pools["eval"]
        vector = pool.envs[0]
        cache: dict[str, np.ndarray] = {}

        def encode(text: str) -> np.ndarray:
            if text not in cache:
                try:
                    cache[text] = np.asarray(vector.call("encode_instruction", text)[0])
                except AttributeError:
                    raise LeRobotDataError(f"env {pool.env_id!r} observes an instruction and has no "
                                           f"encode_instruction(text) to turn a task into it. Fix: give the env one "
                                           f"(rlfabric's sims and sim adapters have it)") from None
                except ValueError as exc:
                    raise LeRobotDataError(f"{root}: task {text!r}: {exc}") from None
            return cache[text]

        return import_dataset(root, pool.obs_spec, pool.act_spec, encode, keys, max_episodes,
                              config.replay.capacity_transitions, progress)
    finally:
        channel.close()
