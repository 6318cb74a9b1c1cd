"""Robot adapter: arms behind a robot gateway as a gymnasium vector env, so real-world RL runs through the env
service, the plans and the algorithms like any simulator. Every env is one robot connected on the gateway (the
gateway keeps its own deadlines, limits and holds; this adapter is an ordinary, authenticated client).

    env: {adapter: robot, id: reach, num_envs: 2,
          options: {gateway: 127.0.0.1:PORT, driver: sim, hz: 50, episode_steps: 100, action_scale: 0.05}}

Task ``reach``: the observation is joint positions and velocities, the target and the end effector (x, y, z each);
an action in [-1, 1] per joint moves the joint target by up to ``action_scale`` rad; the reward is minus the distance
to the target, plus 1 and the end of the episode within ``success_distance``; ``episode_steps`` truncates. The
target is drawn at random per episode, or fixed (``target: "x,y,z"``); the start pose is ``start``, each joint
moved by up to ``start_noise`` rad at random. Every step reports whether a human intervened (teleop) and the action
that was executed in the policy's units (``info["intervened"]``, ``info["executed_action"]``): the rollout sends
intervened steps to replay's "interventions" source. One
vector step commands every robot, then waits for the first state of each that used its command (one control tick).
A latched hold the gateway imposes (fault, e-stop) ends the episode as truncated with the reason in
``info["hold_reason"]``. Training never clears one: only the gateway's operator does (``rlfabric robot
clear-estop``). The reset of an arm that is still latched waits for that, up to ``latch_wait_s`` (keep it below
data_plane.timeout_s), with the arm held still, and then fails the step with the arm's id and the fix; once the latch
is cleared the reset walks the arm back to its start pose within the gateway's limits.

Camera (``camera: S``): the gateway renders each arm's camera at S x S pixels and serves the newest frame on its
camera data plane (ZeroMQ, never gRPC); the observation becomes a Dict of ``state`` (the vector above) and
``image`` (uint8 [S, S, 3], the newest frame when the observation is made).

Action chunks (``env.action_chunk: H``): a decision is H joint moves, one per control tick. ``info["idle_ticks"]``
counts the ticks the arm went without a fresh policy command (it waited for the policy). With
``realtime_chunks: true`` the env returns the observation before the chunk ends, ``d`` ticks early, and keeps
executing the chunk's last ``d`` moves while the policy computes the next one (real-time chunking): ``d`` is the
measured inference delay (the time between returning an observation and receiving the next chunk, in ticks, a
running mean rounded up, at most H - 1; ``info["lead_ticks"]``). The next chunk was planned from that observation,
so its first moves belong to ticks the tail already filled: execution starts at the index of the first tick not yet
executed. Ticks run by the tail count toward the next decision (its reward follows the observation it saw), so the
per-step arrays (``step_rewards``, ``step_valid``) are in tick order: the first ticks of a decision may be the
previous chunk's tail, and tick h > those ran move h of this chunk. An episode that ends in the tail ends that
next decision without running its chunk.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.dataplane import DataClient
from rlfabric.services.robot_gateway.cameras import FRAME_BYTES

collector = "gym"  # rollout.collector auto: gym stepping (the gateway keeps its own deadlines)
OPTIONS = {"gateway": str, "driver": str, "hz": (int, float), "watchdog_s": (int, float), "episode_steps": int,
           "action_scale": (int, float), "success_distance": (int, float), "start": str, "spin_s": (int, float),
           "start_noise": (int, float), "target": str, "realtime_chunks": bool, "camera": int,
           "latch_wait_s": (int, float)}
TASKS = ("reach",)
log = logging.getLogger(__name__)
_pools = itertools.count()


def _options(env_cfg: Any) -> dict[str, Any]:
    unknown = sorted(set(env_cfg.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"env.options {unknown} are not robot options; use {sorted(OPTIONS)}")
    opts = {"gateway": "", "driver": "sim", "hz": 50, "watchdog_s": 0.2,
            "episode_steps": 100, "action_scale": 0.05, "success_distance": 0.05, "start": "0,-0.3,0.6",
            "spin_s": -1, "start_noise": 0.0, "target": "random", "realtime_chunks": False, "camera": 0,
            "latch_wait_s": 10.0} | dict(env_cfg.options)
    for key, kind in OPTIONS.items():
        if not isinstance(opts[key], kind) or (isinstance(opts[key], bool) and kind is not bool):
            raise ValueError(f"env.options.{key}={opts[key]!r}: expected {kind}")
    if not opts["gateway"]:
        raise ValueError("env.options.gateway is not set. Fix: give the robot gateway's HOST:PORT (rlfabric serve "
                         "robot_gateway --port-file FILE writes it)")
    if env_cfg.id not in TASKS:
        raise ValueError(f"env.id={env_cfg.id!r}: robot tasks are {list(TASKS)}")
    from rlfabric.services.core.paths import process_endpoints

    process_endpoints().check(opts["gateway"].strip().lower(), "env.options.gateway")  # a spec dials no host it likes
    if not 1 <= opts["episode_steps"] <= 100_000 or not 0 < opts["action_scale"] <= 0.5:
        raise ValueError("env.options: episode_steps in [1, 100000], action_scale in (0, 0.5] rad")
    if not 0 <= opts["start_noise"] <= 1:
        raise ValueError(f"env.options.start_noise={opts['start_noise']}: give 0..1 rad (each joint's start is "
                         f"drawn within +-start_noise of start)")
    if not 0 <= opts["latch_wait_s"] <= 3600:
        raise ValueError(f"env.options.latch_wait_s={opts['latch_wait_s']}: give 0..3600 s (how long a reset waits "
                         f"for the operator to clear an arm's e-stop; below data_plane.timeout_s)")
    if opts["camera"] and not 8 <= opts["camera"] <= 256:
        raise ValueError(f"env.options.camera={opts['camera']}: give the frame size in pixels (8..256), or 0 for no "
                         f"camera")
    if opts["realtime_chunks"] and env_cfg.action_chunk < 2:
        raise ValueError("env.options.realtime_chunks executes a chunk's tail while the policy computes the next; "
                         "it needs env.action_chunk >= 2")
    if opts["target"] != "random":
        try:
            target = [float(v) for v in opts["target"].split(",")]
        except ValueError:
            target = []
        if len(target) != 3 or not np.isfinite(target).all():
            raise ValueError(f"env.options.target={opts['target']!r}: give 'random' or 'x,y,z' in metres")
    return opts


def check(env_cfg: Any) -> None:
    _options(env_cfg)


@dataclass
class Tick:
    """One control tick of one arm under a policy move: what the decision that owns it reports."""

    obs: np.ndarray
    reward: float
    terminated: bool
    truncated: bool
    intervened: bool
    executed: np.ndarray
    hold: str
    idle: int  # ticks before this one that had no fresh policy command

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class RobotVectorEnv(gym.vector.VectorEnv):
    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, env_cfg: Any, num_envs: int):
        from rlfabric.services.core import auth
        from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
        from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
        from rlfabric.services.core.runtime import GRPC_OPTIONS

        self.pb, self.opts = pb, _options(env_cfg)
        self.channel = auth.sync_channel(self.opts["gateway"], GRPC_OPTIONS)
        self.stub = robot_gateway_pb2_grpc.RobotGatewayStub(self.channel)
        pool = next(_pools)
        self.ids = [f"env{os.getpid()}-{pool}-{i}" for i in range(num_envs)]
        infos = []
        try:
            for rid in self.ids:
                infos.append(self.stub.Connect(pb.ConnectRequest(
                    robot_id=rid, driver=self.opts["driver"], options={"start": self.opts["start"]},
                    control_hz=self.opts["hz"], watchdog_s=self.opts["watchdog_s"], spin_s=self.opts["spin_s"],
                    camera_size=self.opts["camera"]), timeout=60))
        except grpc.RpcError as exc:
            self._disconnect(self.ids[:len(infos)])
            raise ValueError(f"the robot gateway at {self.opts['gateway']} refused Connect ({exc.code().name}: "
                             f"{exc.details()}). Fix: start it (rlfabric serve robot_gateway), give the deployment's "
                             f"RLFABRIC_TOKEN to both, or free robots there") from None
        self.joints = len(infos[0].joint_names)
        self.start = np.array([float(v) for v in self.opts["start"].split(",")])
        self.max_step = float(min(infos[0].limits.jump_max, 0.3))
        self.num_envs = num_envs
        self.horizon, self.realtime = env_cfg.action_chunk, self.opts["realtime_chunks"]
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (2 * self.joints + 6,), np.float32)
        self.camera_endpoint = infos[0].camera_endpoint
        self.frames = None  # the camera data-plane client, made by the thread that steps (sockets stay in one)
        if self.opts["camera"]:
            size = self.opts["camera"]
            self.single_observation_space = gym.spaces.Dict({
                "image": gym.spaces.Box(0, 255, (size, size, 3), np.uint8), "state": self.single_observation_space})
        self.single_action_space = gym.spaces.Box(
            -1.0, 1.0, (self.horizon, self.joints) if self.horizon > 1 else (self.joints,), np.float32)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        # each step waits for the state its command produced, so at most one command is ever waiting per robot
        self.outbox: list[queue.Queue] = [queue.Queue(maxsize=2) for _ in self.ids]
        self.streams = [self.stub.Control(self._commands(i)) for i in range(num_envs)]
        self.seq = 0
        self.targets = np.zeros((num_envs, 3))
        self.commanded = np.tile(self.start, (num_envs, 1))
        self.steps = np.zeros(num_envs, dtype=np.int64)
        self.rng = np.random.default_rng()
        self.last_tick = np.full(num_envs, -1, np.int64)  # the gateway tick that used each arm's newest command
        # real-time chunking: the tail of each arm's chunk runs in a thread while the caller computes
        self.tails: list[np.ndarray] = [np.zeros((0, self.joints))] * num_envs
        self.tail_ticks: list[list[Tick]] = [[] for _ in range(num_envs)]
        self.tail_thread: threading.Thread | None = None
        self.tail_stop = threading.Event()
        self.tail_error: BaseException | None = None
        self.returned_at: float | None = None
        self.delay_s = 0.0  # running mean of the caller's time between an observation and its next chunk

    def _commands(self, i: int):
        while True:
            cmd = self.outbox[i].get()
            if cmd is None:
                return
            yield cmd

    def _send(self, i: int, position: np.ndarray, resetting: bool = False) -> int:
        self.seq += 1
        self.outbox[i].put_nowait(self.pb.JointCommand(robot_id=self.ids[i], seq=self.seq,
                                                       position=position.tolist(), resetting=resetting))
        return self.seq

    def _state_after(self, i: int, seq: int):
        """The first state of robot i whose tick had command ``seq`` (``policy_seq``: the newest policy command a
        tick had): it moved the arm, or a latched hold (fault, e-stop) kept it still, or a human who intervenes
        commanded the arm instead. A watchdog hold from before (the learner was updating) is not that state: the
        command ends it."""
        for state in self.streams[i]:
            if state.policy_seq >= seq:
                return state
        raise RuntimeError(f"the gateway closed the control stream of {self.ids[i]}")

    def _obs(self, i: int, state) -> np.ndarray:
        return np.concatenate([state.position, state.velocity, self.targets[i], state.end_effector]).astype(
            np.float32)

    def _observation(self, i: int, vector: np.ndarray) -> Any:
        """What the policy sees: the state vector, with the camera's newest frame beside it when there is one."""
        if not self.opts["camera"]:
            return vector
        if self.frames is None:
            self.frames = DataClient(self.camera_endpoint, max_bytes=FRAME_BYTES, timeout_s=10.0)
        kind, frame = self.frames.request("frame", TensorBatch(meta={"robot_id": self.ids[i]}))
        image = np.asarray(frame["image"])
        if kind != "frame" or image.shape != self.single_observation_space["image"].shape or image.dtype != np.uint8:
            raise RuntimeError(f"the gateway's camera answered {kind!r} with an image of {image.shape} "
                               f"{image.dtype}, not {self.single_observation_space['image']}")
        return {"image": image, "state": vector}

    def _stack(self, observations: list[Any]) -> Any:
        if not self.opts["camera"]:
            return np.stack(observations)
        return {k: np.stack([o[k] for o in observations]) for k in ("image", "state")}

    def _unlatched(self, i: int):
        """The arm's state once no e-stop or fault is latched on it. Training never clears one (ISO 13850: a
        deliberate human act resets an e-stop): it waits ``latch_wait_s`` for the operator, the arm held still by
        the gateway, then fails naming the arm and the fix."""
        ref = self.pb.RobotRef(robot_id=self.ids[i])
        state = self.stub.GetState(ref, timeout=10)
        if not (state.estopped or state.fault):
            return state
        what = "e-stopped" if state.estopped else f"held by a latched fault ({state.fault})"
        fix = (f"the operator checks the arm, then runs `rlfabric robot clear-estop {self.ids[i]} --gateway "
               f"{self.opts['gateway']} --operator-token-file FILE`")
        log.warning("robot %s is %s: the run waits for the operator (up to %g s). Fix: %s", self.ids[i], what,
                    self.opts["latch_wait_s"], fix)
        deadline = time.monotonic() + self.opts["latch_wait_s"]
        while time.monotonic() < deadline:
            time.sleep(0.2)
            state = self.stub.GetState(ref, timeout=10)
            if not (state.estopped or state.fault):
                log.warning("robot %s was cleared by the operator: the run goes on", self.ids[i])
                return state
        raise RuntimeError(f"robot {self.ids[i]} is {what}, and training never clears an operator's e-stop or a "
                           f"latched fault; it waited {self.opts['latch_wait_s']:g} s (env.options.latch_wait_s). "
                           f"Fix: {fix}; then `rlfabric resume RUN_DIR` continues the run")

    def _reset(self, arms: list[int]) -> dict[int, Any]:
        """Walk ``arms`` back to their start poses together, one control tick for all of them at a time (steps the
        gateway accepts), once nothing latched holds each; draw each a reachable target; their observations. (In
        turn, arms that finished on the same step took one walk each.)"""
        noise = self.opts["start_noise"]
        target, start, state = {}, {}, {}
        for i in arms:
            state[i] = self._unlatched(i)
            target[i] = np.asarray(state[i].position)
            start[i] = self.start + (self.rng.uniform(-noise, noise, self.start.shape) if noise else 0.0)
        walking = list(arms)
        for _ in range(300):  # the gateway's slew limit paces the walk; done once the target is the start, settled
            if not walking:
                break
            # every command goes out before any state is awaited: the arms tick together
            seqs = {i: self._send(i, target[i] + np.clip(start[i] - target[i], -self.max_step, self.max_step),
                                  resetting=True) for i in walking}
            for i, seq in seqs.items():
                state[i] = self._state_after(i, seq)
                target[i] = np.asarray(state[i].target)
            walking = [i for i in walking if np.abs(target[i] - start[i]).max() >= 1e-9
                       or np.abs(state[i].velocity).max() >= 0.05]
        observations = {}
        for i in arms:
            self.commanded[i] = target[i]
            self.last_tick[i] = state[i].seq
            if self.opts["target"] == "random":
                yaw, reach = self.rng.uniform(-0.6, 0.6), self.rng.uniform(0.35, 0.5)
                height = self.rng.uniform(0.05, 0.3)
                self.targets[i] = [reach * np.cos(yaw), reach * np.sin(yaw), height]
            else:
                self.targets[i] = [float(v) for v in self.opts["target"].split(",")]
            self.steps[i] = 0
            observations[i] = self._observation(i, self._obs(i, state[i]))
        return observations

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._stop_tail()
        for ticks in self.tail_ticks:
            ticks.clear()
        self.returned_at = None
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        observations = self._reset(list(range(self.num_envs)))
        return self._stack([observations[i] for i in range(self.num_envs)]), {}

    # -- ticks -----------------------------------------------------------------------------------------------
    def _ticks(self, moves: dict[int, np.ndarray]) -> dict[int, Tick]:
        """One control tick of each arm in ``moves`` (a move in [-1, 1] per joint): every command goes out before
        any state is awaited, so the arms tick together."""
        before = {i: self.commanded[i].copy() for i in moves}
        seqs = {}
        for i, move in moves.items():
            self.commanded[i] = self.commanded[i] + np.clip(move, -1, 1) * self.opts["action_scale"]
            seqs[i] = self._send(i, self.commanded[i])
        out = {}
        for i, seq in seqs.items():
            state = self._state_after(i, seq)
            self.commanded[i] = np.asarray(state.target)  # what the gateway let through (or the human commanded)
            idle = max(0, int(state.seq - self.last_tick[i] - 1))
            self.last_tick[i] = state.seq
            self.steps[i] += 1
            distance = float(np.linalg.norm(np.asarray(state.end_effector) - self.targets[i]))
            terminated = distance < self.opts["success_distance"]
            hold = state.hold_reason if state.holding else ""
            truncated = not terminated and (bool(hold) or self.steps[i] >= self.opts["episode_steps"])
            executed = np.clip((self.commanded[i] - before[i]) / self.opts["action_scale"], -1, 1)
            out[i] = Tick(self._obs(i, state), float(terminated) - distance, bool(terminated), bool(truncated),
                          bool(state.intervening), executed.astype(np.float32), hold, idle)
        return out

    def _run_tail(self) -> None:
        """The thread that executes the chunks' tails while the caller computes, until told to stop."""
        try:
            k = 0
            while not self.tail_stop.is_set():
                moves = {i: tail[k] for i, tail in enumerate(self.tails)
                         if k < len(tail) and not (self.tail_ticks[i] and self.tail_ticks[i][-1].done)}
                if not moves:
                    return
                for i, tick in self._ticks(moves).items():
                    self.tail_ticks[i].append(tick)
                k += 1
        except BaseException as exc:  # handed to the caller's next step: a tail never fails silently
            self.tail_error = exc

    def _stop_tail(self) -> None:
        if self.tail_thread is not None:
            self.tail_stop.set()
            self.tail_thread.join()
            self.tail_thread = None
        if self.tail_error is not None:
            error, self.tail_error = self.tail_error, None
            raise RuntimeError(f"the robot env's chunk tail failed: {error}") from error

    def lead_ticks(self) -> int:
        """How many ticks before a chunk's end the observation goes back (the measured inference delay)."""
        if not self.realtime:
            return 0
        return min(self.horizon - 1, math.ceil(self.delay_s * self.opts["hz"]))

    # -- step --------------------------------------------------------------------------------------------------
    def step(self, actions):
        received = time.monotonic()
        self._stop_tail()
        if self.returned_at is not None:
            delay = received - self.returned_at
            self.delay_s = delay if self.delay_s == 0 else 0.8 * self.delay_s + 0.2 * delay
        moves = np.asarray(actions, dtype=float).reshape(self.num_envs, self.horizon, self.joints)
        ticks = [list(t) for t in self.tail_ticks]
        for t in self.tail_ticks:
            t.clear()
        lead = self.lead_ticks()
        # the chunk starts at its first tick not run yet (the tail ran the earlier ones) and runs to H - lead
        index = [len(t) for t in ticks]
        stop = [max(self.horizon - lead, k + 1) for k in index]
        while True:
            now = {i: moves[i, index[i]] for i in range(self.num_envs)
                   if index[i] < stop[i] and not (ticks[i] and ticks[i][-1].done)}
            if not now:
                break
            for i, tick in self._ticks(now).items():
                ticks[i].append(tick)
                index[i] += 1
        out = self._report(ticks)
        if self.realtime:
            self.tails = [moves[i, index[i]:] if not ticks[i][-1].done else np.zeros((0, self.joints))
                          for i in range(self.num_envs)]
            self.tail_stop.clear()
            self.tail_thread = threading.Thread(target=self._run_tail, name="robot-chunk-tail", daemon=True)
            self.tail_thread.start()
        self.returned_at = time.monotonic()
        return out

    def _report(self, ticks: list[list[Tick]]):
        """The vector step's return from each arm's ticks of this decision (auto-resetting arms that finished)."""
        n, H = self.num_envs, self.horizon
        last = [t[-1] for t in ticks]
        terminated = np.array([t.terminated for t in last])
        truncated = np.array([t.truncated for t in last])
        rewards = np.array([sum(t.reward for t in arm) for arm in ticks])
        done = terminated | truncated
        observations = [self._observation(i, t.obs) for i, t in enumerate(last)]
        finals: list[Any] = [None] * n
        fresh = self._reset([int(i) for i in np.flatnonzero(done)])
        for i, observation in fresh.items():
            finals[i], observations[i] = observations[i], observation
        obs = self._stack(observations)
        holds = [t.hold for t in last]
        facts: dict[str, Any] = {"intervened": np.array([any(t.intervened for t in arm) for arm in ticks]),
                                 "is_success": terminated.copy(),
                                 "idle_ticks": np.array([sum(t.idle for t in arm) for arm in ticks], np.int64)}
        if H == 1:
            facts["executed_action"] = np.stack([t.executed for t in last])
        else:
            executed = np.zeros((n, H, self.joints), np.float32)
            chunk = {k: np.zeros((n, H), np.float32) for k in ("step_rewards", "step_dones", "step_valid")}
            for i, arm in enumerate(ticks):
                for h, t in enumerate(arm):
                    executed[i, h] = t.executed
                    chunk["step_rewards"][i, h], chunk["step_valid"][i, h] = t.reward, 1.0
                chunk["step_dones"][i, len(arm) - 1] = float(arm[-1].done)
            facts |= chunk | {"executed_action": executed, "executed": np.array([len(a) for a in ticks], np.int64)}
        info: dict[str, Any] = {"hold_reason": np.array(holds, dtype=object), "_hold_reason": np.array(
            [bool(h) for h in holds]), "lead_ticks": np.full(n, self.lead_ticks(), np.int64)}
        info |= facts | {f"_{k}": ~done for k in facts}  # a finished env's last step is in final_info (gymnasium)
        if done.any():
            info["final_obs"], info["_final_obs"] = np.array(finals, dtype=object), done
            info["final_info"] = facts | {f"_{k}": done for k in facts}
        return obs, rewards, terminated, truncated, info

    def _disconnect(self, ids: list[str]) -> None:
        for rid in ids:
            try:
                self.stub.Disconnect(self.pb.RobotRef(robot_id=rid), timeout=10)
            except grpc.RpcError as exc:  # closing: say so, never raise
                log.warning("could not disconnect robot %s: %s", rid, exc.details())

    def close_extras(self, **kwargs: Any) -> None:
        try:
            self._stop_tail()
        except RuntimeError as exc:  # closing goes on (the arms are freed below), but the failure is said
            log.warning("%s", exc)
        for box in self.outbox:
            with contextlib.suppress(queue.Full):  # a full box's stream is cancelled just below anyway
                box.put_nowait(None)
        for stream in self.streams:
            stream.cancel()
        if self.frames is not None:
            self.frames.close()
        self._disconnect(self.ids)  # the arms brake and the gateway frees them
        self.channel.close()


def make_vector_env(env_cfg: Any, num_envs: int, vectorization: str = "sync") -> gym.vector.VectorEnv:
    return RobotVectorEnv(env_cfg, num_envs)
