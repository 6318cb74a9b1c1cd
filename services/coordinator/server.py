"""The coordinator's gRPC face: the worker registry (register, heartbeats, reaping) and the run API
(submit, get, list, watch, stop). Runs execute as asyncio tasks driving workers over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import math
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from rlfabric.services.coordinator import warm_start
from rlfabric.services.coordinator.loop import TrainingLoop
from rlfabric.services.coordinator.recovery import Loss, unreachable
from rlfabric.services.coordinator.registry import RegistryFull, Worker, WorkerRegistry
from rlfabric.services.coordinator.run import Run, RunFailed, StopRequested, WorkerLost
from rlfabric.services.coordinator.runindex import RUN_INDEX_ERRORS, RunIndex
from rlfabric.services.core.config import ConfigError, RunConfig, parse_config
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime, run_service

log = logging.getLogger(__name__)
STOP_GRACE_S = 60.0  # a stop waits this long for an iteration boundary before cancelling


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, runtime: ServiceRuntime, runs_root: str, heartbeat_timeout_s: float,
                 max_active_runs: int = 64, max_watchers: int = 256, max_kept_runs: int = 1000,
                 take_up_runs: bool = True):
        self.runtime = runtime
        self.max_active_runs, self.max_watchers, self.max_kept_runs = max_active_runs, max_watchers, max_kept_runs
        self.runs_root = Path(runs_root)
        self.registry = WorkerRegistry(heartbeat_interval_s=min(0.5, heartbeat_timeout_s / 4),
                                       heartbeat_timeout_s=heartbeat_timeout_s)
        self.runs: dict[str, Run] = {}
        self.index = RunIndex(self.runs_root)
        self.earlier: list[dict] = []  # index records this coordinator does not run (finished, or not taken up)
        self.dashboard = None  # the web dashboard (dashboard.py), unless --dashboard-port -1
        self.reaper = asyncio.get_event_loop().create_task(self._reap())
        runtime.on_shutdown(self.shutdown)
        self._take_up_recorded_runs(take_up_runs)

    # -- the run index: a restarted coordinator takes up the runs it held ----------------------------------
    def _record(self) -> None:
        """The run index now. On the event loop, never in a thread: it reads ``self.runs``, which the loop changes,
        and two writers would share the index's temporary file (1.6 ms at the bounds: 64 active, 1,000 kept)."""
        self.index.save([rec for rec in self.earlier if rec["run_id"] not in self.runs] + [
            # (a finished run's config is in its run directory; the index needs none)
            # (secrets redacted: a run taken up again takes them from its workers' environment)
            {"run_id": r.run_id, "run_dir": str(r.run_dir),
             "config_json": "" if r.finished else r.config.redacted().to_json(),
             "state": coordinator_pb2.RunState.Name(r.state), "recoveries": r.recoveries,
             **({"reason": r.reason} if r.finished and r.reason else {})} for r in self.runs.values()
            if not r.parent])  # (a warm_start stage's run is its parent's to take up)

    def _forget_old_runs(self) -> None:
        """Finished runs beyond --max-kept-runs leave memory, oldest first (their directories stay)."""
        finished = [r for r in self.runs.values() if r.finished]
        for run in finished[:max(0, len(finished) - self.max_kept_runs)]:
            del self.runs[run.run_id]

    def _take_up_recorded_runs(self, enabled: bool) -> None:
        """Runs a previous coordinator held and that had not ended: resumed from their newest checkpoints, inside
        the same run ids, as a recovery from the coordinator's loss (an event, a row of recoveries.csv). Not
        ``enabled`` (--take-up-runs no), they stay recorded as they were, for `rlfabric resume` or a later
        coordinator."""
        me = Worker("coordinator", "coordinator", self.runtime.address, "", "", os.getpid(), socket.gethostname())
        for rec in self.index.load():
            if rec["state"] in ("SUCCEEDED", "FAILED", "STOPPED") or not enabled:
                self.earlier.append(rec)
                continue
            try:
                config = RunConfig.from_json(rec["config_json"])
            except (ConfigError, ValueError) as exc:
                # not forgotten: FAILED with the reason, in GetRun/ListRuns and in the index
                RUN_INDEX_ERRORS.labels("invalid_config").inc()
                log.error("cannot take up run %s after a restart: its recorded config does not validate (%s)",
                          rec["run_id"], exc)
                run = Run(str(rec["run_id"]), RunConfig(), Path(str(rec["run_dir"])))
                run.recoveries = int(rec.get("recoveries", 0))
                run.set_state(coordinator_pb2.FAILED, f"not taken up after a coordinator restart: its recorded config "
                              f"no longer validates ({exc}). Fix: resume it with a valid spec (rlfabric resume "
                              f"{rec['run_dir']} --set FIELD=VALUE)")
                self.runs[run.run_id] = run
                continue
            run = Run(rec["run_id"], config, Path(rec["run_dir"]))
            run.recoveries, run.on_recovery = int(rec.get("recoveries", 0)), self._record
            self.runs[run.run_id] = run
            loss = Loss([(me, "restarted: the coordinator that held the run died or was stopped")], -1)
            run.task = asyncio.get_event_loop().create_task(self._execute(run, "if_any", loss))
            log.warning("taking up run %s after a coordinator restart", run.run_id)
        self._record()

    # -- registry ------------------------------------------------------------------------------------------
    async def RegisterWorker(self, request, context):
        try:
            worker = self.registry.register(request)
        except RegistryFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("worker registered", extra={"worker_id": worker.worker_id, "grpc": worker.grpc})
        return coordinator_pb2.RegisterWorkerReply(worker_id=worker.worker_id,
                                                   heartbeat_interval_s=self.registry.heartbeat_interval_s,
                                                   worker_key=worker.key)

    async def Heartbeat(self, request, context):
        try:
            known = self.registry.heartbeat(request.worker_id, request.worker_key,
                                           request.cpu_s if math.isfinite(request.cpu_s) else 0.0, request.messages)
        except PermissionError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        run = self._owning_run(request.worker_id)
        lost = not known and request.worker_id in self.registry.workers  # declared lost, not merely unknown
        return coordinator_pb2.HeartbeatReply(known=known, run_id=run.run_id if run else "",
                                              run_key=run.key if run else "", lost=lost)

    def _owning_run(self, worker_id: str) -> Run | None:
        """The running run that holds this worker, or None."""
        worker = self.registry.workers.get(worker_id)
        run = self.runs.get(worker.run_id) if worker is not None else None
        return run if run is not None and not run.finished else None

    def _owner(self, worker_id: str) -> str:
        """The id of the running run that holds this worker, or ""."""
        run = self._owning_run(worker_id)
        return run.run_id if run is not None else ""

    async def DeregisterWorker(self, request, context):
        owner = self._owner(request.worker_id)
        if owner and not request.force:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker {request.worker_id} is in use by run {owner}: deregistering it would fail "
                                f"that run. Fix: stop the run first (rlfabric stop {owner}), or stop the worker "
                                f"itself (it deregisters with force as it leaves)")
        worker = self.registry.workers.get(request.worker_id)
        if worker is not None and not hmac.compare_digest(worker.key.encode(),
                                                          request.worker_key.encode(errors="replace")):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"deregistering {request.worker_id} takes that "
                                                                   f"worker's key: only the worker itself leaves. "
                                                                   f"Fix: stop the worker's process")
        worker = self.registry.deregister(request.worker_id)
        if worker is not None:
            log.info("worker left", extra={"worker_id": worker.worker_id, "reason": request.reason})
            self._worker_lost(worker, f"left ({request.reason or 'no reason given'})")
        return common_pb2.Empty()

    async def ListWorkers(self, request, context):
        return coordinator_pb2.ListWorkersReply(
            workers=[self.registry.status(w) for w in self.registry.workers.values()])

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for worker in self.registry.reap():
                log.warning("worker missed heartbeats", extra={"worker_id": worker.worker_id})
                try:
                    self._worker_lost(worker, f"stopped sending heartbeats for "
                                              f"{self.registry.heartbeat_timeout_s:.1f}s (crashed or unreachable)")
                except Exception:  # noqa: BLE001 — the reaper must outlive any one run's bookkeeping
                    log.exception("handling the loss of %s failed", worker.worker_id)

    def _worker_lost(self, worker, why: str) -> None:
        run = self.runs.get(worker.run_id)
        if run is not None and not run.finished:
            run.lose(worker, why)

    # -- runs ----------------------------------------------------------------------------------------------
    def confine(self, run_dir: str) -> Path:
        """A client's run_dir as a directory under this coordinator's runs root (a relative one is taken from it);
        anything that resolves elsewhere (an absolute path outside, '..', a symlink out) is a ValueError: a client
        chooses where its run lives among the runs, never where the coordinator writes on its host."""
        root = self.runs_root.resolve()
        path = Path(run_dir)
        path = (path if path.is_absolute() else root / path).resolve()
        if path == root or root not in path.parents:
            raise ValueError(f"run_dir {run_dir!r} is outside this coordinator's runs root {root}. Fix: pass a "
                             f"directory under it (or just a name), or start the coordinator with --runs-root "
                             f"covering it")
        return path

    async def SubmitRun(self, request, context):
        config_yaml = request.config_yaml
        if request.run_dir:
            try:
                confined = self.confine(request.run_dir)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.resume:
            if not request.run_dir:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resume needs run_dir (the run to continue)")
            saved = confined / "config.yaml"
            if not config_yaml and not saved.is_file():
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"cannot resume {request.run_dir}: no config.yaml there (is it a run directory?)")
            config_yaml = config_yaml or saved.read_text()
        try:
            # off the event loop: a big or deep spec must not stall heartbeats and other runs' calls
            config = await asyncio.to_thread(parse_config, config_yaml, "config_yaml", list(request.overrides))
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        refusal = warm_start.vision_refusal(config) if warm_start.needed(config) else None
        if refusal:  # refused before a run exists, as a spec error is
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        if request.run_dir:
            run_dir = confined
            run_id = run_dir.name
        else:
            name = re.sub(r"[^A-Za-z0-9_.-]", "-", config.name)
            run_id = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            run_dir = self.runs_root / run_id
        if run_id in self.runs and not self.runs[run_id].finished:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"run {run_id} is already running")
        active = sum(not r.finished for r in self.runs.values())
        if active >= self.max_active_runs:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{active} runs are waiting or running, the most this coordinator holds "
                                f"(--max-active-runs). Fix: stop one (rlfabric stop RUN_ID) or wait for one to end")
        run = Run(run_id, config, run_dir)
        run.on_recovery = self._record
        run.set_state(coordinator_pb2.PENDING, "waiting for workers")  # a watcher sees the run from the start
        self.runs[run_id] = run
        run.task = asyncio.create_task(self._execute(run, request.resume))
        self._record()
        return run.status()

    async def _acquire(self, run: Run, counts: dict[str, int], wait_s: float | None = None,
                       current: Callable[[], bool] | None = None) -> dict[str, list]:
        """``counts[role]`` idle workers per role for ``run``, waiting up to ``wait_s`` for them to register. With
        ``current`` (a check that the placement asking is still the run's), a wait outlived by its placement (the
        run ended, or re-placed itself after a lost worker) gives back what it took and fails: a Scale request dies
        with its run and never keeps a worker."""
        wait_s = run.config.runtime.worker_wait_s if wait_s is None else wait_s
        sched = run.config.scheduling
        # stages placed on declared pools run on the workers registered in them (replay goes with the learner)
        where = sched.resolved_placement() if sched.pools and sched.mode != "auto" else {}
        pools = {**where, "replay": where.get("learner", "")} if where else {}
        deadline = time.monotonic() + wait_s
        workers: dict[str, list] = {role: [] for role in counts}
        try:
            while True:
                for role, n in counts.items():
                    while len(workers[role]) < n:
                        w = self.registry.acquire(role, run.run_id, pools.get(role, ""))
                        if w is None:
                            break
                        workers[role].append(w)
                if run.stop_requested.is_set():  # a stopped run stops waiting for workers at once
                    raise StopRequested()
                if current is not None and not current():
                    raise RunFailed(f"run {run.run_id} ended or re-placed itself while waiting for "
                                    f"{', '.join(f'{n} {r}' for r, n in counts.items())} worker(s); nothing was "
                                    f"placed (ask again if the run goes on)")
                missing = {r: n - len(workers[r]) for r, n in counts.items() if len(workers[r]) < n}
                if not missing:
                    return workers
                if time.monotonic() > deadline:
                    role = next(iter(missing))
                    raise RunFailed(f"not enough idle workers registered within {wait_s:g}s (runtime.worker_wait_s): "
                                    f"missing {', '.join(f'{n} {r}' for r, n in missing.items())}; start one with "
                                    f"`rlfabric serve {role} --coordinator {self.runtime.address}`")
                await asyncio.sleep(0.1)
        except BaseException:
            for ws in workers.values():
                for w in ws:
                    w.run_id = ""
            raise

    @staticmethod
    def worker_counts(config) -> dict[str, int]:
        """Workers a run's plan needs. An algorithm that collects nothing gets one env service (the spaces) and a
        rollout worker only when it evaluates."""
        s = config.scheduling
        if not config.collects:
            return {"env": 1, "replay": 1, "learner": 1, "rollout": 1 if config.train.eval_every_iterations else 0}
        env_workers = s.env_workers if (s.mode == "auto" or not s.env_in_rollout()) else 1
        return {"env": env_workers, "replay": 1, "learner": 1, "rollout": s.rollout_workers}

    async def _execute(self, run: Run, resume: bool | str = False, loss: Loss | None = None) -> None:
        """Run the workflow, recovering from lost workers (recovery.py) at most runtime.max_recoveries times. The
        terminal state is published only after artefacts are written and workers freed, so anyone who sees
        SUCCEEDED can read curve.png and the checkpoint. A spec's warm_start stages run first (warm_start.py)."""
        if warm_start.needed(run.config):
            outcome = await self._warm_start(run)
            if outcome is not None:
                self.registry.release(run.run_id)
                run.set_state(*outcome)
                self._record()
                return
            resume = "if_any" if resume else resume  # a run killed during its warm start has no checkpoint yet
        while True:
            run.lost = []
            run.attempt = attempt = asyncio.create_task(self._attempt(run, resume, loss))
            try:
                outcome = await attempt
                break
            except asyncio.CancelledError:  # a forced stop or a shutdown: the attempt said why, if it could
                outcome = (coordinator_pb2.STOPPED, "stopped by force (no iteration boundary in time); in-flight "
                           "work was discarded; resume continues from the last periodic checkpoint", False)
                break
            except WorkerLost as exc:
                loss = exc.loss
                limit = run.config.runtime.max_recoveries
                if run.recoveries >= limit or run.stop_requested.is_set() or asyncio.current_task().cancelling():
                    why = (f"the run already recovered {run.recoveries} time(s), runtime.max_recoveries={limit}"
                           if limit else f"runtime.max_recoveries=0: the run cannot continue without a "
                                         f"{'/'.join(loss.roles)} worker")
                    outcome = (coordinator_pb2.FAILED, f"{exc.reason}; its in-flight work was discarded and {why}",
                               False)
                    break
                for worker, _ in loss.lost:  # never placed again; if it lives, it registers anew
                    worker.alive = False
                self.registry.release(run.run_id)
                run.log(f"lost {loss.describe()}; recovering (recovery {run.recoveries + 1} of at most {limit}): "
                        f"re-placing the run on live workers and resuming from the newest checkpoint",
                        level="warning")
                resume = "if_any"
        self.registry.release(run.run_id)
        run.set_state(*outcome)
        self._forget_old_runs()
        self._record()
        log.info("run finished", extra={"run_id": run.run_id, "state": run.state, "reason": run.reason})

    async def _warm_start(self, run: Run) -> tuple[int, str, bool] | None:
        """The run's warm_start stages; None to go on with the run itself, or the run's outcome."""
        try:
            await warm_start.run(self, run)
            return None
        except StopRequested:
            return (coordinator_pb2.STOPPED, f"stopped by request during the warm start ({run.stage}); `rlfabric "
                    f"resume {run.run_dir}` continues it, keeping the stages done", False)
        except RunFailed as exc:
            return (coordinator_pb2.FAILED, exc.reason if exc.reason.startswith("warm") else
                    f"warm start ({run.stage or 'before its stages'}): {exc.reason}", exc.bad_input)
        except asyncio.CancelledError:
            return (coordinator_pb2.STOPPED, f"stopped by force during the warm start ({run.stage}); `rlfabric "
                    f"resume {run.run_dir}` continues it, keeping the stages done", False)
        except Exception as exc:  # noqa: BLE001 — a bug must fail the run loudly, not hang it
            log.exception("the warm start of run %s crashed", run.run_id)
            return (coordinator_pb2.FAILED, f"coordinator error in the warm start: {exc.__class__.__name__}: {exc}",
                    False)

    async def _attempt(self, run: Run, resume: bool | str, loss: Loss | None) -> tuple[int, str, bool]:
        """One placement of the run, to its outcome; raises WorkerLost when a worker of it dies (after the
        surviving learner checkpointed, so the next attempt resumes from its newest state)."""
        loop = None
        outcome: tuple[int, str, bool]
        lost: list = []
        try:
            workers = await self._acquire(run, self.worker_counts(run.config))
            run.set_state(coordinator_pb2.RUNNING, "workers: " + ", ".join(w.worker_id for ws in workers.values()
                                                                             for w in ws))

            attempt = asyncio.current_task()

            async def acquire(role: str, n: int, wait_s: float) -> list:
                def current() -> bool:
                    return run.attempt is attempt and not run.finished

                return (await self._acquire(run, {role: n}, wait_s, current))[role]

            def release(worker) -> None:
                worker.run_id = ""

            loop = TrainingLoop(run, workers, resume, acquire, release, recovery=loss)
            run.loop = loop
            outcome = (coordinator_pb2.SUCCEEDED, await loop.fit(), False)
        except RunFailed as exc:
            outcome = (coordinator_pb2.FAILED, exc.reason, exc.bad_input)
            if not exc.bad_input and loop is not None:  # a failed call may be a dead worker's doing: probe
                if not run.lost:
                    run.lost.extend(await unreachable([s for ss in loop.plan.pools.values() for s in ss]))
                lost = run.lost
        except StopRequested:
            outcome = (coordinator_pb2.STOPPED, "stopped by request at an iteration boundary", False)
            if loop is None or loop.runlog is None:
                outcome = (coordinator_pb2.STOPPED, "stopped by request before the run was placed: nothing ran",
                           False)
            else:
                try:
                    reply = await loop.save_checkpoint()
                    outcome = (coordinator_pb2.STOPPED, outcome[1] + f"; checkpoint {reply.uri} "
                               f"(continue with `rlfabric resume {run.resume_dir}`)", False)
                except RunFailed as exc:
                    outcome = (coordinator_pb2.STOPPED, outcome[1] + f"; no checkpoint on stop: {exc.reason}",
                               False)
        except asyncio.CancelledError:
            outcome = (coordinator_pb2.STOPPED, "stopped by force (no iteration boundary in time); in-flight "
                       "work was discarded; resume continues from the last periodic checkpoint", False)
            if run.lost and not (run.task is not None and run.task.cancelling()):
                asyncio.current_task().uncancel()  # a lost worker ended this attempt, not a stop: recover
                lost = run.lost
        except Exception as exc:  # noqa: BLE001 — a bug must fail the run loudly, not hang it
            log.exception("run %s crashed", run.run_id)
            outcome = (coordinator_pb2.FAILED, f"coordinator error: {exc.__class__.__name__}: {exc}", False)
        if lost:
            run.attempt = None  # more losses from here on join this one instead of cancelling the recovery
            loss = Loss(lost, run.iteration)
            if loop is not None and loop.runlog is not None and "learner" not in loss.roles:
                try:  # the surviving learner's newest state: the next attempt loses only in-flight work
                    await asyncio.wait_for(loop.save_checkpoint(), run.config.data_plane.timeout_s + 30)
                except (RunFailed, TimeoutError) as exc:
                    run.log(f"no checkpoint before recovering ({exc}); resuming from an older one", level="warning")
        await self._close(run, loop)
        if lost:
            raise WorkerLost(loss.describe(), loss)  # (describes every loss, those during the checkpoint too)
        return outcome

    @staticmethod
    async def _close(run: Run, loop: TrainingLoop | None) -> None:
        if loop is not None:
            try:
                await asyncio.shield(loop.close())
            except Exception:  # noqa: BLE001 — a failed plot must not hide the run's outcome
                log.exception("closing run %s failed", run.run_id)

    async def _run(self, request, context) -> Run:
        run = self.runs.get(request.run_id)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no run {request.run_id!r}; ListRuns shows the known ones")
        return run

    async def GetRun(self, request, context):
        return (await self._run(request, context)).status()

    async def ListRuns(self, request, context):
        return coordinator_pb2.ListRunsReply(runs=[r.status() for r in self.runs.values()])

    async def WatchRun(self, request, context):
        run = await self._run(request, context)
        if len(run.watchers) >= self.max_watchers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"run {run.run_id} already has {len(run.watchers)} watchers, the most it serves "
                                f"(--max-watchers-per-run). Fix: share one stream, or poll GetRun")
        queue: asyncio.Queue = asyncio.Queue()
        history = list(run.history)
        run.watchers.add(queue)
        def final(event) -> bool:
            return event.HasField("status") and event.status.state in (
                coordinator_pb2.SUCCEEDED, coordinator_pb2.FAILED, coordinator_pb2.STOPPED)

        try:
            for event in history:
                yield event
            if any(final(event) for event in history):
                return
            # events emitted since the snapshot (the run may have ended while history was being sent) are queued
            while True:
                event = await queue.get()
                yield event
                if final(event):
                    return
        finally:
            run.watchers.discard(queue)

    async def StopRun(self, request, context):
        """Stop at the next iteration boundary (checkpointed, resumable); cancel if none comes in time."""
        run = await self._run(request, context)
        if run.task is not None and not run.finished:
            run.stop_requested.set()
            done, _ = await asyncio.wait({run.task}, timeout=STOP_GRACE_S)
            if not done:
                run.task.cancel()
                await asyncio.gather(run.task, return_exceptions=True)
        return run.status()

    async def Scale(self, request, context):
        """Add or remove workers of a role in a live run; returns once applied at an epoch boundary."""
        run = await self._run(request, context)
        loop = run.loop
        if run.finished or loop is None or run.state != coordinator_pb2.RUNNING:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"run {run.run_id} is not running ({coordinator_pb2.RunState.Name(run.state)})")
        if not (math.isfinite(request.timeout_s) and 0 <= request.timeout_s <= 3600):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be within [0, 3600] seconds "
                                                                  f"(0 = 60), got {request.timeout_s}")
        if not (0 <= request.count <= 4096 and -4096 <= request.delta <= 4096):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"count must be within [0, 4096] and delta within "
                                                                  f"[-4096, 4096], got count={request.count}, "
                                                                  f"delta={request.delta}")
        role = request.role
        plan = loop.plan
        current = len(plan.pools.get(role, []))
        target = request.count if request.count > 0 else current + request.delta
        timeout = request.timeout_s or 60.0
        try:
            change = await plan.request_scale(role, target, timeout)
            applied = await asyncio.wait_for(asyncio.shield(change.done), timeout)
        except RunFailed as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT if exc.bad_input
                                else grpc.StatusCode.FAILED_PRECONDITION, exc.reason)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"scale {role} to {target} is queued but no epoch boundary came within {timeout:g}s; "
                                f"it applies at the next one")
        stages = plan.pools[role]
        run.log(f"scaled {role} from {current} to {len(stages)} worker(s) at iteration {applied}")
        return coordinator_pb2.ScaleReply(role=role, workers=len(stages), worker_ids=[s.worker.worker_id for s in stages],
                                          applied_at_iteration=applied, detail=plan.describe())

    async def GetPlan(self, request, context):
        run = await self._run(request, context)
        loop = run.loop
        if loop is None:
            return coordinator_pb2.PlanReply(plan=run.plan)
        rows = [coordinator_pb2.PlanRow(plan=d["plan"], predicted_iteration_s=d.get("predicted_s", 0.0),
                                        measured_iteration_s=d.get("measured_s", 0.0), chosen=d.get("chosen", False),
                                        description=d.get("description", "")) for d in loop.decisions]
        return coordinator_pb2.PlanReply(plan=run.plan, description=loop.plan.describe(), decisions=rows)

    async def DashboardLogin(self, request, context):
        if self.dashboard is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this coordinator serves no dashboard "
                                                                     "(--dashboard-port -1). Fix: start it with "
                                                                     "--dashboard-port 0 (or a port)")
        return coordinator_pb2.DashboardLoginReply(url=self.dashboard.login_url())

    async def shutdown(self) -> None:
        self.reaper.cancel()
        for run in self.runs.values():
            if run.task is not None and not run.finished:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in self.runs.values() if r.task), return_exceptions=True)


