"""The sentences of README.md's security paragraph and docs/deployment.md#security that had no test of their own.
Each test's docstring quotes the sentence it guards. All run in this process: a service's start is its real
``main`` through ``run_service`` (its parser, RLFABRIC_* variables, security set-up and build step), with the
servicer it would serve replaced and nothing bound, so what the operator's flags do is read straight off the
process; a CLI command's local stack is a LocalStack that starts nothing."""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import importlib
import json
import logging
import operator
import os
import shutil
import signal
import socket
import stat
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import zmq

from rlfabric.services.core import auth, registry
from rlfabric.services.core.registry import IMPORT_PATHS_FLAG
from rlfabric.services.launcher import LocalStack
from tests.conftest import Aborted, AbortingContext

TOKEN = "deployment-claims-secret-0123456789"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _dropped(sock: socket.socket) -> bool:
    """The peer closed ``sock`` (waits up to the socket's timeout): end of stream, or a reset."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def clean_env(monkeypatch):
    """No RLFABRIC_* variable of the shell or CI reaches what a test parses; the monkeypatch, for more."""
    for name in [n for n in os.environ if n.startswith("RLFABRIC_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def process_settings(monkeypatch):
    """What a service's start sets for its whole process (import paths, data roots, endpoints, reward limits) is
    put back afterwards."""
    from rlfabric.services.core import paths
    from rlfabric.services.env import reward_pool
    from rlfabric.services.env.tasks import dataset

    monkeypatch.setattr(registry, "_import_paths", registry._import_paths)
    saved = dataset._roots, paths._process_endpoints, reward_pool.operator_limits()
    yield
    dataset.set_data_roots(saved[0])
    paths.set_process_endpoints(saved[1])
    reward_pool.set_operator_limits(saved[2])


class _Unserved:
    """Stands in for ServiceRuntime: run_service parses, configures and builds; nothing binds or serves."""

    def __init__(self, options):
        self.options, self.server, self.advertise_host = options, None, "127.0.0.1"

    async def start(self) -> None:
        pass

    async def serve_until_stopped(self) -> None:
        pass


# role -> (module, its servicer class, its generated grpc module, the function that adds the servicer)
SERVICES = {
    "env": ("rlfabric.services.env.server", "EnvService", "env_pb2_grpc", "add_EnvServicer_to_server"),
    "rollout": ("rlfabric.services.rollout.server", "RolloutService", "rollout_pb2_grpc", "add_RolloutServicer_to_server"),
    "replay": ("rlfabric.services.replay.server", "ReplayService", "replay_pb2_grpc", "add_ReplayServicer_to_server"),
    "robot_gateway": ("rlfabric.services.robot_gateway.server", "RobotGatewayService", "robot_gateway_pb2_grpc",
                      "add_RobotGatewayServicer_to_server"),
}


def _start(monkeypatch, role: str, argv: list[str], via_cli: bool = False) -> SimpleNamespace:
    """Start service ``role`` as ``rlfabric serve`` does (``via_cli``: through rlfabric.services.cli's own ``serve``), up to
    the moment it would serve: its parser with the RLFABRIC_* variables, its security, its own build step (the
    operator's flags applied to the process). Returns the parsed flags (``args``) and what the build gave the
    servicer (``built``)."""
    import uvloop

    from rlfabric.services.core import runtime

    module_name, servicer, grpc_module, add = SERVICES[role]
    module = importlib.import_module(module_name)
    seen = SimpleNamespace(args=None, built=[])
    monkeypatch.setattr(runtime, "setup_logging", lambda *a, **k: None)  # (pytest keeps its log handlers)
    monkeypatch.setattr(runtime, "set_process_title", lambda *a, **k: None)
    monkeypatch.setattr(runtime, "ServiceRuntime", _Unserved)
    monkeypatch.setattr(uvloop, "run", asyncio.run)
    monkeypatch.setattr(module, servicer, lambda *a: seen.built.append(a) or SimpleNamespace())
    monkeypatch.setattr(getattr(module, grpc_module), add, lambda *a: None)
    if "MUJOCO_GL" not in os.environ:  # (the gateway's main picks a GL backend for the process)
        monkeypatch.setenv("MUJOCO_GL", "osmesa")

    def run_service(name, build, argv=None, extra_args=None):
        async def capture(rt, args):
            seen.args = args
            await build(rt, args)

        runtime.run_service(name, capture, argv, extra_args)

    monkeypatch.setattr(module, "run_service", run_service)
    if via_cli:
        from rlfabric.services import cli

        with pytest.raises(SystemExit) as done:
            cli.main(["serve", role, *argv])
        assert done.value.code == 0
    else:
        module.main(argv)
    return seen


class _NotStarted(Exception):
    pass


class _Stack(LocalStack):
    """A LocalStack that starts nothing: the tests read what a CLI command built it with."""

    made: list = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.kwargs = kwargs
        _Stack.made.append(self)

    def spawn_coordinator(self) -> None:  # (train, resume)
        raise _NotStarted

    def start(self) -> str:  # (up)
        return "127.0.0.1:1"

    def supervise(self, *args, **kwargs) -> None:
        pass

    def dead(self) -> dict[str, int]:
        return {"coordinator": 0}  # ends `up`'s serving loop at once

    def stop(self, *args, **kwargs) -> None:
        pass


@pytest.fixture
def fake_stack(clean_env):
    import rlfabric.services.launcher as launcher

    _Stack.made = []
    clean_env.setattr(launcher, "LocalStack", _Stack)
    clean_env.setattr(launcher, "prestart", lambda *a, **k: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # (`up` sets its own)
    yield _Stack.made
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _cli(*argv: str) -> int:
    from rlfabric.services import cli

    args = cli.build_parser().parse_args(list(argv))
    return {"up": cli.cmd_up, "train": cli.cmd_train, "resume": cli.cmd_resume, "certs": cli.cmd_certs,
            "scrape-token": cli.cmd_scrape_token}[argv[0]](args)


# -- credentials -----------------------------------------------------------------------------------------------
LABELS = {"gRPC bearer": "rlfabric/grpc-bearer", "metrics scrape token": "rlfabric/metrics-scrape",
          "CURVE server key": "rlfabric/curve/server", "CURVE client key": "rlfabric/curve/client",
          "robot operator credential": "rlfabric/robot-operator"}


def _hkdf_sha256(secret: str, label: str) -> bytes:
    """RFC 5869 HKDF-SHA256, 32 bytes, by the cryptography package (not by services/core/auth.py)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"rlfabric/hkdf/v1",
                info=label.encode()).derive(secret.encode())


def test_each_ports_credential_is_hkdf_sha256_of_the_secret_under_its_own_label():
    """README: "each port's credential is derived from it (HKDF-SHA256, one label each)"; deployment.md: "each
    credential a port checks is derived from it with HKDF-SHA256 under a label of its own". Known answers from an
    independent HKDF, and no two alike."""
    from zmq.utils import z85

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    for secret in (TOKEN, auth.generate_token()):
        security = auth.Security(secret)
        derived = {"gRPC bearer": security.bearer, "metrics scrape token": security.scrape_token,
                   "CURVE server key": z85.decode(security.curve_keys("server")[1]),
                   "CURVE client key": z85.decode(security.curve_keys("client")[1]),
                   "robot operator credential": auth.operator_credential(secret)}
        expected = {what: _hkdf_sha256(secret, label) for what, label in LABELS.items()}
        for what, value in derived.items():
            assert value == (expected[what] if isinstance(value, bytes) else b64(expected[what])), what
        assert len(set(expected.values())) == len(LABELS)  # each port's its own
        for role in ("server", "client"):  # the public half is the secret key's
            public, secret_key = security.curve_keys(role)
            assert public == zmq.curve_public(secret_key)
        assert security.metadata() == (("authorization", f"Bearer {security.bearer}"),)


def test_the_bearer_scrape_token_zap_key_and_operator_credential_are_compared_in_constant_time(monkeypatch):
    """deployment.md: "the bearer derived from the token, compared in constant time before the method is even
    looked up: a call without it gets `UNAUTHENTICATED` and nothing else runs"."""
    import hmac

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    security = auth.Security(TOKEN)
    bearer = f"Bearer {security.bearer}"
    assert security.accepts(bearer) and not security.accepts("Bearer guess") and not security.accepts(None)
    assert security.accepts_scrape(f"Bearer {security.scrape_token}") and not security.accepts_scrape(bearer)
    assert len(calls) == 5 and all(expected in (bearer.encode(), f"Bearer {security.scrape_token}".encode())
                                   for _, expected in calls)
    # the first interceptor of every server: a wrong bearer is refused after the comparison, before any lookup
    calls.clear()
    looked_up = []

    async def continuation(details):
        looked_up.append(details.method)
        return "the method's handler"

    interceptor = auth.TokenInterceptor(security)
    for metadata, expected in (((("authorization", "Bearer guess"),), auth._REFUSE), ((), auth._REFUSE),
                               (security.metadata(), "the method's handler")):
        details = SimpleNamespace(method="/rlfabric.v1.Env/GetStats", invocation_metadata=metadata)
        assert asyncio.run(interceptor.intercept_service(continuation, details)) is expected
    assert looked_up == ["/rlfabric.v1.Env/GetStats"] and len(calls) == 3
    # the data plane's ZAP handler and a robot gateway's operator credential
    calls.clear()
    client_key = security.curve_keys("client")[0]
    admit = auth._AdmitDerivedClient(client_key)
    assert admit.callback("*", client_key) and not admit.callback("*", auth.Security("x" * 20).curve_keys("client")[0])
    operator_secret = "operator-secret-0123456789"
    assert auth.operator_accepts(operator_secret, auth.operator_credential(operator_secret))
    assert not auth.operator_accepts(operator_secret, auth.operator_credential(TOKEN))
    assert len(calls) == 4


def test_a_data_port_is_a_curve_server_and_a_peer_without_the_derived_key_never_reaches_a_handler(monkeypatch):
    """deployment.md: "ZeroMQ data plane (env, replay, learner weights, robot cameras) | CURVE: server and client
    key pairs derived from the token; the ZAP handler admits only the derived client key, so a peer without it
    never reaches a handler". The replay and weight ports here (the env port:
    tests/integration/test_auth.py::test_a_data_plane_peer_without_the_key_gets_nothing)."""
    from rlfabric.services.core.batch import TensorBatch
    from rlfabric.services.core.codec import encode
    from rlfabric.services.core.config import RunConfig
    from rlfabric.services.core.dataplane import DataServer
    from rlfabric.services.core.weights import WeightPublisher
    from rlfabric.services.replay.server import ReplayService

    reached = []
    real_handle = DataServer._handle

    def handle(self, frames, handler):
        reached.append(self.name)
        return real_handle(self, frames, handler)

    monkeypatch.setattr(DataServer, "_handle", handle)
    security = auth.configure(TOKEN)
    runtime = SimpleNamespace(advertise_host="127.0.0.1", data_endpoint="", watch=lambda *a: None,
                              on_shutdown=lambda hook: None)
    replay = ReplayService(runtime, "127.0.0.1")
    weights = WeightPublisher("127.0.0.1", RunConfig().data_plane.max_message_bytes)
    servers = {"replay": replay.data, "weights": weights.server}
    sockets = []

    def dealer(endpoint: str, who: auth.Security | str | None) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 10_000)  # (never a hang: a peer whose handshake failed has no pipe to send on)
        if who == "own client keys":  # the server's public key (no secret), and a key pair of its own
            sock.curve_serverkey = security.curve_keys("server")[0]
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        elif who is not None:
            auth.secure_client_socket(sock, who)
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    request = encode("stats", TensorBatch(meta={}), seq=1)
    try:
        strangers = []
        for name, server in servers.items():
            assert server._sock.getsockopt(zmq.CURVE_SERVER) == 1, name
            assert server._sock.getsockopt(zmq.MECHANISM) == zmq.CURVE, name
            # no CURVE; another deployment's keys; this server's public key with a client key pair of its own
            for who in (None, auth.Security("a-token-of-another-deployment"), "own client keys"):
                strangers.append(dealer(server.endpoint, who))
                try:
                    strangers[-1].send_multipart(request, flags=zmq.NOBLOCK)
                except zmq.Again:  # refused already (the handshake failed before the send): nothing sent either
                    pass
        for name, server in servers.items():  # the deployment's own peer is answered
            keyed = dealer(server.endpoint, security)
            keyed.send_multipart(request)
            assert keyed.poll(10_000), f"the {name} port did not answer a peer holding the derived key"
            keyed.recv_multipart()
        assert not any(sock.poll(1000 if n == 0 else 0) for n, sock in enumerate(strangers))
        assert sorted(reached) == ["replay", "weights"]  # one request each: the keyed peer's
    finally:
        for sock in sockets:
            sock.close()
        replay.data.stop()
        weights.close()


