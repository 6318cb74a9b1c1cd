"""PPO from pixels through every service: a MiniGrid room rendered to 24x24 RGB on the CPU, a CNN policy, the
disaggregated plan (env service -> rollout -> replay on Redis -> learner). Images are uint8 on the wire and in
replay, byte for byte, and the policy learns to reach the goal from random starts."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import redis

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import decode, unpack_frames
from rlfabric.services.core.config import load_config
from rlfabric.services.core.dataplane import DataClient
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, env_pb2_grpc
from rlfabric.services.core.runtime import ROLE_NAMES
from tests.conftest import grpc_channel
from tests.support_redis import redis_server  # noqa: F401

pytestmark = pytest.mark.minutes(0.7)  # on CI's 2 cores: the tiers start long files first

CONFIG = "examples/minigrid_pixels_ppo.yaml"
IMAGE = (24, 24, 3)


def test_the_env_service_sends_uint8_images(stack):
    """On the wire from the env service: uint8, H * W * 3 bytes per env, and the spec says so."""

    cfg = load_config(CONFIG, ["scheduling.mode=disaggregated"])
    env = next(w for w in stack.client.workers() if ROLE_NAMES[w.role] == "env")
    with grpc_channel(env.endpoint.grpc) as ch:
        reply = env_pb2_grpc.EnvStub(ch).Configure(common_pb2.ConfigureRequest(run_id="px", config_json=cfg.to_json()),
                                                   timeout=60)
    spec = json.loads(reply.detail_json)["observation_space"]
    assert spec["dtype"] == "uint8" and spec["shape"] == list(IMAGE)
    client = DataClient(reply.data_endpoint, max_bytes=1 << 24, timeout_s=10)
    _, obs = client.request("reset", TensorBatch(meta={"pool": "train", "seed": 0, "num_envs": 8, "chunks": 2}))
    assert obs["obs"].dtype == np.uint8 and obs["obs"].nbytes == 8 * int(np.prod(IMAGE))
    _, out = client.request("step", TensorBatch({"actions": np.full(4, 2, np.int64)}, meta={"chunk": 0}))
    assert out["obs"].dtype == np.uint8 and out["obs"].shape == (4, *IMAGE)
    client.close()


@pytest.mark.smoke
def test_ppo_learns_from_pixels_through_every_service(tmp_path, redis_server):  # noqa: F811
    run_dir = tmp_path / "pixels"
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", CONFIG, "--run-dir", str(run_dir), "--quiet",
                           "--set", "scheduling.mode=disaggregated", "--set", "replay.store=redis",
                           "--set", f"replay.redis_url={redis_server}"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    assert evals[0] < 0.6 and evals[-1] >= 0.9, evals  # from near-random to the goal from every start
    # replay holds what rollout workers put, as the data plane's frames: uint8 images, exactly H * W * 3 bytes each
    r = redis.Redis.from_url(redis_server)
    keys = r.keys(f"rlfabric:{run_dir.name}:batch:*")
    assert keys
    T, N = 64, 8
    for key in keys[:3]:
        frames = unpack_frames(r.get(key))
        _, batch = decode(frames[1:], 1 << 30)
        assert batch.dims == ("time", "env") and batch["obs"].dtype == np.uint8
        assert batch["obs"].nbytes == T * N * int(np.prod(IMAGE))
    entry = r.lrange(f"rlfabric:{run_dir.name}:window", 0, 0)[0].decode().split(" ")
    stored = int(entry[3])  # the window entry's byte count: images at one byte per channel, plus the rest
    assert stored == T * N * int(np.prod(IMAGE)) + T * N * (8 + 4 * 4) + N * 4  # obs + actions, logp/values/
    #                                                                            rewards/dones, last_values
