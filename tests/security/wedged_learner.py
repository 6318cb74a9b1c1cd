"""A real learner that misbehaves on its Train of batch 1, once (across its restarts), as WEDGE_MODE says (the learners of
tests/security/test_liveness.py); it writes WEDGE_MARKER when it starts misbehaving.

- ``stuck``: never returns, and ignores its caller giving up (a thread blocked for good): its heartbeats and health
  check stay fine, and it shows no progress.
- ``busy:<seconds>``: computes for that long (real CPU work, torch matmuls), then trains as usual.
- ``frozen``: stops its own process (SIGSTOP): no heartbeats, no answers, until something kills it."""

from __future__ import annotations

import os
import signal
import time

import torch

from rlfabric.services.learner import server

_train = server.LearnerService._train


def _misbehaving(self, batch_index: int, min_version: int, timeout_s: float, cancelled=None):
    marker = os.environ["WEDGE_MARKER"]
    if batch_index == 1 and not os.path.exists(marker):  # once, across restarts of the learner too
        mode = os.environ.get("WEDGE_MODE", "stuck")
        with open(marker, "w") as f:
            f.write(f"{mode} on batch 1 (pid {os.getpid()})")
        if mode == "stuck":
            while True:
                time.sleep(1.0)
        elif mode == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode.startswith("busy:"):
            until, x = time.monotonic() + float(mode.split(":")[1]), torch.randn(256, 256)
            while time.monotonic() < until:
                x = torch.tanh(x @ x)
    return _train(self, batch_index, min_version, timeout_s, cancelled)


def main(argv: list[str] | None = None) -> None:
    server.LearnerService._train = _misbehaving
    server.main(argv)


if __name__ == "__main__":
    main()