# -- weight sync ------------------------------------------------------------------------------------------------
def test_weight_sync_defaults_to_the_data_plane_and_a_pairs_prefix_is_128_random_bits(monkeypatch):
    """README and deployment.md: "`zmq` (the default) rides the CURVE data plane"; a weight pair's keys live
    "under its pair's 128-bit random prefix"."""
    from rlfabric.services.core import weight_transport
    from rlfabric.services.core.config import RunConfig, parse_config
    from rlfabric.services.core.weights import _options

    assert RunConfig().weight_sync.transport == "zmq"
    assert parse_config("name: t\n", "spec").weight_sync.transport == "zmq"
    assert _options(RunConfig().weight_sync).transport == "zmq"
    made = []
    monkeypatch.setattr(weight_transport, "_Pair", lambda host, pair, prefix, *a: made.append(prefix)
                        or SimpleNamespace(alive=True, used=0.0))
    host = weight_transport.PairHost("gloo", "127.0.0.1")  # the publisher's side, as a subscriber joins
    prefixes = [host.join("127.0.0.1", 1.0)[1] for _ in range(64)]
    assert prefixes == made and len(set(prefixes)) == 64
    for prefix in prefixes:
        assert weight_transport.check_prefix(prefix) == prefix and len(prefix) == 32  # 32 hex digits
    values = [int(p, 16) for p in prefixes]
    # every one of the 128 bits takes both values across 64 pairs (a counter, a clock or a fixed part would not;
    # a random one fails this once in 2**56)
    assert functools.reduce(operator.or_, values) == (1 << 128) - 1
    assert functools.reduce(operator.and_, values) == 0


