"""The rollout service's gRPC face: Configure, Collect (one batch), Produce (a stream of batches under a
staleness bound), Evaluate, GetState. Acting runs on the RolloutWorker thread."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import Future

import grpc
from prometheus_client import Counter, Gauge

from rlfabric.services.core.config import ConfigError, RunConfig
from rlfabric.services.core.dataplane import PeerTimeout, RemoteError, fence_of
from rlfabric.services.core.ownership import check_owner
from rlfabric.services.core.paths import DataRoots, Endpoints, confine_model, confine_storage
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime, run_service
from rlfabric.services.core.stats import episode_stats
from rlfabric.services.env.pool import add_host_arguments, apply_host_arguments
from rlfabric.services.rollout.worker import CollectResult, RolloutWorker, Stopped, WeightsLate

log = logging.getLogger(__name__)
BATCHES = Counter("rlfabric_rollout_batches_total", "trajectory batches produced")
SERVING = Gauge("rlfabric_rollout_weight_version", "weight version this rollout worker serves")
MAX_EVAL_EPISODES = 10_000
MAX_PROBE_ROUND_TRIPS = 10_000


def _reply(r: CollectResult) -> rollout_pb2.CollectReply:
    return rollout_pb2.CollectReply(
        batch_index=r.batch_index, env_steps=r.env_steps, weight_version=r.weight_version,
        episodes=episode_stats(r.returns, r.lengths), collect_seconds=r.collect_seconds,
        env_seconds=r.env_seconds, policy_seconds=r.policy_seconds, weight_wait_seconds=r.weight_wait_seconds,
        episode_returns=r.returns, shard=r.shard, shard_envs=r.shard_envs, stats=r.stats)


class RolloutService(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, runtime: ServiceRuntime, roots: DataRoots | None = None, endpoints: Endpoints | None = None):
        self.runtime = runtime
        # where a run spec may have this worker read weights from, and which endpoints it may reach (the operator's)
        self.roots = roots if roots is not None else DataRoots.parse(".")
        self.endpoints = endpoints if endpoints is not None else Endpoints.parse("")
        self.worker: RolloutWorker | None = None
        self.producing: threading.Event | None = None
        runtime.on_shutdown(self.close)
        runtime.watch("rollout-worker", lambda: self.worker.health() if self.worker is not None else None)

    async def _call(self, context, fut: Future, stop: threading.Event | None = None):
        """Await a worker job, mapping failures to gRPC codes with the worker's own message. A caller that goes away
        (cancelled, deadline passed) sets ``stop``: the job stops at its next step instead of running on."""
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if stop is not None:
                stop.set()
            raise
        except WeightsLate as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except (PeerTimeout, TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RemoteError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Stopped as exc:
            await context.abort(grpc.StatusCode.CANCELLED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _require(self, context) -> RolloutWorker:
        if self.worker is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "rollout not configured: call Configure")
        return self.worker

    def _expert(self, config: RunConfig) -> dict | None:
        """The expert checkpoint's state when the algorithm has the expert act in some steps (a beta
        mixture): read under the operator's data roots, checked (magic, digest, format), never unpickled."""
        if not config.collects or config.spec.trajectory(config.algorithm).expert_acts <= 0:
            return None
        from rlfabric.services.learner.checkpoint import CorruptCheckpoint, unpack

        path = getattr(config.algorithm, "expert_checkpoint", "")
        field = "algorithm.expert_checkpoint"
        try:
            return unpack(self.roots.read_bytes(path, field), path)
        except OSError as exc:
            raise ValueError(f"{field}={path!r} cannot be read on the rollout host ({exc.strerror}): the expert acts "
                             f"there too. Fix: a checkpoint file under its --data-root") from None
        except CorruptCheckpoint as exc:
            raise ValueError(f"{field}: {exc}") from None

    async def Configure(self, request, context):
        await check_owner(self.runtime, request.run_id, context)
        try:
            config = RunConfig.from_json(request.config_json)
            info = json.loads(request.context_json or "{}")
            env_spec, peers, fence = info["env_spec"], dict(request.peers), fence_of(info)
            for role in ("env", "replay", "learner"):
                if role not in peers:
                    raise KeyError(f"peers.{role}")
        except (ConfigError, KeyError, ValueError) as exc:  # (a JSONDecodeError is a ValueError)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"Configure needs config_json, context_json.env_spec and peers env/replay/learner: {exc}")
        try:  # the object store its cold start reads and the model it loads: under the operator's roots
            storage, run_dir = confine_storage(config.storage, str(info.get("run_dir") or "."), self.roots,
                                               self.endpoints)
            config = confine_model(config, self.roots).model_copy(update={"storage": storage})
            expert = await asyncio.to_thread(self._expert, config)
        except ValueError as exc:  # PathRefused, EndpointRefused, an unreadable expert checkpoint
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rollout: {exc}")
        self.close()
        base = int(info.get("base_version", 0))
        start = int(info.get("start_iteration", 0))
        shard = info.get("shard") or {}
        try:
            index, envs, offset = int(shard.get("index", 0)), int(shard.get("envs", 0)), int(shard.get("offset", 0))
            if envs < 0 or offset < 0 or offset + envs > config.env.num_envs:
                raise ValueError(f"shard envs [{offset}, {offset + envs}) outside env.num_envs={config.env.num_envs}")
        except (TypeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"context_json.shard is invalid: {exc}. Fix: send "
                                                                  f'{{"index": w, "envs": n, "offset": first_env}}')
        try:
            self.worker = await asyncio.to_thread(RolloutWorker, config, env_spec, peers, base, start, index,
                                                  envs or None, offset, expert, fence)
            stored = await self._call(context, self.worker.submit(self.worker.cold_start, run_dir, request.run_id))
            need = int(info.get("min_version", base + start))  # what its first batch needs (staleness allowing)
            try:
                await asyncio.wrap_future(self.worker.submit(self.worker.sync_weights, need,
                                                             config.data_plane.timeout_s))
            except (PeerTimeout, TimeoutError):
                if stored < need:
                    raise
                log.warning("learner unreachable; serving weight version %d from the object store", stored)
        except (PeerTimeout, RemoteError, TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"rollout could not reach its peers: {exc}")
        except (ValueError, OSError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"rollout cold start failed: {exc}")
        SERVING.set(self.worker.version)
        self.runtime.state = f"busy:{request.run_id}"
        log.info("configured", extra={"run_id": request.run_id, "version": self.worker.version})
        return common_pb2.ConfigureReply(detail_json=json.dumps({"weight_version": self.worker.version}))

    async def Collect(self, request, context):
        worker = await self._require(context)
        stop = threading.Event()
        result = await self._call(context, worker.submit(worker.collect, request.batch_index, request.min_version,
                                                         stop), stop)
        BATCHES.inc()
        SERVING.set(worker.version)
        return _reply(result)

    async def Produce(self, request, context):
        worker = await self._require(context)
        stop = threading.Event()
        self.producing = stop
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def emit(r: CollectResult) -> None:
            loop.call_soon_threadsafe(out.put_nowait, r)

        fut = worker.submit(worker.produce, request.first_batch_index, request.max_batches, request.staleness,
                            emit, stop)
        done = asyncio.wrap_future(fut)
        try:
            while True:
                getter = asyncio.ensure_future(out.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    BATCHES.inc()
                    SERVING.set(worker.version)
                    yield _reply(getter.result())
                    continue
                getter.cancel()
                while not out.empty():
                    yield _reply(out.get_nowait())
                await self._call(context, fut)  # raises the worker's error, if any
                return
        finally:
            stop.set()  # cancelled by the client or finished: the worker discards its in-flight batch

    async def Evaluate(self, request, context):
        worker = await self._require(context)
        if not 0 <= request.episodes <= MAX_EVAL_EPISODES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"episodes must be within [0, {MAX_EVAL_EPISODES}] "
                                                                  f"(0 = train.eval_episodes), got {request.episodes}")
        episodes = request.episodes or worker.config.train.eval_episodes
        seed = request.seed or worker.config.eval_seed()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stop = threading.Event()
        ev = await self._call(context, worker.submit(worker.evaluate, episodes, not request.stochastic, seed, stop),
                              stop)
        return rollout_pb2.EvaluateReply(episodes=episode_stats(ev.returns), weight_version=worker.version,
                                         returns=ev.returns, successes=ev.successes, seconds=loop.time() - t0)

    async def Drain(self, request, context):
        worker = await self._require(context)
        worker.drain_after = request.last_batch_index
        return await self.GetState(request, context)

    async def Probe(self, request, context):
        worker = await self._require(context)
        if not 0 <= request.round_trips <= MAX_PROBE_ROUND_TRIPS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"round_trips must be within "
                                                                  f"[0, {MAX_PROBE_ROUND_TRIPS}], got {request.round_trips}")
        stop = threading.Event()
        rtt, size, local = await self._call(context, worker.submit(worker.probe, request.round_trips or 64, stop),
                                            stop)
        return rollout_pb2.ProbeReply(round_trip_seconds=rtt, payload_bytes=size, in_process=local)

    async def GetState(self, request, context):
        w = self.worker
        if w is None:
            return rollout_pb2.RolloutState(weight_version=-1)
        return rollout_pb2.RolloutState(weight_version=w.version, batches=w.batches, env_steps=w.env_steps,
                                        discarded_batches=w.discarded)

    def close(self) -> None:
        if self.producing is not None:
            self.producing.set()
        if self.worker is not None:
            self.worker.close()
            self.worker = None


async def _build(runtime: ServiceRuntime, args) -> None:
    apply_host_arguments(args)  # collocated plans host the run's env pools (and their files, rewards) here
    service = RolloutService(runtime, DataRoots.parse(args.data_root), Endpoints.parse(args.allow_endpoints))
    rollout_pb2_grpc.add_RolloutServicer_to_server(service, runtime.server)


def main(argv: list[str] | None = None) -> None:
    run_service("rollout", _build, argv, add_host_arguments)


if __name__ == "__main__":
    main()
