"""Recovery: what the coordinator does when a run loses a worker (SIGKILLed, crashed, unreachable, gone).

The run does not fail. The attempt that lost the worker ends; if the learner survived, it checkpoints its newest
state first (so nothing it trained on is lost). Then every surviving worker is released, the dead one is never
placed again, and the next attempt places the run on live workers (the supervisor's restarted ones among them),
resumes from the newest valid checkpoint inside the same run id, and every rollout worker gets that weight
version before it acts. What the loss threw away follows the algorithm's data access:

    on-policy FIFO   the in-flight shards of the iteration being collected: produced by a policy the run moves
                     past, so they are discarded, never half-counted
    sampled window   transitions already in replay stay (Redis keeps them across a dead replay service); only the
                     untaken FIFO shards go; a memory store that died takes its window with it and the run
                     re-collects it

Each recovery is a RecoveryEvent on WatchRun, a warning in the run's log, and a row of recoveries.csv in the run
directory. A run recovers at most ``runtime.max_recoveries`` times; the next loss fails it with the reason.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rlfabric.services.coordinator.registry import Worker
from rlfabric.services.coordinator.run import Run
from rlfabric.services.coordinator.stages import Stage, healthy
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2

PROBE_TIMEOUT_S = 1.0


@dataclass
class Loss:
    """Workers a run lost in one attempt, and what that attempt was doing."""

    lost: list[tuple[Worker, str]]
    iteration: int
    at: float = field(default_factory=time.monotonic)

    @property
    def roles(self) -> list[str]:
        return sorted({w.role for w, _ in self.lost})

    def describe(self) -> str:
        return "; ".join(f"{w.describe()} {why}" for w, why in self.lost)


async def unreachable(stages: list[Stage]) -> list[tuple[Worker, str]]:
    """The placed workers whose health check does not answer SERVING: they are treated as lost."""
    answers = await asyncio.gather(*(healthy(s, PROBE_TIMEOUT_S) for s in stages))
    return [(s.worker, "stopped answering its health check (crashed or unreachable)")
            for s, ok in zip(stages, answers, strict=True) if not ok]


def discarded(run: Run, loss: Loss) -> str:
    """What the loss threw away, and why, from the algorithm's data access and the replay store."""
    cfg = run.config
    access = cfg.spec.data(cfg.algorithm)
    what = []
    if "coordinator" in loss.roles:
        what.append("the run's work since its newest checkpoint (the coordinator that had placed the rest died "
                    "with it)")
    elif cfg.collects:
        if access.keeps_window:
            what.append(f"the untaken shards of iteration {loss.iteration + 1} ({access.kind} sampling keeps the "
                        f"transitions already in replay)")
        else:
            what.append(f"the in-flight shards of iteration {loss.iteration + 1} (on-policy: the resumed run moves "
                        f"past the policy that produced them)")
    if "replay" in loss.roles:
        if cfg.replay.store == "redis":
            what.append("nothing from replay (Redis keeps every acknowledged batch)")
        else:
            what.append("everything the memory replay store held (not persistent: the run re-collects it)")
    if "learner" in loss.roles:
        what.append("the learner's updates since its newest checkpoint (checkpoint.every_iterations="
                    f"{cfg.checkpoint.every_iterations})")
    return "; ".join(what) or "nothing"


def event(run: Run, loss: Loss, detail: dict, start: int) -> coordinator_pb2.RecoveryEvent:
    """The run's next recovery, once the new attempt resumed (``detail``: the learner's Configure reply)."""
    return coordinator_pb2.RecoveryEvent(
        attempt=run.recoveries + 1, role=",".join(loss.roles), worker_id=",".join(w.worker_id for w, _ in loss.lost),
        cause=loss.lost[0][1] if len(loss.lost) == 1 else loss.describe(), discarded=discarded(run, loss),
        resumed_from=detail.get("resumed_from", ""), resumed_at_iteration=start, weight_version=start,
        seconds=time.monotonic() - loss.at, time=time.time())
