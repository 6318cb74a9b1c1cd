"""Discrete-event cluster simulator: predict an execution plan's iteration time and env steps/s from stage profiles.

The static scheduler ranks plans with it and ``rlfabric plan`` prints its predictions. It replays the one logical
workflow ``rollout (env <-> policy) -> train -> publish weights (epoch N+1)`` as the real system executes it,
process by process, on pools of units (CPU cores or GPUs) measured on one machine and scaled to bigger clusters.

The model, top to bottom (each item is one function below):
  pools          a pool is a FIFO ``simpy.Resource`` with one slot per unit. Every process (env worker, rollout
                 worker, learner rank) is single-threaded: it holds one unit of its stage's pool for one compute
                 segment (one act call, one vector-env step, one weight load, one update) and queues FIFO when
                 all units are busy. Stages on the same pool therefore share its units; on 1 unit they serialize.
  rollout worker per batch: wait for the weight version the batch may use, load it if newer (sync_s), then for
                 each step and each env chunk: act on the chunk, then step it, in-process (env_in_rollout) or by
                 sending it to its env worker, so the policy acts on chunk c+1 while the env steps chunk c.
  env worker     steps the chunks sent to it in arrival order (env_call_s + env_step_s * envs + ipc_s).
  learner        update i starts once all W shards of batch i arrived and update i-1 finished; its L ranks each
                 train on T*N/L transitions, meet, all-reduce; then weight version i+1 exists.
  gating         batch i may use version >= i - k (k = staleness when learner_overlaps, else 0 = take turns).

Choices and limits, stated so the numbers are read right:
  * FIFO per segment, not processor sharing: the OS time-slices a core, we hand it out a segment at a time. Work is
    conserved, so a saturated pool gives the same throughput; latency through a shared pool is coarser (a long
    update holds its unit for its whole length where the OS would interleave acts with it).
  * No memory, offload/onload (context switch), network bandwidth or scheduling jitter: only the profile's timings.
    IPC is charged to the env worker per step message, weight sync to the rollout worker, both as profiled.
  * The value bootstrap on the last observation, GAE and episode resets are taken to be inside the profiled costs.
  * Steady state = the mean spacing of update completions after a warm-up of 1 + k updates (the pipeline fill).
  * Cost is one simpy event per segment or hand-off, so big clusters are folded: a plan whose worker counts and
    pool sizes share a factor g (and whose envs split evenly) runs as one of g identical replicas (``fold``), and
    ``rank`` simulates plans that differ only in which of several equal pools they use once.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace

import simpy

STAGES = ("env", "rollout", "learner")


@dataclass(frozen=True)
class StageProfile:              # measured on the real machine, per process, 1 CPU core (or 1 GPU)
    env_step_s: float            # simulation seconds per env per step (vector env cost grows linearly with envs)
    env_call_s: float = 0.0      # fixed seconds per vector-step call (python overhead)
    policy_call_s: float = 0.0   # fixed seconds per batched act call
    policy_per_env_s: float = 0.0  # extra act seconds per env row in a call
    ipc_s: float = 0.0           # seconds added per env step message when env and policy live in different processes
    train_s_per_transition: float = 0.0  # learner seconds per transition of a batch (one device)
    train_call_s: float = 0.0    # fixed learner seconds per update
    sync_s: float = 0.0          # seconds for a rollout worker to fetch + load one weight version
    device: str = "cpu"          # "cpu" or "gpu": what one unit of a pool means for these timings


@dataclass(frozen=True)
class Pool:
    name: str
    units: int                   # CPU cores or GPUs in the pool


@dataclass(frozen=True)
class PlanShape:                 # a compiled execution plan, as the simulator needs it
    name: str
    num_envs: int                # N, total envs of one batch
    n_steps: int                 # T, steps per env per batch (batch = T * N transitions)
    rollout_workers: int         # W processes acting (each gets N / W envs, uneven split allowed)
    env_in_rollout: bool         # env simulated inside the rollout process (no IPC, no env/policy overlap)
    env_workers: int             # env-service processes when not env_in_rollout (rollout worker w uses env worker w % E)
    chunks: int                  # env chunks per rollout worker pipelined against inference (1 = plain act/step)
    learner_overlaps: bool       # learner on its own workers, consuming a stream (True) or taking turns with rollout (False)
    staleness: int               # k: batch i may be produced with weight version >= i - k (0 = on-policy)
    placement: dict[str, str]    # stage ("env", "rollout", "learner") -> pool name
    learner_workers: int = 1     # data-parallel learner ranks (each a unit of the learner's pool)
    allreduce_s: float = 0.0     # per-update gradient all-reduce seconds when learner_workers > 1


@dataclass(frozen=True)
class Segment:
    """One compute segment of the timeline: a process held a unit of ``pool`` from ``start`` to ``end``."""

    process: str                 # "rollout3", "env0", "learner1"
    pool: str
    what: str                    # "act", "env", "sync", "train", "allreduce"
    batch: int
    start: float
    end: float


@dataclass(frozen=True)
class Prediction:
    iteration_s: float           # steady-state seconds per iteration (one batch trained and published)
    env_steps_per_s: float       # T * N / iteration_s
    utilisation: dict[str, float]  # pool -> busy unit-seconds / (units * seconds), over the steady-state window
    update_done_s: tuple[float, ...] = ()  # when each update finished (simulated seconds from start)
    replicas: int = 1            # identical replicas the cluster was folded into (see fold)
    timeline: tuple[Segment, ...] | None = field(default=None, compare=False)

    @property
    def bottleneck(self) -> str:
        """The busiest pool: the first place to add units."""
        return max(sorted(self.utilisation), key=lambda p: self.utilisation[p])

    def describe(self) -> str:
        util = ", ".join(f"{p} {u:.0%}" for p, u in self.utilisation.items())
        return f"{self.iteration_s:.4g} s/iteration, {self.env_steps_per_s:,.0f} env steps/s (busy: {util})"


# ---------------------------------------------------------------------------------------------------------------
# the model


def split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as possible, the first ones getting the rest (as shard_sizes)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class Units:
    """A pool's units: a FIFO resource plus the integral of busy units over time, for utilisation."""

    def __init__(self, sim: simpy.Environment, name: str, units: int, processes: int):
        self.sim, self.name, self.units = sim, name, units
        self.resource = simpy.Resource(sim, capacity=units)
        self.queues = processes > units  # else nobody ever waits: skip the resource (same times, fewer events)
        self.busy = 0            # units held now
        self.area = 0.0          # busy unit-seconds up to self.last
        self.last = 0.0

    def mark(self, delta: int = 0) -> float:
        """Bring the busy integral up to now, then change the busy count by ``delta``; returns the integral."""
        now = self.sim.now
        self.area += self.busy * (now - self.last)
        self.last = now
        self.busy += delta
        return self.area


