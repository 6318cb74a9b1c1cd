"""The README's CartPole PPO run deployed as docs/deployment.md's lab machines run it: coordinator, env, rollout,
learner and replay each on a host of its own (a network namespace, its own address), started with `rlfabric
serve`, and the run submitted with `rlfabric train --coordinator` from another host (the test's own). The plan is
disaggregated, so the rollout and the learner are on different hosts and weights cross the network. Then real
network faults on that deployment: the link between the learner's and the rollout's hosts cut for 10 s, and the
env host's traffic through a token bucket. None of this runs on loopback, where every test of one machine runs."""

from __future__ import annotations

import csv
import subprocess
import time
from pathlib import Path

import pytest

from tests.hosts.harness import GRPC_PORT, Hosts

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.minutes(6)]

THRESHOLD = 475.0  # examples/cartpole_ppo.yaml's stop_at_eval_return, as tests/e2e/test_cartpole.py asserts
SPEC = "examples/cartpole_ppo.yaml"
PLAN = ["scheduling.mode=disaggregated", "scheduling.pipeline_chunks=2"]  # every role a worker of its own
ROLES = ("coordinator", "env", "rollout", "learner", "replay")
TRAIN_S = 300  # the longest a run may take here (a clean one takes about a minute on 2 cores): then it hangs
RATE = "2mbit"  # the env host's token bucket: a few hundred bytes each way per env step, ~15k steps and eval steps
CLEAN_KEY = "rlfabric/hosts/clean_steps_per_s"  # the clean run's env steps/s (pytest's cache), for the throttled run


def deploy(make_hosts, tls: bool) -> Hosts:
    """Five hosts, one service on each, all serving."""
    hosts = make_hosts(ROLES, tls=tls)
    for role in ROLES:
        hosts.serve(role, role)
    hosts.wait_serving()
    return hosts


def train(hosts: Hosts, *sets: str) -> tuple[subprocess.Popen, Path, Path]:
    """`rlfabric train SPEC --coordinator ...` from the root host: (its process, its output, the run directory)."""
    run_dir = hosts.runs_root / "run"
    args = ["train", SPEC, "--coordinator", hosts.coordinator, "--run-dir", str(run_dir), "--quiet"]
    for s in [*PLAN, *sets]:
        args += ["--set", s]
    proc, out = hosts.client(*args)
    return proc, out, run_dir


def finish(hosts: Hosts, proc: subprocess.Popen, out: Path, timeout_s: float) -> tuple[int, str]:
    """The client's exit code and output once it ends; a client still running after ``timeout_s`` is a hang."""
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not end within {timeout_s:.0f} s (a hang):\n{hosts.tails(40)}")
    return code, out.read_text(errors="replace")


def rows_of(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path))) if path.exists() else []


def rows(run_dir: Path) -> list[dict[str, str]]:
    """The run's metrics so far (the coordinator appends a row per iteration: one being written is left out)."""
    return [r for r in rows_of(run_dir / "metrics.csv") if r.get("env_steps") and r.get("fps") is not None]


def steps_per_s(rows_: list[dict[str, str]]) -> float:
    """Mean env steps per second over the run's training iterations (its fps column)."""
    fps = [float(r["fps"]) for r in rows_ if r.get("fps")]
    return sum(fps) / len(fps) if fps else 0.0


def assert_solved(code: int, output: str, run_dir: Path, hosts: Hosts) -> list[dict[str, str]]:
    assert code == 0, f"{output[-3000:]}\n{hosts.tails(40)}"
    assert f"reached eval return >= {THRESHOLD:g}" in output, output[-3000:]
    got = rows(run_dir)
    evals = [float(r["eval_return_mean"]) for r in got if r["eval_return_mean"]]
    assert evals and evals[-1] >= THRESHOLD, evals
    assert (run_dir / "checkpoints" / "final.pt").is_file()
    return got


