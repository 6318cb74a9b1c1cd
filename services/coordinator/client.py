"""CoordinatorClient: the thin, synchronous Python client over the coordinator's gRPC API (for notebooks,
scripts and the CLI)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from rlfabric.services.core.runtime import GRPC_OPTIONS

if TYPE_CHECKING:
    from rlfabric.services.core.config import RunConfig

STATE_NAMES = {v: k for k, v in coordinator_pb2.RunState.items()}


class CoordinatorClient:
    """``token``/``token_file``: the deployment's secret (default: RLFABRIC_TOKEN_FILE or RLFABRIC_TOKEN, or what
    this process configured already, e.g. a local stack's); ``tls``: the CA (and a client certificate for mTLS
    services), default RLFABRIC_TLS_* or what this process configured."""

    def __init__(self, address: str, timeout_s: float = 10.0, token: str | None = None, token_file: str = "",
                 tls: auth.TLSFiles | None = None):
        self.address = address
        self.timeout_s = timeout_s
        if token is not None:
            environment = auth.tls_from_environment()
            security = auth.Security(token, tls or (environment if environment.ca or environment.enabled
                                                    else auth.current().tls),
                                     auth.current().plaintext_ok or auth.plaintext_from_environment())
        elif token_file or tls is not None or not auth.current().enabled:
            security = auth.from_environment(token_file, tls)
        else:
            security = auth.current()
        self._channel = auth.sync_channel(address, GRPC_OPTIONS, security)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def submit(self, config: str | Path | RunConfig, overrides: list[str] | None = None,
               run_dir: str | Path | None = None) -> coordinator_pb2.RunStatus:
        """Submit a run spec: a RunConfig, a YAML path, or YAML text. (The coordinator validates it; this client
        stays light, importing the schema only when handed a RunConfig.)"""
        if hasattr(config, "model_dump_json"):
            from rlfabric.services.core.config import dump_yaml

            text = dump_yaml(config)
        elif isinstance(config, Path) or (isinstance(config, str) and "\n" not in config and Path(config).is_file()):
            text = Path(config).read_text()
        else:
            text = str(config)
        return self.stub.SubmitRun(coordinator_pb2.SubmitRunRequest(
            config_yaml=text, overrides=overrides or [], run_dir=str(run_dir or "")), timeout=self.timeout_s)

    def resume(self, run_dir: str | Path, overrides: list[str] | None = None) -> coordinator_pb2.RunStatus:
        """Continue the run in ``run_dir`` (same run id) from its newest valid checkpoint; ``overrides`` may
        change its saved config (e.g. a larger ``train.total_env_steps``)."""
        return self.stub.SubmitRun(coordinator_pb2.SubmitRunRequest(run_dir=str(run_dir), resume=True,
                                                                    overrides=overrides or []),
                                   timeout=self.timeout_s)

    def status(self, run_id: str) -> coordinator_pb2.RunStatus:
        return self.stub.GetRun(coordinator_pb2.RunRef(run_id=run_id), timeout=self.timeout_s)

    def runs(self) -> list[coordinator_pb2.RunStatus]:
        return list(self.stub.ListRuns(common_pb2.Empty(), timeout=self.timeout_s).runs)

    def workers(self) -> list[coordinator_pb2.WorkerStatus]:
        return list(self.stub.ListWorkers(common_pb2.Empty(), timeout=self.timeout_s).workers)

    def watch(self, run_id: str, reconnect_s: float = 120.0) -> Iterator[coordinator_pb2.RunEvent]:
        """Every event of the run (history first), until it ends. A coordinator that goes away (restarting) is
        waited for up to ``reconnect_s`` and watched again: a restarted one takes the run up, and its history
        starts there."""
        while True:
            try:
                for event in self.stub.WatchRun(coordinator_pb2.RunRef(run_id=run_id)):
                    yield event
                    if event.HasField("status") and event.status.state in (
                            coordinator_pb2.SUCCEEDED, coordinator_pb2.FAILED, coordinator_pb2.STOPPED):
                        return
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or reconnect_s <= 0:
                    raise
                self.wait_ready(reconnect_s)

    def wait(self, run_id: str) -> coordinator_pb2.RunStatus:
        for _ in self.watch(run_id):
            pass
        return self.status(run_id)

    def stop(self, run_id: str) -> coordinator_pb2.RunStatus:
        return self.stub.StopRun(coordinator_pb2.RunRef(run_id=run_id), timeout=60)

    def scale(self, run_id: str, role: str, delta: int = 0, count: int = 0,
              timeout_s: float = 60.0) -> coordinator_pb2.ScaleReply:
        """Add (delta > 0) or remove (delta < 0) workers of ``role``, or set their ``count``; returns once the
        change is applied at an epoch boundary."""
        return self.stub.Scale(coordinator_pb2.ScaleRequest(run_id=run_id, role=role, delta=delta, count=count,
                                                            timeout_s=timeout_s), timeout=timeout_s + 10)

    def plan(self, run_id: str) -> coordinator_pb2.PlanReply:
        """The plan the run executes and, for mode auto, the static scheduler's decision table."""
        return self.stub.GetPlan(coordinator_pb2.RunRef(run_id=run_id), timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
