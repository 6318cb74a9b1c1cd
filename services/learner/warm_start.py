"""A run's warm_start stages that need torch or an env, run by a learner for the coordinator (Learner.WarmStart):
the image encoder's grounding pretraining, the scripted expert's demonstrations, a LeRobot data set's import, and
both sources merged into one data set. The supervised stage is a run of its own, which the coordinator places like
any other (services/coordinator/warm_start.py).

Each stage writes under ``<run dir>/warm_start`` and keeps what a previous attempt finished there, so a run resumed
after a kill, or taken up by a restarted coordinator, does not repeat a stage. A file is written under a temporary
name and renamed, so a stage killed half-way leaves nothing that looks done.
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.paths import DataRoots

log = logging.getLogger(__name__)

STAGES = ("vision", "demos", "dataset", "merge")


@dataclass
class StageResult:
    path: Path  # what the stage wrote, or found done
    summary: str  # one line for the run's log
    kept: bool = False  # done by an earlier attempt


def vision(config: RunConfig, stage_dir: Path) -> StageResult:
    """warm_start.vision: the policy's image encoder learns to read the env's scene_state() off its cameras
    (services/policies/grounding.py), saved as a SigLIP vision model in ``<stage>/vision`` with its metrics.csv."""
    from rlfabric.services.env.adapters import adapter
    from rlfabric.services.policies import grounding

    out = stage_dir / "vision"
    if (out / "config.json").is_file():
        return StageResult(out, f"image encoder kept from an earlier attempt: {out}", kept=True)
    stage = config.warm_start.vision
    section = getattr(config.policy, config.policy_name)
    envs = adapter(config.env.adapter).make_vector_env(config.env, 1)
    try:
        images, states = grounding.scenes(envs, stage.scenes, config.warm_start.demos_seed)
    finally:
        envs.close()
    model = grounding.encoder(section, getattr(section, "image_size", 0) or images.shape[2], config.seed)
    every = max(1, stage.updates // 10)
    rows = grounding.pretrain(model, images, states, stage.updates, stage.batch_size, stage.learning_rate,
                              config.seed, progress=lambda step, rmse: step % every == 0 and log.info(
                                  "warm start: image encoder", extra={"step": step, "heldout_rmse": rmse}))
    partial = out.with_name("vision.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    with (partial / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return StageResult(out, f"image encoder's held-out error (root mean square, scene_state units) "
                            f"{rows[0]['heldout_rmse']:.3f} -> {rows[-1]['heldout_rmse']:.3f} after {stage.updates} "
                            f"updates on {stage.scenes} scenes -> {out}")


def demos(config: RunConfig, stage_dir: Path) -> StageResult:
    """warm_start.demos: the env's scripted expert plays ``warm_start.demos`` episodes (obs and actions) into
    ``<stage>/demos.npz``, from seed ``warm_start.demos_seed`` (scenes no evaluation replays)."""
    from rlfabric.services.replay.datasets import save_dataset
    from rlfabric.services.rollout.evaluate import collect_dataset

    out = stage_dir / "demos.npz"
    if out.is_file():
        return StageResult(out, f"expert demonstrations kept from an earlier attempt: {out}", kept=True)
    warm = config.warm_start
    batch, returns = collect_dataset(config, warm.demos, warm.demos_seed, expert=True)
    # the supervised stage reads obs and actions: next_obs would double every sample replay sends it
    _save(save_dataset, out, TensorBatch({k: v for k, v in batch.tensors.items() if not k.startswith("next_obs")},
                                         version=0, dims=("sample",)))
    return StageResult(out, f"{len(returns)} expert episodes (mean return {sum(returns) / len(returns):.2f}), "
                            f"{batch.rows} transitions -> {out}")


def dataset(config: RunConfig, stage_dir: Path, roots: DataRoots) -> StageResult:
    """warm_start.dataset: a LeRobot data set (under this learner's data roots) as the env's demonstrations, in
    ``<stage>/lerobot.npz``."""
    from rlfabric.services.env.lerobot_data import import_for_run
    from rlfabric.services.replay.datasets import save_dataset

    out = stage_dir / "lerobot.npz"
    if out.is_file():
        return StageResult(out, f"LeRobot episodes kept from an earlier attempt: {out}", kept=True)
    warm = config.warm_start
    root = roots.confine(warm.dataset, "warm_start.dataset")
    batch, summary = import_for_run(root, config, warm.dataset_keys, warm.dataset_episodes)
    _save(save_dataset, out, batch)
    outside = summary["actions_out_of_bounds"]
    return StageResult(out, f"{summary['episodes']} LeRobot episodes ({summary['frames']} frames, {summary['tasks']} "
                            f"tasks) -> {summary['transitions']} chunks of {summary['chunk']} -> {out}; features: "
                            f"{summary['keys']}" + (f"; {outside:.1%} of action values lie outside the env's bounds"
                                                    if outside else ""))


def merge(config: RunConfig, stage_dir: Path) -> StageResult:
    """Both sources as one data set, ``<stage>/demonstrations.npz``: the imported episodes numbered after the
    expert's."""
    from rlfabric.services.replay.datasets import load_dataset, save_dataset
    from rlfabric.services.rollout.evaluate import merge_datasets

    out = stage_dir / "demonstrations.npz"
    if out.is_file():
        return StageResult(out, f"merged demonstrations kept from an earlier attempt: {out}", kept=True)
    parts = [load_dataset(stage_dir / name, max_rows=1 << 40) for name in ("demos.npz", "lerobot.npz")]
    merged = merge_datasets(parts)
    _save(save_dataset, out, merged)
    return StageResult(out, f"expert and LeRobot demonstrations merged: {merged.rows} rows -> {out}")


def _save(save_dataset, out: Path, batch: TensorBatch) -> None:
    """Written whole or not at all: a stage's output exists only once it is complete."""
    partial = out.with_name(out.stem + ".partial.npz")
    save_dataset(partial, batch)
    os.replace(partial, out)


def run_stage(stage: str, config: RunConfig, run_dir: Path, roots: DataRoots) -> StageResult:
    """Stage ``stage`` of ``config``'s warm start, in ``run_dir/warm_start`` (a ValueError says what is wrong)."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not a warm_start stage a learner runs; one of {STAGES}")
    warm = config.warm_start
    asked = {"vision": warm.vision.scenes > 0, "demos": warm.demos > 0 and bool(warm.supervised),
             "dataset": bool(warm.dataset and warm.supervised), "merge": bool(warm.demos and warm.dataset)}
    if not asked[stage]:
        raise ValueError(f"the run's spec asks for no warm_start.{stage} stage. Fix: set warm_start.{stage} (with "
                         f"warm_start.supervised for demonstrations), or do not call it")
    if stage == "vision" and not hasattr(getattr(config.policy, config.policy_name, None), "vlm_path"):
        raise ValueError(f"warm_start.vision pretrains the image encoder a VLM policy starts from, and "
                         f"policy.name={config.policy_name} has none")
    stage_dir = run_dir / "warm_start"
    stage_dir.mkdir(parents=True, exist_ok=True)
    if stage == "dataset":
        return dataset(config, stage_dir, roots)
    return {"vision": vision, "demos": demos, "merge": merge}[stage](config, stage_dir)
