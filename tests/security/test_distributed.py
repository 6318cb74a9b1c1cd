"""torch.distributed out of strangers' reach (issue 19, finding 7; issue 39, finding 1): a weight-sync pair has no
TCP store (its keys live in the publisher's process, reached over the authenticated weight channel), a multi-rank
learner's store listens on loopback, every gloo device on the service's own address, never all interfaces, and
every group's keys live under a random prefix handed over an authenticated channel."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlfabric.services.core.weight_transport import bind_address
from rlfabric.services.core.weights import WeightPublisher, WeightSubscriber, WeightSyncOptions

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
    new = listeners(os.getpid()) - before  # both gloo devices (this process holds both ends): no store
    _loopback_only(new)


def test_the_store_binds_the_advertised_address_when_the_service_binds_all_interfaces():
    assert bind_address("127.0.0.1") == "127.0.0.1"
    assert bind_address("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert bind_address("0.0.0.0", "localhost") in ("127.0.0.1", "::1")
    with pytest.raises(OSError, match="--advertise-host"):
        bind_address("0.0.0.0", "no-such-host.invalid")


def test_a_pair_reads_and_writes_its_own_rendezvous_keys_only():
    """The weight channel's store requests come from token holders: each reaches only its pair's keys, bounded."""
    from rlfabric.services.core.weight_transport import MAX_VALUE_BYTES, PairHost

    host = PairHost("gloo", "127.0.0.1")
    try:
        a, prefix_a = host.join("127.0.0.1", 2.0)
        b, prefix_b = host.join("127.0.0.1", 2.0)
        mine, theirs = f"rlfabric/weights/{prefix_a}/x", f"rlfabric/weights/{prefix_b}/x"
        host.store_op(a, {"op": "set", "key": mine}, b"1")
        assert host.store_op(a, {"op": "get", "key": mine}, b"") == ({"found": True}, b"1")
        assert host.store_op(a, {"op": "add", "key": mine + "n", "amount": 2}, b"")[0] == {"value": 2}
        for meta, value in [({"op": "get", "key": theirs}, b""), ({"op": "set", "key": "x"}, b"1"),
                            ({"op": "check", "keys": [mine, theirs]}, b""), ({"op": "num_keys"}, b""),
                            ({"op": "add", "key": mine, "amount": "1"}, b""),
                            ({"op": "set", "key": mine}, b"x" * (MAX_VALUE_BYTES + 1))]:
            with pytest.raises(ValueError, match="weights: "):
                host.store_op(a, meta, value)
        assert host.store_op(b, {"op": "get", "key": theirs}, b"") == ({"found": False}, b"")
        with pytest.raises(ValueError, match="closed or unknown"):
            host.store_op(99, {"op": "get", "key": mine}, b"")
    finally:
        host.close()


# A stranger's probe of every port it is given: a raw connect first (2 s), then, where something accepts, a
# TCPStore client that lists the keys ("list") and tries to take rank 1 of every group whose keys it saw ("join").
# A probe that hangs (a gloo device or the CURVE data plane, neither of which speaks the store's protocol) counts
# as no store. Prints one JSON object: port -> what it got.
STRANGER = """
import json, os, socket, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
mode, host, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]
got = {}
def probe(port):
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        got[port] = "refused: " + type(exc).__name__
        return
    got[port] = "accepts, no store answered"
    store = dist.TCPStore(host, port, None, False, timedelta(seconds=3))
    keys = store.list_keys()
    got[port] = "listed: " + ", ".join(keys)
    if mode == "join":
        for key in keys:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=3)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=socket.gethostbyname(socket.gethostname()))]
            try:
                dist.ProcessGroupGloo(dist.PrefixStore(key.rsplit("/", 2)[0], store), 1, 2, opts)
                got[port] = "joined the group of " + key
            except Exception as exc:
                got[port] += " (join failed: " + type(exc).__name__ + ")"
threads = [threading.Thread(target=probe, args=(p,), daemon=True) for p in ports]
for t in threads:
    t.start()
deadline = time.monotonic() + 5
for t in threads:
    t.join(max(0.0, deadline - time.monotonic()))
print(json.dumps({str(p): got.get(p, "accepts, no store answered") for p in ports}), flush=True)
os._exit(0)
"""


@pytest.mark.slow  # ~18 s (a namespace, a rank group, two strangers that wait out probes that hang): the fast tier
# was at its 10-minute budget
def test_strangers_on_another_host_can_neither_list_nor_join_a_torch_distributed_group(tmp_path):
    """Issue 39, finding 1: a TCPStore client lists every key of its server, and the publisher's weight-pair store
    listened on the service's address, so a stranger that reached it read the pair's random prefix and could race
    its rendezvous. Two stranger processes on another host (a network namespace) now probe every port a weight
    pair and a 2-rank learner listen on: none answers as a store, none lets them join, and the pair still moves
    the next weight version."""
    import json

    from rlfabric.services.learner.ranks import RankGroup
    from tests.netns import other_host, run_there

    with other_host() as (namespace, here, _):
        before = listeners(os.getpid())
        pub = WeightPublisher(here, 4 * MiB, sync=WeightSyncOptions(transport="gloo", bucket_bytes=64 * 1024))
        sub = WeightSubscriber(pub.endpoint, 4 * MiB, timeout_s=5, sync=WeightSyncOptions(transport="gloo",
                                                                                          bucket_bytes=64 * 1024))
        ranks = RankGroup(2, torch.device("cpu"), timeout_s=60)
        try:
            state = _state()
            pub.publish(0, state)
            assert sub.fetch(-1)[0] == 0 and sub._pair is not None  # the pair's group exists: gloo, not zmq
            ports = {port for _, port in listeners(os.getpid()) - before}
            ports |= {port for _, port in listeners(ranks.procs[0].pid)}
            assert len(ports) >= 4, ports  # the data plane, the pair's gloo devices, the ranks' store and devices
            for mode in ("list", "join"):
                result = run_there(namespace, STRANGER, mode, here, *map(str, sorted(ports)))
                assert result.returncode == 0, result.stderr[-2000:]
                got = json.loads(result.stdout.strip().splitlines()[-1])
                assert not [f"{p}: {g}" for p, g in got.items() if g.startswith(("listed", "joined"))], got
            pub.publish(1, {k: v + 1 for k, v in state.items()})
            version, fetched = sub.fetch(0)
            assert version == 1 and np.allclose(fetched["w"], state["w"].numpy() + 1)
        finally:
            ranks.close()
            sub.close()
            pub.close()


@pytest.fixture(scope="module")
def rank_group():
    from rlfabric.services.learner.ranks import RankGroup

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
