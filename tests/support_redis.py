"""Real Redis for tests: the ``redis_server`` fixture and ``RedisServer``, a redis-server process a test controls.

``redis_server`` yields a URL. With RLFABRIC_TEST_REDIS_URL set (CI starts a Redis) it uses that server on a db
picked from the test's name and flushed before and after; otherwise it starts a private redis-server on a free
loopback port and stops it afterwards. Tests that kill or restart Redis use ``RedisServer`` directly.

    from tests.support_redis import redis_server  # noqa: F401
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from tests.conftest import free_port

REDIS_BIN = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else "")


class RedisServer:
    """A redis-server on 127.0.0.1 that can be killed and restarted on the same port and data directory; its
    fixture kills it. It is started without a preexec_fn: one makes subprocess fork and run Python in the child,
    where gRPC's fork handlers (the test process holds gRPC channels) restart a poller thread whose epoll fd
    close_fds then closes, and the child aborts (SIGABRT, "epoll_wait error: Bad file descriptor") before exec.
    """

    def __init__(self, workdir: str | Path, *, appendonly: bool = False, appendfsync: str = "everysec",
                 port: int | None = None, extra_args: tuple[str, ...] = ()):
        if not REDIS_BIN:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server) and this test controls "
                        "its own Redis")
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def password(self) -> str | None:
        args = list(self.extra_args)
        return args[args.index("--requirepass") + 1] if "--requirepass" in args else None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync,
                "--logfile", str(self.dir / "redis.log"), *self.extra_args]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5, password=self.password)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "redis.log").read_text() if (self.dir / "redis.log").exists() else ""
                    code = self.proc.poll()
                    self.stop()
                    why = f"it exited with code {code}" if code is not None else f"no PING answer in {timeout_s:g}s"
                    raise RuntimeError(f"redis-server on port {self.port} did not start ({why}): {log[-1500:]}") \
                        from None
                time.sleep(0.01)
            finally:
                client.close()
        return self

    def kill(self) -> None:
        """SIGKILL: Redis gets no chance to flush anything (what a crash looks like)."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown (Redis flushes its append-only file)."""
        self._signal(signal.SIGTERM)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


@pytest.fixture
def redis_server(tmp_path_factory):
    """A Redis URL for one test, empty at the start."""
    shared = os.environ.get("RLFABRIC_TEST_REDIS_URL", "")
    if shared:
        # a database per xdist worker (db 0 is left to whatever else uses that Redis): a worker runs one test at a
        # time, and two workers never share one. Chosen by the test's id instead, two tests that ran side by side
        # could draw the same database and flush each other's data.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        db = 1 + (int(worker[2:]) if worker[2:].isdigit() else 14) % 15
        url = _with_db(shared, db)
        client = redis.Redis.from_url(url)
        client.flushdb()
        yield url
        client.flushdb()
        client.close()
        return
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.kill()
