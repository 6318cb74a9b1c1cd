"""Fuzzing every port of a live stack: every gRPC method of every service (coordinator, env, replay, learner,
rollout, robot gateway) gets messages that hypothesis builds from the protos themselves (extreme numbers, NaN and
infinity, long and odd strings, out-of-range enums, random nesting), in random order, before and after the
services are configured; every ZeroMQ data port gets garbage frames and well-formed frames with hostile headers.

What counts: a crash is a call that ends UNKNOWN (an exception the handler did not turn into a status); a hang is a
service that then fails its health check; an unhealthy service is one whose health check, which its component
watchdogs feed (a dead data-plane loop turns it NOT_SERVING), says so. All three must stay 0, and a run afterwards
succeeds. The counts per service are printed at the end of the test session (tests/conftest.py)."""

from __future__ import annotations

import json
import math
from collections import Counter

import grpc
import pytest
import zmq
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import (
    common_pb2,
    coordinator_pb2,
    env_pb2,
    learner_pb2,
    replay_pb2,
    robot_gateway_pb2,
    robot_gateway_pb2_grpc,
    rollout_pb2,
)
from rlfabric.services.core.runtime import ROLE_NAMES
from tests.conftest import grpc_channel, short_config
from tests.hostile import data_ports
from tests.robot_support import gateway_process

pytestmark = pytest.mark.serial  # every service must answer within its deadline while fuzzed: never beside another test

FUZZ_COUNTS: Counter = Counter()  # "service: grpc" / "service: data" -> inputs tried (printed by conftest)
CALL_TIMEOUT_S = 1.0
EXAMPLES = 80  # per service and plane
LOOPBACK = ["127.0.0.1:1", "127.0.0.1:9", "localhost:0", "", "tcp://127.0.0.1:1", "not an address", "127.0.0.1:99999"]
SERVICES = {
    "coordinator": coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
    "env": env_pb2.DESCRIPTOR.services_by_name["Env"],
    "replay": replay_pb2.DESCRIPTOR.services_by_name["Replay"],
    "learner": learner_pb2.DESCRIPTOR.services_by_name["Learner"],
    "rollout": rollout_pb2.DESCRIPTOR.services_by_name["Rollout"],
    "robot_gateway": robot_gateway_pb2.DESCRIPTOR.services_by_name["RobotGateway"],
}
F = FieldDescriptor
INT_BOUNDS = {F.TYPE_INT32: 31, F.TYPE_SINT32: 31, F.TYPE_SFIXED32: 31, F.TYPE_INT64: 63, F.TYPE_SINT64: 63,
              F.TYPE_SFIXED64: 63}
UINT_BOUNDS = {F.TYPE_UINT32: 32, F.TYPE_FIXED32: 32, F.TYPE_UINT64: 64, F.TYPE_FIXED64: 64}


def _strings(name: str, known: list[str]) -> st.SearchStrategy[str]:
    """Strings: addresses stay on loopback (no fuzz input may send a service anywhere else), real drivers stay
    out (no arm library is asked to reach a robot), and the rest mixes known names with odd and long text."""
    if any(k in name for k in ("grpc", "data", "metrics", "endpoint", "gateway", "address", "host")):
        return st.sampled_from(LOOPBACK)
    if name == "robot_id":  # mostly the connected arm, so calls get past the lookup
        return st.sampled_from(["arm", "arm", "arm", "", "no-such-arm", "a" * 300])
    if name == "driver":
        return st.sampled_from(["sim", "", "no-such-driver", "../sim"])
    odd = st.sampled_from(["", " ", "..", "../../etc/passwd", "{", "[]", "null", "\x00", "a" * 5000, "é∂ƒ",
                           "name: x\nenv: {id: CartPole-v1}", "*a", "&a [*a, *a]", "-1", "nan", "1e999"])
    return st.one_of(st.text(max_size=40), odd, st.sampled_from(known or ["x"]))


def _scalar(field, known: list[str]) -> st.SearchStrategy:
    t = field.type
    if t in INT_BOUNDS:
        b = INT_BOUNDS[t]
        return st.one_of(st.integers(-(2 ** b), 2 ** b - 1), st.sampled_from([0, 1, -1, 2 ** b - 1, -(2 ** b)]))
    if t in UINT_BOUNDS:
        b = UINT_BOUNDS[t]
        return st.one_of(st.integers(0, 2 ** b - 1), st.sampled_from([0, 1, 2 ** b - 1]))
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        extreme = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 1e-300])
        return st.one_of(st.floats(width=64 if t == F.TYPE_DOUBLE else 32), extreme)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return _strings(field.name, known)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=512)
    if t == F.TYPE_ENUM:
        return st.integers(-3, 12)  # open enums: values the contract does not name
    raise TypeError(f"no strategy for field type {t}")


@st.composite
def message(draw, descriptor, known: list[str], depth: int = 0):
    """A message of ``descriptor``'s type with a random subset of its fields set (nested ones to depth 3)."""
    msg = message_factory.GetMessageClass(descriptor)()
    fields = [f for f in descriptor.fields if depth < 3 or f.type != F.TYPE_MESSAGE]
    for field in draw(st.lists(st.sampled_from(fields), max_size=len(fields), unique=True)) if fields else []:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_scalar(key_f, known), _value(value_f, known, depth), max_size=3))
            target = getattr(msg, field.name)
            for k, v in entries.items():
                if value_f.type == F.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            values = draw(st.lists(_value(field, known, depth), max_size=4))
            if field.type == F.TYPE_MESSAGE:
                for v in values:
                    getattr(msg, field.name).add().CopyFrom(v)
            else:
                getattr(msg, field.name).extend(values)
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(_value(field, known, depth)))
        else:
            setattr(msg, field.name, draw(_value(field, known, depth)))
    return msg


