"""Authentication that holds on a network (issue 19, findings 5, 6, 9's token file and 10's metrics server):
nothing runs for a caller without the token, the secret never goes on the wire, a public bind wants TLS, metrics
have their own read-only credential and stay up under idle connections, and secrets and logs are owner-only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.services.core import auth, certs
from rlfabric.services.core.runtime import GRPC_OPTIONS
from rlfabric.services.launcher import open_private_log, private_dir
from tests.conftest import free_port

pytestmark = pytest.mark.minutes(0.5)  # on CI's 2 cores: the tiers start long files first

TOKEN = "security-test-secret-0123456789abcdef"


def _clean_env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")} | extra


@contextlib.contextmanager
def _env_service(workdir: Path, *flags: str) -> Iterator[tuple[str, int, int, Path]]:
    """An env service process with the token (and ``flags``): (gRPC address, pid, metrics port, log file)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file, log_file, metrics_port = workdir / "env.address", workdir / "env.log", free_port()
    with open(workdir / "env.stderr", "wb") as stderr:  # a file: a pipe nobody reads could stall the service
        proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.env.server", "--port-file", str(port_file),
                                 "--metrics-port", str(metrics_port), "--log-file", str(log_file), *flags],
                                env=_clean_env(RLFABRIC_TOKEN=TOKEN), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert proc.poll() is None, (workdir / "env.stderr").read_text()[-2000:]
            assert time.monotonic() < deadline, "the env service did not start"
            time.sleep(0.05)
        yield port_file.read_text().strip(), proc.pid, metrics_port, log_file
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with _env_service(tmp_path_factory.mktemp("env")) as running:
        yield running


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _scrape(port: int, header: str | None = None, scheme: str = "http", context: ssl.SSLContext | None = None
            ) -> tuple[int, str]:
    headers = {"Authorization": header} if header else {}
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _rpc_series(port: int) -> list[str]:
    status, text = _scrape(port, f"Bearer {auth.Security(TOKEN).scrape_token}")
    assert status == 200, text
    return [line for line in text.splitlines() if line.startswith("rlfabric_rpcs_total{")]


async def _random_calls(address: str, count: int, concurrency: int = 128) -> dict[str, int]:
    """``count`` unary calls to random method paths, every other one with the deployment's bearer."""
    good = auth.Security(TOKEN).metadata()
    codes: dict[str, int] = {}
    rng = random.Random(19)
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        async def worker(n: int) -> None:
            for i in range(n, count, concurrency):
                method = f"/fuzz{rng.getrandbits(40):x}.Svc{i}/M{rng.getrandbits(40):x}"
                call = channel.unary_unary(method)
                try:
                    await call(b"", timeout=30, metadata=good if i % 2 else ())
                    code = "OK"
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
                codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(worker(n) for n in range(concurrency)))
    return codes


def test_30k_random_method_names_leave_the_service_rss_flat_and_the_rpc_counter_bounded(service):
    """Finding 5: the RPC counter labelled each call with the path the caller sent, before the token check. A label
    per distinct name costs over 1 KiB, so 30k calls would grow RSS past the 10 MiB bound (100k calls, its first
    form, took 35-110 s of the fast tier on 2 cores and proved no more)."""
    address, pid, metrics_port, _ = service
    asyncio.run(_random_calls(address, 5_000))  # warm-up: arenas, caches, the counter's one "unknown" child
    before = _rss_kib(pid)
    started = time.monotonic()
    codes = asyncio.run(_random_calls(address, 30_000))
    elapsed = time.monotonic() - started
    after = _rss_kib(pid)
    assert after - before < 10 * 1024, f"RSS grew {(after - before) / 1024:.1f} MiB over 30k calls ({elapsed:.0f} s)"
    methods = {line.split('method="', 1)[1].split('"', 1)[0] for line in _rpc_series(metrics_port)}
    assert len(methods) < 20 and not any(m.startswith("M") for m in methods), len(methods)  # no caller's label
    assert "unknown" in methods
    # a stranger learns nothing, not even that a method does not exist; a token holder is told it does not
    assert codes == {"UNAUTHENTICATED": 15_000, "UNIMPLEMENTED": 15_000}, codes


