"""The cluster simulator against hand-computed iteration times and the behaviours the scheduler relies on."""

from dataclasses import replace

import pytest

from rlfabric.services.coordinator.simulator import PlanShape as Plan
from rlfabric.services.coordinator.simulator import (
    Pool,
    Prediction,
    StageProfile,
    candidate_plans,
    parse_cluster,
    rank,
    simulate,
    split,
)


def plan(name="p", num_envs=8, n_steps=32, rollout_workers=1, env_in_rollout=True, env_workers=1, chunks=1,
         learner_overlaps=False, staleness=0, placement=None, learner_workers=1, allreduce_s=0.0) -> Plan:
    placement = placement or {"env": "a", "rollout": "a", "learner": "a"}
    return Plan(name, num_envs, n_steps, rollout_workers, env_in_rollout, env_workers, chunks, learner_overlaps,
                staleness, placement, learner_workers, allreduce_s)


def pools(**units) -> dict[str, Pool]:
    return {name: Pool(name, u) for name, u in units.items()}


PROFILE = StageProfile(env_step_s=1e-3, env_call_s=2e-4, policy_call_s=5e-4, policy_per_env_s=1e-5,
                       train_s_per_transition=2e-5, train_call_s=0.01, sync_s=0.005)


# --- hand-checked cases ------------------------------------------------------------------------------------------


def test_collocated_iteration_time_matches_hand_computation():
    n, t = 8, 32
    pred = simulate(PROFILE, plan(num_envs=n, n_steps=t), pools(a=1))
    p = PROFILE
    step = p.policy_call_s + p.policy_per_env_s * n + p.env_call_s + p.env_step_s * n
    expected = p.sync_s + t * step + p.train_call_s + p.train_s_per_transition * t * n
    assert pred.iteration_s == pytest.approx(expected, rel=0.01)
    assert pred.env_steps_per_s == pytest.approx(t * n / expected, rel=0.01)
    assert pred.utilisation["a"] == pytest.approx(1.0)  # one process at a time, never idle


def test_data_parallel_workers_and_learner_ranks_match_hand_computation():
    n, t, allreduce = 8, 32, 0.003
    pred = simulate(PROFILE, plan(num_envs=n, n_steps=t, rollout_workers=2, learner_workers=2,
                                  allreduce_s=allreduce), pools(a=2))
    p = PROFILE
    step = p.policy_call_s + p.policy_per_env_s * n / 2 + p.env_call_s + p.env_step_s * n / 2
    expected = p.sync_s + t * step + p.train_call_s + p.train_s_per_transition * t * n / 2 + allreduce
    assert pred.iteration_s == pytest.approx(expected, rel=0.01)


# --- learner overlap ----------------------------------------------------------------------------------------------

LEARNER_BOUND = StageProfile(env_step_s=1e-4, policy_call_s=1e-4, train_s_per_transition=1e-4, train_call_s=0.02)
SPLIT = {"env": "a", "rollout": "a", "learner": "b"}


def test_overlapping_learner_beats_taking_turns_when_learner_bound():
    n, t = 8, 32
    p = LEARNER_BOUND
    rollout = t * (p.policy_call_s + p.env_step_s * n)
    train = p.train_call_s + p.train_s_per_transition * t * n
    assert train > rollout  # the premise
    turns = simulate(p, plan(placement=SPLIT), pools(a=1, b=1))
    overlap = simulate(p, plan(placement=SPLIT, learner_overlaps=True, staleness=1), pools(a=1, b=1))
    assert turns.iteration_s == pytest.approx(rollout + train, rel=0.01)
    assert overlap.iteration_s == pytest.approx(max(rollout, train), rel=0.01)
    assert overlap.env_steps_per_s > 1.5 * turns.env_steps_per_s
    assert overlap.utilisation["b"] == pytest.approx(1.0, abs=0.01)  # the learner never waits for data


def test_staleness_zero_gives_no_overlap():
    turns = simulate(LEARNER_BOUND, plan(placement=SPLIT), pools(a=1, b=1))
    on_policy = simulate(LEARNER_BOUND, plan(placement=SPLIT, learner_overlaps=True, staleness=0), pools(a=1, b=1))
    assert on_policy.iteration_s == pytest.approx(turns.iteration_s, rel=1e-9)


def test_overlap_gains_nothing_when_learner_and_rollout_share_one_unit():
    turns = simulate(LEARNER_BOUND, plan(), pools(a=1))
    overlap = simulate(LEARNER_BOUND, plan(learner_overlaps=True, staleness=1), pools(a=1))
    assert overlap.iteration_s == pytest.approx(turns.iteration_s, rel=0.01)


# --- env chunks pipelined against inference -----------------------------------------------------------------------

