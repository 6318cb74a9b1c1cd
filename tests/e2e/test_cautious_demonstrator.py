"""RL beyond a cautious demonstrator, for both VLA families: each example's whole recipe (a grounded, frozen image
encoder, 800 demonstrations of ArmReach's scripted expert at a quarter of the arm's speed, env.kwargs.expert_speed
0.25, then vla_sft, then 64k env steps of PPO) on seed 0. The expert's imitation runs out of time in most scenes;
RL from there learns to move faster than its demonstrator, and success on the same 320 held-out scenes rises.

pi0 explores with Flow-SDE's Gaussian noise on its last denoising step, here with a standard deviation of 0.75 in
[-1, 1] units (policy.pi0.flow_noise; at the example's 0.5 it gained +0.18 to +0.25 on seeds 0-2, at 0.75 +0.25 to
+0.29). vla_tokens (16 bins, parallel decoding) explores the bins its imitation left probable: its supervised stage
targets a Gaussian three bins wide around each demonstrated action (policy.vla_tokens.imitation_sigma); from
one-hot targets it did not learn, and at two bins wide it gained +0.14 to +0.31 depending on the seed.

The whole recipe repeats exactly on one machine and set of packages: the RL stage always did, and since b8aa752 the
vision stage draws its encoder from the run's seed. On CI's packages seed 0 goes, every run, from 39 to 132 scenes
for pi0 (+0.291) and from 37 to 114 for vla_tokens (+0.241); both gates are the issue's +0.2 (64 of 320 scenes).
pi0's seeds 1-2 gained +0.28 and +0.25, vla_tokens' seeds 1-3 +0.34, +0.25 and +0.34 (docs/benchmarks.md, "Wider
exploration beyond a cautious demonstrator"). Of the 64-episode evaluations, which nothing here reads, only the
final one runs (deterministic, on eval envs of their own: the run's trajectory does not depend on them). The vision
and demonstration stages are the same bytes for both families and are built once (tests/vla_warm_stages.py)."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers.models.pi0")
pytest.importorskip("mujoco")

RECIPES = {  # the example; the overrides for a cautious demonstrator; the gates: held-out scenes gained and the
    # rise of the rollouts' success (first quarter -> last), each below seed 0's repeatable run
    "pi0": ("examples/arm_reach_pi0.yaml",
            ["env.kwargs.expert_speed=0.25", "train.total_env_steps=64000", "policy.pi0.flow_noise=0.75"], 64, 0.1),
    "vla_tokens": ("examples/arm_reach_vla_tokens.yaml", [], 64, 0.05),
}


def rows(path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path)))


def shared_stages(config, spec: str, sets: list[str], order: tuple[str, str], stage: Path) -> None:
    """The recipe's vision and demos stages, which both families share (tests/vla_warm_stages.py), copied into the
    run's ``warm_start`` directory, where ``rlfabric train`` keeps them. Each family asks for them in its own
    ``order``: side by side, one builds the encoder while the other records the demonstrations."""
    from tests.artefacts import cached
    from tests.vla_warm_stages import inputs

    def build(name: str):
        def run(out: Path) -> None:
            proc = subprocess.run([sys.executable, "-m", "tests.vla_warm_stages", name, spec, str(out), *sets],
                                  capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
            assert proc.returncode == 0, proc.stderr[-3000:]
        return run

    stage.mkdir(parents=True)
    for name in order:
        built = cached(config, f"vla-{name}", inputs(name, spec, sets[1::2]), build(name))
        if name == "vision":
            shutil.copytree(built / "vision", stage / "vision")
        else:
            shutil.copy2(built / "demos.npz", stage / "demos.npz")


def rl_raises_a_vla_over_its_imitation(request, tmp_path, family: str, order: tuple[str, str]) -> None:
    """One family's whole recipe through `rlfabric train`, then its gates. Each family's test has a file of its own
    (this one: pi0; test_cautious_demonstrator_tokens.py: vla_tokens), so the slow tier's two workers run them side
    by side."""
    spec, overrides, gate, rise = RECIPES[family]
    run_dir = tmp_path / "run"
    # one 64-episode evaluation, the final one, which nothing here reads (the held-out 320 are the score)
    sets = [arg for kv in [*overrides, "train.eval_every_iterations=1000"] for arg in ("--set", kv)]
    shared_stages(request.config, spec, sets, order, run_dir / "warm_start")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", spec, "--run-dir", str(run_dir), "--quiet", *sets],
        capture_output=True, text=True, timeout=2300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sft, rl = rows(run_dir / "warm_start" / "supervised" / "metrics.csv"), rows(run_dir / "metrics.csv")
    held_out = [r[-1] for r in (sft, rl)]
    assert all(r["held_out_episodes"] == "320" for r in held_out)
    wins = [round(float(r["held_out_success_rate"]) * 320) for r in held_out]
    assert wins[1] - wins[0] >= gate, wins  # on the paired scenes
    train = [float(r["train_success_rate"]) for r in rl if r.get("train_success_rate")]
    quarter = len(train) // 4
    assert np.mean(train[-quarter:]) >= np.mean(train[:quarter]) + rise, train


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 12-15 minutes on CI's 2 cores alone, up to twice that beside the other family's run
@pytest.mark.parametrize("family", ["pi0"])
def test_rl_raises_a_vla_over_its_imitation_of_a_cautious_demonstrator(request, tmp_path, family):
    rl_raises_a_vla_over_its_imitation(request, tmp_path, family, ("vision", "demos"))
