"""Shared fixtures: real service processes on loopback (LocalStack) and small run configs."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from rlfabric.services.core import auth
from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.runtime import GRPC_OPTIONS
from rlfabric.services.launcher import LocalStack


class Aborted(Exception):
    """What ``AbortingContext.abort`` raises: a handler's refusal, with its status code and details."""

    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class AbortingContext:
    """The part of a gRPC servicer context a handler called in-process uses to refuse (and the call's metadata)."""

    def __init__(self, metadata: tuple = ()):
        self.metadata = metadata

    def invocation_metadata(self) -> tuple:
        return self.metadata

    async def abort(self, code, details):
        raise Aborted(code, details)


@pytest.fixture(autouse=True)
def _gpu_device_mixes_fail_here(request):
    """The fast unit tests (every algorithm's update, every policy's forward and act, in-process) run GPU-path code
    under tests/device_guard.py, so a tensor that code creates without its inputs' device fails here as it would
    on a GPU. Not elsewhere: torch.compile (vLLM's samplers) cannot trace through a TorchFunctionMode, and an
    in-process FSDP rank group crashed its pytest worker under one."""
    node = request.node
    if ("torch" not in sys.modules or f"{os.sep}tests{os.sep}unit{os.sep}" not in str(node.path)
            or node.get_closest_marker("slow") or node.get_closest_marker("serial")):
        yield
        return
    from tests.device_guard import guard

    with guard():
        yield


def short_config(**overrides) -> RunConfig:
    """A small CartPole run for API tests (not for learning thresholds)."""
    data = {
        "name": "test", "env": {"num_envs": 4, "eval_envs": 2},
        "algorithm": {"name": "ppo", "n_steps": 16, "batch_size": 64, "n_epochs": 2},
        "train": {"total_env_steps": 640, "eval_every_iterations": 5, "eval_episodes": 2},
        "data_plane": {"timeout_s": 10},
        "runtime": {"worker_wait_s": 30},
    }
    for key, value in overrides.items():
        node = data
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return RunConfig.model_validate(data)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Coordinator + env + replay + learner + rollout as real processes, registered and alive."""
    root = tmp_path_factory.mktemp("stack")
    # runs may live anywhere under the session's temporary directory (every tmp_path is in it): the coordinator
    # confines run directories to its runs root
    s = LocalStack(log_dir=root / "logs", runs_root=tmp_path_factory.getbasetemp(), heartbeat_timeout_s=3.0)
    s.start()
    from rlfabric.services.coordinator.client import CoordinatorClient

    client = CoordinatorClient(s.address)
    client.wait_ready(30)
    import time

    deadline = time.monotonic() + 60
    while len([w for w in client.workers() if w.alive]) < 4:
        assert time.monotonic() < deadline, f"workers did not register; logs in {root / 'logs'}"
        assert not s.dead(), f"service exited at start-up: {s.dead()}; logs in {root / 'logs'}"
        time.sleep(0.1)
    s.client = client
    s.root = root
    yield s
    client.close()
    s.stop()


@pytest.fixture
def private_stack(tmp_path):
    """A stack of the test's own with a fast heartbeat timeout, for tests that kill its workers."""
    from rlfabric.services.coordinator.client import CoordinatorClient

    s = LocalStack(log_dir=tmp_path / "logs", runs_root=tmp_path, heartbeat_timeout_s=1.5)
    s.start()
    s.client = CoordinatorClient(s.address)
    try:
        s.client.wait_ready(30)
        yield s
    finally:
        s.client.close()
        s.stop()


@pytest.fixture(autouse=True)
def _security(request):
    """This process presents the secret of the stack a test uses (none otherwise), and nothing leaks between tests:
    the security settings are process-wide, like a service's."""
    token = ""
    for name in ("stack", "private_stack"):
        if name in request.fixturenames:
            token = request.getfixturevalue(name).token
    auth.configure(token)
    yield
    auth.configure("")


def wait_for_workers(stack, count: int, timeout_s: float = 90.0) -> None:
    """Until ``count`` workers of ``stack`` are registered and alive; fails at once if a service exited."""
    import time

    deadline = time.monotonic() + timeout_s
    while len([w for w in stack.client.workers() if w.alive]) < count:
        assert time.monotonic() < deadline and not stack.dead(), f"workers did not register: {stack.dead()}"
        time.sleep(0.2)


def grpc_channel(address: str):
    """A blocking channel to a service that presents this process's secret."""
    return auth.sync_channel(address, GRPC_OPTIONS)


def metrics_text(url: str) -> str:
    """A service's Prometheus page, asked with the bearer token."""
    import urllib.request

    request = urllib.request.Request(url, headers=auth.metrics_headers())
    return urllib.request.urlopen(request, timeout=5).read().decode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_terminal_summary(terminalreporter) -> None:
    """The fuzz suite's report (tests/integration/test_fuzz.py): inputs tried per service and plane."""
    import sys

    fuzz = sys.modules.get("tests.integration.test_fuzz")
    counts = getattr(fuzz, "FUZZ_COUNTS", None)
    if counts:
        terminalreporter.write_line("fuzz inputs tried (0 crashes, 0 hangs, 0 unhealthy unless a test failed): " +
                                    ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def pytest_configure(config) -> None:
    # pytest-xdist's --dist loadfile hands out the files with the most tests first (its --loadscope-reorder, on by
    # default), which would undo the order below: a one-test file of many minutes started last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_sessionstart(session) -> None:
    """The parallel phases' artefacts are built ahead on the core a serial phase leaves idle (tests/prebuild.py):
    with RLFABRIC_PREBUILD=1 (.ci/run) a serial phase starts the build, and a parallel phase, which takes both
    cores, stops it first."""
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: its controller decides
        return
    from tests import prebuild

    serial_phase = "serial" in (config.option.markexpr or "").replace("not serial", "")
    if getattr(config.option, "numprocesses", None):  # a parallel phase
        if prebuild.stop():
            config.get_terminal_writer().line("stopped tests/prebuild.py: the parallel phase starts")
    elif serial_phase and os.environ.get("RLFABRIC_PREBUILD") == "1":
        prebuild.start()


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first: those whose own timeout exceeds the suite's, then those marked ``minutes(n)``, by
    those numbers (a ``fresh_process`` file before all of them; a ``start_as(n)`` file where one of n minutes
    goes). The tiers run two files at a time, and a file of minutes started last would leave the other worker idle
    while it ends the tier alone. Files go to the two workers in turn: the first and third of this order to one,
    the second and fourth to the other, the rest to whichever finishes first."""
    default = float(config.getini("timeout") or 0)

    def weight(item) -> float:
        if item.get_closest_marker("fresh_process"):
            return float("inf")  # before any other file of its tier: its worker has run no test yet
        if start_as := item.get_closest_marker("start_as"):  # a file that would only wait if started first
            return 60.0 * float(start_as.args[0])
        timeout, minutes = item.get_closest_marker("timeout"), item.get_closest_marker("minutes")
        own = float(timeout.args[0]) if timeout and timeout.args else 0.0
        return max(own if own > default else 0.0, 60.0 * float(minutes.args[0]) if minutes else 0.0)

    items.sort(key=lambda item: -weight(item))
