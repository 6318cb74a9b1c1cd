"""TensorBatch: the one batch type every piece speaks — named arrays plus a little typed metadata.

Values are numpy arrays or torch tensors; the codec moves both without pickle. ``version`` is the weight
version that produced the data and ``seq`` a per-channel sequence number (see DESIGN.md section 5).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Scalar = str | int | float | bool | None


@dataclass
class TensorBatch:
    tensors: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = -1
    seq: int = 0

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.tensors[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def items(self):
        return self.tensors.items()

    @property
    def nbytes(self) -> int:
        total = 0
        for v in self.tensors.values():
            total += int(v.nbytes) if isinstance(v, np.ndarray) else int(v.numel() * v.element_size())
        return total

    def to_torch(self, device: str = "cpu") -> dict[str, Any]:
        """Torch views of the arrays (copies only arrays numpy marks read-only, which torch cannot alias)."""
        import torch

        out = {}
        for name, v in self.tensors.items():
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v if v.flags.writeable else v.copy())
            out[name] = v.to(device)
        return out

    @classmethod
    def from_mapping(cls, tensors: Mapping[str, Any], **kw: Any) -> TensorBatch:
        return cls(dict(tensors), **kw)
