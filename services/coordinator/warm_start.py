"""A run's ``warm_start`` stages, run by the coordinator as the first part of the run, whoever submitted it (the
CLI, a notebook's Client.submit): one code path, so a spec gets the same run everywhere.

    vision, demos, dataset, merge   a learner the run holds runs each (Learner.WarmStart, services/learner/
                                    warm_start.py): the coordinator never imports torch or steps an env
    supervised                      a run of its own, ``<run_id>.supervised`` in ``<run dir>/warm_start/supervised``,
                                    placed and recovered like any run; its events echo in the run's WatchRun
    the run itself                  starts from the supervised run's checkpoints/final.pt (policy.init_checkpoint),
                                    written into its config.yaml and the run index, so nothing warms up twice

The run's status names the stage it is in (RunStatus.stage). Each stage keeps what an earlier attempt finished
(a run resumed after a kill, or taken up by a restarted coordinator), and a supervised run cut short resumes from
its own newest checkpoint. The stages' files live in the run directory, so the coordinator and the learner must see
the same run directory (one host, compose's shared volume, or a shared filesystem across hosts).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlfabric.services.coordinator.run import Run, RunFailed, StopRequested
from rlfabric.services.coordinator.runlog import write_private
from rlfabric.services.coordinator.stages import Stage, watched
from rlfabric.services.core.config import RunConfig, dump_yaml
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2, learner_pb2

SUPERVISED_SUFFIX = ".supervised"
ECHOED_METRICS = ("eval_success_rate", "eval_return_mean", "loss", "bc_loss", "sft_loss", "imitation_loss")


def needed(config: RunConfig) -> bool:
    """Stages to run first: a warm_start section and no checkpoint to start from yet."""
    return config.warm_start.enabled and not config.policy.init_checkpoint


def vision_refusal(config: RunConfig) -> str | None:
    """Why warm_start.vision cannot pretrain this policy's image encoder (None: it can), before anything runs."""
    if not config.warm_start.vision.scenes:
        return None
    name = config.policy_name
    section = getattr(config.policy, name, None)
    if not hasattr(section, "vlm_path"):
        return (f"warm_start.vision pretrains the image encoder a VLM policy starts from (policy.<name>.vlm_path), "
                f"and policy.name={name} has none. Fix: a VLM policy (pi0, vla_tokens, vlm), or no warm_start.vision")
    if section.path:
        return (f"warm_start.vision pretrains the encoder of a policy built from its sizes, and policy.{name}.path "
                f"loads a whole model. Fix: drop one of them")
    if getattr(section, "family", "paligemma") != "paligemma":
        return (f"warm_start.vision pretrains a SigLIP image encoder, and policy.{name}.family={section.family!r} "
                f"has its own. Fix: family: paligemma, or no warm_start.vision")
    return None


def learner_stages(config: RunConfig) -> list[str]:
    """The stages a learner runs, in order: the encoder first (the demonstrations do not need it), then the data."""
    warm = config.warm_start
    stages = ["vision"] if warm.vision.scenes else []
    if warm.supervised:
        stages += ["demos"] * bool(warm.demos) + ["dataset"] * bool(warm.dataset)
        if warm.demos and warm.dataset:
            stages.append("merge")  # both sources: one data set, the imported episodes after the expert's
    return stages


def with_values(config: RunConfig, values: dict[str, Any]) -> RunConfig:
    """``config`` with dotted fields set, validated again (as ``--set`` would be)."""
    data = json.loads(config.to_json())
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:  # named with the fields it set
        raise RunFailed(f"warm start: the run's spec with {sorted(values)} set does not validate: {exc}",
                        bad_input=True) from None


def supervised_config(config: RunConfig, demonstrations: str) -> RunConfig:
    """The supervised stage's run: the run's env, policy and train sections, the warm start's algorithm on the
    default plan, learning offline from the demonstrations."""
    spec = json.loads(config.to_json())
    spec.pop("warm_start")
    spec.pop("scheduling")  # the supervised stage is offline: the default plan
    warm = config.warm_start
    source = warm.supervised.get("source", "offline")
    spec.update(name=f"{config.name}-supervised", algorithm=warm.supervised,
                replay=spec["replay"] | {"datasets": {source: demonstrations}})
    try:
        return RunConfig.model_validate(spec)
    except ValidationError as exc:
        raise RunFailed(f"warm_start.supervised: the supervised stage's spec does not validate: {exc}",
                        bad_input=True) from None


