"""The static scheduler's pieces that need no services: candidate plans of a run, the profile fit from measured
iterations, and `rlfabric plan` ranking plans on a cluster from a saved profile."""

from __future__ import annotations

import json

import pytest

from rlfabric.services.cli import main
from rlfabric.services.coordinator.records import IterationRecord
from rlfabric.services.coordinator.scheduler import candidates, control_overhead, fit_profile, shape
from rlfabric.services.coordinator.simulator import Pool, simulate
from rlfabric.services.core.config import parse_config


def test_candidates_keep_the_algorithm_and_vary_placement():
    sched = parse_config("scheduling: {mode: auto, staleness: 1, pipeline_chunks: 2}").scheduling
    plans = candidates(sched)
    assert set(plans) == {"collocated", "hybrid env+rollout|learner", "hybrid env|rollout+learner", "disaggregated"}
    assert all(p.staleness == 1 and p.rollout_workers == sched.rollout_workers for p in plans.values())
    assert plans["collocated"].env_in_rollout() and not plans["collocated"].learner_overlaps()
    assert plans["hybrid env+rollout|learner"].env_in_rollout() and plans["hybrid env+rollout|learner"].learner_overlaps()
    assert plans["hybrid env|rollout+learner"].chunks() == 2 and not plans["hybrid env|rollout+learner"].learner_overlaps()
    assert plans["disaggregated"].effective_staleness() == 1 and plans["disaggregated"].chunks() == 2
    with pytest.raises(ValueError, match="unknown plan"):
        candidates(sched.model_copy(update={"candidates": ["warp"]}))


def _record(**kw) -> IterationRecord:
    return IterationRecord(**{"iteration": 1, "plan": "p", "env_steps": 0, "wall_time_s": 0.0,
                              "iteration_seconds": 0.0, **kw})


def test_profile_fit_recovers_stage_costs_and_predicts_the_turns_plan():
    T, N = 32, 16
    env, call, per_env, train = 40e-6, 100e-6, 10e-6, 0.05  # seconds: per env step, per act, per act row, update
    policy_full = T * (call + per_env * N)
    turns = [_record(policy_seconds=policy_full, collect_seconds=policy_full + T * env * N, train_seconds=train,
                     weight_wait_seconds=0.001, iteration_seconds=policy_full + T * env * N + train + 0.011)] * 3
    piped = [_record(policy_seconds=2 * T * (call + per_env * N / 2), collect_seconds=0.05, train_seconds=train)] * 3
    profile = fit_profile(T, N, 2, turns, piped, N)
    assert profile.env_step_s == pytest.approx(env) and profile.policy_per_env_s == pytest.approx(per_env)
    assert profile.policy_call_s == pytest.approx(call) and profile.train_s_per_transition * T * N == pytest.approx(train)
    assert control_overhead(turns) == pytest.approx(0.01)
    sched = parse_config("").scheduling
    pred = simulate(profile, shape("collocated", sched, N, T, 1, 1), {"host": Pool("host", 2)}, iterations=4)
    assert pred.iteration_s == pytest.approx(0.001 + policy_full + T * env * N + train, rel=0.01)


def test_plan_command_ranks_plans_on_a_cluster(tmp_path, capsys):
    profile = {"env_step_s": 40e-6, "policy_call_s": 1e-4, "policy_per_env_s": 1e-5, "ipc_s": 1e-4,
               "train_s_per_transition": 5e-5, "sync_s": 1e-3}
    (tmp_path / "plan.json").write_text(json.dumps({"profile": profile}))
    with pytest.raises(SystemExit) as done:
        main(["plan", "examples/halfcheetah_ppo.yaml", "--cluster", "rollout=8,learner=8", "--profile",
              str(tmp_path), "--top", "3"])
    assert done.value.code == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert best["env_steps_per_s"] > 0 and "learner@" in best["best"]
    with pytest.raises(SystemExit) as done:
        main(["plan", "examples/halfcheetah_ppo.yaml", "--cluster", "rollout=8", "--profile", str(tmp_path / "x")])
    assert done.value.code == 2 and "scheduling.mode=auto" in capsys.readouterr().err