def test_a_call_without_the_token_is_refused_before_anything_counts_it(service):
    address, _, metrics_port, _ = service

    def health_count() -> float:
        lines = [line for line in _rpc_series(metrics_port) if 'method="Check"' in line]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    before = health_count()
    with grpc.insecure_channel(address) as channel:
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "RLFABRIC_TOKEN" in refused.value.details()
    assert health_count() == before
    with auth.sync_channel(address, GRPC_OPTIONS, auth.Security(TOKEN)) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health_count() == before + 1


def test_the_secret_never_goes_on_the_wire_and_each_credential_opens_only_its_own_port(service):
    """Finding 6(d): the bearer gRPC carries, the scrape token and the CURVE keys are each derived from the secret
    under their own label; holding one (sniffed) gives none of the others."""
    address, _, metrics_port, _ = service
    security = auth.Security(TOKEN)
    [(key, value)] = security.metadata()
    assert key == "authorization" and TOKEN not in value
    sniffed = auth.Security(value.removeprefix("Bearer "))  # a sniffer who takes the bearer for the secret
    for role in ("server", "client"):
        assert sniffed.curve_keys(role) != security.curve_keys(role)
        assert security.curve_keys(role)[1] not in value.encode()
    assert len({security.bearer, security.scrape_token, sniffed.scrape_token, TOKEN}) == 4
    # the scrape token reads metrics and calls nothing; the gRPC bearer (or the secret itself) reads no metrics
    assert _scrape(metrics_port, f"Bearer {security.scrape_token}")[0] == 200
    for wrong in (value, f"Bearer {TOKEN}", f"Bearer {sniffed.scrape_token}", None):
        assert _scrape(metrics_port, wrong)[0] == 401, wrong
    with grpc.insecure_channel(address) as channel:
        for bearer in (security.scrape_token, TOKEN):
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5,
                                                          metadata=(("authorization", f"Bearer {bearer}"),))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_serve_on_a_public_address_wants_tls_or_an_explicit_insecure_plaintext(tmp_path):
    """Finding 6(a): a token alone let `serve --host 0.0.0.0` put the bearer on the network in clear."""
    try:
        refused = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "serve", "env", "--host", "0.0.0.0",
                                  "--coordinator", "127.0.0.1:9"], capture_output=True, text=True, timeout=60,
                                 env=_clean_env(RLFABRIC_TOKEN=TOKEN))
    except subprocess.TimeoutExpired:
        pytest.fail("serve --host 0.0.0.0 without TLS started instead of refusing")
    assert refused.returncode == 2, refused.stderr
    for named in ("without TLS", "--tls-cert", "--tls-key", "--insecure-plaintext", "rlfabric certs"):
        assert named in refused.stderr, (named, refused.stderr)
    with _env_service(tmp_path / "plain", "--host", "0.0.0.0", "--insecure-plaintext") as (_, _, _, log_file):
        records = [json.loads(line) for line in log_file.read_text().splitlines()]
        assert any(r["level"] == "warning" and "in the clear" in r["msg"] and "--insecure-plaintext" in r["msg"]
                   for r in records), records


