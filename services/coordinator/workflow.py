"""The PPO macro workflow, written once as plain code:

    rollout (env <-> policy) -> advantages -> train -> publish weights (epoch N+1)

and executed under the plan the run's placement compiles to (see SchedulingConfig). Two loops cover every plan:
  turns   rollout and learner share workers: every rollout worker Collects its shard of batch i with version i,
          then the learner Trains on the shards; repeat.
  stream  the learner has its own workers: every rollout worker Produces a stream of shards (its env chunks
          pipelined against inference, or its envs in-process) while the learner trains; a shard of batch i uses
          a version >= i - staleness (0 = strictly on-policy).
Between iterations (epoch boundaries) the plan may change: online scaling (Scale), the static scheduler trying
candidate plans (mode auto), dynamic shard rebalancing. A stream is drained first, so nothing is discarded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.coordinator.registry import Worker
from services.coordinator.run import Run, RunFailed, StopRequested
from services.coordinator.runlog import RunLog
from services.core.config import RunConfig, SchedulingConfig
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


@dataclass
class Producer:
    """One rollout worker's Produce stream: the shards it delivered and how it ended."""

    stage: Stage
    call: object
    task: asyncio.Task | None = None
    last_index: int = -1
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ScaleChange:
    role: str
    target: int
    joiners: list[Worker]
    done: asyncio.Future


@dataclass
class PlanChange:
    """Re-place stages (the dynamic scheduler): the same workers, another plan, from the next boundary."""

    sched: SchedulingConfig
    why: str


Acquire = Callable[[str, int, float], Awaitable[list[Worker]]]


