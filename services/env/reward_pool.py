"""The env's reward pool: rewards run in worker processes, so a reward that raises, hangs, eats memory or kills its
process costs only its own sample (the task's failure reward, one log line, a count), never the env service.

Workers come from ``pebble.ProcessPool`` started with "spawn" (never fork: the env service runs gRPC and ZeroMQ
threads). Each caps its address space (RLIMIT_AS), exits when the env process that started it is gone, and leads a
process group of its own, which every process a reward starts joins: when a call returns, its leftover processes are
killed, and a call that runs past its timeout ends its whole group, worker included (pebble starts a new worker).
A worker whose group outlives it (pebble killed it first) has that group killed by the env process. Where the
kernel allows (root, or unprivileged user namespaces), each worker has a network namespace of its own with no
interface up, so a reward reaches no host; elsewhere it has the service's network, and the pool logs that once.
Files are not confined: a reward runs as the service's user (docs/deployment.md says so). Only strings cross the pipe: the reward's
``package.module:function`` target (the worker imports it through the reward registry), the prompt, completion and
answer, and the row's other fields as JSON; a float and a failure message come back. A step's finished samples
are scored together: all submitted, then all waited for.

One pool per env process and settings (``acquire``/``release``): every chunk and pool of envs shares its workers,
and the last one to close stops them.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import math
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import tempfile
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
TIMEOUT_EXIT = 86  # the exit code of a worker that ended its own call at the call's timeout
BACKSTOP_S = 5.0  # past a call's timeout, pebble kills a worker that could not end itself (a reward holding the GIL)
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class OperatorLimits:
    """What a run spec's reward options may ask of this host at most: the operator's flags of the env (and
    rollout) service. A spec may lower them, never lift them."""

    memory_mb: int = 2048  # --reward-memory-mb: each worker's address space; 0: no limit (the operator's choice)
    timeout_s: float = 60.0  # --reward-timeout-s: one call's time


_limits = OperatorLimits()


def set_operator_limits(limits: OperatorLimits) -> None:
    global _limits
    _limits = limits


def operator_limits() -> OperatorLimits:
    return _limits


def add_arguments(parser) -> None:
    """The operator's reward limits, on every service that may host text envs (env, rollout)."""
    parser.add_argument("--reward-memory-mb", type=int, default=OperatorLimits.memory_mb,
                        help="the most memory (MiB of address space) a run spec's reward workers may have "
                             "(env.options.reward_memory_mb may ask less); 0: no limit")
    parser.add_argument("--reward-timeout-s", type=float, default=OperatorLimits.timeout_s,
                        help="the longest one reward call may run (env.options.reward_timeout_s may ask less)")


