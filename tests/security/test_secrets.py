"""Finding 9, secrets in files: S3 keys and a Redis password in a run spec never reach config.yaml, the run index or
the logs; run directories are owner-only (0700) and the files holding a run's spec, the index and logs 0600."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlfabric.services.core.config import RunConfig, dump_yaml
from tests.conftest import short_config

SECRETS = ("AKIA-SPEC-KEY", "spec-secret-key", "hunter2")


def _secret_config(**overrides) -> RunConfig:
    return short_config(storage={"access_key": SECRETS[0], "secret_key": SECRETS[1]},
                        replay={"redis_url": f"redis://default:{SECRETS[2]}@redis:6379/0"}, **overrides)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_redacted_config_has_no_secret_and_keeps_the_rest():
    config = _secret_config()
    assert config.secrets() == ["storage.access_key", "storage.secret_key", "replay.redis_url"]
    clean = config.redacted()
    text = clean.to_json()
    assert not any(s in text for s in SECRETS)
    assert clean.replay.redis_url == "redis://default@redis:6379/0" and clean.storage.access_key == ""
    assert clean.env == config.env and clean.algorithm == config.algorithm and not clean.secrets()
    assert config.storage.secret_key == SECRETS[1]  # the run itself keeps them (its store workers need them)
    plain = short_config()
    assert plain.redacted() is plain


def test_run_directory_is_private_and_config_yaml_holds_no_secret(tmp_path):
    from rlfabric.services.coordinator.runlog import RunLog

    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True, mode=0o755)
    (run_dir / "config.yaml").write_text("old")
    os.chmod(run_dir / "config.yaml", 0o644)
    log = RunLog(run_dir, _secret_config())
    try:
        text = (run_dir / "config.yaml").read_text()
        assert not any(s in text for s in SECRETS) and "redis://default@redis:6379/0" in text
        assert _mode(run_dir) == 0o700 and _mode(run_dir / "config.yaml") == 0o600
    finally:
        log._tb.close()
        log._csv_file.close()


def test_log_files_are_owner_only_and_never_written_through_a_symlink(tmp_path):
    from rlfabric.services.core.logs import setup_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    path = tmp_path / "learner.log"
    path.write_text("")
    os.chmod(path, 0o644)
    try:
        setup_logging("learner", str(path))
        logging.getLogger("x").warning("hello")
        root.handlers[0].flush()
        assert _mode(path) == 0o600 and '"msg": "hello"' in path.read_text()
        target = tmp_path / "elsewhere"
        target.write_text("")
        (tmp_path / "planted.log").symlink_to(target)
        with pytest.raises(OSError):
            setup_logging("learner", str(tmp_path / "planted.log"))
        assert target.read_text() == ""
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


class _Context:
    async def abort(self, code, details):
        raise AssertionError(f"{code}: {details}")


def test_run_index_holds_no_secret_and_is_owner_only(tmp_path):
    """SubmitRun records the run in runs.json: its spec without the secrets, in a 0600 file of a 0700 folder."""
    from rlfabric.services.coordinator.server import CoordinatorService
    from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2

    async def main():
        runtime = SimpleNamespace(address="127.0.0.1:1", on_shutdown=lambda hook: None)
        service = CoordinatorService(runtime, str(tmp_path), 3.0, take_up_runs=False)
        try:
            status = await service.SubmitRun(coordinator_pb2.SubmitRunRequest(
                config_yaml=dump_yaml(_secret_config()), run_dir="with-secrets"), _Context())
            assert service.runs[status.run_id].config.storage.secret_key == SECRETS[1]  # in memory, for the run
        finally:
            await service.shutdown()

    asyncio.run(main())
    index = tmp_path / ".coordinator" / "runs.json"
    text = index.read_text()
    assert "with-secrets" in text and not any(s in text for s in SECRETS)
    recorded = RunConfig.from_json(json.loads(text)["runs"][0]["config_json"])
    assert recorded.replay.redis_url == "redis://default@redis:6379/0"
    assert _mode(index) == 0o600 and _mode(index.parent) == 0o700


def test_replay_takes_the_redis_password_from_its_environment_not_the_spec():
    from rlfabric.services.replay.server import with_password

    assert with_password("redis://redis:6379/0", "p@ss/word") == "redis://:p%40ss%2Fword@redis:6379/0"
    assert with_password("redis://user@redis:6379/0", "pw") == "redis://user:pw@redis:6379/0"
    assert with_password("redis://:own@redis:6379/0", "pw") == "redis://:own@redis:6379/0"  # the spec's wins
    assert with_password("redis://redis:6379/0", "") == "redis://redis:6379/0"
    assert with_password("unix:///run/redis.sock", "pw") == "unix:///run/redis.sock"


def test_the_env_worker_keeps_no_secret_of_the_runs_it_serves(monkeypatch):
    """The env service opens no store: the S3 keys and Redis password a spec holds are not kept there."""
    from rlfabric.services.env import server

    runtime = SimpleNamespace(options=SimpleNamespace(role="env", coordinator=""), worker_id="", owner_run="",
                              advertise_host="127.0.0.1", data_endpoint="", state="idle", on_shutdown=lambda hook: None,
                              watch=lambda name, probe: None)

    async def main():
        service = server.EnvService(runtime, "127.0.0.1")
        try:
            from rlfabric.services.core.proto.rlfabric.v1 import common_pb2

            await service.Configure(common_pb2.ConfigureRequest(run_id="r", config_json=_secret_config().to_json()),
                                    _Context())
            return service.config.to_json()
        finally:
            service.close()

    kept = asyncio.run(main())
    assert not any(s in kept for s in SECRETS)


def test_checkpoints_hold_the_spec_without_its_secrets(tmp_path):
    """A checkpoint is a file (or an object) others may copy: the spec inside it is redacted like config.yaml."""
    import torch

    from rlfabric.services.core.objectstore import FilesystemObjectStore
    from rlfabric.services.learner import checkpoint as ckpt
    from rlfabric.services.learner.server import LearnerService

    store = FilesystemObjectStore(tmp_path)
    learner = SimpleNamespace(config=_secret_config(), env_spec={}, ranks=None, version=3, store=store,
                              policy=SimpleNamespace(), algo=SimpleNamespace(state_dict=lambda: {}),
                              generator=torch.Generator(),
                              _weights=lambda: {"w": torch.zeros(2)})
    LearnerService._write_checkpoint(learner, "checkpoints/final.pt", "{}", False)
    raw = (tmp_path / "checkpoints" / "final.pt").read_bytes()
    assert not any(s.encode() in raw for s in SECRETS)
    state = ckpt.unpack(raw)
    assert RunConfig.from_json(state["config_json"]).env == learner.config.env


def test_the_coordinator_sends_an_env_worker_no_secret(monkeypatch):
    """What crosses the wire to a worker that opens no store holds none of the spec's secrets (the env service drops
    them too, but it should never have been sent them)."""
    from rlfabric.services.coordinator import plan as plan_mod

    sent = []

    async def rpc(stage, method, request, timeout=None):
        sent.append(request)
        return SimpleNamespace(data_endpoint="tcp://127.0.0.1:1", detail_json="{}")

    executor = plan_mod.PlanExecutor.__new__(plan_mod.PlanExecutor)
    executor.run = SimpleNamespace(run_id="run-1")
    executor.cfg, executor.endpoints, executor.fence = _secret_config(), {}, "attempt-fence"
    stage = SimpleNamespace(worker=SimpleNamespace(worker_id="env-1"))
    monkeypatch.setattr(plan_mod, "rpc", rpc)
    asyncio.run(executor.configure_env(stage))
    assert len(sent) == 1 and not any(s in sent[0].config_json for s in SECRETS)
    assert RunConfig.from_json(sent[0].config_json).env == executor.cfg.env
    assert json.loads(sent[0].context_json) == {"fence": "attempt-fence"}  # the attempt's fence, nothing else


def test_what_the_coordinator_and_a_replay_worker_log_or_answer_holds_no_secret(tmp_path, caplog):
    """deployment.md: "Secrets in a run spec (`storage.access_key`/`secret_key`, a password in `replay.redis_url`)
    never reach `config.yaml`, the run index, checkpoints or logs": every log record (as the JSON log files write
    it) and every file of a run the coordinator takes, and what a replay worker logs and answers as it opens the
    spec's Redis, or cannot reach it."""
    from rlfabric.services.coordinator.server import CoordinatorService
    from rlfabric.services.core.logs import JsonFormatter
    from rlfabric.services.core.paths import DataRoots, Endpoints
    from rlfabric.services.core.proto.rlfabric.v1 import common_pb2, coordinator_pb2
    from rlfabric.services.replay.server import ReplayService
    from tests.conftest import Aborted, AbortingContext

    runtime = SimpleNamespace(address="127.0.0.1:1", advertise_host="127.0.0.1", data_endpoint="", state="idle",
                              owner_run="", owner_key="", worker_id="", on_shutdown=lambda hook: None,
                              watch=lambda name, probe: None, options=SimpleNamespace(role="replay", coordinator=""))
    answers, written = [], {}

    async def main():
        coordinator = CoordinatorService(runtime, str(tmp_path / "runs"), 3.0, take_up_runs=False)
        replay = ReplayService(runtime, "127.0.0.1", DataRoots.parse(str(tmp_path)), Endpoints.parse("*"))
        try:
            await coordinator.SubmitRun(coordinator_pb2.SubmitRunRequest(config_yaml=dump_yaml(_secret_config()),
                                                                         run_dir="with-secrets"), _Context())
            await asyncio.sleep(0.3)  # the run's task starts, waits for workers, and logs what it does
            for store, url in (("memory", f"redis://default:{SECRETS[2]}@redis:6379/0"),
                               ("redis", f"redis://default:{SECRETS[2]}@127.0.0.1:1/0")):  # nothing listens
                config = short_config(storage={"access_key": SECRETS[0], "secret_key": SECRETS[1]},
                                      replay={"store": store, "redis_url": url, "connect_timeout_s": 1.0})
                try:
                    reply = await replay.Configure(common_pb2.ConfigureRequest(
                        run_id="with-secrets", config_json=config.to_json()), AbortingContext())
                    answers.append(str(reply))
                except Aborted as exc:
                    answers.append(exc.details)
            written.update({str(p): p.read_bytes().decode(errors="replace")
                            for p in (tmp_path / "runs").rglob("*") if p.is_file()})  # while the run is on
        finally:
            replay.data.stop()
            await coordinator.shutdown()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    formatter = JsonFormatter("test")
    logged = "\n".join(formatter.format(record) for record in caplog.records)
    assert "configured" in logged and "cannot reach Redis" in answers[1], (logged[-2000:], answers)
    index = str(tmp_path / "runs" / ".coordinator" / "runs.json")  # (config.yaml: test_run_directory_is_...)
    assert "with-secrets" in written[index]
    for where, text in [("logs", logged), ("answers", "\n".join(answers)), *written.items()]:
        assert not any(s in text for s in SECRETS), where


