"""The runtime every service process shares: a grpc.aio server on uvloop with the standard health service,
bounded message sizes, a Prometheus endpoint, graceful shutdown on SIGTERM/SIGINT, and (for workers)
registration with the coordinator plus heartbeats."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import setproctitle
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import Counter, Gauge

from rlfabric.services.core import auth, progress
from rlfabric.services.core.logs import setup_logging
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from rlfabric.services.core.registry import IMPORT_PATHS_FLAG, allow_import_paths

log = logging.getLogger(__name__)

# Control messages are small; tensors never ride gRPC. The bound protects every service from oversized input.
MAX_GRPC_MESSAGE_BYTES = 8 * 2**20
LOST_EXIT_CODE = 75  # (EX_TEMPFAIL) a worker the coordinator declared lost while its work still ran: restart it
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

RPCS = Counter("rlfabric_rpcs_total", "gRPC calls received", ["service", "method"])
COMPONENT_UP = Gauge("rlfabric_component_up", "1 while a service's internal component (a data-plane loop, a "
                     "worker thread) runs; 0 once it died (the health check then reports NOT_SERVING)", ["component"])


class _CountRpcs(grpc.aio.ServerInterceptor):
    """Counts calls by method, after the token check (it sits behind TokenInterceptor, which never passes a refused
    call on) and only for registered methods: the label is the caller's choice, so an unknown path counts under
    one "unknown" label instead of a new Prometheus child per name (memory anyone could grow)."""

    def __init__(self, service: str):
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1] if handler is not None else "unknown"
        RPCS.labels(self.service, method).inc()
        return handler


def channel(address: str) -> grpc.aio.Channel:
    """A control-plane channel that presents this process's token (and TLS, when configured)."""
    return auth.aio_channel(address, GRPC_OPTIONS)