def apply_arguments(args) -> None:
    if args.reward_memory_mb < 0 or not 0 < args.reward_timeout_s <= 3600:
        raise SystemExit("--reward-memory-mb: MiB >= 0 (0: no limit); --reward-timeout-s: seconds in (0, 3600]")
    set_operator_limits(OperatorLimits(args.reward_memory_mb, args.reward_timeout_s))


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
def _init(memory_mb: int, parent: int, groups: str) -> None:
    os.setpgid(0, 0)  # a group of its own: what a reward starts joins it, and is killed with it
    network = _no_network()
    with open(os.path.join(groups, str(os.getpid())), "w") as f:  # the env process kills groups that outlive us
        f.write(network)
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    if memory_mb:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _no_network() -> str:
    """A network namespace of this worker's own, with no interface up: "" once done, else why not (no privilege)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return ""
    return f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}"


def _group_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` (from /proc), other than this one."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _last_pid() -> str:
    """The newest process id handed out (/proc/loadavg): unchanged across a call, the call started no process."""
    with open("/proc/loadavg") as f:
        return f.read().rsplit(" ", 1)[1]


def _kill_leftovers() -> None:
    """Kill every process a reward started in this worker's group (the worker itself stays)."""
    for pid in _group_members(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class _Watchdog:
    """One thread per worker that ends a call still running at its deadline: it kills every process the call
    started, then the worker (pebble starts another). Arming is one attribute write (no thread or wake-up per
    call); the thread looks every ``TICK_S``."""

    TICK_S = 0.05

    def __init__(self):
        self.deadline: float | None = None
        threading.Thread(target=self._run, name="reward-watchdog", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            deadline = self.deadline
            if deadline is not None and time.monotonic() >= deadline:
                _kill_leftovers()
                os._exit(TIMEOUT_EXIT)


_watchdog: _Watchdog | None = None


def _watch_parent(parent: int) -> None:
    """A worker outlives no env process: a reward stuck in a loop would otherwise run on as an orphan."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _describe(exc: BaseException) -> str:
    """``Class: message``, even for an exception whose ``__str__`` raises (the user's)."""
    name = type(exc).__name__[:100]
    try:
        return f"{name}: {exc}"[:MAX_MESSAGE]
    except BaseException:  # noqa: BLE001 — its message is the user's code too
        return f"{name} (its message could not be read)"


def _score(target: str, prompt: str, completion: str, answer: str, fields: str,
           timeout_s: float = 0.0) -> tuple[float, str]:
    from rlfabric.services.env.tasks.rewards import REWARDS, call_reward

    global _watchdog
    if timeout_s and _watchdog is None:
        _watchdog = _Watchdog()
    if timeout_s:
        _watchdog.deadline = time.monotonic() + timeout_s
    last_pid = _last_pid()
    try:
        return call_reward(REWARDS.load(target), prompt, completion, answer, json.loads(fields)), ""
    except BaseException as exc:  # noqa: BLE001 — the user's code: anything it raises (KeyboardInterrupt too)
        return 0.0, _describe(exc)
    finally:
        if timeout_s:
            _watchdog.deadline = None
        if _last_pid() != last_pid:  # some process started (here or elsewhere): none of the call's may outlive it
            _kill_leftovers()


def _resolve(target: str) -> str:
    from rlfabric.services.env.tasks.rewards import REWARDS

    try:
        REWARDS.load(target)
    except BaseException as exc:  # noqa: BLE001 — reported to the caller as a spec error
        return _describe(exc) if not isinstance(exc, ValueError) else str(exc)[:2000]
    return ""


# -- in the env process -----------------------------------------------------------------------------------------
class RewardPool:
    """A bounded set of reward workers (started on first use)."""

    def __init__(self, workers: int = 2, memory_mb: int = 2048):
        self.workers, self.memory_mb = workers, memory_mb
        self.failures: collections.Counter[str] = collections.Counter()
        self._groups = tempfile.mkdtemp(prefix="rlfabric-reward-groups-")  # a file per worker ever started
        self._network_said = False
        self._pool: ProcessPool | None = None
        self._closed = False
        self._resolved: set[str] = set()
        self._lock = threading.Lock()

    def _get(self) -> ProcessPool:
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed (its env was closed)")
            if self._pool is None:
                self._pool = ProcessPool(self.workers, initializer=_init,
                                         initargs=(self.memory_mb, os.getpid(), self._groups),
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
        self._say_network()

    def network(self) -> dict[int, str]:
        """Each worker started so far: "" where it has no network, else why it has the service's."""
        out = {}
        for entry in os.listdir(self._groups):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(self._groups, entry)) as f:
                out[int(entry)] = f.read()
        return out

    def _say_network(self) -> None:
        if self._network_said:
            return
        why = next((w for w in self.network().values() if w), "")
        if why:
            self._network_said = True
            log.warning("reward workers keep the env service's network (%s): a reward can reach any host this one "
                        "can. Run the env service as root, or where unprivileged user namespaces are enabled, to "
                        "give each worker a network namespace of its own", why)

    def reap(self) -> int:
        """Kill the process groups of workers that are gone (pebble killed them past a timeout before they could
        end their own): a reward's processes outlive neither its call nor its worker. Returns how many groups."""
        killed = 0
        for entry in os.listdir(self._groups):
            pgid = int(entry)
            if _alive(pgid):
                continue
            try:
                os.killpg(pgid, signal.SIGKILL)  # the group id cannot be reused while members remain
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._groups, entry))
        return killed

    def score(self, calls: list[RewardCall], timeout_s: float, failure_reward: float,
              step_timeout_s: float | None = None) -> list[Scored]:
        """Every call's reward, all running at once on the workers; a call that fails gets ``failure_reward``.
        ``timeout_s`` bounds each call from its start; ``step_timeout_s`` the whole batch, queueing included (calls
        still unscored then count as timeouts), so that hung rewards queued behind each other cannot hold a step
        past its peer's data-plane timeout. Default: every call's worst case, queued ``workers`` at a time."""
        if not calls:
            return []
        pool = self._get()
        futures = [pool.schedule(_score, args=(c.reward, c.prompt, c.completion, c.answer, c.fields, timeout_s),
                                 timeout=timeout_s + BACKSTOP_S) for c in calls]
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
                if exc.exitcode == TIMEOUT_EXIT:
                    kind, message = "timeout", f"ran past env.options.reward_timeout_s={timeout_s:g}"
                else:
                    kind, message = "died", f"its worker process died (exit code {exc.exitcode})"
            except CancelledError:
                kind, message = "died", "the pool cancelled it"
            except BrokenProcessPool:
                kind, message, broken = "died", "the pool's workers could not run it (BrokenProcessPool)", True
            except BaseException as exc:  # noqa: BLE001 — whatever came back from the user's code is its sample's
                kind, message = "raised", _describe(exc)
            if kind is None:
                out.append(Scored(value))
                continue
            future.cancel()  # (stops a call still running or queued past the step's deadline)
            self.failures[kind] += 1
            FAILURES.labels(kind).inc()
            log.warning("reward %s failed (%s) for %s: %s; the sample scores env.options.failure_reward=%g",
                        call.reward, kind, call.sample, message, failure_reward)
            out.append(Scored(failure_reward, kind))
        if any(s.failure in ("timeout", "died") for s in out):
            self.reap()
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
        self.reap()
        shutil.rmtree(self._groups, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: its group may still hold live processes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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


__all__ = ["FAILURES", "KINDS", "OperatorLimits", "RewardCall", "RewardPool", "Scored", "acquire", "add_arguments",
           "apply_arguments", "fields_json", "operator_limits", "release", "set_operator_limits"]
