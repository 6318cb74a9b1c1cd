"""DynamicScheduler decisions from measured windows: propose a move from utilisation, keep it only if the next
window is faster, roll it back otherwise, never oscillate."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.coordinator import dynamic
from services.core.config import parse_config


class FakeWorkflow:
    """The surface DynamicScheduler uses: rows, the current plan, plan validation, re-plan requests, a run log."""

    def __init__(self, sched):
        self.cfg = SimpleNamespace(scheduling=sched)
        self.sched = sched
        self.rows: list[dict] = []
        self.envs = [object()]
        self.requested = []
        self.logs: list[str] = []
        self.run = SimpleNamespace(log=self.logs.append)

    def plan_config(self, sched):
        return sched

    async def request_plan(self, sched, why):
        self.requested.append((sched, why))
        self.sched = sched  # applied at the boundary


def _window(wf, n, it_s, collect, policy, train, env_blocked=0.0):
    t = wf.rows[-1]["wall_time_s"] if wf.rows else 0.0
    steps = wf.rows[-1]["env_steps"] if wf.rows else 0
    for _ in range(n):
        t += it_s
        steps += 1000
        wf.rows.append({"wall_time_s": t, "env_steps": steps, "collect_seconds": collect, "policy_seconds": policy,
                        "env_seconds": env_blocked, "train_seconds": train})



def _scheduler(monkeypatch, mode: str, every: int):
    """A DynamicScheduler over a fake workflow; the env services' busy seconds are what ``env_time[0]`` says."""
    sched = parse_config(f"scheduling: {{mode: {mode}, dynamic: true, dynamic_every: {every}}}").scheduling
    wf = FakeWorkflow(sched)
    ds = dynamic.DynamicScheduler(wf)
    env_time = [0.0]

    async def env_seconds():
        return env_time[0]

    monkeypatch.setattr(ds, "_env_seconds", env_seconds)
    return wf, ds, env_time

def test_env_bound_in_process_rollout_moves_env_out_and_rolls_back_when_slower(monkeypatch):
    wf, ds, env_time = _scheduler(monkeypatch, "collocated", 5)
    # rollout busy 90% of the iteration, 70% of it simulating, learner 8%: move the env out
    _window(wf, 5, 0.1, collect=0.09, policy=0.027, train=0.008)
    asyncio.run(ds.at_boundary(4))
    assert wf.requested and wf.requested[-1][1] == "rollout -> env"
    assert not wf.sched.env_in_rollout() and wf.sched.chunks() == 2
    # the next window is slower (0.12 s per iteration): roll back, and never propose it again
    env_time[0] = 0.2
    _window(wf, 5, 0.12, collect=0.1, policy=0.03, train=0.008, env_blocked=0.05)
    asyncio.run(ds.at_boundary(9))
    assert wf.requested[-1][1] == "rollout -> env rolled back" and wf.sched.env_in_rollout()
    assert ds.moves[-1]["kept"] is False and "rolled back" in wf.logs[-1]
    _window(wf, 5, 0.1, collect=0.09, policy=0.027, train=0.008)
    asyncio.run(ds.at_boundary(14))
    assert len(wf.requested) == 2


def test_idle_env_service_moves_env_in_and_the_kept_move_is_never_reversed(monkeypatch):
    wf, ds, env_time = _scheduler(monkeypatch, "disaggregated", 4)
    env_time[0] = 0.01  # 10 ms of simulation over a 0.3 s window: the env service is 3% busy
    _window(wf, 4, 0.1, collect=0.08, policy=0.02, train=0.05, env_blocked=0.05)
    asyncio.run(ds.at_boundary(3))
    assert wf.requested[-1][1] == "env -> rollout" and wf.sched.env_in_rollout()
    _window(wf, 4, 0.07, collect=0.06, policy=0.02, train=0.05)  # faster: kept
    asyncio.run(ds.at_boundary(7))
    assert ds.moves[-1]["kept"] is True and len(wf.requested) == 1
    _window(wf, 4, 0.07, collect=0.066, policy=0.01, train=0.004)  # looks env-bound now, but the reverse was slower
    asyncio.run(ds.at_boundary(11))
    assert len(wf.requested) == 1
