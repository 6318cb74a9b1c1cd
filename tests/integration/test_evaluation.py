"""Evaluation reports success where the env says it: every episode of rlfabric/ArmReach-v0 comes back with its
return and whether it succeeded (its return is above 1 exactly when it does), and an env without ``is_success``
(CartPole) reports none rather than zeros."""

from __future__ import annotations

import numpy as np
import pytest

from services.core.config import RunConfig
from services.env.local import LocalEnvChannel
from services.rollout.backends import build_backend
from services.rollout.collectors.gym import play
from services.rollout.evaluate import _env_spec


def evaluation(run: dict, episodes: int):
    config = RunConfig.model_validate(run)
    env = LocalEnvChannel(config)
    try:
        backend = build_backend(config.rollout.backend, config, _env_spec(config), "cpu")
        return play(env, backend, config.env.eval_envs, episodes, seed=3, random=True)[0]
    finally:
        env.close()


def test_eval_episodes_say_whether_they_succeeded_where_the_env_reports_it():
    pytest.importorskip("mujoco")
    ev = evaluation({"env": {"id": "rlfabric/ArmReach-v0", "kwargs": {"observation": "state"}, "action_chunk": 4,
                             "num_envs": 4, "eval_envs": 4}}, 48)
    assert len(ev.returns) == len(ev.successes) == 48 and set(ev.successes) <= {0.0, 1.0}
    assert 0 < sum(ev.successes) < 48  # random arms sometimes touch the ball
    assert ((np.array(ev.returns) > 1) == (np.array(ev.successes) == 1)).all()


def test_an_env_without_is_success_reports_no_successes():
    ev = evaluation({"env": {"id": "CartPole-v1", "num_envs": 2, "eval_envs": 2}}, 4)
    assert len(ev.returns) == 4 and ev.successes == []
