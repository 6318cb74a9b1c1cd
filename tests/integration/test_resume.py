"""Checkpoint on stop, resume with counters continuing, and fallback past a corrupt checkpoint; a restarted
coordinator neither forgets a recorded run nor overwrites a run index it cannot read, and an env that crashes while
being configured is not taken for the spec's fault."""

from __future__ import annotations

import asyncio
import csv
import json
import time
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import REGISTRY

from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2
from tests.conftest import Aborted, AbortingContext, short_config
from tests.integration.test_coordinator import _wait_idle


def _rows(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _assert_continuous(rows, n_epochs_steps):
    iters = [int(r["iteration"]) for r in rows]
    assert iters == list(range(1, len(rows) + 1)), iters  # no jump back, no duplicates
    for r in rows:
        i = int(r["iteration"])
        assert int(r["env_steps"]) == 64 * i and int(r["weight_version"]) == i
        assert int(r["optimizer_steps"]) == n_epochs_steps * i


def test_stop_checkpoints_and_resume_continues_counters(stack, tmp_path):
    _wait_idle(stack.client)
    run_dir = tmp_path / "run"
    cfg = short_config(train={"total_env_steps": 10_000_000, "eval_every_iterations": 0},
                       checkpoint={"every_iterations": 0})
    status = stack.client.submit(cfg, run_dir=run_dir)
    deadline = time.monotonic() + 60
    while stack.client.status(status.run_id).env_steps < 64 * 6:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stopped = stack.client.stop(status.run_id)
    assert stopped.state == coordinator_pb2.STOPPED and "rlfabric resume" in stopped.reason
    done = len(_rows(run_dir))
    store_keys = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert len(store_keys) == 1 and store_keys[0].startswith("ckpt-")  # the on-stop checkpoint
    _wait_idle(stack.client)
    resumed = stack.client.resume(run_dir, overrides=[f"train.total_env_steps={64 * (done + 4)}"])
    assert resumed.run_id == status.run_id  # the same run continues
    events = list(stack.client.watch(resumed.run_id))
    final = events[-1].status
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    logs = [e.log.message for e in events if e.HasField("log")]
    assert any(f"resumed from checkpoints/ckpt-{done:010d}.pt at iteration {done}" in m for m in logs), logs
    rows = _rows(run_dir)
    assert len(rows) == done + 4
    _assert_continuous(rows, n_epochs_steps=2)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(stack, tmp_path):
    _wait_idle(stack.client)
    run_dir = tmp_path / "run"
    cfg = short_config(train={"total_env_steps": 64 * 8, "eval_every_iterations": 0},
                       checkpoint={"every_iterations": 2, "keep": 5})
    status = stack.client.submit(cfg, run_dir=run_dir)
    assert stack.client.wait(status.run_id).state == coordinator_pb2.SUCCEEDED
    keys = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert keys == ["ckpt-0000000002.pt", "ckpt-0000000004.pt", "ckpt-0000000006.pt", "final.pt"]
    for name in ("final.pt", "ckpt-0000000006.pt"):  # bit rot in the two newest
        path = run_dir / "checkpoints" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55
        path.write_bytes(bytes(data))
    _wait_idle(stack.client)
    resumed = stack.client.resume(run_dir, overrides=["train.total_env_steps=768"])
    events = list(stack.client.watch(resumed.run_id))
    assert events[-1].status.state == coordinator_pb2.SUCCEEDED, events[-1].status.reason
    warnings = [e.log.message for e in events if e.HasField("log") and e.log.level == "warning"]
    assert any("final.pt" in w and "corrupt" in w for w in warnings), warnings
    assert any("ckpt-0000000006.pt" in w and "corrupt" in w for w in warnings), warnings
    rows = _rows(run_dir)
    assert [int(r["iteration"]) for r in rows] == list(range(1, 13))  # 1-4 kept, 5-12 from the resume
    _assert_continuous(rows, n_epochs_steps=2)


# -- failures that must not vanish (issue 19, finding 11) --------------------------------------------------------

def _restart_coordinator(runs_root) -> dict:
    """A coordinator started on ``runs_root`` (in this process): its runs, as GetRun would give them."""
    from rlfabric.services.coordinator.server import CoordinatorService

    async def main():
        service = CoordinatorService(SimpleNamespace(address="127.0.0.1:1", on_shutdown=lambda hook: None),
                                     str(runs_root), 3.0)
        try:
            return {run_id: run.status() for run_id, run in service.runs.items()}
        finally:
            await service.shutdown()

    return asyncio.run(main())


def _index_errors(kind: str) -> float:
    return REGISTRY.get_sample_value("rlfabric_coordinator_run_index_errors_total", {"kind": kind}) or 0.0


def test_an_unreadable_run_index_is_kept_aside_not_overwritten(tmp_path):
    index = tmp_path / ".coordinator" / "runs.json"
    index.parent.mkdir()
    index.write_text('{"runs": [{"run_id": "half-writ')  # a torn write, or a person's edit gone wrong
    before = _index_errors("unreadable")
    assert _restart_coordinator(tmp_path) == {}
    aside = list(index.parent.glob("runs.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"runs": [{"run_id": "half-writ'
    assert json.loads(index.read_text()) == {"runs": []}  # a fresh index beside it
    assert _index_errors("unreadable") == before + 1


def test_a_recorded_run_whose_config_no_longer_validates_is_failed_with_the_reason(tmp_path):
    index = tmp_path / ".coordinator" / "runs.json"
    index.parent.mkdir()
    bad = json.loads(short_config().to_json())
    bad["env"]["num_envs"] = 0  # e.g. a bound tightened by an upgrade
    index.write_text(json.dumps({"runs": [{"run_id": "old-run", "run_dir": str(tmp_path / "old-run"),
                                           "config_json": json.dumps(bad), "state": "RUNNING", "recoveries": 2}]}))
    before = _index_errors("invalid_config")
    runs = _restart_coordinator(tmp_path)
    assert runs["old-run"].state == coordinator_pb2.FAILED and runs["old-run"].recoveries == 2
    assert "no longer validates" in runs["old-run"].reason and "env.num_envs" in runs["old-run"].reason
    recorded = json.loads(index.read_text())["runs"]
    assert [(r["run_id"], r["state"]) for r in recorded] == [("old-run", "FAILED")]
    assert "no longer validates" in recorded[0]["reason"]
    assert _index_errors("invalid_config") == before + 1
    _restart_coordinator(tmp_path)  # and a later coordinator keeps it on record as it ended
    assert [(r["run_id"], r["state"]) for r in json.loads(index.read_text())["runs"]] == [("old-run", "FAILED")]


@pytest.mark.parametrize(("error", "code"), [
    (RuntimeError("simulator segfaulted in its constructor"), grpc.StatusCode.INTERNAL),
    (MemoryError(), grpc.StatusCode.INTERNAL),
    (ValueError("env.options.view: must be odd"), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_an_env_that_crashes_in_configure_is_internal_not_bad_input(monkeypatch, error, code):
    """INVALID_ARGUMENT marks the run bad input (FAILED, not recovered); a crash of the simulator is not the spec's."""
    from rlfabric.services.env import server

    def crash(*args):
        raise error

    monkeypatch.setattr(server, "EnvPools", crash)
    runtime = SimpleNamespace(options=SimpleNamespace(role="env", coordinator=""), worker_id="", owner_run="",
                              advertise_host="127.0.0.1", data_endpoint="", on_shutdown=lambda hook: None,
                              watch=lambda name, probe: None)

    async def main():
        service = server.EnvService(runtime, "127.0.0.1")
        try:
            await service.Configure(common_pb2.ConfigureRequest(run_id="r", config_json=short_config().to_json()),
                                    AbortingContext())
        finally:
            service.close()

    with pytest.raises(Aborted) as info:
        asyncio.run(main())
    assert info.value.code == code
