"""Kill a training run for real, resume it, and it still solves CartPole with every counter continuing."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2
from tests.support_redis import redis_server  # noqa: F401

pytestmark = pytest.mark.minutes(1.1)  # on CI's 2 cores: the tiers start long files first

CKPT_EVERY = 5


def _rows(run_dir):
    if not (run_dir / "metrics.csv").exists():
        return []
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _train_then_sigkill(run_dir, spec: str, *sets: str) -> None:
    """Train in a session of its own; once two periodic checkpoints are behind it, SIGKILL the CLI and every
    service it started, with no chance to clean up."""
    args = [a for s in sets for a in ("--set", s)]
    train = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "train", spec, "--run-dir", str(run_dir),
                              "--quiet", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_rows(run_dir)) < 2 * CKPT_EVERY + 2:
        assert train.poll() is None and time.monotonic() < deadline, train.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.killpg(train.pid, signal.SIGKILL)
    train.wait()


def _assert_resumed_and_solved(rows, resumed_from: int):
    iters = [int(r["iteration"]) for r in rows]
    assert iters == list(range(1, len(rows) + 1)), "the curve must continue without a jump back"
    first = rows[resumed_from]  # the first row written by the resumed run
    assert int(first["iteration"]) == resumed_from + 1
    assert int(first["env_steps"]) == 256 * (resumed_from + 1)       # env steps continue
    assert int(first["weight_version"]) == resumed_from + 1          # weight versions continue
    assert int(first["optimizer_steps"]) == 20 * (resumed_from + 1)  # optimiser steps continue
    assert float(rows[-1]["eval_return_mean"]) >= 475


@pytest.mark.slow
def test_sigkill_learner_then_resume_solves(private_stack, tmp_path):
    stack, client = private_stack, private_stack.client
    run_dir = tmp_path / "run"
    # recovery off: the run fails, and a person resumes it by hand (tests/e2e/test_chaos.py covers recovery)
    status = client.submit("examples/cartpole_ppo.yaml", [f"checkpoint.every_iterations={CKPT_EVERY}",
                                                          "runtime.max_recoveries=0"], run_dir=run_dir)
    deadline = time.monotonic() + 120
    while len(_rows(run_dir)) < 2 * CKPT_EVERY + 2:
        assert time.monotonic() < deadline and not client.status(status.run_id).reason.startswith("reached")
        time.sleep(0.05)
    os.kill(stack.procs["learner"].pid, signal.SIGKILL)
    failed = client.wait(status.run_id)
    assert failed.state == coordinator_pb2.FAILED and "learner worker" in failed.reason
    replacement = stack.start_worker("learner", name="learner-2")  # a replacement registers
    assert not [w for w in client.workers() if w.alive and w.worker_id.startswith("learner")]
    deadline = time.monotonic() + 60
    while not [w for w in client.workers() if w.alive and w.pid == replacement.pid]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    resumed_from = max(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("ckpt-*.pt"))
    final = client.wait(client.resume(run_dir).run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    _assert_resumed_and_solved(_rows(run_dir), resumed_from)


@pytest.mark.slow
def test_sigkill_whole_run_then_cli_resume_solves(tmp_path):
    run_dir = tmp_path / "run"
    _train_then_sigkill(run_dir, "examples/cartpole_ppo.yaml", f"checkpoint.every_iterations={CKPT_EVERY}")
    resumed_from = max(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("ckpt-*.pt"))
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "resume", str(run_dir), "--quiet"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from checkpoints/ckpt-{resumed_from:010d}.pt" in proc.stderr
    _assert_resumed_and_solved(_rows(run_dir), resumed_from)


@pytest.mark.slow
def test_sac_on_redis_killed_and_resumed_keeps_its_replay_window(tmp_path, redis_server):  # noqa: F811
    """The off-policy window survives: after a SIGKILL of the whole run, the resumed run starts from the same
    replay window the killed one had (its untaken FIFO dropped), and goes on learning with counters continuing."""
    run_dir = tmp_path / "sac-redis"
    _train_then_sigkill(run_dir, "examples/pendulum_sac.yaml", "replay.store=redis", f"replay.redis_url={redis_server}",
                        f"checkpoint.every_iterations={CKPT_EVERY}", "train.stop_at_eval_return=null",
                        "train.total_env_steps=4096")
    stats = redis.Redis.from_url(redis_server).hgetall(f"rlfabric:{run_dir.name}:stats")
    window = int(stats[b"transitions"])
    assert window >= 2 * CKPT_EVERY * 128  # every collected epoch is in the window
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "resume", str(run_dir), "--quiet"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"kept {window} transitions in the replay window at this resume" in proc.stderr
    rows = _rows(run_dir)
    assert [int(r["iteration"]) for r in rows] == list(range(1, len(rows) + 1)) and int(rows[-1]["env_steps"]) == 4096
