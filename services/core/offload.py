"""Offload and onload of a stage's model state between turns, for stages that share a pool (collocated plans).

While the rollout stage acts, the learner's parameters and optimiser state sit idle, and while the learner
trains the rollout's copy of the policy does. On a GPU the idle stage moves its tensors to host memory so the
active one has the device's memory (veRL and RLinf do the same); on a CPU-only host the CPU variant moves them to
a file, which frees the RAM they held. Either way the tensors keep their identity: ``tensor.data`` is swapped
for an empty placeholder and back, so optimisers and modules that hold them need not know.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TARGETS = ("host", "disk")


@dataclass
class _Slot:
    tensor: torch.Tensor
    device: torch.device
    dtype: torch.dtype
    shape: torch.Size
    offset: int = 0  # disk: byte offset in the file
    nbytes: int = 0
    host: torch.Tensor | None = None  # host: the copy in (pinned) host memory


class ModelOffload:
    """Moves the tensors ``tensors()`` returns off their device (``offload``) and back (``onload``).

    ``tensors`` is called at each offload, so state created since the last one (an optimiser's first step) is
    included. Gradients are not kept: they are recomputed before they are used again."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]], target: str, directory: str | Path = "",
                 name: str = "model"):
        if target not in TARGETS:
            raise ValueError(f"offload target {target!r}: expected one of {', '.join(TARGETS)}")
        self.tensors, self.target = tensors, target
        self.path = Path(directory or tempfile.gettempdir()) / f"rlfabric-offload-{name}-{os.getpid()}.bin"
        self.slots: list[_Slot] = []
        self.offloaded_bytes = 0
        self.offload_seconds = self.onload_seconds = 0.0  # last transfer of each kind

    @property
    def offloaded(self) -> bool:
        return bool(self.slots)

    def offload(self) -> int:
        """Frees the tensors' device memory; returns the bytes moved."""
        if self.slots:
            return 0
        t0 = time.perf_counter()
        seen: set[int] = set()
        slots = []
        for t in self.tensors():
            if id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            if isinstance(t, torch.nn.Parameter):
                t.grad = None
            slots.append(_Slot(t, t.device, t.dtype, t.shape, nbytes=t.numel() * t.element_size()))
        if self.target == "disk":
            offset = 0
            with open(self.path, "wb") as f:
                for s in slots:
                    raw = s.tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
                    f.write(memoryview(raw))
                    s.offset, offset = offset, offset + s.nbytes
                f.flush()
        else:
            pin = torch.cuda.is_available()
            for s in slots:
                host = s.tensor.detach().to("cpu", copy=True)
                s.host = host.pin_memory() if pin else host
        for s in slots:  # only now: a failed write above leaves the model as it was
            s.tensor.data = torch.empty(0, dtype=s.dtype, device=s.device)
        if any(s.device.type == "cuda" for s in slots):
            # the freed blocks stay in this process's caching allocator otherwise: the stage taking its turn runs in
            # another process (the rollout service, an engine) and would find the device as full as before
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.slots = slots
        self.offloaded_bytes = sum(s.nbytes for s in slots)
        self.offload_seconds = time.perf_counter() - t0
        return self.offloaded_bytes

    def onload(self) -> None:
        """Puts every offloaded tensor back on its device, with its values."""
        if not self.slots:
            return
        t0 = time.perf_counter()
        if self.target == "disk":
            with open(self.path, "rb") as f:
                for s in self.slots:
                    f.seek(s.offset)
                    raw = np.fromfile(f, dtype=np.uint8, count=s.nbytes)
                    if raw.size != s.nbytes:
                        raise OSError(f"offload file {self.path} is truncated: {raw.size} of {s.nbytes} bytes "
                                      f"at offset {s.offset}; was it removed or the disk full?")
                    s.tensor.data = torch.from_numpy(raw).view(s.dtype).reshape(s.shape).to(s.device)
        else:
            for s in self.slots:
                s.tensor.data = s.host.to(s.device, non_blocking=True).reshape(s.shape)
            if any(s.device.type == "cuda" for s in self.slots):
                torch.cuda.synchronize()
        self.slots = []
        self.onload_seconds = time.perf_counter() - t0

    @contextmanager
    def onloaded(self) -> Iterator[None]:
        """Onload for the block (a checkpoint, an evaluation) and offload again after it if it was offloaded."""
        was = self.offloaded
        self.onload()
        try:
            yield
        finally:
            if was:
                self.offload()

    def close(self) -> None:
        """Drop the offloaded copy (the model it belonged to is being discarded) and its file."""
        self.slots = []
        self.path.unlink(missing_ok=True)


def state_tensors(*owners) -> list[torch.Tensor]:
    """The tensors a training stage owns, each once: parameters and buffers of the modules, and optimiser state
    (moments, step counters), found among ``owners`` and their attributes (an algorithm object, a policy)."""
    found: dict[int, torch.Tensor] = {}
    for owner in owners:
        items = [owner] if isinstance(owner, torch.nn.Module) else list(vars(owner).values())
        for v in items:
            if isinstance(v, torch.nn.Module):
                tensors = [*v.parameters(), *v.buffers()]
            elif isinstance(v, torch.Tensor):
                tensors = [v]
            elif hasattr(v, "param_groups") and isinstance(getattr(v, "state", None), dict):  # an optimiser
                tensors = [t for state in v.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
            else:
                continue
            found.update((id(t), t) for t in tensors)
    return list(found.values())


__all__ = ["ModelOffload", "state_tensors"]
