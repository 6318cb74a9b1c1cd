"""The image encoder's conv stack on the image sizes pixel adapters render."""

from __future__ import annotations

import pytest
import torch

from rlfabric.services.core.config import CNNConfig
from rlfabric.services.core.models.encoders import CNN


def _cnn(h: int, w: int, **cfg) -> CNN:
    return CNN({"kind": "box", "dtype": "uint8", "shape": [h, w, 3]}, CNNConfig(**cfg))


@pytest.mark.parametrize("h,w", [(32, 32), (24, 24), (16, 16), (32, 20)])
def test_the_default_stack_serves_small_renders(h, w):
    """A 32x32 camera (mujoco_pixels' image_size: 32) leaves 2x2 for the default 3x3 layer: it once failed."""
    out = _cnn(h, w)(torch.zeros(2, h, w, 3, dtype=torch.uint8))
    assert out.shape == (2, 512)


def test_a_stack_that_fits_keeps_its_kernels():
    kernels = [tuple(m.kernel_size) for m in _cnn(84, 84).convs if isinstance(m, torch.nn.Conv2d)]
    assert kernels == [(8, 8), (4, 4), (3, 3)] and _cnn(84, 84).linear[0].in_features == 64 * 7 * 7
