"""Cases that render MuJoCo on the CPU run in a pytest process of their own, with OSMesa chosen before anything
imports MuJoCo: the suite's process may already have imported it for tests that do not render (MuJoCo picks its
OpenGL backend once, on import), and transformers' later imports crash beside a loaded OSMesa."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_rendering_cases(cases: Path, allow_skips: bool = False, timeout: int = 600) -> None:
    """Run the pytest file ``cases`` with MUJOCO_GL=osmesa; fail unless every case passed (or skipped, if
    ``allow_skips``: cases whose optional simulator is not installed)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                          env={**os.environ, "MUJOCO_GL": "osmesa"}, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
    assert allow_skips or "skipped" not in summary, summary
