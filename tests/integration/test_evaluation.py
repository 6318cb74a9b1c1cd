"""Evaluation reports success where the env says it: every episode of rlfabric/ArmReach-v0 comes back with its
return and whether it succeeded (its return is above 1 exactly when it does), and an env without ``is_success``
(CartPole) reports none rather than zeros. It acts as ``train.eval_deterministic`` says: a policy whose argmax
loops but whose samples succeed scores 0 one way and about 1 the other, in ``rlfabric eval`` (the run's setting
unless a flag says otherwise) and in a run's own evaluation (metrics.csv says which mode scored)."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric.services.cli import build_parser, cmd_eval
from rlfabric.services.coordinator.loop import TrainingLoop
from rlfabric.services.coordinator.registry import Worker
from rlfabric.services.coordinator.run import Run
from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.proto.rlfabric.v1 import rollout_pb2_grpc
from rlfabric.services.core.runtime import ServiceOptions, ServiceRuntime
from rlfabric.services.env.local import LocalEnvChannel
from rlfabric.services.learner.checkpoint import pack
from rlfabric.services.rollout.backends import build_backend
from rlfabric.services.rollout.collectors.gym import play
from rlfabric.services.rollout.evaluate import _env_spec, evaluate_checkpoint
from rlfabric.services.rollout.server import RolloutService
from rlfabric.services.rollout.worker import RolloutWorker
from tests.conftest import short_config

CORRIDOR = "rlfabric-test/Corridor-v0"


class Corridor(gym.Env):
    """Three steps forward reach the goal (return 1, success); waiting goes nowhere until the 20-step limit.
    The cheapest grid world where argmax loops: a policy that prefers waiting never arrives under argmax, and its
    samples (3 forward moves in 20 at p=0.4) almost always do."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)  # 0 waits, 1 steps forward

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        return self._obs(), {"is_success": False}

    def step(self, action):
        self.pos += int(action)
        arrived = self.pos >= 3
        return self._obs(), float(arrived), arrived, False, {"is_success": arrived}

    def _obs(self) -> np.ndarray:
        return np.array([self.pos / 3], np.float32)


if CORRIDOR not in gym.registry:
    gym.register(CORRIDOR, entry_point=Corridor, max_episode_steps=20)


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


def waiting_run(eval_deterministic: bool, **sections) -> tuple[RunConfig, dict, dict]:
    """A corridor run's spec, env spec and a policy that waits with p=0.6 and steps forward with p=0.4, whatever
    it sees."""
    config = RunConfig.model_validate({"env": {"id": CORRIDOR, "num_envs": 2, "eval_envs": 4},
                                       "train": {"eval_deterministic": eval_deterministic, "eval_episodes": 16},
                                       **sections})
    spec = _env_spec(config)
    policy = build_backend(config.rollout.backend, config, spec, "cpu").policy
    with torch.no_grad():
        policy.pi_head.weight.zero_()
        policy.pi_head.bias.copy_(torch.tensor([math.log(0.6), math.log(0.4)]))
    return config, spec, policy.state_dict()


def waiting_checkpoint(path, eval_deterministic: bool):
    config, spec, policy = waiting_run(eval_deterministic)
    path.write_bytes(pack({"config_json": config.to_json(), "env_spec_json": json.dumps(spec),
                           "policy": policy, "weight_version": 0}))
    return path


def test_an_argmax_that_loops_scores_nothing_where_its_samples_succeed(tmp_path):
    ckpt = waiting_checkpoint(tmp_path / "final.pt", eval_deterministic=False)
    greedy = evaluate_checkpoint(ckpt, 16, deterministic=True)
    sampled = evaluate_checkpoint(ckpt, 16)  # the run's own setting: sampled
    assert greedy.deterministic is True and sampled.deterministic is False
    assert greedy.returns == [0.0] * 16 and greedy.successes == [0.0] * 16  # waits until the time limit
    assert sum(sampled.successes) >= 14 and sampled.returns == sampled.successes
    assert evaluate_checkpoint(ckpt, 16).returns == sampled.returns  # the run's eval seed: it reproduces


@pytest.mark.parametrize("eval_deterministic,flags,mode", [
    (True, [], "deterministic"), (False, [], "stochastic"),
    (True, ["--stochastic"], "stochastic"), (False, ["--deterministic"], "deterministic")])