# no fixed costs, no learner: an iteration is the rollout, act and env cost linear in envs
PIPE = StageProfile(env_step_s=2e-4, policy_per_env_s=1e-4)
APART = {"env": "e", "rollout": "r", "learner": "l"}


@pytest.mark.parametrize("chunks", [1, 2])
def test_chunks_pipeline_env_against_policy_on_separate_units(chunks):
    n, t = 8, 32
    act, env = PIPE.policy_per_env_s * n, PIPE.env_step_s * n
    pred = simulate(PIPE, plan(num_envs=n, n_steps=t, env_in_rollout=False, chunks=chunks, placement=APART),
                    pools(e=1, r=1, l=1))
    if chunks == 1:
        assert pred.iteration_s == pytest.approx(t * (act + env), rel=0.01)
    else:  # per step max(env, policy), plus filling the pipeline once (half an act)
        assert pred.iteration_s == pytest.approx(t * max(act, env), rel=0.02)
        assert pred.utilisation["e"] > 0.97


def test_chunks_gain_nothing_when_env_and_policy_share_one_unit():
    n, t = 8, 32
    shared = {"env": "a", "rollout": "a", "learner": "l"}
    one = simulate(PIPE, plan(num_envs=n, n_steps=t, env_in_rollout=False, chunks=1, placement=shared),
                   pools(a=1, l=1))
    two = simulate(PIPE, plan(num_envs=n, n_steps=t, env_in_rollout=False, chunks=2, placement=shared),
                   pools(a=1, l=1))
    expected = t * (PIPE.policy_per_env_s + PIPE.env_step_s) * n
    assert one.iteration_s == pytest.approx(expected, rel=0.01)
    assert two.iteration_s == pytest.approx(expected, rel=0.01)


def test_timeline_shows_env_and_policy_overlapping():
    pred = simulate(PIPE, plan(n_steps=4, env_in_rollout=False, chunks=2, placement=APART), pools(e=1, r=1, l=1),
                    iterations=2, keep_timeline=True)
    acts = [s for s in pred.timeline if s.what == "act"]
    envs = [s for s in pred.timeline if s.what == "env"]
    assert {s.pool for s in acts} == {"r"} and {s.pool for s in envs} == {"e"}
    assert any(a.start < e.end and e.start < a.end for a in acts for e in envs)


# --- env-bound profiles want env work spread out ------------------------------------------------------------------

ENV_BOUND = StageProfile(env_step_s=2e-3, env_call_s=1e-4, policy_call_s=3e-4, policy_per_env_s=1e-5, ipc_s=1e-4,
                         train_s_per_transition=1e-5, train_call_s=0.005, sync_s=0.002)


def test_env_bound_best_plan_on_two_cores_takes_the_policy_off_the_env_core():
    profile = replace(ENV_BOUND, policy_per_env_s=5e-4)  # env still 4x the policy per env, but the policy matters
    cluster = pools(a=1, b=1)
    ranked = rank(profile, candidate_plans(8, 32, cluster), cluster)
    collocated = next(pred for p, pred in ranked if p.name.startswith("collocated"))
    best_plan, best = ranked[0]
    assert not best_plan.name.startswith("collocated")
    assert not best_plan.env_in_rollout and best_plan.placement["env"] != best_plan.placement["rollout"]
    assert best.env_steps_per_s > 1.15 * collocated.env_steps_per_s
    assert best.bottleneck == best_plan.placement["env"]
    assert [pred.env_steps_per_s for _, pred in ranked] == sorted((pred.env_steps_per_s for _, pred in ranked),
                                                                   reverse=True)


def test_env_bound_spreading_env_over_more_cores_scales():
    collocated = simulate(ENV_BOUND, plan(), pools(a=1, b=4))
    spread = simulate(ENV_BOUND, plan(rollout_workers=4, env_in_rollout=False, env_workers=4, chunks=2,
                                      learner_overlaps=True, staleness=1,
                                      placement={"env": "b", "rollout": "a", "learner": "a"}), pools(a=1, b=4))
    assert spread.env_steps_per_s > 2.5 * collocated.env_steps_per_s
    assert spread.bottleneck == "b"


# --- larger clusters ----------------------------------------------------------------------------------------------

GPU = StageProfile(env_step_s=2e-5, env_call_s=2e-4, policy_call_s=5e-4, policy_per_env_s=1e-6,
                   train_s_per_transition=4e-6, train_call_s=0.02, sync_s=0.01, device="gpu")


def gpu_plan(workers: int) -> Plan:
    return plan(num_envs=8192, n_steps=32, rollout_workers=workers, learner_overlaps=True, staleness=1,
                placement={"env": "rollout", "rollout": "rollout", "learner": "learner"}, learner_workers=8,
                allreduce_s=0.005)


