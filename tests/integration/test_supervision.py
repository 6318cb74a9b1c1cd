"""The local stack's restart policy (on-failure): a SIGKILLed worker process is started again after a back-off, it
registers with the coordinator again (its process titled with its role), and once its restarts run out it stays
down and the stack names it dead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from services.core.proto.rlfabric.v1 import common_pb2


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
