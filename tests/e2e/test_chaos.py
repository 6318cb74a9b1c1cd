"""Chaos: SIGKILL one service of a live run, whatever its role, and the run still reaches the CartPole threshold.

The stack restarts the dead process (its restart policy), the coordinator re-places the run on live workers and
resumes it from the learner's newest state inside the same run id; the loss is a RecoveryEvent on WatchRun and a
row of recoveries.csv that says what was discarded."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import time
from pathlib import Path

import grpc
import pytest
import redis

from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2
from tests.support_redis import redis_server  # noqa: F401

pytestmark = pytest.mark.minutes(4.3)  # on CI's 2 cores: the tiers start long files first

THRESHOLD = 475.0
TERMINAL = (coordinator_pb2.SUCCEEDED, coordinator_pb2.FAILED, coordinator_pb2.STOPPED)


CARTPOLE = "examples/cartpole_ppo.yaml"
CHAOS = ["checkpoint.every_iterations=5", "scheduling.mode=disaggregated",  # every role a process of its own
         "data_plane.timeout_s=10", "runtime.worker_wait_s=60"]


def status_of(client, run_id: str) -> coordinator_pb2.RunStatus:
    """GetRun, waiting out a coordinator that is restarting (its address answers again within seconds)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.status(run_id)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_steps(client, run_id: str, steps: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := status_of(client, run_id)).env_steps < steps:
        assert status.state in (coordinator_pb2.PENDING, coordinator_pb2.RUNNING), status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("role", ["env", "rollout", "replay", "learner", "coordinator"])
def test_a_run_survives_a_sigkill_of_any_role_and_reaches_the_threshold(private_stack, role):
    stack, client = private_stack, private_stack.client
    stack.supervise(max_restarts=3, backoff_s=0.5)
    status = client.submit(CARTPOLE, CHAOS)
    wait_steps(client, status.run_id, 6000)  # past the first periodic checkpoint (iteration 5: 1,280 steps)
    victim = stack.procs[role].pid
    os.kill(victim, signal.SIGKILL)
    events = list(client.watch(status.run_id))
    final = client.status(status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    assert f"reached eval return >= {THRESHOLD:g}" in final.reason
    assert stack.procs[role].pid != victim and stack.restarts == {role: 1}
    recoveries = [e.recovery for e in events if e.HasField("recovery")]
    assert final.recoveries == 1 and len(recoveries) == 1, recoveries
    event = recoveries[0]
    assert event.role == role and event.cause and event.discarded
    assert event.resumed_from and event.resumed_at_iteration > 0  # not from scratch
    rows = list(csv.DictReader(open(os.path.join(final.run_dir, "recoveries.csv"))))
    assert [r["role"] for r in rows] == [role] and rows[0]["discarded"] == event.discarded
    metrics = list(csv.DictReader(open(os.path.join(final.run_dir, "metrics.csv"))))
    versions = [int(r["weight_version"]) for r in metrics]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)  # continued, never went back
    assert float(metrics[-1]["eval_return_mean"]) >= THRESHOLD


