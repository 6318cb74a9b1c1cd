"""Fixtures of the multi-host tests: ``make_hosts`` builds hosts (network namespaces on a private bridge, see
harness.py) that are torn down however the test ends, and shows every service's log when it failed."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.hosts.harness import Hosts, unavailable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so that a fixture's teardown knows whether the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _probe_namespaces() -> str:
    """Why no network namespace can be made here ('' when one can): root and `ip` are not always enough (a
    container without CAP_SYS_ADMIN)."""
    reason = unavailable()
    if reason:
        return reason
    name = f"rlf{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return ""


@pytest.fixture
def make_hosts(request, tmp_path):
    """``make_hosts(names, tls=True)``: that many hosts, entered; every one made is closed at teardown (processes
    killed by process group, rules, qdiscs, namespaces, veths, the bridge), and a failed test prints the tail of
    every service's output and log."""
    reason = _probe_namespaces()
    if reason:
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(names, tls: bool = True) -> Hosts:
        hosts = Hosts(list(names), tmp_path / f"hosts{len(made)}", tls=tls)
        made.append(hosts)
        return hosts.__enter__()

    try:
        yield make
    finally:
        failed = any(getattr(request.node, f"rep_{when}", None) is not None and
                     getattr(request.node, f"rep_{when}").failed for when in ("setup", "call"))
        for hosts in made:
            if failed:
                print(f"\n===== services of {hosts.tmp} =====\n{hosts.tails(60)}")
            hosts.close()
