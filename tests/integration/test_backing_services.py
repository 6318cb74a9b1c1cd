"""The compose topology as processes: every service on loopback with Redis replay and S3 storage."""

from __future__ import annotations

import json

import redis

from rlfabric.services.core.objectstore import open_store
from rlfabric.services.core.proto.rlfabric.v1 import (
    common_pb2,
    coordinator_pb2,
    env_pb2_grpc,
    replay_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from rlfabric.services.core.weights import load_weights
from tests.conftest import grpc_channel, short_config
from tests.integration.test_coordinator import _wait_idle
from tests.support_redis import redis_server as redis_server  # noqa: F401
from tests.support_s3 import s3_server as s3_server  # noqa: F401


def _config(redis_url, storage, **extra):
    return short_config(replay={"store": "redis", "redis_url": redis_url},
                        storage=storage.model_dump(), checkpoint={"every_iterations": 4}, **extra)


def test_run_with_redis_replay_and_s3_storage_then_late_rollout_cold_starts(stack, tmp_path, redis_server, s3_server):
    _wait_idle(stack.client)
    storage = s3_server.storage()
    cfg = _config(redis_server, storage)
    status = stack.client.submit(cfg, run_dir=tmp_path / "run")
    final = stack.client.wait(status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    store = open_store(storage, tmp_path, status.run_id)
    keys = store.list("")
    assert "checkpoints/final.pt" in keys and "weights/latest" in keys
    assert any(k.startswith("checkpoints/ckpt-") for k in keys)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing went to the local disk
    assert redis.Redis.from_url(redis_server).keys(f"{cfg.replay.key_prefix}:{status.run_id}:*")
    version, _ = load_weights(store, 1 << 20)
    assert version == 10

    # A rollout worker that starts late, while the learner is unreachable, serves the stored version.
    late = stack.start_worker("rollout", name="rollout-late")
    cfg_late = cfg.model_copy(update={"data_plane": cfg.data_plane.model_copy(update={"timeout_s": 1.0})})
    workers = {w.pid: w for w in stack.client.workers()}
    import time

    deadline = time.monotonic() + 60
    while late.pid not in workers:
        assert time.monotonic() < deadline
        time.sleep(0.1)
        workers = {w.pid: w for w in stack.client.workers()}
    roles = {w.worker_id.split("-")[0]: w for w in workers.values() if w.alive and w.pid != late.pid}
    req = dict(run_id=status.run_id, config_json=cfg_late.to_json())
    env = env_pb2_grpc.EnvStub(grpc_channel(roles["env"].endpoint.grpc))
    replay = replay_pb2_grpc.ReplayStub(grpc_channel(roles["replay"].endpoint.grpc))
    env_reply = env.Configure(common_pb2.ConfigureRequest(**req), timeout=30)
    replay_reply = replay.Configure(common_pb2.ConfigureRequest(**req), timeout=30)
    rollout = rollout_pb2_grpc.RolloutStub(grpc_channel(workers[late.pid].endpoint.grpc))
    rollout.Configure(common_pb2.ConfigureRequest(
        **req, peers={"env": env_reply.data_endpoint, "replay": replay_reply.data_endpoint,
                      "learner": "tcp://127.0.0.1:9"},  # nobody there
        context_json=json.dumps({"env_spec": json.loads(env_reply.detail_json), "run_dir": str(tmp_path / "run"),
                                 "base_version": 0, "start_iteration": 10})), timeout=60)
    assert rollout.GetState(common_pb2.Empty()).weight_version == 10
    ev = rollout.Evaluate(rollout_pb2.EvaluateRequest(episodes=2), timeout=60)
    assert len(ev.returns) == 2


def test_wrong_s3_credentials_fail_the_run_with_the_field_to_fix(stack, tmp_path, redis_server, s3_server):
    _wait_idle(stack.client)
    storage = s3_server.storage(secret_key="not-the-secret")
    status = stack.client.submit(_config(redis_server, storage), run_dir=tmp_path / "run")
    final = stack.client.wait(status.run_id)
    assert final.state == coordinator_pb2.FAILED and final.bad_input
    assert "storage.secret_key" in final.reason
