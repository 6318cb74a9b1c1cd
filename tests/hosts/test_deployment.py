"""The README's CartPole PPO run deployed as docs/deployment.md's lab machines run it: coordinator, env, rollout,
learner and replay each on a host of its own (a network namespace, its own address), started with `rlfabric
serve`, and the run submitted with `rlfabric train --coordinator` from another host (the test's own). The plan is
disaggregated, so every hop (env steps, batches, weights) crosses the network. Then real network faults on that
deployment, none of which a test on loopback can make:

- the link between the learner's and the rollout's hosts cut for 10 s (a stall, not a death);
- the env host's traffic through a token bucket (a slow data plane);
- a rollout host cut from the coordinator only: lost, replaced by a spare, and its stale work refused;
- the robot gateway on its own host, cut from the host that commands its arms: every arm holds in its window.

The first four run beside another test file (they assert learning and recovery, not timing); the gateway's, whose
watchdog window is 0.1 s, runs alone."""

from __future__ import annotations

import csv
import subprocess
import time
from pathlib import Path

import pytest

from tests.hosts.harness import GRPC_PORT, Hosts

pytestmark = [pytest.mark.slow, pytest.mark.minutes(3)]

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



@pytest.mark.timeout(TRAIN_S + 180)
def test_a_rollout_host_cut_from_the_coordinator_is_replaced_and_its_stale_steps_refused(make_hosts):
    """Mid-run, the rollout's host loses its link to the coordinator only: it keeps running and still reaches
    env, replay and the learner. The coordinator declares it lost when its heartbeats stop and re-places the run
    on a spare rollout worker (a sixth host). The stale worker, still collecting, steps the env: the env refuses
    it (the attempt that placed it has ended: each attempt configures its workers with a new fence), so it
    cannot advance the new attempt's episodes nor put its batches into replay. When the link returns it
    registers anew, and the run reaches the threshold."""
    hosts = make_hosts([*ROLES, "spare"], tls=False)
    for role in ROLES:
        hosts.serve(role, role)
    hosts.wait_serving()
    spare = hosts.serve("rollout", "spare")  # registered last: the run is placed on the rollout host's worker
    hosts.wait_serving()
    rollout, coordinator = hosts["rollout"], hosts["coordinator"]
    cut = next(s for s in hosts.services if s.role == "rollout" and s.host is rollout)
    env_log = next(s for s in hosts.services if s.role == "env").log
    proc, out, run_dir = train(hosts)
    deadline = time.monotonic() + 180
    while len(rows(run_dir)) < 2:
        assert proc.poll() is None, f"the run ended before the cut:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no training within 180 s:\n{hosts.tails(30)}"
        time.sleep(0.1)
    assert "configured" in cut.log.read_text() and "configured" not in spare.log.read_text()
    hosts.cut(rollout, coordinator)
    cut_at = time.monotonic()
    assert hosts.reaches(rollout, hosts["env"], GRPC_PORT)  # only the coordinator's link is gone
    while not rows_of(run_dir / "recoveries.csv"):
        assert time.monotonic() - cut_at < 30, f"the cut worker was not declared lost in 30 s:\n{hosts.tails(30)}"
        time.sleep(0.1)
    lost_after = time.monotonic() - cut_at
    (recovery,) = rows_of(run_dir / "recoveries.csv")
    assert recovery["role"] == "rollout" and "heartbeats" in recovery["cause"], recovery
    while "configured" not in spare.log.read_text():  # re-placed on the spare (its reply may trail the row)
        assert time.monotonic() - cut_at < 40, f"the run was not re-placed on the spare:\n{hosts.tails(30)}"
        time.sleep(0.1)
    while "refused a request of an attempt of the run that has ended" not in env_log.read_text():
        assert time.monotonic() - cut_at < 40, f"the env refused nothing of the stale worker:\n{hosts.tails(30)}"
        time.sleep(0.1)
    refused_after = time.monotonic() - cut_at
    time.sleep(max(0.0, 10.0 - (time.monotonic() - cut_at)))
    hosts.restore(rollout, coordinator)
    code, output = finish(hosts, proc, out, TRAIN_S)
    assert_solved(code, output, run_dir, hosts)
    deadline = time.monotonic() + 15  # the restored worker's next heartbeat is refused: it registers anew
    while "registering again" not in cut.log.read_text():
        assert time.monotonic() < deadline, f"the restored worker did not register anew:\n{cut.tail()}"
        time.sleep(0.2)
    print(f"rollout worker lost {lost_after:.1f} s after the cut, its first stale env step refused at "
          f"{refused_after:.1f} s; recovery: {recovery}")


