"""The replay service on Redis, as a real process driven over gRPC and the data plane: its data outlives a SIGKILL,
a missing Redis fails Configure at once with the fix, and a Redis lost mid-run is retried, then reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.config import dump_yaml
from rlfabric.services.core.dataplane import DataClient, RemoteError
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, replay_pb2_grpc
from tests.conftest import free_port, short_config
from tests.support_redis import RedisServer, redis_server  # noqa: F401


class ReplayProcess:
    """``python -m rlfabric.services.replay.server`` on loopback (no coordinator), with a gRPC stub."""

    def __init__(self, workdir: Path, name: str):
        port_file = workdir / f"{name}.address"
        self.log = workdir / f"{name}.log"
        with open(workdir / f"{name}.stderr", "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlfabric.services.replay.server", "--port-file", str(port_file),
                 "--log-file", str(self.log), "--data-root", str(workdir), "--allow-endpoints", "*"],
                stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"))  # no preexec_fn: see tests/support_redis.py
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert self.proc.poll() is None, f"replay exited at start-up; see {workdir / f'{name}.stderr'}"
            assert time.monotonic() < deadline, "replay did not start within 30 s"
            time.sleep(0.02)
        self.channel = grpc.insecure_channel(port_file.read_text().strip())
        self.stub = replay_pb2_grpc.ReplayStub(self.channel)
        self.clients: list[DataClient] = []

    def configure(self, run_id: str, run_dir: Path, **replay) -> DataClient:
        cfg = short_config(replay={"store": "redis", **replay})
        reply = self.stub.Configure(common_pb2.ConfigureRequest(
            run_id=run_id, config_json=cfg.to_json(),
            context_json=json.dumps({"run_dir": str(run_dir), "env_spec": {}})), timeout=30)
        client = DataClient(reply.data_endpoint, max_bytes=1 << 24, timeout_s=15, peer="replay")
        self.clients.append(client)
        return client

    def kill(self) -> None:
        for c in self.clients:
            c.close()
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def replay_procs(tmp_path):
    started: list[ReplayProcess] = []

    def start(name: str) -> ReplayProcess:
        started.append(ReplayProcess(tmp_path, name))
        return started[-1]

    yield start
    for p in started:
        p.kill()


def _traj(version: int, width: int = 2) -> TensorBatch:
    return TensorBatch({"obs": np.full((8, 4, width), version, np.float32),
                        "rewards": np.full((8, 4), version, np.float32)}, version=version, dims=("time", "env"))


def test_a_sigkilled_replay_service_comes_back_with_the_same_batches(redis_server, replay_procs, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    first = replay_procs("replay-1")
    client = first.configure("persist-1", run_dir, redis_url=redis_server, offload_bytes=4096)
    for v in range(4):  # obs is 8*4*64*4 = 8 KiB > offload_bytes: it goes to the run's object store
        kind, ack = client.request("put", _traj(v, width=64))
        assert kind == "ack" and ack.meta["puts"] == v + 1
    kind, got = client.request("get", TensorBatch(meta={"min_version": 1}))  # drops version 0 as stale
    assert kind == "batch" and got.version == 1
    first.kill()  # SIGKILL: no shutdown hook runs

    second = replay_procs("replay-2")
    client = second.configure("persist-1", run_dir, redis_url=redis_server, offload_bytes=4096)
    stats = second.stub.GetStats(common_pb2.Empty(), timeout=10)
    assert (stats.batches, stats.pending_onpolicy, stats.puts, stats.onpolicy_gets, stats.stale_dropped,
            stats.transitions, stats.newest_version) == (4, 2, 4, 1, 1, 128, 3)
    for v in (2, 3):  # the rest of the FIFO, in order, with versions and data intact
        kind, got = client.request("get", TensorBatch(meta={"min_version": 0}))
        assert kind == "batch" and got.version == v
        np.testing.assert_array_equal(got["obs"], _traj(v, width=64)["obs"])
    assert client.request("get", TensorBatch(meta={"min_version": 0, "wait_s": 0.05}))[0] == "empty"
    _, sample = client.request("sample", TensorBatch(meta={"n": 64}))
    assert sample["obs"].shape == (64, 64) and set(sample["version"]) <= {0, 1, 2, 3}
    np.testing.assert_array_equal(sample["obs"][:, 0], sample["version"].astype(np.float32))
    objects = sorted(p.relative_to(run_dir).parts[:2] for p in (run_dir / "replay").rglob("obs"))
    assert objects == [("replay", "persist-1")] * 4  # replay/<run_id>/<batch id>/obs in the run directory
    other = second.configure("persist-2", run_dir, redis_url=redis_server)  # another run id starts empty
    assert other.request("get", TensorBatch(meta={"min_version": 0}))[0] == "empty"


def test_configure_with_redis_down_fails_at_once_naming_the_url_and_fix(replay_procs, tmp_path):
    replay = replay_procs("replay")
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        replay.configure("down", tmp_path / "run", redis_url=url, connect_timeout_s=2.0, retry_attempts=5)
    assert time.monotonic() - t0 < 2.0
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"replay.redis_url='{url}'" in info.value.details() and "start redis-server" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # a malformed URL is bad input (the CLI exits 2)
        replay.configure("typo", tmp_path / "run", redis_url="redis//127.0.0.1:6379")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "redis://HOST:PORT/DB" in info.value.details()
    client = replay.configure("fallback", tmp_path / "run", store="memory")  # the service is still usable
    assert client.request("put", _traj(0))[0] == "ack"


def test_redis_lost_mid_run_is_retried_then_reported_on_the_data_plane(replay_procs, tmp_path):
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    try:
        replay = replay_procs("replay")
        client = replay.configure("lost", tmp_path / "run", redis_url=server.url, retry_attempts=8,
                                  retry_backoff_s=0.05)
        assert client.request("put", _traj(0))[0] == "ack"
        server.kill()
        # the put runs on a helper thread while Redis comes back (from this thread: a redis-server started
        # by a short-lived thread would die with it, PR_SET_PDEATHSIG being per thread)
        answer: dict = {}
        put = threading.Thread(target=lambda: answer.update(reply=client.request("put", _traj(1))))
        put.start()
        time.sleep(0.3)
        server.start()  # back within the retry budget (0.05 s doubling to 2 s)
        put.join(30)
        kind, ack = answer["reply"]
        assert kind == "ack" and ack.meta["puts"] == 2
        assert "Redis connection lost" in replay.log.read_text()  # acknowledged after retries, not before

        client = replay.configure("lost", tmp_path / "run", redis_url=server.url, retry_attempts=2,
                                  retry_backoff_s=0.05)
        server.kill()  # and this time it stays down
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            client.request("put", _traj(2))
        assert time.monotonic() - t0 < 3.0
        msg = str(info.value)
        assert "'put' failed" in msg and f"replay.redis_url='{server.url}'" in msg
        assert "replay.retry_attempts=2" in msg and "restart redis-server" in msg
        with pytest.raises(RemoteError, match="during take"):
            client.request("get", TensorBatch(meta={"min_version": 0}))
        assert replay.stub.GetStats(common_pb2.Empty(), timeout=5).puts == 2  # control plane still answers

        server.start()  # the same service carries on once Redis is back; nothing acknowledged was lost
        assert client.request("put", _traj(2))[1].meta["puts"] == 3
        versions = [client.request("get", TensorBatch(meta={"min_version": 0}))[1].version for _ in range(3)]
        assert versions == [0, 1, 2]
    finally:
        server.kill()


def test_a_training_run_keeps_its_replay_in_redis_and_large_tensors_in_the_run_dir(redis_server, tmp_path):  # noqa: F811
    """The whole path: the coordinator passes the run directory to replay, rollout puts, the learner takes."""
    cfg = short_config(replay={"store": "redis", "redis_url": redis_server, "offload_bytes": 1024},
                       scheduling={"mode": "disaggregated", "staleness": 1, "pipeline_chunks": 2},
                       env={"num_envs": 8, "eval_envs": 2}, train={"total_env_steps": 640, "eval_every_iterations": 0})
    spec = tmp_path / "run.yaml"
    spec.write_text(dump_yaml(cfg))
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(spec), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    r = redis.Redis.from_url(redis_server)
    (stats_key,) = r.keys("rlfabric:*:stats")
    stats = {k.decode(): int(v) for k, v in r.hgetall(stats_key).items()}
    assert stats["puts"] == 5 and stats["onpolicy_gets"] == 5 and stats["newest_version"] >= 3
    run_id = stats_key.decode().split(":")[1]
    assert len(list((run_dir / "replay" / run_id).glob("*/obs"))) == 5  # 16x8x4 float32 obs: 2 KiB > 1 KiB
