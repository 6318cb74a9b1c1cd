"""Teleop clients: a human (keyboard) or a scripted expert takes over robots on a gateway through the Teleop
stream. Their commands replace the policy's per tick inside the gateway, under the same limits and watchdog; the
robot env reports those steps as intervened, and the rollout files them under replay's "interventions" source.

    rlfabric teleop --gateway HOST:PORT --robot ID                 keyboard: one robot
    rlfabric teleop --gateway HOST:PORT --expert-goal X,Y,Z ...    the scripted reach expert on every robot

``ReachExpert`` is the scripted "expert takes over when the policy drifts" of human-gated imitation experiments: it watches
each episode from the moment the arm settles at its start pose, takes over once the end effector has made no
progress toward the goal for ``patience`` policy commands, drives it to the goal by damped least squares on the
arm's kinematics at the policy's pace (one bounded step per policy command), and hands back when it gets there.
``KeyboardTeleop`` maps keys to the same events.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import grpc
import numpy as np

log = logging.getLogger(__name__)
SEQ_BASE = 1 << 40  # teleop command seqs, far from any policy's: a state's command_seq tells who commanded


@dataclass
class ReachExpert:
    """The scripted expert for one robot (a state machine fed one state per tick, returning the events to send).

    resetting   the arm is away from its start pose, or the env walks it back (``policy_resetting``): never
                intervene
    watching    an episode is running: track the best distance to the goal and the policy's commands since it
                improved (ticks with no new policy command do not count: the policy is paused, not drifting)
    helping     the expert commands the arm toward the goal; at ``handback_distance`` it hands back, and when the
                episode ends under it (the env starts its reset walk) it lets go

