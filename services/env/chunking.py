"""ActionChunk: one policy decision executes a chunk of H primitive actions (VLA policies emit action chunks).

The chunk runs inside the sub-env, so an episode that ends at step h of a chunk stops there: the remaining
actions of the chunk are dropped (they were planned for an episode that is over, never executed on the next one),
and the vector env's same-step auto-reset starts the next episode as usual. The decision's reward is the sum of
the executed steps' rewards; per-step rewards, done flags and a validity mask come along in ``info`` so that an
algorithm can credit actions at step level, and ``executed`` says how many primitive steps ran.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

MAX_HORIZON = 256
STEP_KEYS = ("step_rewards", "step_dones", "step_valid")


class ActionChunk(gym.Wrapper):
    def __init__(self, env: gym.Env, horizon: int):
        super().__init__(env)
        if not isinstance(env.action_space, gym.spaces.Box):
            raise ValueError(f"env.action_chunk needs a Box action space (arm commands), not {env.action_space}. "
                             f"Fix: set env.action_chunk: 1 for this env")
        if not 1 <= horizon <= MAX_HORIZON:
            raise ValueError(f"env.action_chunk={horizon} must lie in [1, {MAX_HORIZON}]")
        self.horizon = horizon
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
        for h in range(H):
            obs, reward, terminated, truncated, info = self.env.step(actions[h])
            rewards[h], valid[h] = reward, 1.0
            if terminated or truncated:
                dones[h] = 1.0
                break
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