# -- the token, the local stack's secret --------------------------------------------------------------------
def test_a_service_reads_its_token_from_token_file_or_the_variables(tmp_path, clean_env, process_settings):
    """deployment.md: "A service reads it from `--token-file` (or `RLFABRIC_TOKEN_FILE`) or from
    `RLFABRIC_TOKEN`"; README: "services elsewhere read `RLFABRIC_TOKEN` or `--token-file`"."""
    flag_file = auth.write_token_file(tmp_path / "flag", TOKEN + "-flag")
    env_file = auth.write_token_file(tmp_path / "env", TOKEN + "-file")
    clean_env.setenv("RLFABRIC_TOKEN", TOKEN + "-variable")
    _start(clean_env, "env", [])
    assert auth.current().token == TOKEN + "-variable"
    clean_env.setenv("RLFABRIC_TOKEN_FILE", str(env_file))
    _start(clean_env, "env", [])
    assert auth.current().token == TOKEN + "-file"
    _start(clean_env, "env", ["--token-file", str(flag_file)])
    assert auth.current().token == TOKEN + "-flag"


def test_clients_take_token_or_token_file_or_read_the_same_variables(tmp_path, clean_env, capsys):
    """deployment.md: "Clients (the CLI, `rlfabric.Client`, notebooks) read the same variables, or take `token=` /
    `token_file=`"."""
    import rlfabric

    presented = []
    clean_env.setattr(auth, "sync_channel", lambda address, options, security=None: presented.append(security)
                      or grpc.insecure_channel(address))
    path = auth.write_token_file(tmp_path / "token", TOKEN + "-file")

    def client_token(**kwargs) -> str:
        auth.configure("")  # a fresh notebook
        rlfabric.Client("127.0.0.1:1", **kwargs).close()
        return presented[-1].token

    assert client_token(token=TOKEN + "-arg") == TOKEN + "-arg"
    assert client_token(token_file=str(path)) == TOKEN + "-file"
    clean_env.setenv("RLFABRIC_TOKEN", TOKEN + "-variable")
    assert client_token() == TOKEN + "-variable"
    clean_env.setenv("RLFABRIC_TOKEN_FILE", str(path))
    assert client_token() == TOKEN + "-file"
    # the CLI: what `rlfabric scrape-token` derives is the scrape token of the secret it read
    for argv, secret in ((["scrape-token"], TOKEN + "-file"),
                         (["scrape-token", "--token-file", str(auth.write_token_file(tmp_path / "t2", TOKEN))],
                          TOKEN)):
        capsys.readouterr()
        assert _cli(*argv) == 0
        assert capsys.readouterr().out.strip() == auth.Security(secret).scrape_token


def test_up_writes_a_fresh_secret_per_stack_and_its_scrape_token_owner_only(tmp_path, fake_stack):
    """deployment.md: "`rlfabric train` and `rlfabric up` generate a new secret for each local stack; `up` writes
    it to `<runs-root>/.rlfabric/token` and the scrape token to `<runs-root>/.rlfabric/scrape-token` (both
    owner-only)"; README: "`rlfabric train` and `up` make a secret per local stack"."""
    tokens = []
    for name in ("a", "b"):
        runs = tmp_path / name
        _cli("up", "--runs-root", str(runs))
        stack = fake_stack[-1]
        assert "token" not in stack.kwargs  # the stack makes its own
        secret, scrape = runs / ".rlfabric" / "token", runs / ".rlfabric" / "scrape-token"
        assert secret.read_text().strip() == stack.token and len(stack.token) >= 43  # 32 random bytes
        assert scrape.read_text().strip() == auth.Security(stack.token).scrape_token != stack.token
        assert _mode(secret) == _mode(scrape) == 0o600 and _mode(secret.parent) == 0o700
        tokens.append(stack.token)
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: claims\n")
    for _ in range(2):
        with pytest.raises(_NotStarted):
            _cli("train", str(spec), "--runs-root", str(tmp_path / "runs"), "--quiet")
        assert "token" not in fake_stack[-1].kwargs
        tokens.append(fake_stack[-1].token)
    assert len(set(tokens)) == 4


