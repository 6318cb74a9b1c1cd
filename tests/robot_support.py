"""Shared by the robot gateway tests: a real gateway process on loopback with a token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def gateway_process(workdir: Path, token: str) -> Iterator[str]:
    """``rlfabric serve robot_gateway`` with ``token``; yields its address, stops it after."""
    port_file = workdir / "port"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "robot_gateway", "--port-file",
                             str(port_file)], env={**os.environ, "RLFABRIC_TOKEN": token},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        if not port_file.exists():
            raise RuntimeError(f"the gateway did not start: {proc.stderr.read().decode()[-2000:]}"
                               if proc.poll() is not None else "the gateway wrote no port file in 15 s")
        yield port_file.read_text().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
