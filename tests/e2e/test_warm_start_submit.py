"""A spec's warm_start stages are part of its run, whoever submits it: a notebook's Client.submit gets the demos
stage, the supervised run and the run from its checkpoint, as `rlfabric train` does (it is up + submit + watch).
The stages show in WatchRun and GetRun, a stop during them is resumed without repeating what was done, and the
supervised stage learns: the run starts from a policy that reaches the named ball where a fresh one does not."""

from __future__ import annotations

import csv

import pytest

from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2

pytest.importorskip("mujoco")

pytestmark = pytest.mark.minutes(0.8)

SPEC = """
name: warm-small
seed: 0
env:
  id: rlfabric/ArmReachLang-v0
  kwargs: {observation: state}
  action_chunk: 4
  num_envs: 8
  eval_envs: 16
policy:
  name: vla
  vla: {width: 32, heads: 2, layers: 1, head: tokens, bins: 11}
algorithm: {name: ppo, n_steps: 8, batch_size: 32, n_epochs: 1, critic_warmup: 2}
train: {total_env_steps: 128, eval_every_iterations: 1, eval_episodes: 32}
data_plane: {timeout_s: 10}
runtime: {worker_wait_s: 30}
warm_start:
  demos: 96
  supervised: {name: vla_sft, learning_rate: 0.003, batch_size: 64, total_updates: 600, updates_per_iteration: 100}
"""


def rows(path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path)))


def events(client, run_id: str) -> tuple[list[str], list[str], coordinator_pb2.RunStatus]:
    """The stages the run's status named in order, its log lines, and its final status."""
    stages, logs, final = [], [], None
    for event in client.watch(run_id):
        kind = event.WhichOneof("event")
        if kind == "status":
            final = event.status
            if not stages or stages[-1] != event.status.stage:
                stages.append(event.status.stage)
        elif kind == "log":
            logs.append(event.log.message)
    return stages, logs, final