class Cluster:
    """One simulated run of a plan: simpy processes for every env worker, rollout worker and learner rank."""

    def __init__(self, profile: StageProfile, plan: PlanShape, pools: dict[str, Pool], iterations: int,
                 allreduce_s: float, keep_timeline: bool):
        self.p, self.plan, self.iterations, self.allreduce_s = profile, plan, iterations, allreduce_s
        self.sim = simpy.Environment()
        # the env runs inside the rollout process when env_in_rollout: it uses the rollout worker's unit
        self.pool_of = {"rollout": plan.placement["rollout"], "learner": plan.placement["learner"],
                        "env": plan.placement["rollout" if plan.env_in_rollout else "env"]}
        processes = dict.fromkeys(pools, 0)
        processes[self.pool_of["rollout"]] += plan.rollout_workers
        processes[self.pool_of["learner"]] += plan.learner_workers
        if not plan.env_in_rollout:
            processes[self.pool_of["env"]] += plan.env_workers
        self.units = {name: Units(self.sim, name, pool.units, processes[name]) for name, pool in pools.items()}
        self.timeline: list[Segment] | None = [] if keep_timeline else None
        # weight versions: version 0 exists at start, update i publishes version i + 1
        self.version = 0
        self.version_ready = [self.sim.event() for _ in range(iterations + 1)]
        self.version_ready[0].succeed()
        self.shards = [0] * iterations
        self.batch_ready = [self.sim.event() for _ in range(iterations)]
        self.done: list[float] = []                # when each update finished
        self.areas: list[dict[str, float]] = []    # busy unit-seconds per pool at those moments
        self.env_inbox = [simpy.Store(self.sim) for _ in range(0 if plan.env_in_rollout else plan.env_workers)]

    def compute(self, process: str, stage: str, what: str, seconds: float, batch: int):
        """A single-threaded process holds one unit of its stage's pool for ``seconds`` (FIFO when all are busy)."""
        if seconds <= 0:
            return
        units = self.units[self.pool_of[stage]]
        if units.queues:
            with units.resource.request() as granted:
                yield granted
                units.mark(+1)
                yield self.sim.timeout(seconds)
                units.mark(-1)
        else:
            units.mark(+1)
            yield self.sim.timeout(seconds)
            units.mark(-1)
        if self.timeline is not None:
            self.timeline.append(Segment(process, units.name, what, batch, self.sim.now - seconds, self.sim.now))

    def needs_version(self, i: int) -> int:
        """Batch i may be produced with version >= i - k; taking turns is k = 0 (train on i-1 before collecting i)."""
        k = self.plan.staleness if self.plan.learner_overlaps else 0
        return max(0, i - k)

    def rollout_worker(self, w: int, envs: int):
        plan, p, name = self.plan, self.p, f"rollout{w}"
        chunks = split(envs, 1 if plan.env_in_rollout else min(plan.chunks, envs))
        stepped = [self.sim.event().succeed() for _ in chunks]  # each chunk's latest observation is in
        loaded = 0
        for i in range(self.iterations):
            yield self.version_ready[self.needs_version(i)]
            if self.version > loaded:  # fetch + load the newest version before acting on the batch
                yield from self.compute(name, "rollout", "sync", p.sync_s, i)
                loaded = self.version
            for _ in range(plan.n_steps):
                for c, n in enumerate(chunks):
                    yield stepped[c]  # act on chunk c once its previous step is back
                    yield from self.compute(name, "rollout", "act", p.policy_call_s + p.policy_per_env_s * n, i)
                    if plan.env_in_rollout:
                        yield from self.compute(name, "env", "env", p.env_call_s + p.env_step_s * n, i)
                    else:  # hand the actions over and go on to the next chunk while the env steps this one
                        stepped[c] = self.sim.event()
                        self.env_inbox[w % plan.env_workers].put((n, stepped[c], i))
            yield self.sim.all_of(stepped)  # the shard is complete once its last step is back
            self.shards[i] += 1
            if self.shards[i] == plan.rollout_workers:
                self.batch_ready[i].succeed()

    def env_worker(self, e: int):
        p, inbox = self.p, self.env_inbox[e]
        while True:
            n, stepped, batch = yield inbox.get()
            yield from self.compute(f"env{e}", "env", "env", p.env_call_s + p.env_step_s * n + p.ipc_s, batch)
            stepped.succeed()

    def learner(self):
        plan, p, ranks = self.plan, self.p, self.plan.learner_workers
        per_rank = p.train_call_s + p.train_s_per_transition * plan.n_steps * plan.num_envs / ranks
        for i in range(self.iterations):
            yield self.batch_ready[i]
            yield self.sim.all_of([self.sim.process(self.compute(f"learner{r}", "learner", "train", per_rank, i))
                                   for r in range(ranks)])
            if self.allreduce_s > 0:  # every rank has its gradients: all-reduce them (a barrier, on every unit)
                yield self.sim.all_of([self.sim.process(self.compute(
                    f"learner{r}", "learner", "allreduce", self.allreduce_s, i)) for r in range(ranks)])
            self.version = i + 1
            self.version_ready[i + 1].succeed()
            self.done.append(self.sim.now)
            self.areas.append({name: u.mark() for name, u in self.units.items()})

    def run(self) -> None:
        for e in range(len(self.env_inbox)):
            self.sim.process(self.env_worker(e))
        for w, envs in enumerate(split(self.plan.num_envs, self.plan.rollout_workers)):
            self.sim.process(self.rollout_worker(w, envs))
        self.sim.run(until=self.sim.process(self.learner()))