async def run(coordinator, parent: Run) -> None:
    """The stages of ``parent``'s warm start, then ``parent.config`` set to start from them. Raises RunFailed or
    StopRequested; the caller turns those into the run's outcome."""
    refusal = vision_refusal(parent.config)
    if refusal:
        raise RunFailed(refusal, bad_input=True)
    parent.run_dir.mkdir(parents=True, exist_ok=True)
    # as submitted, for `rlfabric resume` of a run killed during its warm start (the run rewrites it at its start)
    write_private(parent.run_dir / "config.yaml", dump_yaml(parent.config.redacted()))
    config, demonstrations = parent.config, ""
    stages = learner_stages(config)
    if stages:
        workers = await coordinator._acquire(parent, {"learner": 1})
        worker = workers["learner"][0]
        stage = Stage.of(worker, parent.key)
        try:
            for name in stages:
                _enter(parent, name, f"on {worker.describe()}")
                request = learner_pb2.WarmStartRequest(run_id=parent.run_id, config_json=config.to_json(),
                                                       stage=name, run_dir=str(parent.run_dir))
                window = config.data_plane.timeout_s + config.runtime.liveness_s
                reply = await watched(stage, "WarmStart", request, parent, window)
                parent.log(f"warm start: {reply.summary}")
                if name == "vision":
                    config = with_values(config, {f"policy.{config.policy_name}.vlm_path": reply.path})
                else:
                    demonstrations = reply.path  # the last data stage's file is the one the supervised run reads
        except RunFailed:
            for lost, _ in parent.lost:
                lost.alive = False  # never placed again; a worker still running exits (its heartbeat says lost)
            raise
        finally:
            worker.run_id = ""
            await stage.channel.close()
    if config.warm_start.supervised:
        final = await _supervised(coordinator, parent, supervised_config(config, demonstrations))
        config = with_values(config, {"policy.init_checkpoint": str(final)})
        parent.log(f"warm start done: the run starts from {final}")
    parent.config = config
    _enter(parent, "", "warm start done")
    coordinator._record()  # a coordinator restarted from here takes the run up without warming up again


async def _supervised(coordinator, parent: Run, config: RunConfig) -> Path:
    """The supervised stage as a run of its own; its checkpoints/final.pt (kept when an earlier attempt wrote it)."""
    run_dir = parent.run_dir / "warm_start" / "supervised"
    final = (run_dir / config.train.checkpoint_key).resolve()
    if final.is_file():
        parent.log(f"warm start: the supervised stage's checkpoint is kept from an earlier attempt: {final}")
        return final
    child = Run(parent.run_id + SUPERVISED_SUFFIX, config, run_dir)
    child.parent, child.resume_dir = parent.run_id, parent.run_dir  # (resuming the run resumes its stage)
    child.stop_requested = parent.stop_requested  # a stop of the run stops its stage, and StopRun of the stage
    child.task = parent.task  # stops the run
    child.on_recovery = coordinator._record
    coordinator.runs[child.run_id] = child
    _enter(parent, "supervised", f"run {child.run_id} ({config.algorithm.name}) -> {run_dir}")
    queue: asyncio.Queue = asyncio.Queue()
    child.watchers.add(queue)
    echo = asyncio.create_task(_echo(queue, child, parent))
    try:
        # a supervised run cut short (a kill, a coordinator restart) continues from its newest checkpoint
        await coordinator._execute(child, "if_any" if (run_dir / "config.yaml").is_file() else False)
    finally:
        echo.cancel()
        child.watchers.discard(queue)
        while not queue.empty():  # its last events (the outcome) too
            _echo_one(queue.get_nowait(), child, parent)
    if child.state == coordinator_pb2.STOPPED and parent.stop_requested.is_set():
        raise StopRequested()
    if child.state != coordinator_pb2.SUCCEEDED:
        state = coordinator_pb2.RunState.Name(child.state)
        raise RunFailed(f"warm start: the supervised stage (run {child.run_id}) {state}: {child.reason}",
                        child.bad_input)
    if not final.is_file():
        raise RunFailed(f"warm start: the supervised stage succeeded and left no {final}. Fix: keep "
                        f"train.checkpoint_key and the filesystem store (storage.kind: filesystem) for a warm start")
    return final


def _enter(parent: Run, stage: str, detail: str) -> None:
    parent.stage = f"warm_start.{stage}" if stage else ""
    what = f"warm start: {stage} stage" if stage else "the run itself"
    parent.set_state(coordinator_pb2.RUNNING, f"{what} {detail}" if stage else detail)
    if stage:
        parent.log(f"{what} {detail}")


async def _echo(queue: asyncio.Queue, child: Run, parent: Run) -> None:
    """The supervised run's events in the run's own WatchRun, as they come."""
    while True:
        _echo_one(await queue.get(), child, parent)


def _echo_one(event, child: Run, parent: Run) -> None:
    """One event of the supervised run as a log line of the run: its logs, its evaluations, a tenth of its
    iterations and its outcome (the run's metrics stay the run's own)."""
    kind = event.WhichOneof("event")
    if kind == "log":
        parent.log(f"warm start (supervised): {event.log.message}", event.log.level or "info")
    elif kind == "metrics":
        m = event.metrics
        shown = {k: m.values[k] for k in ECHOED_METRICS if k in m.values}
        every = max(1, child.config.progress()[1] // 10)
        if any(k.startswith("eval_") for k in m.values) or m.iteration % every == 0:
            parent.log(f"warm start (supervised): iteration {m.iteration}" + "".join(
                f", {k} {v:.4g}" for k, v in shown.items()))
    elif kind == "status" and event.status.state in (coordinator_pb2.SUCCEEDED, coordinator_pb2.FAILED,
                                                      coordinator_pb2.STOPPED):
        parent.log(f"warm start (supervised): {coordinator_pb2.RunState.Name(event.status.state)} "
                   f"{event.status.reason}")


__all__ = ["learner_stages", "needed", "run", "supervised_config", "vision_refusal", "with_values"]
