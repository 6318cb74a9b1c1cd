"""The robot gateway as an env: the `robot` adapter's vector env drives arms on a real gateway process (sim driver)
through an EnvPool, a scripted reaching policy gets there (success ends the episode, auto-reset walks the arm back),
and a gateway hold (an e-stop mid-episode) ends the episode with its reason. Action chunks run one move per tick,
and real-time chunking keeps the arm moving while the policy computes the next chunk."""

from __future__ import annotations

import time
from contextlib import closing

import grpc
import numpy as np
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.core.config import EnvConfig  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb  # noqa: E402
from rlfabric.services.env.pool import EnvPool  # noqa: E402
from rlfabric.services.robot_gateway.drivers.sim import SimArm  # noqa: E402
from tests.robot_support import as_operator, gateway_process  # noqa: E402

pytestmark = pytest.mark.serial  # real-time chunking against a 100 Hz arm: never beside another test

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


def test_the_reset_walk_is_marked_so_a_teleop_expert_leaves_it_alone(gateway_address):
    """Every move of the env's walk back to the start pose is a JointCommand marked ``resetting``: the gateway's
    state says so until the policy's first command of the episode (the scripted expert stays out meanwhile:
    tests/unit/test_reach_expert.py). Arms that end an episode together walk back together."""
    from rlfabric.services.env.adapters.robot import RobotVectorEnv

    auth.configure(TOKEN)
    env = RobotVectorEnv(EnvConfig(adapter="robot", id="reach", num_envs=2, options={
        "gateway": gateway_address, "hz": 100, "episode_steps": 3, "action_scale": 0.2}), 2)
    try:
        env.reset(seed=0)
        refs = [pb.RobotRef(robot_id=rid) for rid in env.ids]
        assert all(env.stub.GetState(ref, timeout=5).policy_resetting for ref in refs)
        env.step(np.ones((2, 3)))
        assert not any(env.stub.GetState(ref, timeout=5).policy_resetting for ref in refs)
        env.step(np.ones((2, 3)))
        before = [env.stub.GetState(ref, timeout=5) for ref in refs]
        *_, truncated, info = env.step(np.ones((2, 3)))  # the third step ends both episodes: both walk back
        after = [env.stub.GetState(ref, timeout=5) for ref in refs]
        assert truncated.all() and all(s.policy_resetting for s in after)
        assert np.allclose([s.target for s in after], [[0.0, -0.3, 0.6]] * 2)
        # the ticks from the last step to the end of the reset: 19 with the arms walking together, 54-55 in turn
        walks = [a.seq - b.seq for a, b in zip(after, before, strict=True)]
        assert max(walks) < 35, walks
    finally:
        env.close()


def estopped_env(address: str, latch_wait_s: float):
    """A one-arm robot env, reset, whose arm a token holder has just e-stopped; and the arm's RobotRef."""
    from rlfabric.services.env.adapters.robot import RobotVectorEnv

    auth.configure(TOKEN)
    env = RobotVectorEnv(EnvConfig(adapter="robot", id="reach", num_envs=1,
                                   options={"gateway": address, "hz": 100, "latch_wait_s": latch_wait_s}), 1)
    env.reset(seed=1)
    env.stub.EStop(pb.EStopRequest(robot_id=env.ids[0], reason="operator"), timeout=5)
    return env, pb.RobotRef(robot_id=env.ids[0])


def test_an_estop_ends_the_episode_and_the_reset_never_clears_it(gateway_address):
    """Training never clears an operator's e-stop: the auto-reset waits (env.options.latch_wait_s) with the arm held
    still, then fails naming the arm and the fix; the latch is still there after."""
    env, ref = estopped_env(gateway_address, latch_wait_s=1.5)
    try:
        before = np.asarray(env.stub.GetState(ref, timeout=5).position)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            env.step(np.ones((1, 3), np.float32))  # the episode ends in the hold; its reset waits, then gives up
        assert time.monotonic() - t0 >= 1.5
        assert env.ids[0] in str(err.value) and "rlfabric robot clear-estop" in str(err.value)
        state = env.stub.GetState(ref, timeout=5)
        assert state.estopped and state.holding and state.hold_reason == "e-stop"
        assert np.abs(np.asarray(state.position) - before).max() < 1e-3
    finally:
        env.close()


