"""The robot gateway as an env: the `robot` adapter's vector env drives arms on a real gateway process (sim driver)
through an EnvPool, a scripted reaching policy gets there (success ends the episode, auto-reset walks the arm back),
and a gateway hold (an e-stop mid-episode) ends the episode with its reason."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

pytest.importorskip("mujoco")

from services.core import auth  # noqa: E402
from services.core.config import EnvConfig  # noqa: E402
from services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb  # noqa: E402
from services.env.pool import EnvPool  # noqa: E402
from services.robot_gateway.drivers.sim import SimArm  # noqa: E402
from tests.robot_support import gateway_process  # noqa: E402

TOKEN = "robot-env-test-token"


@pytest.fixture(scope="module")
def gateway_address(tmp_path_factory):
    with gateway_process(tmp_path_factory.mktemp("gw"), TOKEN) as address:
        yield address


def greedy(arm: SimArm, obs: np.ndarray) -> np.ndarray:
    """A scripted reacher: per joint, the direction that brings the hand closer (forward kinematics probes)."""
    actions = np.zeros((len(obs), 3), np.float32)
    for k, o in enumerate(obs):
        q, target = o[:3].astype(float), o[6:9].astype(float)
        base = np.linalg.norm(arm.forward_kinematics(q) - target)
        for j in range(3):
            dq = np.zeros(3)
            dq[j] = 0.02
            gain = base - np.linalg.norm(arm.forward_kinematics(q + dq) - target)
            actions[k, j] = np.clip(gain * 40, -1, 1)
    return actions


def test_a_scripted_policy_reaches_targets_through_the_gateway(gateway_address):
    auth.configure(TOKEN)
    cfg = EnvConfig(adapter="robot", id="reach", num_envs=2,
                    options={"gateway": gateway_address, "hz": 100, "episode_steps": 150})
    pool = EnvPool(cfg, 2)
    arm = SimArm()
    try:
        obs = pool.reset(seed=0)[0]
        assert obs.shape == (2, 12) and pool.act_spec["shape"] == [3]
        first = np.linalg.norm(obs[:, 9:12] - obs[:, 6:9], axis=1)
        successes, returns = 0, []
        for _ in range(300):
            out = pool.step(0, greedy(arm, obs))
            obs = out["obs"]
            successes += int(out["terminated"].sum())
            if "final_obs" in out:
                done = out["terminated"] | out["truncated"]
                final = out["final_obs"][done]
                assert np.allclose(obs[done][:, :3], [0.0, -0.3, 0.6], atol=0.03)  # reset walked back to start
                returns += out["episode_return"][done].tolist()
                assert (np.linalg.norm(final[:, 9:12] - final[:, 6:9], axis=1) < first.max()).all()
            if successes >= 2:
                break
        assert successes >= 2, f"the scripted reacher succeeded {successes} times"
    finally:
        pool.close()


def test_a_gateway_hold_ends_the_episode_with_its_reason(gateway_address):
    from services.env.adapters.robot import RobotVectorEnv

    auth.configure(TOKEN)
    env = RobotVectorEnv(EnvConfig(adapter="robot", id="reach", num_envs=1,
                                   options={"gateway": gateway_address, "hz": 100}), 1)
    try:
        env.reset(seed=1)
        env.stub.EStop(pb.EStopRequest(robot_id=env.ids[0], reason="operator"), timeout=5)
        _, _, terminated, truncated, info = env.step(np.zeros((1, 3), np.float32))
        assert truncated[0] and not terminated[0] and info["hold_reason"][0] == "e-stop"
        state = env.stub.GetState(pb.RobotRef(robot_id=env.ids[0]), timeout=5)
        assert not state.estopped  # the auto-reset cleared it and walked the arm back
    finally:
        env.close()
    from services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
    from services.core.runtime import GRPC_OPTIONS

    with auth.sync_channel(gateway_address, GRPC_OPTIONS) as channel:  # closing the env freed its robots
        with pytest.raises(grpc.RpcError) as err:
            robot_gateway_pb2_grpc.RobotGatewayStub(channel).GetState(pb.RobotRef(robot_id=env.ids[0]), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
