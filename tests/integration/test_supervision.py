"""The local stack's restart policy (on-failure): a SIGKILLed worker process is started again after a back-off, it
registers with the coordinator again (its process titled with its role), and once its restarts run out it stays
down and the stack names it dead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rlfabric.services.core.proto.rlfabric.v1 import common_pb2


def wait_for(what, timeout_s: float = 60.0, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {what.__doc__ or what}")


def test_a_killed_worker_is_restarted_with_back_off_until_its_restarts_run_out(private_stack):
    stack, client = private_stack, private_stack.client
    stack.supervise(max_restarts=1, backoff_s=0.5)

    def alive_env_pids() -> set[int]:
        return {w.pid for w in client.workers() if w.alive and w.role == common_pb2.ENV}

    first = stack.procs["env"].pid
    wait_for(lambda: first in alive_env_pids())
    os.kill(first, signal.SIGKILL)
    killed = time.monotonic()
    second = wait_for(lambda: stack.procs["env"].pid if stack.procs["env"].pid != first else None)
    assert time.monotonic() - killed >= 0.4  # after the back-off, not in a tight loop
    wait_for(lambda: second in alive_env_pids())  # registered again, as a new worker
    title = Path(f"/proc/{second}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert title.startswith("rlfabric-env"), title
    assert stack.restarts == {"env": 1} and stack.dead() == {}

    os.kill(second, signal.SIGKILL)  # its one restart is spent: it stays down, and the stack says so
    assert wait_for(lambda: stack.dead()) == {"env": -signal.SIGKILL}
    time.sleep(1.0)
    assert stack.procs["env"].pid == second and stack.restarts == {"env": 1}
    assert stack.procs["learner"].poll() is None  # the other workers were never touched


def test_serve_restart_on_failure_brings_a_killed_service_back(private_stack, tmp_path):
    """`rlfabric serve ROLE --restart on-failure` (a per-host deployment): the service runs in a child; SIGKILLed,
    it comes back after the back-off and registers again; SIGTERM to the supervisor stops both."""
    import subprocess
    import sys

    client = private_stack.client
    before = {w.pid for w in client.workers()}
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "rlfabric.services.cli", "serve", "env", "--coordinator", private_stack.address,
         "--restart", "on-failure", "--max-restarts", "2"], env={**os.environ, "RLFABRIC_TOKEN": private_stack.token},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "wb"))
    try:
        def new_env_pid() -> int | None:
            """an env worker of the supervised service is registered and alive"""
            pids = [w.pid for w in client.workers() if w.alive and w.role == common_pb2.ENV and w.pid not in before]
            return pids[0] if pids else None

        first = wait_for(new_env_pid)
        assert first != supervisor.pid  # the service is the supervisor's child
        os.kill(first, signal.SIGKILL)
        before.add(first)
        second = wait_for(new_env_pid)
        assert second != first and supervisor.poll() is None
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        wait_for(lambda: not Path(f"/proc/{second}").exists() or None)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
