"""Finding 8, paths and endpoints a token holder chooses: every client-named path resolves under the operator's data
roots (relative ones from the first; absolute ones elsewhere, '..' and symlinks out refused, naming the field, the
root and the flag), only regular files within a size bound are read (``/dev/zero`` and a FIFO are refused at once,
not read until memory runs out or forever), and a run spec's endpoints must be on the operator's allow-list."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.paths import (
    DataRoots,
    EndpointRefused,
    Endpoints,
    PathRefused,
    confine_storage,
    redis_endpoint,
)
from tests.conftest import Aborted, AbortingContext, short_config


@pytest.fixture
def layout(tmp_path):
    """A data root with a checkpoint-like file in it, and a secret file beside it (outside)."""
    root = tmp_path / "root"
    (root / "ckpts").mkdir(parents=True)
    (root / "ckpts" / "a.pt").write_bytes(b"inside")
    (tmp_path / "secret").write_bytes(b"outside")
    (root / "link-out").symlink_to(tmp_path / "secret")
    os.mkfifo(root / "fifo")
    return SimpleNamespace(root=root, roots=DataRoots.parse(str(root)), outside=tmp_path / "secret")


def test_relative_paths_start_at_the_root_and_stay_in_it(layout):
    assert layout.roots.confine("ckpts/a.pt", "policy.init_checkpoint") == layout.root / "ckpts" / "a.pt"
    assert layout.roots.read_bytes("ckpts/a.pt", "policy.init_checkpoint") == b"inside"
    assert layout.roots.read_bytes(str(layout.root / "ckpts/a.pt"), "policy.init_checkpoint") == b"inside"


@pytest.mark.parametrize("name", ["absolute", "dotdot", "symlink"])
def test_paths_that_resolve_outside_are_refused_naming_field_root_and_flag(layout, name):
    path = {"absolute": str(layout.outside), "dotdot": "ckpts/../../secret", "symlink": "link-out"}[name]
    with pytest.raises(PathRefused) as info:
        layout.roots.read_bytes(path, "algorithm.expert_checkpoint")
    msg = str(info.value)
    assert "algorithm.expert_checkpoint" in msg and str(layout.root) in msg and "--data-root" in msg


def test_devices_fifos_and_oversized_files_are_refused_without_reading(layout):
    anywhere = DataRoots.anywhere()
    with pytest.raises(PathRefused, match="a device, not a regular file"):
        anywhere.read_bytes("/dev/zero", "policy.init_checkpoint")
    with pytest.raises(PathRefused, match="a FIFO, not a regular file"):  # (opening it would block: no writer)
        layout.roots.read_bytes("fifo", "policy.init_checkpoint")
    with pytest.raises(PathRefused, match="a directory"):
        layout.roots.read_bytes("ckpts", "policy.init_checkpoint")
    with pytest.raises(PathRefused, match=r"over the 3-byte bound \(paths.MAX_READ_BYTES\)"):
        layout.roots.read_bytes("ckpts/a.pt", "policy.init_checkpoint", max_bytes=3)


def test_learner_reads_checkpoints_only_under_its_roots(layout):
    from rlfabric.services.learner.server import _read_checkpoint

    for path, roots, expected in (("/dev/zero", DataRoots.anywhere(), "a device, not a regular file"),
                                  ("/dev/zero", layout.roots, "outside this worker's data root"),
                                  (str(layout.root / "fifo"), layout.roots, "a FIFO"),
                                  (str(layout.outside), layout.roots, "outside this worker's data root")):
        with pytest.raises(ValueError, match=expected) as info:
            _read_checkpoint(path, "policy.init_checkpoint", roots)
        assert "policy.init_checkpoint" in str(info.value)


def test_the_learner_reads_an_expert_checkpoint_only_under_its_roots(layout, monkeypatch):
    """deployment.md: "Workers apply the same rule to every path a run spec names (..., `algorithm.expert_checkpoint`,
    ...), under the operator's `--data-root`": the learner loading the expert an algorithm's roles ask for refuses
    one outside its roots (absolute, '..', a symlink out, a FIFO) naming the field, the root and the flag, before
    reading it, and reads one inside."""
    from rlfabric.services.core.algorithm import Roles
    from rlfabric.services.learner import server

    class Read(Exception):
        pass

    def unpack(data, path):
        raise Read(data)

    monkeypatch.setattr(server.ckpt, "unpack", unpack)
    learner = SimpleNamespace(roots=layout.roots, policy=None)  # a LearnerService's, as --data-root made it

    def roles(path: str) -> None:
        config = SimpleNamespace(spec=SimpleNamespace(name="expert-algo", needs=lambda cfg: Roles(expert=True)),
                                 algorithm=SimpleNamespace(expert_checkpoint=path))
        server.LearnerService._roles(learner, config, {})

    for path in (str(layout.outside), "ckpts/../../secret", "link-out"):
        with pytest.raises(PathRefused, match="outside this worker's data root") as info:
            roles(path)
        msg = str(info.value)
        assert "algorithm.expert_checkpoint" in msg and str(layout.root) in msg and "--data-root" in msg, msg
    with pytest.raises(PathRefused, match=r"algorithm.expert_checkpoint=.* is a FIFO, not a regular file"):
        roles("fifo")  # (inside the roots: refused without opening it, which would block)
    with pytest.raises(Read) as read:
        roles("ckpts/a.pt")
    assert read.value.args[0] == b"inside"


def test_data_sets_are_read_only_under_the_roots_and_only_from_regular_files(layout):
    from rlfabric.services.replay.datasets import DatasetError, load_dataset

    np.savez(layout.root / "demos.npz", obs=np.zeros((4, 2), np.float32))
    assert load_dataset("demos.npz", 10, roots=layout.roots).rows == 4
    np.savez(layout.outside.with_suffix(".npz"), obs=np.zeros((4, 2), np.float32))
    for path, expected in ((str(layout.outside.with_suffix(".npz")), "outside"), ("fifo", "a FIFO"),
                           ("/dev/zero", "outside")):
        with pytest.raises(DatasetError, match=expected):
            load_dataset(path, 10, roots=layout.roots, field="replay.datasets.demos")
    with pytest.raises(DatasetError, match="a device"):  # even for a user's own tool (no roots)
        load_dataset("/dev/zero", 10)


def test_storage_root_and_run_directory_are_confined(layout):
    storage = RunConfig().storage.model_copy(update={"root": "stores/run"})
    confined, run_dir = confine_storage(storage, "runs/a", layout.roots, Endpoints.parse(""))
    assert confined.root == str(layout.root / "stores" / "run") and run_dir == str(layout.root / "runs" / "a")
    for field, storage_root, given_dir in (("storage.root", "/etc", "runs/a"), ("storage.root", "../x", "runs/a"),
                                           ("run directory", "", "/etc")):
        with pytest.raises(PathRefused, match=field):
            confine_storage(RunConfig().storage.model_copy(update={"root": storage_root}), given_dir, layout.roots,
                            Endpoints.parse(""))


def test_endpoints_come_from_the_allow_list():
    allowed = Endpoints.parse("minio:9000, redis:6379")
    s3 = RunConfig().storage.model_copy(update={"kind": "s3", "endpoint": "minio:9000"})
    confine_storage(s3, ".", DataRoots.parse("."), allowed)
    for endpoint in ("169.254.169.254:80", "http://evil:9000", "minio:9001"):
        with pytest.raises(EndpointRefused, match="storage.endpoint.*--allow-endpoints"):
            confine_storage(s3.model_copy(update={"endpoint": endpoint}), ".", DataRoots.parse("."), allowed)
    assert redis_endpoint("redis://:pw@redis/0") == "redis:6379"
    assert redis_endpoint("redis://[::1]:6380/0") == "[::1]:6380" and redis_endpoint("redis://x:99999") != "x:99999"
    allowed.check(redis_endpoint("redis://redis:6379/0"), "replay.redis_url")
    with pytest.raises(EndpointRefused, match="replay.redis_url"):
        allowed.check(redis_endpoint("redis://127.0.0.1:6379/0"), "replay.redis_url")
    Endpoints.parse("*").check("anything:1", "storage.endpoint")


def test_replay_refuses_a_redis_url_not_allowed_before_connecting(layout):
    """The replay service opens Redis where the spec says only if its operator allowed it (SSRF otherwise)."""
    from rlfabric.services.replay.server import ReplayService

    worker = SimpleNamespace(roots=layout.roots, endpoints=Endpoints.parse("redis:6379"), max_memory_bytes=1 << 30)
    config = short_config(replay={"store": "redis", "redis_url": "redis://:hunter2@10.0.0.1:6380/0"})
    with pytest.raises(EndpointRefused) as info:
        ReplayService._open_stores(worker, config, "r", str(layout.root))
    assert "10.0.0.1:6380" in str(info.value) and "hunter2" not in str(info.value)
    config = short_config(replay={"datasets": {"demos": str(layout.outside)}})
    from rlfabric.services.replay.datasets import DatasetError

    with pytest.raises(DatasetError, match="replay.datasets.demos.*outside"):
        ReplayService._open_stores(worker, config, "r", str(layout.root))


def test_rollout_configure_refuses_a_storage_root_outside(layout):
    from rlfabric.services.rollout.server import RolloutService

    runtime = SimpleNamespace(options=SimpleNamespace(role="rollout", coordinator=""), worker_id="", owner_run="",
                              on_shutdown=lambda hook: None, watch=lambda name, probe: None)
    service = RolloutService(runtime, layout.roots, Endpoints.parse(""))
    request = SimpleNamespace(run_id="r", config_json=short_config(storage={"root": str(layout.outside.parent)}).to_json(),
                              context_json=json.dumps({"env_spec": {}, "run_dir": str(layout.root)}),
                              peers={"env": "x", "replay": "x", "learner": "x"})
    with pytest.raises(Aborted) as info:
        asyncio.run(service.Configure(request, AbortingContext()))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "storage.root" in info.value.details
    assert service.worker is None  # refused before anything was built


def test_a_saved_model_directory_is_confined_too(layout):
    from rlfabric.services.core.paths import confine_model

    config = short_config(policy={"lm": {"path": "models/lm"}})
    assert confine_model(config, layout.roots).policy.lm.path == str(layout.root / "models" / "lm")
    with pytest.raises(PathRefused, match="policy.lm.path.*--data-root"):
        confine_model(short_config(policy={"lm": {"path": str(layout.outside.parent)}}), layout.roots)


@pytest.mark.parametrize("section,field", [("pi0", "path"), ("pi0", "vlm_path"), ("vla_tokens", "path"),
                                           ("vla_tokens", "vlm_path"), ("vlm", "path"), ("vlm", "vlm_path")])
def test_a_vlm_policys_model_directory_is_confined_too(layout, section, field):
    """A VLM directory is read by transformers itself (its modeling code too, with trust_remote_code): it must lie
    under the roots like any other file a spec names."""
    from rlfabric.services.core.paths import confine_model

    inside = confine_model(short_config(policy={section: {field: "models/vlm"}}), layout.roots)
    assert getattr(getattr(inside.policy, section), field) == str(layout.root / "models" / "vlm")
    with pytest.raises(PathRefused, match=rf"policy.{section}.{field}.*--data-root"):
        confine_model(short_config(policy={section: {field: str(layout.outside.parent)}}), layout.roots)


def test_learner_configure_answers_a_run_directory_that_is_a_fifo_with_a_status(layout):
    """A run directory inside the roots that is not a directory (here a FIFO) is the host's refusal, answered as
    FAILED_PRECONDITION naming the path, not an unhandled exception (UNKNOWN) the fuzz suite counts as a crash."""
    from rlfabric.services.learner.server import LearnerService

    runtime = SimpleNamespace(options=SimpleNamespace(role="learner", coordinator=""), worker_id="", owner_run="",
                              on_shutdown=lambda hook: None, watch=lambda name, probe: None)
    service = LearnerService(runtime, "127.0.0.1", 1, layout.roots, Endpoints.parse(""))
    request = SimpleNamespace(run_id="r", config_json=short_config().to_json(),
                              context_json=json.dumps({"env_spec": {}, "run_dir": str(layout.root / "fifo")}),
                              peers={"replay": "tcp://127.0.0.1:1"})
    try:
        with pytest.raises(Aborted) as info:
            asyncio.run(service.Configure(request, AbortingContext()))
    finally:
        service.close()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "fifo" in info.value.details


def test_the_env_service_reads_data_set_files_only_under_its_roots(layout):
    """env.options.path of the dataset text task: the env service's --data-root confines it like the others."""
    from rlfabric.services.core.textdata import DataFileError
    from rlfabric.services.env.tasks import dataset

    (layout.root / "qa.jsonl").write_text('{"prompt": "2+2", "answer": "4"}\n')
    layout.outside.with_suffix(".jsonl").write_text('{"prompt": "secret", "answer": "1"}\n')
    os.mkfifo(layout.root / "pipe.jsonl")
    dataset.set_data_roots(layout.roots)
    try:
        task = dataset.DatasetTask(path="qa.jsonl", held_out_fraction=0.01)
        assert "2+2" in task.prompt(task.problem(np.random.default_rng(0)))
        for path, expected in ((str(layout.outside.with_suffix(".jsonl")), "outside"), ("pipe.jsonl", "FIFO")):
            with pytest.raises(DataFileError, match=expected):
                dataset.DatasetTask(path=path)
    finally:
        dataset.set_data_roots(None)
