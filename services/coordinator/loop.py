"""TrainingLoop: one run, written once as plain code for every algorithm, top to bottom:

    setup      configure env, replay, learner (resume from a checkpoint), then the rollout workers
    fit        for each iteration the plan runs (collect -> train -> publish weights, overlapped as the plan says):
                   evaluate when due, record, stop at the target, let the schedulers see the record,
                   checkpoint when due, honour a stop
    finish     a final checkpoint

What differs between algorithms is declared by their specs (roles, data access, iterations) and read here; how
iterations overlap is the plan executor's (plan.py); where stages run is the schedulers' (scheduler.py,
dynamic.py), who see only IterationRecords and the PlanControl interface.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from contextlib import aclosing

from rlfabric.services.coordinator import recovery
from rlfabric.services.coordinator.dynamic import DynamicScheduler
from rlfabric.services.coordinator.plan import Acquire, PlanExecutor, Step
from rlfabric.services.coordinator.records import IterationRecord
from rlfabric.services.coordinator.recovery import Loss
from rlfabric.services.coordinator.registry import Worker
from rlfabric.services.coordinator.run import Run, RunFailed, StopRequested
from rlfabric.services.coordinator.runlog import RunLog
from rlfabric.services.coordinator.scheduler import StaticScheduler
from rlfabric.services.coordinator.stages import rpc
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, learner_pb2, replay_pb2, rollout_pb2


def episode_counts(shards: list) -> dict[str, float]:
    """What the envs reported beside returns, summed over the iteration's shards, with the rates that follow:
    ``train_success_rate`` over episodes that said whether they succeeded, and (envs under teleop) the share of
    episodes a human intervened in and of episodes that succeeded with no intervention (human-gated imitation's measure)."""
    counts: dict[str, float] = {}
    for c in shards:
        for key, value in c.stats.items():
            counts[key] = counts.get(key, 0.0) + value
    episodes = sum(len(c.episode_returns) for c in shards)
    if counts.get("episodes_judged"):
        counts["train_success_rate"] = counts.get("episodes_succeeded", 0.0) / counts["episodes_judged"]
    if "intervened_steps" in counts and episodes:
        counts["intervened_episode_rate"] = counts.get("episodes_intervened", 0.0) / episodes
        counts["success_without_intervention_rate"] = counts.get("successes_without_intervention", 0.0) / episodes
    return counts

class TrainingLoop:
    def __init__(self, run: Run, workers: dict[str, list[Worker]], resume: bool | str = False,
                 acquire: Acquire | None = None, release=None, recovery: Loss | None = None):
        self.run = run
        self.cfg = run.config
        self.spec = self.cfg.spec
        self.resume = resume  # True: from the newest checkpoint; "if_any": a recovery, from the start if none
        self.recovery = recovery  # the loss this attempt recovers from
        self.plan = PlanExecutor(run, workers, acquire, release)
        self.start = 0  # first iteration to run (> 0 when resumed from a checkpoint)
        self.base_version = 0
        self.static: StaticScheduler | None = None
        self.dynamic: DynamicScheduler | None = None
        self.records: list[IterationRecord] = []
        self.recent_returns: deque[float] = deque(maxlen=100)
        self.runlog: RunLog | None = None
        self.t0 = time.time()
        self.t_iter = time.perf_counter()
        self.best_eval = -math.inf
        self.held_out_row: dict[str, float] | None = None
        self.ended_before = False  # resumed from the final checkpoint of a run that had ended

    @property
    def decisions(self) -> list[dict]:
        """The static scheduler's decision table (mode auto), for GetPlan."""
        return self.static.decisions if self.static is not None else []

    async def close(self) -> None:
        await self.plan.close()
        if self.runlog is not None:
            await asyncio.to_thread(self.runlog.close)

    # -- the run ---------------------------------------------------------------------------------------------
    async def fit(self) -> str:
        await self.setup()
        n_iters = self.cfg.iterations()
        if self.resume == "if_any" and (self.ended_before or self.start >= n_iters):
            return await self.finish_ended(n_iters)
        if self.start >= n_iters:
            raise RunFailed(f"nothing to resume: the checkpoint is at iteration {self.start} of {n_iters}", True)
        reached = False
        self.t_iter = time.perf_counter()
        async with aclosing(self.plan.iterations(self.start, n_iters)) as steps:
            async for step in steps:
                ev = await self.evaluate() if self.eval_due(step.index, n_iters) else None
                record = self.record(step, ev)
                if self.reached(ev):
                    reached = True
                    break
                await self.observe(record)
                if self.checkpoint_due(step.index, n_iters):
                    await self.save_checkpoint()
                if self.run.stop_requested.is_set():
                    raise StopRequested()
        await self.held_out()
        await self.save_checkpoint(self.cfg.train.checkpoint_key, periodic=False)
        return self.summary(reached)

    async def held_out(self) -> None:
        """The final held-out evaluation (train.held_out_episodes): its own metrics row, on scenes apart from the
        periodic evaluations'."""
        train = self.cfg.train
        if not train.held_out_episodes or not self.plan.rollouts:
            return
        ev = await rpc(self.plan.rollouts[0], "Evaluate",
                       rollout_pb2.EvaluateRequest(episodes=train.held_out_episodes,
                                                   stochastic=not train.eval_deterministic,
                                                   seed=self.cfg.held_out_seed()), 3600)
        row = {"iteration": self.run.iteration, "env_steps": self.run.env_steps,
               "wall_time_s": time.time() - self.t0, "weight_version": ev.weight_version - self.base_version,
               "held_out_return_mean": ev.episodes.return_mean, "held_out_episodes": len(ev.returns),
               "held_out_seconds": ev.seconds}
        if ev.successes:
            row["held_out_success_rate"] = sum(ev.successes) / len(ev.successes)
        self.held_out_row = row
        self.runlog.write(row)
        self.run.metrics(row)

    async def finish_ended(self, n_iters: int) -> str:
        """A recovery (a lost worker, a restarted coordinator) whose newest checkpoint already holds the run's end
        (its last iteration, or the final checkpoint of a run that reached its target): the loss came between the
        last update and the run's recorded end. What may be missing is the final evaluation and the final
        checkpoint; both are made again from the same weights, and the run ends instead of training on."""
        last = self.runlog.rows[-1] if self.runlog.rows else {}
        again = bool(self.plan.rollouts) and not (int(last.get("iteration", 0)) == self.start and "eval_return_mean" in last)
        if again:
            last = {"iteration": self.start, "env_steps": self.run.env_steps, "wall_time_s": time.time() - self.t0,
                    "weight_version": self.start, **self.eval_values(await self.evaluate())}
            self.runlog.write(last)
            self.run.metrics(last)
        if not (self.runlog.rows and "held_out_return_mean" in self.runlog.rows[-1]):
            await self.held_out()
        self.run.log(f"the checkpoint already holds the run's end (iteration {self.start} of {n_iters}): "
                     f"{'evaluated again and ' if again else ''}finishing the run")
        await self.save_checkpoint(self.cfg.train.checkpoint_key, periodic=False)
        target, mean = self.cfg.train.stop_at_eval_return, last.get("eval_return_mean")
        return self.summary(target is not None and mean is not None and mean >= target)

    async def setup(self) -> None:
        cfg, run, plan = self.cfg, self.run, self.plan
        req = dict(run_id=run.run_id, config_json=cfg.to_json())
        plan.env_spec = env_spec = await plan.configure_env(plan.envs[0])
        for stage in plan.envs[1:]:
            await plan.configure_env(stage)
        ctx = {"env_spec": env_spec, "run_dir": str(run.run_dir.resolve()), "fence": plan.fence}
        replay = await rpc(plan.stage("replay"), "Configure",
                           common_pb2.ConfigureRequest(**req, context_json=json.dumps(ctx)), 600)
        for source, rows in json.loads(replay.detail_json or "{}").get("loaded", {}).items():
            run.log(f"loaded {rows} rows into replay source {source!r} from {cfg.replay.datasets[source]}")
        await self.retain_replay()
        learner = await rpc(plan.stage("learner"), "Configure", common_pb2.ConfigureRequest(
            **req, peers={"replay": replay.data_endpoint}, context_json=json.dumps({**ctx, "resume": self.resume})),
            120)
        plan.endpoints["replay"], plan.endpoints["learner"] = replay.data_endpoint, learner.data_endpoint
        detail = json.loads(learner.detail_json)
        self.base_version = plan.base_version = detail["weight_version"]
        if self.resume:
            self.restore(detail)
        self.runlog = await asyncio.to_thread(RunLog, run.run_dir, cfg, self.start if self.resume else None,
                                              run.env_steps)
        if self.recovery is not None:
            event = recovery.event(run, self.recovery, detail, self.start)
            self.runlog.recovery(event)  # the row first: a count the index holds always has its row
            run.recovered(event)
            run.log(f"recovered from losing {self.recovery.describe()}: discarded {event.discarded}; resumed from "
                    f"{event.resumed_from or 'the start (no checkpoint yet)'} at iteration {self.start} in "
                    f"{event.seconds:.1f}s", level="warning")
        if cfg.scheduling.mode == "auto" and cfg.collects:
            self.static = StaticScheduler(plan, cfg, run.run_dir)
            name, sched = self.static.first()
            await plan.configure_rollouts(self.start, sched, name)
        else:
            await plan.configure_rollouts(self.start)
        if cfg.scheduling.dynamic and cfg.collects:
            self.dynamic = DynamicScheduler(plan)
            if self.static is None:
                await self.dynamic.begin()
        where = f"learner on {detail.get('device', 'cpu')}"
        run.log(f"configured {env_spec['env_id']} x{env_spec['num_envs']} (obs {_describe(env_spec['observation_space'])}, "
                f"actions {env_spec['action_space']['kind']}); algorithm {cfg.algorithm.name}, {where}")

    async def retain_replay(self) -> None:
        """What replay keeps across a start or resume follows the algorithm's data access: on-policy batches belong
        to the policy lineage that produced them, so leftovers (a persistent store written after the checkpoint)
        are discarded; a sampled window stays, and only its FIFO of untaken shards is dropped."""
        replay = self.plan.stage("replay")
        before = await rpc(replay, "GetStats", common_pb2.Empty(), 30)
        access = self.spec.data(self.cfg.algorithm)
        when = "resume" if self.resume else "run"
        if access.keeps_window:
            if before.pending_onpolicy:
                await rpc(replay, "Clear", replay_pb2.ClearRequest(source="online", pending_only=True,
                                                                   run_id=self.run.run_id), 30)
            if before.transitions or before.pending_onpolicy:
                self.run.log(f"kept {before.transitions} transitions in the replay window at this {when} "
                             f"({access.kind} sampling); dropped {before.pending_onpolicy} untaken shards")
        elif before.batches:
            await rpc(replay, "Clear", replay_pb2.ClearRequest(source="online", run_id=self.run.run_id), 30)
            self.run.log(f"discarded {before.batches} replay batches ({before.pending_onpolicy} unconsumed) left from "
                         f"before this {when}: on-policy data from another policy lineage", level="warning")

    def restore(self, detail: dict) -> None:
        """Continue where the checkpoint was: iteration, env steps, versions, returns history, wall clock."""
        extra = detail.get("extra", {})
        version = detail["weight_version"]
        self.base_version = self.plan.base_version = int(extra.get("base_version", 0))
        self.start = version - self.base_version
        self.run.env_steps = int(detail.get("env_steps", 0))
        self.run.weight_version = self.start
        self.recent_returns.extend(extra.get("recent_returns", []))
        best = extra.get("best_eval")
        self.best_eval = -math.inf if best is None else float(best)
        self.t0 = time.time() - float(extra.get("wall_time_s", 0.0))
        self.ended_before = bool(extra.get("run_ended", False))
        for reason in detail.get("skipped", []):
            self.run.log(f"skipped checkpoint {reason}; using an older one", level="warning")
        if not detail.get("resumed_from"):
            self.run.log("no checkpoint to resume from yet: the run starts over", level="warning")
            return
        self.run.log(f"resumed from {detail['resumed_from']} at iteration {self.start}, "
                     f"{self.run.env_steps} env steps, weight version {self.start}, "
                     f"{detail.get('optimizer_steps', 0)} optimiser steps")

    async def save_checkpoint(self, key: str = "", periodic: bool = True) -> learner_pb2.CheckpointReply:
        extra = {"base_version": self.base_version, "recent_returns": list(self.recent_returns),
                 "best_eval": self.best_eval if self.best_eval > -math.inf else None,
                 "wall_time_s": time.time() - self.t0, "run_ended": not periodic}
        reply = await rpc(self.plan.stage("learner"), "SaveCheckpoint", learner_pb2.CheckpointRequest(
            key=key, extra_json=json.dumps(extra), periodic=periodic), 120)
        self.run.log(f"checkpoint {reply.uri} ({reply.bytes} bytes, weight version "
                     f"{reply.weight_version - self.base_version})")
        return reply

    # -- an iteration's end --------------------------------------------------------------------------------
    async def observe(self, record: IterationRecord) -> None:
        """The schedulers see the record: mode auto measures candidate plans first, then dynamic scheduling."""
        if self.static is not None and not self.static.done:
            await self.static.observe(record)
            if self.static.done and self.dynamic is not None:
                await self.dynamic.begin()
        elif self.dynamic is not None:
            await self.dynamic.observe(record)

    def checkpoint_due(self, i: int, n_iters: int) -> bool:
        every = self.cfg.checkpoint.every_iterations
        return every > 0 and (i + 1) % every == 0 and i + 1 < n_iters

    def eval_due(self, i: int, n_iters: int) -> bool:
        if not self.plan.rollouts:
            return False  # nothing to evaluate with: an offline run placed no rollout worker
        every = self.cfg.train.eval_every_iterations
        return i + 1 == n_iters or (every > 0 and (i + 1) % every == 0)

    async def evaluate(self) -> rollout_pb2.EvaluateReply:
        """Periodic and final evaluation (and so stop_at_eval_return) act as train.eval_deterministic says."""
        train = self.cfg.train
        return await rpc(self.plan.rollouts[0], "Evaluate",
                         rollout_pb2.EvaluateRequest(episodes=train.eval_episodes,
                                                     stochastic=not train.eval_deterministic))

    def reached(self, ev: rollout_pb2.EvaluateReply | None) -> bool:
        target = self.cfg.train.stop_at_eval_return
        return ev is not None and target is not None and ev.episodes.return_mean >= target

    def eval_values(self, ev: rollout_pb2.EvaluateReply) -> dict[str, float]:
        """An evaluation's columns of a metrics row (and the best evaluation so far follows it)."""
        self.best_eval = max(self.best_eval, ev.episodes.return_mean)
        values = {"eval_return_mean": ev.episodes.return_mean, "eval_return_std": ev.episodes.return_std,
                  "eval_weight_version": ev.weight_version - self.base_version, "eval_seconds": ev.seconds,
                  "eval_deterministic": float(self.cfg.train.eval_deterministic)}  # which actions scored it
        if ev.successes:
            values["eval_success_rate"] = sum(ev.successes) / len(ev.successes)
        return values

    def record(self, step: Step, ev: rollout_pb2.EvaluateReply | None) -> IterationRecord:
        shards, t = step.shards, step.train
        for c in shards:
            self.recent_returns.extend(c.episode_returns)
        now = time.perf_counter()
        iteration_s, self.t_iter = now - self.t_iter, now
        n = max(len(shards), 1)

        def mean(field: str) -> float:
            return sum(getattr(c, field) for c in shards) / n

        sched = self.plan.sched
        row: dict[str, float] = {
            "iteration": step.index + 1, "env_steps": t.env_steps, "wall_time_s": time.time() - self.t0,
            "weight_version": t.weight_version - self.base_version,
            "batch_version": t.batch_version - self.base_version,
            "train_episodes": sum(len(c.episode_returns) for c in shards), "optimizer_steps": t.optimizer_steps,
            "fps": self.cfg.batch_env_steps() / max(iteration_s, 1e-9), "iteration_seconds": iteration_s,
            "collect_seconds": mean("collect_seconds"), "train_seconds": t.train_seconds,
            "env_seconds": mean("env_seconds"), "policy_seconds": mean("policy_seconds"),
            "weight_wait_seconds": mean("weight_wait_seconds"), "train_wait_seconds": t.wait_seconds,
            "rollout_workers": len(self.plan.rollouts),
            "env_workers": 0 if sched.env_in_rollout() else len(self.plan.envs),
            **dict(t.stats),
        }
        if self.recent_returns:
            row["train_return_mean"] = sum(self.recent_returns) / len(self.recent_returns)
        row.update(episode_counts(shards))
        if ev is not None:
            row.update(self.eval_values(ev))
        self.runlog.write(row)
        self.run.metrics(row)
        record = IterationRecord(
            iteration=step.index + 1, plan=step.plan, env_steps=t.env_steps, wall_time_s=row["wall_time_s"],
            iteration_seconds=iteration_s, collect_seconds=row["collect_seconds"], train_seconds=t.train_seconds,
            env_seconds=row["env_seconds"], policy_seconds=row["policy_seconds"],
            weight_wait_seconds=row["weight_wait_seconds"], eval_seconds=row.get("eval_seconds", 0.0),
            evaluated=ev is not None, values=row)
        self.records.append(record)
        return record

    def summary(self, stopped_early: bool) -> str:
        sampled = "" if self.cfg.train.eval_deterministic else " of sampled actions"
        best = f"best eval mean return{sampled} {self.best_eval:.1f}" if self.best_eval > -math.inf else "no eval"
        if self.held_out_row is not None:
            h = self.held_out_row
            rate = f", success {h['held_out_success_rate']:.3f}" if "held_out_success_rate" in h else ""
            best += (f"; held out: mean return {h['held_out_return_mean']:.2f}{rate} over "
                     f"{h['held_out_episodes']} episodes")
        target = self.cfg.train.stop_at_eval_return
        if stopped_early:
            return f"reached eval return >= {target:g} at {self.run.env_steps} env steps ({best})"
        if not self.cfg.collects:
            return f"finished {self.run.iteration} iterations ({best})"
        return f"finished {self.run.env_steps} env steps ({best})"


def _describe(space: dict) -> str:
    if space.get("kind") == "dict":
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in space["spaces"].items()) + "}"
    if space.get("kind") == "text":
        return f"text[<={space.get('max_length')} bytes]"
    return f"{space.get('dtype', '')}{space.get('shape', [])}"