def _value(field, known, depth):
    if field.type == F.TYPE_MESSAGE:
        return message(field.message_type, known, depth + 1)
    return _scalar(field, known)


def _call(channel, service, method, request) -> grpc.StatusCode:
    path = f"/{service.full_name}/{method.name}"
    ser, de = (lambda m: m.SerializeToString()), (lambda b: b)
    try:
        if method.client_streaming:
            call = channel.stream_stream(path, request_serializer=ser, response_deserializer=de)
            replies = call(iter([request, request]), timeout=CALL_TIMEOUT_S)
        elif method.server_streaming:
            replies = channel.unary_stream(path, request_serializer=ser, response_deserializer=de)(
                request, timeout=CALL_TIMEOUT_S)
        else:
            channel.unary_unary(path, request_serializer=ser, response_deserializer=de)(request,
                                                                                        timeout=CALL_TIMEOUT_S)
            return grpc.StatusCode.OK
        for i, _ in enumerate(replies):  # a few replies, then hang up: a stream may legitimately go on
            if i >= 3:
                replies.cancel()
                break
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def _healthy(address: str) -> bool:
    with grpc_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def fuzz_grpc(name: str, address: str, known: list[str]) -> None:
    service = SERVICES[name]
    methods = list(service.methods)
    crashes: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data) -> None:
        method = data.draw(st.sampled_from(methods))
        request = data.draw(message(method.input_type, known))
        with grpc_channel(address) as ch:
            code = _call(ch, service, method, request)
        FUZZ_COUNTS[f"{name}: grpc"] += 1
        FUZZ_COUNTS[f"{name}: grpc {code.name}"] += 1
        if code == grpc.StatusCode.UNKNOWN:
            crashes.append(f"{method.name}({str(request)[:300]!r})")
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            assert _healthy(address), f"{name} stopped answering after {method.name}({str(request)[:300]!r})"

    run()
    assert not crashes, f"{name}: {len(crashes)} call(s) crashed its handler (UNKNOWN): {crashes[:5]}"
    assert _healthy(address), f"{name} is not SERVING after the fuzz"


def fuzz_data(name: str, endpoint: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client_socket(sock)
    sock.connect(endpoint)
    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(), st.text(max_size=20))
    json_doc = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                           max_size=4), max_leaves=20)
    header = st.fixed_dictionaries(
        {"w": st.sampled_from([2, 1, 3, "2"]), "kind": st.sampled_from(["get", "put", "sample", "reset", "step",
                                                                         "echo", "weights", "frame", "x"]),
         "seq": st.integers(-5, 2 ** 64), "version": st.integers(-5, 2 ** 40), "meta": json_doc,
         "dims": st.lists(st.sampled_from(["time", "env", "sample", "x"]), max_size=3),
         "tensors": st.lists(st.fixed_dictionaries({"name": st.text(max_size=8), "dtype": st.sampled_from(
             ["uint8", "float32", "int64", "object", "bool", "float16"]), "shape": st.lists(
             st.integers(-2, 2 ** 40), max_size=4)}), max_size=3)})
    frames = st.one_of(
        st.lists(st.binary(max_size=256), min_size=1, max_size=5),  # garbage
        st.tuples(header, st.lists(st.binary(max_size=64), max_size=4)).map(  # well-formed but hostile
            lambda hb: [json.dumps(hb[0]).encode(), *hb[1]]))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(msg=frames)
    def run(msg) -> None:
        sock.send_multipart(msg, copy=False)
        FUZZ_COUNTS[f"{name}: data"] += 1
        if sock.poll(5_000):
            sock.recv_multipart()
        else:  # a frame too broken to carry a sequence number may go unanswered; the loop must still serve
            FUZZ_COUNTS[f"{name}: data unanswered"] += 1

    try:
        run()
    finally:
        sock.close()


def test_every_port_takes_fuzzed_input_and_a_run_succeeds_afterwards(private_stack, tmp_path):
    stack, client = private_stack, private_stack.client
    first = client.wait(client.submit(short_config(), run_dir=tmp_path / "before").run_id)  # services configured
    assert first.state == coordinator_pb2.SUCCEEDED, first.reason
    workers = {ROLE_NAMES[w.role]: w for w in client.workers() if w.alive}
    known = [first.run_id, *(w.worker_id for w in workers.values())]
    with gateway_process(tmp_path / "gateway", stack.token) as gateway:
        with grpc_channel(gateway) as ch:  # a connected sim arm, so fuzzed calls reach past the robot lookup
            robot_gateway_pb2_grpc.RobotGatewayStub(ch).Connect(robot_gateway_pb2.ConnectRequest(
                robot_id="arm", driver="sim", control_hz=100, watchdog_s=0.05), timeout=30)
        known.append("arm")
        addresses = {"coordinator": stack.address, **{r: w.endpoint.grpc for r, w in workers.items()},
                     "robot_gateway": gateway}
        # the data ports, configured for a run whose data-plane waits are short (a fuzzed Train waits that long)
        for name, endpoint in data_ports(workers, tmp_path, short_config(data_plane={"timeout_s": 0.5})).items():
            fuzz_data(name, endpoint)
        for name, address in addresses.items():
            fuzz_grpc(name, address, known)
        for name, address in addresses.items():
            assert _healthy(address), name
    for run in client.stub.ListRuns(common_pb2.Empty()).runs:  # fuzzed SubmitRuns that started something
        if run.state in (coordinator_pb2.PENDING, coordinator_pb2.RUNNING):
            client.stop(run.run_id)
    after = client.wait(client.submit(short_config(), run_dir=tmp_path / "after").run_id)
    assert after.state == coordinator_pb2.SUCCEEDED, after.reason
