"""LocalStack: every service as its own local process on loopback, on free ports, shut down cleanly.

The coordinator writes its bound port to a file; workers register with it and report their own ports, so no
port is ever guessed. Services die with the launcher (a pidfd watch; PR_SET_PDEATHSIG for plain processes), so a
crashed or SIGKILLed CLI leaves no orphans.

Services are forked from a multiprocessing forkserver that imported what they all import (torch, numpy, grpc,
pydantic, the service modules) once, instead of once per process: on 2 cores those imports are most of the
start-up CPU, and five processes importing them side by side took ~2 s of it. The forkserver is started first
(``prestart``, before the CLI reads the run spec). Nothing but imports happens before the fork (no threads,
sockets, gRPC channels or servers); each service still is its own process with its own gRPC server, sockets
and threads, started from its own ``main`` with the flags and environment a plain process would get.
``RLFABRIC_LAUNCH=exec`` starts plain ``python -m`` processes instead.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import setproctitle

from rlfabric.services.core.paths import local_stack_args

log = logging.getLogger(__name__)

WORKER_ROLES = ("env", "replay", "learner", "rollout")
# What the forked services import anyway (the collocated rollout hosts its env pool: rlfabric.services.env.local). A
# child also re-runs the launching program's main module (multiprocessing's rule), so the CLI is preloaded too.
PRELOAD = ["rlfabric.services.launcher", "numpy", "torch", "rlfabric.services.coordinator.server", "rlfabric.services.env.server",
           "rlfabric.services.rollout.collectors.gym", "rlfabric.services.rollout.backends.torch",
           "rlfabric.services.replay.server", "rlfabric.services.learner.server", "rlfabric.services.rollout.server", "rlfabric.services.env.local",
           "rlfabric.services.cli"]

# A forked child re-runs the launching main module (e.g. rlfabric.services.cli), which the forkserver preloaded: runpy's
# "found in sys.modules" warning about that is expected here, not a sign of a double import going wrong.
warnings.filterwarnings("ignore", message=r"'services\.[a-z_.]+' found in sys\.modules", category=RuntimeWarning)


def _service_env(torch_threads: int, token: str = "") -> dict[str, str]:
    """A local service's environment: the launcher's, less RLFABRIC_* (they configure deployed services, e.g.
    compose; a local stack sets everything by flags, and an inherited RLFABRIC_PORT would make every local service
    bind the same port), plus the stack's own secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(torch_threads))
    if token:
        from rlfabric.services.core import auth

        env[auth.TOKEN_ENV] = token
    return env


def _die_with(pid: int, grace_s: float = 10.0) -> None:
    """Stop this process when process ``pid`` (the launcher) exits: SIGTERM to itself (a graceful stop), SIGKILL if
    that takes longer than ``grace_s``. A service forked from the forkserver has the forkserver as its parent, and
    the forkserver lives as long as any of its children holds the fd that keeps it alive, so PR_SET_PDEATHSIG alone
    would leave a whole stack running after its CLI was SIGKILLed; a pidfd on the launcher cannot be fooled so."""
    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # no pidfds (old kernel): look every second instead
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(1.0)
        else:
            select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


def private_dir(path: Path) -> Path:
    """Make ``path`` and any missing parents owner-only (0700): run directories and logs hold what a run's spec
    and its services say, which is no other local user's business."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(mode=0o700, exist_ok=True)
    return path


def open_private_log(path: str | Path, truncate: bool = True) -> int:
    """A log file only its owner can read (0600 even when it existed wider), as a write descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0),
                 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _exec_service() -> None:
    """Entry of a service started as an interpreter of its own (RLFABRIC_LAUNCH=exec), ``-c`` argv: MODULE
    LAUNCHER_PID FLAGS...; it dies with the launcher like a forked one. (Not a preexec_fn: Python run between fork
    and exec meets gRPC's fork handlers when the launcher holds channels, and the child aborted before exec with
    'epoll_wait error: Bad file descriptor'.)"""
    module, launcher, *argv = sys.argv[1:]
    _die_with(int(launcher))
    sys.argv = [module, *argv]
    importlib.import_module(module).main(argv)