def _extra(parser) -> None:
    parser.add_argument("--runs-root", default="runs", help="where run directories are created")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0,
                        help="seconds without a heartbeat before a worker is declared dead")
    parser.add_argument("--max-active-runs", type=int, default=64, help="runs waiting or running at once")
    parser.add_argument("--max-watchers-per-run", type=int, default=256, help="WatchRun streams one run serves")
    parser.add_argument("--max-kept-runs", type=int, default=1000, help="finished runs kept in memory for GetRun")
    parser.add_argument("--take-up-runs", choices=("yes", "no"), default="yes",
                        help="resume the runs a previous coordinator on this runs root held and had not ended")
    parser.add_argument("--dashboard-port", type=_dashboard_port, default=-1,
                        help="serve the web dashboard on --host at this port (0 = pick one, -1 = none); "
                             "`rlfabric dashboard` prints a login URL")
    parser.add_argument("--dashboard-gateway", action="append", default=[], metavar="HOST:PORT",
                        help="a robot gateway the dashboard shows beside those registered with this coordinator")


def _dashboard_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -2
    if not -1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535 (0 = pick one) or -1 (no dashboard), got {text!r}")
    return port


def _warm_up() -> None:
    """Import the TensorBoard writer before the first run asks for it."""
    from rlfabric.services.coordinator.runlog import import_tensorboardx

    import_tensorboardx()


async def _build(runtime: ServiceRuntime, args) -> None:
    threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()
    service = CoordinatorService(runtime, args.runs_root, args.heartbeat_timeout, args.max_active_runs,
                                 args.max_watchers_per_run, args.max_kept_runs, args.take_up_runs == "yes")
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, runtime.server)
    if args.dashboard_port >= 0:  # aiohttp loads only for a coordinator that serves the dashboard
        from rlfabric.services.coordinator.dashboard import Dashboard

        service.dashboard = Dashboard(service, args.host, args.dashboard_port, runtime.advertise_host,
                                      args.dashboard_gateway)
        await service.dashboard.start()
        runtime.on_shutdown(service.dashboard.stop)


def main(argv: list[str] | None = None) -> None:
    run_service("coordinator", _build, argv, _extra)


if __name__ == "__main__":
    main()
