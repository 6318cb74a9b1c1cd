"""Replay store throughput: put and sample of the memory store and the Redis store, next to raw redis-py SET/GET
of the same bytes on the same Redis, all measured in this run.

    python bench/replay.py [--out FILE] [--redis-url URL] [--seconds 1.0] [--rounds 3]

Batches are time-major trajectories: "cartpole" (32 steps x 8 envs, 4-float observations, ~10 KiB with actions,
rewards, values...) in a window of 256 batches, and "image" (32 x 8 of 3x64x64 uint8 frames, ~3 MiB) in a window
of 16. Every put evicts the oldest batch (steady state). Ratios (ours / raw, higher is better):
  redis_put_vs_raw_set             RedisStore.put vs SET of the batch's frames (the same bytes)
  redis_sample_vs_raw_get          RedisStore.sample (in-process copies on, the default) vs GET of a value as
                                   large as the sample it returns
  redis_onpolicy_vs_raw_set_get    put + take_onpolicy (the PPO path) vs SET + GET of the same bytes
  redis_sample_uncached_vs_raw_get RedisStore.sample with cache_bytes=0 vs pipelined GETs of every whole batch the
                                   sample touched (what it must fetch); informational, no target
Keys without a suffix are the worse of the two shapes; ``_cartpole`` / ``_image`` give each. Tensors stay in Redis
(offload_bytes is set out of reach): the object store is not what is measured. Without --redis-url (or
RLFABRIC_TEST_REDIS_URL) the bench starts its own redis-server (no persistence) on a free port.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402

from rlfabric.services.core.batch import TensorBatch  # noqa: E402
from rlfabric.services.core.codec import encode  # noqa: E402
from rlfabric.services.replay.stores import draw_rows  # noqa: E402
from rlfabric.services.replay.stores.memory import MemoryStore  # noqa: E402
from rlfabric.services.replay.stores.redis import RedisStore  # noqa: E402

T, N = 32, 8


def make_batch(shape: str, version: int, rng: np.random.Generator) -> TensorBatch:
    obs = (rng.standard_normal((T, N, 4), dtype=np.float32) if shape == "cartpole"
           else rng.integers(0, 255, (T, N, 3, 64, 64), dtype=np.uint8))
    return TensorBatch({
        "obs": obs, "actions": rng.integers(0, 2, (T, N)), "rewards": np.ones((T, N), np.float32),
        "dones": np.zeros((T, N), np.float32), "values": rng.standard_normal((T, N), dtype=np.float32),
        "log_probs": rng.standard_normal((T, N), dtype=np.float32), "last_values": np.zeros(N, np.float32),
    }, version=version, dims=("time", "env"), field_dims={"last_values": ("env",)})


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Operations per second over about ``seconds`` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn()
        n += 1
    return n / elapsed


def best(pairs: list[dict[str, Callable[[], float]]], rounds: int) -> dict[str, float]:
    """Run every measurement ``rounds`` times, interleaved so drift hits all alike; keep each one's best."""
    out: dict[str, float] = {}
    for _ in range(rounds):
        for group in pairs:
            for name, measure in group.items():
                out[name] = max(out.get(name, 0.0), measure())
    return out


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.01)
    proc.kill()
    raise SystemExit(f"redis-server did not start on port {port}")


