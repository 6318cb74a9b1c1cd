"""A run id is no secret: ListWorkers shows which run holds each worker. Holding the deployment's token and that
id used to be enough to reconfigure a running run's workers, to heartbeat for one (and read what the coordinator
tells it) or to deregister an idle one. Now the coordinator's calls for a run carry the run's key, which only the
worker it placed learns (from its own heartbeats, which carry the key of its registration): a token holder's
Configure or Replay.Clear naming the run is PERMISSION_DENIED, and so is a heartbeat or a deregistration for a worker
it is not."""

from __future__ import annotations

import time

import grpc
import pytest

from rlfabric.services.core.proto.rlfabric.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    env_pb2_grpc,
    replay_pb2,
    replay_pb2_grpc,
)
from tests.conftest import grpc_channel, short_config


def test_a_token_holder_who_knows_a_runs_id_cannot_drive_its_workers(private_stack):
    stack, client = private_stack, private_stack.client
    status = client.submit(short_config(train={"total_env_steps": 3000, "eval_every_iterations": 0},
                                        data_plane={"timeout_s": 20}, scheduling={"mode": "disaggregated"}))
    deadline = time.monotonic() + 60
    while client.status(status.run_id).env_steps < 300:
        assert time.monotonic() < deadline, client.status(status.run_id)
        time.sleep(0.05)
    env = next(w for w in client.workers() if w.role == common_pb2.ENV)
    assert env.run_id == status.run_id  # what anyone with the token can read
    hijack = short_config(env={"id": "Pendulum-v1"}).to_json()
    with grpc_channel(env.endpoint.grpc) as channel:
        with pytest.raises(grpc.RpcError) as err:
            env_pb2_grpc.EnvStub(channel).Configure(common_pb2.ConfigureRequest(
                run_id=status.run_id, config_json=hijack, context_json="{}"), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "run's key" in err.value.details()
    with grpc_channel(stack.address) as channel:
        coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
        for call in (lambda: coordinator.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id=env.worker_id),
                                                   timeout=10),
                     lambda: coordinator.Heartbeat(coordinator_pb2.HeartbeatRequest(
                         worker_id=env.worker_id, worker_key="a guess"), timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    replay = next(w for w in client.workers() if w.role == common_pb2.REPLAY)
    with grpc_channel(replay.endpoint.grpc) as channel:  # naming the run that holds it: still not its key
        with pytest.raises(grpc.RpcError) as err:
            replay_pb2_grpc.ReplayStub(channel).Clear(replay_pb2.ClearRequest(run_id=status.run_id), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "run's key" in err.value.details()
    final = client.wait(status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED and final.recoveries == 0, final.reason  # the run never noticed