def _stores_opened(monkeypatch, tmp_path, config, run_id: str, run_dir) -> dict:
    """What a replay worker configured with ``config`` opens its stores with (S3 for large tensors, Redis), the
    stores themselves replaced: {"s3": the S3 store's arguments, "redis_url": the URL Redis is dialled at}."""
    from rlfabric.services.core import objectstore
    from rlfabric.services.core.paths import DataRoots, Endpoints
    from rlfabric.services.replay import server as replay_server

    opened = {}

    class Opened(Exception):
        pass

    def s3_store(self, **kwargs):  # (no MinIO here: what the store would be opened with)
        opened["s3"] = kwargs

    def redis_store(config, run_id, objects, **kwargs):
        opened["redis_url"] = config.replay.redis_url
        raise Opened

    monkeypatch.setattr(objectstore.S3ObjectStore, "__init__", s3_store)
    monkeypatch.setattr(replay_server, "open_replay_store", redis_store)
    worker = SimpleNamespace(roots=DataRoots.parse(str(tmp_path)), endpoints=Endpoints.parse("*"),
                             max_memory_bytes=1 << 30)
    with pytest.raises(Opened):
        replay_server.ReplayService._open_stores(worker, config, run_id, str(run_dir))
    return opened


def test_a_resumed_run_takes_its_secrets_from_its_workers_environment(tmp_path, monkeypatch):
    """deployment.md: "a resumed run takes them from its workers' environment (`RLFABRIC_S3_ACCESS_KEY`,
    `RLFABRIC_S3_SECRET_KEY`, `RLFABRIC_REDIS_PASSWORD`)": the spec a resume reads back from config.yaml has none,
    and a worker opening its stores (here the replay service: S3 for large tensors, Redis) fills them in."""
    from rlfabric.services.core.config import parse_config

    spec = short_config(storage={"kind": "s3", "endpoint": "minio:9000", "access_key": SECRETS[0],
                                 "secret_key": SECRETS[1]},
                        replay={"store": "redis", "redis_url": f"redis://default:{SECRETS[2]}@redis:6379/0"})
    saved = dump_yaml(spec.redacted())  # what config.yaml holds
    assert not any(s in saved for s in SECRETS)
    resumed = parse_config(saved, "config.yaml")
    monkeypatch.setenv("RLFABRIC_S3_ACCESS_KEY", "env-access-key")
    monkeypatch.setenv("RLFABRIC_S3_SECRET_KEY", "env-secret-key")
    monkeypatch.setenv("RLFABRIC_REDIS_PASSWORD", "env-password")
    opened = _stores_opened(monkeypatch, tmp_path, resumed, "r", tmp_path / "run")
    assert (opened["s3"]["access_key"], opened["s3"]["secret_key"]) == ("env-access-key", "env-secret-key")
    assert opened["redis_url"] == "redis://default:env-password@redis:6379/0"


