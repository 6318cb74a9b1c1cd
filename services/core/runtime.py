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
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import Counter, start_http_server

from services.core.logs import setup_logging
from services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# Control messages are small; tensors never ride gRPC. The bound protects every service from oversized input.
MAX_GRPC_MESSAGE_BYTES = 8 * 2**20
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

RPCS = Counter("rlfabric_rpcs_total", "gRPC calls received", ["service", "method"])


class _CountRpcs(grpc.aio.ServerInterceptor):
    def __init__(self, service: str):
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        RPCS.labels(self.service, handler_call_details.method.rsplit("/", 1)[-1]).inc()
        return await continuation(handler_call_details)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)


@dataclass
class ServiceOptions:
    role: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    coordinator: str = ""
    port_file: str = ""
    advertise_host: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for every host)")
        parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = pick a free one)")
        parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = free one)")
        parser.add_argument("--coordinator", default="", help="host:port of the coordinator to register with")
        parser.add_argument("--advertise-host", default="", help="host name peers use to reach this service")
        parser.add_argument("--port-file", default="", help="write host:port here once serving")
        parser.add_argument("--coordinator-file", default="",
                            help="wait for this file (a coordinator's --port-file) and register with that address")
        parser.add_argument("--log-file", default="", help="JSON-lines log file (default stderr)")
        parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")


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
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[_CountRpcs(options.role)])
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.stopping = asyncio.Event()
        self.worker_id = ""
        self.state = "idle"
        self.data_endpoint = ""
        self._shutdown_hooks: list[Callable[[], Awaitable[None] | None]] = []
        self._tasks: list[asyncio.Task] = []
        self.port = 0
        self.metrics_port = 0

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

    async def start(self) -> None:
        self.port = self.server.add_insecure_port(f"{self.options.host}:{self.options.port}")
        if not self.port:
            raise SystemExit(f"{self.options.role}: cannot bind gRPC on {self.options.host}:{self.options.port}")
        await self.server.start()
        metrics_server, _ = start_http_server(self.options.metrics_port, addr=self.options.host)
        self.metrics_port = metrics_server.server_port
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
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
                                   metrics=f"http://{self.advertise_host}:{self.metrics_port}/metrics")

    async def register(self) -> None:
        async with channel(self.options.coordinator) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            reply = await stub.RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(role=ROLES[self.options.role], endpoint=self.endpoint(),
                                                      pid=os.getpid(), host=socket.gethostname(),
                                                      labels=self.options.labels),
                timeout=10, wait_for_ready=True)
        self.worker_id = reply.worker_id
        self.heartbeat_interval = reply.heartbeat_interval_s or 0.5
        log.info("registered", extra={"worker_id": self.worker_id, "coordinator": self.options.coordinator})

    async def _heartbeats(self) -> None:
        async with channel(self.options.coordinator) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            while not self.stopping.is_set():
                try:
                    reply = await stub.Heartbeat(
                        coordinator_pb2.HeartbeatRequest(worker_id=self.worker_id, state=self.state), timeout=5)
                    if not reply.known:
                        log.warning("coordinator does not know this worker (it restarted?); registering again")
                        await self.register()
                except grpc.aio.AioRpcError as exc:
                    log.warning("heartbeat failed: %s", exc.details() or exc.code().name)
                try:
                    await asyncio.wait_for(self.stopping.wait(), self.heartbeat_interval)
                except TimeoutError:
                    pass

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
                        coordinator_pb2.DeregisterWorkerRequest(worker_id=self.worker_id, reason="shutdown"),
                        timeout=1)
            except grpc.aio.AioRpcError:
                pass
        await self.server.stop(grace_s)
        log.info("stopped")


def run_service(role: str, build: Callable[[ServiceRuntime, argparse.Namespace], Awaitable[None]],
                argv: list[str] | None = None, extra_args: Callable[[argparse.ArgumentParser], None] | None = None
                ) -> None:
    """Entry point of a service process: parse the shared flags, set up logs and torch threads, serve."""
    parser = argparse.ArgumentParser(prog=f"rlfabric serve {role}")
    ServiceOptions.add_arguments(parser)
    if extra_args:
        extra_args(parser)
    args = parser.parse_args(argv)
    setup_logging(role, args.log_file or None)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))
    options = ServiceOptions(role=role, host=args.host, port=args.port, metrics_port=args.metrics_port,
                             coordinator=args.coordinator, port_file=args.port_file,
                             advertise_host=args.advertise_host)

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
        await asyncio.sleep(0.02)
    with open(path) as f:
        return f.read().strip()


def set_torch_threads(n: int) -> None:
    """Every service sets its torch thread count: defaults collapse when processes share 2 cores."""
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set once in this process
