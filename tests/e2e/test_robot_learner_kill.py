"""Real-world RL must fail safe: SIGKILL of the learner while the arms are mid-episode (PPO through every service,
the robot env driving arms on a real gateway process) leaves every arm in safe hold. The gateway's watchdog holds
each arm within its window plus one tick of the last policy command; the test watches every tick of every arm
through a Teleop stream that never takes over."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("mujoco")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.core.config import load_config  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc  # noqa: E402
from rlfabric.services.core.runtime import GRPC_OPTIONS  # noqa: E402
from tests.robot_support import ArmWatch, gateway_process  # noqa: E402

pytestmark = pytest.mark.serial  # a watchdog window of 0.1 s: never beside another test

HZ, WATCHDOG = 100, 0.1


@pytest.mark.slow
def test_sigkill_of_the_learner_mid_episode_puts_every_arm_in_safe_hold(private_stack, tmp_path):
    stack, client = private_stack, private_stack.client
    with gateway_process(tmp_path / "gw", stack.token) as gateway:
        cfg = load_config("examples/robot_reach_ppo.yaml", [
            f"env.options.gateway={gateway}", f"env.options.hz={HZ}", f"env.options.watchdog_s={WATCHDOG}",
            "env.num_envs=2", "env.eval_envs=1", "scheduling.mode=disaggregated", "algorithm.n_steps=60",
            "train.total_env_steps=1000000", "train.eval_every_iterations=0", "data_plane.timeout_s=20"])
        run = client.submit(cfg)
        channel = auth.sync_channel(gateway, GRPC_OPTIONS)
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
        deadline = time.monotonic() + 90
        while client.status(run.run_id).env_steps < 120:  # the first update is done: the learner is in the loop
            assert time.monotonic() < deadline, client.status(run.run_id)
            time.sleep(0.05)
        watch = ArmWatch(stub, pb)
        time.sleep(0.5)
        commanded = watch.commanded()
        assert commanded, "no arm was being commanded by the policy before the kill"
        os.kill(stack.procs["learner"].pid, signal.SIGKILL)
        time.sleep(3.0)
        watch.close()
        channel.close()
        for rid in commanded:
            watch.held_after_last_command(rid, WATCHDOG, 1.0 / HZ)
