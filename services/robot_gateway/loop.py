"""The control loop: one tick per period against absolute deadlines (tick k is due at start + k * period), never
"work, then sleep what is left", so a slow tick does not push every later one.

Each tick measures how late it woke (lateness) and how far its period strayed from nominal (jitter), exports both
as Prometheus histograms and in every state, and counts overruns (a tick later than a whole period, after which
the loop skips to the next deadline ahead instead of bursting). A tick later than the watchdog window (the arm went
that long without control: a stalled driver, a paused process) latches a deadline fault: the arm holds and the
gateway's health turns NOT_SERVING until the operator's ClearEStop. The thread asks for real-time priority and a
pinned core and says what it got.

What the arm does each tick, in order of precedence:
    e-stop latched     hold, until the operator's ClearEStop
    fault latched      hold, until the operator's ClearEStop (a jump, a workspace exit, a malformed command, a
                       missed deadline)
    no valid command   hold, once the newest command is older than the watchdog window (or none came yet)
    otherwise          the newest command through the safety filter
A hold keeps the current target: the last target sent (the measured position only before any was), never the
position measured when the hold began, which would step the arm by its servo's tracking error at every hold. Leaving
a hold, the velocity and slew limits count from that target too. The commanding source is the policy, or the human
while one intervenes (teleop): the human's commands replace the policy's per tick, through the same filter and
watchdog. A takeover belongs to the caller that began it (``owner``): another may neither stop it nor command
through it, until the owner lets go (``release``), after which its stale commands hold the arm until anyone takes
over or stops the takeover.
Episodes end with a teleop verdict (success, failure, terminate, or re-record); intervened ticks, episodes with any
intervention and successes without one are counted.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from rlfabric.services.robot_gateway.drivers import Driver
from rlfabric.services.robot_gateway.safety import LimitError, Limits, SafetyFilter
from rlfabric.services.robot_gateway.series import robot_series

log = logging.getLogger(__name__)
BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 1.0)
LATENESS = Histogram("rlfabric_robot_loop_lateness_seconds", "how late each control tick woke after its deadline",
                     ["robot"], buckets=BUCKETS)
JITTER = Histogram("rlfabric_robot_loop_jitter_seconds", "|tick-to-tick period - nominal period|", ["robot"],
                   buckets=BUCKETS)
OVERRUNS = Counter("rlfabric_robot_loop_overruns_total", "ticks later than a whole period", ["robot"])
HOLDING = Gauge("rlfabric_robot_holding", "1 while the arm is in safe hold", ["robot"])
INTERVENED = Counter("rlfabric_robot_intervened_ticks_total", "ticks commanded by a human (teleop)", ["robot"])
EPISODES = Counter("rlfabric_robot_episodes_total", "episodes ended by a teleop verdict", ["robot", "outcome",
                                                                                           "intervened"])
OUTCOMES = ("success", "failure", "rerecord", "terminate")
SPIN_S = 0.001  # default: the last millisecond before a deadline is spun, not slept (sleep wakes up to ~1 ms late)


def _sleep_until(when: float) -> None:
    remaining = when - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


class TakeoverError(PermissionError):
    """A teleop event from a caller that does not own the running takeover (names who does)."""


@dataclass
class Tick:
    """The state the loop publishes every tick."""

    tick: int
    time: float
    position: np.ndarray
    velocity: np.ndarray
    target: np.ndarray
    estopped: bool
    fault: str
    holding: bool
    hold_reason: str
    lateness_s: float
    jitter_s: float
    overruns: int
    command_seq: int
    clipped: bool = False
    slowed: bool = False
    intervening: bool = False
    episode: int = 0
    episode_intervened_ticks: int = 0
    end_effector: np.ndarray = field(default_factory=lambda: np.zeros(3))
    policy_seq: int = -1  # the newest policy command this tick had (used, or overridden by a human)
    policy_resetting: bool = False  # that command walks the arm back between episodes (JointCommand.resetting)
    estop_at: float = 0.0  # when the e-stop latched (monotonic s; 0: none): from then on no new target is sent


@dataclass
class EpisodeCounts:
    """What interventions amounted to (human-gated imitation's measures): per outcome, and how many had any intervention."""

    episodes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    with_intervention: int = 0
    success_without_intervention: int = 0
    intervened_ticks: int = 0


@dataclass
class _Command:
    position: np.ndarray
    seq: int
    resetting: bool = False
    received: float = field(default_factory=time.monotonic)


class ControlLoop:
    def __init__(self, robot_id: str, driver: Driver, hz: float, watchdog_s: float, spin_s: float = SPIN_S):
        self.robot_id, self.driver = robot_id, driver
        self.holding_metric, self.lateness_metric, self.jitter_metric, self.overruns_metric, self.intervened_metric = (
            robot_series(m, robot_id) for m in (HOLDING, LATENESS, JITTER, OVERRUNS, INTERVENED))  # once, not per tick
        self.period, self.watchdog_s = 1.0 / hz, watchdog_s
        self.spin_s = spin_s  # precision for CPU: many arms on one host may spin less (or not at all)
        self.hard = driver.hard_limits()
        self.safety = SafetyFilter(self.hard, driver.forward_kinematics)
        self.lock = threading.Lock()
        self.command: _Command | None = None
        self.human: _Command | None = None
        self.intervening = False
        self.intervention_owner: object | None = None  # who began the takeover (a Teleop stream); None: no one
        self.episode, self.episode_intervened = 0, 0
        self.counts = EpisodeCounts()
        self.intervention_listeners: list[Callable[[bool, int], None]] = []  # (intervening, episode)
        self.estopped, self.fault = False, ""
        self.estop_at = 0.0
        self.missed_deadline = ""  # a latched deadline fault, as the health check says it (see _run)
        position, velocity = driver.read()
        self.target = position.copy()
        self.overruns = 0
        self.last = Tick(0, time.monotonic(), position, velocity, position, False, "", True, "no command yet", 0.0,
                         0.0, 0, -1)
        self.listeners: list[Callable[[Tick], None]] = []
        self.realtime = "not started"
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.idle: Callable[[float], None] = _sleep_until  # until the spin: a process of its own serves requests
        self.thread = threading.Thread(target=self._run, name=f"control-{robot_id}", daemon=True)

    # -- what clients do (any thread) -------------------------------------------------------------------------
    def submit(self, position: np.ndarray, seq: int, resetting: bool = False) -> None:
        with self.lock:
            self.command = _Command(np.asarray(position, dtype=float), seq, resetting)

    def _check_owner(self, owner: object | None, what: str) -> None:
        """Under self.lock: refuse ``what`` from anyone but the takeover's owner (a takeover nobody owns is free)."""
        if owner is not None and self.intervening and self.intervention_owner not in (None, owner):
            raise TakeoverError(f"{what}: robot {self.robot_id!r} is taken over by {self.intervention_owner}. Only "
                                f"the stream that sent INTERVENE_START may command or stop the takeover. Fix: wait "
                                f"for its INTERVENE_STOP (or for its stream to end)")

    def intervene(self, active: bool, position: np.ndarray | None = None, seq: int = 0,
                  owner: object | None = None) -> None:
        """A human takes over (``active``, with their first command) or hands the arm back to the policy. With an
        ``owner`` (the caller), only the owner of a running takeover may do either (TakeoverError); without one
        (the gateway itself, ending an episode) it always applies."""
        with self.lock:
            self._check_owner(owner, "INTERVENE_START" if active else "INTERVENE_STOP")
            changed = active != self.intervening
            self.intervening = active
            self.intervention_owner = owner if active else None
            self.human = _Command(np.asarray(position, dtype=float), seq) if active and position is not None \
                else (self.human if active else None)
        if changed:
            log.info("intervention " + ("start" if active else "stop"), extra={"robot": self.robot_id,
                                                                               "episode": self.episode})
            for listener in list(self.intervention_listeners):
                listener(active, self.episode)

    def teleop_command(self, position: np.ndarray, seq: int, owner: object | None = None) -> bool:
        """The human's command; used only while they intervene (returns whether it was). Another caller's command
        during a takeover is refused (TakeoverError)."""
        with self.lock:
            self._check_owner(owner, "a teleop COMMAND")
            if self.intervening:
                self.human = _Command(np.asarray(position, dtype=float), seq)
            return self.intervening

    def check_owner(self, owner: object, what: str) -> None:
        """Raise TakeoverError if another caller owns the running takeover (a verdict would end it)."""
        with self.lock:
            self._check_owner(owner, what)

    def release(self, owner: object) -> None:
        """``owner`` went away (its stream ended): its takeover stays, owned by no one, so its stale commands hold
        the arm (the watchdog) until someone takes over or stops it; nothing is left that nobody can end."""
        with self.lock:
            if self.intervention_owner == owner:  # (equal: the arm process rebuilds an owner per request)
                self.intervention_owner = None

    def end_episode(self, outcome: str) -> EpisodeCounts:
        """A teleop verdict ends the episode: count it (a re-recorded one counts only as re-recorded)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"episode outcome {outcome!r}: one of {OUTCOMES}")
        self.intervene(False)
        with self.lock:
            intervened = self.episode_intervened > 0
            self.counts.episodes[outcome] += 1
            if outcome != "rerecord":
                self.counts.with_intervention += int(intervened)
                self.counts.success_without_intervention += int(outcome == "success" and not intervened)
            self.episode += 1
            self.episode_intervened = 0
        robot_series(EPISODES, self.robot_id, outcome, str(intervened).lower()).inc()
        log.info("episode ended", extra={"robot": self.robot_id, "outcome": outcome, "intervened": intervened})
        return self.counts

    def estop(self, reason: str) -> None:
        with self.lock:
            if not self.estopped:
                self.estop_at = time.monotonic()
            self.estopped = True
        log.warning("e-stop", extra={"robot": self.robot_id, "reason": reason})

    def latch_fault(self, fault: str) -> None:
        """Latch a fault from outside the loop (one kept by the device across a reconnect): hold until cleared."""
        with self.lock:
            self.fault = fault
        log.error("safety fault", extra={"robot": self.robot_id, "fault": fault})

    def clear(self) -> None:
        """Clear the e-stop and any fault; the arm stays in hold until a fresh command arrives."""
        with self.lock:
            self.estopped, self.fault, self.command, self.missed_deadline = False, "", None, ""
            self.estop_at = 0.0

    def set_limits(self, limits: Limits) -> Limits:
        """Narrow (or widen back) the limits; position limits must hold the arm's current target, since the filter
        clips every target into them: one outside would be yanked to the limit in a tick, past the slew limit."""
        limits.within(self.hard)
        with self.lock:
            target = self.target
            outside = (target < limits.position_min) | (target > limits.position_max)
            if outside.any():
                j = int(np.flatnonzero(outside)[0])
                raise LimitError(f"position_min/position_max of joint {j} ({self.driver.joint_names[j]}): "
                                 f"[{limits.position_min[j]:g}, {limits.position_max[j]:g}] leaves out the arm's "
                                 f"current target {target[j]:.4f}. Fix: command the arm inside the new limits first")
            self.safety.limits = limits
        return limits

    def start(self) -> None:
        self.thread.start()

    def halt(self) -> None:
        """Ask ``run`` to return after its current tick (from within the loop's own ``idle``)."""
        self._stop.set()

    def run(self) -> None:
        """Tick in the calling thread until ``stop`` (an arm's own process runs its loop on its main thread)."""
        self._run()

    def stop(self) -> None:
        """Stop ticking and leave the arm braked (a stopping gateway never leaves it tracking a stale target)."""
        self._stop.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=2)
        self.holding_metric.set(1)
        self.driver.brake()

    def health(self) -> str | None:
        if self.error is not None:
            return f"the control loop of {self.robot_id} died: {self.error!r}"
        if self.thread.ident is not None and not self.thread.is_alive() and not self._stop.is_set():
            return f"the control loop of {self.robot_id} stopped"
        with self.lock:
            missed = self.missed_deadline
        if missed:
            return f"the control loop of {self.robot_id} missed its deadline ({missed}); the arm holds until the " \
                   f"operator's ClearEStop"
        return None

    # -- the loop thread --------------------------------------------------------------------------------------
    def _claim_realtime(self) -> str:
        got = []
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
            got.append("SCHED_FIFO priority 10")
        except (PermissionError, OSError, AttributeError) as exc:
            got.append(f"no real-time priority ({exc.__class__.__name__}: run with CAP_SYS_NICE for SCHED_FIFO)")
        try:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) > 1:
                os.sched_setaffinity(0, {cpus[-1]})
                got.append(f"pinned to CPU {cpus[-1]}")
            else:
                got.append("not pinned (one CPU allowed)")
        except (OSError, AttributeError) as exc:
            got.append(f"not pinned ({exc.__class__.__name__})")
        return "; ".join(got)

    def _run(self) -> None:
        self.realtime = self._claim_realtime()
        log.info("control loop started", extra={"robot": self.robot_id, "hz": 1 / self.period,
                                                "realtime": self.realtime})
        start = time.monotonic()
        k, woke_last = 0, start
        try:
            while not self._stop.is_set():
                k += 1
                deadline = start + k * self.period
                self.idle(deadline - self.spin_s)
                while time.monotonic() < deadline:
                    time.sleep(0)  # spins, but lets go of the GIL each turn: the event loop (EStop) never waits
                now = time.monotonic()
                lateness, jitter = now - deadline, abs((now - woke_last) - self.period)
                woke_last = now
                self.lateness_metric.observe(lateness)
                self.jitter_metric.observe(jitter)
                if lateness > self.period:
                    self.overruns += 1
                    self.overruns_metric.inc()
                    log.warning("control tick overran", extra={"robot": self.robot_id, "late_s": round(lateness, 6),
                                                               "overruns": self.overruns})
                    k = math.floor((now - start) / self.period)  # skip to the next deadline ahead
                if lateness > self.watchdog_s:
                    self._missed(lateness)
                self.idle(0.0)  # what came during the spin (an EStop) is served before this tick, not after it
                self._tick(k, now, lateness, jitter)
        except BaseException as exc:  # noqa: BLE001 — a dead loop fails the health check, loudly
            self.error = exc
            log.exception("control loop died", extra={"robot": self.robot_id})
            try:
                self.driver.brake()
            finally:
                self.holding_metric.set(1)

    def _missed(self, lateness: float) -> None:
        """The tick woke later than the watchdog window: the arm went that long without control. Latch a fault
        (this tick already holds) and fail the health check until the operator clears it."""
        why = f"a tick woke {lateness * 1e3:.1f} ms late, past the {self.watchdog_s * 1e3:.0f} ms watchdog window"
        with self.lock:
            self.fault = self.fault or f"deadline: {why}"
            self.missed_deadline = self.missed_deadline or why
        log.error("control tick missed its deadline: fault latched", extra={"robot": self.robot_id,
                                                                           "late_s": round(lateness, 6)})

    def _tick(self, k: int, now: float, lateness: float, jitter: float) -> None:
        position, velocity = self.driver.read()
        with self.lock:
            intervening = self.intervening
            command = self.human if intervening else self.command
            policy_seq = self.command.seq if self.command is not None else -1
            policy_resetting = self.command is not None and self.command.resetting
            estopped, fault, safety, estop_at = self.estopped, self.fault, self.safety, self.estop_at
        verdict = None
        if estopped:
            reason = "e-stop"
        elif fault:
            reason = f"fault: {fault}"
        elif command is None:
            reason = "no teleop command yet" if intervening else "no command yet"
        elif now - command.received > self.watchdog_s:
            who = "teleop command" if intervening else "command"
            reason = f"watchdog: no {who} for {now - command.received:.3f} s (window {self.watchdog_s} s)"
        else:
            reason = ""
            verdict = safety.apply(command.position, position, self.target, self.period)
            if verdict.fault:
                with self.lock:
                    self.fault = verdict.fault
                log.error("safety fault", extra={"robot": self.robot_id, "fault": verdict.fault})
                reason = f"fault: {verdict.fault}"
        if not reason:  # a hold keeps the target (the last one sent), never re-targets the measured position
            self.target = verdict.target
        self.driver.command(self.target, self.period)
        self.holding_metric.set(1 if reason else 0)
        with self.lock:
            fault = self.fault
            if intervening:
                self.episode_intervened += 1
                self.counts.intervened_ticks += 1
            episode, episode_intervened = self.episode, self.episode_intervened
        if intervening:
            self.intervened_metric.inc()
        tick = Tick(k, now, position, velocity, self.target.copy(), estopped, fault, bool(reason), reason,
                    lateness, jitter, self.overruns, command.seq if command is not None else -1,
                    bool(verdict and verdict.clipped), bool(verdict and verdict.slowed), intervening, episode,
                    episode_intervened, self.driver.forward_kinematics(position), policy_seq, policy_resetting, estop_at)
        self.last = tick
        for listener in list(self.listeners):
            listener(tick)


__all__ = ["OUTCOMES", "ControlLoop", "EpisodeCounts", "Tick"]
