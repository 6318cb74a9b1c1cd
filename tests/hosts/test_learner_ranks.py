"""A learner whose ranks span two hosts, deployed as docs/deployment.md runs one on lab machines: four ranks of the
arithmetic GRPO learner (``runtime.learner_ranks: 4``, ``learner_ranks_per_host: 2``), ranks 0-1 on the learner's
host and ranks 2-3 on a rank host (``rlfabric serve learner --rank-host-for LEARNER``) that the learner names
(``--rank-hosts``), each service on a host of its own over mutual TLS. The learner asks the rank host to start its
ranks over gRPC; they meet rank 0 through its CURVE rendezvous; FSDP's collectives then cross the hosts' link. That
the ranks make the one-rank update exactly (and that a lost one is named) tests/integration/test_rank_hosts.py
checks on loopback; here the run trains, publishes every version and checkpoints the unsharded state."""

from __future__ import annotations

import re
import time

import pytest

from tests.hosts.harness import GRPC_PORT
from tests.hosts.test_deployment import finish, rows

pytestmark = [pytest.mark.slow, pytest.mark.minutes(1)]

ROLES = ("coordinator", "env", "rollout", "learner", "replay", "ranks")
SETS = ["policy.init_checkpoint=''", "runtime.learner_ranks=4", "runtime.learner_ranks_per_host=2",
        "env.num_envs=16", "env.eval_envs=8", "algorithm.minibatch_size=8", "train.total_env_steps=48",
        "train.eval_every_iterations=0", "scheduling.mode=disaggregated"]


def deploy(make_hosts, tls: bool):
    """Six hosts: the five services, the learner naming the sixth as its rank host, which serves it; all serving.
    (hosts, the learner's service, the rank host's service)."""
    hosts = make_hosts(ROLES, tls=tls)
    learner, ranks = hosts["learner"], hosts["ranks"]
    for role in ("coordinator", "env", "rollout", "replay"):
        hosts.serve(role, role)
    learner_service = hosts.serve("learner", learner, "--rank-hosts", f"{ranks.address}:{GRPC_PORT}")
    rank_host = hosts.serve("learner", ranks, "--rank-host-for", learner.address)
    hosts.wait_serving()
    return hosts, learner_service, rank_host


@pytest.mark.timeout(400)
def test_a_learner_of_four_ranks_on_two_hosts_trains_through_the_deployment(make_hosts):
    from rlfabric.services.learner import checkpoint as ckpt

    hosts, learner_service, rank_host = deploy(make_hosts, tls=True)
    ranks = rank_host.host

    run_dir = hosts.runs_root / "ranks"
    args = ["train", "examples/arith_grpo.yaml", "--coordinator", hosts.coordinator, "--run-dir", str(run_dir),
            "--quiet"]
    proc, out = hosts.client(*args, *[a for s in SETS for a in ("--set", s)])
    code, output = finish(hosts, proc, out, 300)
    assert code == 0, f"{output[-3000:]}\n{hosts.tails(40)}"
    got = rows(run_dir)
    assert [int(r["weight_version"]) for r in got] == [1, 2, 3]
    assert all(float(r["updated"]) == 1.0 for r in got)
    state = ckpt.unpack((run_dir / "checkpoints" / "final.pt").read_bytes(), "final.pt")
    assert state["weight_version"] == 3 and set(state["algorithm"]["optimizer"]["state"]) <= set(state["policy"])

    # ranks 2-3 ran on the rank host, listening on its address (not loopback), and the learner knew them as such
    started = [line for line in rank_host.log.read_text().splitlines() if "learner ranks started" in line]
    assert len(started) == 1 and '"ranks": "2..3"' in started[0], started
    assert f'"listen": "{ranks.address}"' in started[0], started[0]
    learner_log = learner_service.log.read_text()
    assert re.search(rf"learner ranks up.*ranks 2\.\.3 on {re.escape(ranks.address)}:{GRPC_PORT}", learner_log)


@pytest.mark.timeout(400)
def test_a_10_s_cut_between_the_learner_and_its_rank_host_is_recovered_from(make_hosts):
    """Mid-run, every packet between the learner's host and its rank host is dropped for 10 s: the group's next
    collective fails within data_plane.timeout_s (it never hangs) and the learner's health says so, naming the rank
    host; the coordinator recovers the run onto the same learner, whose new group waits for the rank host to be
    reachable again, and the run finishes from its last checkpoint. A recovery whose new group forms as the link
    comes back may see its first broadcast fail (once in a CI run: TCP's retries of the cut's connection attempts
    back off for seconds): that Configure fails as a group failure too, and the run recovers once more."""
    hosts, learner_service, rank_host = deploy(make_hosts, tls=False)
    learner, ranks = learner_service.host, rank_host.host
    run_dir = hosts.runs_root / "cut"
    sets = [*SETS, "train.total_env_steps=160", "data_plane.timeout_s=5", "runtime.max_recoveries=2",
            "checkpoint.every_iterations=1"]
    proc, out = hosts.client("train", "examples/arith_grpo.yaml", "--coordinator", hosts.coordinator, "--run-dir",
                             str(run_dir), "--quiet", *[a for s in sets for a in ("--set", s)])
    deadline = time.monotonic() + 180
    while len(rows(run_dir)) < 2:  # training is under way
        assert proc.poll() is None, f"the run ended before the cut:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no training within 180 s:\n{hosts.tails(30)}"
        time.sleep(0.1)
    hosts.cut(learner, ranks)
    time.sleep(10)
    hosts.restore(learner, ranks)
    code, output = finish(hosts, proc, out, 180)
    assert code == 0, f"{output[-3000:]}\n{hosts.tails(40)}"
    assert re.search(r"lost learner worker .*; recovering \(recovery 1 of at most 2\)", output), output[-3000:]
    died = [line for line in learner_service.log.read_text().splitlines() if "component died" in line]
    assert died and f"ranks 2..3 on {ranks.address}:{GRPC_PORT}" in died[0], died  # the health check named it
    assert len([line for line in rank_host.log.read_text().splitlines() if "learner ranks started" in line]) >= 2
    versions = [int(r["weight_version"]) for r in rows(run_dir)]
    assert versions[-1] == 160 // 16, versions  # every iteration trained, across the recovery
