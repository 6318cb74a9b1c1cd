"""Checkpoint on stop, resume with counters continuing, and fallback past a corrupt checkpoint."""

from __future__ import annotations

import csv
import time

from services.core.proto.rlfabric.v1 import coordinator_pb2
from tests.conftest import short_config
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
