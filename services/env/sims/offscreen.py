"""Which OpenGL a process that renders MuJoCo headless uses, chosen once, before mujoco is first imported (MuJoCo
and PyOpenGL fix their backend then): OSMesa, Mesa's CPU rasteriser (Debian's libosmesa6), unless the deployment
chose one (``MUJOCO_GL=egl`` on a GPU host). Only processes that render should pick it.

OSMesa's llvmpipe loads its LLVM with global symbols, and a later ``import triton`` (torch.compile, or transformers'
pi0 through torch._dynamo) then dies with SIGSEGV; the other order works. So a process that already runs torch, such
as ``rlfabric eval``/``collect`` acting with a VLM beside an in-process env, loads triton first."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import sys


def use_osmesa() -> None:
    if "mujoco" in sys.modules or not ctypes.util.find_library("OSMesa"):
        return
    os.environ.setdefault("MUJOCO_GL", "osmesa")
    if os.environ["MUJOCO_GL"] == "osmesa" and "torch" in sys.modules and importlib.util.find_spec("triton"):
        import triton  # noqa: F401  (before OSMesa's LLVM: see the module's docstring)
