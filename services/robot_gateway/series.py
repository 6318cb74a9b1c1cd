"""Prometheus series per robot, removed when the robot disconnects: robot ids are chosen by clients, so series
that outlived their robot would grow without bound on a gateway whose arms come and go (a run's env pool names
its robots afresh)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

_lock = threading.Lock()
_series: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}  # robot id -> (metric, label values) it exported


def robot_series(metric: Any, robot_id: str, *labels: str) -> Any:
    """``metric.labels(robot_id, *labels)``, remembered so that ``forget`` removes it."""
    with _lock:
        _series.setdefault(robot_id, set()).add((metric, (robot_id, *labels)))
    return metric.labels(robot_id, *labels)


def forget(robot_id: str) -> int:
    """Remove every series of ``robot_id``; returns how many."""
    with _lock:
        gone = _series.pop(robot_id, set())
    for metric, labels in gone:
        with contextlib.suppress(KeyError):
            metric.remove(*labels)
    return len(gone)
