"""A learner whose ranks span hosts (``runtime.learner_ranks_per_host``): ranks started by a rank host (``rlfabric
serve learner --rank-host-for LEARNER``) meet rank 0 through its CURVE rendezvous, never a TCPStore, and make the
update one rank makes; a rank lost there is named. On loopback here; across network namespaces in
tests/hosts/test_learner_ranks_hosts.py."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.core.batch import TensorBatch  # noqa: E402
from rlfabric.services.core.config import ConfigError, parse_config  # noqa: E402
from rlfabric.services.core.dataplane import DataClient, RemoteError  # noqa: E402
from rlfabric.services.core.models import build_policy  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import learner_pb2  # noqa: E402
from rlfabric.services.core.weight_transport import listening_store, new_prefix  # noqa: E402
from rlfabric.services.learner.rank_host import RankHost  # noqa: E402
from rlfabric.services.learner.ranks import RankGroup, RankGroupFailed, RankHostError, Rendezvous  # noqa: E402
from tests.integration.test_learner_ranks import grpo_batch, one_rank_update, run_config  # noqa: E402
from tests.lm_support import SPEC  # noqa: E402
from tests.robot_support import serve_process  # noqa: E402

pytestmark = pytest.mark.minutes(0.4)  # on CI's 2 cores: the tiers start long files first
TOKEN = "learner-rank-host-test-token-0123456789"


@pytest.fixture
def rank_host(tmp_path):
    """A rank host for a learner on 127.0.0.1, and this process holding the deployment's token (as rank 0)."""
    with serve_process("learner", tmp_path / "rank-host", TOKEN, "--rank-host-for", "127.0.0.1") as address:
        auth.configure(TOKEN)
        try:
            yield address, tmp_path / "rank-host" / "learner.log"
        finally:
            auth.configure("")


def test_a_rank_on_a_rank_host_makes_the_one_rank_update_and_a_lost_one_is_named(rank_host):
    address, log = rank_host
    config = run_config("sequence")
    torch.manual_seed(config.seed)
    batch = grpo_batch(build_policy(config.spec.policy, SPEC, config.policy))
    expected = one_rank_update(config, batch)
    group = RankGroup(2, torch.device("cpu"), timeout_s=60, per_host=1, rank_hosts=(address,))
    try:
        assert group.procs == [] and len(group.remote_pids) == 1  # rank 1 is the rank host's
        policy, algo, _ = group.configure(config, SPEC, None, None)
        stats = group.update(algo, batch)
        got = group.weights(policy)
        assert stats["updated"] == 1.0 and algo.optimizer_steps == 6 and group.dead() is None
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=2e-5, rtol=1e-4, msg=name)
        assert "learner ranks started" in log.read_text()

        os.kill(group.remote_pids[0], signal.SIGKILL)  # the rank on the other host goes
        with pytest.raises(RuntimeError, match=f"ranks 1..1 on {address}"):  # fails, naming where, never hangs
            group.update(algo, batch)
    finally:
        group.close()


def test_a_group_that_breaks_before_its_first_broadcast_fails_configure_as_a_group_failure(rank_host):
    """Configure's broadcast of the weights is a collective across hosts too (a link just back from a cut may fail
    it): RankGroupFailed, naming the rank host, which the learner answers UNAVAILABLE with its health failing, so
    the coordinator recovers the run again instead of failing it (tests/hosts/test_learner_ranks.py's cut)."""
    address, _ = rank_host
    group = RankGroup(2, torch.device("cpu"), timeout_s=5, per_host=1, rank_hosts=(address,))
    try:
        os.kill(group.remote_pids[0], signal.SIGKILL)
        with pytest.raises(RankGroupFailed, match=f"ranks 1..1 on {address}"):
            group.configure(run_config("sequence"), SPEC, None, None)
        assert group.dead() is not None
    finally:
        group.close()


def test_ranks_beyond_the_learners_host_need_rank_hosts_and_whole_hosts():
    with pytest.raises(ValueError, match="needs 1 rank host.*--rank-host-for.*learner_ranks_per_host: 0"):
        RankGroup(4, torch.device("cpu"), timeout_s=10, per_host=2)
    with pytest.raises(RankHostError, match=r"rank host 127.0.0.1:1 did not start ranks 2..3: DEADLINE_EXCEEDED.*Fix"):
        RankGroup(4, torch.device("cpu"), timeout_s=2, per_host=2, rank_hosts=("127.0.0.1:1",))  # waited 2 s for it
    with pytest.raises(ConfigError, match="learner_ranks=3 is not a whole number of hosts"):
        parse_config("name: r\nenv: {adapter: text, id: arith, options: {group_size: 2}}\nalgorithm: {name: grpo}\n"
                     "runtime: {learner_ranks: 3, learner_ranks_per_host: 2}\n")


class _Runtime:
    def on_shutdown(self, hook) -> None:
        pass


def test_a_rank_host_starts_ranks_only_for_its_own_learner():
    host = RankHost(_Runtime(), "127.0.0.1")
    good = dict(world=2, first_rank=1, count=1, rendezvous="tcp://127.0.0.1:5555", prefix=new_prefix(),
                device="cpu", timeout_s=30)
    assert host.check(learner_pb2.HostRanksRequest(**good)) == "127.0.0.1"
    for field, value, why in [("rendezvous", "tcp://10.255.0.9:5555", "not this rank host's learner"),
                              ("rendezvous", "127.0.0.1:5555", "tcp://HOST:PORT"),
                              ("first_rank", 0, "rank 0 is the learner"), ("count", 2, "ranks outside"),
                              ("prefix", "../../etc", "prefix"), ("device", "tpu", "cpu or cuda"),
                              ("world", 65, "2..64")]:
        with pytest.raises(ValueError, match=why):
            host.check(learner_pb2.HostRanksRequest(**{**good, field: value}))


def test_the_rendezvous_serves_its_groups_keys_and_no_others():
    store = listening_store("127.0.0.1", 10)
    prefix = new_prefix()
    rendezvous = Rendezvous(store.port, prefix, "127.0.0.1", "", 10)
    client = DataClient(rendezvous.endpoint, max_bytes=1 << 20, timeout_s=10, peer="rendezvous")
    try:
        mine = f"rlfabric/learner/{prefix}/0"
        client.request("store", TensorBatch({"value": np.frombuffer(b"addr", np.uint8)},
                                            meta={"op": "set", "key": mine}))
        assert store.get(mine) == b"addr"  # on rank 0's store, where its local ranks read it
        store.set("rlfabric/learner/another-group/0", b"theirs")
        for meta in ({"op": "get", "key": "rlfabric/learner/another-group/0"}, {"op": "check", "keys": [mine, "x"]},
                     {"op": "set", "key": "rlfabric/weights/x"}, {"op": "num_keys", "key": mine}):
            with pytest.raises(RemoteError, match="outside this group's prefix|unknown store operation"):
                client.request("store", TensorBatch(meta=meta))
        assert store.get("rlfabric/learner/another-group/0") == b"theirs"
    finally:
        client.close()
        rendezvous.close()
