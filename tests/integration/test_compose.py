"""The compose deployment: the file validates, its structure holds what the services need, and the services really
are configurable by RLFABRIC_* environment variables alone (what the containers rely on)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlfabric.services.core.config import load_config
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2
from rlfabric.services.core.runtime import ServiceOptions, apply_env_defaults
from tests.conftest import free_port
from tests.serve_flags import service_flags

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
ENV_EXAMPLE = ROOT / "compose" / ".env.example"
RUN_SPEC = ROOT / "examples" / "cartpole_ppo_compose.yaml"
RLFABRIC = ("coordinator", "env", "replay", "learner", "rollout")
BACKING = ("redis", "minio")
ONE_SHOT = ("certs",)  # the deployment's CA and certificates, made on the first `up`
# compose refuses to start without each of these (no default credentials): the secret and the backing services'
REQUIRED = {"RLFABRIC_TOKEN": "compose-test-secret-0123456789", "RLFABRIC_S3_ACCESS_KEY": "compose-test-user",
            "RLFABRIC_S3_SECRET_KEY": "compose-test-password", "RLFABRIC_REDIS_PASSWORD": "compose-test-redis"}


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def _clean_env(**extra: str) -> dict[str, str]:
    """The test's own environment without RLFABRIC_* settings a developer may have exported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # SafeLoader resolves the `<<:` merges the file uses


# -- (a) the file validates ------------------------------------------------------------------------------------

