"""The env's reward pool: rewards run in worker processes, so a reward that raises, hangs, eats memory or kills its
process costs only its own sample (the task's failure reward, one log line, a count), never the env service.

Workers come from ``pebble.ProcessPool`` started with "spawn" (never fork: the env service runs gRPC and ZeroMQ
threads). Each caps its address space (RLIMIT_AS) and exits when the env process that started it is gone; pebble
replaces a worker that died or ran past its call's timeout. Only strings cross the pipe: the reward's
``package.module:function`` target (the worker imports it through the reward registry), the prompt, completion and
answer, and the row's other fields as JSON; a float and a failure message come back. A step's finished samples
are scored together: all submitted, then all waited for.

One pool per env process and settings (``acquire``/``release``): every chunk and pool of envs shares its workers,
and the last one to close stops them.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import multiprocessing
import os
import resource
import sys
import threading
import time
from concurrent.futures import CancelledError
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from pebble import ProcessExpired, ProcessPool
from prometheus_client import Counter

log = logging.getLogger(__name__)
KINDS = ("raised", "timeout", "died")
FAILURES = Counter("rlfabric_env_reward_failures_total", "samples whose reward failed and scored the task's "
                   "failure reward: it raised, ran past env.options.reward_timeout_s, or killed its worker", ["kind"])
RESOLVE_TIMEOUT_S = 120.0  # a worker's start (a fresh interpreter) and the reward module's import
MAX_MESSAGE = 500


@dataclass(frozen=True)
class RewardCall:
    """One sample to score: who it is (for the log line), the reward's target, and the reward's arguments."""

    sample: str  # e.g. "env 3, path row 17"
    reward: str  # package.module:function (REWARDS.target of the name the run spec gives)
    prompt: str
    completion: str
    answer: str
    fields: str = "{}"  # the row's other fields, as JSON (see fields_json)


@dataclass(frozen=True)
class Scored:
    value: float
    failure: str | None = None  # None, or how the reward failed: raised, timeout, died


def fields_json(fields: dict[str, Any]) -> str:
    """A problem's fields as they cross to a worker (values JSON cannot hold become their str)."""
    return json.dumps(fields, ensure_ascii=False, default=str)