# -- import paths ------------------------------------------------------------------------------------------------
def test_allow_import_paths_and_its_variable_enable_import_paths_on_a_service(clean_env, process_settings):
    """README: "a deployment's services refuse a run spec that names code by import path (`package.module:attr`)
    unless their operator started them with `--allow-import-paths`"; deployment.md: "starts each service with
    `--allow-import-paths` (`RLFABRIC_ALLOW_IMPORT_PATHS=1`; ...)"."""
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.spec_yaml import ConfigError

    spec = json.dumps({"env": {"adapter": "text", "id": "arith", "num_envs": 2, "eval_envs": 2,
                               "options": {"reward": "rlfabric.services.env.tasks.rewards:exact_match"}}})
    for argv, variable, allowed in (([], "", False), (["--allow-import-paths"], "", True), ([], "1", True),
                                    ([], "0", False)):
        if variable:
            clean_env.setenv("RLFABRIC_ALLOW_IMPORT_PATHS", variable)
        _start(clean_env, "env", ["--coordinator", "127.0.0.1:9", *argv], via_cli=True)  # `rlfabric serve env`
        assert registry.import_paths_allowed() is allowed, (argv, variable)
        if allowed:
            assert parse_config(spec, "spec").env.options["reward"] == "rlfabric.services.env.tasks.rewards:exact_match"
        else:
            with pytest.raises(ConfigError, match=rf"env.options.reward .*{IMPORT_PATHS_FLAG}"):
                parse_config(spec, "spec")


def test_train_and_resume_start_their_stack_with_import_paths_and_up_only_when_asked(tmp_path, fake_stack):
    """deployment.md: "`rlfabric up --allow-import-paths` for a local stack). `rlfabric train` and `rlfabric
    resume` start their own stack with it, because there the user is the operator"."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: claims\n")
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: claims\n")
    with pytest.raises(_NotStarted):
        _cli("train", str(spec), "--runs-root", str(tmp_path / "runs"), "--quiet")
    with pytest.raises(_NotStarted):
        _cli("resume", str(run_dir), "--quiet")
    _cli("up", "--runs-root", str(tmp_path / "up"))
    _cli("up", "--runs-root", str(tmp_path / "up2"), "--allow-import-paths")
    train, resume, up, up_allowed = fake_stack
    for stack, allowed in ((train, True), (resume, True), (up, False), (up_allowed, True)):
        assert stack.allow_import_paths is allowed
        assert (IMPORT_PATHS_FLAG in stack._security_flags()) is allowed  # what each service is started with


def test_trust_remote_code_is_refused_with_invalid_argument_by_services_without_the_flag(tmp_path, monkeypatch):
    """deployment.md: "`policy.vlm.trust_remote_code: true` (a checkpoint's own modeling code) is refused the same
    way" (INVALID_ARGUMENT naming the field and the flag, by the coordinator at submit and by a worker at
    Configure)."""
    from rlfabric.services.coordinator.server import CoordinatorService
    from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2
    from rlfabric.services.env.server import EnvService

    monkeypatch.setattr(registry, "_import_paths", False)  # a service whose operator did not allow it
    spec = json.dumps({"name": "remote-code", "policy": {"vlm": {"trust_remote_code": True}}})
    runtime = SimpleNamespace(address="127.0.0.1:1", advertise_host="127.0.0.1", data_endpoint="", state="idle",
                              owner_run="", owner_key="", worker_id="", on_shutdown=lambda hook: None,
                              watch=lambda name, probe: None, options=SimpleNamespace(role="env", coordinator=""))

    async def main() -> list[Aborted]:
        refused = []
        coordinator = CoordinatorService(runtime, str(tmp_path), 3.0, take_up_runs=False)
        env = EnvService(runtime, "127.0.0.1")
        try:
            for call in (lambda: coordinator.SubmitRun(coordinator_pb2.SubmitRunRequest(config_yaml=spec),
                                                       AbortingContext()),
                         lambda: env.Configure(common_pb2.ConfigureRequest(run_id="r", config_json=spec),
                                               AbortingContext())):
                with pytest.raises(Aborted) as info:
                    await call()
                refused.append(info.value)
        finally:
            env.close()
            await coordinator.shutdown()
        return refused

    for refusal in asyncio.run(main()):
        assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "policy.vlm.trust_remote_code" in refusal.details and IMPORT_PATHS_FLAG in refusal.details
    assert not (tmp_path / "remote-code").exists()


PLUGIN = '''
CALLED = []
class NoProblem:  # a class, but no problem(rng)
    def __init__(self, **options):
        CALLED.append(("NoProblem", options))
def task_function(**options):
    CALLED.append(("task_function", options))
def two_args(prompt, completion):  # a reward that cannot take (prompt, completion, answer)
    CALLED.append(("two_args", prompt))
    return 1.0
class RewardClass:
    def __init__(self, prompt, completion, answer):
        CALLED.append(("RewardClass", prompt))
def policy_function(*args, **kwargs):  # says it serves actor_critic, and is no policy class
    CALLED.append(("policy_function", args))
policy_function.serves = "actor_critic"
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "rlf_claims_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_import_paths", True)  # the operator's --allow-import-paths
    module = importlib.import_module("rlf_claims_plugin")
    yield module
    sys.modules.pop("rlf_claims_plugin", None)


def test_a_resolved_import_path_that_is_not_its_kind_is_refused_before_it_is_called(plugin):
    """deployment.md: "Even then a resolved name is checked as its kind before it is called: a text task is a class
    with `problem(rng)`, a reward a Python function that takes `(prompt, completion, answer)`" (built-ins that are
    not of their kind: tests/unit/test_registry.py::test_a_resolved_name_is_checked_as_its_kind_before_anything_
    calls_it)."""
    import torch  # noqa: F401 — as in a learner or rollout worker, where a policy's class is looked at

    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.spec_yaml import ConfigError
    from rlfabric.services.env.tasks import TASKS
    from rlfabric.services.env.tasks.rewards import REWARDS

    for name in ("rlf_claims_plugin:NoProblem", "rlf_claims_plugin:task_function"):
        with pytest.raises(ValueError, match=r"env.id .*is not a text task: a text task is a class with a problem"):
            TASKS.load(name)
    for name in ("rlf_claims_plugin:two_args", "rlf_claims_plugin:RewardClass"):
        with pytest.raises(ValueError, match=r"env.options.reward .*is not a reward"):
            REWARDS.load(name)
    for name in ("os:system", "subprocess:Popen"):  # a policy.name that names no policy: refused at validation
        with pytest.raises(ConfigError, match=rf"policy.name '{name}': '{name}' is not a policy: a policy is a "):
            parse_config(json.dumps({"policy": {"name": name}}), "spec")
    assert plugin.CALLED == []


def test_a_literal_policy_that_is_no_policy_class_is_refused_before_it_is_called(plugin):
    """deployment.md: "the other kinds are checked against their Protocols" — for policy.name."""
    import torch  # noqa: F401

    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.core.spec_yaml import ConfigError

    with pytest.raises((ConfigError, ValueError)):
        parse_config(json.dumps({"policy": {"name": "rlf_claims_plugin:policy_function"}}), "spec")
        build_policy("rlf_claims_plugin:policy_function", {"observation_space": {"kind": "box"}, "action_space": {}},
                     None)
    assert plugin.CALLED == []


# -- workers and their registrations -----------------------------------------------------------------------------
def test_a_deregistration_carries_its_registrations_key_and_no_other_caller_deregisters_a_worker(tmp_path,
                                                                                                 monkeypatch):
    """deployment.md: "Each registration gets a key of its own from the coordinator, which its heartbeats and its
    deregistration carry ... and so is [refused with PERMISSION_DENIED] a heartbeat or a deregistration for a
    worker that is not the caller"."""
    from rlfabric.services.coordinator.server import CoordinatorService
    from rlfabric.services.core import runtime as runtime_mod
    from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2

    async def coordinator_side() -> None:
        service = CoordinatorService(SimpleNamespace(address="127.0.0.1:1", on_shutdown=lambda hook: None),
                                     str(tmp_path), 3.0, take_up_runs=False)
        try:
            reply = await service.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(
                role=common_pb2.ENV, endpoint=common_pb2.Endpoint(grpc="127.0.0.1:7"), pid=1, host="h"),
                AbortingContext())
            assert len(reply.worker_key) >= 32
            for key in ("", "a guess", reply.worker_key[:-1]):
                with pytest.raises(Aborted) as info:
                    await service.DeregisterWorker(coordinator_pb2.DeregisterWorkerRequest(
                        worker_id=reply.worker_id, reason="not mine", force=True, worker_key=key), AbortingContext())
                assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert reply.worker_id in service.registry.workers
            await service.DeregisterWorker(coordinator_pb2.DeregisterWorkerRequest(
                worker_id=reply.worker_id, reason="shutdown", force=True, worker_key=reply.worker_key),
                AbortingContext())
            assert reply.worker_id not in service.registry.workers
        finally:
            await service.shutdown()

    asyncio.run(coordinator_side())

    # the worker's side: as it stops, its deregistration carries the key its registration got
    sent = []

    class Stub:
        def __init__(self, channel):
            pass

        async def DeregisterWorker(self, request, timeout=None):
            sent.append(request)

    class Channel:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    monkeypatch.setattr(runtime_mod, "channel", lambda address: Channel())
    monkeypatch.setattr(runtime_mod.coordinator_pb2_grpc, "CoordinatorStub", Stub)
    monkeypatch.setattr(runtime_mod, "set_process_title", lambda *a, **k: None)

    async def worker_side() -> None:
        rt = runtime_mod.ServiceRuntime(runtime_mod.ServiceOptions(role="env", coordinator="127.0.0.1:9"))
        rt.worker_id, rt.worker_key = "env-7", "the-key-of-this-registration"
        rt.stopping.set()
        await rt.serve_until_stopped(grace_s=0)

    asyncio.run(worker_side())
    assert [(r.worker_id, r.worker_key) for r in sent] == [("env-7", "the-key-of-this-registration")]