def _forked_service(module: str, argv: list[str], log_path: str, env: dict[str, str], launcher: int) -> None:
    """Entry of a service forked from the preloaded forkserver: the environment the launcher has now (not the one
    the forkserver started with), stdout/stderr to its log, dies with the launcher."""
    fd = open_private_log(log_path)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    _die_with(launcher)
    # setproctitle takes over the argv/environ block on its first call; clearing the environment first leaves it
    # nothing to write into (ps would go on showing "python -c from multiprocessing.forkserver ...")
    setproctitle.setproctitle(f"rlfabric-{module.split('.')[1]}")
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    importlib.import_module(module).main(argv)


def _names(roles: tuple[str, ...]) -> list[str]:
    """Process names for roles, numbered from the second of a role on: rollout, rollout-1, ..."""
    seen: dict[str, int] = {}
    names = []
    for role in roles:
        n = seen.get(role, 0)
        seen[role] = n + 1
        names.append(role if n == 0 else f"{role}-{n}")
    return names


def spec_facts(config) -> dict:
    """What a launcher needs to know of a run spec before it starts anything (JSON-able)."""
    unit, total = config.progress()
    return {"name": config.name, "torch_threads": config.runtime.torch_threads, "roles": list(roles_for(config)),
            "progress": [unit, total]}


def _describe_spec(conn, path: str, overrides: list[str]) -> None:
    """In a child of the preloaded forkserver: validate a run spec there (its algorithm specs import torch, which
    the forkserver has loaded already) and send back its facts, or the error, as JSON."""
    from rlfabric.services.core.config import ConfigError, load_config

    try:
        facts = spec_facts(load_config(path, overrides))
    except ConfigError as exc:
        facts = {"error": str(exc)}
    conn.send_bytes(json.dumps(facts).encode())
    conn.close()


def describe_spec(path: str | Path, overrides: list[str] | None = None, torch_threads: int = 1) -> dict:
    """Validate a run spec and return its facts ({"error": reason} when invalid). With the forkserver in use, the
    validation runs in a child of it: a CLI that starts local services then never imports torch itself (its
    algorithm specs do), which on 2 cores would compete with the forkserver's own imports at start-up."""
    if os.environ.get("RLFABRIC_LAUNCH", "fork") != "fork":
        from rlfabric.services.core.config import ConfigError, load_config

        try:
            return spec_facts(load_config(path, overrides))
        except ConfigError as exc:
            return {"error": str(exc)}
    ctx = _forkserver_context(torch_threads)
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_describe_spec, args=(send, str(path), list(overrides or [])), name="describe-spec",
                        daemon=True)
    child.start()
    send.close()
    try:
        return json.loads(receive.recv_bytes())
    except EOFError:
        child.join(10)
        raise RuntimeError(f"validating {path} failed in the forkserver (exit code {child.exitcode})") from None
    # (not joined: the child exits on its own; waiting for a torch process to wind down would delay the stack)


def roles_for(config) -> tuple[str, ...]:
    """The worker processes a run's plan needs on one host: its rollout workers and env services."""
    from rlfabric.services.coordinator.server import CoordinatorService

    counts = CoordinatorService.worker_counts(config)
    return tuple(role for role in WORKER_ROLES for _ in range(counts[role]))


class ForkedProcess:
    """The subprocess.Popen surface LocalStack and its users rely on, over a multiprocessing.Process."""

    def __init__(self, proc: multiprocessing.Process):
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"service pid {self.pid}", timeout or 0)
        return self._proc.exitcode


_forkserver = None


def _forkserver_context(torch_threads: int):
    """One forkserver per launcher process; it inherits OMP_NUM_THREADS when it starts (each forked service sets
    its own torch thread count from its flags either way)."""
    global _forkserver
    if _forkserver is None:
        os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(PRELOAD)
    return _forkserver


