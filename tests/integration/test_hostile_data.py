"""Every data port of a live stack — env, replay, and the learner's weight publisher — takes the killer messages,
a malformed-message corpus and hostile requests; each service stays SERVING with its loops alive, and a run
afterwards succeeds."""

from __future__ import annotations

import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import (
    coordinator_pb2,
)
from rlfabric.services.core.runtime import ROLE_NAMES
from tests.conftest import grpc_channel, metrics_text, short_config
from tests.hostile import CORPUS, data_ports


def _attack(endpoint: str) -> int:
    """Send the whole corpus as a peer that holds the secret (a buggy or compromised one); returns how many were
    answered (with an error, every one)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client_socket(sock)
    sock.connect(endpoint)
    answered = 0
    try:
        for name, frames in CORPUS.items():
            sock.send_multipart(frames, copy=False)
            assert sock.poll(10_000), f"{endpoint}: no answer to {name!r}"
            assert b'"kind":"error"' in sock.recv_multipart()[0], name
            answered += 1
    finally:
        sock.close()
    return answered


def test_hostile_messages_leave_every_service_serving_and_a_run_succeeds(stack, tmp_path):
    workers = {ROLE_NAMES[w.role]: w for w in stack.client.workers() if w.alive}
    for endpoint in data_ports(workers, tmp_path).values():
        assert _attack(endpoint) == len(CORPUS)
    for role in ("env", "replay", "learner", "rollout"):
        w = workers[role]
        with grpc_channel(w.endpoint.grpc) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, role
        metrics = metrics_text(w.endpoint.metrics)
        assert " 0.0" not in [line[line.index("}") + 1:] for line in metrics.splitlines()
                              if line.startswith("rlfabric_component_up{")], role
    run = stack.client.submit(short_config(), run_dir=stack.root / "runs" / "after-hostile")
    final = stack.client.wait(run.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