def test_rlfabric_eval_follows_the_runs_setting_unless_a_flag_says(tmp_path, capsys, eval_deterministic, flags,
                                                                   mode):
    ckpt = waiting_checkpoint(tmp_path / "final.pt", eval_deterministic)
    assert cmd_eval(build_parser().parse_args(["eval", str(ckpt), "--episodes", "8", *flags])) == 0
    out = capsys.readouterr()
    assert f"8 {mode} episodes" in out.err  # the summary line; stdout carries the mean alone
    mean = float(out.out.splitlines()[-1])
    assert mean == 0.0 if mode == "deterministic" else mean >= 0.75


def test_eval_mode_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "final.pt", "--stochastic", "--deterministic"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("eval_deterministic", [True, False])
def test_a_runs_evaluation_reaches_the_rollout_worker_in_the_specs_mode(tmp_path, eval_deterministic):
    """The coordinator's evaluation (periodic and final) through a real rollout service and worker, over gRPC:
    the corridor policy scores 0 under argmax and about 1 sampled, and only the sampled one stops the run early."""
    config, spec, policy = waiting_run(eval_deterministic, scheduling={"mode": "collocated"},
                                       data_plane={"timeout_s": 0.2})  # no learner: it evaluates what it holds
    config.train.stop_at_eval_return = 0.5

    async def scenario() -> tuple[dict[str, float], bool]:
        runtime = ServiceRuntime(ServiceOptions("rollout"))
        service = RolloutService(runtime)
        rollout_pb2_grpc.add_RolloutServicer_to_server(service, runtime.server)
        address = f"127.0.0.1:{runtime.server.add_insecure_port('127.0.0.1:0')}"
        await runtime.server.start()
        nobody = "tcp://127.0.0.1:9"  # the env runs in the worker; replay and learner never answer
        service.worker = await asyncio.to_thread(RolloutWorker, config, spec,
                                                 {"env": nobody, "replay": nobody, "learner": nobody})
        service.worker.backend.load(0, policy)
        service.worker.version = 0
        loop = TrainingLoop(Run("eval-mode", config, tmp_path),
                            {"rollout": [Worker("rollout-0", "rollout", address, "", "", os.getpid(), "localhost")]})
        try:
            ev = await loop.evaluate()
            return loop.eval_values(ev), loop.reached(ev)
        finally:
            await loop.plan.close()
            service.close()
            await runtime.server.stop(None)

    values, reached = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert values["eval_deterministic"] == float(eval_deterministic) and reached is not eval_deterministic
    if eval_deterministic:
        assert values["eval_return_mean"] == 0.0 and values["eval_success_rate"] == 0.0
    else:
        assert values["eval_success_rate"] >= 14 / 16 and values["eval_return_mean"] == values["eval_success_rate"]



def submit_when_idle(stack, cfg, run_dir):
    """Submit once the shared stack's workers are free of an earlier test's run."""
    deadline = time.monotonic() + 30
    while any(w.run_id for w in stack.client.workers()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return stack.client.submit(cfg, run_dir=run_dir)

def test_a_runs_evaluation_samples_when_the_spec_says_and_its_metrics_say_so(stack, tmp_path):
    run_dir = tmp_path / "run"
    cfg = short_config(train={"total_env_steps": 640, "eval_every_iterations": 5, "eval_episodes": 2,
                              "eval_deterministic": False})
    status = submit_when_idle(stack, cfg, run_dir)
    final = [e.status for e in stack.client.watch(status.run_id) if e.HasField("status")][-1]
    assert "best eval mean return of sampled actions" in final.reason, final
    table = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    assert [r["eval_deterministic"] for r in table if r["eval_return_mean"]] == ["0.0", "0.0"]


def test_a_run_ends_with_a_held_out_evaluation_in_its_own_row(stack, tmp_path):
    """train.held_out_episodes: after the last iteration's evaluation, one more of that many episodes, from seeds no
    periodic evaluation uses, in a last metrics row of its own and in the run's final status."""
    run_dir = tmp_path / "run"
    cfg = short_config(train={"total_env_steps": 640, "eval_every_iterations": 5, "eval_episodes": 2,
                              "held_out_episodes": 6})
    status = submit_when_idle(stack, cfg, run_dir)
    final = [e.status for e in stack.client.watch(status.run_id) if e.HasField("status")][-1]
    assert "held out: mean return" in final.reason and "over 6 episodes" in final.reason, final
    table = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    *periodic, last = table
    assert last["held_out_episodes"] == "6" and float(last["held_out_return_mean"]) > 0 and not last["eval_return_mean"]
    assert last["iteration"] == periodic[-1]["iteration"] and periodic[-1]["eval_return_mean"]  # after the final eval
    assert not any(r["held_out_return_mean"] for r in periodic)