def bench_shape(shape: str, url: str, seconds: float, rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    window = 256 if shape == "cartpole" else 16  # batches kept: 65k transitions / 4k transitions (~50 MiB)
    n_sample = 256 if shape == "cartpole" else 64
    batches = [make_batch(shape, v, rng) for v in range(window)]
    batch_bytes = batches[0].nbytes
    payloads = [b"".join(bytes(f) for f in encode("batch", b)) for b in batches]
    raw = redis.Redis.from_url(url)
    raw.flushdb()
    mem = MemoryStore(window * T * N)
    store = RedisStore(url, f"bench-{shape}", window * T * N, offload_bytes=1 << 40)  # measure Redis, not files
    for b in batches:  # fill the windows: steady state, each put below also evicts the oldest batch
        mem.put(b)
        store.put(b)
    for i, p in enumerate(payloads):
        raw.set(f"raw:{i}", p)
    it = {"mem": 0, "redis": 0, "raw": 0, "on": 0}

    def put(name: str, fn: Callable[[TensorBatch], object]) -> Callable[[], float]:
        def one() -> None:
            it[name] += 1
            fn(batches[it[name] % window])
        return lambda: rate(one, seconds)

    def raw_set() -> None:
        it["raw"] += 1
        raw.set(f"raw:{it['raw'] % window}", payloads[it["raw"] % window])

    # sample baselines: GET of a value as large as a sample, and pipelined GETs of the batches a cold sample touches
    sample_bytes = mem.sample(n_sample, np.random.default_rng(1)).nbytes
    raw.set("raw:sample", os.urandom(sample_bytes))
    counts = np.full(window, T * N)
    srng, crng, rrng, mrng = (np.random.default_rng(s) for s in (2, 3, 4, 5))
    touched: list[int] = []

    def uncached_sample() -> float:
        """A second store on the same keys with its cache off, opened after the puts (one owner at a time)."""
        cold = RedisStore(url, f"bench-{shape}", window * T * N, offload_bytes=1 << 40, cache_bytes=0)
        try:
            return rate(lambda: cold.sample(n_sample, crng), seconds)
        finally:
            cold.close()

    def raw_get_touched() -> None:
        owners = np.unique(draw_rows(counts, n_sample, rrng)[1])
        touched.append(len(owners))
        pipe = raw.pipeline(transaction=False)
        for o in owners:
            pipe.get(f"raw:{o}")
        pipe.execute()

    # On-policy stores start empty, so take_onpolicy returns the batch just put. The memory one is unbounded:
    # MemoryStore.put raises when it evicts a batch that was already taken while another is pending.
    mem_on = MemoryStore(1 << 62)
    redis_on = RedisStore(url, f"bench-{shape}-onpolicy", window * T * N, offload_bytes=1 << 40)

    def onpolicy(s) -> Callable[[], None]:
        def one() -> None:
            it["on"] += 1
            s.put(batches[it["on"] % window])
            s.take_onpolicy(0)
        return one

    def raw_set_get() -> None:
        raw_set()
        raw.get(f"raw:{it['raw'] % window}")

    r = best([
        {"memory_put": put("mem", mem.put), "redis_put": put("redis", store.put), "raw_set": lambda: rate(raw_set, seconds)},
        {"memory_sample": lambda: rate(lambda: mem.sample(n_sample, mrng), seconds),
         "redis_sample": lambda: rate(lambda: store.sample(n_sample, srng), seconds),
         "raw_get": lambda: rate(lambda: raw.get("raw:sample"), seconds)},
        {"redis_sample_uncached": uncached_sample,
         "raw_get_touched": lambda: rate(raw_get_touched, seconds)},
        {"memory_onpolicy": lambda: rate(onpolicy(mem_on), seconds),
         "redis_onpolicy": lambda: rate(onpolicy(redis_on), seconds),
         "raw_set_get": lambda: rate(raw_set_get, seconds)},
    ], rounds)
    store.close()
    redis_on.close()
    raw.flushdb()
    mb = 1e6
    out = {"batch_bytes": batch_bytes, "sample_transitions": n_sample, "sample_bytes": sample_bytes,
           "window_batches": window, "batches_per_uncached_sample": float(np.mean(touched))}
    for name, ops in r.items():
        if name.endswith("put") or name == "raw_set":
            out[f"{name}_transitions_s"] = ops * T * N
            out[f"{name}_mb_s"] = ops * batch_bytes / mb
        elif name.endswith("onpolicy") or name == "raw_set_get":
            out[f"{name}_transitions_s"] = ops * T * N
            out[f"{name}_mb_s"] = ops * 2 * batch_bytes / mb  # in and out
        elif name in ("raw_get_touched", "redis_sample_uncached"):  # moves whole batches to return a sample
            out[f"{name}_transitions_s"] = ops * n_sample
            out[f"{name}_fetched_mb_s"] = ops * out["batches_per_uncached_sample"] * batch_bytes / mb
        else:
            out[f"{name}_transitions_s"] = ops * n_sample
            out[f"{name}_mb_s"] = ops * sample_bytes / mb
        out[f"{name}_ops_s"] = ops
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument("--redis-url", default=os.environ.get("RLFABRIC_TEST_REDIS_URL", ""))
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="cartpole,image")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # (the store warns that the bench's Redis has no appendonly)
    proc, workdir = None, None
    url = args.redis_url
    if not url:
        workdir = tempfile.mkdtemp(prefix="bench-redis-")
        proc, url = start_redis(workdir)
    try:
        metrics: dict[str, float] = {}
        ratios: dict[str, float] = {}
        shapes = [s for s in args.shapes.split(",") if s]
        for shape in shapes:
            m = bench_shape(shape, url, args.seconds, args.rounds)
            metrics.update({f"{shape}_{k}": v for k, v in m.items()})
            ratios[f"redis_put_vs_raw_set_{shape}"] = m["redis_put_ops_s"] / m["raw_set_ops_s"]
            ratios[f"redis_sample_vs_raw_get_{shape}"] = m["redis_sample_ops_s"] / m["raw_get_ops_s"]
            ratios[f"redis_sample_uncached_vs_raw_get_{shape}"] = (m["redis_sample_uncached_ops_s"]
                                                                  / m["raw_get_touched_ops_s"])
            ratios[f"redis_onpolicy_vs_raw_set_get_{shape}"] = m["redis_onpolicy_ops_s"] / m["raw_set_get_ops_s"]
        for key in ("redis_put_vs_raw_set", "redis_sample_vs_raw_get", "redis_sample_uncached_vs_raw_get",
                    "redis_onpolicy_vs_raw_set_get"):
            ratios[key] = min(ratios[f"{key}_{s}"] for s in shapes)
        metrics["redis_url"] = url if args.redis_url else "private redis-server (no persistence)"
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
    for shape in shapes:
        print(f"{shape}: put {metrics[f'{shape}_memory_put_transitions_s']:,.0f} (memory) / "
              f"{metrics[f'{shape}_redis_put_transitions_s']:,.0f} (redis) / "
              f"{metrics[f'{shape}_raw_set_transitions_s']:,.0f} (raw SET) transitions/s; "
              f"{metrics[f'{shape}_redis_put_mb_s']:,.0f} vs {metrics[f'{shape}_raw_set_mb_s']:,.0f} MB/s")
        print(f"{shape}: sample {metrics[f'{shape}_memory_sample_transitions_s']:,.0f} (memory) / "
              f"{metrics[f'{shape}_redis_sample_transitions_s']:,.0f} (redis) / "
              f"{metrics[f'{shape}_redis_sample_uncached_transitions_s']:,.0f} (redis, no cache) / "
              f"{metrics[f'{shape}_raw_get_transitions_s']:,.0f} (raw GET) transitions/s")
    from common import report

    targets = {k: ">=0.7" for k in ratios if not k.startswith("redis_sample_uncached")}
    report("replay", metrics, ratios, targets, args.out)


if __name__ == "__main__":
    main()
