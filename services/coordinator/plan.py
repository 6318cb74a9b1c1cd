"""PlanExecutor: runs the iterations of a run under the plan its placement compiles to (see SchedulingConfig).

Three loops cover every plan:
  turns       rollout and learner share workers: every rollout worker Collects its shard of batch i with version
              i, then the learner Trains on the shards; repeat.
  stream      the learner has its own workers: every rollout worker Produces a stream of shards (its env chunks
              pipelined against inference, or its envs in-process) while the learner trains; a shard of batch i
              uses a version >= i - staleness (0 = strictly on-policy).
  train-only  an algorithm that collects nothing (offline): the learner Trains on what replay holds.
Between iterations (epoch boundaries) the plan may change: online scaling (Scale), a scheduler re-placing stages
(mode auto trying candidate plans, dynamic rebalancing). A stream is drained first, so nothing is discarded.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from rlfabric.services.coordinator.recovery import unreachable
from rlfabric.services.coordinator.registry import Worker
from rlfabric.services.coordinator.run import Run, RunFailed
from rlfabric.services.coordinator.stages import Stage, rpc, watched
from rlfabric.services.core.config import RunConfig, SchedulingConfig
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, learner_pb2, rollout_pb2

Acquire = Callable[[str, int, float], Awaitable[list[Worker]]]

# Liveness of Train and Collect: no call has a deadline, for a call's length says nothing about its worker (50 supervised
# updates of a 20M-parameter model took minutes on a slow host, and the run was once declared dead for it). The
# worker's heartbeats show its progress instead (services/core/progress.py: CPU time and data-plane messages; the
# registry's Worker.note). A worker in a call that shows none for data_plane.timeout_s (the longest it may wait on a
# silent peer before it reports that peer itself) plus runtime.liveness_s is stalled: wedged, though its heartbeats
# and health check may still say it is fine. One whose heartbeats stop is lost by the registry's reaper sooner.
# Either way the run loses it, and recovery re-places the run without it.


@dataclass
class Step:
    """One iteration as the plan ran it: its index, the rollout shards that fed it, the learner's reply."""

    index: int
    plan: str
    shards: list[rollout_pb2.CollectReply]
    train: learner_pb2.TrainReply


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
    sched: SchedulingConfig
    name: str


