"""ActionChunk: one policy decision executes a chunk of H primitive actions (VLA policies emit action chunks).

The chunk runs inside the sub-env, so an episode that ends at step h of a chunk stops there: the remaining
actions of the chunk are dropped (they were planned for an episode that is over, never executed on the next one),
and the vector env's same-step auto-reset starts the next episode as usual. The decision's reward is the sum of
the executed steps' rewards; per-step rewards, done flags and a validity mask come along in ``info`` so that an
algorithm can credit actions at step level, and ``executed`` says how many primitive steps ran.

Only the observation after a chunk's last executed step reaches the policy. An env with a camera that says so
(a ``skip_frames`` flag and an ``observe()`` method: ArmReach) skips rendering the frames of the steps before it:
rendering is most of a step's time (~60% of ArmReach's at 64x64 on the CPU), so a chunk of 4 renders one frame
instead of 4. Where the chunk ends early (success, a time limit) the step's observation is taken again with
its frame, from the same state: the observations are the same bytes as with every frame rendered. Between this
wrapper and that env there must be only wrappers that pass observations through unchanged (gymnasium's
TimeLimit, OrderEnforcing, PassiveEnvChecker); behind any other every frame is rendered.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker, TimeLimit

MAX_HORIZON = 256
STEP_KEYS = ("step_rewards", "step_dones", "step_valid")
TRANSPARENT = (TimeLimit, OrderEnforcing, PassiveEnvChecker)
"""Wrappers that return their env's observations unchanged: a frame-skipping env may sit behind them."""


def frame_skipping_env(env: gym.Env) -> Any | None:
    """The env under ``env`` that can skip the frames of a chunk's dropped steps (``skip_frames``, ``observe``),
    where only TRANSPARENT wrappers lie between; else None."""
    while isinstance(env, gym.Wrapper):
        if type(env) not in TRANSPARENT:
            return None
        env = env.env
    return env if hasattr(env, "skip_frames") and callable(getattr(env, "observe", None)) else None


class ActionChunk(gym.Wrapper):
    def __init__(self, env: gym.Env, horizon: int):
        super().__init__(env)
        if not isinstance(env.action_space, gym.spaces.Box):
            raise ValueError(f"env.action_chunk needs a Box action space (arm commands), not {env.action_space}. "
                             f"Fix: set env.action_chunk: 1 for this env")
        if not 1 <= horizon <= MAX_HORIZON:
            raise ValueError(f"env.action_chunk={horizon} must lie in [1, {MAX_HORIZON}]")
        self.horizon = horizon
        self.frames = frame_skipping_env(env) if horizon > 1 else None
        base = env.action_space
        self.action_space = gym.spaces.Box(np.repeat(base.low[None], horizon, 0), np.repeat(base.high[None], horizon, 0),
                                           (horizon, *base.shape), base.dtype)

    def step(self, actions: np.ndarray):
        H = self.horizon
        rewards = np.zeros(H, np.float32)
        dones = np.zeros(H, np.float32)
        valid = np.zeros(H, np.float32)
        terminated = truncated = False
        info: dict[str, Any] = {}
        frames = self.frames
        try:
            for h in range(H):
                if frames is not None:
                    frames.skip_frames = h < H - 1  # the last step's observation is the one returned
                obs, reward, terminated, truncated, info = self.env.step(actions[h])
                rewards[h], valid[h] = reward, 1.0
                if terminated or truncated:
                    dones[h] = 1.0
                    break
            if frames is not None and frames.skip_frames:  # ended early, on a step that kept the last frame
                obs = frames.observe()
        finally:
            if frames is not None:
                frames.skip_frames = False
        executed = int(valid.sum())
        info = dict(info, step_rewards=rewards, step_dones=dones, step_valid=valid, executed=executed)
        return obs, float(rewards.sum()), terminated, truncated, info


def info_rows(info: dict[str, Any], done: np.ndarray, key: str, shape: tuple[int, ...] = (),
              dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """A per-env ``info`` entry of a same-step auto-reset vector step, and which envs reported it: a sub-env that
    finished (and was reset in the same step) has it in ``final_info``, the others at the top level of ``info``."""
    n = len(done)
    out, have = np.zeros((n, *shape), dtype), np.zeros(n, bool)
    final = info.get("final_info", {})
    for source, rows in ((info, ~done), (final, done)):
        if key in source:
            mine = np.asarray(source.get(f"_{key}", np.ones(n, bool)), bool) & rows
            out[mine] = np.asarray(source[key])[mine]
            have |= mine
    return out, have


def step_fields(info: dict[str, Any], done: np.ndarray, horizon: int) -> dict[str, np.ndarray]:
    """Per-step chunk facts of a vector step (see ``info_rows``)."""
    out = {k: info_rows(info, done, k, (horizon,))[0] for k in STEP_KEYS}
    out["executed"] = info_rows(info, done, "executed", (), np.int64)[0]
    missing = out["executed"] == 0
    if missing.any():
        raise RuntimeError(f"env(s) {np.flatnonzero(missing).tolist()} reported no executed steps for an action "
                           f"chunk: a wrapper between ActionChunk and the vector env dropped its info")
    return out
