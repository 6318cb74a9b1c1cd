"""StaticScheduler (``scheduling.mode: auto``): profile the stages, predict every candidate plan with the cluster
simulator, run the fastest, and say why.

1. Profile: run a few real training iterations under the collocated plan (env in the rollout process: pure env
   and policy costs) and under a pipelined plan (env service, chunks: IPC and per-env policy costs); fit a
   ``StageProfile`` from the measured stage times.
2. Predict every candidate plan's iteration time on this host with ``simulator.simulate``.
3. Measure every candidate for a few iterations too (each is real, on-policy training within the run's
   staleness bound, so nothing is thrown away) and print the decision table: predicted and measured seconds per
   iteration. The predicted-best plan runs from then on, unless it measured over ``OVERRIDE`` slower than the
   measured-best one: then measurement wins, and the table says so (the model was wrong about this workload).
The profile and the table are written to ``<run_dir>/plan.json`` for ``rlfabric plan --profile``.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict
from pathlib import Path

from rlfabric.services.coordinator.records import IterationRecord, PlanControl
from rlfabric.services.coordinator.simulator import PlanShape, Pool, StageProfile, simulate
from rlfabric.services.core.config import RunConfig, SchedulingConfig

OVERRIDE = 0.10


def candidates(sched: SchedulingConfig) -> dict[str, SchedulingConfig]:
    """The run's candidate plans (its own rollout workers, chunks and staleness: the scheduler picks where stages
    run, never the algorithm). Names: which stages share a pool, '|' between pools."""
    base = json.loads(sched.model_dump_json())
    base.update(env_placement="auto", pools={})
    plans = {
        "collocated": {"mode": "collocated"},
        "hybrid env+rollout|learner": {"mode": "hybrid", "pipeline_chunks": 1,
                                       "placement": {"env": "a", "rollout": "a", "learner": "b"}},
        "hybrid env|rollout+learner": {"mode": "hybrid", "placement": {"env": "a", "rollout": "b", "learner": "b"}},
        "disaggregated": {"mode": "disaggregated"},
    }
    wanted = sched.candidates or list(plans)
    unknown = [n for n in wanted if n not in plans]
    if unknown:
        raise ValueError(f"scheduling.candidates names unknown plan(s) {unknown}; known: {list(plans)}")
    return {name: SchedulingConfig.model_validate({**base, **plans[name]}) for name in wanted}


def shape(name: str, sched: SchedulingConfig, num_envs: int, n_steps: int, workers: int, env_workers: int) -> PlanShape:
    """The simulator's view of a plan on this host: every process shares the host's cores (one pool)."""
    in_rollout = sched.env_in_rollout()
    return PlanShape(name=name, num_envs=num_envs, n_steps=n_steps, rollout_workers=workers,
                     env_in_rollout=in_rollout, env_workers=0 if in_rollout else min(env_workers, workers),
                     chunks=sched.chunks(), learner_overlaps=sched.learner_overlaps(),
                     staleness=sched.effective_staleness(),
                     placement={"env": "host", "rollout": "host", "learner": "host"})


def steady(rows: list[IterationRecord]) -> list[IterationRecord]:
    """The measured iterations of a plan: without its first (re-planning, pipeline fill) and evaluated ones."""
    rest = rows[1:] or rows
    return [r for r in rest if not r.evaluated] or rest


def iteration_time(rows: list[IterationRecord]) -> float:
    """A plan's seconds per iteration: wall clock over its iterations after the first, evaluations excluded. Wall
    clock, not a per-row median: a streaming plan records iterations in bursts as shards arrive."""
    if len(rows) < 2:
        return rows[0].iteration_seconds
    evals = sum(r.eval_seconds for r in rows[1:])
    return (rows[-1].wall_time_s - rows[0].wall_time_s - evals) / (len(rows) - 1)


def fit_profile(n_steps: int, shard_envs: int, chunks: int, turns: list[IterationRecord],
                piped: list[IterationRecord] | None, num_envs: int | None = None,
                ipc_s: float | None = None) -> StageProfile:
    """Stage costs from measured iterations. ``turns``: the collocated plan's (env in process); ``piped``: those of
    a plan whose env service pipelines ``chunks`` chunks (None when no such plan was profiled)."""
    def med(rows: list[IterationRecord], key: str) -> float:
        return statistics.median(getattr(r, key) for r in rows)

    T, n = n_steps, shard_envs
    num_envs = num_envs or n
    policy_full = med(turns, "policy_seconds") / T  # one act call on the whole shard
    env_full = max(0.0, med(turns, "collect_seconds") - med(turns, "policy_seconds")) / T
    per_env, call = 0.0, policy_full
    ipc = 0.0
    if piped and chunks > 1:
        policy_chunk = med(piped, "policy_seconds") / (T * chunks)  # one act call on n / chunks envs
        per_env = max(0.0, (policy_full - policy_chunk) / (n - n / chunks))
        call = max(0.0, policy_full - per_env * n)
    if ipc_s is not None:  # probed: the round trip of a step-sized message to the env service
        ipc = ipc_s
    elif piped and chunks > 1:
        # what the pipelined collection took beyond its compute, per env message (overlap makes this a floor)
        extra = med(piped, "collect_seconds") - med(piped, "policy_seconds") - T * env_full
        ipc = max(0.0, extra / (T * chunks))
    elif piped:
        ipc = max(0.0, (med(piped, "collect_seconds") - T * (policy_full + env_full)) / T)
    train = med(turns, "train_seconds")  # the learner alone: a pipelined plan shares its cores
    # the update's cost scales with the batch (minibatch epochs over T * N transitions): per transition, so a
    # plan with data-parallel learner ranks divides it
    return StageProfile(env_step_s=env_full / n, policy_call_s=call, policy_per_env_s=per_env, ipc_s=ipc,
                        train_s_per_transition=train / (T * num_envs),
                        sync_s=med(turns, "weight_wait_seconds"))


def control_overhead(turns: list[IterationRecord]) -> float:
    """Per-iteration time no stage accounts for (control-plane round trips, recording): measured in the plan whose
    stages take turns, where it is the iteration minus its stage times; added to every prediction."""
    return max(0.0, statistics.median(r.iteration_seconds - r.collect_seconds - r.train_seconds
                                      - r.weight_wait_seconds for r in turns))


class StaticScheduler:
    """Runs each candidate plan for ``profile_iterations`` (+1 warm-up) real iterations, in this order: collocated
    and disaggregated first (the profile needs both), then the others; then decides, and the chosen plan runs from
    the next boundary. Driven by the training loop: ``first()`` names the plan to start with, ``observe()`` sees
    every recorded iteration until ``done``."""

    def __init__(self, control: PlanControl, cfg: RunConfig, run_dir: Path):
        self.control, self.cfg, self.run_dir = control, cfg, run_dir
        self.iterations = cfg.scheduling.profile_iterations
        self.plans = candidates(cfg.scheduling)
        self.every = candidates(cfg.scheduling.model_copy(update={"candidates": []}))
        self.order = ["collocated", "disaggregated"] + [n for n in self.plans
                                                        if n not in ("collocated", "disaggregated")]
        self.measured: dict[str, list[IterationRecord]] = {name: [] for name in self.order}
        self.current = 0
        self.ipc: float | None = None
        self.decisions: list[dict] = []
        self.done = False

    def first(self) -> tuple[str, SchedulingConfig]:
        name = self.order[0]
        return name, self.every[name]

    async def observe(self, record: IterationRecord) -> None:
        if self.done:
            return
        if record.plan in self.measured:
            self.measured[record.plan].append(record)
        name = self.order[self.current]
        if len(self.measured[name]) < self.iterations + 1:
            return
        if self.ipc is None and not self.every[name].env_in_rollout():
            self.ipc = await self.control.probe_ipc()  # while the plan with an env service is still in place
        self.current += 1
        if self.current < len(self.order):
            nxt = self.order[self.current]
            await self.control.request_plan(self.every[nxt], nxt)
            return
        self.done = True
        chosen = self.decide(record.iteration)
        await self.control.request_plan(self.plans[chosen], chosen)

    def decide(self, iteration: int = 0) -> str:
        """Pick the plan from the measurements (after iteration ``iteration``; the choice runs from the next)."""
        cfg, control = self.cfg, self.control
        T, N = cfg.spec.steps_per_env(cfg.algorithm), cfg.env.num_envs
        W, E = control.rollout_workers, control.env_workers
        profile = fit_profile(T, N // W, self.every["disaggregated"].chunks(), steady(self.measured["collocated"]),
                              steady(self.measured["disaggregated"]), N, self.ipc)
        host = {"host": Pool("host", max(1, os.cpu_count() or 1))}
        overhead = control_overhead(steady(self.measured["collocated"]))
        table = []
        for name, sched in self.plans.items():
            pred = simulate(profile, shape(name, sched, N, T, W, E), host, iterations=max(4, 2 + sched.staleness + 2))
            table.append({"plan": name, "predicted_s": pred.iteration_s + overhead,
                          "measured_s": iteration_time(self.measured[name]), "description": control.describe(sched)})
        best_predicted = min(table, key=lambda r: r["predicted_s"])
        best_measured = min(table, key=lambda r: r["measured_s"])
        chosen, why = best_predicted, "fastest predicted"
        if best_predicted["measured_s"] > (1 + OVERRIDE) * best_measured["measured_s"]:
            chosen, why = best_measured, (f"fastest measured (the predicted best, {best_predicted['plan']}, measured "
                                          f"{best_predicted['measured_s'] / best_measured['measured_s']:.2f}x slower)")
        for row in table:
            row["chosen"] = row is chosen
        self.decisions = table
        lines = [f"{'plan':<28} {'predicted s/it':>14} {'measured s/it':>14}"]
        lines += [f"{r['plan']:<28} {r['predicted_s']:>14.4f} {r['measured_s']:>14.4f}"
                  f"{'  <- chosen' if r['chosen'] else ''}" for r in table]
        control.log("static scheduler decision (" + why + "):\n" + "\n".join(lines))
        (self.run_dir / "plan.json").write_text(json.dumps(
            {"profile": asdict(profile), "control_overhead_s": overhead, "decisions": table, "chosen": chosen["plan"],
             "why": why, "decided_after_iteration": iteration, "host_cores": host["host"].units, "num_envs": N,
             "n_steps": T, "rollout_workers": W},
            indent=2))
        return chosen["plan"]