def test_a_resumed_run_takes_its_secrets_from_overrides_again(tmp_path, monkeypatch):
    """deployment.md: "a resumed run takes them from its workers' environment (...) or from the resume's overrides": a
    resume whose overrides name the secrets (what `rlfabric.Client.resume(run_dir, overrides=[...])` sends) puts
    them into the run the coordinator makes of the saved, secret-free config.yaml, and a worker opening its stores
    (the replay service, whose Configure gets the run's config as is) opens them with those, no variable set."""
    from rlfabric.services.coordinator.client import CoordinatorClient
    from rlfabric.services.coordinator.server import CoordinatorService
    from tests.conftest import AbortingContext

    for name in ("RLFABRIC_S3_ACCESS_KEY", "RLFABRIC_S3_SECRET_KEY", "RLFABRIC_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    spec = short_config(storage={"kind": "s3", "endpoint": "minio:9000", "access_key": SECRETS[0],
                                 "secret_key": SECRETS[1]},
                        replay={"store": "redis", "redis_url": f"redis://default:{SECRETS[2]}@redis:6379/0"})
    run_dir = tmp_path / "runs" / "resumed"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(spec.redacted()))  # what the first run left
    overrides = ["storage.access_key=set-access-key", "storage.secret_key=set-secret-key",
                 "replay.redis_url=redis://default:set-password@redis:6379/0"]
    sent = []
    client = CoordinatorClient.__new__(CoordinatorClient)  # (its stub only: what it sends)
    client.timeout_s, client.stub = 1.0, SimpleNamespace(SubmitRun=lambda request, timeout: sent.append(request))
    client.resume(run_dir, overrides)
    [request] = sent
    assert request.resume and list(request.overrides) == overrides

    async def coordinator() -> str:
        runtime = SimpleNamespace(address="127.0.0.1:1", on_shutdown=lambda hook: None)
        service = CoordinatorService(runtime, str(tmp_path / "runs"), 3.0, take_up_runs=False)
        try:
            status = await service.SubmitRun(request, AbortingContext())
            return service.runs[status.run_id].config.to_json()  # what the replay worker's Configure carries
        finally:
            await service.shutdown()

    resumed = RunConfig.from_json(asyncio.run(coordinator()))
    opened = _stores_opened(monkeypatch, tmp_path, resumed, "resumed", run_dir)
    assert (opened["s3"]["access_key"], opened["s3"]["secret_key"]) == ("set-access-key", "set-secret-key")
    assert opened["redis_url"] == "redis://default:set-password@redis:6379/0"
