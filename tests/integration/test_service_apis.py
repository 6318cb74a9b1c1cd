"""Every service as a real process on loopback: its gRPC API, its data plane, health and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.services.core import auth
from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.dataplane import DataClient, RemoteError
from rlfabric.services.core.proto.rlfabric.v1 import (
    common_pb2,
    env_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    replay_pb2,
    replay_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from rlfabric.services.core.runtime import ROLE_NAMES
from tests.conftest import grpc_channel, metrics_text, short_config

STUBS = {"env": env_pb2_grpc.EnvStub, "replay": replay_pb2_grpc.ReplayStub,
         "learner": learner_pb2_grpc.LearnerStub, "rollout": rollout_pb2_grpc.RolloutStub}


def _workers(stack) -> dict:
    return {ROLE_NAMES[w.role]: w for w in stack.client.workers() if w.alive}


def _stub(stack, role):
    channel = grpc_channel(_workers(stack)[role].endpoint.grpc)
    return STUBS[role](channel)


def test_every_service_serves_health_and_prometheus_metrics(stack):
    workers = _workers(stack)
    assert set(workers) == {"env", "replay", "learner", "rollout"}
    for w in [*workers.values()]:
        with grpc_channel(w.endpoint.grpc) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        body = metrics_text(w.endpoint.metrics)
        assert "rlfabric_rpcs_total" in body and "process_cpu_seconds_total" in body
        assert w.seconds_since_heartbeat < 3.0


def test_grpc_message_size_is_bounded(stack):
    env = _stub(stack, "env")
    with pytest.raises(grpc.RpcError) as info:
        env.Configure(common_pb2.ConfigureRequest(run_id="x", config_json="x" * (9 * 2**20)), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_env_api_and_data_plane(stack):
    env = _stub(stack, "env")
    cfg = short_config(scheduling={"mode": "disaggregated", "pipeline_chunks": 2})
    reply = env.Configure(common_pb2.ConfigureRequest(run_id="t-env", config_json=cfg.to_json()), timeout=30)
    spec = json.loads(reply.detail_json)
    assert spec["num_chunks"] == 2 and spec["action_space"] == {"kind": "discrete", "shape": [], "dtype": "int64",
                                                                "n": 2, "start": 0}
    assert env.GetSpec(common_pb2.Empty()).observation_space.shape == [4]
    client = DataClient(reply.data_endpoint, max_bytes=1 << 20, timeout_s=5, peer="env")
    _, obs = client.request("reset", TensorBatch(meta={"pool": "train", "seed": 0, "num_envs": 4}))
    assert obs["obs"].shape == (4, 4)
    for _ in range(30):
        _, out = client.request("step", TensorBatch({"actions": np.ones(2, np.int64)}, meta={"chunk": 1}))
    assert out["obs"].shape == (2, 4) and out["reward"].dtype == np.float32
    with pytest.raises(RemoteError, match=r"shape \(3,\).*expects \(2,\)"):
        client.request("step", TensorBatch({"actions": np.ones(3, np.int64)}, meta={"chunk": 0}))
    with pytest.raises(RemoteError, match="meta.pool must be 'eval', 'train' or 'train/<worker index"):
        client.request("reset", TensorBatch(meta={"pool": "nope"}))
    with pytest.raises(RemoteError, match="no env pool 'train/3'"):  # a shard nobody reset yet
        client.request("step", TensorBatch({"actions": np.ones(2, np.int64)}, meta={"pool": "train/3"}))
    stats = env.GetStats(common_pb2.Empty())
    assert stats.env_steps == 60 and stats.episodes.episodes >= 2 and stats.rejected_messages >= 2


def test_env_and_replay_refuse_requests_of_an_ended_attempt(stack):
    """Each attempt of a run configures its workers with a new fence; a worker of an ended attempt (lost by the
    coordinator, yet still reaching its peers) is refused by env and replay, naming why, and counted. Requests
    that carry no fence (tools, these tests) are served."""
    env, replay = _stub(stack, "env"), _stub(stack, "replay")
    cfg = short_config(replay={"capacity_transitions": 100})
    shard = TensorBatch({"obs": np.zeros((8, 4, 2), np.float32)}, version=0, dims=("time", "env"))
    clients = {}
    for attempt in ("a0", "a1"):
        req = dict(run_id="t-fence", config_json=cfg.to_json(), context_json=json.dumps({"fence": attempt}))
        replay_at = replay.Configure(common_pb2.ConfigureRequest(**req), timeout=10).data_endpoint
        env_at = env.Configure(common_pb2.ConfigureRequest(**req), timeout=30).data_endpoint
        clients[attempt] = (DataClient(replay_at, max_bytes=1 << 20, timeout_s=5, peer="replay", fence=attempt),
                            DataClient(env_at, max_bytes=1 << 20, timeout_s=5, peer="env", fence=attempt))
        assert clients[attempt][0].request("put", shard)[0] == "ack"
        assert clients[attempt][1].request("reset", TensorBatch(meta={"pool": "train", "seed": 0,
                                                                      "num_envs": 4}))[1]["obs"].shape == (4, 4)
    stale_replay, stale_env = clients["a0"]
    for request in (("put", shard), ("get", TensorBatch(meta={"min_version": 0})), ("sample", TensorBatch(
            meta={"n": 4}))):
        with pytest.raises(RemoteError, match="refused a request of an attempt of the run that has ended"):
            stale_replay.request(*request)
    with pytest.raises(RemoteError, match="env: 'step' refused: env: refused a request of an attempt .* has ended"):
        stale_env.request("step", TensorBatch({"actions": np.ones(4, np.int64)}))
    assert replay.GetStats(common_pb2.Empty()).puts == 1  # only the current attempt's put is stored
    unfenced = DataClient(stale_replay.endpoint, max_bytes=1 << 20, timeout_s=5, peer="replay")
    assert unfenced.request("get", TensorBatch(meta={"min_version": 0}))[0] == "batch"
    assert clients["a1"][1].request("step", TensorBatch({"actions": np.ones(4, np.int64)}))[1]["obs"].shape == (4, 4)
    for role, metric in (("replay", "rlfabric_replay_stale_attempt_requests_total"),
                         ("env", "rlfabric_env_stale_attempt_requests_total")):
        text = metrics_text(_workers(stack)[role].endpoint.metrics)
        assert any(line.startswith(metric) and float(line.split()[-1]) >= 1 for line in text.splitlines()), role


def test_corrupt_and_oversized_frames_are_refused_and_channel_survives(stack):
    env = _stub(stack, "env")
    cfg = short_config(data_plane={"max_message_bytes": 4096})
    reply = env.Configure(common_pb2.ConfigureRequest(run_id="t-frames", config_json=cfg.to_json()), timeout=30)
    rejected_before = env.GetStats(common_pb2.Empty()).rejected_messages
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    auth.secure_client_socket(raw)  # a peer with the secret, sending garbage
    raw.connect(reply.data_endpoint)
    raw.send_multipart([b"\x00\x01garbage", b"junk"])
    assert raw.poll(5000), "a corrupt frame must be answered, not swallowed"
    assert b"not valid JSON" in raw.recv_multipart()[0]
    big = TensorBatch({"actions": np.ones(4, np.int64), "pad": np.zeros(6000, np.uint8)}, meta={"chunk": 0})
    from rlfabric.services.core.codec import encode

    raw.send_multipart(encode("step", big))
    assert raw.poll(5000)
    assert b"exceeds the data-plane bound of 4096 bytes" in raw.recv_multipart()[0]
    raw.close()
    client = DataClient(reply.data_endpoint, max_bytes=4096, timeout_s=5)
    client.request("reset", TensorBatch(meta={"seed": 1}))
    _, out = client.request("step", TensorBatch({"actions": np.zeros(4, np.int64)}))
    assert out["obs"].shape == (4, 4)
    assert env.GetStats(common_pb2.Empty()).rejected_messages == rejected_before + 2


def test_replay_api_and_data_plane(stack):
    replay = _stub(stack, "replay")
    cfg = short_config(replay={"capacity_transitions": 100})
    reply = replay.Configure(common_pb2.ConfigureRequest(run_id="t-replay", config_json=cfg.to_json()), timeout=10)
    client = DataClient(reply.data_endpoint, max_bytes=1 << 20, timeout_s=5, peer="replay")
    for v in range(3):
        kind, ack = client.request("put", TensorBatch({"obs": np.full((8, 4, 2), v, np.float32)}, version=v,
                                                      dims=("time", "env")))
        assert kind == "ack" and ack.meta["puts"] == v + 1
    kind, got = client.request("get", TensorBatch(meta={"min_version": 1}))
    assert kind == "batch" and got.version == 1 and got["obs"][0, 0, 0] == 1
    kind, sample = client.request("sample", TensorBatch(meta={"n": 10}))
    assert sample["obs"].shape == (10, 2) and set(sample["version"]) <= {0, 1, 2}
    stats = replay.GetStats(common_pb2.Empty())
    assert (stats.puts, stats.stale_dropped, stats.evicted_batches, stats.pending_onpolicy) == (3, 1, 0, 1)
    assert stats.transitions == 96 and stats.newest_version == 2
    with pytest.raises(RemoteError, match="no policy version"):
        client.request("put", TensorBatch({"obs": np.zeros((2, 2))}, dims=("sample",)))
    with pytest.raises(RemoteError, match="declares no batch dims"):
        client.request("put", TensorBatch({"obs": np.zeros((2, 2))}, version=0))
    with pytest.raises(RemoteError, match="no replay source 'demos'"):
        client.request("sample", TensorBatch(meta={"n": 4, "source": "demos"}))
    with pytest.raises(RemoteError, match="meta.n must be an integer"):
        client.request("sample", TensorBatch(meta={"n": "ten"}))
    assert replay.Clear(replay_pb2.ClearRequest(pending_only=True)).transitions == 96  # the window stays
    assert replay.GetStats(common_pb2.Empty()).pending_onpolicy == 0
    assert replay.Clear(replay_pb2.ClearRequest()).transitions == 0
    kind, _ = client.request("get", TensorBatch(meta={"min_version": 0, "wait_s": 0.2}))
    assert kind == "empty"


def test_replay_loads_data_sets_as_named_sources_and_samples_a_weighted_mix(stack, tmp_path):
    replay = _stub(stack, "replay")
    for name, value, rows in (("demos", 0.0, 300), ("play", 1.0, 500)):
        np.savez(tmp_path / f"{name}.npz", obs=np.full((rows, 3), value, np.float32),
                 rewards=np.full(rows, value, np.float32))
    cfg = short_config(replay={"datasets": {"demos": str(tmp_path / "demos.npz"), "play": str(tmp_path / "play.npz")}})
    reply = replay.Configure(common_pb2.ConfigureRequest(run_id="t-mix", config_json=cfg.to_json()), timeout=30)
    assert json.loads(reply.detail_json)["loaded"] == {"demos": 300, "play": 500}
    assert dict(replay.GetStats(common_pb2.Empty()).source_transitions) == {"online": 0, "demos": 300, "play": 500}
    client = DataClient(reply.data_endpoint, max_bytes=1 << 24, timeout_s=5, peer="replay")
    _, mix = client.request("sample", TensorBatch(meta={"n": 4000, "mix": {"demos": 0.25, "play": 0.75}}))
    assert mix.meta["sources"] == ["demos", "play"] and mix.dims == ("sample",)
    from_play = mix["source"] == 1
    assert 0.70 < from_play.mean() < 0.80
    np.testing.assert_array_equal(mix["obs"][:, 0], from_play.astype(np.float32))  # rows stay with their source
    _, demos = client.request("sample", TensorBatch(meta={"n": 50, "source": "demos"}))
    assert (demos["rewards"] == 0).all()
    client.close()
    broken = tmp_path / "broken.npz"
    np.savez(broken, obs=np.zeros((3, 2)), rewards=np.zeros(4))
    with pytest.raises(grpc.RpcError) as info:
        replay.Configure(common_pb2.ConfigureRequest(run_id="t-bad", config_json=short_config(
            replay={"datasets": {"x": str(broken)}}).to_json()), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "same number of rows" in info.value.details()


def test_learner_and_rollout_apis_driven_by_hand(stack, tmp_path):
    """The macro workflow's calls, one by one: configure, collect, train, evaluate, checkpoint."""
    cfg = short_config()
    req = dict(run_id="t-manual", config_json=cfg.to_json())
    env, replay = _stub(stack, "env"), _stub(stack, "replay")
    learner, rollout = _stub(stack, "learner"), _stub(stack, "rollout")
    env_reply = env.Configure(common_pb2.ConfigureRequest(**req), timeout=30)
    replay_reply = replay.Configure(common_pb2.ConfigureRequest(**req), timeout=30)
    ctx = {"env_spec": json.loads(env_reply.detail_json), "run_dir": str(tmp_path)}
    learner_reply = learner.Configure(common_pb2.ConfigureRequest(
        **req, peers={"replay": replay_reply.data_endpoint}, context_json=json.dumps(ctx)), timeout=60)
    base = json.loads(learner_reply.detail_json)["weight_version"]
    rollout.Configure(common_pb2.ConfigureRequest(
        **req, peers={"env": env_reply.data_endpoint, "replay": replay_reply.data_endpoint,
                      "learner": learner_reply.data_endpoint},
        context_json=json.dumps({**ctx, "base_version": base})), timeout=60)
    assert rollout.GetState(common_pb2.Empty()).weight_version == base
    c = rollout.Collect(rollout_pb2.CollectRequest(batch_index=0, min_version=base), timeout=30)
    assert c.env_steps == 64 and c.weight_version == base and c.collect_seconds > 0
    t = learner.Train(learner_pb2.TrainRequest(batch_index=0, min_version=base), timeout=30)
    assert t.weight_version == base + 1 and t.batch_version == base and t.optimizer_steps == 2
    assert {"policy_loss", "value_loss", "entropy", "approx_kl", "learning_rate"} <= set(t.stats)
    c = rollout.Collect(rollout_pb2.CollectRequest(batch_index=1, min_version=base + 1), timeout=30)
    assert c.weight_version == base + 1  # the rollout loaded the new version before acting
    ev = rollout.Evaluate(rollout_pb2.EvaluateRequest(episodes=3), timeout=60)
    assert len(ev.returns) == 3 and ev.episodes.return_mean > 0
    with pytest.raises(grpc.RpcError) as info:  # no batch for version base+5 will ever come
        learner.Train(learner_pb2.TrainRequest(batch_index=1, min_version=base + 5, timeout_s=0.3), timeout=30)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "version >=" in info.value.details()
    ck = learner.SaveCheckpoint(learner_pb2.CheckpointRequest(key="checkpoints/manual.pt"), timeout=30)
    assert Path(ck.uri.removeprefix("file://")).is_file() and ck.bytes > 1000
    state = learner.GetState(common_pb2.Empty())
    assert state.weight_version == base + 1 and state.algorithm == "ppo" and state.env_steps == 64
