"""The learner service's gRPC face. Training runs on one dedicated thread (which also owns the replay client
socket) so the control plane stays responsive while gradients are computed."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import grpc
import numpy as np
import torch
from prometheus_client import Counter, Gauge

from rlfabric.services.core import progress
from rlfabric.services.core.config import ConfigError, RunConfig
from rlfabric.services.core.dataplane import DataClient, PeerTimeout, RemoteError, fence_of
from rlfabric.services.core.devices import resolve_device
from rlfabric.services.core.models import build_policy
from rlfabric.services.core.objectstore import ObjectStore, open_store
from rlfabric.services.core.offload import ModelOffload, state_tensors
from rlfabric.services.core.ownership import check_owner
from rlfabric.services.core.paths import DataRoots, Endpoints, confine_model, confine_storage
from rlfabric.services.core.paths import add_arguments as add_path_arguments
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, learner_pb2, learner_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime, learner_precision, run_service, set_torch_threads
from rlfabric.services.core.weights import WeightPublisher, save_weights
from rlfabric.services.learner import checkpoint as ckpt
from rlfabric.services.learner import warm_start
from rlfabric.services.learner.feeds import UpdateCancelled, feed_for
from rlfabric.services.learner.ranks import (
    RankGroup,
    RankGroupFailed,
    RankHostError,
    initial_policy,
    rank_device,
)
from rlfabric.services.replay.datasets import DatasetError

log = logging.getLogger(__name__)
MAX_TRAIN_WAIT_S = 86_400.0  # the longest a Train call may wait for its data (a day)
UPDATES = Counter("rlfabric_learner_updates_total", "learner updates")
HF_EXPORT_PREFIX = "checkpoints/hf/"  # where the final LM policy lands as a Hugging Face checkpoint directory
VERSION = Gauge("rlfabric_weight_version", "newest published weight version")


def _read_checkpoint(path: str, field: str, roots: DataRoots | None = None) -> dict:
    """A checkpoint file a run spec names: under the worker's data roots (any path without them), a regular file
    within the read bound (paths.PathRefused, a ValueError naming the field, otherwise)."""
    roots = roots if roots is not None else DataRoots.anywhere()
    try:
        data = roots.read_bytes(path, field)
    except OSError as exc:
        raise ValueError(f"{field}={path!r} cannot be read ({exc.strerror}). Fix: give a checkpoint file of a "
                         f"finished run (RUN_DIR/checkpoints/...)") from None
    return ckpt.unpack(data, path)


def _frozen(module: torch.nn.Module) -> torch.nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class LearnerService(learner_pb2_grpc.LearnerServicer):
    def __init__(self, runtime: ServiceRuntime, host: str, torch_threads: int, roots: DataRoots | None = None,
                 endpoints: Endpoints | None = None, rank_hosts: tuple[str, ...] = ()):
        self.runtime = runtime
        self.rank_hosts = rank_hosts  # the operator's: where ranks beyond this host may run
        # where a run spec may have this learner read and write, and which endpoints it may reach (the operator's)
        self.roots = roots if roots is not None else DataRoots.parse(".")
        self.endpoints = endpoints if endpoints is not None else Endpoints.parse("")
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
        self.feed = None
        self.store: ObjectStore | None = None
        self.version = -1
        self.env_spec: dict = {}
        self.device = torch.device("cpu")
        self.offload: ModelOffload | None = None
        self.ranks: RankGroup | None = None  # ranks 1..N-1 when runtime.learner_ranks > 1 (this process is rank 0)
        runtime.on_shutdown(self.close)
        runtime.watch("weights-data-plane", lambda: self.publisher.server.health() if self.publisher else None)
        # a group that failed in Configure is closed at once: its failure stays the health check's until the next
        # Configure builds a group, so the coordinator's probe after the failed call recovers the run
        self.ranks_failed: str | None = None
        runtime.watch("learner-ranks", lambda: self.ranks.dead() if self.ranks else self.ranks_failed)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, progress.run_working, fn, *args)

    def _roles(self, config: RunConfig, env_spec: dict) -> dict[str, torch.nn.Module]:
        """The frozen policies the algorithm's roles ask for: a reference (the initial policy) and an expert (loaded
        from the config's expert_checkpoint)."""
        roles: dict[str, torch.nn.Module] = {}
        spec = config.spec
        needs = spec.needs(config.algorithm)
        if needs.reference:
            roles["reference"] = _frozen(copy.deepcopy(self.policy))
        if needs.expert:
            path = getattr(config.algorithm, "expert_checkpoint", "")
            if not path:
                raise ValueError(f"algorithm {spec.name!r} needs an expert: set algorithm.expert_checkpoint to a "
                                 f"checkpoint file of a run with the same env")
            state = _read_checkpoint(path, "algorithm.expert_checkpoint", self.roots)
            expert_config = RunConfig.from_json(state["config_json"])
            expert = build_policy(expert_config.policy_name, json.loads(state["env_spec_json"]),
                                  expert_config.policy).to(self.device)
            expert.load_state_dict(state["policy"])
            roles["expert"] = _frozen(expert)
        return roles

    def _configure(self, config: RunConfig, env_spec: dict, replay_endpoint: str, run_dir: str,
                   resume: bool, run_id: str, fence: str = "") -> dict:
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        self.ranks_failed = None  # a new Configure, a new group (or none)
        self.device = resolve_device(config.runtime.device)
        storage, run_dir = confine_storage(config.storage, run_dir, self.roots, self.endpoints)
        config = confine_model(config, self.roots)  # (its checkpoints record where the model came from)
        self.store = open_store(storage, run_dir, run_id)
        detail: dict = {}
        state = None
        if resume:
            try:
                key, state, skipped = ckpt.load_latest(self.store)
                detail = {"resumed_from": key, "skipped": skipped,
                          "extra": json.loads(state.get("extra_json", "{}"))}
            except FileNotFoundError:
                if resume != "if_any":  # a recovery (if_any) with no checkpoint yet starts the run over
                    raise
                detail = {"resumed_from": "", "skipped": [], "extra": {}}
        warm = None
        # a warm start (a supervised run's weights), also for a run that resumes or recovers with no checkpoint
        # of its own yet (it starts over, from the same start)
        if config.policy.init_checkpoint and state is None:
            warm = _read_checkpoint(config.policy.init_checkpoint, "policy.init_checkpoint", self.roots)["policy"]
        if config.runtime.learner_ranks > 1:
            self.device = rank_device(self.device, 0)
            self.ranks = RankGroup(config.runtime.learner_ranks, self.device, config.data_plane.timeout_s,
                                   per_host=config.runtime.learner_ranks_per_host, rank_hosts=self.rank_hosts,
                                   host=self.host, advertise_host=self.runtime.options.advertise_host)
            try:
                self.policy, self.algo, self.generator = self.ranks.configure(
                    config, env_spec, state["policy"] if state else warm, state)
            except BaseException as exc:  # a half-configured group is out of step: its ranks go, the error is said
                self.ranks.close()
                self.ranks = None
                if isinstance(exc, RankGroupFailed):
                    self.ranks_failed = f"learner ranks: {exc}"
                raise
        else:
            self._build(config, env_spec, warm)
        if self.replay is not None:
            self.replay.close()
        self.replay = DataClient(replay_endpoint, max_bytes=config.data_plane.max_message_bytes,
                                 timeout_s=config.data_plane.timeout_s, peer="replay", fence=fence)
        self.feed = feed_for(config.spec.data(config.algorithm), self.replay, config.collects, config.env.num_envs)
        if self.publisher is not None and self.publisher_sync != config.weight_sync:
            self.publisher.close()  # a run with other weight-sync options (transport, buckets, deltas)
            self.publisher = None
        if self.publisher is None:
            self.publisher = WeightPublisher(self.host, config.data_plane.max_message_bytes,
                                             self.runtime.advertise_host, sync=config.weight_sync)
            self.publisher_sync = config.weight_sync
        self.config, self.env_spec = config, env_spec
        self.version = 0
        if state is not None:
            self._restore(state)
        weights = self._weights()
        self.publisher.reset(self.version, weights)
        save_weights(self.store, self.version, weights)  # cold starts read it from here
        VERSION.set(self.version)
        target = config.scheduling.offload_target(self.device.type)
        if target is not None:  # learner and rollout take turns: the idle learner's state leaves the device
            self.offload = ModelOffload(lambda: state_tensors(self.policy, self.algo), target, name="learner")
            self.offload.offload()
        return {"weight_version": self.version, "weights_endpoint": self.publisher.endpoint,
                "env_steps": self.algo.env_steps, "optimizer_steps": self.algo.optimizer_steps,
                "device": str(self.device), "learner_ranks": config.runtime.learner_ranks, **detail}

    def _build(self, config: RunConfig, env_spec: dict, warm: dict | None) -> None:
        """One rank: the policy (from a warm start's weights), its frozen roles, the algorithm."""
        spec = config.spec
        self.policy = initial_policy(config, env_spec, self.device, warm)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed + 7)
        self.algo = spec(self.policy, config, self.generator, env_spec=env_spec, **self._roles(config, env_spec))

    def _weights(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (gathered from every rank's shards on a multi-rank learner)."""
        return self.ranks.weights(self.policy) if self.ranks is not None else self.policy.state_dict()

    def _restore(self, state: dict) -> None:
        if self.ranks is None:  # a rank group restored policy, optimiser and generator while it was built
            self.policy.load_state_dict(state["policy"])
            self.algo.load_state_dict(state["algorithm"])
            self.generator.set_state(state["generator"])
        self.version = int(state["weight_version"])
        torch.set_rng_state(state["torch_rng"])
        pos, has_gauss, cached = state["numpy_rng_pos"].tolist()
        np.random.set_state(("MT19937", state["numpy_rng"].numpy().astype(np.uint32), int(pos), int(has_gauss),
                             float(cached)))

    async def Configure(self, request, context):
        await check_owner(self.runtime, request.run_id, context)
        try:
            config = RunConfig.from_json(request.config_json)
            context_info = json.loads(request.context_json or "{}")
            env_spec = context_info["env_spec"]
            replay_endpoint = request.peers["replay"]
            fence = fence_of(context_info)
        except (ConfigError, KeyError, ValueError) as exc:  # (a JSONDecodeError is a ValueError)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"Configure needs config_json, context_json.env_spec and peers.replay: {exc}")
        set_torch_threads(config.runtime.torch_threads)
        try:
            detail = await self._run(self._configure, config, env_spec, replay_endpoint,
                                     context_info.get("run_dir", "."), context_info.get("resume") or False,
                                     request.run_id, fence)
        except FileNotFoundError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot resume: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RankHostError as exc:  # a rank host the spec's learner_ranks_per_host needs
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except RankGroupFailed as exc:  # the new group's first collective (the weights' broadcast) failed
            await self._rank_group_failed(context, exc)
        except OSError as exc:  # the host's: a run directory that is a file, no permission, a full disk
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the learner's host refused {exc.filename or 'a path'!s}: {exc.strerror or exc}. "
                                f"Fix: point the run directory and storage.root at directories this learner can "
                                f"write")
        for reason in detail.get("skipped", []):
            log.warning("skipped checkpoint", extra={"reason": reason})
        self.runtime.state = f"busy:{request.run_id}"
        log.info("configured", extra={"run_id": request.run_id, "version": self.version,
                                      "resumed_from": detail.get("resumed_from", "")})
        return common_pb2.ConfigureReply(data_endpoint=detail["weights_endpoint"], detail_json=json.dumps(detail))

    def _train(self, batch_index: int, min_version: int, timeout_s: float,
               cancelled: threading.Event | None = None) -> learner_pb2.TrainReply:
        t0 = time.perf_counter()
        # what the algorithm's data access gives for this iteration: the on-policy batch, or the minibatches it
        # owes sampled from the window (None before it owes any)
        fed = self.feed.next(self.algo, batch_index, min_version, timeout_s, cancelled)
        batch = fed.batch
        waited = time.perf_counter() - t0
        if self.offload is not None:
            self.offload.onload()
        u0 = time.perf_counter()
        stats = {}
        self.algo.weight_version = self.version  # the version the update starts from (for version lags)
        if batch is not None:
            with learner_precision(self.config.runtime.precision, self.device):
                if self.ranks is not None:  # every rank takes its share of each minibatch
                    stats = self.ranks.update(self.algo, batch)
                else:
                    stats = self.algo.update(batch.to_torch(self.device, pin=self.device.type == "cuda"))
            if "update" in batch.dims:
                stats["updates"] = batch.sizes()["update"]
        stats["update_seconds"] = time.perf_counter() - u0
        self.version += 1
        p0 = time.perf_counter()
        self.publisher.publish(self.version, self._weights())
        stats["publish_seconds"] = time.perf_counter() - p0
        if self.offload is not None:  # the rollout's turn: free what the update used
            stats["offload_bytes"] = self.offload.offload()
            stats["onload_seconds"] = self.offload.onload_seconds
            stats["offload_seconds"] = self.offload.offload_seconds
        UPDATES.inc()
        VERSION.set(self.version)
        return learner_pb2.TrainReply(
            weight_version=self.version, batch_version=fed.version if fed.version >= 0 else self.version - 1,
            env_steps=self.algo.env_steps, optimizer_steps=self.algo.optimizer_steps,
            stats={k: float(v) for k, v in stats.items()}, train_seconds=time.perf_counter() - t0 - waited,
            wait_seconds=waited)

    async def Train(self, request, context):
        if self.algo is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "learner not configured: call Configure")
        if not (math.isfinite(request.timeout_s) and 0 <= request.timeout_s <= MAX_TRAIN_WAIT_S):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be within [0, {MAX_TRAIN_WAIT_S:g}] "
                                                                  f"(0 = data_plane.timeout_s), got {request.timeout_s}")
        if request.batch_index < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"batch_index must be >= 0 (the iteration to train), got {request.batch_index}")
        timeout = request.timeout_s or self.config.data_plane.timeout_s
        cancelled = threading.Event()
        try:
            return await self._run(self._train, request.batch_index, request.min_version, timeout, cancelled)
        except asyncio.CancelledError:  # the caller went away: stop waiting for its shards (the thread ends)
            cancelled.set()
            raise
        except UpdateCancelled as exc:
            await context.abort(grpc.StatusCode.CANCELLED, str(exc))
        except PeerTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except RemoteError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replay refused: {exc}")
        except RankGroupFailed as exc:
            await self._rank_group_failed(context, exc)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad trajectory batch: {exc}")

    def _checkpoint(self, key: str, extra_json: str, periodic: bool) -> learner_pb2.CheckpointReply:
        with self.offload.onloaded() if self.offload is not None else nullcontext():
            return self._write_checkpoint(key, extra_json, periodic)

    def _export_hf(self, weights: dict[str, torch.Tensor]) -> None:
        """The final policy as a Hugging Face checkpoint directory under ``checkpoints/hf/`` of the run's object
        store (model with LoRA merged, tokenizer with its chat template, generation config): it opens in plain
        transformers and vLLM, and as ``policy.lm.path`` of a next run. Written to a temporary directory, then
        each file put into the store (which may be S3)."""
        import tempfile
        from pathlib import Path

        policy = self.policy
        if self.ranks is not None:  # sharded: a plain host copy of the gathered weights
            policy = build_policy(self.config.policy_name, self.env_spec, self.config.policy)
            policy.load_state_dict(weights)
        with tempfile.TemporaryDirectory(prefix="rlfabric-hf-") as tmp:
            policy.save_pretrained(tmp)
            for file in sorted(Path(tmp).rglob("*")):
                if file.is_file():
                    self.store.put_bytes(f"{HF_EXPORT_PREFIX}{file.relative_to(tmp).as_posix()}", file.read_bytes())

    def _write_checkpoint(self, key: str, extra_json: str, periodic: bool) -> learner_pb2.CheckpointReply:
        """The run's state under ``key`` (periodic checkpoints pruned to checkpoint.keep). The final checkpoint
        (train.checkpoint_key) of an LM policy also exports the policy as a Hugging Face directory under
        ``checkpoints/hf/`` (see _export_hf)."""
        # the coordinator's state rides in the checkpoint and is read back on resume: refuse what could not be
        try:
            extra = json.loads(extra_json or "{}")
        except ValueError as exc:
            raise ValueError(f"extra_json is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("extra_json must be a JSON object (the coordinator's run state)")
        np_state = np.random.get_state()
        weights = self._weights()
        state = {
            "config_json": self.config.redacted().to_json(),  # (a checkpoint is a file: no S3 key, no password)
            "env_spec_json": json.dumps(self.env_spec),
            "extra_json": extra_json or "{}",
            "policy": weights,
            "algorithm": self.ranks.algorithm_state(self.policy, self.algo) if self.ranks else self.algo.state_dict(),
            "weight_version": self.version,
            "torch_rng": torch.get_rng_state(),
            "generator": self.generator.get_state(),
            "numpy_rng": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_rng_pos": torch.tensor(list(np_state[2:4]) + [float(np_state[4])], dtype=torch.float64, device="cpu"),
        }
        key = key or ckpt.periodic_key(self.version)
        data = ckpt.pack(state)
        uri = self.store.put_bytes(key, data)
        save_weights(self.store, self.version, weights)
        if key == self.config.train.checkpoint_key and hasattr(self.policy, "save_pretrained"):
            self._export_hf(weights)
        if periodic:
            for old in ckpt.prune(self.store, self.config.checkpoint.keep):
                log.info("pruned checkpoint", extra={"key": old})
        return learner_pb2.CheckpointReply(uri=uri, bytes=len(data), weight_version=self.version)

    async def SaveCheckpoint(self, request, context):
        if self.algo is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "learner not configured: call Configure")
        try:
            return await self._run(self._checkpoint, request.key, request.extra_json, request.periodic)
        except ValueError as exc:  # the request's own fault (a key outside the store, extra_json not JSON)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"checkpoint refused: {exc}")
        except OSError as exc:  # the store's (a full disk, a lost bucket): the run's checkpoint did not happen
            await context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {exc}")
        except RankGroupFailed as exc:  # (gathering the sharded state is a collective)
            await self._rank_group_failed(context, exc)

    async def _rank_group_failed(self, context, exc: RankGroupFailed) -> None:
        """A rank group spanning hosts is out of step for good: the health check turns NOT_SERVING (until a
        Configure builds a new group) before the caller hears of it, so the coordinator, probing after a failed
        call, recovers the run onto this learner."""
        self.runtime.check_components()
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"learner ranks: {exc}")

    async def GetState(self, request, context):
        return learner_pb2.LearnerState(
            weight_version=self.version, optimizer_steps=getattr(self.algo, "optimizer_steps", 0),
            env_steps=getattr(self.algo, "env_steps", 0),
            algorithm=self.config.algorithm.name if self.config else "")

    async def WarmStart(self, request, context):
        """One warm_start stage of the run that holds this learner (services/learner/warm_start.py), on the
        learner's thread: its heartbeats show the stage's compute, so a long stage is never taken for a wedged one."""
        await check_owner(self.runtime, request.run_id, context)
        try:
            config = RunConfig.from_json(request.config_json)
            run_dir = self.roots.confine(request.run_dir or ".", "run_dir (the run directory)")
            config = confine_model(config, self.roots)
        except (ConfigError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"WarmStart: {exc}")
        set_torch_threads(config.runtime.torch_threads)
        self.runtime.state = f"busy:{request.run_id}"
        try:
            done = await self._run(warm_start.run_stage, request.stage, config, run_dir, self.roots)
        except (ValueError, DatasetError) as exc:  # the spec's (an env without an expert, a data set's format)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"warm_start.{request.stage}: {exc}")
        except OSError as exc:  # the host's: no permission, a full disk
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"warm_start.{request.stage}: the learner's host refused {exc.filename or 'a path'!s}:"
                                f" {exc.strerror or exc}. Fix: a run directory this learner can write")
        finally:
            self.runtime.state = "idle"
        log.info("warm start stage", extra={"run_id": request.run_id, "stage": request.stage, "path": str(done.path),
                                            "kept": done.kept})
        return learner_pb2.WarmStartReply(path=str(done.path), summary=done.summary, kept=done.kept)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.offload is not None:
            self.offload.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


async def _build(runtime: ServiceRuntime, args) -> None:
    if args.rank_host_for:
        from rlfabric.services.learner import rank_host

        await rank_host.build(runtime, args.rank_host_for)
        return
    service = LearnerService(runtime, args.host, args.torch_threads, DataRoots.parse(args.data_root),
                             Endpoints.parse(args.allow_endpoints),
                             tuple(a.strip() for a in args.rank_hosts.split(",") if a.strip()))
    learner_pb2_grpc.add_LearnerServicer_to_server(service, runtime.server)


def _arguments(parser) -> None:
    add_path_arguments(parser)
    parser.add_argument("--rank-hosts", default="",
                        help="HOST:PORT of rank hosts, comma-separated, in rank order: where a run's learner ranks "
                             "beyond this host go (runtime.learner_ranks_per_host; services/learner/ranks.py)")
    parser.add_argument("--rank-host-for", default="", metavar="LEARNER",
                        help="serve as a rank host for the learner at LEARNER (its host name or address) instead "
                             "of as a learner: no coordinator, only that learner's ranks")


def main(argv: list[str] | None = None) -> None:
    run_service("learner", _build, argv, _arguments)


if __name__ == "__main__":
    main()