def test_compose_file_validates_with_docker_compose(tmp_path):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither docker-compose nor `docker compose` is installed (CI installs docker-compose)")
    for missing in REQUIRED:  # no secret or no credentials, no deployment (and the error names what to set)
        env = _clean_env(**{k: v for k, v in REQUIRED.items() if k != missing})
        refused = subprocess.run([*cli, "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env,
                                 timeout=60)
        assert refused.returncode != 0 and missing in refused.stderr, (missing, refused.stderr)
    env = _clean_env(**REQUIRED)
    result = subprocess.run([*cli, "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    normalised = yaml.safe_load(result.stdout)
    assert set(normalised["services"]) == set(RLFABRIC) | set(BACKING) | set(ONE_SHOT)
    services = normalised["services"]
    assert services["coordinator"]["environment"]["RLFABRIC_PORT"] == "50051"
    for role in RLFABRIC:  # the secret reaches every rlfabric service, from the env file
        assert services[role]["environment"]["RLFABRIC_TOKEN"] == "compose-test-secret-0123456789"
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == "compose-test-password"
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1] == "compose-test-redis"
    assert services["replay"]["environment"]["RLFABRIC_REDIS_PASSWORD"] == "compose-test-redis"
    # credentials reach only the workers that open the stores
    for role in ("coordinator", "env"):
        assert not {"RLFABRIC_S3_SECRET_KEY", "RLFABRIC_REDIS_PASSWORD"} & set(services[role]["environment"])

    # The same command must reject a schema error, or the check above proves nothing.
    broken = tmp_path / "broken.yml"
    broken.write_text("services:\n  x:\n    image: busybox\n    healthcheck:\n      tset: [CMD, 'true']\n")
    result = subprocess.run([*cli, "-f", str(broken), "config"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode != 0 and "tset" in result.stderr


# -- (b) structure ---------------------------------------------------------------------------------------------

def test_every_service_has_a_healthcheck(compose):
    services = compose["services"]
    assert set(services) == set(RLFABRIC) | set(BACKING) | set(ONE_SHOT)
    for name, svc in services.items():
        if name in ONE_SHOT:
            continue
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name}: no healthcheck"
    assert "redis-cli ping" in " ".join(services["redis"]["healthcheck"]["test"])
    assert "/minio/health/live" in " ".join(services["minio"]["healthcheck"]["test"])


def test_redis_and_minio_keep_data_in_named_volumes(compose):
    named = set(compose["volumes"])
    for name, target in (("redis", "/data"), ("minio", "/data")):
        mounts = [v.split(":") for v in compose["services"][name]["volumes"]]
        assert any(src in named and dst == target for src, dst, *_ in mounts), f"{name}: no named volume"
    redis_cmd = compose["services"]["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    minio_env = compose["services"]["minio"]["environment"]
    # no default credentials: `:?` makes compose refuse to start without them
    assert minio_env["MINIO_ROOT_USER"].startswith("${RLFABRIC_S3_ACCESS_KEY:?")
    assert minio_env["MINIO_ROOT_PASSWORD"].startswith("${RLFABRIC_S3_SECRET_KEY:?")
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${RLFABRIC_REDIS_PASSWORD:?")


def test_rlfabric_services_share_one_image_and_are_configured_by_environment(compose):
    services = compose["services"]
    images = {services[r]["image"] for r in RLFABRIC}
    builds = {(services[r]["build"]["context"], services[r]["build"]["dockerfile"]) for r in RLFABRIC}
    assert len(images) == 1 and len(builds) == 1
    context, dockerfile = builds.pop()
    assert (COMPOSE.parent / context / dockerfile).resolve() == DOCKERFILE
    ports = set()
    for role in RLFABRIC:
        svc = services[role]
        env = svc["environment"]
        assert svc["command"][:2] == ["serve", role]
        assert env["RLFABRIC_HOST"] == "0.0.0.0" and env["RLFABRIC_ADVERTISE_HOST"] == role
        # off loopback a service wants TLS (it refuses plaintext): mTLS with the certs one-shot's files
        assert "RLFABRIC_INSECURE_PLAINTEXT" not in env and env["RLFABRIC_METRICS_TLS"] == "true"
        tls = {env[f"RLFABRIC_TLS_{k}"] for k in ("CERT", "KEY", "CA")}
        assert all(path.startswith("/srv/rlfabric/certs/") for path in tls) and len(tls) == 3
        assert "certs:/srv/rlfabric/certs:ro" in svc["volumes"]
        assert not any(v.startswith("ca-key:") for v in svc["volumes"])  # no service holds the CA's key
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        port = env["RLFABRIC_PORT"]
        ports.add(port)
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "rlfabric.services.core.healthcheck", f"{role}:{port}"]
        # (secrets are read from the environment, never flags: they would show in `ps`)
        unknown = {k for k in env if k.startswith("RLFABRIC_") and not k.startswith("RLFABRIC_S3_")
                   and k not in ("RLFABRIC_TOKEN", "RLFABRIC_REDIS_PASSWORD")}
        unknown -= service_flags(role)
        assert not unknown, f"{role}: {sorted(unknown)} are not flags of `rlfabric serve {role}`"
        if role == "coordinator":
            assert "RLFABRIC_COORDINATOR" not in env
            assert any(p.endswith(":50051") for p in svc["ports"])
        else:
            assert env["RLFABRIC_COORDINATOR"] == "coordinator:50051"
            assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert len(ports) == len(RLFABRIC)
    for role, backing in (("replay", "redis"), ("replay", "minio"), ("learner", "minio")):
        assert services[role]["depends_on"][backing]["condition"] == "service_healthy"


def test_env_example_documents_exactly_the_variables_compose_reads():
    used = set(re.findall(r"\$\{(\w+)(?::?[-?][^}]*)?\}", COMPOSE.read_text()))
    documented = {line.split("=", 1)[0] for line in ENV_EXAMPLE.read_text().splitlines()
                  if line and not line.startswith("#")}
    assert used == documented


def test_dockerfile_is_slim_cpu_non_root_with_the_cli_as_entrypoint():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert "torch==2.13.0" in text and "https://download.pytorch.org/whl/cpu" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["rlfabric"\]', text, re.M)


def test_compose_run_spec_uses_redis_and_minio_by_service_name():
    config = load_config(RUN_SPEC)
    assert config.replay.store == "redis" and config.replay.redis_url == "redis://redis:6379/0"
    assert config.storage.kind == "s3" and config.storage.endpoint == "minio:9000"
    assert not config.storage.access_key and not config.storage.secret_key  # from the workers' environment
    assert not config.secrets()  # the Redis password too


# -- (c) configuration by environment, for real --------------------------------------------------------------

def _health(address: str, timeout: float = 3.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfabric.services.core.healthcheck", address, "--timeout", str(timeout)],
                          capture_output=True, text=True, env=_clean_env(), timeout=30)


def _wait_healthy(address: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    deadline = time.monotonic() + timeout_s
    while True:
        result = _health(address, 2.0)
        if result.returncode == 0:
            return result
        assert proc.poll() is None, f"service exited with {proc.returncode}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"not healthy within {timeout_s:.0f}s: {result.stderr}"
        time.sleep(0.3)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_service_configured_only_by_environment_and_healthcheck_follows_it(tmp_path):
    port, metrics_port = free_port(), free_port()
    log_file = tmp_path / "env.log"
    env = _clean_env(RLFABRIC_HOST="127.0.0.1", RLFABRIC_PORT=str(port), RLFABRIC_METRICS_PORT=str(metrics_port),
                     RLFABRIC_LOG_FILE=str(log_file))
    proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.env.server"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{port}"
    try:
        result = _wait_healthy(address, proc)
        assert result.stdout.strip() == f"{address}: SERVING"
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "rlfabric_rpcs_total" in body
        assert f'"grpc": "{address}"' in log_file.read_text()
    finally:
        _stop(proc)
    assert proc.returncode == 0
    result = _health(address)
    assert result.returncode == 1
    reason = result.stderr.strip()
    assert "\n" not in reason and reason.startswith(f"{address}: UNAVAILABLE")


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("RLFABRIC_PORT", "fifty", "integer port"),
    ("RLFABRIC_METRICS_PORT", "70000", "integer port"),
    ("RLFABRIC_COORDINATOR", "coordinator", "HOST:PORT"),
])
def test_malformed_environment_value_exits_2_naming_the_variable(name, value, expected):
    result = subprocess.run([sys.executable, "-m", "rlfabric.services.env.server"], env=_clean_env(**{name: value}),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert name in result.stderr and expected in result.stderr and repr(value) in result.stderr


def test_coordinator_ignores_rlfabric_coordinator_and_reads_its_own_flags_from_environment(tmp_path):
    """One RLFABRIC_COORDINATOR exported on every host must not make the coordinator register with itself."""
    port = free_port()
    log_file = tmp_path / "coordinator.log"
    env = _clean_env(RLFABRIC_HOST="127.0.0.1", RLFABRIC_PORT=str(port), RLFABRIC_COORDINATOR=f"127.0.0.1:{port}",
                     RLFABRIC_LOG_FILE=str(log_file), RLFABRIC_HEARTBEAT_TIMEOUT="5")
    proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.coordinator.server"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(f"127.0.0.1:{port}", proc)
        time.sleep(1.0)  # registration would follow SERVING at once
        from rlfabric.services.coordinator.client import CoordinatorClient

        with CoordinatorClient(f"127.0.0.1:{port}") as client:
            assert [w for w in client.workers() if w.role == common_pb2.COORDINATOR] == []
    finally:
        _stop(proc)
    assert proc.returncode == 0
    assert '"registered"' not in log_file.read_text()


def test_command_line_wins_over_environment_which_wins_over_defaults():
    parser = argparse.ArgumentParser()
    ServiceOptions.add_arguments(parser)
    apply_env_defaults(parser, {"RLFABRIC_PORT": "6000", "RLFABRIC_HOST": "0.0.0.0", "RLFABRIC_TORCH_THREADS": ""})
    args = parser.parse_args(["--port", "7000"])
    assert (args.port, args.host, args.torch_threads, args.metrics_port) == (7000, "0.0.0.0", 1, 0)
    assert "[env RLFABRIC_METRICS_PORT]" in " ".join(parser.format_help().split())  # help names the variables


def test_healthcheck_reports_not_serving_with_exit_1():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        result = _health(f"127.0.0.1:{port}")
        assert result.returncode == 1 and result.stderr.strip() == f"127.0.0.1:{port}: NOT_SERVING"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _health(f"127.0.0.1:{port}").returncode == 0
    finally:
        server.stop(0)


def test_certs_one_shot_makes_the_ca_once_and_keeps_it_on_every_later_up(compose, tmp_path):
    """The compose `certs` service runs on every `up`: the first makes the CA, later ones keep it (a new CA would
    lock out every client that copied the old one); without --if-missing the same command refuses to replace it."""
    command = compose["services"]["certs"]["command"]
    assert command[0] == "certs" and "--if-missing" in command
    out, key_dir = tmp_path / "certs", tmp_path / "ca-key"
    volumes = {"/srv/rlfabric/certs": str(out), "/srv/rlfabric/ca-key": str(key_dir)}
    assert set(volumes) == {v.split(":")[1] for v in compose["services"]["certs"]["volumes"]}
    argv = [sys.executable, "-m", "rlfabric.services.cli", *[volumes.get(a, a) for a in command]]
    first = subprocess.run(argv, capture_output=True, text=True, env=_clean_env(), timeout=60)
    assert first.returncode == 0, first.stderr
    ca = (out / "ca.pem").read_bytes()
    assert (out / "server.key").stat().st_mode & 0o077 == 0
    assert not (out / "ca.key").exists() and (key_dir / "ca.key").stat().st_mode & 0o077 == 0  # kept apart
    from cryptography import x509

    names = x509.load_pem_x509_certificate((out / "server.pem").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert set(RLFABRIC) | {"localhost"} <= set(names)  # peers dial service names, host clients localhost
    again = subprocess.run(argv, capture_output=True, text=True, env=_clean_env(), timeout=60)
    assert again.returncode == 0 and (out / "ca.pem").read_bytes() == ca
    refused = subprocess.run([a for a in argv if a != "--if-missing"], capture_output=True, text=True,
                             env=_clean_env(), timeout=60)
    assert refused.returncode == 2 and "--force" in refused.stderr and (out / "ca.pem").read_bytes() == ca
