"""Shared by the robot gateway tests: a real gateway process on loopback with a token, or the service in-process
(and ``serve_process``: any service so)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OPERATOR_SECRET = "the-operators-own-secret-not-the-deployments"  # what a test gateway's operator holds


def as_operator(secret: str = OPERATOR_SECRET) -> tuple[tuple[str, str], ...]:
    """The metadata of a call made as the gateway's operator (ClearEStop takes it; a run never has it)."""
    from rlfabric.services.core import auth

    return ((auth.OPERATOR_METADATA_KEY, auth.operator_credential(secret)),)


@contextmanager
def serve_process(role: str, workdir: Path, token: str, *args: str) -> Iterator[str]:
    """``rlfabric serve ROLE`` on loopback with ``token`` (and extra flags); yields its address, stops it after. Its
    log is ``workdir/ROLE.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / f"{role}.log"  # a file, not a pipe: a pipe nobody reads fills up and stalls the service
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "serve", role, "--port-file",
                                 str(port_file), *args], env={**os.environ, "RLFABRIC_TOKEN": token},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    try:
        for _ in range(300):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        if not port_file.exists():
            raise RuntimeError(f"{role} did not start: {log_path.read_text()[-2000:]}"
                               if proc.poll() is not None else f"{role} wrote no port file in 15 s")
        yield port_file.read_text().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


@contextmanager
def gateway_process(workdir: Path, token: str, *args: str, operator: str = OPERATOR_SECRET) -> Iterator[str]:
    """``rlfabric serve robot_gateway`` with ``token`` (and extra flags), its operator holding ``operator`` (""
    for none); yields its address, stops it after. Its log is ``workdir/robot_gateway.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    if operator:
        from rlfabric.services.core import auth

        operator_file = auth.write_token_file(workdir / "operator-token", operator)
        args = ("--operator-token-file", str(operator_file), *args)
    with serve_process("robot_gateway", workdir, token, *args) as address:
        yield address


class _Runtime:
    """What RobotGatewayService takes from its ServiceRuntime, in-process (no auth, no health server)."""

    def __init__(self):
        from types import SimpleNamespace

        self.options = SimpleNamespace(host="127.0.0.1")
        self.advertise_host = "127.0.0.1"
        self.shutdown_hooks: list = []
        self.probes: dict = {}

    def on_shutdown(self, hook) -> None:
        self.shutdown_hooks.append(hook)

    def watch(self, component: str, probe) -> None:
        self.probes[component] = probe


@contextmanager
def gateway_in_process(**service_kwargs) -> Iterator[tuple]:
    """A RobotGatewayService on its own asyncio loop and thread, served on loopback without a token: for tests
    that need the gateway's own objects (a test driver registered in this process, its health probes). Yields
    (stub, service, runtime); the service is closed after."""
    import asyncio

    import grpc

    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
    from rlfabric.services.robot_gateway.server import RobotGatewayService

    runtime, aloop, started = _Runtime(), asyncio.new_event_loop(), threading.Event()
    made: dict = {}

    async def serve() -> None:
        server = grpc.aio.server()
        made["service"] = RobotGatewayService(runtime, **{"operator_secret": OPERATOR_SECRET, **service_kwargs})
        robot_gateway_pb2_grpc.add_RobotGatewayServicer_to_server(made["service"], server)
        made["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        made["stop"] = stop = asyncio.Event()
        started.set()
        await stop.wait()
        await server.stop(0)

    thread = threading.Thread(target=aloop.run_until_complete, args=(serve(),), name="gateway-in-process",
                              daemon=True)
    thread.start()
    if not started.wait(15):
        raise RuntimeError("the in-process gateway did not start in 15 s")
    channel = grpc.insecure_channel(f"127.0.0.1:{made['port']}")
    try:
        yield robot_gateway_pb2_grpc.RobotGatewayStub(channel), made["service"], runtime
    finally:
        channel.close()
        aloop.call_soon_threadsafe(made["stop"].set)
        thread.join(15)
        aloop.close()
        made["service"].close()


class ArmWatch:
    """Every tick of every arm of a gateway, through a Teleop stream per arm that never takes over (what the
    fail-safe tests read: which arms a policy commanded, and when each went into hold)."""

    def __init__(self, stub, pb):
        import grpc
        import numpy as np

        from rlfabric.services.robot_gateway.teleop import TeleopSession

        self.arms = [r.robot_id for r in stub.ListRobots(pb.ListRobotsRequest(), timeout=10).robots]
        self.states: dict[str, list] = {rid: [] for rid in self.arms}
        self.sessions = [TeleopSession(stub, pb, rid, np.asarray(stub.GetState(pb.RobotRef(robot_id=rid)).position))
                         for rid in self.arms]

        def follow(session) -> None:
            try:
                for state in session.states:
                    self.states[session.robot_id].append(state)
            except grpc.RpcError:  # the stream ends when the arm is freed or the test closes it
                return

        for session in self.sessions:
            threading.Thread(target=follow, args=(session,), daemon=True).start()

    def commanded(self) -> list[str]:
        """The arms whose policy sent more than 5 distinct commands so far."""
        return [rid for rid in self.arms if len({s.policy_seq for s in self.states[rid]}) > 5]

    def close(self) -> None:
        for session in self.sessions:
            session.close()

    def held_after_last_command(self, rid: str, window_s: float, tick_s: float, upto: int | None = None) -> tuple:
        """Asserts arm ``rid`` went into watchdog hold within ``window_s`` plus one tick of its last command and
        stayed held (over its first ``upto`` ticks); returns (seconds it waited, ticks after the last command)."""
        ticks = self.states[rid][:upto]
        last = max(i for i, s in enumerate(ticks) if s.policy_seq != ticks[-1].policy_seq) + 1  # last command
        held = [s for s in ticks[last:] if s.holding]
        assert held, f"{rid} was never put in hold after its commands stopped"
        assert held[0].hold_reason.startswith("watchdog"), held[0].hold_reason
        waited = held[0].time - ticks[last].time
        assert waited <= window_s + tick_s + 1e-6, f"{rid} held {waited:.3f} s after its last command"
        assert all(s.holding for s in ticks[ticks.index(held[0]):]), f"{rid} left its hold"
        return waited, len(ticks) - last
