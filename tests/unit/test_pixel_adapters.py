"""The pixel env adapters' cases (pixel_adapters_cases.py) in a process of their own, with OSMesa chosen before
anything imports MuJoCo: the suite's process may already have imported it for tests that do not render, and
MuJoCo picks its OpenGL backend once, on import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("pixel_adapters_cases.py")


def test_pixel_adapters_in_a_rendering_process():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          env={**os.environ, "MUJOCO_GL": "osmesa"}, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
