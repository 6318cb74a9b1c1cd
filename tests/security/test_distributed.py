"""torch.distributed out of strangers' reach (issue 19, finding 7): the stores and gloo devices of weight-sync pairs
and of a multi-rank learner listen on the service's own address, never all interfaces, and every group's keys
live under a random prefix handed over an authenticated channel, so a stranger who reaches a store can neither
find a group's rendezvous keys nor take a group's place by writing them."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from services.core.weight_transport import bind_address
from services.core.weights import WeightPublisher, WeightSubscriber, WeightSyncOptions

MiB = 1 << 20


def _decode(addr: str) -> tuple[str, int]:
    ip, port = addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listeners(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.add(_decode(fields[1]))
    return found


def _loopback_only(new: set[tuple[str, int]]) -> None:
    assert new, "nothing new listens: the check would prove nothing"
    assert {ip for ip, _ in new} <= {"127.0.0.1", "::ffff:127.0.0.1"}, f"listening beyond loopback: {sorted(new)}"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 100, generator=g), "b": torch.randn(300, generator=g)}


@pytest.fixture
def gloo_publisher():
    pub = WeightPublisher("127.0.0.1", 4 * MiB, sync=WeightSyncOptions(transport="gloo", bucket_bytes=64 * 1024))
    subs: list[WeightSubscriber] = []

    def subscriber() -> WeightSubscriber:
        sub = WeightSubscriber(pub.endpoint, 4 * MiB, timeout_s=5, sync=WeightSyncOptions(transport="gloo",
                                                                                          bucket_bytes=64 * 1024))
        subs.append(sub)
        return sub

    yield pub, subscriber
    for sub in subs:
        sub.close()
    pub.close()


def test_a_weight_pair_listens_on_the_service_address_only(gloo_publisher):
    pub, subscriber = gloo_publisher
    before = listeners(os.getpid())
    state = _state()
    pub.publish(0, state)
    version, got = subscriber().fetch(-1)
    assert version == 0 and np.array_equal(got["w"], state["w"].numpy())
    new = listeners(os.getpid()) - before  # the pair's store and both gloo devices (this process holds both ends)
    assert pub._pairs.port in {port for _, port in new}
    _loopback_only(new)


def test_the_store_binds_the_advertised_address_when_the_service_binds_all_interfaces():
    assert bind_address("127.0.0.1") == "127.0.0.1"
    assert bind_address("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert bind_address("0.0.0.0", "localhost") in ("127.0.0.1", "::1")
    with pytest.raises(OSError, match="--advertise-host"):
        bind_address("0.0.0.0", "no-such-host.invalid")


def test_a_stranger_cannot_take_a_weight_pair_by_writing_its_rendezvous_keys(gloo_publisher):
    """Pairs were numbered 1, 2, ... under a fixed prefix: a stranger who reached the store registered as rank 1
    of the next pair before its subscriber did, and the publisher sent that subscriber's weights to the stranger."""
    pub, subscriber = gloo_publisher
    state = _state()
    pub.publish(0, state)
    subscriber().fetch(-1)  # pair 1: the store now exists
    port = pub._pairs.port
    taken: dict[str, object] = {}

    def stranger() -> None:
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=4)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        try:
            taken["group"] = dist.ProcessGroupGloo(dist.PrefixStore("rlfabric/weights/pair/2/", store), 1, 2, opts)
        except RuntimeError as exc:  # nobody answered on those keys: the stranger got nothing
            taken["error"] = exc

    thread = threading.Thread(target=stranger, daemon=True)
    thread.start()
    probe = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5))
    deadline = time.monotonic() + 10
    while not probe.check(["rlfabric/weights/pair/2//0/1"]):  # rank 1's address, under the old fixed prefix
        assert time.monotonic() < deadline, "the stranger never wrote its rendezvous key"
        time.sleep(0.02)
    version, got = subscriber().fetch(-1)  # pair 2, the pair the stranger waits for
    assert version == 0 and np.array_equal(got["w"], state["w"].numpy())
    thread.join(timeout=15)
    assert not thread.is_alive() and "group" not in taken, "the stranger joined a weight-transfer group"


@pytest.fixture(scope="module")
def rank_group():
    from services.learner.ranks import RankGroup

    before = listeners(os.getpid())
    group = RankGroup(2, torch.device("cpu"), timeout_s=60)
    yield group, before
    group.close()


def _rank_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)


def test_the_learner_ranks_listen_on_loopback_only(rank_group):
    group, before = rank_group
    new = listeners(os.getpid()) - before  # the store and rank 0's gloo device
    assert int(_rank_env(group.procs[0].pid)["MASTER_PORT"]) in {port for _, port in new}
    _loopback_only(new)
    _loopback_only(listeners(group.procs[0].pid))  # rank 1's gloo device


def test_a_stranger_cannot_find_the_learner_ranks_keys(rank_group):
    """The group's keys sat at torch's well-known names (rank 1's gloo address at default_pg/0//cpu//0/1), so
    anyone who reached the store could read or overwrite them; and the prefix never shows in a rank's argv."""
    group, _ = rank_group
    env = _rank_env(group.procs[0].pid)
    stranger = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), None, False, timedelta(seconds=5))
    assert stranger.num_keys() > 0  # the group's keys are there ...
    assert not stranger.check(["default_pg/0//cpu//0/1"])  # ... but not where a stranger looks
    with open(f"/proc/{group.procs[0].pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace")
    prefix = env.get("RLFABRIC_LEARNER_STORE_PREFIX", "")
    assert len(prefix) == 32 and prefix not in argv
