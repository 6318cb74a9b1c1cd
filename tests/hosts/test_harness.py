"""The harness itself, without services (a few seconds): the multi-host tests' faults are only as good as these.
Every host reaches every other one; a cut drops that one link, both ways, and nothing else; restore gives it back;
throttle puts a token bucket on both ends of the host's veth pair; and closing leaves no namespace, veth, bridge
or process behind."""

from __future__ import annotations

import subprocess
import sys

from tests.hosts.harness import GRPC_PORT


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=20).stdout


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout


def test_a_cut_drops_one_link_both_ways_and_restore_gives_it_back(make_hosts):
    hosts = make_hosts(("a", "b", "c"), tls=False)
    # nothing listens: a refusal (a RST) comes back, which is what "reaches" means; a drop times out
    pairs = [("a", "b"), ("b", "a"), ("a", "c"), ("c", "b"), ("root", "a"), ("b", "root")]
    assert all(hosts.reaches(x, y, GRPC_PORT) for x, y in pairs), "hosts do not reach each other"
    hosts.cut("a", "b")
    assert not hosts.reaches("a", "b", GRPC_PORT) and not hosts.reaches("b", "a", GRPC_PORT)
    assert all(hosts.reaches(x, y, GRPC_PORT) for x, y in [("a", "c"), ("c", "b"), ("root", "a"), ("b", "root")])
    hosts.restore("a", "b")
    assert hosts.reaches("a", "b", GRPC_PORT) and hosts.reaches("b", "a", GRPC_PORT)
    hosts.cut("root", "c")  # the rules go in c's namespace: the root's firewall is left alone
    assert not hosts.reaches("root", "c", GRPC_PORT) and hosts.reaches("a", "c", GRPC_PORT)
    hosts.restore("c", "root")
    assert hosts.reaches("root", "c", GRPC_PORT)


def test_throttle_shapes_both_directions_of_a_host_and_unthrottle_removes_it(make_hosts):
    hosts = make_hosts(("a", "b"), tls=False)
    hosts.throttle("a", "1mbit")
    inside = hosts["a"].run("tc", "qdisc", "show", "dev", "eth0").stdout
    outside = subprocess.run(["tc", "qdisc", "show", "dev", hosts["a"].veth], capture_output=True, text=True,
                             timeout=20).stdout
    assert "tbf" in inside and "rate 1Mbit" in inside, inside
    assert "tbf" in outside and "rate 1Mbit" in outside, outside
    assert hosts.reaches("a", "b", GRPC_PORT)
    hosts.unthrottle("a")
    assert "tbf" not in hosts["a"].run("tc", "qdisc", "show", "dev", "eth0").stdout


def test_closing_leaves_nothing_behind(make_hosts):
    hosts = make_hosts(("a", "b"), tls=False)
    sleeper = subprocess.Popen(hosts["a"].argv(sys.executable, "-c", "import time; time.sleep(600)"),
                               start_new_session=True)
    names = [h.ns for h in hosts.hosts.values()]
    veths = [h.veth for h in hosts.hosts.values()]
    assert all(n in _namespaces() for n in names)
    hosts.cut("a", "b")
    hosts.close()
    assert sleeper.wait(10) is not None  # a process still in a namespace is killed with it
    links, spaces = _links(), _namespaces()
    assert not [n for n in names if n in spaces], spaces
    assert not [v for v in [*veths, hosts.bridge] if f" {v}" in links or f" {v}@" in links], links