def test_the_coordinators_calls_for_a_run_carry_its_key_as_rlfabric_run_key_metadata(monkeypatch):
    """deployment.md: "and each run a key that the coordinator's calls for it carry (metadata `rlfabric-run-key`)".
    The name is the literal one on both sides: what the coordinator's calls carry, and what a worker the run holds
    reads (a key under any other name is not the run's)."""
    from rlfabric.services.coordinator import stages
    from rlfabric.services.core import ownership

    sent = []

    class Stub:
        async def Configure(self, request, timeout=None, metadata=()):
            sent.append(tuple(metadata))
            return "configured"

    stage = stages.Stage(worker=SimpleNamespace(describe=lambda: "env-1"), channel=None, stub=Stub(),
                         run_key="the-runs-key")
    assert asyncio.run(stages.rpc(stage, "Configure", object())) == "configured"
    assert sent == [(("rlfabric-run-key", "the-runs-key"),)]

    asked = []

    async def ask(runtime):  # the coordinator's answer: the run still holds the worker, with the same key
        asked.append(runtime.worker_id)

    monkeypatch.setattr(ownership, "_ask", ask)
    runtime = SimpleNamespace(options=SimpleNamespace(role="env", coordinator="127.0.0.1:9"), worker_id="env-1",
                              owner_run="r1", owner_key="the-runs-key")
    asyncio.run(ownership.check_owner(runtime, "r1", AbortingContext((("rlfabric-run-key", "the-runs-key"),))))
    assert asked == []  # taken at once
    for metadata in ((("rlfabric-run-key", "another-key"),), (("run-key", "the-runs-key"),),
                     (("rlfabric-run-id", "the-runs-key"),), ()):
        with pytest.raises(Aborted) as refused:
            asyncio.run(ownership.check_owner(runtime, "r1", AbortingContext(metadata)))
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED, metadata


