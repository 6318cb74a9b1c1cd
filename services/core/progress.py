"""What a worker has done, for its heartbeats: the coordinator judges a long call by progress, never by its length.

A call (a learner's Train, a rollout's Collect) may take minutes on a slow host and still be healthy; one that hangs
may keep its heartbeats and health check fine. So each heartbeat carries two signs of work: the process's CPU time
(compute) and a count of data-plane messages it received (work that waits on peers: an env stepping a real robot,
shards arriving). A call whose worker shows neither for a whole liveness window is stalled (plan.py). A worker the
coordinator gave up on checks whether a call of its own is still in flight, and then stops instead of serving again
while its old work still runs."""

from __future__ import annotations

import contextlib
import resource
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_received = 0  # data-plane messages this process received (any change is progress)
_in_flight = 0  # Train/Collect-like calls running now


def received() -> None:
    """One data-plane message arrived (dataplane.py calls this for every frame set it decodes)."""
    global _received
    _received += 1  # (a lost increment under a race still changes the count: that is all a reader needs)


def messages() -> int:
    return _received


def cpu_seconds() -> float:
    """User plus system CPU time of this process, all its threads (torch's intra-op threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def working() -> Iterator[None]:
    """Around the body of a call's work, on the thread that runs it (not around an await: a cancelled await
    leaves the thread running, and that thread is what counts)."""
    global _in_flight
    with _lock:
        _in_flight += 1
    try:
        yield
    finally:
        with _lock:
            _in_flight -= 1


def in_flight() -> int:
    return _in_flight


def run_working(fn, *args):
    """``fn(*args)`` counted as a call in flight (an executor's job)."""
    with working():
        return fn(*args)
