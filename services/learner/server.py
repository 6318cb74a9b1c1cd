"""The learner service's gRPC face. Training runs on one dedicated thread (which also owns the replay client
socket) so the control plane stays responsive while gradients are computed."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import grpc
import numpy as np
import torch
from prometheus_client import Counter, Gauge

from services.core.batch import TensorBatch
from services.core.config import ConfigError, RunConfig
from services.core.dataplane import DataClient, PeerTimeout, RemoteError
from services.core.objectstore import ObjectStore, open_store
from services.core.offload import ModelOffload, state_tensors
from services.core.proto.rlfabric.v1 import common_pb2, learner_pb2, learner_pb2_grpc
from services.core.runtime import ServiceRuntime, run_service, set_torch_threads
from services.core.weights import WeightPublisher, save_weights
from services.learner import algorithms
from services.learner import checkpoint as ckpt

log = logging.getLogger(__name__)
UPDATES = Counter("rlfabric_learner_updates_total", "learner updates")
VERSION = Gauge("rlfabric_weight_version", "newest published weight version")

def build_policy(config: RunConfig, env_spec: dict) -> torch.nn.Module:
    from services.core.actor import build_policy as policy_for

    return policy_for(config, env_spec)


class LearnerService(learner_pb2_grpc.LearnerServicer):
    def __init__(self, runtime: ServiceRuntime, host: str, torch_threads: int):
        self.runtime = runtime
        self.host = host
        self.torch_threads = torch_threads
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        self.executor.submit(set_torch_threads, torch_threads).result()
        self.config: RunConfig | None = None
        self.algo = None
        self.policy: torch.nn.Module | None = None
        self.publisher: WeightPublisher | None = None
        self.publisher_sync = None
        self.replay: DataClient | None = None
        self.store: ObjectStore | None = None
        self.version = -1
        self.env_spec: dict = {}
        self.offload: ModelOffload | None = None
        runtime.on_shutdown(self.close)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _configure(self, config: RunConfig, env_spec: dict, replay_endpoint: str, run_dir: str,
                   resume: bool, run_id: str) -> dict:
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        self.policy = build_policy(config, env_spec)
        self.generator = torch.Generator().manual_seed(config.seed + 7)
        self.algo = algorithms.build(config.algorithm.name, self.policy, config, self.generator)
        if self.replay is not None:
            self.replay.close()
        self.replay = DataClient(replay_endpoint, max_bytes=config.data_plane.max_message_bytes,
                                 timeout_s=config.data_plane.timeout_s, peer="replay")
        if self.publisher is not None and self.publisher_sync != config.weight_sync:
            self.publisher.close()  # a run with other weight-sync options (transport, buckets, deltas)
            self.publisher = None
        if self.publisher is None:
            self.publisher = WeightPublisher(self.host, config.data_plane.max_message_bytes,
                                             self.runtime.advertise_host, sync=config.weight_sync)
            self.publisher_sync = config.weight_sync
        self.store = open_store(config.storage, run_dir, run_id)
        self.config, self.env_spec = config, env_spec
        self.held: dict[int, list[TensorBatch]] = {}  # shards of later updates, taken early (see _take_batch)
        detail: dict = {}
        self.version = 0
        if resume:
            key, state, skipped = ckpt.load_latest(self.store)
            self._restore(state)
            detail = {"resumed_from": key, "skipped": skipped, "extra": json.loads(state.get("extra_json", "{}"))}
        self.publisher.reset(self.version, self.policy.state_dict())
        save_weights(self.store, self.version, self.policy.state_dict())  # cold starts read it from here
        VERSION.set(self.version)
        target = config.scheduling.offload_target(config.runtime.device)
        if target is not None:  # learner and rollout take turns: the idle learner's state leaves the device
            self.offload = ModelOffload(lambda: state_tensors(self.policy, self.algo), target, name="learner")
            self.offload.offload()
        return {"weight_version": self.version, "weights_endpoint": self.publisher.endpoint,
                "env_steps": self.algo.env_steps, "optimizer_steps": self.algo.optimizer_steps, **detail}

    def _restore(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.algo.load_state_dict(state["algorithm"])
        self.version = int(state["weight_version"])
        torch.set_rng_state(state["torch_rng"])
        self.generator.set_state(state["generator"])
        pos, has_gauss, cached = state["numpy_rng_pos"].tolist()
        np.random.set_state(("MT19937", state["numpy_rng"].numpy().astype(np.uint32), int(pos), int(has_gauss),
                             float(cached)))

    async def Configure(self, request, context):
        try:
            config = RunConfig.from_json(request.config_json)
            context_info = json.loads(request.context_json or "{}")
            env_spec = context_info["env_spec"]
            replay_endpoint = request.peers["replay"]
        except (ConfigError, KeyError, json.JSONDecodeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"Configure needs config_json, context_json.env_spec and peers.replay: {exc}")
        set_torch_threads(config.runtime.torch_threads)
        try:
            detail = await self._run(self._configure, config, env_spec, replay_endpoint,
                                     context_info.get("run_dir", "."), bool(context_info.get("resume")),
                                     request.run_id)
        except FileNotFoundError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot resume: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        for reason in detail.get("skipped", []):
            log.warning("skipped checkpoint", extra={"reason": reason})
        self.runtime.state = f"busy:{request.run_id}"
        log.info("configured", extra={"run_id": request.run_id, "version": self.version,
                                      "resumed_from": detail.get("resumed_from", "")})
        return common_pb2.ConfigureReply(data_endpoint=detail["weights_endpoint"], detail_json=json.dumps(detail))

    def _take_batch(self, batch_index: int, min_version: int, timeout_s: float) -> TensorBatch:
        """Update ``batch_index``'s batch: the shards of that index (one per rollout worker, each [T, n_w, ...],
        every one at least ``min_version``), joined along the env axis once they hold env.num_envs envs.
        Shards arrive FIFO from replay; one of a later index (a worker running ahead within the staleness bound)
        is held for its own update; one of an earlier index (left over from before a re-plan) is dropped."""
        deadline = time.monotonic() + timeout_s
        shards = self.held.pop(batch_index, [])
        envs = sum(int(b.tensors["rewards"].shape[1]) for b in shards)
        while envs < self.config.env.num_envs:
            wait = max(0.0, deadline - time.monotonic())
            kind, shard = self.replay.request("get", TensorBatch(meta={"min_version": min_version, "wait_s": wait}),
                                              timeout_s=wait + 5)
            if kind != "batch":
                raise PeerTimeout(f"no trajectory batch with version >= {min_version} arrived in replay within "
                                  f"{timeout_s:.1f}s (have {envs} of {self.config.env.num_envs} envs of batch "
                                  f"{batch_index}); is the rollout service producing?")
            index = int(shard.meta.get("batch_index", batch_index))
            if index > batch_index:
                self.held.setdefault(index, []).append(shard)
                continue
            if index < batch_index:
                log.warning("dropped a shard of batch %d arriving at update %d", index, batch_index)
                continue
            shards.append(shard)
            envs += int(shard.tensors["rewards"].shape[1])
        if len(shards) == 1:
            return shards[0]
        shards.sort(key=lambda b: int(b.meta.get("env_offset", 0)))
        tensors = {k: np.concatenate([b.tensors[k] for b in shards], axis=0 if shards[0].tensors[k].ndim == 1 else 1)
                   for k in shards[0].tensors}
        meta = {"env_steps": sum(int(b.meta.get("env_steps", 0)) for b in shards), "shards": len(shards),
                "batch_index": batch_index}
        return TensorBatch(tensors, meta=meta, version=min(b.version for b in shards))

    def _sample_minibatches(self, timeout_s: float) -> TensorBatch | None:
        """Off-policy: the gradient steps this epoch owes, as [U, B] minibatches sampled uniformly from the replay
        window in one request (None before learning_starts)."""
        updates = self.algo.updates_for(self.config.batch_env_steps())
        if updates == 0:
            return None
        B = self.config.algorithm.sac.batch_size
        kind, batch = self.replay.request("sample", TensorBatch(meta={"n": updates * B}), timeout_s=timeout_s + 5)
        if kind != "batch":
            raise PeerTimeout(f"replay answered {kind!r} to a sample of {updates * B} transitions")
        tensors = {k: v.reshape(updates, B, *v.shape[1:]) for k, v in batch.tensors.items()
                   if k in ("obs", "actions", "rewards", "next_obs", "terminated")}
        return TensorBatch(tensors, meta={"updates": updates}, version=batch.version)

    def _train(self, batch_index: int, min_version: int, timeout_s: float) -> learner_pb2.TrainReply:
        t0 = time.perf_counter()
        # the epoch's shards: on-policy they are the update's batch; off-policy taking them only confirms the
        # epoch's data is stored (and leaves the FIFO empty), then the update samples the whole window
        batch = self._take_batch(batch_index, min_version, timeout_s)
        waited = time.perf_counter() - t0
        if self.offload is not None:
            self.offload.onload()
        u0 = time.perf_counter()
        if getattr(self.algo, "off_policy", False):
            sampled = self._sample_minibatches(timeout_s)
            stats = self.algo.update(sampled.to_torch()) if sampled is not None else {}
            stats["updates"] = sampled.meta["updates"] if sampled is not None else 0
        else:
            stats = self.algo.update(batch.to_torch())
        stats["update_seconds"] = time.perf_counter() - u0
        self.version += 1
        p0 = time.perf_counter()
        self.publisher.publish(self.version, self.policy.state_dict())
        stats["publish_seconds"] = time.perf_counter() - p0
        if self.offload is not None:  # the rollout's turn: free what the update used
            stats["offload_bytes"] = self.offload.offload()
            stats["onload_seconds"] = self.offload.onload_seconds
            stats["offload_seconds"] = self.offload.offload_seconds
        UPDATES.inc()
        VERSION.set(self.version)
        return learner_pb2.TrainReply(
            weight_version=self.version, batch_version=batch.version, env_steps=self.algo.env_steps,
            optimizer_steps=self.algo.optimizer_steps, stats={k: float(v) for k, v in stats.items()},
            train_seconds=time.perf_counter() - t0 - waited, wait_seconds=waited)

    async def Train(self, request, context):
        if self.algo is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "learner not configured: call Configure")
        timeout = request.timeout_s or self.config.data_plane.timeout_s
        try:
            return await self._run(self._train, request.batch_index, request.min_version, timeout)
        except PeerTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except RemoteError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replay refused: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad trajectory batch: {exc}")

    def _checkpoint(self, key: str, extra_json: str, periodic: bool) -> learner_pb2.CheckpointReply:
        with self.offload.onloaded() if self.offload is not None else nullcontext():
            return self._write_checkpoint(key, extra_json, periodic)

    def _write_checkpoint(self, key: str, extra_json: str, periodic: bool) -> learner_pb2.CheckpointReply:
        np_state = np.random.get_state()
        state = {
            "config_json": self.config.to_json(),
            "env_spec_json": json.dumps(self.env_spec),
            "extra_json": extra_json or "{}",
            "policy": self.policy.state_dict(),
            "algorithm": self.algo.state_dict(),
            "weight_version": self.version,
            "torch_rng": torch.get_rng_state(),
            "generator": self.generator.get_state(),
            "numpy_rng": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_rng_pos": torch.tensor(list(np_state[2:4]) + [float(np_state[4])], dtype=torch.float64),
        }
        key = key or ckpt.periodic_key(self.version)
        data = ckpt.pack(state)
        uri = self.store.put_bytes(key, data)
        save_weights(self.store, self.version, self.policy.state_dict())
        if periodic:
            for old in ckpt.prune(self.store, self.config.checkpoint.keep):
                log.info("pruned checkpoint", extra={"key": old})
        return learner_pb2.CheckpointReply(uri=uri, bytes=len(data), weight_version=self.version)

    async def SaveCheckpoint(self, request, context):
        if self.algo is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "learner not configured: call Configure")
        try:
            return await self._run(self._checkpoint, request.key, request.extra_json, request.periodic)
        except (ValueError, OSError) as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {exc}")

    async def GetState(self, request, context):
        return learner_pb2.LearnerState(
            weight_version=self.version, optimizer_steps=getattr(self.algo, "optimizer_steps", 0),
            env_steps=getattr(self.algo, "env_steps", 0),
            algorithm=self.config.algorithm.name if self.config else "")

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.offload is not None:
            self.offload.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


async def _build(runtime: ServiceRuntime, args) -> None:
    learner_pb2_grpc.add_LearnerServicer_to_server(LearnerService(runtime, args.host, args.torch_threads),
                                                   runtime.server)


def main(argv: list[str] | None = None) -> None:
    run_service("learner", _build, argv)


if __name__ == "__main__":
    main()