def fold(plan: PlanShape, pools: dict[str, Pool]) -> tuple[PlanShape, dict[str, Pool], int]:
    """A symmetric plan is g identical replicas: replica r holds the rollout workers w = r mod g, the env workers
    they use (w % E = r mod g too), L/g learner ranks and 1/g of every pool the plan uses. Simulating one replica
    is exact for processes pinned to their replica's units (as GPU workers are); for a pooled FIFO it differs only
    in how simultaneous requests of different replicas are ordered. It is what makes 64-GPU plans cheap."""
    used = {plan.placement[s] for s in ("rollout", "learner") + (() if plan.env_in_rollout else ("env",))}
    counts = [plan.rollout_workers, plan.learner_workers] + [pools[name].units for name in used]
    if not plan.env_in_rollout:
        counts.append(plan.env_workers)
    g = math.gcd(*counts)
    if g == 1 or plan.num_envs % plan.rollout_workers:  # uneven shards are not identical replicas
        return plan, pools, 1
    small = replace(plan, num_envs=plan.num_envs // g, rollout_workers=plan.rollout_workers // g,
                    env_workers=plan.env_workers if plan.env_in_rollout else plan.env_workers // g,
                    learner_workers=plan.learner_workers // g)
    return small, {n: Pool(n, p.units // g) if n in used else p for n, p in pools.items()}, g


def simulate(profile: StageProfile, plan: PlanShape, pools: dict[str, Pool], iterations: int = 8,
             keep_timeline: bool = False, fold_replicas: bool = True) -> Prediction:
    """Run ``iterations`` batches of the plan and average the steady state (after 1 + k warm-up updates).
    ``fold_replicas`` simulates one of g identical replicas (see ``fold``); the timeline is then that replica's."""
    check(profile, plan, pools, iterations)
    small, small_pools, g = fold(plan, pools) if fold_replicas else (plan, pools, 1)
    allreduce_s = plan.allreduce_s if plan.learner_workers > 1 else 0.0
    cluster = Cluster(profile, small, small_pools, iterations, allreduce_s, keep_timeline)
    cluster.run()
    k = plan.staleness if plan.learner_overlaps else 0
    warm = min(1 + k, iterations - 1)  # the update ending the warm-up starts the measured window
    t0, t1 = cluster.done[warm - 1], cluster.done[-1]
    iteration_s = (t1 - t0) / (iterations - warm)
    a0, a1 = cluster.areas[warm - 1], cluster.areas[-1]
    utilisation = {name: (a1[name] - a0[name]) / (pool.units * (t1 - t0)) if t1 > t0 else 0.0
                   for name, pool in small_pools.items()}
    return Prediction(
        iteration_s=iteration_s,
        env_steps_per_s=plan.n_steps * plan.num_envs / iteration_s if iteration_s > 0 else math.inf,
        utilisation=utilisation,
        update_done_s=tuple(cluster.done),
        replicas=g,
        timeline=tuple(cluster.timeline) if cluster.timeline is not None else None,
    )


def check(profile: StageProfile, plan: PlanShape, pools: dict[str, Pool], iterations: int) -> None:
    """Refuse inputs the model cannot mean anything for, naming the field and the fix."""
    def bad(msg: str) -> ValueError:
        return ValueError(f"plan {plan.name!r}: {msg}")

    if profile.device not in ("cpu", "gpu"):
        raise ValueError(f"StageProfile.device={profile.device!r}: expected 'cpu' or 'gpu'")
    negative = [k for k, v in vars(profile).items() if isinstance(v, float | int) and v < 0]
    if negative:
        raise ValueError(f"StageProfile has negative timings: {', '.join(negative)}")
    if iterations < 2:
        raise ValueError(f"iterations={iterations}: need at least 2 (one warm-up, one measured)")
    for name, pool in pools.items():
        if pool.units < 1:
            raise ValueError(f"pool {name!r} has {pool.units} units; a pool needs at least 1")
    needed = ("rollout", "learner") if plan.env_in_rollout else STAGES
    missing = [s for s in needed if s not in plan.placement]
    if missing:
        raise bad(f"placement lacks stage(s) {missing}; expected stage -> pool for {', '.join(needed)}")
    unknown = sorted({plan.placement[s] for s in needed} - set(pools))
    if unknown:
        raise bad(f"placement uses pool(s) {unknown} not in the cluster ({', '.join(pools)})")
    if plan.env_in_rollout and plan.placement.get("env", plan.placement["rollout"]) != plan.placement["rollout"]:
        raise bad("env_in_rollout puts the env in the rollout process, but placement puts env on "
                  f"{plan.placement['env']!r} and rollout on {plan.placement['rollout']!r}")
    if plan.n_steps < 1 or plan.rollout_workers < 1 or plan.chunks < 1 or plan.learner_workers < 1:
        raise bad("n_steps, rollout_workers, chunks and learner_workers must each be >= 1")
    if plan.num_envs < plan.rollout_workers:
        raise bad(f"num_envs={plan.num_envs} < rollout_workers={plan.rollout_workers}: every worker needs an env")
    if not plan.env_in_rollout and plan.env_workers < 1:
        raise bad("env_workers must be >= 1 when the env runs as its own service")
    if plan.staleness < 0:
        raise bad(f"staleness={plan.staleness} must be >= 0")


def rank(profile: StageProfile, plans: list[PlanShape], pools: dict[str, Pool],
         iterations: int = 8) -> list[tuple[PlanShape, Prediction]]:
    """Every plan's prediction, fastest (most env steps/s) first; ties keep the given order. Plans that differ only
    in which of several equal pools they use predict alike, so each such shape is simulated once."""
    cache: dict[str, Prediction] = {}
    ranked = []
    for plan in plans:
        check(profile, plan, pools, iterations)
        used = list(dict.fromkeys(plan.placement[s] for s in STAGES if s in plan.placement))
        label = {name: f"pool{i}" for i, name in enumerate(used)}
        shape = replace(plan, name="", placement={s: label[plan.placement[s]] for s in STAGES if s in plan.placement})
        shape_pools = {label[name]: Pool(label[name], pools[name].units) for name in used}
        key = repr((shape, shape_pools))
        if key not in cache:
            cache[key] = simulate(profile, shape, shape_pools, iterations)
        pred = cache[key]
        utilisation = {name: pred.utilisation[label[name]] if name in label else 0.0 for name in pools}
        ranked.append((plan, replace(pred, utilisation=utilisation)))
    return sorted(ranked, key=lambda pp: -pp[1].env_steps_per_s)


# ---------------------------------------------------------------------------------------------------------------
# plans and clusters


def candidate_plans(num_envs: int, n_steps: int, pools: dict[str, Pool], max_chunks: int = 4,
                    staleness_options: tuple[int, ...] = (0, 1)) -> list[PlanShape]:
    """The sensible shapes for these pools. A stage alone on a pool gets one process per unit; env and rollout
    pipelined on one pool split it (rollout ceil(u/2), env the rest); an env service on its own pool is served by
    as many rollout workers as the rollout pool has units, and also by one rollout worker per env worker (the
    rollout pool oversubscribed). Chunk counts divide every worker's envs (the real config requires it); a learner
    on its own pool streams with each staleness option, one sharing the rollout pool may also take turns.

      collocated     everything on one pool, env in the rollout process, learner takes turns
      hybrid         env+rollout on one pool (in-process, or pipelined chunks with an env worker), learner on
                     another; or env alone on one pool, rollout+learner on another
      disaggregated  env, rollout and learner on three distinct pools; with two pools, the split not covered by
                     the hybrids (env+learner | rollout); with one pool, separate pipelined processes sharing it
    """
    if num_envs < 1 or n_steps < 1 or max_chunks < 1 or not pools:
        raise ValueError("candidate_plans needs num_envs, n_steps, max_chunks >= 1 and at least one pool")
    units = {name: pool.units for name, pool in pools.items()}
    streams = [(True, k) for k in staleness_options]
    turns_or_streams = [(False, 0)] + streams
    plans: list[PlanShape] = []

    def chunk_options(workers: int, least: int = 1) -> list[int]:
        shards = set(split(num_envs, workers))
        return [c for c in range(least, max_chunks + 1) if all(s % c == 0 for s in shards)]

    def add(kind: str, env_in_rollout: bool, placement: dict[str, str], w: int, e: int, c: int,
            mode: tuple[bool, int], ranks: int) -> None:
        w = min(w, num_envs)
        overlaps, k = mode
        groups: dict[str, list[str]] = {}
        for stage in STAGES:
            if stage in placement:
                groups.setdefault(placement[stage], []).append(stage)
        where = " | ".join(f"{'+'.join(s)}@{pool}" for pool, s in groups.items())
        env = "env in-process" if env_in_rollout else f"E={e} chunks={c}"
        sched = f"stream k={k}" if overlaps else "turns"
        plans.append(PlanShape(
            name=f"{kind} {where} W={w} {env} L={ranks} {sched}", num_envs=num_envs, n_steps=n_steps,
            rollout_workers=w, env_in_rollout=env_in_rollout, env_workers=0 if env_in_rollout else e,
            chunks=1 if env_in_rollout else c, learner_overlaps=overlaps, staleness=k, placement=placement,
            learner_workers=ranks))

    def serving(rollout_units: int, env_workers: int) -> list[int]:
        """Rollout worker counts for a separate env service: one per rollout unit, or one per env worker."""
        return sorted({min(rollout_units, num_envs), min(max(rollout_units, env_workers), num_envs)})

    for x in units:
        add("collocated", True, {"env": x, "rollout": x, "learner": x}, units[x], 0, 1, (False, 0), units[x])
    for x, y in itertools.permutations(units, 2):
        for mode in streams:  # env+rollout on x, learner on y
            add("hybrid", True, {"env": x, "rollout": x, "learner": y}, units[x], 0, 1, mode, units[y])
            w, e = math.ceil(units[x] / 2), max(1, units[x] // 2)
            for c in chunk_options(w, least=2):
                add("hybrid", False, {"env": x, "rollout": x, "learner": y}, w, e, c, mode, units[y])
        for w in serving(units[y], units[x]):  # env alone on x, rollout+learner on y
            for c, mode in itertools.product(chunk_options(w), turns_or_streams):
                add("hybrid", False, {"env": x, "rollout": y, "learner": y}, w, units[x], c, mode, units[y])
    if len(units) >= 3:
        for x, y, z in itertools.permutations(units, 3):
            for w in serving(units[y], units[x]):
                for c, mode in itertools.product(chunk_options(w), streams):
                    add("disaggregated", False, {"env": x, "rollout": y, "learner": z}, w, units[x], c, mode,
                        units[z])
    elif len(units) == 2:
        for x, y in itertools.permutations(units, 2):  # env+learner on x, rollout on y
            for w in serving(units[y], units[x]):
                for c, mode in itertools.product(chunk_options(w), streams):
                    add("disaggregated", False, {"env": x, "rollout": y, "learner": x}, w, units[x], c, mode,
                        units[x])
    else:
        (x,) = units
        w, e = math.ceil(units[x] / 2), max(1, units[x] // 2)
        for c, mode in itertools.product(chunk_options(w, least=2), streams):
            add("disaggregated", False, {"env": x, "rollout": x, "learner": x}, w, e, c, mode, units[x])
    unique = {plan.name: plan for plan in plans}  # the same shape reached twice (e.g. one env worker per unit)
    return list(unique.values())


_PART = re.compile(r"^\s*([A-Za-z_][\w.-]*)\s*=\s*(\d+)\s*$")


def parse_cluster(spec: str) -> dict[str, Pool]:
    """``"a=1,b=1"``, ``"gpu=8"``, ``"rollout=24,learner=8"`` -> pools by name (units = cores or GPUs)."""
    expected = "expected NAME=UNITS[,NAME=UNITS...] with UNITS a whole number >= 1, e.g. 'rollout=24,learner=8'"
    if not spec or not spec.strip():
        raise ValueError(f"empty cluster spec; {expected}")
    pools: dict[str, Pool] = {}
    for part in spec.split(","):
        m = _PART.match(part)
        if not m:
            raise ValueError(f"bad cluster part {part.strip()!r} in {spec!r}; {expected}")
        name, units = m.group(1), int(m.group(2))
        if units < 1:
            raise ValueError(f"bad cluster part {part.strip()!r} in {spec!r}: pool {name!r} needs at least 1 unit")
        if name in pools:
            raise ValueError(f"bad cluster part {part.strip()!r} in {spec!r}: pool {name!r} is declared twice")
        pools[name] = Pool(name, units)
    return pools