Without the mark, an episode that ran out of time while the expert helped kept the arm led toward the goal while
the env's walk waited, and a walk after a time-out while watching looked like a policy drifting from the goal.

    While helping, the expert moves its target once per policy command (the overridden commands still arrive, one
    per env step) and repeats it on the ticks between (the gateway's watchdog wants a command per tick): what the
    learner is taught is then one decision's worth of motion, in the policy's own units and unclipped. Moving on
    every tick instead, an env step that spans 13 ticks (a loaded 2-core host) taught a move 5x past the action
    range: every label clipped to +-1, a bang-bang policy that overshot near the goal.
    """

    goal: np.ndarray
    start: np.ndarray
    forward_kinematics: Callable[[np.ndarray], np.ndarray]
    start_tolerance: float = 0.05  # rad per joint (plus the env's start noise) that count as "at the start pose"
    patience: int = 8  # policy commands without progress before the expert takes over
    progress: float = 0.005  # metres of improvement that count as progress
    step: float = 0.04  # rad per policy command the expert moves the joint targets at most (the largest joint move;
    # the step keeps its direction). Below the env's action_scale, so the executed action it teaches stays inside
    # the policy's (-1, 1)
    handback_distance: float = 0.06  # a little before the task counts success: the policy must finish
    mode: str = "resetting"
    best: float = float("inf")
    stalled: int = 0
    policy_seq: int = -1
    target: np.ndarray | None = None
    takeovers: int = 0

    def _distance(self, q: np.ndarray) -> float:
        return float(np.linalg.norm(self.forward_kinematics(q) - self.goal))

    def toward_goal(self, q: np.ndarray) -> np.ndarray:
        """One damped-least-squares step of the joints toward the goal (numerical Jacobian of the kinematics)."""
        ee = self.forward_kinematics(q)
        eps = 1e-4
        J = np.stack([(self.forward_kinematics(q + eps * np.eye(len(q))[j]) - ee) / eps for j in range(len(q))], 1)
        dq = J.T @ np.linalg.solve(J @ J.T + 1e-3 * np.eye(3), self.goal - ee)
        return q + dq * min(1.0, self.step / max(float(np.abs(dq).max()), 1e-12))

    def observe(self, state: Any) -> list[tuple[str, np.ndarray | None]]:
        """The events for this tick: ("start" | "command" | "stop", joint target or None)."""
        q = np.asarray(state.position, float)
        distance = self._distance(q)
        if self.mode == "resetting":  # an episode starts settled at its start pose, away from the goal
            if np.abs(q - self.start).max() <= self.start_tolerance and np.abs(state.velocity).max() < 0.05 \
                    and not state.holding and not state.policy_resetting and distance > 2 * self.handback_distance:
                self.mode, self.best, self.stalled = "watching", distance, 0
            return []
        if state.policy_resetting:  # the episode is over: the env walks the arm back
            helping, self.mode = self.mode == "helping", "resetting"
            return [("stop", None)] if helping else []
        if self.mode == "watching":
            if distance <= self.handback_distance:  # the policy got there by itself
                self.mode = "resetting"
                return []
            commanded = state.policy_seq != self.policy_seq  # only a policy that acts can drift: a pause
            self.policy_seq = state.policy_seq  # (its learner updating, its env busy elsewhere) is not one
            if distance < self.best - self.progress:
                self.best, self.stalled = distance, 0
            elif commanded:
                self.stalled += 1
            if self.stalled < self.patience:
                return []
            self.mode, self.takeovers = "helping", self.takeovers + 1
            self.target = self.toward_goal(np.asarray(state.target, float))
            return [("start", self.target)]
        if distance <= self.handback_distance:
            self.mode = "resetting"
            return [("stop", None)]
        if state.policy_seq != self.policy_seq:  # the next decision: one more step from where the arm is led
            self.policy_seq = state.policy_seq
            self.target = self.toward_goal(np.asarray(state.target, float))
        return [("command", self.target)]


KEYS = {"q": (0, 1), "a": (0, -1), "w": (1, 1), "s": (1, -1), "e": (2, 1), "d": (2, -1),
        "r": (3, 1), "f": (3, -1), "t": (4, 1), "g": (4, -1), "y": (5, 1), "h": (5, -1)}
VERDICT_KEYS = {"1": "SUCCESS", "2": "FAILURE", "3": "RERECORD", "4": "TERMINATE"}
HELP = ("space: take over / hand back   q/a w/s e/d r/f t/g y/h: joint 0..5 +/-   1: success  2: failure  "
        "3: re-record  4: terminate  x: quit")


class KeyboardTeleop:
    """Keys to teleop events for one robot: space toggles the takeover, joint keys nudge a joint target by
    ``step`` rad, digits end the episode with a verdict. Keys come from any text stream (a raw terminal, a pipe)."""

    def __init__(self, joints: int, step: float = 0.02):
        self.joints, self.step = joints, step
        self.intervening = False
        self.target: np.ndarray | None = None

    def key(self, key: str, position: np.ndarray) -> list[tuple[str, np.ndarray | None]]:
        if key == " ":
            self.intervening = not self.intervening
            if self.intervening:
                self.target = np.asarray(position, float).copy()
                return [("start", self.target)]
            return [("stop", None)]
        if key in VERDICT_KEYS:
            return [(VERDICT_KEYS[key], None)]
        if key in KEYS and self.intervening and self.target is not None:
            joint, sign = KEYS[key]
            if joint < self.joints:
                self.target = self.target.copy()
                self.target[joint] += sign * self.step
                return [("command", self.target)]
        return []


class TeleopSession:
    """One robot's Teleop stream: events go out through a queue, one state per tick comes back."""

    def __init__(self, stub: Any, pb: Any, robot_id: str, first_position: np.ndarray):
        self.stub, self.pb, self.robot_id = stub, pb, robot_id
        self.outbox: queue.Queue = queue.Queue(maxsize=256)
        self.seq = SEQ_BASE
        self.send("command", first_position)  # not intervening yet: subscribes to the states, moves nothing
        self.states = stub.Teleop(self._events())

    def _events(self) -> Iterator[Any]:
        while (event := self.outbox.get()) is not None:
            yield event

    def send(self, kind: str, position: np.ndarray | None = None) -> None:
        kinds = self.pb.TeleopEvent.Kind
        code = {"start": kinds.INTERVENE_START, "command": kinds.COMMAND, "stop": kinds.INTERVENE_STOP}.get(kind)
        if code is None:
            code = getattr(kinds, kind)  # a verdict: SUCCESS, FAILURE, RERECORD, TERMINATE
        event = self.pb.TeleopEvent(robot_id=self.robot_id, kind=code)
        if position is not None:
            self.seq += 1
            event.command.CopyFrom(self.pb.JointCommand(robot_id=self.robot_id, seq=self.seq,
                                                        position=np.asarray(position, float).tolist()))
        self.outbox.put(event, timeout=5)

    def close(self) -> None:
        self.outbox.put(None)
        self.states.cancel()


def run_expert(address: str, goal: np.ndarray, start: np.ndarray, forward_kinematics: Callable, stop: threading.Event,
               start_tolerance: float = 0.05, poll_s: float = 0.5, **expert: Any) -> dict[str, ReachExpert]:
    """The scripted expert on every robot connected to the gateway at ``address`` (robots that connect later are
    picked up every ``poll_s``), until ``stop`` is set. Returns the experts by robot id."""
    from rlfabric.services.core import auth
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
    from rlfabric.services.core.runtime import GRPC_OPTIONS

    channel = auth.sync_channel(address, GRPC_OPTIONS)
    stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
    experts: dict[str, ReachExpert] = {}
    threads: list[threading.Thread] = []
    sessions: list[TeleopSession] = []

    def serve(rid: str, session: TeleopSession, brain: ReachExpert) -> None:
        try:
            for state in session.states:
                if stop.is_set():
                    return
                for kind, target in brain.observe(state):
                    session.send(kind, target)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND):
                log.warning("teleop stream of %s ended: %s", rid, exc.details())

    try:
        while not stop.is_set():
            for info in stub.ListRobots(pb.ListRobotsRequest(), timeout=10).robots:
                if info.robot_id in experts:
                    continue
                state = stub.GetState(pb.RobotRef(robot_id=info.robot_id), timeout=10)
                experts[info.robot_id] = brain = ReachExpert(goal, start, forward_kinematics,
                                                             start_tolerance=start_tolerance, **expert)
                session = TeleopSession(stub, pb, info.robot_id, np.asarray(state.position))
                sessions.append(session)
                threads.append(threading.Thread(target=serve, args=(info.robot_id, session, brain), daemon=True,
                                                name=f"expert-{info.robot_id}"))
                threads[-1].start()
            stop.wait(poll_s)
    finally:
        for session in sessions:
            session.close()
        for thread in threads:
            thread.join(timeout=5)
        channel.close()
    return experts