# -- metrics ------------------------------------------------------------------------------------------------------
def test_the_metrics_server_drops_a_silent_connection_and_past_64_the_oldest(clean_env):
    """deployment.md: "a connection has 5 s to send its request, and past 64 open connections
    the oldest is dropped"."""
    security = auth.Security(TOKEN)
    server, _ = auth.start_metrics_server(0, "127.0.0.1", security)  # what every service starts
    try:
        assert (server.timeout_s, server.max_connections) == (5.0, 64)
    finally:
        server.shutdown()

    def connect(port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half a request head, then nothing
        return sock

    capped = auth.MetricsServer("127.0.0.1", 0, security, timeout_s=60.0)  # the default cap; no timeout in play
    socks = []
    try:
        socks.append(connect(capped.port))
        _until(lambda: capped.connections == 1, "the first connection was not counted")
        socks += [connect(capped.port) for _ in range(63)]
        _until(lambda: capped.connections == 64, f"{capped.connections} of 64 connections counted")
        socks.append(connect(capped.port))  # the 65th
        assert _dropped(socks[0])  # the oldest was dropped ...
        _until(lambda: capped.connections == 64, "the cap did not hold")
        for sock in socks[1:]:  # ... and no other
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
    finally:
        for sock in socks:
            sock.close()
        capped.shutdown()
    quick = auth.MetricsServer("127.0.0.1", 0, security, timeout_s=0.3)  # the timeout, shortened
    try:
        silent, half = socket.create_connection(("127.0.0.1", quick.port), timeout=10), connect(quick.port)
        assert _dropped(silent) and _dropped(half)  # cut at the timeout (well before these 10 s)
        silent.close()
        half.close()
        _until(lambda: quick.connections == 0, "connections cut at their timeout are still counted")
    finally:
        quick.shutdown()


# -- TLS ----------------------------------------------------------------------------------------------------------
def test_certs_names_every_host_keeps_keys_0600_never_replaces_a_ca_silently_and_ca_key_dir(tmp_path):
    """deployment.md: "`server.pem`, valid for every listed name plus localhost, 127.0.0.1 and ::1 ... Keys are
    written 0600. ... `--ca-key-dir` writes it elsewhere, so the directory you copy to the hosts never holds it.
    It refuses to replace an existing CA without `--force`"."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from rlfabric.services.core import certs

    out = tmp_path / "tls"
    assert _cli("certs", str(out), "--hosts", "node-a.lab,10.1.2.3,host-c") == 0
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(sans.get_values_for_type(x509.DNSName)) | {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    assert names == {"node-a.lab", "10.1.2.3", "host-c", "localhost", "127.0.0.1", "::1"}
    for key in ("ca.key", "server.key", "client.key"):
        assert _mode(out / key) == 0o600, key
    made = {name: (out / name).read_bytes() for name in certs.FILES}
    assert _cli("certs", str(out), "--hosts", "other") == 2
    assert {name: (out / name).read_bytes() for name in certs.FILES} == made  # nothing replaced
    assert _cli("certs", str(out), "--hosts", "other", "--force") == 0
    assert (out / "ca.pem").read_bytes() != made["ca.pem"] and (out / "ca.key").read_bytes() != made["ca.key"]

    shipped, offline = tmp_path / "ship", tmp_path / "offline"
    assert _cli("certs", str(shipped), "--hosts", "h", "--ca-key-dir", str(offline)) == 0
    assert sorted(p.name for p in shipped.iterdir()) == sorted(set(certs.FILES) - {"ca.key"})
    assert _mode(offline / "ca.key") == 0o600
    ca_key = serialization.load_pem_private_key((offline / "ca.key").read_bytes(), None)
    shipped_ca = x509.load_pem_x509_certificate((shipped / "ca.pem").read_bytes())
    assert ca_key.public_key().public_numbers() == shipped_ca.public_key().public_numbers()  # that CA's key
    assert _cli("certs", str(shipped), "--hosts", "h", "--ca-key-dir", str(offline)) == 2


def test_up_tls_auto_makes_its_ca_once_and_reuses_it_on_later_starts(tmp_path, fake_stack, capsys):
    """deployment.md: "`rlfabric up --tls auto` ... a CA under `<runs-root>/.rlfabric/tls` (made once, reused on
    later starts; delete it for a new one), mTLS gRPC and HTTPS metrics, and prints the variables its clients
    set"; README: "(`up --tls auto` a private CA too)"."""
    import re

    from rlfabric.services.core import certs

    runs = tmp_path / "runs"
    tls = runs / ".rlfabric" / "tls"
    capsys.readouterr()
    _cli("up", "--runs-root", str(runs), "--tls", "auto")
    said = capsys.readouterr()
    printed = re.sub(r"\x1b\[[0-9;]*m", "", said.out + said.err)  # (rich styles nothing off a terminal; if it did)
    for variable, file in (("RLFABRIC_TLS_CA", "ca.pem"), ("RLFABRIC_TLS_CERT", "client.pem"),
                           ("RLFABRIC_TLS_KEY", "client.key")):
        assert re.search(rf"(^|\s){variable}={re.escape(str((tls / file).resolve()))}(\s|$)", printed), \
            (variable, printed)
    client = certs.client_files(certs.existing(tls))  # the files a client needs, as `rlfabric certs` names them
    assert {Path(client.ca), Path(client.cert), Path(client.key)} == {tls / "ca.pem", tls / "client.pem",
                                                                     tls / "client.key"}
    made = {name: (tls / name).read_bytes() for name in certs.FILES}
    first = fake_stack[-1].kwargs["tls"]
    assert (Path(first.cert), Path(first.key), Path(first.ca)) == (tls / "server.pem", tls / "server.key",
                                                                   tls / "ca.pem")
    _cli("up", "--runs-root", str(runs), "--tls", "auto")
    assert {name: (tls / name).read_bytes() for name in certs.FILES} == made
    assert fake_stack[-1].kwargs["tls"] == first
    shutil.rmtree(tls)
    _cli("up", "--runs-root", str(runs), "--tls", "auto")
    assert (tls / "ca.pem").read_bytes() != made["ca.pem"]


# -- rewards ------------------------------------------------------------------------------------------------------
def test_the_operators_reward_limits_default_to_2048_mib_and_60_s(clean_env, process_settings):
    """deployment.md: "Memory (`--reward-memory-mb`, default 2048 MiB of address space per worker) and time
    (`--reward-timeout-s`, at most 60 s per call by default; a run that sets none gets 10 s) are the operator's"
    (a run's own 10 s: test_a_run_that_sets_no_reward_timeout_gets_10_s_per_call)."""
    from rlfabric.services.core.config import EnvConfig
    from rlfabric.services.env import reward_pool
    from rlfabric.services.env.adapters import text

    for role in ("env", "rollout"):  # (a rollout worker hosts a collocated plan's text envs)
        reward_pool.set_operator_limits(reward_pool.OperatorLimits(1, 1.0))
        args = _start(clean_env, role, []).args
        assert (args.reward_memory_mb, args.reward_timeout_s) == (2048, 60.0), role
        assert reward_pool.operator_limits() == reward_pool.OperatorLimits(2048, 60.0), role
    opts, _ = text._options(EnvConfig(adapter="text", id="arith", num_envs=2, eval_envs=2))
    assert opts["reward_memory_mb"] == 2048  # what a spec that says nothing gets: all of it
    assert opts["reward_timeout_s"] == 10.0  # ... and of the time, its own default, under the operator's 60 s