HZ, WATCHDOG = 100, 0.1  # the gateway's control rate and watchdog window (tests/e2e/test_robot_learner_kill.py's)


@pytest.mark.serial
@pytest.mark.timeout(240)
def test_cutting_the_rollout_host_from_the_robot_gateway_holds_every_arm_within_its_window(make_hosts):
    """The robot gateway on a host of its own, its sim arms driven by PPO whose env runs in the rollout worker
    (the policy's host commands the arms). The link between the rollout host and the gateway's host is cut
    mid-episode: every arm the policy was commanding goes into watchdog hold within its window plus one tick of
    its last command, and stays held while the link is down. The test watches every tick of every arm through a
    Teleop stream from its own host that never takes over."""
    pytest.importorskip("mujoco")
    from rlfabric.services.core import auth
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
    from rlfabric.services.core.runtime import GRPC_OPTIONS
    from tests.robot_support import ArmWatch

    hosts = make_hosts([*ROLES, "gateway"], tls=False)
    at = f"{hosts['gateway'].address}:{GRPC_PORT}"
    for role in ROLES:  # the workers that may dial the arms are allowed the gateway's address by their operator
        hosts.serve(role, role, *(["--allow-endpoints", at] if role in ("env", "rollout") else []))
    gateway = hosts.serve("robot_gateway", "gateway")
    hosts.wait_serving()
    hosts.coordinator_client().close()  # this process's auth: the deployment's token, in the clear
    run_dir = hosts.runs_root / "robot"
    proc, out = hosts.client(
        "train", "examples/robot_reach_ppo.yaml", "--coordinator", hosts.coordinator, "--run-dir", str(run_dir),
        "--quiet", *(x for s in (f"env.options.gateway={gateway.address}", f"env.options.hz={HZ}",
                                 f"env.options.watchdog_s={WATCHDOG}", "env.num_envs=2", "env.eval_envs=1",
                                 "scheduling.mode=disaggregated", "scheduling.env_placement=rollout",
                                 "algorithm.n_steps=60", "train.total_env_steps=1000000",
                                 "train.eval_every_iterations=0", "data_plane.timeout_s=20") for x in ("--set", s)))
    channel = auth.sync_channel(gateway.address, GRPC_OPTIONS)
    stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
    deadline = time.monotonic() + 120
    while len(rows(run_dir)) < 1:  # the first update is done: the policy is in the loop
        assert proc.poll() is None, f"the run ended early:\n{out.read_text()[-3000:]}\n{hosts.tails(30)}"
        assert time.monotonic() < deadline, f"no update within 120 s:\n{hosts.tails(30)}"
        time.sleep(0.1)
    watch = ArmWatch(stub, pb)
    time.sleep(0.5)
    commanded = watch.commanded()
    assert commanded, f"no arm was being commanded by the policy before the cut:\n{hosts.tails(20)}"
    hosts.cut("rollout", "gateway")
    time.sleep(3.0)
    ticks_at_restore = {rid: len(watch.states[rid]) for rid in watch.arms}
    hosts.restore("rollout", "gateway")
    watch.close()
    channel.close()
    proc.send_signal(subprocess.signal.SIGINT)  # the run itself is not the point: stop it
    for rid in commanded:
        waited, cut_off = watch.held_after_last_command(rid, WATCHDOG, 1.0 / HZ, ticks_at_restore[rid])
        print(f"{rid}: held {waited * 1000:.0f} ms after its last command ({cut_off} ticks cut off)")
