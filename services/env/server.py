"""The env service's faces: gRPC control (Configure, GetSpec, GetStats) and the data plane that steps envs.

Data-plane requests (meta.pool is "train" or "eval"):
  reset {seed}            -> obs [num_envs, ...]
  step  {chunk} actions   -> obs, reward, terminated, truncated, final_obs, episode_return, episode_length
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import grpc
from prometheus_client import Counter

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.config import ConfigError, RunConfig
from rlfabric.services.core.dataplane import DataServer, Reply, StaleAttempt, check_fence, fence_of
from rlfabric.services.core.ownership import check_owner
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, env_pb2, env_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime, run_service
from rlfabric.services.core.stats import episode_stats
from rlfabric.services.env.adapters.gymnasium import UnknownEnvError, bounds
from rlfabric.services.env.pool import EnvPools, add_host_arguments, apply_host_arguments

log = logging.getLogger(__name__)
ENV_STEPS = Counter("rlfabric_env_steps_total", "env steps simulated", ["pool"])
REJECTED = Counter("rlfabric_env_rejected_messages_total", "data-plane messages refused")
STALE = Counter("rlfabric_env_stale_attempt_requests_total",
                "env requests refused as coming from a rollout worker of an ended attempt (a fenced-off worker)")
ENV_BUILD_FAILURES = Counter("rlfabric_env_build_failures_total", "Configure calls whose envs crashed while being "
                             "built (not the spec's fault)")


def _space(spec: dict) -> env_pb2.Space:
    box = spec["kind"] == "box"
    return env_pb2.Space(kind=spec["kind"], shape=spec["shape"], dtype=spec["dtype"],
                         low=bounds(spec, "low") if box else [], high=bounds(spec, "high") if box else [],
                         n=spec.get("n", spec.get("max_length", 0)), spaces={k: _space(v) for k, v in spec.get("spaces", {}).items()})


class EnvService(env_pb2_grpc.EnvServicer):
    def __init__(self, runtime: ServiceRuntime, host: str):
        self.runtime = runtime
        self.pools: EnvPools | None = None
        self.config: RunConfig | None = None
        self.lock = threading.Lock()
        self.fence = ""  # the run attempt these envs serve (Configure's context_json.fence): see check_fence
        self.data = DataServer(host, max_bytes=RunConfig().data_plane.max_message_bytes, name="env",
                               on_reject=lambda _r: REJECTED.inc(), advertise_host=runtime.advertise_host)
        runtime.data_endpoint = self.data.endpoint
        self.data.start(self.handle)
        runtime.watch("env-data-plane", self.data.health)
        runtime.on_shutdown(self.close)

    # -- data plane (runs in the data thread) --------------------------------------------------------------
    def handle(self, kind: str, batch: TensorBatch, reply: Reply) -> None:
        with self.lock:
            if self.pools is None:
                raise ValueError("no env pools: call Configure first")
            try:  # a lost rollout worker must not step the envs of the attempt that replaced it
                check_fence(batch.meta, self.fence, "env")
            except StaleAttempt:
                STALE.inc()
                raise
            out_kind, tensors = self.pools.handle(kind, batch.meta, batch.tensors)
        if out_kind == "stepped":
            ENV_STEPS.labels("eval" if batch.meta.get("pool") == "eval" else "train").inc(len(tensors["reward"]))
        reply.send(out_kind, TensorBatch(tensors))

    # -- control plane -------------------------------------------------------------------------------------
    async def Configure(self, request, context):
        await check_owner(self.runtime, request.run_id, context)
        try:
            config = RunConfig.from_json(request.config_json).redacted()  # it opens no store: it keeps no secret
            fence = fence_of(json.loads(request.context_json or "{}"))
        except (ConfigError, ValueError) as exc:  # (a JSONDecodeError is a ValueError)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        env = config.env
        try:
            # training shards are built by the rollout workers' first resets (sized by the plan)
            pools = await asyncio.to_thread(EnvPools, config, False)
        except (UnknownEnvError, ValueError, TypeError) as exc:  # the spec's: an unknown id, options, kwargs
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 — a simulator that fails to build is reported, not hidden
            # Not the spec's fault (a crashed simulator, a missing library, memory): INTERNAL, so the coordinator
            # recovers the run on another worker instead of failing it as bad input.
            ENV_BUILD_FAILURES.inc()
            log.exception("env construction failed")
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"env.id {env.id!r} failed to build on this env worker: "
                                f"{exc.__class__.__name__}: {exc}")
        with self.lock:
            old, self.pools, self.config, self.fence = self.pools, pools, config, fence
            self.data.max_bytes = config.data_plane.max_message_bytes
        if old is not None:
            old.close()
        self.runtime.state = f"busy:{request.run_id}"
        log.info("configured", extra={"run_id": request.run_id, "env_id": env.id, "num_envs": env.num_envs})
        return common_pb2.ConfigureReply(data_endpoint=self.data.endpoint, detail_json=json.dumps(self._spec_dict()))

    def _spec_dict(self) -> dict:
        spec = self.pools["eval"]
        return {"env_id": spec.env_id, "num_envs": self.config.env.num_envs,
                "num_chunks": self.config.scheduling.chunks(), "eval_envs": spec.num_envs,
                "observation_space": spec.obs_spec, "action_space": spec.act_spec}

    async def GetSpec(self, request, context):
        if self.pools is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not configured: call Configure first")
        d = self._spec_dict()
        return env_pb2.EnvSpec(env_id=d["env_id"], num_envs=d["num_envs"], num_chunks=d["num_chunks"],
                               eval_envs=d["eval_envs"], observation_space=_space(d["observation_space"]),
                               action_space=_space(d["action_space"]))

    async def GetStats(self, request, context):
        with self.lock:
            pools = self.pools.train_pools() if self.pools is not None else []
            returns = [r for p in pools for r in p.finished_returns]
            lengths = [n for p in pools for n in p.finished_lengths]
            steps, seconds = sum(p.env_steps for p in pools), sum(p.step_seconds for p in pools)
        return env_pb2.EnvStats(env_steps=steps, episodes=episode_stats(returns, lengths),
                                rejected_messages=self.data.rejected, step_seconds=seconds)

    def close(self) -> None:
        self.data.stop()
        with self.lock:
            if self.pools is not None:
                self.pools.close()
            self.pools = None


async def _build(runtime: ServiceRuntime, args) -> None:
    apply_host_arguments(args)
    env_pb2_grpc.add_EnvServicer_to_server(EnvService(runtime, args.host), runtime.server)


def main(argv: list[str] | None = None) -> None:
    # Every worker takes the operator's --data-root and --allow-endpoints (a launcher passes them to all alike);
    # the env service reads data-set files only under --data-root and connects to no endpoint a run spec names.
    run_service("env", _build, argv, add_host_arguments)


if __name__ == "__main__":
    main()
