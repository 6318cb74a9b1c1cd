"""What the dashboard shows of a robot gateway, from a real gateway process with a simulated arm: per arm its loop
jitter, its hold and its interventions; a gateway that does not answer is shown with the reason."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rlfabric.services.coordinator.dashboard import Dashboard
from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
from rlfabric.services.core.runtime import GRPC_OPTIONS
from tests.robot_support import gateway_process

TOKEN = "the-dashboards-gateway-test-secret"


def test_the_dashboard_shows_each_arms_jitter_hold_and_interventions(tmp_path, monkeypatch):
    pytest.importorskip("mujoco")
    security = auth.Security(TOKEN)
    monkeypatch.setattr(auth, "_current", security)  # the coordinator's process holds the deployment's secret
    with gateway_process(tmp_path / "gw", TOKEN, "--storage-root", str(tmp_path / "recordings")) as address:
        with auth.sync_channel(address, GRPC_OPTIONS, security) as channel:
            robot_gateway_pb2_grpc.RobotGatewayStub(channel).Connect(
                pb.ConnectRequest(robot_id="arm0", driver="sim", control_hz=50), timeout=60)
        registered = SimpleNamespace(role="robot_gateway", alive=True, grpc=address)
        service = SimpleNamespace(registry=SimpleNamespace(workers={"robot_gateway-0": registered}), runs={})

        async def poll() -> list[list[dict]]:
            board = Dashboard(service, "127.0.0.1", 0, "127.0.0.1", ["127.0.0.1:1"])  # (nothing listens on :1)
            try:
                first = await board.poll_gateways()
                await asyncio.sleep(0.2)
                return [first, await board.poll_gateways()]
            finally:
                await board.stop()

        first, second = asyncio.run(poll())
    gateway, unreachable = second
    assert gateway["address"] == address and gateway["registered"] and not gateway["error"]
    [arm] = gateway["robots"]
    assert arm["robot_id"] == "arm0" and arm["driver"] == "sim" and arm["control_hz"] == 50
    assert len(arm["jitter_ms_series"]) == 2 and arm["jitter_max_ms"] >= arm["jitter_ms"] >= 0  # sampled per poll
    assert arm["holding"] and arm["hold_reason"]  # no command yet: the arm holds, and says why
    assert not arm["intervening"] and arm["episode_intervened_ticks"] == 0 and not arm["estopped"]
    assert not unreachable["registered"] and unreachable["robots"] == [] and "UNAVAILABLE" in unreachable["error"]
    assert first[0]["robots"][0]["robot_id"] == "arm0"
