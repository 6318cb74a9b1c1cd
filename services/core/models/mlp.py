"""The one MLP builder every model uses."""

from __future__ import annotations

from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def mlp(sizes: list[int], activation: str, out: int | None = None) -> nn.Sequential:
    """Linear layers through ``sizes`` with ``activation`` after each, then a linear output layer of ``out`` units
    (none when ``out`` is None: the body of a network whose heads are separate)."""
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), ACTIVATIONS[activation]()]
    if out is not None:
        layers.append(nn.Linear(sizes[-1], out))
    return nn.Sequential(*layers)