class PlanExecutor:
    """Owns the run's stages and the current plan; the training loop consumes ``iterations``."""

    def __init__(self, run: Run, workers: dict[str, list[Worker]], acquire: Acquire | None = None,
                 release: Callable[[Worker], None] | None = None):
        self.run = run
        self.cfg: RunConfig = run.config
        self.pools: dict[str, list[Stage]] = {role: [Stage.of(w, self.run.key) for w in ws] for role, ws in workers.items()}
        self.acquire, self.release = acquire, release
        self._sched: SchedulingConfig = self.cfg.scheduling
        self.plan_name = self._sched.mode
        self.changes: list[ScaleChange | PlanChange] = []
        self.arrived: list[rollout_pb2.CollectReply] = []
        self.endpoints: dict[str, str] = {}
        self.env_spec: dict = {}
        self.base_version = 0
        # This attempt's fence, in every worker's Configure: env and replay refuse requests stamped with another
        # (a worker lost to an earlier attempt that can still reach them), so its stale work never mixes in.
        self.fence = secrets.token_hex(8)

    # -- the narrow interface schedulers see (records.PlanControl) -------------------------------------------
    @property
    def sched(self) -> SchedulingConfig:
        return self._sched

    @property
    def rollout_workers(self) -> int:
        return len(self.rollouts)

    @property
    def env_workers(self) -> int:
        return len(self.envs)

    def validate(self, sched: SchedulingConfig) -> SchedulingConfig:
        return self.plan_config(sched).scheduling

    async def request_plan(self, sched: SchedulingConfig, name: str) -> None:
        """Queue a re-placement for the next epoch boundary."""
        self.changes.append(PlanChange(sched, name))

    def describe(self, sched: SchedulingConfig | None = None, workers: int | None = None) -> str:
        s = sched or self._sched
        where = s.resolved_placement()
        w = workers or len(self.rollouts)
        env = "in the rollout workers" if s.env_in_rollout() else \
            f"in {min(len(self.envs), w)} env service(s), {s.chunks()} chunk(s) pipelined"
        learner = f"streams, staleness {s.effective_staleness()}" if s.learner_overlaps() else "takes turns"
        return (f"placement {where}; {w} rollout worker(s) with shards {self.cfg.shard_sizes(w)}; env {env}; "
                f"learner {learner}")

    async def env_step_seconds(self) -> float:
        total = 0.0
        for stage in self.envs:
            total += (await rpc(stage, "GetStats", common_pb2.Empty(), 10)).step_seconds
        return total

    async def probe_ipc(self) -> float | None:
        if self._sched.env_in_rollout():
            return None
        probe = await rpc(self.rollouts[0], "Probe", rollout_pb2.ProbeRequest(round_trips=64), 60)
        return probe.round_trip_seconds

    def log(self, message: str) -> None:
        self.run.log(message)

    # -- stages --------------------------------------------------------------------------------------------
    @property
    def rollouts(self) -> list[Stage]:
        return self.pools.get("rollout", [])

    @property
    def envs(self) -> list[Stage]:
        return self.pools["env"]

    def stage(self, role: str) -> Stage:
        return self.pools[role][0]

    async def close(self) -> None:
        """End this placement: scale changes still queued fail (their joiners go back to the registry), and the
        stages' channels close."""
        for change in self.changes:
            if isinstance(change, ScaleChange):
                for worker in change.joiners:
                    if self.release is not None:
                        self.release(worker)
                if not change.done.done():
                    change.done.set_exception(RunFailed(
                        f"scaling {change.role} to {change.target} did not apply: the run ended or re-placed itself "
                        f"first (ask again if it goes on)"))
                    change.done.exception()  # retrieved here: the Scale call may have stopped waiting
        self.changes = []
        for stages in self.pools.values():
            for s in stages:
                await s.channel.close()

    def plan_config(self, sched: SchedulingConfig | None = None, **updates) -> RunConfig:
        """The run config with a concrete plan (validated: a plan that cannot split the envs is refused)."""
        data = json.loads(self.cfg.to_json())
        data["scheduling"] = {**json.loads((sched or self._sched).model_dump_json()), **updates}
        try:
            return RunConfig.model_validate(data)
        except ValueError as exc:
            raise RunFailed(f"plan {self.plan_name} cannot run: {exc}", True) from None

    async def configure_env(self, stage: Stage) -> dict:
        """An env worker opens no store, so it gets the spec without its secrets (S3 keys, Redis password)."""
        reply = await rpc(stage, "Configure", common_pb2.ConfigureRequest(
            run_id=self.run.run_id, config_json=self.cfg.redacted().to_json(),
            context_json=json.dumps({"fence": self.fence})), 120)
        self.endpoints[stage.worker.worker_id] = reply.data_endpoint
        return json.loads(reply.detail_json)

    async def configure_rollouts(self, next_index: int, sched: SchedulingConfig | None = None,
                                 name: str | None = None) -> None:
        """(Re)configure every rollout worker for the current plan: its shard of the env batch, its env peer, and
        the weight version its first batch needs (a joiner gets it before its first step)."""
        sched = sched or self._sched
        if not self.rollouts:
            return
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
                   "min_version": self.base_version + max(0, next_index - k), "fence": self.fence}
            calls.append(rpc(stage, "Configure", common_pb2.ConfigureRequest(
                run_id=self.run.run_id, config_json=cfg.to_json(), context_json=json.dumps(ctx),
                peers={"env": self.endpoints[env_stage.worker.worker_id], "replay": self.endpoints["replay"],
                       "learner": self.endpoints["learner"]}), 120))
        await asyncio.gather(*calls)
        self._sched = cfg.scheduling
        if name is not None:
            self.plan_name = name
        self.run.plan = self.plan_name
        if self.cfg.collects:
            self.run.log(f"plan {self.plan_name} from iteration {next_index}: {self.describe()}")

    # -- iterations ----------------------------------------------------------------------------------------
    def liveness_window(self) -> float:
        """Seconds a worker in a call may show no progress before it counts as stalled (the rule above)."""
        return self.cfg.data_plane.timeout_s + self.cfg.runtime.liveness_s

    async def _work(self, stage: Stage, method: str, request):
        """Train or Collect for as long as its worker shows progress (stages.watched)."""
        return await watched(stage, method, request, self.run, self.liveness_window())

    async def iterations(self, i: int, until: int) -> AsyncIterator[Step]:
        """Iterations [i, until) under the current plan, re-planned at boundaries where changes wait."""
        while i < until:
            if not self.cfg.collects:
                loop = self._train_only(i, until)
            elif self._sched.learner_overlaps():
                loop = self._stream(i, until)
            else:
                loop = self._turns(i, until)
            async for step in loop:
                yield step
                i = step.index + 1
            if self.changes and i < until:
                await self.apply_changes(i)

    async def _train(self, i: int, min_version: int) -> learner_pb2.TrainReply:
        return await self._work(self.stage("learner"), "Train", learner_pb2.TrainRequest(batch_index=i,
                                                                                        min_version=min_version))

    async def _train_only(self, i: int, until: int) -> AsyncIterator[Step]:
        while i < until:
            yield Step(i, self.plan_name, [], await self._train(i, self.base_version + i))
            i += 1
            if self.changes:
                return

    async def _turns(self, i: int, until: int) -> AsyncIterator[Step]:
        while i < until:
            version = self.base_version + i
            shards = await asyncio.gather(*(self._work(r, "Collect", rollout_pb2.CollectRequest(
                batch_index=i, min_version=version)) for r in self.rollouts))
            yield Step(i, self.plan_name, list(shards), await self._train(i, version))
            i += 1
            if self.changes:
                return

    async def _learner_first(self, failed: RunFailed, train: asyncio.Task) -> None:
        """A rollout stream that gave up waiting for the learner's next weight version while the learner's Train
        runs is the learner's doing: that Train gets the data plane's timeout to end, and if it fails, its failure
        is the run's (the root cause: a learner rank's link, say), with the rollout's after it. Otherwise (the Train
        went on, or the stream failed for another reason) the rollout's stands."""
        if not getattr(failed, "weights_late", False):
            return
        await asyncio.wait({train}, timeout=self.cfg.data_plane.timeout_s + 5.0)
        if not train.done() or train.cancelled() or train.exception() is None:
            return
        cause = train.exception()
        if isinstance(cause, RunFailed):
            raise RunFailed(f"{cause.reason} (then {failed.reason})", cause.bad_input) from cause
        raise cause

    def _open(self, stage: Stage, first: int, count: int, k: int, failure: list[RunFailed],
              arrived: asyncio.Event) -> Producer:
        call = stage.stub.Produce(rollout_pb2.ProduceRequest(first_batch_index=first, max_batches=count,
                                                             staleness=k), metadata=stage.metadata())
        producer = Producer(stage, call, last_index=first - 1)

        async def consume() -> None:
            try:
                async for reply in call:
                    producer.last_index = reply.batch_index
                    self.arrived.append(reply)
                    arrived.set()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    failed = RunFailed(f"{stage.worker.describe()}: Produce failed: {exc.details()}",
                                       exc.code() == grpc.StatusCode.INVALID_ARGUMENT)
                    failed.weights_late = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # (rollout's WeightsLate)
                    failure.append(failed)
            finally:
                producer.ended.set()
                arrived.set()

        producer.task = asyncio.create_task(consume())
        return producer

    async def _stream(self, i: int, until: int) -> AsyncIterator[Step]:
        k = self._sched.effective_staleness()
        failure: list[RunFailed] = []
        arrived = asyncio.Event()
        producers = [self._open(r, i, until - i, k, failure, arrived) for r in self.rollouts]
        drain_at: int | None = None
        train: asyncio.Task | None = None
        try:
            while i < until:
                if drain_at is not None and i > drain_at:
                    break  # every shard produced before the drain was trained on
                train = asyncio.create_task(self._train(i, self.base_version + i - k))
                while not train.done():
                    waiter = asyncio.ensure_future(arrived.wait())
                    await asyncio.wait({train, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    arrived.clear()
                    if failure:
                        await self._learner_first(failure[0], train)
                        train.cancel()
                        raise failure[0]
                    if not train.done() and drain_at is None and all(p.ended.is_set() for p in producers) \
                            and min(p.last_index for p in producers) < i:  # a stream ended short of batch i
                        await asyncio.wait({train}, timeout=1.0)  # the last shard may still be in flight
                        if not train.done():
                            train.cancel()
                            raise RunFailed("every rollout stream ended before the learner had its batch "
                                            f"{i}; see the rollout workers' logs")
                shards, self.arrived = self.arrived, []
                yield Step(i, self.plan_name, shards, train.result())
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
        finally:
            if train is not None and not train.done():
                train.cancel()  # the learner stops waiting for this batch (a lost worker, a stop)
            for p in producers:
                p.call.cancel()
                if p.task is not None:
                    p.task.cancel()

    # -- changes at epoch boundaries ---------------------------------------------------------------------------
    async def request_scale(self, role: str, target: int, timeout_s: float) -> ScaleChange:
        """Queue a change of the number of ``role`` workers; it is applied at the next epoch boundary."""
        if role not in ("rollout", "env"):
            raise RunFailed(f"cannot scale role {role!r}: only 'rollout' and 'env' workers scale", True)
        if not self.cfg.collects:
            raise RunFailed("this run's algorithm collects nothing (offline): there are no rollout or env stages "
                            "to scale", True)
        current = len(self.pools[role])
        if target < 1:
            raise RunFailed(f"a run needs at least one {role} worker (asked for {target})", True)
        if role == "rollout" and target > self.cfg.env.num_envs:
            raise RunFailed(f"cannot run {target} rollout workers on env.num_envs={self.cfg.env.num_envs}", True)
        if role == "rollout":
            self.plan_config(self._sched, rollout_workers=target)  # refuses a split the chunks cannot take
        joiners: list[Worker] = []
        if target > current:
            if self.acquire is None:
                raise RunFailed("this coordinator cannot acquire workers for a run")
            joiners = await self.acquire(role, target - current, timeout_s)
            await self._probe(joiners)
        change = ScaleChange(role, target, joiners, asyncio.get_running_loop().create_future())
        self.changes.append(change)
        return change

    async def _probe(self, joiners: list[Worker]) -> None:
        """A worker joins a live run only if its health check answers SERVING (a registered worker may be dead or
        fake); otherwise every joiner goes back, the unhealthy ones are never placed again, and the request fails.
        (A joiner is version-synced when configured: its first batch waits for the run's current weights.)"""
        stages = [Stage.of(w, self.run.key) for w in joiners]
        try:
            bad = [w for w, _ in await unreachable(stages)]
        finally:
            for s in stages:
                await s.channel.close()
        if bad:
            for w in bad:
                w.alive = False
            for w in joiners:
                if self.release is not None:
                    self.release(w)
            raise RunFailed(f"{', '.join(w.describe() for w in bad)} did not answer its health check, so it was not "
                            f"placed in the live run (marked dead; it registers again if it lives). Fix: check that "
                            f"worker, or scale again to take another")

    async def apply_changes(self, next_index: int) -> None:
        """Apply queued changes between iterations: joiners are configured (current weights first), leavers were
        drained and are released, a re-placement takes effect, and every rollout worker gets its new shard."""
        changes, self.changes = self.changes, []
        sched, name = None, None
        for change in changes:
            if isinstance(change, PlanChange):
                sched, name = change.sched, change.name
                continue
            stages = self.pools[change.role]
            leaving = stages[change.target:]
            kept = stages[:change.target] + [Stage.of(w, self.run.key) for w in change.joiners]
            if change.role == "env":
                for stage in kept[len(stages):]:
                    await self.configure_env(stage)
            self.pools[change.role] = kept
            for stage in leaving:
                await stage.channel.close()
                if self.release is not None:
                    self.release(stage.worker)
        if not changes:
            return
        scaled = [c for c in changes if isinstance(c, ScaleChange)]
        try:
            await self.configure_rollouts(next_index, sched, name)
        except RunFailed as exc:
            for change in scaled:
                if not change.done.done():
                    change.done.set_exception(exc)
            raise
        for change in scaled:
            if not change.done.done():
                change.done.set_result(next_index)
