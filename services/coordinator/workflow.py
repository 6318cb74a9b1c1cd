"""The PPO macro workflow, written once as plain code:

    rollout (env <-> policy) -> advantages -> train -> publish weights (epoch N+1)

and executed under one of two plans:
  collocated     stages take turns: Collect batch i with version N, Train on it, repeat.
  disaggregated  the rollout produces a stream of batches (env chunks pipelined against inference) while the
                 learner trains; batch i uses a version >= i - staleness (0 = strictly on-policy).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.coordinator.registry import Worker
from services.coordinator.run import Run, RunFailed, StopRequested
from services.coordinator.runlog import RunLog
from services.core.proto.rlfabric.v1 import (
    common_pb2,
    env_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    replay_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from services.core.runtime import channel

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """A worker taking part in a run and the stub the coordinator drives it with."""

    worker: Worker
    channel: grpc.aio.Channel
    stub: object


async def rpc(stage: Stage, method: str, request, timeout: float | None = None):
    """Call a worker; any failure becomes a RunFailed that names the worker, the call and the cause."""
    try:
        return await getattr(stage.stub, method)(request, timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        detail = exc.details() or exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE and not await healthy(stage):
            # its control plane is gone: never place work on it again (if it lives, its next heartbeat is
            # refused and it registers anew); a live worker reporting an unreachable peer stays placeable
            stage.worker.alive = False
        raise RunFailed(f"{stage.worker.describe()}: {method} failed: {detail}",
                        bad_input=exc.code() == grpc.StatusCode.INVALID_ARGUMENT) from None


async def healthy(stage: Stage, timeout_s: float = 1.0) -> bool:
    """The worker's standard gRPC health service answers SERVING."""
    try:
        reply = await health_pb2_grpc.HealthStub(stage.channel).Check(health_pb2.HealthCheckRequest(),
                                                                      timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


STUBS = {
    "env": env_pb2_grpc.EnvStub, "replay": replay_pb2_grpc.ReplayStub,
    "learner": learner_pb2_grpc.LearnerStub, "rollout": rollout_pb2_grpc.RolloutStub,
}


class PPOWorkflow:
    roles = ("env", "replay", "learner", "rollout")

    def __init__(self, run: Run, workers: dict[str, Worker], resume: bool = False):
        self.run = run
        self.cfg = run.config
        self.resume = resume
        self.start = 0  # first iteration to run (> 0 when resumed from a checkpoint)
        self.stages = {}
        for role, w in workers.items():
            ch = channel(w.grpc)
            self.stages[role] = Stage(w, ch, STUBS[role](ch))
        self.recent_returns: deque[float] = deque(maxlen=100)
        self.runlog: RunLog | None = None
        self.t0 = time.time()
        self.best_eval = -math.inf

    async def close(self) -> None:
        for s in self.stages.values():
            await s.channel.close()
        if self.runlog is not None:
            await asyncio.to_thread(self.runlog.close)

    async def configure(self) -> None:
        cfg, run = self.cfg, self.run
        req = dict(run_id=run.run_id, config_json=cfg.to_json())
        env = await rpc(self.stages["env"], "Configure", common_pb2.ConfigureRequest(**req), 120)
        env_spec = json.loads(env.detail_json)
        ctx = {"env_spec": env_spec, "run_dir": str(run.run_dir.resolve())}
        replay = await rpc(self.stages["replay"], "Configure",
                           common_pb2.ConfigureRequest(**req, context_json=json.dumps(ctx)), 60)
        # On-policy data is only valid for the policy lineage that produced it: a persistent store (Redis) may
        # still hold batches from before a crash, produced after the checkpoint we resume from. Discard them.
        before = await rpc(self.stages["replay"], "GetStats", common_pb2.Empty(), 30)
        if before.batches:
            await rpc(self.stages["replay"], "Clear", common_pb2.Empty(), 30)
            run.log(f"discarded {before.batches} replay batches ({before.pending_onpolicy} unconsumed) left from "
                    f"before this {'resume' if self.resume else 'run'}: on-policy data from another policy lineage",
                    level="warning")
        learner = await rpc(self.stages["learner"], "Configure", common_pb2.ConfigureRequest(
            **req, peers={"replay": replay.data_endpoint}, context_json=json.dumps({**ctx, "resume": self.resume})),
            120)
        detail = json.loads(learner.detail_json)
        self.base_version = detail["weight_version"]
        if self.resume:
            self._restore(detail)
        self.runlog = await asyncio.to_thread(RunLog, run.run_dir, cfg, self.start if self.resume else None,
                                              run.env_steps)
        await rpc(self.stages["rollout"], "Configure", common_pb2.ConfigureRequest(
            **req, peers={"env": env.data_endpoint, "replay": replay.data_endpoint,
                          "learner": learner.data_endpoint},
            context_json=json.dumps({**ctx, "base_version": self.base_version, "start_iteration": self.start})), 120)
        run.log(f"configured {env_spec['env_id']} x{env_spec['num_envs']} "
                f"(obs {env_spec['observation_space']['shape']}, actions {env_spec['action_space']['kind']}); "
                f"plan {cfg.scheduling.mode}, chunks {cfg.scheduling.chunks()}, "
                f"staleness {cfg.scheduling.effective_staleness()}, env pool in "
                f"{'the rollout worker' if cfg.scheduling.env_in_rollout() else 'the env service'}")

    def _restore(self, detail: dict) -> None:
        """Continue where the checkpoint was: iteration, env steps, versions, returns history, wall clock."""
        extra = detail.get("extra", {})
        version = detail["weight_version"]
        self.base_version = int(extra.get("base_version", 0))
        self.start = version - self.base_version
        self.run.env_steps = int(detail.get("env_steps", 0))
        self.run.weight_version = self.start
        self.recent_returns.extend(extra.get("recent_returns", []))
        best = extra.get("best_eval")
        self.best_eval = -math.inf if best is None else float(best)
        self.t0 = time.time() - float(extra.get("wall_time_s", 0.0))
        for reason in detail.get("skipped", []):
            self.run.log(f"skipped checkpoint {reason}; using an older one", level="warning")
        self.run.log(f"resumed from {detail['resumed_from']} at iteration {self.start}, "
                     f"{self.run.env_steps} env steps, weight version {self.start}, "
                     f"{detail.get('optimizer_steps', 0)} optimiser steps")

    async def save_checkpoint(self, key: str = "", periodic: bool = True) -> learner_pb2.CheckpointReply:
        extra = {"base_version": self.base_version, "recent_returns": list(self.recent_returns),
                 "best_eval": self.best_eval if self.best_eval > -math.inf else None,
                 "wall_time_s": time.time() - self.t0}
        reply = await rpc(self.stages["learner"], "SaveCheckpoint", learner_pb2.CheckpointRequest(
            key=key, extra_json=json.dumps(extra), periodic=periodic), 120)
        self.run.log(f"checkpoint {reply.uri} ({reply.bytes} bytes, weight version "
                     f"{reply.weight_version - self.base_version})")
        return reply

    async def finish_iteration(self, i: int, n_iters: int, c: rollout_pb2.CollectReply,
                               t: learner_pb2.TrainReply) -> bool:
        """Every plan ends an iteration alike: evaluate when due, record, checkpoint when due, and honour a stop
        here (the one place it takes effect, so no update goes unrecorded). True once the target is reached."""
        ev = await self.evaluate() if self.eval_due(i, n_iters) else None
        self.record(i, c, t, ev)
        if self.reached(ev):
            return True
        if self.checkpoint_due(i, n_iters):
            await self.save_checkpoint()
        if self.run.stop_requested.is_set():
            raise StopRequested()
        return False

    def checkpoint_due(self, i: int, n_iters: int) -> bool:
        every = self.cfg.checkpoint.every_iterations
        return every > 0 and (i + 1) % every == 0 and i + 1 < n_iters

    async def evaluate(self) -> rollout_pb2.EvaluateReply:
        return await rpc(self.stages["rollout"], "Evaluate",
                         rollout_pb2.EvaluateRequest(episodes=self.cfg.train.eval_episodes))

    def record(self, i: int, c: rollout_pb2.CollectReply, t: learner_pb2.TrainReply,
               ev: rollout_pb2.EvaluateReply | None) -> None:
        self.recent_returns.extend(c.episode_returns)
        run = self.run
        wall = time.time() - self.t0
        env_steps = run.env_steps + c.env_steps
        row: dict[str, float] = {
            "iteration": i + 1, "env_steps": env_steps, "wall_time_s": wall,
            "weight_version": t.weight_version - self.base_version,
            "batch_version": t.batch_version - self.base_version,
            "train_episodes": len(c.episode_returns), "optimizer_steps": t.optimizer_steps,
            "fps": c.env_steps / max(c.collect_seconds + t.train_seconds, 1e-9),
            "collect_seconds": c.collect_seconds, "train_seconds": t.train_seconds,
            "env_seconds": c.env_seconds, "policy_seconds": c.policy_seconds,
            "weight_wait_seconds": c.weight_wait_seconds, "train_wait_seconds": t.wait_seconds,
            **dict(t.stats),
        }
        if self.recent_returns:
            row["train_return_mean"] = sum(self.recent_returns) / len(self.recent_returns)
        if ev is not None:
            row["eval_return_mean"] = ev.episodes.return_mean
            row["eval_return_std"] = ev.episodes.return_std
            row["eval_weight_version"] = ev.weight_version - self.base_version
            self.best_eval = max(self.best_eval, ev.episodes.return_mean)
        self.runlog.write(row)
        run.metrics(row)

    def eval_due(self, i: int, n_iters: int) -> bool:
        every = self.cfg.train.eval_every_iterations
        return i + 1 == n_iters or (every > 0 and (i + 1) % every == 0)

    def reached(self, ev: rollout_pb2.EvaluateReply | None) -> bool:
        target = self.cfg.train.stop_at_eval_return
        return ev is not None and target is not None and ev.episodes.return_mean >= target

    async def execute(self) -> str:
        await self.configure()
        n_iters = math.ceil(self.cfg.train.total_env_steps / self.cfg.batch_env_steps())
        if self.start >= n_iters:
            raise RunFailed(f"nothing to resume: the checkpoint is at iteration {self.start} of {n_iters}", True)
        if self.cfg.scheduling.mode == "collocated":
            summary = await self._collocated(n_iters)
        else:
            summary = await self._disaggregated(n_iters)
        await self.save_checkpoint(self.cfg.train.checkpoint_key, periodic=False)
        return summary

    def _summary(self, stopped_early: bool) -> str:
        best = f"best eval mean return {self.best_eval:.1f}" if self.best_eval > -math.inf else "no eval"
        target = self.cfg.train.stop_at_eval_return
        if stopped_early:
            return f"reached eval return >= {target:g} at {self.run.env_steps} env steps ({best})"
        return f"finished {self.run.env_steps} env steps ({best})"

    async def _collocated(self, n_iters: int) -> str:
        learner, rollout = self.stages["learner"], self.stages["rollout"]
        for i in range(self.start, n_iters):
            version = self.base_version + i
            c = await rpc(rollout, "Collect", rollout_pb2.CollectRequest(batch_index=i, min_version=version))
            t = await rpc(learner, "Train", learner_pb2.TrainRequest(batch_index=i, min_version=version))
            if await self.finish_iteration(i, n_iters, c, t):
                return self._summary(True)
        return self._summary(False)

    async def _disaggregated(self, n_iters: int) -> str:
        learner, rollout = self.stages["learner"], self.stages["rollout"]
        k = self.cfg.scheduling.staleness
        call = rollout.stub.Produce(rollout_pb2.ProduceRequest(first_batch_index=self.start,
                                                               max_batches=n_iters - self.start, staleness=k))
        collected: dict[int, rollout_pb2.CollectReply] = {}
        arrived = asyncio.Event()
        failure: list[RunFailed] = []

        async def consume() -> None:
            try:
                async for reply in call:
                    collected[reply.batch_index] = reply
                    arrived.set()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    failure.append(RunFailed(f"{rollout.worker.describe()}: Produce failed: {exc.details()}",
                                             exc.code() == grpc.StatusCode.INVALID_ARGUMENT))
            arrived.set()

        consumer = asyncio.create_task(consume())
        try:
            for i in range(self.start, n_iters):
                train = asyncio.create_task(rpc(learner, "Train", learner_pb2.TrainRequest(
                    batch_index=i, min_version=self.base_version + i - k)))
                while not train.done():
                    await asyncio.wait({train, asyncio.ensure_future(arrived.wait())},
                                       return_when=asyncio.FIRST_COMPLETED)
                    arrived.clear()
                    if failure:
                        train.cancel()
                        raise failure[0]
                t = train.result()
                while i not in collected:  # the put was acknowledged before the stats were emitted
                    if failure:
                        raise failure[0]
                    if consumer.done():
                        raise RunFailed(f"{rollout.worker.describe()}: produce stream ended before batch {i}")
                    await arrived.wait()
                    arrived.clear()
                if await self.finish_iteration(i, n_iters, collected.pop(i), t):
                    return self._summary(True)
            return self._summary(False)
        finally:
            call.cancel()
            consumer.cancel()
