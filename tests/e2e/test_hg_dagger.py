"""HG-DAgger through the robot gateway: PPO's services, a real gateway process (sim driver, 100 Hz), and the
scripted expert as a teleop client that takes over whenever the policy's commands stop making progress toward the
goal. The steps the expert commanded reach replay's interventions source, the learner clones them, and the policy
comes to reach the goal on its own: success without intervention rises from none to most episodes, and the
expert steps in far less. The intervention metrics are columns of metrics.csv."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.robot_gateway.drivers.sim import SimArm  # noqa: E402
from rlfabric.services.robot_gateway.teleop import run_expert  # noqa: E402
from tests.robot_support import gateway_process  # noqa: E402

pytestmark = pytest.mark.serial  # a teleoperated arm at 100 Hz: never beside another test

TOKEN = "hg-dagger-e2e-test-token"
GOAL, START = np.array([0.35, 0.15, 0.25]), np.array([0.0, -0.3, 0.6])


@pytest.mark.slow
# The gateway steps in real time (100 Hz) while the policy's env steps run at the host's pace, so what the expert's
# labels teach depends on the machine's speed: one fresh-clone CI run of two fell to 0.24 success alone (0.63-0.85
# in the others; the same tree passed alone at once). One rerun; two failures in a row still fail.
@pytest.mark.flaky(reruns=1)
def test_hg_dagger_raises_success_without_intervention_through_the_gateway(tmp_path):
    with gateway_process(tmp_path / "gw", TOKEN) as gateway:
        auth.configure(TOKEN)
        stop = threading.Event()
        experts: dict = {}
        expert = threading.Thread(target=lambda: experts.update(run_expert(
            gateway, GOAL, START, SimArm().forward_kinematics, stop, start_tolerance=0.2)), daemon=True)
        expert.start()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "rlfabric.services.cli", "train", "examples/robot_reach_hg_dagger.yaml", "--run-dir",
                 str(tmp_path / "run"), "--quiet", "--set", f"env.options.gateway={gateway}", "--set",
                 "env.num_envs=4", "--set", "train.total_env_steps=4800",
                 "--set", "train.eval_episodes=2"],  # (the run's last evaluation: 10 real-time episodes took 13 s)
                env={**os.environ, "RLFABRIC_TOKEN": TOKEN}, capture_output=True, text=True, timeout=600,
                stdin=subprocess.DEVNULL)
        finally:
            stop.set()
            expert.join(timeout=15)
            auth.configure("")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    alone = [float(r["success_without_intervention_rate"]) for r in rows]
    helped = [float(r["intervened_episode_rate"]) for r in rows]
    steps = [float(r["intervened_steps"]) for r in rows]
    assert sum(e.takeovers for e in experts.values()) > 0
    assert alone[0] <= 0.25 and helped[0] >= 0.75, (alone, helped)  # at first the expert does the reaching
    # over the second half, most episodes succeed with no human: 0.63 (a fresh-clone CI run), 0.71, 0.84, 0.85 (per
    # iteration it swings with the real-time expert's takeovers, 0.5 to 1.0). Before the expert moved at the
    # policy's pace its labels were clipped bang-bang moves and this went 0.28 to 0.45
    half = len(rows) // 2
    assert np.mean(alone[half:]) >= 0.45, alone
    # ... and the expert steps in far less: a second half of 0.16x to 0.29x the first iteration's steps
    assert np.mean(steps[half:]) < 0.5 * steps[0], steps
