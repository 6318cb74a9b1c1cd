"""Service processes say what they are: ``rlfabric-<role> [run=<id>] grpc=:<port>`` in ps/top (issue: every
process showed the same ``python -c from multiprocessing.forkserver ...`` line)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def test_a_served_process_is_titled_with_its_role_and_port(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "serve", "robot_gateway", "--port-file",
                             str(port_file)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "RLFABRIC_TOKEN": "process-titles-test-token"})
    try:
        for _ in range(1200):  # a loaded CI machine takes a while to import torch
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert port_file.exists(), f"the gateway did not start (exit code {proc.poll()})"
        port = port_file.read_text().strip().rsplit(":", 1)[1]
        time.sleep(0.2)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        assert cmdline == f"rlfabric-robot_gateway grpc=:{port}", cmdline
    finally:
        proc.terminate()
        proc.wait(timeout=10)


TITLES = """
import asyncio, setproctitle
from rlfabric.services.core.runtime import ServiceOptions, ServiceRuntime

async def titles():  # a runtime is built inside its event loop, as run_service builds it (grpc.aio needs one)
    runtime = ServiceRuntime(ServiceOptions(role="learner"))
    print(setproctitle.getproctitle())
    runtime.port = 50123
    runtime.state = "busy:run-7f3a"
    print(setproctitle.getproctitle())
    runtime.state = "idle"
    print(setproctitle.getproctitle())

asyncio.run(titles())
"""


def test_the_title_names_the_run_a_service_works_for():
    """In a fresh interpreter, as a service starts: setproctitle takes over argv's memory on its first call, which
    fails (an empty title) in a process whose environment grew before it, such as a test runner that ran others."""
    proc = subprocess.run([sys.executable, "-c", TITLES], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["rlfabric-learner", "rlfabric-learner run=run-7f3a grpc=:50123",
                                        "rlfabric-learner grpc=:50123"]