class PPOWorkflow:
    roles = ("env", "replay", "learner", "rollout")

    def __init__(self, run: Run, workers: dict[str, list[Worker]], resume: bool = False,
                 acquire: Acquire | None = None, release: Callable[[Worker], None] | None = None):
        self.run = run
        self.cfg = run.config
        self.resume = resume
        self.start = 0  # first iteration to run (> 0 when resumed from a checkpoint)
        self.stages: dict[str, Stage] = {}
        self.pools: dict[str, list[Stage]] = {}
        for role, ws in workers.items():
            self.pools[role] = [self._stage(w) for w in ws]
            self.stages[role] = self.pools[role][0]
        self.acquire, self.release = acquire, release
        self.sched: SchedulingConfig = self.cfg.scheduling
        self.plan_name = self.sched.mode
        self.decisions: list[dict] = []  # the static scheduler's table (mode auto)
        self.rows: list[dict] = []  # every recorded iteration of this execution
        self.changes: list[ScaleChange | PlanChange] = []
        self.dynamic = None  # DynamicScheduler when scheduling.dynamic
        self.arrived: list[rollout_pb2.CollectReply] = []
        self.recent_returns: deque[float] = deque(maxlen=100)
        self.runlog: RunLog | None = None
        self.t0 = time.time()
        self.t_iter = time.perf_counter()
        self.best_eval = -math.inf
        self.env_spec: dict = {}
        self.endpoints: dict[str, str] = {}

    @staticmethod
    def _stage(w: Worker) -> Stage:
        ch = channel(w.grpc)
        return Stage(w, ch, STUBS[w.role](ch))

    @property
    def rollouts(self) -> list[Stage]:
        return self.pools["rollout"]

    @property
    def envs(self) -> list[Stage]:
        return self.pools["env"]

    async def close(self) -> None:
        for stages in self.pools.values():
            for s in stages:
                await s.channel.close()
        if self.runlog is not None:
            await asyncio.to_thread(self.runlog.close)

    # -- configuration ---------------------------------------------------------------------------------------
    def plan_config(self, sched: SchedulingConfig | None = None, **updates) -> RunConfig:
        """The run config with a concrete plan (validated: a plan that cannot split the envs is refused)."""
        data = json.loads(self.cfg.to_json())
        data["scheduling"] = {**json.loads((sched or self.sched).model_dump_json()), **updates}
        try:
            return RunConfig.model_validate(data)
        except ValueError as exc:
            raise RunFailed(f"plan {self.plan_name} cannot run: {exc}", True) from None

    async def configure(self) -> None:
        cfg, run = self.cfg, self.run
        req = dict(run_id=run.run_id, config_json=cfg.to_json())
        env = await rpc(self.envs[0], "Configure", common_pb2.ConfigureRequest(**req), 120)
        self.env_spec = env_spec = json.loads(env.detail_json)
        self.endpoints = {self.envs[0].worker.worker_id: env.data_endpoint}
        for stage in self.envs[1:]:
            await self._configure_env(stage)
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
        self.endpoints["replay"], self.endpoints["learner"] = replay.data_endpoint, learner.data_endpoint
        detail = json.loads(learner.detail_json)
        self.base_version = detail["weight_version"]
        if self.resume:
            self._restore(detail)
        self.runlog = await asyncio.to_thread(RunLog, run.run_dir, cfg, self.start if self.resume else None,
                                              run.env_steps)
        if self.sched.mode != "auto":
            await self.configure_rollouts(self.start)
        run.log(f"configured {env_spec['env_id']} x{env_spec['num_envs']} "
                f"(obs {env_spec['observation_space']['shape']}, actions {env_spec['action_space']['kind']})")

    async def _configure_env(self, stage: Stage) -> None:
        reply = await rpc(stage, "Configure", common_pb2.ConfigureRequest(run_id=self.run.run_id,
                                                                          config_json=self.cfg.to_json()), 120)
        self.endpoints[stage.worker.worker_id] = reply.data_endpoint

    def describe_plan(self, sched: SchedulingConfig | None = None, workers: int | None = None) -> str:
        s = sched or self.sched
        where = s.resolved_placement()
        w = workers or len(self.rollouts)
        env = "in the rollout workers" if s.env_in_rollout() else \
            f"in {min(len(self.envs), w)} env service(s), {s.chunks()} chunk(s) pipelined"
        learner = f"streams, staleness {s.effective_staleness()}" if s.learner_overlaps() else "takes turns"
        return (f"placement {where}; {w} rollout worker(s) with shards {self.cfg.shard_sizes(w)}; env {env}; "
                f"learner {learner}")

    async def configure_rollouts(self, next_index: int, sched: SchedulingConfig | None = None) -> None:
        """(Re)configure every rollout worker for the current plan: its shard of the env batch, its env peer, and
        the weight version its first batch needs (a joiner gets it before its first step)."""
        sched = sched or self.sched
        w_count = len(self.rollouts)
        cfg = self.plan_config(sched, rollout_workers=w_count, env_workers=len(self.envs))
        k = sched.effective_staleness()
        offsets = [0]
        for n in cfg.shard_sizes():
            offsets.append(offsets[-1] + n)
        calls = []
        for w, stage in enumerate(self.rollouts):
            env_stage = self.envs[w % len(self.envs)]
            shard = {"index": w, "envs": offsets[w + 1] - offsets[w], "offset": offsets[w]}
            ctx = {"env_spec": self.env_spec, "run_dir": str(self.run.run_dir.resolve()),
                   "base_version": self.base_version, "start_iteration": next_index, "shard": shard,
                   "min_version": self.base_version + max(0, next_index - k)}
            calls.append(rpc(stage, "Configure", common_pb2.ConfigureRequest(
                run_id=self.run.run_id, config_json=cfg.to_json(), context_json=json.dumps(ctx),
                peers={"env": self.endpoints[env_stage.worker.worker_id], "replay": self.endpoints["replay"],
                       "learner": self.endpoints["learner"]}), 120))
        await asyncio.gather(*calls)
        self.sched = cfg.scheduling
        self.run.plan = self.plan_name
        self.run.log(f"plan {self.plan_name} from iteration {next_index}: {self.describe_plan()}")

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

    # -- one iteration's end -----------------------------------------------------------------------------------
    async def finish_iteration(self, i: int, n_iters: int, shards: list[rollout_pb2.CollectReply],
                               t: learner_pb2.TrainReply) -> bool:
        """Every plan ends an iteration alike: evaluate when due, record, checkpoint when due, and honour a stop
        here (the one place it takes effect, so no update goes unrecorded). True once the target is reached."""
        ev = await self.evaluate() if self.eval_due(i, n_iters) else None
        self.record(i, shards, t, ev)
        if self.reached(ev):
            return True
        if self.dynamic is not None:
            await self.dynamic.at_boundary(i)
        if self.checkpoint_due(i, n_iters):
            await self.save_checkpoint()
        if self.run.stop_requested.is_set():
            raise StopRequested()
        return False

    def checkpoint_due(self, i: int, n_iters: int) -> bool:
        every = self.cfg.checkpoint.every_iterations
        return every > 0 and (i + 1) % every == 0 and i + 1 < n_iters

    async def evaluate(self) -> rollout_pb2.EvaluateReply:
        return await rpc(self.rollouts[0], "Evaluate",
                         rollout_pb2.EvaluateRequest(episodes=self.cfg.train.eval_episodes))

    def record(self, i: int, shards: list[rollout_pb2.CollectReply], t: learner_pb2.TrainReply,
               ev: rollout_pb2.EvaluateReply | None) -> None:
        for c in shards:
            self.recent_returns.extend(c.episode_returns)
        now = time.perf_counter()
        iteration_s, self.t_iter = now - self.t_iter, now
        run = self.run
        n = max(len(shards), 1)

        def mean(field: str) -> float:
            return sum(getattr(c, field) for c in shards) / n

        row: dict[str, float] = {
            "iteration": i + 1, "env_steps": t.env_steps, "wall_time_s": time.time() - self.t0,
            "weight_version": t.weight_version - self.base_version,
            "batch_version": t.batch_version - self.base_version,
            "train_episodes": sum(len(c.episode_returns) for c in shards), "optimizer_steps": t.optimizer_steps,
            "fps": self.cfg.batch_env_steps() / max(iteration_s, 1e-9), "iteration_seconds": iteration_s,
            "collect_seconds": mean("collect_seconds"), "train_seconds": t.train_seconds,
            "env_seconds": mean("env_seconds"), "policy_seconds": mean("policy_seconds"),
            "weight_wait_seconds": mean("weight_wait_seconds"), "train_wait_seconds": t.wait_seconds,
            "rollout_workers": len(self.rollouts), "env_workers": 0 if self.sched.env_in_rollout() else len(self.envs),
            **dict(t.stats),
        }
        if self.recent_returns:
            row["train_return_mean"] = sum(self.recent_returns) / len(self.recent_returns)
        if ev is not None:
            row["eval_return_mean"] = ev.episodes.return_mean
            row["eval_return_std"] = ev.episodes.return_std
            row["eval_weight_version"] = ev.weight_version - self.base_version
            row["eval_seconds"] = ev.seconds
            self.best_eval = max(self.best_eval, ev.episodes.return_mean)
        self.rows.append(row)
        self.runlog.write(row)
        run.metrics(row)

    def eval_due(self, i: int, n_iters: int) -> bool:
        every = self.cfg.train.eval_every_iterations
        return i + 1 == n_iters or (every > 0 and (i + 1) % every == 0)

    def reached(self, ev: rollout_pb2.EvaluateReply | None) -> bool:
        target = self.cfg.train.stop_at_eval_return
        return ev is not None and target is not None and ev.episodes.return_mean >= target

    # -- the run -----------------------------------------------------------------------------------------------
    async def execute(self) -> str:
        await self.configure()
        n_iters = math.ceil(self.cfg.train.total_env_steps / self.cfg.batch_env_steps())
        if self.start >= n_iters:
            raise RunFailed(f"nothing to resume: the checkpoint is at iteration {self.start} of {n_iters}", True)
        i, done = self.start, False
        self.t_iter = time.perf_counter()
        if self.sched.mode == "auto":
            from services.coordinator.scheduler import StaticScheduler

            i, done = await StaticScheduler(self).choose(i, n_iters)
        if self.cfg.scheduling.dynamic:
            from services.coordinator.dynamic import DynamicScheduler

            self.dynamic = DynamicScheduler(self)
            self.dynamic.start_row = len(self.rows)
            self.dynamic.env_seconds = await self.dynamic._env_seconds()
        while not done and i < n_iters:
            i, done = await self.segment(i, n_iters)
            if not done and i < n_iters:
                await self.apply_changes(i)
        await self.save_checkpoint(self.cfg.train.checkpoint_key, periodic=False)
        return self._summary(done)

    async def segment(self, i: int, until: int) -> tuple[int, bool]:
        """Run iterations [i, until) under the current plan; stop early (at a boundary) when a change waits."""
        if self.sched.learner_overlaps():
            return await self._stream(i, until)
        return await self._turns(i, until)

    def _summary(self, stopped_early: bool) -> str:
        best = f"best eval mean return {self.best_eval:.1f}" if self.best_eval > -math.inf else "no eval"
        target = self.cfg.train.stop_at_eval_return
        if stopped_early:
            return f"reached eval return >= {target:g} at {self.run.env_steps} env steps ({best})"
        return f"finished {self.run.env_steps} env steps ({best})"

    async def _turns(self, i: int, until: int) -> tuple[int, bool]:
        learner = self.stages["learner"]
        while i < until:
            version = self.base_version + i
            shards = await asyncio.gather(*(rpc(r, "Collect", rollout_pb2.CollectRequest(
                batch_index=i, min_version=version)) for r in self.rollouts))
            t = await rpc(learner, "Train", learner_pb2.TrainRequest(batch_index=i, min_version=version))
            if await self.finish_iteration(i, until, list(shards), t):
                return i + 1, True
            i += 1
            if self.changes:
                break
        return i, False

    def _open(self, stage: Stage, first: int, count: int, k: int, failure: list[RunFailed],
              arrived: asyncio.Event) -> Producer:
        call = stage.stub.Produce(rollout_pb2.ProduceRequest(first_batch_index=first, max_batches=count,
                                                             staleness=k))
        producer = Producer(stage, call, last_index=first - 1)

        async def consume() -> None:
            try:
                async for reply in call:
                    producer.last_index = reply.batch_index
                    self.arrived.append(reply)
                    arrived.set()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    failure.append(RunFailed(f"{stage.worker.describe()}: Produce failed: {exc.details()}",
                                             exc.code() == grpc.StatusCode.INVALID_ARGUMENT))
            finally:
                producer.ended.set()
                arrived.set()

        producer.task = asyncio.create_task(consume())
        return producer

    async def _stream(self, i: int, until: int) -> tuple[int, bool]:
        learner = self.stages["learner"]
        k = self.sched.effective_staleness()
        failure: list[RunFailed] = []
        arrived = asyncio.Event()
        producers = [self._open(r, i, until - i, k, failure, arrived) for r in self.rollouts]
        drain_at: int | None = None
        try:
            while i < until:
                if drain_at is not None and i > drain_at:
                    break  # every shard produced before the drain was trained on
                train = asyncio.create_task(rpc(learner, "Train", learner_pb2.TrainRequest(
                    batch_index=i, min_version=self.base_version + i - k)))
                while not train.done():
                    waiter = asyncio.ensure_future(arrived.wait())
                    await asyncio.wait({train, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    arrived.clear()
                    if failure:
                        train.cancel()
                        raise failure[0]
                    if not train.done() and all(p.ended.is_set() for p in producers) and drain_at is None:
                        await asyncio.wait({train}, timeout=1.0)  # the last shard may still be in flight
                        if not train.done():
                            train.cancel()
                            raise RunFailed("every rollout stream ended before the learner had its batch "
                                            f"{i}; see the rollout workers' logs")
                t = train.result()
                shards, self.arrived = self.arrived, []
                if await self.finish_iteration(i, until, shards, t):
                    return i + 1, True
                i += 1
                if self.changes and drain_at is None:
                    # finish what is in flight (up to the furthest shard started), then re-plan
                    drain_at = max(max(p.last_index for p in producers) + 1, i)
                    await asyncio.gather(*(rpc(p.stage, "Drain", rollout_pb2.DrainRequest(last_batch_index=drain_at))
                                           for p in producers if not p.ended.is_set()))
                    self.run.log(f"draining rollout streams after batch {drain_at} to re-plan")
            await asyncio.wait_for(asyncio.gather(*(p.ended.wait() for p in producers)),
                                   self.cfg.data_plane.timeout_s)
            if failure:
                raise failure[0]
            return i, False
        finally:
            for p in producers:
                p.call.cancel()
                if p.task is not None:
                    p.task.cancel()

    # -- changes at epoch boundaries ---------------------------------------------------------------------------
    async def request_scale(self, role: str, target: int, timeout_s: float) -> ScaleChange:
        """Queue a change of the number of ``role`` workers; it is applied at the next epoch boundary."""
        if role not in ("rollout", "env"):
            raise RunFailed(f"cannot scale role {role!r}: only 'rollout' and 'env' workers scale", True)
        current = len(self.pools[role])
        if target < 1:
            raise RunFailed(f"a run needs at least one {role} worker (asked for {target})", True)
        if role == "rollout" and target > self.cfg.env.num_envs:
            raise RunFailed(f"cannot run {target} rollout workers on env.num_envs={self.cfg.env.num_envs}", True)
        if role == "rollout":
            self.plan_config(self.sched, rollout_workers=target)  # refuses a split the chunks cannot take
        joiners: list[Worker] = []
        if target > current:
            if self.acquire is None:
                raise RunFailed("this coordinator cannot acquire workers for a run")
            joiners = await self.acquire(role, target - current, timeout_s)
        change = ScaleChange(role, target, joiners, asyncio.get_running_loop().create_future())
        self.changes.append(change)
        return change

    async def request_plan(self, sched: SchedulingConfig, why: str) -> None:
        """Queue a re-placement for the next epoch boundary (the dynamic scheduler)."""
        self.changes.append(PlanChange(sched, why))

    async def apply_changes(self, next_index: int) -> None:
        """Apply queued changes between iterations: joiners are configured (current weights first), leavers were
        drained and are released, a re-placement takes effect, and every rollout worker gets its new shard."""
        changes, self.changes = self.changes, []
        sched = None
        for change in changes:
            if isinstance(change, PlanChange):
                sched = change.sched
                self.plan_name = f"{self.plan_name.split(' [')[0]} [{change.why}]"
                continue
            stages = self.pools[change.role]
            leaving = stages[change.target:]
            kept = stages[:change.target] + [self._stage(w) for w in change.joiners]
            if change.role == "env":
                for stage in kept[len(stages):]:
                    await self._configure_env(stage)
            self.pools[change.role] = kept
            self.stages[change.role] = kept[0]
            for stage in leaving:
                await stage.channel.close()
                if self.release is not None:
                    self.release(stage.worker)
        if not changes:
            return
        scaled = [c for c in changes if isinstance(c, ScaleChange)]
        try:
            await self.configure_rollouts(next_index, sched)
        except RunFailed as exc:
            for change in scaled:
                if not change.done.done():
                    change.done.set_exception(exc)
            raise
        for change in scaled:
            if not change.done.done():
                change.done.set_result(next_index)
