"""`rlfabric up` keeps a stack serving for notebooks and `train --coordinator`; a signal stops all of it."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import grpc
import pytest

from rlfabric.services.coordinator.client import CoordinatorClient
from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2

pytestmark = pytest.mark.minutes(0.4)  # on CI's 2 cores: the tiers start long files first


def _serving(up: subprocess.Popen, tmp_path) -> tuple[str, CoordinatorClient]:
    """The address `rlfabric up` printed and a client holding its secret, once every worker is registered."""
    address = up.stdout.readline().strip()
    client = CoordinatorClient(address, token_file=str(tmp_path / "runs" / ".rlfabric" / "token"))
    client.wait_ready(30)
    deadline = time.monotonic() + 60
    while len([w for w in client.workers() if w.alive]) < 4:
        assert time.monotonic() < deadline and up.poll() is None
        time.sleep(0.1)
    return address, client


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_runs_and_stops_everything_on_a_signal(tmp_path, sig):
    # as a background job: SIGINT ignored (set by the shell, not a preexec_fn: see tests/support_redis.py)
    up = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$0" -m rlfabric.services.cli up --runs-root "$1"', sys.executable,
                           str(tmp_path / "runs")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        address, client = _serving(up, tmp_path)
        token_file = tmp_path / "runs" / ".rlfabric" / "token"  # the stack's secret, for its clients only
        assert token_file.stat().st_mode & 0o077 == 0
        # docs/deployment.md: "`up` writes it to `<runs-root>/.rlfabric/token` and the scrape token to
        # `<runs-root>/.rlfabric/scrape-token` (both owner-only)"
        scrape_file = token_file.parent / "scrape-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == stat.S_IMODE(scrape_file.stat().st_mode) == 0o600
        assert scrape_file.read_text().strip() == auth.Security(token_file.read_text().strip()).scrape_token
        stranger = CoordinatorClient(address, token="not-the-secret-of-this-stack")
        with pytest.raises(grpc.RpcError) as refused:
            stranger.workers()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        pids = {w.pid for w in client.workers()}
        if sig == signal.SIGTERM:  # one run through the served stack, as a notebook would submit it
            train = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", "examples/cartpole_ppo.yaml",
                                    "--coordinator", address, "--quiet", "--set", "train.total_env_steps=512",
                                    "--run-dir", str(tmp_path / "runs" / "r1")], capture_output=True, text=True,
                                   timeout=120, env={**os.environ, "RLFABRIC_TOKEN_FILE": str(token_file)})
            assert train.returncode == 0, train.stderr
            assert client.status("r1").state == coordinator_pb2.SUCCEEDED
        client.close()
        up.send_signal(sig)
        assert up.wait(30) == 0
        for pid in pids:  # every service went down with it
            assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
    finally:
        if up.poll() is None:
            up.kill()


def test_a_sigkilled_cli_takes_its_services_with_it(tmp_path):
    """Services are forked from a forkserver (their parent), which outlives the CLI while any of them runs: they
    watch the CLI itself, so a SIGKILL of it leaves nothing behind."""
    up = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "up", "--runs-root", str(tmp_path / "runs")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        _, client = _serving(up, tmp_path)
        pids = {w.pid for w in client.workers()}
        client.close()
    finally:
        up.kill()
        up.wait()
    deadline = time.monotonic() + 20
    while any(subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0 for pid in pids):
        assert time.monotonic() < deadline, "services outlived their SIGKILLed CLI"
        time.sleep(0.2)


def test_up_restarts_a_killed_coordinator_on_its_address_and_keeps_serving(tmp_path):
    """`rlfabric up` supervises its coordinator too: SIGKILLed, it comes back on the same address, the workers
    register with it again, and `up` goes on serving (it used to exit once the coordinator died)."""
    up = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "up", "--runs-root", str(tmp_path / "runs")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        address, client = _serving(up, tmp_path)
        port = address.rsplit(":", 1)[1]
        [coordinator] = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith(
            f"rlfabric-coordinator grpc=:{port}")]
        os.kill(coordinator, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # the same address answers again, with every worker registered anew
            assert up.poll() is None, up.stderr.read()[-2000:]
            assert time.monotonic() < deadline
            try:
                if len([w for w in client.workers() if w.alive]) == 4:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        client.close()
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    finally:
        if up.poll() is None:
            up.kill()


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_up_with_tls_auto_serves_mutual_tls_and_a_public_host_wants_tls(tmp_path, monkeypatch):
    """`up --tls auto` makes the stack's CA and certificates: gRPC is mTLS, metrics HTTPS, clients (the CLI with
    --tls-*, rlfabric.Client from RLFABRIC_TLS_*) get in with the client certificate, a peer without one does not.
    Without TLS, `up` refuses a non-loopback host (finding 6 of issue 19)."""
    import ssl
    import urllib.request

    from rlfabric.services.core import auth
    from rlfabric.services.core.runtime import GRPC_OPTIONS, ROLE_NAMES

    refused = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "up", "--runs-root", str(tmp_path / "public"),
                              "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--tls auto" in refused.stderr and "--insecure-plaintext" in refused.stderr
    assert not (tmp_path / "public").exists()
    runs = tmp_path / "runs"
    up = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "up", "--runs-root", str(runs), "--tls", "auto"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        tls = runs / ".rlfabric" / "tls"
        for var, name in (("CA", "ca.pem"), ("CERT", "client.pem"), ("KEY", "client.key")):
            monkeypatch.setenv(f"RLFABRIC_TLS_{var}", str(tls / name))
        address, client = _serving(up, tmp_path)
        token_file = runs / ".rlfabric" / "token"
        status = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "status", "--coordinator", address,
                                 "--tls-ca", str(tls / "ca.pem"), "--tls-cert", str(tls / "client.pem"),
                                 "--tls-key", str(tls / "client.key")], capture_output=True, text=True, timeout=60,
                                env={**{k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")},
                                     "RLFABRIC_TOKEN_FILE": str(token_file)})
        assert status.returncode == 0 and "rollout" in status.stdout, status.stderr
        token = token_file.read_text().strip()
        for stranger in (auth.Security(token), auth.Security(token, auth.TLSFiles(ca=str(tls / "ca.pem")))):
            with auth.sync_channel(address, GRPC_OPTIONS, stranger) as channel:  # in clear; TLS without a cert
                with pytest.raises(grpc.RpcError):
                    channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5)
        replay = next(w for w in client.workers() if ROLE_NAMES[w.role] == "replay")
        assert replay.endpoint.metrics.startswith("https://")
        scrape = (runs / ".rlfabric" / "scrape-token").read_text().strip()
        request = urllib.request.Request(replay.endpoint.metrics, headers={"Authorization": f"Bearer {scrape}"})
        context = ssl.create_default_context(cafile=str(tls / "ca.pem"))
        assert b"rlfabric_rpcs_total" in urllib.request.urlopen(request, timeout=10, context=context).read()
        logs = runs / "logs"  # issue 19, finding 9: what services log is their owner's alone
        assert logs.stat().st_mode & 0o777 == 0o700
        assert {p.stat().st_mode & 0o777 for p in logs.iterdir()} == {0o600}
        client.close()
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    finally:
        if up.poll() is None:
            up.kill()
