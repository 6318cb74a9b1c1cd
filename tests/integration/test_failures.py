"""Injected failures and bad input: each gives a clear message, nothing hangs, the run reports why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from rlfabric.services.core.proto.rlfabric.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replay_pb2,
    replay_pb2_grpc,
)
from tests.conftest import grpc_channel, short_config

pytestmark = pytest.mark.minutes(0.5)  # on CI's 2 cores: the tiers start long files first


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfabric.services.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_sigkilled_env_worker_fails_the_run_with_the_reason_when_recovery_is_off(private_stack, tmp_path):
    stack, client = private_stack, private_stack.client
    cfg = short_config(train={"total_env_steps": 10_000_000, "eval_every_iterations": 0},
                       data_plane={"timeout_s": 20}, scheduling={"mode": "disaggregated"},  # env in its service
                       runtime={"worker_wait_s": 30, "max_recoveries": 0})
    status = client.submit(cfg)
    deadline = time.monotonic() + 60
    while client.status(status.run_id).env_steps < 1000:
        assert time.monotonic() < deadline, client.status(status.run_id)
        time.sleep(0.05)
    os.kill(stack.procs["env"].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    final = client.wait(status.run_id)
    took = time.monotonic() - killed_at
    assert final.state == coordinator_pb2.FAILED and not final.bad_input
    assert "env worker" in final.reason and "heartbeats" in final.reason and "discarded" in final.reason
    assert "runtime.max_recoveries=0" in final.reason and final.recoveries == 0
    assert took < 10, f"failure took {took:.1f}s to surface (heartbeat timeout 1.5s)"
    workers = {w.worker_id: w for w in client.workers()}
    assert not [w for w in workers.values() if w.worker_id.startswith("env")][0].alive
    assert all(not w.run_id for w in workers.values())  # survivors are released for the next run


def test_cli_malformed_yaml_exits_2_with_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("env:\n  id: CartPole-v1\n   num_envs: 8\n")
    proc = _cli("train", str(bad), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "line 3" in proc.stderr and "malformed YAML" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started for bad input


def test_cli_bad_field_and_override_exit_2(tmp_path):
    proc = _cli("train", "examples/cartpole_ppo.yaml", "--run-dir", str(tmp_path / "run"), "--set",
                "algorithm.n_epoch=3")
    assert proc.returncode == 2 and "did you mean 'algorithm.n_epochs'" in proc.stderr
    # the coordinator starts while the spec is validated; an invalid spec stops it and leaves no run behind
    assert not (tmp_path / "run").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout
    assert not left.strip(), f"service processes left running: {left}"
    proc = _cli("eval", str(tmp_path / "missing.pt"))
    assert proc.returncode == 2 and "no such checkpoint" in proc.stderr


def test_cli_unknown_env_id_exits_2_and_shuts_everything_down(tmp_path):
    proc = _cli("train", "examples/cartpole_ppo.yaml", "--run-dir", str(tmp_path / "run"), "--quiet",
                "--set", "env.id=CartPol-v1")
    assert proc.returncode == 2, proc.stderr
    assert "did you mean 'CartPole-v1'" in proc.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout
    assert not left.strip(), f"service processes left running: {left}"


def test_admin_calls_that_would_break_a_running_run_are_refused_while_it_owns_the_target(private_stack):
    """An outside Replay.Clear used to take the data from under a running run and fail it, and a DeregisterWorker
    of a busy worker failed it too. While a run owns them both are refused, naming the run and the fix; the run
    goes on, and once it has ended the same calls go through."""
    stack, client = private_stack, private_stack.client
    cfg = short_config(train={"total_env_steps": 10_000_000, "eval_every_iterations": 0},
                       data_plane={"timeout_s": 20}, scheduling={"mode": "disaggregated"})
    status = client.submit(cfg)
    deadline = time.monotonic() + 60
    while client.status(status.run_id).env_steps < 500:
        assert time.monotonic() < deadline, client.status(status.run_id)
        time.sleep(0.05)
    time.sleep(1.0)  # a heartbeat has told every worker which run holds it
    replay_worker = next(w for w in client.workers() if w.role == common_pb2.REPLAY)
    assert replay_worker.run_id == status.run_id
    title = Path(f"/proc/{replay_worker.pid}/cmdline")
    assert f"rlfabric-replay run={status.run_id} " in title.read_bytes().replace(b"\0", b" ").decode()
    with grpc_channel(replay_worker.endpoint.grpc) as channel:
        replay = replay_pb2_grpc.ReplayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            replay.Clear(replay_pb2.ClearRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and status.run_id in err.value.details()
        with grpc_channel(stack.address) as coord_channel:
            coordinator = coordinator_pb2_grpc.CoordinatorStub(coord_channel)
            with pytest.raises(grpc.RpcError) as err:
                coordinator.DeregisterWorker(coordinator_pb2.DeregisterWorkerRequest(
                    worker_id=replay_worker.worker_id, reason="operator"), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "rlfabric stop" in err.value.details()
            time.sleep(0.5)
            assert client.status(status.run_id).state == coordinator_pb2.RUNNING  # nothing reached the run
            client.stop(status.run_id)
            assert client.wait(status.run_id).state != coordinator_pb2.FAILED
            time.sleep(1.0)  # the next heartbeat frees the replay
            assert replay.Clear(replay_pb2.ClearRequest(), timeout=10).transitions == 0
            with pytest.raises(grpc.RpcError) as err:  # an idle worker is still not an outsider's to deregister
                coordinator.DeregisterWorker(coordinator_pb2.DeregisterWorkerRequest(
                    worker_id=replay_worker.worker_id, reason="operator"), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "run=" not in title.read_bytes().decode(errors="replace")  # its title no longer names the run


def test_a_long_call_whose_caller_went_away_stops_and_frees_the_worker(private_stack, tmp_path):
    """Regression: Evaluate with a huge episode count kept burning CPU after the caller gave up, and blocked later
    calls. Now the job stops at its next step once its caller is gone (Collect and Probe stop the same way)."""
    from rlfabric.services.core.proto.rlfabric.v1 import rollout_pb2, rollout_pb2_grpc

    client = private_stack.client
    final = client.wait(client.submit(short_config(), run_dir=tmp_path / "run").run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    [rollout] = [w for w in client.workers() if w.role == common_pb2.ROLLOUT]
    stub = rollout_pb2_grpc.RolloutStub(grpc_channel(rollout.endpoint.grpc))
    for call, request, field in (("Evaluate", rollout_pb2.EvaluateRequest(episodes=2**31 - 1), "episodes"),
                                 ("Probe", rollout_pb2.ProbeRequest(round_trips=2**31 - 1), "round_trips")):
        with pytest.raises(grpc.RpcError, match=f"{field} must be within") as err:  # absurd counts: refused
            getattr(stub, call)(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for call, request in (("Evaluate", rollout_pb2.EvaluateRequest(episodes=10_000)),):
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, call)(request, timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        t0 = time.monotonic()
        reply = stub.Evaluate(rollout_pb2.EvaluateRequest(episodes=2), timeout=20)
        assert len(reply.returns) == 2
        assert time.monotonic() - t0 < 5, f"the abandoned {call} still held the worker"


def test_stopping_a_run_that_waits_for_workers_is_immediate_and_keeps_none(private_stack, tmp_path):
    """A run still waiting for workers stops at once (it used to wait out the 60 s stop grace), holding none."""
    client = private_stack.client
    cfg = short_config(scheduling={"mode": "disaggregated", "rollout_workers": 2})  # the stack has one rollout
    run_id = client.submit(cfg, run_dir=tmp_path / "run").run_id
    time.sleep(0.5)
    assert client.status(run_id).state == coordinator_pb2.PENDING
    t0 = time.monotonic()
    final = client.stop(run_id)
    assert time.monotonic() - t0 < 5
    assert final.state == coordinator_pb2.STOPPED and "before the run was placed" in final.reason
    assert all(not w.run_id for w in client.workers())
