"""A second host for tests: a Linux network namespace joined to this one by a veth pair, each end with its own
address. Root and iproute2 make one; elsewhere the test skips and says why. Torn down however the test ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@contextmanager
def other_host() -> Iterator[tuple[str, str, str]]:
    """Yields (namespace, this side's address, the other host's address) on a private /30."""
    if shutil.which("ip") is None:
        pytest.skip("no iproute2 (`ip`) here to make a network namespace: apt-get install iproute2")
    if os.geteuid() != 0:
        pytest.skip("making a network namespace needs root (CI runs as root)")
    tag = f"{os.getpid() % 100000}"
    name, here, there = f"rlf-ns{tag}", f"rlfh{tag}", f"rlfs{tag}"
    subnet = f"10.213.{os.getpid() % 250}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", name)
        _ip("addr", "add", f"{subnet}.1/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{subnet}.2/30", "dev", there)
        _ip("netns", "exec", name, "ip", "link", "set", there, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, f"{subnet}.1", f"{subnet}.2"
    finally:
        with suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _ip("link", "del", here)
        with suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _ip("netns", "del", name)


def run_there(namespace: str, code: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """``python -c code args`` inside ``namespace`` (this checkout importable), its output captured."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=timeout_s, env=env)
