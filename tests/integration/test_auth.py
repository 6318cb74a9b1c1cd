"""Authenticated ports: every gRPC service refuses calls without the deployment's token, data ports give a peer
without the CURVE key nothing, metrics want the token, `serve` refuses a public address without a secret, run
directories stay under the coordinator's runs root, and TLS/mTLS go through gRPC's own credentials."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.services.core import auth
from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import encode
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, env_pb2_grpc
from rlfabric.services.core.runtime import GRPC_OPTIONS, ROLE_NAMES
from tests.conftest import grpc_channel, metrics_text, short_config


def _check(address: str, security: auth.Security | None) -> grpc.StatusCode:
    channel = auth.sync_channel(address, GRPC_OPTIONS, security) if security else grpc.insecure_channel(address)
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_every_grpc_service_refuses_calls_without_the_token_or_with_a_wrong_one(stack):
    addresses = {ROLE_NAMES[w.role]: w.endpoint.grpc for w in stack.client.workers() if w.alive}
    addresses["coordinator"] = stack.address
    assert set(addresses) == {"coordinator", "env", "replay", "learner", "rollout"}
    wrong = auth.Security("a-token-from-another-deployment")
    for role, address in addresses.items():
        assert _check(address, None) == grpc.StatusCode.UNAUTHENTICATED, role
        assert _check(address, wrong) == grpc.StatusCode.UNAUTHENTICATED, role
        assert _check(address, auth.current()) == grpc.StatusCode.OK, role
    with grpc.insecure_channel(addresses["env"]) as ch:  # a service method, not only health
        with pytest.raises(grpc.RpcError) as info:
            env_pb2_grpc.EnvStub(ch).GetStats(common_pb2.Empty(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "RLFABRIC_TOKEN" in info.value.details()


def _dealer(endpoint: str, security: auth.Security | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        auth.secure_client_socket(sock, security)
    sock.connect(endpoint)
    return sock


def test_a_data_plane_peer_without_the_key_gets_nothing(stack):
    env = next(w for w in stack.client.workers() if ROLE_NAMES[w.role] == "env")
    with grpc_channel(env.endpoint.grpc) as ch:
        stub = env_pb2_grpc.EnvStub(ch)
        reply = stub.Configure(common_pb2.ConfigureRequest(run_id="t-auth", config_json=short_config().to_json()),
                               timeout=30)
        rejected = stub.GetStats(common_pb2.Empty()).rejected_messages
        reset = encode("reset", TensorBatch(meta={"pool": "eval", "seed": 0}), seq=1)
        for who in (None, auth.Security("a-token-from-another-deployment")):  # no CURVE at all; CURVE, wrong keys
            sock = _dealer(reply.data_endpoint, who)
            try:  # (a blocking send would hang for good once the failed handshake has dropped the only pipe)
                sock.send_multipart(reset, flags=zmq.NOBLOCK)
            except zmq.Again:  # refused before the send: nothing sent either
                pass
            assert not sock.poll(1500), "a stranger must get no answer at all"
            sock.close()
        assert stub.GetStats(common_pb2.Empty()).rejected_messages == rejected  # never reached the service
        sock = _dealer(reply.data_endpoint, auth.current())
        sock.send_multipart(reset)
        assert sock.poll(5000) and b'"kind":"obs"' in sock.recv_multipart()[0]
        sock.close()


def test_metrics_want_the_token(stack):
    w = next(w for w in stack.client.workers() if ROLE_NAMES[w.role] == "replay")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(w.endpoint.metrics, timeout=5)
    assert info.value.code == 401
    assert "rlfabric_rpcs_total" in metrics_text(w.endpoint.metrics)


def test_run_dir_outside_the_runs_root_is_refused(stack, tmp_path):
    outside = tmp_path.parent.parent.parent / "elsewhere"  # (tmp_path is under the stack's runs root)
    link = tmp_path / "link"
    link.symlink_to("/etc")
    for run_dir in ("/etc/rlfabric", str(outside), "../../../../x", str(link / "run")):
        with pytest.raises(grpc.RpcError) as info:
            stack.client.submit(short_config(), run_dir=run_dir)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside this coordinator's runs root" in info.value.details()


def test_serve_on_all_interfaces_without_a_secret_exits_2_with_the_fix():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")}
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "serve", "env", "--host", "0.0.0.0",
                           "--coordinator", "127.0.0.1:9"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0 without a secret" in proc.stderr and "RLFABRIC_TOKEN" in proc.stderr


def _certificates(tmp_path) -> dict[str, str]:
    """A CA, and a server and a client certificate it signs (the server's for 127.0.0.1 and localhost)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def make(name: str, issuer=None, issuer_key=None, san=None, ca=False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return cert, key

    ca, ca_key = make("rlfabric-test-ca", ca=True)
    files = {"ca": ca}
    for name, san in (("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                      ("client", [x509.DNSName("client")])):
        cert, key = make(name, ca.subject, ca_key, san)
        files[name] = cert
        (tmp_path / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    out = {}
    for name, cert in files.items():
        (tmp_path / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[name] = str(tmp_path / f"{name}.pem")
    return out | {"server.key": str(tmp_path / "server.key"), "client.key": str(tmp_path / "client.key")}


def test_tls_and_mutual_tls_through_grpc_credentials(tmp_path):
    certs = _certificates(tmp_path)
    token = auth.generate_token()
    port_file = tmp_path / "env.address"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")} | {"RLFABRIC_TOKEN": token}
    proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.env.server", "--port-file", str(port_file),
                             "--tls-cert", certs["server"], "--tls-key", certs["server.key"], "--tls-ca", certs["ca"]],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        address = port_file.read_text().strip()
        client = auth.Security(token, auth.TLSFiles(certs["client"], certs["client.key"], certs["ca"]))
        assert _check(address, client) == grpc.StatusCode.OK  # TLS, a client certificate the CA signed, the token
        assert _check(address, auth.Security(token)) != grpc.StatusCode.OK  # in the clear: no handshake
        no_cert = grpc.ssl_channel_credentials(root_certificates=open(certs["ca"], "rb").read())
        with grpc.secure_channel(address, no_cert) as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5,
                                                     metadata=auth.Security(token).metadata())
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
        assert code != grpc.StatusCode.OK  # mTLS: a client without a certificate is turned away
        wrong_token = auth.Security("not-the-deployment-secret", client.tls)
        assert _check(address, wrong_token) == grpc.StatusCode.UNAUTHENTICATED  # TLS does not replace the token
    finally:
        proc.terminate()
        proc.wait(15)


def test_in_the_clear_on_loopback_when_no_secret_is_set():
    """Without a token (a developer's loopback) data ports speak plaintext and every call is accepted."""
    from rlfabric.services.core.dataplane import DataClient, DataServer

    assert not auth.current().enabled
    server = DataServer(max_bytes=1 << 16, name="plain")
    server.start(lambda kind, batch, reply: reply.send("echo", batch))
    client = DataClient(server.endpoint, max_bytes=1 << 16, timeout_s=5)
    assert client.request("x", TensorBatch({"a": np.ones(2)}))[1]["a"].tolist() == [1.0, 1.0]
    client.close()
    server.stop()
