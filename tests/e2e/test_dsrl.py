"""DSRL end to end on ArmReach (state observation): the examples' whole recipe on seed 0. The scripted expert's
demonstrations, a deliberately short imitation by the vla policy's flow head (examples/arm_reach_flow_sft.yaml:
about 0.4 success), then SAC in that frozen policy's initial noise (examples/arm_reach_dsrl.yaml). Both are judged
on the same 256 held-out scenes (the DSRL run's final held-out evaluation; the base through rlfabric eval on those
seeds and envs), deterministically; the base's weights must come out of the run unchanged.

Seeds 0/1/2 of DSRL on seed 0's base, 64-scene evaluations at 4096 env steps: 0.86 (at 3584), 0.88, 0.91, from the
base's 0.41 (200 scenes)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys

import pytest

pytest.importorskip("mujoco")
pytestmark = pytest.mark.minutes(1.5)

CLI = [sys.executable, "-m", "rlfabric.services.cli"]
HELD_OUT = 256
ENV_STEPS = 4096


def cli(*args: str) -> str:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_dsrl_raises_a_frozen_flow_policy_by_steering_its_noise(tmp_path):
    import torch

    demos, base_dir, run_dir = tmp_path / "demos.npz", tmp_path / "base", tmp_path / "dsrl"
    cli("collect", "examples/arm_reach_flow_sft.yaml", "--expert", "--episodes", "20", "--out", str(demos))
    cli("train", "examples/arm_reach_flow_sft.yaml", "--run-dir", str(base_dir), "--quiet",
        "--set", f"replay.datasets.offline={demos}")
    base = base_dir / "checkpoints" / "final.pt"
    judged = cli("eval", str(base), "--episodes", str(HELD_OUT), "--seed", "1000000", "--deterministic",
                 "--set", "env.eval_envs=32")  # the DSRL run's held-out scenes: its seed + 1e6, 32 eval envs
    base_success = float(re.search(r"success rate ([0-9.]+)", judged).group(1))
    cli("train", "examples/arm_reach_dsrl.yaml", "--run-dir", str(run_dir), "--quiet",
        "--set", f"algorithm.expert_checkpoint={base}", "--set", f"train.total_env_steps={ENV_STEPS}",
        "--set", "train.stop_at_eval_return=null", "--set", "train.eval_every_iterations=0",
        "--set", f"train.held_out_episodes={HELD_OUT}")
    last = list(csv.DictReader(open(run_dir / "metrics.csv")))[-1]
    assert int(last["held_out_episodes"]) == HELD_OUT, last
    gain = float(last["held_out_success_rate"]) - base_success
    assert 0.1 <= base_success <= 0.7, base_success  # partly trained: room to improve, and some skill to steer
    assert gain >= 0.2, (base_success, last["held_out_success_rate"])

    # the base came out unchanged: its weights in the run's final checkpoint are the checkpoint it was given
    from rlfabric.services.learner.checkpoint import unpack

    given = unpack(base.read_bytes(), str(base))["policy"]
    final = unpack((run_dir / "checkpoints" / "final.pt").read_bytes(), "final")["policy"]
    assert given.keys() == {k.removeprefix("base.") for k in final if k.startswith("base.")}
    assert all(torch.equal(final[f"base.{k}"], v) for k, v in given.items())