@pytest.mark.slow
def test_sac_on_redis_survives_a_sigkill_of_its_replay_service_with_the_window_intact(private_stack,
                                                                                      redis_server):  # noqa: F811
    """Off-policy: the replay service dies, Redis keeps the window, and the recovered run samples the same window
    (nothing acknowledged is lost) and still reaches SAC's Pendulum target."""
    stack, client = private_stack, private_stack.client
    stack.supervise(max_restarts=3, backoff_s=0.5)
    spec = open("examples/pendulum_sac.yaml").read()
    status = client.submit(spec, ["replay.store=redis", f"replay.redis_url={redis_server}",
                                  "checkpoint.every_iterations=5", "scheduling.mode=disaggregated",
                                  "train.total_env_steps=15000", "data_plane.timeout_s=10"])
    wait_steps(client, status.run_id, 2500)  # past learning_starts: the learner samples the window
    store = redis.Redis.from_url(redis_server)
    os.kill(stack.procs["replay"].pid, signal.SIGKILL)
    window = int(store.hget(f"rlfabric:{status.run_id}:stats", "transitions"))
    events = list(client.watch(status.run_id))
    final = client.status(status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    assert "reached eval return >= -300" in final.reason
    [event] = [e.recovery for e in events if e.HasField("recovery")]
    assert event.role == "replay" and "nothing from replay" in event.discarded
    kept = [e.log.message for e in events if e.HasField("log") and "transitions in the replay window" in e.log.message]
    assert kept and int(kept[0].split()[1]) >= window, (kept, window)  # the window the dead replay had, or more


@pytest.mark.slow
@pytest.mark.serial  # kills on a wall clock (every 3 s for 60 s): beside a VLA recipe on the other core, one CI
# run's policy ended at an evaluation of 121 (15 recoveries)
def test_soak_a_random_service_killed_every_few_seconds_and_the_run_still_finishes(private_stack):
    """For a minute of training (a fixed 80k-step run, no early stop), a random service (env, rollout, replay,
    learner or the coordinator itself) is SIGKILLed every 3 s; the run recovers from each loss, finishes, and its final evaluation is at the
    threshold."""
    stack, client = private_stack, private_stack.client
    stack.supervise(max_restarts=20, backoff_s=0.2, max_backoff_s=1.0)
    status = client.submit(CARTPOLE, [*CHAOS, "runtime.max_recoveries=40", "train.stop_at_eval_return=null",
                                        "train.total_env_steps=80000"])
    rng = random.Random(0)
    kills: list[str] = []
    start = time.monotonic()
    wait_steps(client, status.run_id, 1000)
    while time.monotonic() - start < 60 and status_of(client, status.run_id).state not in TERMINAL:
        time.sleep(3.0)
        role = rng.choice(["env", "rollout", "replay", "learner", "coordinator"])
        proc = stack.procs[role]
        if proc.poll() is None and status_of(client, status.run_id).state not in TERMINAL:
            os.kill(proc.pid, signal.SIGKILL)
            kills.append(role)
    for _ in client.watch(status.run_id):
        pass
    final = status_of(client, status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, (final.reason, kills)
    assert len(kills) >= 10 and final.recoveries >= 10, (kills, final.recoveries)
    rows = list(csv.DictReader(open(os.path.join(final.run_dir, "recoveries.csv"))))
    assert len(rows) == final.recoveries and {role for r in rows for role in r["role"].split(",")} <= set(kills)
    metrics = list(csv.DictReader(open(os.path.join(final.run_dir, "metrics.csv"))))
    assert int(metrics[-1]["env_steps"]) >= 80_000 and float(metrics[-1]["eval_return_mean"]) >= THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("ended_by", ["last iteration", "target"])
def test_a_coordinator_lost_after_the_run_ended_finishes_it_when_restarted(private_stack, ended_by):
    """The coordinator dies after the learner saved the run's final checkpoint but before the run's end was
    recorded (a soak kill once landed there): the restarted coordinator finds the end in the checkpoint (the last
    iteration, or a target reached early), evaluates again what had not been evaluated, and the run succeeds
    instead of failing with nothing to resume or training on past its target."""
    stack, client = private_stack, private_stack.client
    overrides = (["train.stop_at_eval_return=null", "train.total_env_steps=2560"] if ended_by == "last iteration"
                 else ["train.stop_at_eval_return=0"])  # any policy's return: reached at the first evaluation
    status = client.submit(CARTPOLE, [*CHAOS, *overrides])
    index = Path(stack.runs_root) / ".coordinator" / "runs.json"
    wait_steps(client, status.run_id, 256)
    running = index.read_text()  # the index mid-run: the run, its config, not ended
    assert json.loads(running)["runs"][0]["state"] in ("PENDING", "RUNNING")
    for _ in client.watch(status.run_id):
        pass
    done = client.status(status.run_id)
    assert done.state == coordinator_pb2.SUCCEEDED, done.reason
    coordinator = stack.procs["coordinator"]
    os.kill(coordinator.pid, signal.SIGKILL)
    coordinator.wait()
    index.write_text(running)  # its end never recorded
    metrics_path = Path(done.run_dir) / "metrics.csv"
    lines = metrics_path.read_text().splitlines(keepends=True)
    assert lines[-1].startswith("10,")
    if ended_by == "last iteration":
        metrics_path.write_text("".join(lines[:-1]))  # nor the final evaluation
    stack.supervise(max_restarts=1, backoff_s=0.1)
    events = list(client.watch(status.run_id))
    final = status_of(client, status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED and final.recoveries == 1, final.reason
    assert done.reason.split(" (")[0] in final.reason  # (the best return may count the evaluation made again)
    said = [e.log.message for e in events if e.HasField("log") and "already holds the run's end" in e.log.message]
    assert said and ("evaluated again" in said[0]) == (ended_by == "last iteration"), said
    metrics = list(csv.DictReader(open(metrics_path)))
    assert [int(r["iteration"]) for r in metrics] == list(range(1, 11)) and metrics[-1]["eval_return_mean"]