def test_once_the_operator_clears_the_estop_the_waiting_reset_walks_the_arm_back(gateway_address):
    import threading

    env, ref = estopped_env(gateway_address, latch_wait_s=20)
    try:
        positions = []

        def operator() -> None:  # watches the held arm for a second, then clears it as the operator
            for _ in range(20):
                positions.append(np.asarray(env.stub.GetState(ref, timeout=5).position))
                time.sleep(0.05)
            env.stub.ClearEStop(ref, timeout=5, metadata=as_operator())

        clearing = threading.Thread(target=operator)
        clearing.start()
        _, _, terminated, truncated, info = env.step(np.ones((1, 3), np.float32))
        clearing.join()
        assert truncated[0] and not terminated[0] and info["hold_reason"][0] == "e-stop"
        assert np.abs(np.asarray(positions) - positions[0]).max() < 1e-3  # still while the reset waited
        state = env.stub.GetState(ref, timeout=5)
        assert not state.estopped and np.abs(np.asarray(state.target) - env.start).max() < 1e-6  # walked back
    finally:
        env.close()
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
    from rlfabric.services.core.runtime import GRPC_OPTIONS

    with auth.sync_channel(gateway_address, GRPC_OPTIONS) as channel:  # closing the env freed its robots
        with pytest.raises(grpc.RpcError) as err:
            robot_gateway_pb2_grpc.RobotGatewayStub(channel).GetState(pb.RobotRef(robot_id=env.ids[0]), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def robot_env(address: str, hz: int, horizon: int, **options):
    from rlfabric.services.env.adapters.robot import RobotVectorEnv

    auth.configure(TOKEN)
    cfg = EnvConfig(adapter="robot", id="reach", num_envs=1, action_chunk=horizon,
                    options={"gateway": address, "hz": hz, "target": "0.9,0.9,0.9", **options})
    return RobotVectorEnv(cfg, 1)


def test_a_chunk_runs_one_move_per_tick_and_reports_every_step(gateway_address):
    env = robot_env(gateway_address, hz=50, horizon=4, episode_steps=1000)
    try:
        env.reset(seed=0)
        start = env.commanded[0].copy()
        chunk = np.array([[[0.5, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, -0.5, 0.0], [0.0, 0.0, 0.6]]], np.float32)
        _, reward, terminated, truncated, info = env.step(chunk)
        assert env.single_action_space.shape == (4, 3) and not (terminated[0] or truncated[0])
        assert info["executed"][0] == 4 and info["step_valid"][0].tolist() == [1, 1, 1, 1]
        assert np.isclose(info["step_rewards"][0].sum(), reward[0])
        assert np.allclose(info["executed_action"][0], chunk[0], atol=1e-6)  # every move went through unclipped
        assert np.allclose(env.commanded[0] - start, chunk[0].sum(0) * 0.05, atol=1e-9)
    finally:
        env.close()


def test_realtime_chunking_keeps_the_arm_moving_while_the_policy_computes(gateway_address):
    """A policy that takes 0.12 s per chunk (2.4 ticks at 20 Hz): executed one chunk at a time, the arm waits
    through every inference; with real-time chunking the env hands back the observation early (by the measured
    delay) and the chunk's tail fills the wait, so the arm has a fresh command nearly every tick."""
    idle = {}
    for realtime in (False, True):
        env = robot_env(gateway_address, hz=20, horizon=8, episode_steps=10_000, realtime_chunks=realtime)
        rng = np.random.default_rng(0)
        try:
            env.reset(seed=0)
            per_decision = []
            for _ in range(10):
                time.sleep(0.12)  # the policy's inference
                _, _, _, _, info = env.step(rng.uniform(-0.2, 0.2, (1, 8, 3)).astype(np.float32))
                per_decision.append(int(info["idle_ticks"][0]))
            idle[realtime] = np.mean(per_decision[3:])  # after the delay estimate settled
            if realtime:
                assert 3 <= info["lead_ticks"][0] <= 7, info["lead_ticks"]
        finally:
            env.close()
    assert idle[False] >= 1.5 and idle[True] <= min(1.0, idle[False] / 2), idle  # 2.0 and 0.0 here


def test_an_episode_that_ends_in_a_chunks_tail_ends_the_next_decision_without_running_its_chunk(gateway_address):
    env = robot_env(gateway_address, hz=20, horizon=8, episode_steps=15, realtime_chunks=True)
    try:
        env.reset(seed=0)
        moves = np.zeros((1, 8, 3), np.float32)
        _, _, _, _, first = env.step(moves)  # no delay measured yet: the whole chunk runs
        assert first["executed"][0] == 8 and first["lead_ticks"][0] == 0
        time.sleep(0.12)
        _, _, _, truncated, second = env.step(moves)  # returns `lead` ticks early; the tail runs on
        lead = int(second["lead_ticks"][0])
        assert second["executed"][0] == 8 - lead and not truncated[0]
        time.sleep(0.3)  # long enough for the tail to reach the episode's 15th step
        _, _, _, truncated, third = env.step(moves + 1.0)
        assert truncated[0] and third["final_info"]["executed"][0] == 15 - (16 - lead)
        assert np.allclose(third["final_info"]["executed_action"][0], 0.0)  # only the old tail ran, never this chunk
    finally:
        env.close()


def test_camera_frames_come_over_the_data_plane_and_show_the_arm_move(gateway_address):
    """A robot connected with a camera: the env's observation carries the newest frame (fetched on the gateway's
    ZeroMQ camera port, not gRPC), the frames follow the arm, and the port refuses strangers and unknown robots."""
    from rlfabric.services.core.batch import TensorBatch
    from rlfabric.services.core.dataplane import DataClient, PeerTimeout, RemoteError
    from rlfabric.services.robot_gateway.cameras import FRAME_BYTES

    env = robot_env(gateway_address, hz=50, horizon=1, episode_steps=1000, camera=32)
    try:
        obs, _ = env.reset(seed=0)
        assert obs["image"].shape == (1, 32, 32, 3) and obs["image"].dtype == np.uint8 and obs["state"].shape == (1, 12)
        assert env.camera_endpoint.startswith("tcp://") and obs["image"].std() > 0  # a rendered scene, not a blank
        first = obs["image"][0].astype(int)
        for _ in range(25):  # swing the base round
            obs, *_ = env.step(np.array([[1.0, 0.0, 0.0]], np.float32))
        time.sleep(0.1)  # the camera runs at 30 Hz: its newest frame shows the new pose
        obs, *_ = env.step(np.zeros((1, 3), np.float32))
        assert np.abs(obs["image"][0].astype(int) - first).sum() > 1000

        with closing(DataClient(env.camera_endpoint, max_bytes=FRAME_BYTES, timeout_s=5)) as client:
            _, one = client.request("frame", TensorBatch(meta={"robot_id": env.ids[0]}))
            time.sleep(0.2)
            _, two = client.request("frame", TensorBatch(meta={"robot_id": env.ids[0]}))
            assert two.meta["frame"] > one.meta["frame"] and two.meta["tick"] > one.meta["tick"]
            with pytest.raises(RemoteError, match="has no camera"):
                client.request("frame", TensorBatch(meta={"robot_id": "nobody"}))
        auth.configure("")  # a client without the deployment's token: CURVE never lets it through
        try:
            with closing(DataClient(env.camera_endpoint, max_bytes=FRAME_BYTES, timeout_s=1)) as stranger:
                with pytest.raises(PeerTimeout):
                    stranger.request("frame", TensorBatch(meta={"robot_id": env.ids[0]}))
        finally:
            auth.configure(TOKEN)
    finally:
        env.close()


def test_pi0_drives_the_robot_env_from_its_camera_with_realtime_chunks(gateway_address):
    """What the vla policy does on a robot, pi0 does: the gateway's camera frame and the arm's state in, a chunk of
    joint moves out (a Flow-SDE chain), executed with real-time chunking while pi0 computes the next one."""
    pytest.importorskip("transformers.models.pi0")
    import torch

    from rlfabric.services.core.config import PolicyConfig
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.env.adapters.gymnasium import describe_space

    env = robot_env(gateway_address, hz=20, horizon=4, episode_steps=10_000, camera=32, realtime_chunks=True)
    try:
        obs, _ = env.reset(seed=0)
        spec = {"observation_space": describe_space(env.single_observation_space),
                "action_space": describe_space(env.single_action_space)}
        torch.manual_seed(0)
        pol = build_policy("pi0", spec, PolicyConfig(name="pi0", pi0={"patch": 8}))
        start = env.commanded[0].copy()
        for _ in range(6):
            chain, logp, value = pol.act({k: torch.as_tensor(v) for k, v in obs.items()})
            obs, _, _, _, info = env.step(pol.env_actions(chain))
        assert chain.shape == (1, pol.steps + 1, 4, 3) and torch.isfinite(logp).all() and torch.isfinite(value).all()
        assert info["lead_ticks"][0] >= 1  # the observation came back before the chunk ended
        assert np.abs(env.commanded[0] - start).sum() > 1e-3  # pi0's chunks moved the arm
    finally:
        env.close()