def test_client_submit_runs_the_warm_start_stages_and_learns_from_them(stack, tmp_path):
    spec = tmp_path / "warm.yaml"
    spec.write_text(SPEC)
    client = stack.client
    status = client.submit(spec, run_dir=tmp_path / "run")
    stages, logs, final = events(client, status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, (final.reason, logs[-10:])
    assert stages == ["", "warm_start.demos", "warm_start.supervised", ""], stages  # pending, stages, the run
    assert any("96 expert episodes" in line for line in logs), logs
    assert any(line.startswith("warm start (supervised): iteration 6") for line in logs), logs
    supervised = {r.run_id: r for r in client.runs()}[status.run_id + ".supervised"]
    assert supervised.state == coordinator_pb2.SUCCEEDED and supervised.iteration == 6

    run_dir = tmp_path / "run"
    stage = run_dir / "warm_start"
    final_pt = (stage / "supervised" / "checkpoints" / "final.pt").resolve()
    assert (stage / "demos.npz").is_file() and str(final_pt) in (run_dir / "config.yaml").read_text()
    sft = rows(stage / "supervised" / "metrics.csv")
    losses = [float(r["sft_loss"]) for r in sft if r["sft_loss"]]
    assert losses[-1] < 0.6 * losses[0], losses
    rl = rows(run_dir / "metrics.csv")
    warm_success = float(next(r["eval_success_rate"] for r in rl if r["eval_success_rate"]))

    # the same spec with no warm start: the fresh policy, evaluated on the same scenes, rarely reaches the ball
    cold = client.submit(SPEC.split("warm_start:")[0], run_dir=tmp_path / "cold")
    assert client.wait(cold.run_id).state == coordinator_pb2.SUCCEEDED
    cold_success = float(next(r["eval_success_rate"] for r in rows(tmp_path / "cold" / "metrics.csv")
                              if r["eval_success_rate"]))
    assert warm_success >= 0.3 and warm_success >= cold_success + 0.2, (warm_success, cold_success)


def test_a_run_stopped_in_its_warm_start_resumes_without_repeating_a_stage(stack, tmp_path):
    spec = tmp_path / "warm.yaml"
    spec.write_text(SPEC)
    client = stack.client
    status = client.submit(spec, ["warm_start.supervised.total_updates=3000"], run_dir=tmp_path / "run")
    for event in client.watch(status.run_id):  # stop once the supervised run has taken its first iteration
        if event.WhichOneof("event") == "log" and event.log.message.startswith("warm start (supervised): iteration"):
            break
    stopped = client.stop(status.run_id)
    assert stopped.state == coordinator_pb2.STOPPED and "during the warm start" in stopped.reason, stopped.reason
    assert stopped.stage == "warm_start.supervised"
    import os
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "status", "--coordinator", stack.address],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "400", "RLFABRIC_TOKEN": stack.token})
    assert shown.returncode == 0, shown.stderr[-2000:]
    line = next(x for x in shown.stdout.splitlines() if x.startswith(f"│ {status.run_id} "))  # (not .supervised)
    assert "STOPPED" in line and "warm_start.supervised" in line, shown.stdout
    stage_line = next(x for x in shown.stdout.splitlines() if x.startswith(f"│ {status.run_id}.supervised "))
    assert f"rlfabric resume {tmp_path / 'run'}`" in stage_line, stage_line  # the run, not its stage
    stage = tmp_path / "run" / "warm_start"
    demos = (stage / "demos.npz").stat().st_mtime_ns
    done = len(rows(stage / "supervised" / "metrics.csv"))
    assert 1 <= done < 30

    resumed = client.resume(tmp_path / "run", ["warm_start.supervised.total_updates=1000"])
    stages, logs, final = events(client, resumed.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, (final.reason, logs[-10:])
    assert any("expert demonstrations kept from an earlier attempt" in line for line in logs), logs
    assert (stage / "demos.npz").stat().st_mtime_ns == demos
    sft = rows(stage / "supervised" / "metrics.csv")  # continued from its own checkpoint: no iteration twice
    assert [int(r["iteration"]) for r in sft] == list(range(1, 11)), [r["iteration"] for r in sft]
    # the run itself had no checkpoint when it resumed: it starts from the supervised one all the same
    rl = rows(tmp_path / "run" / "metrics.csv")
    assert float(next(r["eval_success_rate"] for r in rl if r["eval_success_rate"])) >= 0.3, rl


def test_a_coordinator_killed_during_the_supervised_stage_is_taken_up_where_it_was(private_stack, tmp_path):
    """SIGKILL of the coordinator while the supervised run trains: the restarted coordinator takes the run up from
    its run index, keeps the demonstrations, continues the supervised run from its own checkpoint and starts the
    run itself from its final one."""
    import os
    import signal
    import time

    stack, client = private_stack, private_stack.client
    stack.supervise(max_restarts=2, backoff_s=0.5)
    spec = tmp_path / "warm.yaml"
    spec.write_text(SPEC)
    status = client.submit(spec, ["checkpoint.every_iterations=2"], run_dir=tmp_path / "run")
    stage = tmp_path / "run" / "warm_start"
    deadline = time.monotonic() + 120
    while not list((stage / "supervised" / "checkpoints").glob("ckpt-*.pt")):  # a periodic one of its own
        assert time.monotonic() < deadline and client.status(status.run_id).state in (
            coordinator_pb2.PENDING, coordinator_pb2.RUNNING), client.status(status.run_id)
        time.sleep(0.05)
    demos = (stage / "demos.npz").stat().st_mtime_ns
    victim = stack.procs["coordinator"].pid
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while True:
        try:
            final = client.status(status.run_id)
            if final.state not in (coordinator_pb2.PENDING, coordinator_pb2.RUNNING):
                break
        except Exception:  # noqa: BLE001 — the coordinator is restarting
            pass
        assert time.monotonic() < deadline, "the run was not taken up and finished"
        time.sleep(0.2)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    assert stack.procs["coordinator"].pid != victim
    assert (stage / "demos.npz").stat().st_mtime_ns == demos
    sft = rows(stage / "supervised" / "metrics.csv")
    assert [int(r["iteration"]) for r in sft] == list(range(1, 7)), [r["iteration"] for r in sft]
    rl = rows(tmp_path / "run" / "metrics.csv")
    assert float(next(r["eval_success_rate"] for r in rl if r["eval_success_rate"])) >= 0.3, rl
