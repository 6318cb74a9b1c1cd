"""Where a worker's models live: ``runtime.device`` (cpu, cuda, cuda:N, auto) resolved on the worker's own host."""

from __future__ import annotations

import torch


def resolve_device(spec: str) -> torch.device:
    """The torch device for ``runtime.device``; a CUDA device this host lacks is a ValueError naming the fix."""
    if spec == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if available else torch.device("cpu")
    if not available:
        raise ValueError(f"runtime.device={spec!r}, but torch sees no CUDA device on this host (a CPU build, or no "
                         f"GPU/driver). Fix: set runtime.device to cpu or auto")
    device = torch.device(spec)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"runtime.device={spec!r}, but this host has {torch.cuda.device_count()} CUDA device(s). "
                         f"Fix: use cuda:0..cuda:{torch.cuda.device_count() - 1}, cuda or auto")
    return torch.device("cuda", index)
