import threading

import numpy as np
import pytest
import zmq

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import FrameError
from rlfabric.services.core.dataplane import DataClient, DataServer, PeerTimeout, RemoteError
from rlfabric.services.core.weights import WeightPublisher, WeightSubscriber


@pytest.fixture
def echo():
    def handler(kind, batch, reply):
        if kind == "boom":
            raise RuntimeError("kaput")
        if kind == "bad":
            raise ValueError("that field is wrong")
        if kind == "later":
            threading.Timer(0.05, lambda: None).start()
        reply.send("echo", TensorBatch({k: np.asarray(v) * 2 for k, v in batch.items()}, meta=batch.meta,
                                       version=batch.version))

    server = DataServer(max_bytes=64 * 1024, name="echo")
    server.start(handler)
    yield server
    server.stop()


def test_request_reply_and_pipelining(echo):
    c = DataClient(echo.endpoint, max_bytes=64 * 1024, timeout_s=5)
    kind, out = c.request("x", TensorBatch({"a": np.arange(3)}, meta={"m": 1}, version=4))
    assert kind == "echo" and out["a"].tolist() == [0, 2, 4] and out.version == 4 and out.meta == {"m": 1}
    seqs = [c.send("x", TensorBatch({"a": np.array([i])})) for i in range(5)]
    assert [int(c.recv(s)[1]["a"][0]) for s in seqs] == [0, 2, 4, 6, 8]
    c.close()


def test_handler_errors_reach_the_client_and_channel_survives(echo):
    c = DataClient(echo.endpoint, max_bytes=64 * 1024, timeout_s=5)
    with pytest.raises(RemoteError, match="'bad' refused: that field is wrong"):
        c.request("bad")
    with pytest.raises(RemoteError, match="failed inside the service: RuntimeError: kaput"):
        c.request("boom")
    assert c.request("x", TensorBatch({"a": np.ones(1)}))[0] == "echo"


def test_corrupt_and_oversized_frames_rejected_channel_keeps_working(echo):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(echo.endpoint)
    raw.send_multipart([b"garbage-header", b"x"])
    assert raw.poll(5000)
    reply = raw.recv_multipart()
    assert b"not valid JSON" in reply[0]
    raw.send_multipart([b'{"w":1,"kind":"x","seq":1,"version":0,"meta":{},"tensors":[]}', b"\0" * 100_000])
    assert raw.poll(5000)
    assert b"max_message_bytes" in raw.recv_multipart()[0]
    raw.close()
    assert echo.rejected == 2
    c = DataClient(echo.endpoint, max_bytes=64 * 1024, timeout_s=5)
    assert c.request("x", TensorBatch({"a": np.ones(2)}))[1]["a"].tolist() == [2, 2]
    with pytest.raises(FrameError, match="exceeds data_plane.max_message_bytes"):
        c.send("x", TensorBatch({"a": np.zeros(100_000, np.uint8)}))  # refused before it is sent


def test_timeout_names_the_peer_and_setting():
    server = DataServer(max_bytes=1024, name="silent")  # never serves
    c = DataClient(server.endpoint, max_bytes=1024, timeout_s=0.2, peer="env")
    with pytest.raises(PeerTimeout, match=r"no answer from the env .* within 0.2s \(data_plane.timeout_s\)"):
        c.request("x")


def test_weight_publisher_long_poll():
    pub = WeightPublisher("127.0.0.1", 1 << 20)
    sub = WeightSubscriber(pub.endpoint, 1 << 20, timeout_s=5)
    pub.publish(0, {"w": np.zeros(3, np.float32)})
    version, tensors = sub.fetch(have=-1)
    assert version == 0 and tensors["w"].tolist() == [0, 0, 0]
    assert sub.fetch(have=0) == (0, None)  # nothing newer: no tensors sent
    threading.Timer(0.1, pub.publish, args=(1, {"w": np.ones(3, np.float32)})).start()
    version, tensors = sub.fetch(have=0, min_version=1, wait_s=5)  # parked until version 1 appears
    assert version == 1 and tensors["w"].tolist() == [1, 1, 1]
    assert sub.fetch(have=1, min_version=2, wait_s=0.1) == (1, None)  # deadline passes
    with pytest.raises(ValueError, match="must increase"):
        pub.publish(1, {"w": np.ones(3)})
    pub.close()


def test_no_hostile_message_kills_the_receiving_loop(echo):
    """The killer messages (deep nesting, shape products that overflow, absurd sequence numbers) and a corpus of
    malformed ones: each is refused with a reason, the handler never sees it, and the channel keeps serving."""
    from tests.hostile import MALFORMED

    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(echo.endpoint)
    answered = 0
    for name, frames in MALFORMED.items():
        raw.send_multipart(frames, copy=False)
        if raw.poll(5000):
            reply = raw.recv_multipart()
            assert b'"kind":"error"' in reply[0], name
            answered += 1
        assert echo.alive and echo.health() is None, name
    raw.close()
    assert answered == len(MALFORMED)
    c = DataClient(echo.endpoint, max_bytes=64 * 1024, timeout_s=5)
    assert c.request("x", TensorBatch({"a": np.ones(2)}))[1]["a"].tolist() == [2, 2]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_loop_fails_the_services_health_check():
    """Should a receiving loop die anyway (here: a bug, simulated), the service reports NOT_SERVING and why."""
    import asyncio

    from grpc_health.v1 import health_pb2

    from rlfabric.services.core.runtime import ServiceOptions, ServiceRuntime

    async def scenario():
        runtime = ServiceRuntime(ServiceOptions(role="env"))
        server = DataServer(max_bytes=1024, name="doomed")
        runtime.watch("doomed-data-plane", server.health)

        def crash(frames, handler):
            raise SystemExit("a bug in the loop itself")

        server._handle = crash  # noqa: SLF001 — the bug
        server.start(lambda kind, batch, reply: None)
        c = DataClient(server.endpoint, max_bytes=1024, timeout_s=0.3)
        with pytest.raises(PeerTimeout):
            c.request("x")
        c.close()
        server._thread.join(2)
        runtime.check_components()
        await asyncio.sleep(0.05)
        status = runtime.health._server_status[""]  # noqa: SLF001 — what Check answers
        return status, runtime.failed, server.crashed

    status, failed, crashed = asyncio.run(scenario())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert "a bug in the loop itself" in failed["doomed-data-plane"] and "SystemExit" in crashed
