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
def gateway_process(workdir: Path, token: str, *args: str) -> Iterator[str]:
    """``rlfabric serve robot_gateway`` with ``token`` (and extra flags); yields its address, stops it after. Its
    log is ``workdir/gateway.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / "gateway.log"  # a file, not a pipe: a pipe nobody reads fills up and stalls the gateway
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "robot_gateway", "--port-file",
                                 str(port_file), *args], env={**os.environ, "RLFABRIC_TOKEN": token},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    try:
        for _ in range(300):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        if not port_file.exists():
            raise RuntimeError(f"the gateway did not start: {log_path.read_text()[-2000:]}"
                               if proc.poll() is not None else "the gateway wrote no port file in 15 s")
        yield port_file.read_text().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