def run_keyboard(address: str, robot_id: str, keys: TextIO, out: TextIO, step: float = 0.02) -> None:
    """Keyboard teleop of one robot: reads keys from ``keys`` until 'x' or its end."""
    from rlfabric.services.core import auth
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
    from rlfabric.services.core.runtime import GRPC_OPTIONS

    channel = auth.sync_channel(address, GRPC_OPTIONS)
    stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
    state = stub.GetState(pb.RobotRef(robot_id=robot_id), timeout=10)
    pad = KeyboardTeleop(len(state.position), step)
    session = TeleopSession(stub, pb, robot_id, np.asarray(state.position))
    latest = [state]

    def follow() -> None:
        try:
            for s in session.states:
                latest[0] = s
        except grpc.RpcError:
            return

    threading.Thread(target=follow, daemon=True).start()
    out.write(HELP + "\n")
    try:
        while (key := keys.read(1)) and key != "x":
            for kind, target in pad.key(key, np.asarray(latest[0].target or latest[0].position)):
                session.send(kind, target)
                out.write(f"{kind} {'' if target is None else np.round(target, 3).tolist()}\n")
    finally:
        if pad.intervening:
            session.send("stop")
        session.close()
        channel.close()


__all__ = ["KEYS", "KeyboardTeleop", "ReachExpert", "TeleopSession", "run_expert", "run_keyboard"]