def test_certs_give_services_mtls_and_https_metrics_and_clients_connect_with_the_ca(tmp_path):
    """Finding 6(b, c): `rlfabric certs` makes the deployment's CA and certificates; a service serves gRPC (mTLS)
    and metrics (HTTPS) with them; clients, the health probe among them, take the CA (and their certificate)."""
    made = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "certs", str(tmp_path / "tls"), "--hosts",
                           "node-a.lab,10.1.2.3"], capture_output=True, text=True, timeout=60, env=_clean_env())
    assert made.returncode == 0, made.stderr
    paths = certs.existing(tmp_path / "tls")
    assert paths is not None
    for key in ("ca.key", "server.key", "client.key"):
        assert paths[key].stat().st_mode & 0o077 == 0, key
    again = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "certs", str(tmp_path / "tls"), "--hosts", "x"],
                           capture_output=True, text=True, timeout=60, env=_clean_env())
    assert again.returncode == 2 and "--force" in again.stderr  # never replaces a CA silently
    service_tls = certs.service_files(paths)
    flags = ("--tls-cert", service_tls.cert, "--tls-key", service_tls.key, "--tls-ca", service_tls.ca,
             "--metrics-tls")
    with _env_service(tmp_path / "svc", *flags) as (address, _, metrics_port, _):
        address = "localhost:" + address.rsplit(":", 1)[1]
        client = auth.Security(TOKEN, certs.client_files(paths))
        with auth.sync_channel(address, GRPC_OPTIONS, client) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        probe = subprocess.run([sys.executable, "-m", "rlfabric.services.core.healthcheck", address], capture_output=True,
                               text=True, timeout=60, env=_clean_env(
                                   RLFABRIC_TOKEN=TOKEN, RLFABRIC_TLS_CA=str(paths["ca.pem"]),
                                   RLFABRIC_TLS_CERT=str(paths["client.pem"]),
                                   RLFABRIC_TLS_KEY=str(paths["client.key"])))
        assert probe.returncode == 0, probe.stderr
        from rlfabric.services.coordinator.client import (
            CoordinatorClient,  # a notebook's client takes the files too
        )

        notebook = CoordinatorClient(address, token=TOKEN, tls=certs.client_files(paths))
        try:
            health_pb2_grpc.HealthStub(notebook._channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        finally:
            notebook.close()
        context = ssl.create_default_context(cafile=str(paths["ca.pem"]))
        scrape = f"Bearer {auth.Security(TOKEN).scrape_token}"
        status, text = _scrape(metrics_port, scrape, "https", context)
        assert status == 200 and "rlfabric_rpcs_total" in text
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plaintext metrics beside HTTPS
            _scrape(metrics_port, scrape)
    with _env_service(tmp_path / "server-tls", "--tls-cert", service_tls.cert, "--tls-key", service_tls.key
                      ) as (address, _, _, _):  # TLS without mTLS: a client holding only the CA gets in
        address = "localhost:" + address.rsplit(":", 1)[1]
        with auth.sync_channel(address, GRPC_OPTIONS, auth.Security(TOKEN, auth.TLSFiles(ca=service_tls.ca))) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)


def test_idle_connections_neither_pile_up_threads_nor_keep_a_scrape_out():
    """Finding 10: the metrics server started a thread per connection and never timed a socket out."""
    security = auth.Security(TOKEN)
    server, port = auth.start_metrics_server(0, "127.0.0.1", security)
    server.timeout_s = 1.0
    idle = []
    try:
        threads = threading.active_count()
        for _ in range(200):  # slowloris: connect, send half a request head, then nothing
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            idle.append(sock)
        time.sleep(0.3)
        assert threading.active_count() <= threads + 1
        assert server.connections <= server.max_connections
        started = time.monotonic()
        status, text = _scrape(port, f"Bearer {security.scrape_token}")
        assert status == 200 and "rlfabric_rpcs_total" in text
        assert time.monotonic() - started < 2.0
        deadline = time.monotonic() + 10
        for sock in idle[-20:]:  # still open when the cap was reached: closed by the server at their timeout
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            assert sock.recv(1) == b""
        assert server.connections == 0
    finally:
        for sock in idle:
            sock.close()
        server.shutdown()


def test_the_token_file_is_owner_only_and_never_written_through_a_symlink(tmp_path):
    """Finding 9: write_token_file kept an existing file's mode and followed symlinks."""
    wide = tmp_path / "token"
    wide.write_text("old\n")
    wide.chmod(0o644)
    auth.write_token_file(wide, TOKEN)
    assert wide.stat().st_mode & 0o777 == 0o600 and wide.read_text() == TOKEN + "\n"
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(auth.AuthError, match="symlink"):
        auth.write_token_file(link, TOKEN)
    assert target.read_text() == "keep\n"
    fresh = auth.write_token_file(tmp_path / "new" / "dir" / "token", TOKEN)
    assert fresh.stat().st_mode & 0o777 == 0o600 and fresh.parent.stat().st_mode & 0o777 == 0o700


def test_launcher_logs_are_owner_only_and_its_directories_0700(tmp_path):
    """Finding 9: the launcher opened service logs 0644 (and left run directories to the umask)."""
    old = tmp_path / "old.stderr"
    old.write_text("x")
    old.chmod(0o644)
    os.close(open_private_log(old))
    assert old.stat().st_mode & 0o777 == 0o600 and old.read_text() == ""
    logs = private_dir(tmp_path / "runs" / "r1" / "logs")
    for d in (logs, logs.parent, logs.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700, d


def _outbound_address() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing), or None where it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never reached
            host = s.getsockname()[0]
        except OSError:
            return None
    return None if auth.is_loopback(host) else host


