"""The scripted reach expert leads at the policy's pace: what HG-DAgger clones from it is one decision's motion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.robot_gateway.drivers.sim import SimArm  # noqa: E402
from rlfabric.services.robot_gateway.teleop import ReachExpert  # noqa: E402

GOAL, START = np.array([0.35, 0.15, 0.25]), np.array([0.0, -0.3, 0.6])


def state(q, target, policy_seq, resetting=False):
    return SimpleNamespace(position=list(q), velocity=[0.0] * 3, target=list(target), holding=False,
                           policy_seq=policy_seq, policy_resetting=resetting)


def test_the_expert_moves_once_per_policy_command_with_a_bounded_step_that_keeps_its_direction():
    arm = SimArm()
    expert = ReachExpert(GOAL, START, arm.forward_kinematics, patience=3)
    q, seq = START.copy(), 0
    assert expert.observe(state(q, q, seq)) == []  # settled at the start: it starts watching
    events = []
    while not events:  # a policy that sends commands and makes no progress
        seq += 1
        events = expert.observe(state(q, q, seq))
    [(kind, first)] = events
    assert kind == "start" and expert.mode == "helping"
    moves = []
    target = first
    for tick in range(60):
        new_decision = tick % 6 == 0  # an env step spans 6 gateway ticks: one policy command among them
        seq += new_decision
        [(kind, sent)] = expert.observe(state(target, target, seq))
        assert kind == "command"
        if not new_decision:
            assert np.array_equal(sent, target)  # between decisions it holds its target (the watchdog's command)
        else:
            step = sent - target
            assert np.abs(step).max() <= expert.step + 1e-12
            moves.append(step)
        target = sent
    # ten decisions, ten steps, each unclipped per joint: the direction of damped least squares, toward the goal
    assert len(moves) == 10 and all(np.abs(m).max() > 0 for m in moves)
    assert np.linalg.norm(arm.forward_kinematics(target) - GOAL) < np.linalg.norm(arm.forward_kinematics(first) - GOAL)
    ee, eps = arm.forward_kinematics(first), 1e-4
    J = np.stack([(arm.forward_kinematics(first + eps * np.eye(3)[j]) - ee) / eps for j in range(3)], 1)
    dq = J.T @ np.linalg.solve(J @ J.T + 1e-3 * np.eye(3), GOAL - ee)
    cosine = moves[0] @ dq / (np.linalg.norm(moves[0]) * np.linalg.norm(dq))
    assert cosine > 0.9999  # scaled, not clipped joint by joint


def test_an_episode_that_ends_under_the_expert_hands_the_arm_to_the_envs_reset_walk():
    """The env marks its walk back to the start pose (JointCommand.resetting, seen as RobotState.policy_resetting):
    the expert lets go at once, and watches again only once the walk is over and the policy acts. Before, it kept
    leading the arm to the goal while the walk waited, and took over walks from episodes that ran out of time."""
    arm = SimArm()
    expert = ReachExpert(GOAL, START, arm.forward_kinematics, patience=3)
    q, seq = START.copy(), 0
    expert.observe(state(q, q, seq))
    events = []
    while not events:
        seq += 1
        events = expert.observe(state(q, q, seq))
    assert expert.mode == "helping"
    seq += 1  # the episode ran out of time: the env's first reset move
    assert expert.observe(state(q, q, seq, resetting=True)) == [("stop", None)] and expert.mode == "resetting"
    for _ in range(20):  # the walk, one marked move per tick, ends settled at the start: no takeover
        seq += 1
        assert expert.observe(state(q, q, seq, resetting=True)) == []
    assert expert.mode == "resetting"
    seq += 1  # the policy's first command of the next episode
    assert expert.observe(state(q, q, seq)) == [] and expert.mode == "watching"