@dataclass
class ServiceOptions:
    role: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    metrics_tls: bool = False
    coordinator: str = ""
    port_file: str = ""
    advertise_host: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The flags every service shares. Each one can also come from RLFABRIC_<FLAG> (see run_service), so a
        container is configured by its environment alone; a flag on the command line wins over the variable."""
        parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for every host)")
        parser.add_argument("--port", type=_port, default=0, help="gRPC port (0 = pick a free one)")
        parser.add_argument("--metrics-port", type=_port, default=0, help="Prometheus port (0 = free one)")
        parser.add_argument("--coordinator", type=_address, default="",
                            help="host:port of the coordinator to register with")
        parser.add_argument("--advertise-host", default="", help="host name peers use to reach this service")
        parser.add_argument("--port-file", default="", help="write host:port here once serving")
        parser.add_argument("--coordinator-file", default="",
                            help="wait for this file (a coordinator's --port-file) and register with that address")
        parser.add_argument("--log-file", default="", help="JSON-lines log file (default stderr)")
        parser.add_argument("--torch-threads", type=_positive_int, default=1, help="torch intra-op threads")
        parser.add_argument("--token-file", default="", help="file holding the deployment's secret (else "
                                                              "RLFABRIC_TOKEN); required to bind a non-loopback host")
        parser.add_argument("--tls-cert", default="", help="PEM certificate of this service (gRPC over TLS)")
        parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
        parser.add_argument("--tls-ca", default="", help="PEM CA that signs every service's certificate: peers are "
                                                         "verified with it and must present one (mTLS)")
        parser.add_argument("--insecure-plaintext", action="store_true",
                            help="serve gRPC without TLS on a non-loopback --host, and call other hosts' services "
                                 "without TLS (the bearer and every control message cross the network readable); a "
                                 "warning is logged at start")
        parser.add_argument("--metrics-tls", action="store_true",
                            help="serve metrics over HTTPS with --tls-cert/--tls-key")
        parser.add_argument(IMPORT_PATHS_FLAG, action="store_true",
                            help="resolve code a run spec names by import path (package.module:attr as env.id, "
                                 "env.options.reward, policy.name, rollout.backend, ...), which runs that code "
                                 "here for anyone holding the token; without it only built-in and installed "
                                 "entry-point names resolve")
        parser.add_argument("--pool", default="", help="the resource pool this worker belongs to: a run places a "
                                                        "stage on the workers of the pool scheduling.placement names")


ENV_PREFIX = "RLFABRIC_"


def env_var(option: str) -> str:
    """--metrics-port -> RLFABRIC_METRICS_PORT: the one naming rule for configuration by environment."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected an integer port 0-65535 (0 = pick a free one), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _address(text: str) -> str:
    """host:port, checked at start-up so a typo fails now instead of as an endless registration retry."""
    if not text:
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. coordinator:50051, got {text!r}")
    return text


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None,
                       ignore: tuple[str, ...] = ()) -> None:
    """Take every long flag's default from RLFABRIC_<FLAG> when that variable is non-empty (``ignore`` excepted).

    Values are converted and checked here rather than by argparse so that a malformed one exits with code 2 and
    names the variable (argparse would blame the flag, which the user never typed)."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        options = [o for o in action.option_strings if o.startswith("--")]
        if not options or options[0] in ignore or not _single_valued(action):
            continue  # positionals, --help, append/count flags: the command line only
        name = env_var(options[0])
        action.help = f"{action.help or ''} [env {name}]".strip()
        raw = environ.get(name, "").strip()
        if not raw:  # unset and empty alike: compose writes `VAR: ${UNSET}` as an empty string
            continue
        try:
            value = _convert(action, raw)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            parser.exit(2, f"{parser.prog}: error: environment variable {name}={raw!r} is invalid for "
                           f"{options[0]}: {exc}\n")
        action.default = value
        action.required = False


def _single_valued(action: argparse.Action) -> bool:
    if isinstance(action, argparse._StoreConstAction | argparse.BooleanOptionalAction):
        return True
    return isinstance(action, argparse._StoreAction) and action.nargs in (None, "?")


def _convert(action: argparse.Action, raw: str):
    if isinstance(action, argparse._StoreConstAction | argparse.BooleanOptionalAction):
        on, off = (action.const, action.default) if isinstance(action, argparse._StoreConstAction) else (True, False)
        if raw.lower() in _TRUE:
            return on
        if raw.lower() in _FALSE:
            return off
        raise ValueError("expected a boolean: 1/true/yes/on or 0/false/no/off")
    value = raw
    if action.type is not None:
        try:
            value = action.type(raw)
        except (TypeError, ValueError):
            kind = getattr(action.type, "__name__", "value")
            expected = {"int": "an integer", "float": "a number"}.get(kind, f"a valid {kind}")
            raise ValueError(f"expected {expected}, got {raw!r}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


ROLES = {
    "coordinator": common_pb2.COORDINATOR,
    "learner": common_pb2.LEARNER,
    "rollout": common_pb2.ROLLOUT,
    "env": common_pb2.ENV,
    "replay": common_pb2.REPLAY,
    "robot_gateway": common_pb2.ROBOT_GATEWAY,
}
ROLE_NAMES = {v: k for k, v in ROLES.items()}


class ServiceRuntime:
    """Owns the gRPC server and the process lifecycle of one service."""

    def __init__(self, options: ServiceOptions):
        self.options = options
        # the token check first: a refused call never reaches the counter (or anything else)
        interceptors = [*([auth.TokenInterceptor(auth.current())] if auth.current().enabled else []),
                        _CountRpcs(options.role)]
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.stopping = asyncio.Event()
        self.worker_id = ""
        self.worker_key = ""  # this registration's secret (its heartbeats carry it)
        self.owner_run = ""  # the running run that holds this worker, as the coordinator's heartbeats say
        self.owner_key = ""  # and that run's key, which the coordinator's calls for it carry
        self.port = 0
        self.state = "idle"
        self.data_endpoint = ""
        self._shutdown_hooks: list[Callable[[], Awaitable[None] | None]] = []
        self._tasks: list[asyncio.Task] = []
        self.metrics_port = 0
        self._probes: dict[str, Callable[[], str | None]] = {}
        self.failed: dict[str, str] = {}  # component -> why it is dead
        self._serving = True  # what check_components last set the health check to

    @property
    def state(self) -> str:
        """idle, or busy:<run id>: what heartbeats report and what the process title says."""
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        set_process_title(self.options.role, value.removeprefix("busy:") if value.startswith("busy:") else "",
                          self.port)

    @property
    def advertise_host(self) -> str:
        if self.options.advertise_host:
            return self.options.advertise_host
        return socket.gethostname() if self.options.host == "0.0.0.0" else self.options.host

    @property
    def address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    def on_shutdown(self, hook: Callable[[], Awaitable[None] | None]) -> None:
        self._shutdown_hooks.append(hook)

    def watch(self, component: str, probe: Callable[[], str | None]) -> None:
        """Tie the health check to an internal component: ``probe`` returns None while it works, else why not
        (a data-plane thread that died). A service whose component died answers NOT_SERVING instead of SERVING
        with a dead loop behind it, and says why in its log and in ``rlfabric_component_up``."""
        self._probes[component] = probe
        COMPONENT_UP.labels(component).set(1)

    def check_components(self) -> None:
        """Run every probe now (also called every half second). A component whose probe fails turns the health
        check NOT_SERVING; one that works again (a robot arm's deadline fault the operator cleared; a dead thread
        never does) is taken back, and with none failing the service is SERVING again."""
        for component, probe in self._probes.items():
            try:
                why = probe()
            except Exception as exc:  # noqa: BLE001 — a probe that fails reports its component dead
                why = f"its health probe failed: {exc.__class__.__name__}: {exc}"
            if why and component not in self.failed:
                self.failed[component] = why
                COMPONENT_UP.labels(component).set(0)
                log.critical("component died; health is now NOT_SERVING",
                             extra={"component": component, "reason": why})
            elif not why and component in self.failed:
                del self.failed[component]
                COMPONENT_UP.labels(component).set(1)
                log.warning("component works again", extra={"component": component})
        serving = not self.failed
        if serving != self._serving and not self.stopping.is_set():
            self._serving = serving
            asyncio.get_running_loop().create_task(self.health.set("", health_pb2.HealthCheckResponse.SERVING
                                                                   if serving else
                                                                   health_pb2.HealthCheckResponse.NOT_SERVING))

    async def _watch_components(self) -> None:
        while not self.stopping.is_set():
            self.check_components()
            try:
                await asyncio.wait_for(self.stopping.wait(), 0.5)
            except TimeoutError:
                pass

    async def start(self) -> None:
        self.port = auth.add_port(self.server, f"{self.options.host}:{self.options.port}")
        self.state = self.state  # the title gains the port
        if not self.port:
            raise SystemExit(f"{self.options.role}: cannot bind gRPC on {self.options.host}:{self.options.port}")
        await self.server.start()
        self._metrics_server, self.metrics_port = auth.start_metrics_server(
            self.options.metrics_port, self.options.host, tls=self.options.metrics_tls)
        self.on_shutdown(self._metrics_server.shutdown)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self._watch_components()))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        if self.options.port_file:
            tmp = self.options.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(self.address)
            os.replace(tmp, self.options.port_file)
        log.info("serving", extra={"role": self.options.role, "grpc": self.address, "metrics": self.metrics_port})
        if self.options.coordinator:
            await self.register()
            self._tasks.append(asyncio.create_task(self._heartbeats()))

    def request_stop(self, sig: int | None = None) -> None:
        if not self.stopping.is_set():
            log.info("stop requested", extra={"signal": sig})
            self.stopping.set()

    def endpoint(self) -> common_pb2.Endpoint:
        return common_pb2.Endpoint(grpc=self.address, data=self.data_endpoint,
                                   metrics=f"{'https' if self.options.metrics_tls else 'http'}://"
                                           f"{self.advertise_host}:{self.metrics_port}/metrics")

    async def register(self) -> None:
        async with channel(self.options.coordinator) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            reply = await stub.RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(role=ROLES[self.options.role], endpoint=self.endpoint(),
                                                      pid=os.getpid(), host=socket.gethostname(),
                                                      labels=self.options.labels),
                timeout=10, wait_for_ready=True)
        self.worker_id, self.worker_key = reply.worker_id, reply.worker_key
        self.heartbeat_interval = reply.heartbeat_interval_s or 0.5
        log.info("registered", extra={"worker_id": self.worker_id, "coordinator": self.options.coordinator})

    async def _heartbeats(self) -> None:
        async with channel(self.options.coordinator) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            while not self.stopping.is_set():
                try:
                    reply = await stub.Heartbeat(coordinator_pb2.HeartbeatRequest(
                        worker_id=self.worker_id, state=self.state, worker_key=self.worker_key,
                        cpu_s=progress.cpu_seconds(), messages=progress.messages()), timeout=5)
                    if reply.lost and progress.in_flight():
                        self._exit_lost()
                    self.owner_key = reply.run_key
                    if reply.run_id != self.owner_run:  # placed in a run, or freed when it ended: the title says so
                        self.owner_run = reply.run_id
                        set_process_title(self.options.role, reply.run_id, self.port)
                    if not reply.known:
                        log.warning("coordinator does not know this worker (it restarted?); registering again")
                        await self.register()
                except grpc.aio.AioRpcError as exc:
                    log.warning("heartbeat failed: %s", exc.details() or exc.code().name)
                try:
                    await asyncio.wait_for(self.stopping.wait(), self.heartbeat_interval)
                except TimeoutError:
                    pass

    def _exit_lost(self) -> None:
        """The coordinator gave up on this worker (silent too long, or no progress within a call) while work of
        its old run still runs here: that work cannot be stopped from outside its thread, and a recovery must never
        wait on it. So the process ends at once, with LOST_EXIT_CODE: a supervisor (the local stack, compose's
        restart policy, ``serve --restart on-failure``) starts it clean, and it registers anew."""
        log.error("the coordinator declared this worker lost while %d call(s) still run here: exiting with code %d "
                  "so that a clean process takes its place", progress.in_flight(), LOST_EXIT_CODE)
        logging.shutdown()
        os._exit(LOST_EXIT_CODE)

    async def serve_until_stopped(self, grace_s: float = 3.0) -> None:
        await self.stopping.wait()
        await self.health.enter_graceful_shutdown()
        for hook in reversed(self._shutdown_hooks):
            try:
                result = hook()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 — shutdown must run every hook
                log.exception("shutdown hook failed")
        for task in self._tasks:
            task.cancel()
        if self.options.coordinator and self.worker_id:
            try:
                async with channel(self.options.coordinator) as ch:
                    await coordinator_pb2_grpc.CoordinatorStub(ch).DeregisterWorker(
                        coordinator_pb2.DeregisterWorkerRequest(worker_id=self.worker_id, reason="shutdown",
                                                                force=True, worker_key=self.worker_key),
                        timeout=1)
            except grpc.aio.AioRpcError:
                pass
        await self.server.stop(grace_s)
        log.info("stopped")


def set_process_title(role: str, run: str = "", port: int = 0) -> None:
    """``rlfabric-<role> [run=<id>] [grpc=:<port>]`` in ps/top: every service process otherwise shows the same
    ``python -c from multiprocessing.forkserver ...`` line, and an operator could not tell the learner from the env."""
    setproctitle.setproctitle(" ".join(
        [f"rlfabric-{role}", *([f"run={run}"] if run else []), *([f"grpc=:{port}"] if port else [])]))


def run_service(role: str, build: Callable[[ServiceRuntime, argparse.Namespace], Awaitable[None]],
                argv: list[str] | None = None, extra_args: Callable[[argparse.ArgumentParser], None] | None = None
                ) -> None:
    """Entry point of a service process: parse the shared flags (command line over RLFABRIC_* environment over
    built-in defaults), set up logs and torch threads, serve."""
    parser = argparse.ArgumentParser(prog=f"rlfabric serve {role}")
    ServiceOptions.add_arguments(parser)
    if extra_args:
        extra_args(parser)
    # After extra_args, so a service's own flags are configurable the same way. The coordinator registers with
    # no one: it ignores RLFABRIC_COORDINATOR, so one value can be exported on every host, its own included.
    apply_env_defaults(parser, ignore=("--coordinator",) if role == "coordinator" else ())
    args = parser.parse_args(argv)
    set_process_title(role)
    setup_logging(role, args.log_file or None)
    allow_import_paths(args.allow_import_paths)
    try:
        security = auth.from_environment(args.token_file, auth.TLSFiles(args.tls_cert, args.tls_key, args.tls_ca),
                                         plaintext_ok=args.insecure_plaintext or None)
    except auth.AuthError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.exit(2, f"{parser.prog}: error: --tls-cert and --tls-key go together (the certificate and its key)\n")
    if args.tls_ca and not args.tls_cert:
        parser.exit(2, f"{parser.prog}: error: --tls-ca makes peers present certificates, so this service needs its "
                       f"own: give --tls-cert and --tls-key too (`rlfabric certs` makes all three)\n")
    if args.metrics_tls and not args.tls_cert:
        parser.exit(2, f"{parser.prog}: error: --metrics-tls serves metrics with this service's certificate: give "
                       f"--tls-cert and --tls-key (`rlfabric certs` makes them)\n")
    if not security.enabled and not auth.is_loopback(args.host):
        parser.exit(2, f"{parser.prog}: error: refusing to serve on {args.host} without a secret: anyone who can "
                       f"reach it could run, stop and feed runs. Fix: set RLFABRIC_TOKEN (or --token-file) to the "
                       f"deployment's secret on every host, e.g. from `python -c 'import secrets; "
                       f"print(secrets.token_urlsafe(32))'`, or bind 127.0.0.1\n")
    plaintext = not security.tls.enabled and not auth.is_loopback(args.host)
    if plaintext and not args.insecure_plaintext:
        parser.exit(2, f"{parser.prog}: error: refusing to serve gRPC on {args.host} without TLS: every call would "
                       f"carry the deployment's bearer in clear to anyone on the network. Fix: give --tls-cert and "
                       f"--tls-key (and --tls-ca for mTLS; `rlfabric certs DIR --hosts ...` makes them), bind "
                       f"127.0.0.1, or pass --insecure-plaintext on a network you trust\n")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))
    options = ServiceOptions(role=role, host=args.host, port=args.port, metrics_port=args.metrics_port,
                             metrics_tls=args.metrics_tls, coordinator=args.coordinator, port_file=args.port_file,
                             advertise_host=args.advertise_host, labels={"pool": args.pool} if args.pool else {})

    if plaintext:
        log.warning("serving gRPC in the clear on a non-loopback address (--insecure-plaintext): anyone on the "
                    "network can read the bearer and every control message, and use the bearer",
                    extra={"host": args.host})

    async def main() -> None:
        if args.coordinator_file:
            options.coordinator = await _wait_for_file(args.coordinator_file, 60.0)
        runtime = ServiceRuntime(options)
        await build(runtime, args)
        await runtime.start()
        await runtime.serve_until_stopped()

    import uvloop

    uvloop.run(main())


async def _wait_for_file(path: str, timeout_s: float) -> str:
    """Lets a launcher start workers together with the coordinator: heavy imports overlap its start-up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not os.path.exists(path):
        if loop.time() > deadline:
            raise SystemExit(f"coordinator address file {path} did not appear within {timeout_s:.0f}s")
        await asyncio.sleep(0.005)
    with open(path) as f:
        return f.read().strip()


def learner_precision(precision: str, device: object):
    """The context a learner's update runs in: ``runtime.precision`` bf16-mixed autocasts its matrix products to
    bfloat16 (torch keeps log-softmax, norms and losses in fp32, and the weights and optimizer state stay fp32);
    fp32 is a no-op context."""
    import contextlib

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if precision != "bf16-mixed":
        return contextlib.nullcontext()
    global _AUTOCAST_HOOK
    if _AUTOCAST_HOOK is None:
        # autocast keeps one bf16 copy of each weight for the whole context (no re-cast per pass), and does not
        # notice in-place changes: every optimizer step drops the copies, or the next minibatch (epochs > 1,
        # several minibatches per update) would run on the weights before the step
        _AUTOCAST_HOOK = register_optimizer_step_post_hook(lambda *_: torch.clear_autocast_cache())
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


_AUTOCAST_HOOK = None


def set_torch_threads(n: int) -> None:
    """Every service sets its torch thread count: defaults collapse when processes share 2 cores."""
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set once in this process
