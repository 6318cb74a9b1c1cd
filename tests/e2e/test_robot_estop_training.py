"""Training never clears an operator's e-stop (issue 39). PPO drives two sim arms through every service and a real
gateway process; a token holder e-stops one arm mid-run. Its episode ends, and the run's next reset of that arm
waits for the operator instead of clearing the latch: the arm stays latched and still (< 1e-3 rad) through it, the
token holder's ClearEStop is refused (PERMISSION_DENIED), the env service logs the wait naming the arm and the fix,
and once the operator clears it the reset walks the arm back and the run goes on to SUCCEEDED."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.core.config import load_config  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import (
    coordinator_pb2,  # noqa: E402
    robot_gateway_pb2_grpc,  # noqa: E402
)
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb  # noqa: E402
from rlfabric.services.core.runtime import GRPC_OPTIONS  # noqa: E402
from tests.robot_support import as_operator, gateway_process  # noqa: E402

pytestmark = pytest.mark.serial  # a live 100 Hz loop with a 0.2 s watchdog: never beside another test


@pytest.mark.slow
def test_an_operator_estop_mid_training_holds_the_arm_until_the_operator_clears_it(private_stack, tmp_path):
    stack, client = private_stack, private_stack.client
    with gateway_process(tmp_path / "gw", stack.token) as gateway:
        cfg = load_config("examples/robot_reach_ppo.yaml", [
            f"env.options.gateway={gateway}", "env.options.hz=100", "env.options.episode_steps=20",
            "env.options.latch_wait_s=25", "env.num_envs=2", "env.eval_envs=1", "scheduling.mode=disaggregated",
            "algorithm.n_steps=40", "algorithm.batch_size=80", "algorithm.n_epochs=2", "train.total_env_steps=800",
            "train.eval_every_iterations=0", "data_plane.timeout_s=30"])
        run = client.submit(cfg)
        channel = auth.sync_channel(gateway, GRPC_OPTIONS)
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
        deadline = time.monotonic() + 90
        while client.status(run.run_id).env_steps < 80:  # a first update is done: training is in its loop
            assert time.monotonic() < deadline, client.status(run.run_id)
            time.sleep(0.05)
        arm = sorted(r.robot_id for r in stub.ListRobots(pb.ListRobotsRequest(), timeout=10).robots)[0]
        ref = pb.RobotRef(robot_id=arm)
        assert stub.EStop(pb.EStopRequest(robot_id=arm, reason="operator stop"), timeout=5).estopped
        with pytest.raises(grpc.RpcError) as err:  # the run's own credential (the deployment's token)
            stub.ClearEStop(ref, timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        env_log = stack.log_dir / "env.log"
        held, positions = time.monotonic() + 60, []
        while f"robot {arm} is e-stopped" not in env_log.read_text():  # the episode ended; its reset waits
            assert time.monotonic() < held, "the run never reported the stopped arm"
            positions.append(np.asarray(stub.GetState(ref, timeout=5).position))
            time.sleep(0.02)
        assert "rlfabric robot clear-estop" in env_log.read_text()
        steps = client.status(run.run_id).env_steps
        for _ in range(100):  # 2 s more of the paused run: still latched, still still
            state = stub.GetState(ref, timeout=5)
            assert state.estopped and state.holding, state
            positions.append(np.asarray(state.position))
            time.sleep(0.02)
        assert np.abs(np.asarray(positions) - positions[0]).max() < 1e-3
        assert client.status(run.run_id).state == coordinator_pb2.RUNNING
        assert client.status(run.run_id).env_steps <= steps + 80  # at most the iteration under way
        assert not stub.ClearEStop(ref, timeout=5, metadata=as_operator()).estopped
        final = client.wait(run.run_id)
        channel.close()
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    assert final.env_steps >= 800
    assert f"robot {arm} was cleared by the operator" in env_log.read_text()