def test_a_run_that_sets_no_reward_timeout_gets_10_s_per_call(clean_env, process_settings):
    """deployment.md: "time (`--reward-timeout-s`, at most 60 s per call by default; a run that sets none gets
    10 s)": a text env whose spec has no env.options.reward_timeout_s hands the reward pool 10 s for each call,
    under the operator's default 60 s; an operator's lower limit caps it; a spec's own value is taken."""
    from rlfabric.services.core.config import EnvConfig
    from rlfabric.services.env import reward_pool
    from rlfabric.services.env.adapters import text

    given = []

    class Pool:  # the reward pool, as the env calls it (no worker process)
        def resolve(self, target, name):
            pass

        def score(self, calls, timeout_s, failure_reward, step_timeout_s):
            given.append(timeout_s)
            return [SimpleNamespace(value=1.0, failure=None) for _ in calls]

    clean_env.setattr(reward_pool, "acquire", lambda workers, memory_mb: Pool())
    clean_env.setattr(reward_pool, "release", lambda pool: None)
    for operator_s, options, expected in ((60.0, {}, 10.0), (4.0, {}, 4.0),
                                          (60.0, {"reward_timeout_s": 15.0}, 15.0)):
        reward_pool.set_operator_limits(reward_pool.OperatorLimits(2048, operator_s))
        env = text.make_vector_env(EnvConfig(adapter="text", id="arith", num_envs=2, eval_envs=2, options=options), 2)
        try:
            env.reset(seed=0)
            env.step(("1", "2"))
        finally:
            env.close()
        assert given[-1] == expected, (operator_s, options, given)


def test_the_pool_warns_once_when_its_workers_keep_the_services_network(caplog, monkeypatch):
    """deployment.md: "Elsewhere it has the service's network, and the pool logs a warning saying so once"."""
    from rlfabric.services.env.reward_pool import RewardPool

    class Workers:  # pebble's pool, whose started workers each wrote what _init found (as _init does)
        def __init__(self, groups: str, why: str):
            self.groups, self.why = groups, why

        def schedule(self, fn, args, timeout):
            (Path(self.groups) / str(os.getpid())).write_text(self.why)  # (a live pid: close() kills no group)
            done = Future()
            done.set_result("")
            return done

    for why, warnings in (("unshare(CLONE_NEWNET): Operation not permitted", 1), ("", 0)):
        pool = RewardPool(workers=2, memory_mb=0)
        workers = Workers(pool._groups, why)
        monkeypatch.setattr(pool, "_get", lambda workers=workers: workers)
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="rlfabric.services.env.reward_pool"):
                for target in ("rlfabric.services.env.tasks.rewards:exact_match", "rlfabric.services.env.tasks.rewards:gsm8k",
                               "rlfabric.services.env.tasks.rewards:signed_match"):
                    pool.resolve(target, target)
        finally:
            pool.close()
        said = [r.getMessage() for r in caplog.records if "keep the env service's network" in r.getMessage()]
        assert len(said) == warnings and all(why in line for line in said), said


# -- paths and endpoints ------------------------------------------------------------------------------------------
def test_eval_path_corpus_and_a_collocated_rollouts_envs_are_confined_and_the_default_root_is_the_start_dir(
        tmp_path, clean_env, process_settings):
    """deployment.md: "Workers apply the same rule to every path a run spec names (... a text task's
    `env.options.path`, `eval_path` and `corpus`, ...; a rollout worker hosting a collocated plan's envs as much as
    the env service), under the operator's `--data-root` (...; default: the directory the worker started in)"."""
    from rlfabric.services.core.paths import DataRoots
    from rlfabric.services.core.textdata import DataFileError
    from rlfabric.services.env.tasks import dataset

    start, data = tmp_path / "start", tmp_path / "data"
    for d in (start, data):
        d.mkdir()
        (d / "qa.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1), "text": f"p {i}"})
                                            + "\n" for i in range(20)))
    clean_env.chdir(start)
    for role in ("env", "rollout"):
        seen = _start(clean_env, role, [])
        assert dataset.data_roots() == DataRoots((start.resolve(),)), role  # default: where it started
        if role == "rollout":
            assert seen.built[0][1] == DataRoots((start.resolve(),))  # its own reads too
        dataset.DatasetTask(path="qa.jsonl")  # relative: from there
    _start(clean_env, "rollout", ["--data-root", str(data)])
    outside = str(start / "qa.jsonl")
    for kwargs, field in (({"path": "qa.jsonl", "split": "held_out", "eval_path": outside}, "env.options.eval_path"),
                          ({"path": "qa.jsonl", "tools": ["search"], "corpus": outside}, "env.options.corpus"),
                          ({"path": outside}, "env.options.path")):
        with pytest.raises(DataFileError, match=rf"{field}=.*outside this worker's data root"):
            dataset.DatasetTask(**kwargs)
    dataset.DatasetTask(path="qa.jsonl", split="held_out", eval_path="qa.jsonl", tools=["search"], corpus="qa.jsonl")


def test_files_over_64_gib_are_refused(tmp_path):
    """deployment.md: "They read only regular files of at most 64 GiB"."""
    from rlfabric.services.core.paths import DataRoots, PathRefused

    roots = DataRoots.parse(str(tmp_path))
    limit, over = tmp_path / "limit.pt", tmp_path / "over.pt"
    for path, size in ((limit, 64 << 30), (over, (64 << 30) + 1)):
        with open(path, "wb") as f:  # sparse: no block is written
            f.truncate(size)
    with roots.open("limit.pt", "policy.init_checkpoint") as f:  # (opened, not read: 64 GiB)
        assert os.fstat(f.fileno()).st_size == 64 << 30
    with pytest.raises(PathRefused, match=rf"policy.init_checkpoint=.*holds {(64 << 30) + 1} bytes, over the "
                                          rf"{64 << 30}-byte bound"):
        roots.read_bytes("over.pt", "policy.init_checkpoint")


