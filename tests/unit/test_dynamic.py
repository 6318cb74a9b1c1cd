"""DynamicScheduler decisions from measured windows: propose a move from utilisation, keep it only if the next
window is faster, roll it back otherwise, never oscillate."""

from __future__ import annotations

import asyncio

from rlfabric.services.coordinator import dynamic
from rlfabric.services.coordinator.records import IterationRecord
from rlfabric.services.core.config import parse_config


class FakeControl:
    """The PlanControl surface DynamicScheduler uses: the current plan, validation, re-plan requests, a log, the env
    services' busy seconds (what ``env_time[0]`` says)."""

    def __init__(self, sched):
        self.sched = sched
        self.plan_name = sched.mode
        self.env_workers = 1
        self.rollout_workers = 1
        self.requested = []
        self.logs: list[str] = []
        self.env_time = [0.0]
        self.records: list[IterationRecord] = []

    def validate(self, sched):
        return sched

    async def request_plan(self, sched, name):
        self.requested.append((sched, name.split(" [")[-1].rstrip("]")))
        self.sched = sched  # applied at the boundary

    async def env_step_seconds(self):
        return self.env_time[0]

    def log(self, message):
        self.logs.append(message)


def _window(control, ds, n, it_s, collect, policy, train, env_blocked=0.0):
    """n more iterations, each shown to the scheduler as the training loop would."""
    for _ in range(n):
        last = control.records[-1] if control.records else None
        record = IterationRecord(
            iteration=(last.iteration if last else 0) + 1, plan=control.plan_name,
            env_steps=(last.env_steps if last else 0) + 1000, wall_time_s=(last.wall_time_s if last else 0.0) + it_s,
            iteration_seconds=it_s, collect_seconds=collect, policy_seconds=policy, env_seconds=env_blocked,
            train_seconds=train)
        control.records.append(record)
        asyncio.run(ds.observe(record))


def _scheduler(mode: str, every: int):
    sched = parse_config(f"scheduling: {{mode: {mode}, dynamic: true, dynamic_every: {every}}}").scheduling
    control = FakeControl(sched)
    ds = dynamic.DynamicScheduler(control)
    asyncio.run(ds.begin())
    return control, ds


def test_env_bound_in_process_rollout_moves_env_out_and_rolls_back_when_slower():
    wf, ds = _scheduler("collocated", 5)
    # rollout busy 90% of the iteration, 70% of it simulating, learner 8%: move the env out
    _window(wf, ds, 5, 0.1, collect=0.09, policy=0.027, train=0.008)
    assert wf.requested and wf.requested[-1][1] == "rollout -> env"
    assert not wf.sched.env_in_rollout() and wf.sched.chunks() == 2
    # the next window is slower (0.12 s per iteration): roll back, and never propose it again
    wf.env_time[0] = 0.2
    _window(wf, ds, 5, 0.12, collect=0.1, policy=0.03, train=0.008, env_blocked=0.05)
    assert wf.requested[-1][1] == "rollout -> env rolled back" and wf.sched.env_in_rollout()
    assert ds.moves[-1]["kept"] is False and "rolled back" in wf.logs[-1]
    _window(wf, ds, 5, 0.1, collect=0.09, policy=0.027, train=0.008)
    assert len(wf.requested) == 2


def test_idle_env_service_moves_env_in_and_the_kept_move_is_never_reversed():
    wf, ds = _scheduler("disaggregated", 4)
    wf.env_time[0] = 0.01  # 10 ms of simulation over a 0.3 s window: the env service is 3% busy
    _window(wf, ds, 4, 0.1, collect=0.08, policy=0.02, train=0.05, env_blocked=0.05)
    assert wf.requested[-1][1] == "env -> rollout" and wf.sched.env_in_rollout()
    _window(wf, ds, 4, 0.07, collect=0.06, policy=0.02, train=0.05)  # faster: kept
    assert ds.moves[-1]["kept"] is True and len(wf.requested) == 1
    _window(wf, ds, 4, 0.07, collect=0.066, policy=0.01, train=0.004)  # looks env-bound now, but the reverse was slower
    assert len(wf.requested) == 1
