"""A real learner whose Train of batch 1 never answers until its caller gives up on it, once: the wedged worker of
tests/security/test_deadlines.py (its heartbeats and health check stay fine throughout)."""

from __future__ import annotations

import os

from services.learner import server
from services.learner.feeds import UpdateCancelled

_train = server.LearnerService._train
_hung: list[int] = []


def _wedged(self, batch_index: int, min_version: int, timeout_s: float, cancelled=None):
    if batch_index == 1 and not _hung:
        _hung.append(batch_index)
        with open(os.environ["WEDGE_MARKER"], "w") as f:
            f.write("wedged on batch 1")
        cancelled.wait()
        raise UpdateCancelled("the coordinator gave up on this Train")
    return _train(self, batch_index, min_version, timeout_s, cancelled)


def main(argv: list[str] | None = None) -> None:
    server.LearnerService._train = _wedged
    server.main(argv)


if __name__ == "__main__":
    main()