def test_a_client_without_tls_never_sends_the_bearer_off_this_host(tmp_path):
    """Issue 39, finding 10(a): with a token and no CA, a client sent the bearer in clear to any host. Now every
    channel to another host is refused before it connects, naming both fixes; loopback, TLS and the operator's
    explicit plaintext still connect."""
    plain = auth.Security(TOKEN)
    for address in ("10.1.2.3:5000", "dns:///10.1.2.3:5000", "ipv4:192.0.2.7:50051", "[2001:db8::1]:50051"):
        with pytest.raises(auth.PlaintextRefused) as refused:
            auth.sync_channel(address, GRPC_OPTIONS, plain)
        for named in ("in the clear", auth.TLS_ENV["ca"], f"{auth.PLAINTEXT_ENV}=1", "--insecure-plaintext"):
            assert named in str(refused.value), (named, str(refused.value))
        with pytest.raises(auth.PlaintextRefused):
            auth.aio_channel(address, GRPC_OPTIONS, plain)
    for address in ("127.0.0.1:5000", "localhost:5000", "[::1]:5000", "dns:///127.0.0.1:1"):
        auth.sync_channel(address, GRPC_OPTIONS, plain).close()
    tls = certs.client_files(certs.generate(tmp_path / "tls", ["10.1.2.3"]))
    for allowed in (auth.Security(TOKEN, tls), auth.Security(TOKEN, plaintext_ok=True),
                    auth.Security()):  # TLS; the operator's word; no token, so no bearer to leak
        auth.sync_channel("10.1.2.3:5000", GRPC_OPTIONS, allowed).close()

    host = _outbound_address()
    if host is None:
        return
    listener = socket.socket()  # a peer on this host's own network address: nothing may reach it in clear
    listener.bind((host, 0))
    listener.listen(4)
    listener.settimeout(1.0)
    try:
        env = _clean_env(RLFABRIC_TOKEN=TOKEN)
        code = ("import rlfabric, sys\n"
                f"try:\n    rlfabric.Client('{host}:{listener.getsockname()[1]}').workers()\n"
                "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert "PlaintextRefused" in proc.stdout and auth.PLAINTEXT_ENV in proc.stdout, (proc.stdout, proc.stderr)
        with pytest.raises(TimeoutError):
            listener.accept()  # no connection was even opened
    finally:
        listener.close()


def test_insecure_plaintext_in_the_environment_lets_a_client_dial_another_host(monkeypatch):
    """deployment.md: "(`PlaintextRefused`, naming `RLFABRIC_TLS_CA` and `RLFABRIC_INSECURE_PLAINTEXT=1`, the
    operator's way to allow it on a network they trust)": the variable, read where clients read it (the token from
    the environment, `rlfabric.Client` with and without `token=`), lets a channel to a non-loopback address be built
    (nothing connects until a call); without it, or set to 0, the same client is refused."""
    import rlfabric
    from rlfabric.services.coordinator.client import CoordinatorClient

    for name in [n for n in os.environ if n.startswith("RLFABRIC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    address = "10.1.2.3:5000"

    def cli() -> None:  # the CLI and health probes
        auth.sync_channel(address, GRPC_OPTIONS, auth.from_environment()).close()

    def notebook() -> None:  # the token from the environment
        rlfabric.Client(address).close()

    def given_token() -> None:
        CoordinatorClient(address, token=TOKEN).close()

    for value in ("", "0"):
        monkeypatch.setenv(auth.PLAINTEXT_ENV, value)
        for client in (cli, notebook, given_token):
            auth.configure("")  # a fresh process: nothing configured yet
            with pytest.raises(auth.PlaintextRefused):
                client()
    assert auth.PLAINTEXT_ENV == "RLFABRIC_INSECURE_PLAINTEXT"
    monkeypatch.setenv("RLFABRIC_INSECURE_PLAINTEXT", "1")
    for client in (cli, notebook, given_token):
        auth.configure("")
        client()
    assert auth.from_environment().plaintext_ok and not auth.current().tls.client_enabled
