"""Device mixes that only a GPU would show, caught on CPU.

On a GPU, a tensor our code creates without ``device=`` lands on the CPU beside a batch on CUDA, and the first op
that mixes them fails ("Expected all tensors to be on the same device"). CI has no GPU, so inside ``guard()`` every
tensor factory (``torch.zeros``, ``arange``, ``tensor``, ...) that GPU-path code calls without a device makes a
``meta`` tensor instead: mixing it with the model's or the batch's CPU tensors raises at once, as CUDA would, and
reading its values raises too. Code that means a CPU tensor says ``device="cpu"``. Torch's own code and the
tests' are left alone: only calls made from the modules in ``GPU_CODE`` are changed, and not while a module is
being built (``nn.Module.__init__`` on the stack): parameters and buffers are made on the CPU and moved with the
module (``.to(device)``), as PyTorch intends.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

ROOT = Path(__file__).resolve().parents[1]
GPU_CODE = tuple(str(ROOT / p) for p in ("services/learner/", "services/policies/", "services/core/models/",
                                          "services/rollout/backends/", "services/core/algorithm.py"))


class DevicelessOnMeta(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.factories = _device_constructors()
        self.moved: list[str] = []  # where each device-less factory call was made (file:line)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(GPU_CODE) and not _building_a_module(caller):
                kwargs = {**kwargs, "device": "meta"}
                self.moved.append(f"{caller.f_code.co_filename.removeprefix(str(ROOT) + '/')}:{caller.f_lineno}")
        return func(*args, **kwargs)


def _building_a_module(frame, depth: int = 24) -> bool:
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


@contextmanager
def guard():
    with DevicelessOnMeta() as mode:
        yield mode


__all__ = ["GPU_CODE", "DevicelessOnMeta", "guard"]
