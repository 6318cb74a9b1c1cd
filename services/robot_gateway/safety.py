"""Safety limits the gateway enforces on every command, whatever the client sends.

    position     each joint target is clipped into [position_min, position_max]
    velocity     a target moves at most velocity_max * dt per tick from the last target
    slew         ... and at most slew_max per tick (the tighter of the two wins)
    position     the final target is clipped into the position limits once more, after every other step (belt
                 and braces: no later step may carry it out of them)
    jump         a command further than jump_max from the measured position faults: the arm holds, it never
                 chases a far target (a stale, corrupt or mis-indexed command)
    workspace    the end effector of the target, through the driver's forward kinematics, must stay inside the
                 workspace box, or the arm holds and the gateway faults

Limits can be narrowed at runtime and widened back, never past the driver's hard limits. Velocity and slew limits
are >= 0 and jump_max > 0: a negative step bound would clip every move to "the negative step", driving the arm one
way whatever it is commanded (a zero velocity or slew limit freezes the joint, which is safe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np


class LimitError(ValueError):
    """A limits request that would widen past the hard limits, or is malformed (names the field and the fix)."""


@dataclass(frozen=True)
class Limits:
    position_min: np.ndarray
    position_max: np.ndarray
    velocity_max: np.ndarray  # per joint, rad/s
    slew_max: np.ndarray  # per joint, rad per tick
    jump_max: float  # rad, largest |command - measured| followed
    workspace_min: np.ndarray  # x, y, z of the end effector
    workspace_max: np.ndarray

    def within(self, hard: Limits) -> None:
        """Raise LimitError naming the first field of these limits that is wider than ``hard``."""
        lower = ("position_min", "workspace_min")
        for f in fields(self):
            mine, theirs = np.asarray(getattr(self, f.name), float), np.asarray(getattr(hard, f.name), float)
            if mine.shape != theirs.shape:
                raise LimitError(f"{f.name} has {mine.size} values, the robot has {theirs.size}. Fix: give one value "
                                 f"per {'axis (x, y, z)' if 'workspace' in f.name else 'joint'}")
            if not np.isfinite(mine).all():
                raise LimitError(f"{f.name} holds a non-finite value. Fix: give finite limits")
            if f.name in ("velocity_max", "slew_max") and (mine < 0).any():
                i = int(np.flatnonzero(mine < 0)[0])
                raise LimitError(f"{f.name}[{i}]={mine.flat[i]:g} is negative. Fix: give a bound >= 0 (0 freezes the "
                                 f"joint); a negative one would drive the arm against its commands")
            if f.name == "jump_max" and not mine > 0:
                raise LimitError(f"jump_max={float(mine):g} must be > 0. Fix: give the largest distance (rad) between "
                                 f"a command and the measured position the arm may follow")
            wider = mine < theirs if f.name in lower else mine > theirs
            if wider.any():
                i = int(np.flatnonzero(wider)[0])
                raise LimitError(f"{f.name}[{i}]={mine.flat[i]:g} is wider than the driver's hard limit "
                                 f"{theirs.flat[i]:g}. Limits can be narrowed, never widened past the hard limits")
        if (self.position_min > self.position_max).any() or (self.workspace_min > self.workspace_max).any():
            raise LimitError("a minimum is above its maximum. Fix: position_min <= position_max and "
                             "workspace_min <= workspace_max")

    def same_as(self, other: Limits) -> bool:
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    def merged(self, **changes: np.ndarray | float) -> Limits:
        """These limits with the given fields replaced (the rest kept)."""
        return replace(self, **{k: (np.asarray(v, float) if k != "jump_max" else float(v)) for k, v in changes.items()})


@dataclass
class Verdict:
    """What the filter made of one command: the target to send, or a fault (hold), and what it changed."""

    target: np.ndarray
    fault: str = ""
    clipped: bool = False  # a position limit cut the command
    slowed: bool = False  # the velocity or slew limit cut it


class SafetyFilter:
    def __init__(self, limits: Limits, forward_kinematics: Callable[[np.ndarray], np.ndarray]):
        self.limits, self.fk = limits, forward_kinematics

    def apply(self, command: np.ndarray, measured: np.ndarray, last_target: np.ndarray, dt: float) -> Verdict:
        lim = self.limits
        if command.shape != measured.shape or not np.isfinite(command).all():
            return Verdict(last_target, fault=f"a command of shape {command.shape} with non-finite values or the "
                                              f"wrong joint count (the robot has {measured.size} joints)")
        gap = np.abs(command - measured)
        if gap.max() > lim.jump_max:
            j = int(gap.argmax())
            return Verdict(last_target, fault=f"jump: joint {j} commanded {gap[j]:.3f} rad from where it is "
                                              f"(jump_max {lim.jump_max:.3f}); holding instead of following")
        target = np.clip(command, lim.position_min, lim.position_max)
        clipped = bool((target != command).any())
        step = np.maximum(np.minimum(lim.velocity_max * dt, lim.slew_max), 0.0)  # within() refuses < 0 already
        limited = np.clip(last_target + np.clip(target - last_target, -step, step), lim.position_min,
                          lim.position_max)
        slowed = bool((limited != target).any())
        xyz = self.fk(limited)
        if (xyz < lim.workspace_min).any() or (xyz > lim.workspace_max).any():
            return Verdict(last_target, fault=f"workspace: the target puts the end effector at "
                                              f"{np.round(xyz, 3).tolist()}, outside [{lim.workspace_min.tolist()}, "
                                              f"{lim.workspace_max.tolist()}]")
        return Verdict(limited, clipped=clipped, slowed=slowed)


__all__ = ["LimitError", "Limits", "SafetyFilter", "Verdict"]