@pytest.mark.timeout(TRAIN_S + 180)
def test_cartpole_ppo_with_each_service_on_a_host_of_its_own_reaches_the_threshold(make_hosts, request):
    """Over mutual TLS, as the docs' lab recipe: each worker registered from its own address (gRPC and data
    plane), and the run, submitted from a sixth host, reaches the threshold."""
    hosts = deploy(make_hosts, tls=True)
    client = hosts.coordinator_client()
    try:
        client.wait_ready(30)
        deadline = time.monotonic() + 60
        while len([w for w in client.workers() if w.alive]) < len(ROLES) - 1:
            assert time.monotonic() < deadline, f"workers did not register:\n{hosts.tails(30)}"
            time.sleep(0.2)
        from rlfabric.services.core.proto.rlfabric.v1 import common_pb2

        placed = {common_pb2.Role.Name(w.role).lower(): w.endpoint for w in client.workers()}
    finally:
        client.close()
    for role in ROLES[1:]:
        assert placed[role].grpc == f"{hosts[role].address}:{GRPC_PORT}", (role, placed[role])
        if placed[role].data:  # rollout has no data port: it only connects
            assert placed[role].data.startswith(f"tcp://{hosts[role].address}:"), (role, placed[role])
    start = time.monotonic()
    proc, out, run_dir = train(hosts)
    code, output = finish(hosts, proc, out, TRAIN_S)
    got = assert_solved(code, output, run_dir, hosts)
    rate = steps_per_s(got)
    if getattr(request.config, "cache", None) is not None:
        request.config.cache.set(CLEAN_KEY, rate)
    print(f"clean run: {got[-1]['env_steps']} env steps in {time.monotonic() - start:.0f} s, {rate:.0f} env steps/s")


@pytest.mark.timeout(TRAIN_S + 180)
def test_a_10_s_cut_between_the_learner_and_rollout_hosts_is_survived_or_named(make_hosts):
    """Mid-run, every packet between the learner's host and the rollout's host is dropped for 10 s (the weights'
    link; both still reach the coordinator and the rest). The run then either recovers and reaches the threshold,
    or fails with an error that names the link (either host's address); never hangs."""
    hosts = deploy(make_hosts, tls=False)
    learner, rollout = hosts["learner"], hosts["rollout"]
    start = time.monotonic()
    proc, out, run_dir = train(hosts)
    deadline = time.monotonic() + 180
    while len(rows(run_dir)) < 2:  # training is under way: two iterations done (of ~20)
        assert proc.poll() is None, f"the run ended before the cut:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no training within 180 s:\n{hosts.tails(30)}"
        time.sleep(0.1)
    steps_at_cut = int(rows(run_dir)[-1]["env_steps"])
    cut_at = time.monotonic()
    hosts.cut(learner, rollout)
    assert not hosts.reaches(learner, rollout, GRPC_PORT) and not hosts.reaches(rollout, learner, GRPC_PORT)
    assert hosts.reaches(learner, hosts["coordinator"], GRPC_PORT)  # that link only
    time.sleep(max(0.0, 10.0 - (time.monotonic() - cut_at)))
    hosts.restore(learner, rollout)
    steps_at_restore = int(rows(run_dir)[-1]["env_steps"])
    running_at_restore = proc.poll() is None
    code, output = finish(hosts, proc, out, TRAIN_S)
    got = rows(run_dir)
    recoveries = rows_of(run_dir / "recoveries.csv")
    print(f"cut at {steps_at_cut} env steps, restored after 10 s at {steps_at_restore} (run still going: "
          f"{running_at_restore}); ended with exit {code} at {got[-1]['env_steps'] if got else 0} env steps, "
          f"{time.monotonic() - start:.0f} s after submit; recoveries: {recoveries}")
    if code == 0:
        assert_solved(code, output, run_dir, hosts)
    else:
        named = [a for a in (learner.address, rollout.address) if a in output]
        assert named, f"the run failed without naming the link:\n{output[-3000:]}\n{hosts.tails(40)}"


@pytest.mark.timeout(TRAIN_S + 180)
def test_the_run_still_learns_with_the_env_hosts_traffic_through_a_token_bucket(make_hosts, request):
    """The env host's traffic (its data plane to the rollout, its control plane) shaped to RATE each way with tbf
    (every env step of the run and of its evaluations crosses that link): the run still reaches the threshold. Its env steps/s against the clean run's are printed, not asserted
    (this machine's 2 cores are shared with the five services)."""
    hosts = deploy(make_hosts, tls=False)
    hosts.throttle("env", RATE)
    start = time.monotonic()
    proc, out, run_dir = train(hosts)
    code, output = finish(hosts, proc, out, TRAIN_S)
    got = assert_solved(code, output, run_dir, hosts)
    clean = request.config.cache.get(CLEAN_KEY, None) if getattr(request.config, "cache", None) else None
    print(f"env host at {RATE}: {got[-1]['env_steps']} env steps in {time.monotonic() - start:.0f} s, "
          f"{steps_per_s(got):.0f} env steps/s; clean run: "
          + (f"{clean:.0f} env steps/s (the last one measured here)" if clean else "none measured here yet"))