def test_no_allow_endpoints_refuses_every_endpoint_the_variable_is_read_and_star_allows_any(clean_env,
                                                                                            process_settings):
    """deployment.md: "must be on the worker's `--allow-endpoints` (`RLFABRIC_ALLOW_ENDPOINTS`, `host:port,...`,
    `*` for any; default: none), or Configure is refused naming the field and the flag"."""
    from rlfabric.services.core import paths

    for variable, allowed, refused in (("", (), ("minio:9000", "127.0.0.1:6379", "localhost:80")),
                                       ("minio:9000,redis:6379", ("minio:9000", "redis:6379"), ("minio:9001",)),
                                       ("*", ("minio:9000", "169.254.169.254:80"), ())):
        if variable:
            clean_env.setenv("RLFABRIC_ALLOW_ENDPOINTS", variable)
        replay = _start(clean_env, "replay", []).built[0][3]  # ReplayService(runtime, host, roots, endpoints)
        _start(clean_env, "env", [])
        for endpoints in (replay, paths.process_endpoints()):
            for endpoint in allowed:
                endpoints.check(endpoint, "storage.endpoint")
            for endpoint in refused:
                with pytest.raises(paths.EndpointRefused, match=r"storage.endpoint=.*--allow-endpoints.*"
                                                                r"RLFABRIC_ALLOW_ENDPOINTS"):
                    endpoints.check(endpoint, "storage.endpoint")


def test_a_loopback_local_stack_reads_anything_but_devices_and_fifos_and_a_public_one_its_start_dir(
        tmp_path, clean_env):
    """deployment.md: "A local stack on loopback (`rlfabric train`, `up`) serves only the user who started it and
    allows any endpoint and path except devices and FIFOs; one on another interface is confined to its start
    directory (or the launcher's `RLFABRIC_DATA_ROOT`) and runs root"."""
    from rlfabric.services.core import paths

    start, runs = tmp_path / "start", tmp_path / "runs"
    start.mkdir()
    (start / "inside.pt").write_bytes(b"in")
    (tmp_path / "outside.pt").write_bytes(b"out")
    os.mkfifo(tmp_path / "fifo")
    clean_env.chdir(start)

    def workers_of(host: str) -> tuple[paths.DataRoots, paths.Endpoints]:
        """What the stack's launcher gives each worker, as the worker's parser reads it."""
        stack = LocalStack(log_dir=tmp_path / "logs", runs_root=runs, host=host, token="")
        stack.port_file = tmp_path / "coordinator.address"
        spawned = []
        clean_env.setattr(stack, "_spawn", lambda name, module, args: spawned.append(args))
        stack.spawn_workers(("env", "replay", "learner", "rollout"))
        assert len({tuple(a) for a in spawned}) == 1
        parser = argparse.ArgumentParser()
        paths.add_arguments(parser)
        args, _ = parser.parse_known_args(spawned[0])
        return paths.DataRoots.parse(args.data_root), paths.Endpoints.parse(args.allow_endpoints)

    roots, endpoints = workers_of("127.0.0.1")
    assert roots.read_bytes("inside.pt", "policy.init_checkpoint") == b"in"  # relative: its start directory
    assert roots.read_bytes(str(tmp_path / "outside.pt"), "policy.init_checkpoint") == b"out"
    for path, kind in (("/dev/zero", "a device"), (str(tmp_path / "fifo"), "a FIFO")):
        with pytest.raises(paths.PathRefused, match=f"is {kind}, not a regular file"):
            roots.read_bytes(path, "policy.init_checkpoint")
    endpoints.check("169.254.169.254:80", "storage.endpoint")

    roots, endpoints = workers_of("0.0.0.0")
    assert roots.read_bytes("inside.pt", "policy.init_checkpoint") == b"in"
    roots.confine(runs / "r1" / "checkpoints" / "final.pt", "policy.init_checkpoint")
    with pytest.raises(paths.PathRefused, match="outside this worker's data root"):
        roots.read_bytes(str(tmp_path / "outside.pt"), "policy.init_checkpoint")
    with pytest.raises(paths.EndpointRefused):
        endpoints.check("minio:9000", "storage.endpoint")
    clean_env.setenv("RLFABRIC_DATA_ROOT", str(tmp_path))  # the launcher's own
    roots, _ = workers_of("0.0.0.0")
    assert roots.read_bytes(str(tmp_path / "outside.pt"), "policy.init_checkpoint") == b"out"


# -- the operator's secret (robot gateways) ---------------------------------------------------------------------
def test_a_gateways_operator_secret_is_its_own_long_enough_and_read_from_the_variable(tmp_path, clean_env,
                                                                                      process_settings):
    """deployment.md: "start each robot gateway with `--operator-token-file FILE`, a secret of the operator's that is
    not the deployment's token" (and, as every flag, from `RLFABRIC_OPERATOR_TOKEN_FILE`)."""
    clean_env.setenv("RLFABRIC_TOKEN", TOKEN)
    operator_secret = "the-operators-own-secret-0123456789"
    for name, held, why in (("deployment", TOKEN, "not the deployment's token"), ("short", "x" * 15, "at least 16")):
        path = auth.write_token_file(tmp_path / name, held)
        with pytest.raises(SystemExit, match=f"--operator-token-file must hold .*{why}"):
            _start(clean_env, "robot_gateway", ["--operator-token-file", str(path)])
    good = auth.write_token_file(tmp_path / "operator", operator_secret)
    built = _start(clean_env, "robot_gateway", ["--operator-token-file", str(good)]).built
    assert built[-1][-1] == operator_secret  # RobotGatewayService(runtime, storage, root, endpoints, operator)
    clean_env.setenv("RLFABRIC_OPERATOR_TOKEN_FILE", str(good))
    assert _start(clean_env, "robot_gateway", []).built[-1][-1] == operator_secret
    clean_env.setenv("RLFABRIC_OPERATOR_TOKEN_FILE", str(tmp_path / "deployment"))
    with pytest.raises(SystemExit, match="not the deployment's token"):
        _start(clean_env, "robot_gateway", [])


def test_a_local_stack_takes_the_deployments_token_when_it_is_set(tmp_path, monkeypatch):
    """README: "`rlfabric train` and `up` make a secret per local stack unless `RLFABRIC_TOKEN` is set";
    deployment.md: "(or take `RLFABRIC_TOKEN` when it is set)"."""
    from rlfabric.services.launcher import LocalStack

    monkeypatch.setenv("RLFABRIC_TOKEN", "the-deployments-own-secret-0123456789")
    assert LocalStack(tmp_path / "logs", runs_root=tmp_path).token == "the-deployments-own-secret-0123456789"
    monkeypatch.delenv("RLFABRIC_TOKEN")
    first, second = (LocalStack(tmp_path / "logs", runs_root=tmp_path).token for _ in range(2))
    assert first != second and len(first) >= 43
