"""Runs submitted to a live coordinator: lifecycle, metrics stream, artefacts, modes, stop, bad input."""

from __future__ import annotations

import csv
import threading
import time
from pathlib import Path

import grpc
import pytest

from rlfabric.services.coordinator.client import CoordinatorClient
from rlfabric.services.core.config import dump_yaml
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2
from tests.conftest import short_config


def _wait_idle(client: CoordinatorClient) -> None:
    deadline = time.monotonic() + 30
    while any(w.run_id for w in client.workers()):
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("mode,staleness", [("collocated", 0), ("disaggregated", 0), ("disaggregated", 2)])
def test_run_lifecycle_metrics_and_artefacts(stack, tmp_path, mode, staleness):
    _wait_idle(stack.client)
    cfg = short_config(scheduling={"mode": mode, "staleness": staleness, "pipeline_chunks": 2})
    run_dir = tmp_path / "run"
    status = stack.client.submit(cfg, run_dir=run_dir)
    events = list(stack.client.watch(status.run_id))
    states = [e.status.state for e in events if e.HasField("status")]
    assert states[:2] == [coordinator_pb2.PENDING, coordinator_pb2.RUNNING], states  # watched from its submission
    assert states[-1] == coordinator_pb2.SUCCEEDED, events[-1]
    rows = [e.metrics for e in events if e.HasField("metrics")]
    assert [r.iteration for r in rows] == list(range(1, 11))
    assert rows[-1].env_steps == 640 and rows[-1].weight_version == 10
    final = stack.client.status(status.run_id)
    assert final.env_steps == 640 and final.mode == mode and "finished 640 env steps" in final.reason
    for name in ("config.yaml", "metrics.csv", "curve.png", "checkpoints/final.pt"):
        assert (run_dir / name).is_file(), name
    assert list(run_dir.glob("events.out.tfevents.*"))
    table = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert len(table) == 10 and {"env_steps", "train_return_mean", "eval_return_mean"} <= set(table[0])
    assert [bool(r["eval_return_mean"]) for r in table] == [False] * 4 + [True] + [False] * 4 + [True]
    lags = [int(r["weight_version"]) - 1 - int(r["batch_version"]) for r in table]
    assert max(lags) <= staleness and min(lags) >= 0  # the learner never consumed data older than N - k
    if staleness:
        assert max(lags) >= 1  # and the rollout really ran ahead


def test_stop_takes_effect_at_an_iteration_boundary(stack):
    _wait_idle(stack.client)
    cfg = short_config(train={"total_env_steps": 10_000_000, "eval_every_iterations": 0},
                       scheduling={"mode": "disaggregated", "staleness": 1})
    status = stack.client.submit(cfg)
    deadline = time.monotonic() + 30
    while stack.client.status(status.run_id).env_steps < 640:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stopped = stack.client.stop(status.run_id)
    assert stopped.state == coordinator_pb2.STOPPED and "at an iteration boundary" in stopped.reason
    assert stack.client.status(status.run_id).env_steps % 64 == 0  # whole batches only, nothing half-counted
    _wait_idle(stack.client)  # workers are released for the next run


def test_unknown_env_id_fails_the_run_as_bad_input(stack):
    _wait_idle(stack.client)
    status = stack.client.submit(short_config(env={"id": "CartPol-v1"}))
    final = stack.client.wait(status.run_id)
    assert final.state == coordinator_pb2.FAILED and final.bad_input
    assert "env.id 'CartPol-v1' is not a registered gymnasium id" in final.reason
    assert "did you mean 'CartPole-v1'" in final.reason


def test_submit_validates_the_spec(stack):
    with pytest.raises(grpc.RpcError) as info:
        stack.client.submit("env:\n  num_envz: 3\n")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "env.num_envz: unknown field" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stack.client.status("no-such-run")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_replays_history_to_late_watchers(stack, tmp_path):
    _wait_idle(stack.client)
    status = stack.client.submit(dump_yaml(short_config()), overrides=["train.total_env_steps=128"])
    seen: list = []
    t = threading.Thread(target=lambda: seen.extend(stack.client.watch(status.run_id)))
    t.start()
    t.join(60)
    late = list(stack.client.watch(status.run_id))  # after the end: the full history, then it closes
    assert [e.WhichOneof("event") for e in late] == [e.WhichOneof("event") for e in seen]
    assert late[-1].status.state == coordinator_pb2.SUCCEEDED
    assert Path(stack.client.status(status.run_id).run_dir).is_dir()


def test_runs_and_watchers_a_coordinator_holds_are_bounded(tmp_path):
    """A client cannot make a coordinator hold unbounded runs or streams: past --max-active-runs a SubmitRun, past
    --max-watchers-per-run a WatchRun, is refused with RESOURCE_EXHAUSTED naming the flag and the fix."""
    import subprocess
    import sys
    import time

    import grpc
    import pytest

    from rlfabric.services.coordinator.client import CoordinatorClient
    from rlfabric.services.core import auth
    from tests.conftest import short_config

    port_file = tmp_path / "address"
    proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.coordinator.server", "--port-file", str(port_file),
                             "--runs-root", str(tmp_path), "--max-active-runs", "2", "--max-watchers-per-run", "1"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={k: v for k, v in __import__("os").environ.items() if k != "RLFABRIC_TOKEN"})
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        auth.configure("")
        client = CoordinatorClient(port_file.read_text().strip())
        cfg = short_config(runtime={"worker_wait_s": 120})  # no workers: both runs wait
        first, _ = client.submit(cfg), client.submit(cfg)
        with pytest.raises(grpc.RpcError, match="max-active-runs") as err:
            client.submit(cfg)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stream = client.stub.WatchRun(__import__("rlfabric.services.core.proto.rlfabric.v1.coordinator_pb2",
                                                 fromlist=["RunRef"]).RunRef(run_id=first.run_id))
        next(stream)  # the first watcher is in
        with pytest.raises(grpc.RpcError, match="max-watchers-per-run"):
            next(iter(client.watch(first.run_id, reconnect_s=0)))
        stream.cancel()
        client.stop(first.run_id)
        client.submit(cfg)  # a slot is free again
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)