def restart_delay(count: int, backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> float:
    """The restart policy's back-off before a service's restart number ``count + 1``: backoff_s x 2^count, capped."""
    return min(max_backoff_s, backoff_s * 2 ** count)


def serve_supervised(cmd: list[str], max_restarts: int = 5, backoff_s: float = 1.0,
                     max_backoff_s: float = 30.0) -> int:
    """``rlfabric serve ... --restart on-failure``: run ``cmd`` (one service) as a child and start it again when it
    dies with a non-zero code, after the same back-off as the local stack's, at most ``max_restarts`` times. A
    SIGTERM/SIGINT goes to the child and ends supervision; the exit code is the child's last."""
    stopping = threading.Event()
    child: list[subprocess.Popen] = []

    def forward(signum, _frame) -> None:
        stopping.set()
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    restarts = 0
    while True:
        child.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        code = child[-1].wait()
        if code == 0 or stopping.is_set():
            return code
        if restarts >= max_restarts:
            log.error("service exited with code %s after %d restarts: giving up", code, restarts)
            return code
        delay = restart_delay(restarts, backoff_s, max_backoff_s)
        restarts += 1
        log.warning("service exited with code %s; restarting it in %.1f s (restart %d of at most %d)", code, delay,
                    restarts, max_restarts)
        if stopping.wait(delay):
            return code


def prestart(torch_threads: int = 1) -> None:
    """Start the forkserver's imports now, without waiting for them: a launcher about to start torch services
    calls this before its own remaining work (reading the run spec, starting the other services)."""
    if os.environ.get("RLFABRIC_LAUNCH", "fork") != "fork":
        return
    from multiprocessing import forkserver

    _forkserver_context(torch_threads)
    forkserver.ensure_running()


class LocalStack:
    def __init__(self, log_dir: str | Path, runs_root: str | Path = "runs", roles: tuple[str, ...] = WORKER_ROLES,
                 heartbeat_timeout_s: float = 3.0, host: str = "127.0.0.1", torch_threads: int = 1,
                 token: str | None = None, take_up_runs: bool = False, tls=None, insecure_plaintext: bool = False,
                 allow_import_paths: bool = False, dashboard_port: int = -1):
        """``token``: the stack's secret (every port checks it; default: the deployment's, from RLFABRIC_TOKEN_FILE
        or RLFABRIC_TOKEN, when set, so the stack's services reach other services of the deployment such as a robot
        gateway, else a new one per stack; this process then uses it as its own so its clients get in; "" runs in
        the clear, loopback only).
        ``take_up_runs``: the coordinator's first start takes up runs its runs root records as not ended (``up``
        does; ``train``/``resume`` run one run of their own). A restarted coordinator always takes up its runs.
        ``tls``: the services' auth.TLSFiles (certificate, key and CA: gRPC with mTLS, metrics over HTTPS; this
        process calls them with the same identity). ``insecure_plaintext``: let a non-loopback ``host`` serve
        without TLS (the services warn). ``allow_import_paths``: every service resolves code a run spec names by
        import path (--allow-import-paths): for a stack whose user is its operator (``train``), never by default.
        ``dashboard_port``: the coordinator serves its web dashboard there (-1: none; ``up`` gives a fixed port, so
        a restarted coordinator serves it on the same one)."""
        self.take_up_runs = take_up_runs
        self.dashboard_port = dashboard_port
        self.log_dir = Path(log_dir)
        self.runs_root = Path(runs_root)
        self.roles = roles
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.host = host
        self.tls = tls
        self.insecure_plaintext = insecure_plaintext
        self.allow_import_paths = allow_import_paths
        self.torch_threads = torch_threads
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.commands: dict[str, tuple[str, list[str]]] = {}  # name -> (module, args): how to start it again
        self.restarts: dict[str, int] = {}
        self.given_up: dict[str, int] = {}  # name -> its last exit code, once its restarts ran out
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._lister = None  # the supervisor's coordinator client (ListWorkers), made on its first poll
        self.address = ""
        self.preload = os.environ.get("RLFABRIC_LAUNCH", "fork") == "fork"
        from rlfabric.services.core import (
            auth,  # (imported here: prestart, above, runs before grpc and zmq load)
        )

        if token is None:
            token = auth.token_from_environment() or auth.generate_token()
        self.token = token

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen | ForkedProcess:
        self.commands[name] = (module, args)
        private_dir(self.log_dir)
        os.close(open_private_log(self.log_dir / f"{name}.log", truncate=False))  # the service appends to it
        argv = ["--host", self.host, "--log-file", str(self.log_dir / f"{name}.log"),
                "--torch-threads", str(self.torch_threads), *self._security_flags(), *args]
        env = _service_env(self.torch_threads, self.token)
        if self.preload:
            proc = _forkserver_context(self.torch_threads).Process(
                target=_forked_service, name=name, args=(module, argv, str(self.log_dir / f"{name}.stderr"), env,
                                                         os.getpid()))
            proc.start()
            self.procs[name] = ForkedProcess(proc)
            return self.procs[name]
        stderr = os.fdopen(open_private_log(self.log_dir / f"{name}.stderr"), "w")
        proc = subprocess.Popen([sys.executable, "-c", "from rlfabric.services.launcher import _exec_service; _exec_service()",
                                 module, str(os.getpid()), *argv], stdin=subprocess.DEVNULL, stdout=stderr,
                                stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def _security_flags(self) -> list[str]:
        from rlfabric.services.core.registry import IMPORT_PATHS_FLAG

        flags = ["--insecure-plaintext"] if self.insecure_plaintext else []
        flags += [IMPORT_PATHS_FLAG] if self.allow_import_paths else []
        if self.tls is not None and self.tls.enabled:
            flags += ["--tls-cert", self.tls.cert, "--tls-key", self.tls.key, "--metrics-tls",
                      *(["--tls-ca", self.tls.ca] if self.tls.ca else [])]
        return flags

    def spawn_coordinator(self) -> None:
        """Start the coordinator without waiting for it (``wait_coordinator`` does): a launcher does its own
        remaining work (validating the spec, starting workers) while the coordinator comes up."""
        from rlfabric.services.core import auth

        # this process is the stack's client, in the clear where the operator said so
        auth.configure(self.token, self.tls or auth.current().tls, self.insecure_plaintext or None)
        self.port_file = Path(tempfile.mkdtemp(prefix="rlfabric-")) / "coordinator.address"
        if self.preload:
            prestart(self.torch_threads)
        self._spawn("coordinator", "rlfabric.services.coordinator.server",
                    ["--port-file", str(self.port_file), "--runs-root", str(self.runs_root),
                     "--heartbeat-timeout", str(self.heartbeat_timeout_s),
                     "--take-up-runs", "yes" if self.take_up_runs else "no",
                     *(["--dashboard-port", str(self.dashboard_port)] if self.dashboard_port >= 0 else [])])

    def spawn_workers(self, roles: tuple[str, ...]) -> None:
        """Start workers that register with the coordinator once it is up (they wait for its address file)."""
        for name in _names(roles):
            self._spawn(name, f"rlfabric.services.{name.split('-')[0]}.server", ["--coordinator-file", str(self.port_file),
                                                                        *local_stack_args(self.host, self.runs_root)])

    def wait_coordinator(self, timeout_s: float = 60.0) -> str:
        proc = self.procs["coordinator"]
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with code {proc.returncode} at start-up; see "
                                   f"{self.log_dir / 'coordinator.stderr'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start within {timeout_s:.0f}s")
            time.sleep(0.005)
        self.address = self.port_file.read_text().strip()
        return self.address

    def start_coordinator(self, timeout_s: float = 60.0, workers: tuple[str, ...] = ()) -> str:
        """Start the coordinator (and, at the same moment, ``workers`` that register once it is up)."""
        self.spawn_coordinator()
        self.spawn_workers(workers)
        return self.wait_coordinator(timeout_s)

    def start_worker(self, role: str, name: str | None = None, pool: str = "") -> subprocess.Popen:
        """One more worker of ``role``; ``pool`` registers it in that resource pool (``--pool``)."""
        return self._spawn(name or role, f"rlfabric.services.{role}.server",
                           ["--coordinator", self.address, *(["--pool", pool] if pool else []),
                            *local_stack_args(self.host, self.runs_root)])

    def start(self) -> str:
        return self.start_coordinator(workers=self.roles)

    def dead(self) -> dict[str, int]:
        """Services that exited and will not be restarted (with supervision: those whose restarts ran out)."""
        if self._supervisor is not None:
            return dict(self.given_up)
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def supervise(self, max_restarts: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        """Restart a worker process that dies (restart policy on-failure), after backoff_s x 2^k (capped) for its
        k-th restart, at most ``max_restarts`` times; then it stays down and ``dead()`` names it. A restarted worker
        registers with the coordinator again as a new worker; a restarted coordinator serves on its old address,
        workers register with it again, and it takes up the runs it held (services/coordinator/runindex.py)."""
        def loop() -> None:
            due: dict[str, float] = {}
            lost_since: dict[int, float] = {}
            polled = 0.0
            while not self._stopping.wait(0.2):
                if time.monotonic() - polled >= 1.0:
                    polled = time.monotonic()
                    self._kill_lost(lost_since)
                for name, proc in list(self.procs.items()):
                    if name in self.given_up or proc.poll() is None:
                        continue
                    count = self.restarts.get(name, 0)
                    if count >= max_restarts:
                        self.given_up[name] = proc.returncode
                        log.error("service %s exited with code %s and was restarted %d times already: it stays "
                                  "down; see %s", name, proc.returncode, count, self.log_dir / f"{name}.stderr")
                        continue
                    when = due.setdefault(name, time.monotonic() + restart_delay(count, backoff_s, max_backoff_s))
                    if time.monotonic() < when or self._stopping.is_set():
                        continue
                    del due[name]
                    self.restarts[name] = count + 1
                    log.warning("service %s exited with code %s; restarting it (restart %d of at most %d)", name,
                                proc.returncode, count + 1, max_restarts)
                    module, args = self.commands[name]
                    if name == "coordinator":  # on its own address again: workers and clients find it there,
                        # and it takes up the runs it held
                        args = [*args, "--port", self.address.rsplit(":", 1)[1], "--take-up-runs", "yes"]
                    self._spawn(name, module, args)

        self._supervisor = threading.Thread(target=loop, name="stack-supervisor", daemon=True)
        self._supervisor.start()

    def _kill_lost(self, lost_since: dict[int, float]) -> None:
        """SIGKILL a process of this stack that the coordinator declared lost and that did not come back on its own
        (a frozen process, SIGSTOP or swapped out, never does): supervision then restarts it clean, so a recovery
        finds a live worker and never waits on a busy or frozen one. A live process told it is lost registers
        again within a heartbeat (or exits, if its work still runs), so only one listed lost for longer than
        twice the heartbeat timeout is killed."""
        from rlfabric.services.coordinator.client import (
            CoordinatorClient,  # (not before the fork server started)
        )

        if not self.address:
            return
        if self._lister is None:
            self._lister = CoordinatorClient(self.address, timeout_s=2.0)
        try:
            workers = self._lister.workers()
        except Exception:  # noqa: BLE001 — a coordinator restarting or busy: the next poll sees it
            return
        live_pids = {w.pid for w in workers if w.alive}
        lost = {w.pid for w in workers if not w.alive and w.pid not in live_pids}
        now, grace = time.monotonic(), 2 * self.heartbeat_timeout_s
        for pid in list(lost_since):
            if pid not in lost:
                del lost_since[pid]
        for name, proc in list(self.procs.items()):
            if name == "coordinator" or proc.pid not in lost or proc.poll() is not None:
                continue
            if now - lost_since.setdefault(proc.pid, now) >= grace:
                log.warning("service %s (pid %d) was declared lost by the coordinator %.0f s ago and is still "
                            "there: killing it so that it restarts", name, proc.pid, now - lost_since[proc.pid])
                proc.kill()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every service (workers first), wait, then SIGKILL whatever is left."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        if self._lister is not None:
            self._lister.close()
        order = [n for n in self.procs if n != "coordinator"] + (["coordinator"] if "coordinator" in self.procs else [])
        for name in order:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name in order:
            proc = self.procs[name]
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
