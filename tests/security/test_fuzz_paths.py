"""The fuzz flow of issue 19 for paths: every path field of a run spec, given an escape (an absolute path outside,
'..', a symlink out, /dev/zero, a FIFO), and every endpoint field, given a host the operator did not allow,
submitted through the coordinator to workers started with narrow --data-root and --allow-endpoints. Each run is
refused with an error naming the field, none hangs or takes a worker down, and nothing is written outside the
roots."""

from __future__ import annotations

import os
import time

import pytest

from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2
from rlfabric.services.launcher import LocalStack
from tests.conftest import short_config, wait_for_workers

ROLES = ("env", "replay", "learner", "rollout")
TERMINAL = (coordinator_pb2.SUCCEEDED, coordinator_pb2.FAILED, coordinator_pb2.STOPPED)


@pytest.fixture
def confined_stack(tmp_path):
    """A coordinator whose workers read only under data/ and runs/ and connect nowhere a spec names."""
    from rlfabric.services.coordinator.client import CoordinatorClient

    data, runs, outside = tmp_path / "data", tmp_path / "runs", tmp_path / "outside"
    for d in (data, runs, outside):
        d.mkdir()
    stack = LocalStack(log_dir=tmp_path / "logs", runs_root=runs, roles=(), heartbeat_timeout_s=3.0)
    stack.start()
    for role in ROLES:  # (LocalStack's own workers would get a loopback stack's wide roots)
        stack._spawn(role, f"rlfabric.services.{role}.server", ["--coordinator", stack.address, "--data-root",
                                                       f"{data}{os.pathsep}{runs}", "--allow-endpoints", ""])
    stack.client = CoordinatorClient(stack.address)
    try:
        wait_for_workers(stack, len(ROLES))
        yield stack, data, outside
    finally:
        stack.client.close()
        stack.stop()


def _escapes(data, outside) -> dict[str, str]:
    (outside / "ckpt.pt").write_bytes(b"not yours")
    (data / "link-out").symlink_to(outside / "ckpt.pt")
    (data / "dir-out").symlink_to(outside)
    os.mkfifo(data / "fifo")
    return {"absolute outside": str(outside / "ckpt.pt"), "dot-dot": "../outside/ckpt.pt", "symlink out": "link-out",
            "/dev/zero": "/dev/zero", "fifo": str(data / "fifo")}


def test_path_and_endpoint_escapes_in_a_run_spec_are_refused(confined_stack):
    stack, data, outside = confined_stack
    escapes = _escapes(data, outside)
    cases = []
    for name, path in escapes.items():
        cases.append((f"policy.init_checkpoint: {name}", "policy.init_checkpoint",
                      {"policy": {"init_checkpoint": path}}))
        cases.append((f"replay.datasets: {name}", "replay.datasets.demos", {"replay": {"datasets": {"demos": path}}}))
    for name, path in (("absolute outside", str(outside / "store")), ("dot-dot", "../outside/store"),
                       ("symlink out", "dir-out/store"), ("/dev/zero", "/dev/zero")):
        cases.append((f"storage.root: {name}", "storage.root", {"storage": {"root": path}}))
    cases.append(("storage.endpoint: metadata service", "storage.endpoint",
                  {"storage": {"kind": "s3", "endpoint": "169.254.169.254:80", "access_key": "k", "secret_key": "s"}}))
    cases.append(("replay.redis_url: a host of the spec's choosing", "replay.redis_url",
                  {"replay": {"store": "redis", "redis_url": "redis://:pw@10.1.2.3:6379/0"}}))
    before = sorted(p.name for p in outside.iterdir())
    for label, field, override in cases:
        t0 = time.monotonic()
        config = short_config(**override, train={"total_env_steps": 64, "eval_every_iterations": 0})
        status = stack.client.submit(config)
        final = stack.client.wait(status.run_id)
        took = time.monotonic() - t0
        assert final.state == coordinator_pb2.FAILED and final.bad_input, (label, final.state, final.reason)
        assert field in final.reason, (label, final.reason)
        assert took < 60, (label, took)  # refused at once: no FIFO wedge, no read of /dev/zero
        assert "pw" not in final.reason.replace("pwd", "")  # (no password echoed)
    assert sorted(p.name for p in outside.iterdir()) == before  # nothing written outside the roots
    assert not stack.dead() and len([w for w in stack.client.workers() if w.alive]) == len(ROLES)
    # and a spec inside the roots still runs on the same workers
    status = stack.client.submit(short_config(storage={"root": "stores/ok"},
                                              train={"total_env_steps": 64, "eval_every_iterations": 0}))
    final = stack.client.wait(status.run_id)
    assert final.state == coordinator_pb2.SUCCEEDED, final.reason
    assert (data / "stores" / "ok").is_dir()


