"""OSMesa's llvmpipe loads its LLVM with global symbols, and a later ``import triton`` (transformers' pi0 reaches it
through torch._dynamo) then dies with SIGSEGV: ``rlfabric collect``/``eval`` with a pi0 beside an in-process pixel
env once crashed so. A process that runs torch loads triton before it picks OSMesa."""

from __future__ import annotations

import ctypes.util
import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not ctypes.util.find_library("OSMesa") or not importlib.util.find_spec("triton"),
                                reason="needs Debian's libosmesa6 and triton (torch's compiler) to meet")

IMPORT_TRITON_AFTER_OSMESA = """
import os, sys
os.environ.pop("MUJOCO_GL", None)
import torch
{pick}
import ctypes, ctypes.util
ctypes.CDLL(ctypes.util.find_library("OSMesa"), mode=ctypes.RTLD_GLOBAL)  # what MUJOCO_GL=osmesa loads
import triton
print("alive")
"""


def _run(pick: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", IMPORT_TRITON_AFTER_OSMESA.format(pick=pick)], capture_output=True,
                          text=True, timeout=120)


def test_a_torch_process_that_picks_osmesa_survives_a_later_triton_import():
    proc = _run("from rlfabric.services.env.sims.offscreen import use_osmesa; use_osmesa()")
    assert proc.returncode == 0 and "alive" in proc.stdout, proc.stderr[-2000:]
    assert _run("").returncode == -11  # the crash it prevents (SIGSEGV), so this test can tell