# -- in the worker ----------------------------------------------------------------------------------------------
def _init(memory_mb: int, parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    if memory_mb:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _watch_parent(parent: int) -> None:
    """A worker outlives no env process: a reward stuck in a loop would otherwise run on as an orphan."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _score(target: str, prompt: str, completion: str, answer: str, fields: str) -> tuple[float, str]:
    from services.env.tasks.rewards import REWARDS, call_reward

    try:
        return call_reward(REWARDS.load(target), prompt, completion, answer, json.loads(fields)), ""
    except (Exception, SystemExit) as exc:  # noqa: BLE001 — the user's code: anything it raises is its sample's
        return 0.0, f"{exc.__class__.__name__}: {exc}"[:MAX_MESSAGE] or exc.__class__.__name__


def _resolve(target: str) -> str:
    from services.env.tasks.rewards import REWARDS

    try:
        REWARDS.load(target)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 — reported to the caller as a spec error
        return str(exc)[:2000] or exc.__class__.__name__
    return ""


# -- in the env process -----------------------------------------------------------------------------------------
class RewardPool:
    """A bounded set of reward workers (started on first use)."""

    def __init__(self, workers: int = 2, memory_mb: int = 2048):
        self.workers, self.memory_mb = workers, memory_mb
        self.failures: collections.Counter[str] = collections.Counter()
        self._pool: ProcessPool | None = None
        self._closed = False
        self._resolved: set[str] = set()
        self._lock = threading.Lock()

    def _get(self) -> ProcessPool:
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed (its env was closed)")
            if self._pool is None:
                self._pool = ProcessPool(self.workers, initializer=_init, initargs=(self.memory_mb, os.getpid()),
                                         context=multiprocessing.get_context("spawn"))
            return self._pool

    def resolve(self, target: str, name: str) -> None:
        """Import the reward in a worker now (starting the workers): a name that does not resolve there is a
        ValueError of the run spec at build time, not a failure of every sample."""
        if target in self._resolved:
            return
        future = self._get().schedule(_resolve, args=(target,), timeout=RESOLVE_TIMEOUT_S)
        try:
            message = future.result()
        except TimeoutError:
            message = f"importing {target!r} in a reward worker took over {RESOLVE_TIMEOUT_S:g} s"
        except ProcessExpired as exc:
            message = f"importing {target!r} killed the reward worker (exit code {exc.exitcode})"
        except BrokenProcessPool:
            main = getattr(sys.modules.get("__main__"), "__file__", None)
            raise RuntimeError(
                "the reward pool's worker processes exited as they started (their traceback is on stderr). "
                "Multiprocessing's spawn re-runs the parent's main module in each worker" +
                (f" ({main})" if main else "") + ": run from a file or module whose work sits under "
                "`if __name__ == \"__main__\":`, not from stdin") from None
        if message:
            raise ValueError(message if message.startswith("env.options.reward") else
                             f"env.options.reward {name!r}: {message}")
        self._resolved.add(target)

    def score(self, calls: list[RewardCall], timeout_s: float, failure_reward: float,
              step_timeout_s: float | None = None) -> list[Scored]:
        """Every call's reward, all running at once on the workers; a call that fails gets ``failure_reward``.
        ``timeout_s`` bounds each call from its start; ``step_timeout_s`` the whole batch, queueing included (calls
        still unscored then count as timeouts), so that hung rewards queued behind each other cannot hold a step
        past its peer's data-plane timeout. Default: every call's worst case, queued ``workers`` at a time."""
        if not calls:
            return []
        pool = self._get()
        futures = [pool.schedule(_score, args=(c.reward, c.prompt, c.completion, c.answer, c.fields),
                                 timeout=timeout_s) for c in calls]
        if step_timeout_s is None:
            step_timeout_s = timeout_s * (math.ceil(len(calls) / self.workers) + 1) + 60.0
        deadline = time.monotonic() + step_timeout_s
        out, broken = [], False
        for call, future in zip(calls, futures, strict=True):
            try:
                value, message = future.result(timeout=max(0.0, deadline - time.monotonic()))
                kind = "raised" if message else None
            except TimeoutError:
                kind = "timeout"
                message = (f"ran past env.options.reward_timeout_s={timeout_s:g}" if future.done() else
                           f"was not scored within env.options.reward_step_timeout_s={step_timeout_s:g}")
            except ProcessExpired as exc:
                kind, message = "died", f"its worker process died (exit code {exc.exitcode})"
            except CancelledError:
                kind, message = "died", "the pool cancelled it"
            except BrokenProcessPool:
                kind, message, broken = "died", "the pool's workers could not run it (BrokenProcessPool)", True
            if kind is None:
                out.append(Scored(value))
                continue
            future.cancel()  # (stops a call still running or queued past the step's deadline)
            self.failures[kind] += 1
            FAILURES.labels(kind).inc()
            log.warning("reward %s failed (%s) for %s: %s; the sample scores env.options.failure_reward=%g",
                        call.reward, kind, call.sample, message, failure_reward)
            out.append(Scored(failure_reward, kind))
        if broken:  # pebble gives up on a pool whose workers cannot start: the next step starts a fresh one
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.stop()
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=10)


_shared: dict[tuple, list] = {}  # (workers, memory_mb, sys.path) -> [pool, users]
_shared_lock = threading.Lock()


def acquire(workers: int, memory_mb: int) -> RewardPool:
    """This process's pool for these settings, shared by every env that asks. Workers import rewards from the
    sys.path they start with, so a changed sys.path (a test's plug-in) gets a pool of its own."""
    key = (workers, memory_mb, tuple(sys.path))
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            entry = _shared[key] = [RewardPool(workers, memory_mb), 0]
        entry[1] += 1
        return entry[0]


def release(pool: RewardPool) -> None:
    """One user is done with ``pool``; the last one's release stops its workers."""
    with _shared_lock:
        for key, entry in list(_shared.items()):
            if entry[0] is pool:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _shared[key]
                break
    pool.close()


__all__ = ["FAILURES", "KINDS", "RewardCall", "RewardPool", "Scored", "acquire", "fields_json", "release"]
