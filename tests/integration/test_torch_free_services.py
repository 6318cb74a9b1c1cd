"""Services that do not train stay without torch while they work, not only at import (tests/unit/test_imports.py):
a whole run on a stack of separate processes leaves libtorch unmapped in the coordinator, env and replay, and a
served robot gateway never maps it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rlfabric.services.coordinator.client import CoordinatorClient
from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2
from rlfabric.services.launcher import LocalStack
from tests.conftest import short_config


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_run_leaves_the_services_that_do_not_train_without_torch(tmp_path, monkeypatch):
    # separate interpreters: the default local launch forks every service from one server that preloads torch
    monkeypatch.setenv("RLFABRIC_LAUNCH", "exec")
    stack = LocalStack(log_dir=tmp_path / "logs", runs_root=tmp_path, heartbeat_timeout_s=5.0)
    stack.start()
    auth.configure(stack.token)
    client = CoordinatorClient(stack.address)
    try:
        client.wait_ready(60)
        deadline = time.monotonic() + 120
        while len([w for w in client.workers() if w.alive]) < 4:
            assert time.monotonic() < deadline, f"workers did not register; logs in {tmp_path / 'logs'}"
            time.sleep(0.1)
        run = client.submit(short_config(), run_dir=tmp_path / "run")
        assert client.wait(run.run_id).state == coordinator_pb2.SUCCEEDED
        mapped = {name: _maps_torch(proc.pid) for name, proc in stack.procs.items()}
        assert mapped == {"coordinator": False, "env": False, "replay": False, "learner": True, "rollout": True}
    finally:
        client.close()
        stack.stop()


def test_a_served_robot_gateway_maps_no_torch(tmp_path):
    port_file = tmp_path / "port"
    # as a gateway host starts it: through the command line, which must not bring torch in either
    proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "serve", "robot_gateway", "--port-file",
                             str(port_file), "--storage-root", str(tmp_path / "recordings")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RLFABRIC_TOKEN": "torch-free-test-token"})
    try:
        for _ in range(1200):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert port_file.exists(), f"the gateway did not start (exit code {proc.poll()})"
        assert not _maps_torch(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
