"""A real S3 server on loopback for tests: ``from tests.support_s3 import s3_server as s3_server  # noqa: F401``
(the ``as`` form keeps ruff from reporting F811 at every test that takes the fixture).

With $RLFABRIC_TEST_S3_ENDPOINT set (host:port, e.g. a MinIO that CI started) the fixture uses it, with
credentials from $RLFABRIC_TEST_S3_ACCESS_KEY / $RLFABRIC_TEST_S3_SECRET_KEY (default minioadmin/minioadmin).
Otherwise it starts ``moto_server`` with authentication enforced: the first few requests are let through
unauthenticated (moto's INITIAL_NO_AUTH_ACTION_COUNT) to create an IAM user, an access key and an s3:* policy;
after that every S3 request must be signed with that key, as on MinIO. Tests therefore also check our signing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlfabric.services.core.config import StorageConfig

ENDPOINT_ENV = "RLFABRIC_TEST_S3_ENDPOINT"
# CreateUser x2, CreateAccessKey x2, PutUserPolicy: the IAM calls made before auth is enforced.
_SETUP_REQUESTS = 5


@dataclass
class S3Server:
    endpoint: str  # host:port
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    enforces_auth: bool = True
    # Valid credentials with no permissions at all (None on an external server).
    unprivileged_key: tuple[str, str] | None = None

    def storage(self, bucket: str | None = None, **fields) -> StorageConfig:
        """A StorageConfig for this server; a fresh bucket name by default so tests never share state."""
        values = dict(kind="s3", endpoint=self.endpoint, bucket=bucket or unique_bucket(),
                      access_key=self.access_key, secret_key=self.secret_key, region=self.region)
        return StorageConfig(**{**values, **fields})


def unique_bucket(tag: str = "t") -> str:
    return f"rlf-{tag}-{uuid.uuid4().hex[:12]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _moto_command() -> list[str] | None:
    """The moto_server beside this interpreter first: one found on $PATH first may be another Python's older moto
    (5.2.1 signs a query holding '/' wrongly, refusing every listing with SignatureDoesNotMatch)."""
    for exe in (str(Path(sys.executable).parent / "moto_server"), shutil.which("moto_server")):
        if exe and os.access(exe, os.X_OK):
            return [exe]
    return None


def _wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 20.0) -> bool:
    """Poll moto's own API (not S3, which would spend one of the unauthenticated requests)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/data.json", timeout=1):
                return True
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"moto_server on port {port} did not answer in {timeout_s}s; log: {log}")


def _setup_iam(endpoint: str) -> tuple[tuple[str, str], tuple[str, str]]:
    import boto3  # comes with moto

    iam = boto3.client("iam", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    keys = []
    for user in ("rlfabric", "nobody"):
        iam.create_user(UserName=user)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys.append((key["AccessKeyId"], key["SecretAccessKey"]))
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="rlfabric", PolicyName="s3-all", PolicyDocument=json.dumps(policy))
    return keys[0], keys[1]


def start_moto(log_dir: Path) -> tuple[subprocess.Popen, S3Server]:
    """Start an auth-enforcing moto_server on a free loopback port (retrying if the port was taken)."""
    cmd = _moto_command()
    if cmd is None:
        pytest.skip(f"no S3 server: moto_server is not installed (pip install 'moto[server]') and ${ENDPOINT_ENV} "
                    f"is not set")
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_SETUP_REQUESTS))
    for attempt in range(3):
        port = _free_port()
        log = log_dir / f"moto-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
        if _wait_ready(proc, port, log):
            endpoint = f"127.0.0.1:{port}"
            try:
                good, nobody = _setup_iam(endpoint)
            except BaseException:
                _stop(proc)
                raise
            return proc, S3Server(endpoint, *good, unprivileged_key=nobody)
        if attempt == 2:
            raise RuntimeError(f"moto_server exited at start-up: {log.read_text()[-2000:]}")
    raise AssertionError("unreachable")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _probe_auth(server: S3Server) -> bool:
    """Does the external server refuse unknown credentials? (A moto without auth accepts anything.)"""
    from minio import Minio
    from minio.error import S3Error

    client = Minio(server.endpoint, access_key="rlfabric-bogus-key", secret_key="bogus-secret", secure=False,
                   region=server.region)
    try:
        client.bucket_exists(unique_bucket("probe"))
    except S3Error:
        return True
    return False


@pytest.fixture(scope="module")
def s3_server():
    """An S3 endpoint on loopback with working credentials, for the test module."""
    external = os.environ.get(ENDPOINT_ENV)
    if external:
        server = S3Server(external, os.environ.get("RLFABRIC_TEST_S3_ACCESS_KEY", "minioadmin"),
                          os.environ.get("RLFABRIC_TEST_S3_SECRET_KEY", "minioadmin"))
        server.enforces_auth = _probe_auth(server)
        if os.environ.get("RLFABRIC_TEST_S3_UNPRIVILEGED_KEY"):
            server.unprivileged_key = (os.environ["RLFABRIC_TEST_S3_UNPRIVILEGED_KEY"],
                                       os.environ["RLFABRIC_TEST_S3_UNPRIVILEGED_SECRET"])
        yield server
        return
    log_dir = Path(tempfile.mkdtemp(prefix="rlfabric-moto-"))
    proc, server = start_moto(log_dir)
    try:
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(log_dir, ignore_errors=True)


def main() -> None:
    """``python -m tests.support_s3 ENV_FILE``: start an auth-enforcing S3 server for a whole CI run, write the
    variables the fixture reads to ENV_FILE (shell syntax), and serve until killed."""
    env_file = Path(sys.argv[1])
    log_dir = Path(tempfile.mkdtemp(prefix="rlfabric-moto-ci-"))
    proc, server = start_moto(log_dir)
    lines = {ENDPOINT_ENV: server.endpoint, "RLFABRIC_TEST_S3_ACCESS_KEY": server.access_key,
             "RLFABRIC_TEST_S3_SECRET_KEY": server.secret_key}
    if server.unprivileged_key:
        lines["RLFABRIC_TEST_S3_UNPRIVILEGED_KEY"], lines["RLFABRIC_TEST_S3_UNPRIVILEGED_SECRET"] = server.unprivileged_key
    env_file.write_text("".join(f"export {k}={v}\n" for k, v in lines.items()))
    print(f"S3 (moto, auth enforced) at {server.endpoint}", flush=True)
    try:
        proc.wait()
    finally:
        _stop(proc)


if __name__ == "__main__":
    main()