def test_a_local_stack_refuses_devices_and_fifos_as_checkpoints(stack, tmp_path):
    """A loopback local stack reads wherever its one user points (its roots include /), but never a device or a
    FIFO: /dev/zero would fill the learner's memory, a FIFO would wedge it while health says SERVING."""
    os.mkfifo(tmp_path / "fifo")
    for path, kind in (("/dev/zero", "a device"), (str(tmp_path / "fifo"), "a FIFO")):
        status = stack.client.submit(short_config(policy={"init_checkpoint": path},
                                                  train={"total_env_steps": 64, "eval_every_iterations": 0}),
                                     run_dir=tmp_path / f"run-{kind.split()[-1].lower()}")
        final = stack.client.wait(status.run_id)
        assert final.state == coordinator_pb2.FAILED and final.bad_input, final.reason
        assert f"policy.init_checkpoint='{path}'" in final.reason and f"is {kind}, not a regular file" in final.reason


def test_a_spec_cannot_aim_a_robot_env_at_a_gateway_the_operator_did_not_allow():
    from rlfabric.services.core.config import EnvConfig
    from rlfabric.services.core.paths import EndpointRefused, Endpoints, set_process_endpoints
    from rlfabric.services.env.adapters import robot

    cfg = EnvConfig(adapter="robot", id="reach", num_envs=1, options={"gateway": "10.1.2.3:50051"})
    set_process_endpoints(Endpoints.parse("127.0.0.1:7000"))  # the env service's --allow-endpoints
    try:
        with pytest.raises(EndpointRefused, match=r"env.options.gateway=.*--allow-endpoints 10.1.2.3:50051"):
            robot.check(cfg)
        robot.check(cfg.model_copy(update={"options": {"gateway": "127.0.0.1:7000"}}))  # the allowed one
    finally:
        set_process_endpoints(None)


def test_env_kwargs_that_name_files_are_confined_to_the_data_roots(tmp_path):
    from rlfabric.services.core.config import EnvConfig
    from rlfabric.services.core.paths import DataRoots, PathRefused
    from rlfabric.services.env.pool import EnvPool
    from rlfabric.services.env.tasks.dataset import set_data_roots

    (tmp_path / "data").mkdir()
    set_data_roots(DataRoots.parse(str(tmp_path / "data")))
    try:
        for kwargs, field in (({"xml_file": "/etc/passwd"}, "env.kwargs.xml_file"),
                              ({"xml_file": "../outside.xml"}, "env.kwargs.xml_file"),
                              ({"scene": str(tmp_path / "elsewhere.urdf")}, "env.kwargs.scene")):
            with pytest.raises(PathRefused, match=field):
                EnvPool(EnvConfig(id="CartPole-v1", kwargs=kwargs), 1)
    finally:
        set_data_roots(None)


def test_a_public_local_stack_takes_the_launchers_data_root(tmp_path, monkeypatch):
    from rlfabric.services.core.paths import local_stack_args

    monkeypatch.setenv("RLFABRIC_DATA_ROOT", str(tmp_path / "datasets"))
    args = local_stack_args("0.0.0.0", tmp_path / "runs")
    roots = args[args.index("--data-root") + 1].split(os.pathsep)
    assert roots == [str(tmp_path / "datasets"), str((tmp_path / "runs").resolve())]
