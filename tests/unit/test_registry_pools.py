"""Placement by resource pools: a stage placed on a pool runs on workers registered in it (``--pool``), falls
back to workers registered in no pool, and never takes a worker of another pool."""

from __future__ import annotations

from rlfabric.services.coordinator.registry import WorkerRegistry
from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2


def _register(reg: WorkerRegistry, port: int, pool: str = "") -> str:
    req = coordinator_pb2.RegisterWorkerRequest(role=common_pb2.ROLLOUT, endpoint=common_pb2.Endpoint(
        grpc=f"127.0.0.1:{port}"), pid=port, host="h", labels={"pool": pool} if pool else {})
    return reg.register(req).worker_id


def test_pool_placement_prefers_its_pool_then_unpinned_never_another_pool():
    reg = WorkerRegistry()
    gpu_b = _register(reg, 1, "b")
    free = _register(reg, 2)
    gpu_a = _register(reg, 3, "a")
    assert reg.acquire("rollout", "run", "a").worker_id == gpu_a
    assert reg.acquire("rollout", "run", "a").worker_id == free
    assert reg.acquire("rollout", "run", "a") is None  # the pool-b worker is not taken for pool a
    assert reg.acquire("rollout", "run", "b").worker_id == gpu_b
    reg.release("run")
    assert {w.worker_id for w in reg.idle("rollout")} == {gpu_a, gpu_b, free}  # no pool asked: any idle one



def test_registrations_are_bounded_and_the_dead_make_room(monkeypatch):
    import pytest

    from rlfabric.services.coordinator import registry

    monkeypatch.setattr(registry, "MAX_WORKERS", 3)
    reg = WorkerRegistry()
    ids = [_register(reg, port) for port in (1, 2, 3)]
    with pytest.raises(registry.RegistryFull, match="3 workers are registered"):
        _register(reg, 4)
    reg.workers[ids[0]].alive = False  # a dead one (missed heartbeats) gives its slot up
    _register(reg, 4)
    assert ids[0] not in reg.workers and len(reg.workers) == 3