def test_scaling_rollout_workers_is_sublinear_once_the_learner_dominates():
    rates = {}
    for w in (8, 16, 32, 64):
        pred = simulate(GPU, gpu_plan(w), pools(rollout=w, learner=8))
        rates[w] = pred.env_steps_per_s
    assert rates[8] < rates[16] < rates[32] < rates[64]
    assert rates[16] / rates[8] > 1.8                     # rollout-bound: nearly linear
    assert rates[64] / rates[32] < 1.4                    # learner-bound: diminishing returns
    assert rates[64] < 0.6 * 8 * rates[8]
    train = GPU.train_call_s + GPU.train_s_per_transition * 32 * 8192 / 8 + 0.005
    assert rates[64] <= 32 * 8192 / train * 1.001         # the learner's rate is the ceiling
    assert simulate(GPU, gpu_plan(64), pools(rollout=64, learner=8)).bottleneck == "learner"


def test_folding_identical_replicas_matches_the_full_cluster():
    cluster = pools(a=8, b=8)
    p = plan(num_envs=1536, n_steps=16, rollout_workers=16, env_in_rollout=False, env_workers=16, chunks=2,
             learner_overlaps=True, staleness=1, placement={"env": "a", "rollout": "a", "learner": "b"},
             learner_workers=8, allreduce_s=0.01)
    folded, full = simulate(GPU, p, cluster), simulate(GPU, p, cluster, fold_replicas=False)
    assert folded.replicas == 8 and full.replicas == 1
    assert folded.iteration_s == pytest.approx(full.iteration_s, rel=0.02)
    assert folded.utilisation["a"] == pytest.approx(full.utilisation["a"], abs=0.02)


def test_predictions_are_deterministic():
    cluster = pools(a=2, b=1)
    p = plan(num_envs=10, rollout_workers=3, env_in_rollout=False, env_workers=2, chunks=2, learner_overlaps=True,
             staleness=1, placement={"env": "a", "rollout": "a", "learner": "b"})
    first, second = simulate(ENV_BOUND, p, cluster), simulate(ENV_BOUND, p, cluster)
    assert isinstance(first, Prediction)
    assert first == second and first.update_done_s == second.update_done_s


# --- plans and clusters -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["a=1", "a=1,b=1", "a=2,b=2,c=4"])
def test_candidate_plans_cover_the_modes_and_all_simulate(spec):
    cluster = parse_cluster(spec)
    plans = candidate_plans(8, 8, cluster)
    kinds = {p.name.split()[0] for p in plans}
    assert "collocated" in kinds and "disaggregated" in kinds
    assert ("hybrid" in kinds) == (len(cluster) > 1)
    assert len({p.name for p in plans}) == len(plans)
    for p in plans:
        assert all(s % p.chunks == 0 for s in split(p.num_envs, p.rollout_workers))
        assert simulate(ENV_BOUND, p, cluster, iterations=3).env_steps_per_s > 0
    if len(cluster) == 3:
        assert any(len(set(p.placement.values())) == 3 for p in plans)


def test_parse_cluster():
    assert parse_cluster("a=1,b=1") == {"a": Pool("a", 1), "b": Pool("b", 1)}
    assert parse_cluster("gpu=8") == {"gpu": Pool("gpu", 8)}
    assert parse_cluster(" rollout = 24 , learner=8 ") == {"rollout": Pool("rollout", 24), "learner": Pool("learner", 8)}


@pytest.mark.parametrize("spec, bad", [("", "empty"), ("a", "'a'"), ("a=x", "'a=x'"), ("a=1,=2", "'=2'"),
                                       ("a=0", "'a=0'"), ("a=1,a=2", "'a=2'"), ("a=1,,b=2", "''"),
                                       ("a=-1", "'a=-1'")])
def test_parse_cluster_errors_name_the_bad_part(spec, bad):
    with pytest.raises(ValueError, match="NAME=UNITS|at least 1 unit|declared twice") as err:
        parse_cluster(spec)
    assert bad in str(err.value)


def test_bad_plans_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"pool\(s\) \['zz'\]"):
        simulate(PROFILE, plan(placement={"env": "a", "rollout": "a", "learner": "zz"}), pools(a=1))
    with pytest.raises(ValueError, match="every worker needs an env"):
        simulate(PROFILE, plan(num_envs=2, rollout_workers=3), pools(a=1))
    with pytest.raises(ValueError, match="env_in_rollout"):
        simulate(PROFILE, plan(placement={"env": "b", "rollout": "a", "learner": "a"}), pools(a=1, b=1))
