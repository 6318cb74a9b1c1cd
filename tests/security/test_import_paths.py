"""A run spec cannot make a service import code (issue 39). A token holder submits specs that name
``subprocess:Popen``, ``os:system``, ``builtins:exec`` and a module on the workers' PYTHONPATH (importing it would
write a sentinel file) in every field that names code: the text task (env.id), the reward, the policy, the env
adapter, the rollout backend and collector, and gymnasium's own ``module:EnvId`` form of env.id. Services started
without ``--allow-import-paths`` answer INVALID_ARGUMENT naming that flag, at the coordinator and at each worker
called directly, and the sentinel never appears. (With the flag, as a local ``rlfabric train`` starts its stack,
the same names resolve: tests/e2e/test_adapter_smoke.py runs a plug-in's literal reward through every service.)"""

from __future__ import annotations

import json

import grpc
import pytest

from rlfabric.services.core.config import RunConfig
from rlfabric.services.core.proto.rlfabric.v1 import (
    common_pb2,
    env_pb2_grpc,
    learner_pb2_grpc,
    replay_pb2_grpc,
    rollout_pb2_grpc,
)
from rlfabric.services.core.registry import IMPORT_PATHS_FLAG
from rlfabric.services.core.runtime import ROLE_NAMES
from rlfabric.services.launcher import LocalStack
from tests.conftest import grpc_channel, wait_for_workers

ROLES = ("env", "replay", "learner", "rollout")
STUBS = {"env": env_pb2_grpc.EnvStub, "replay": replay_pb2_grpc.ReplayStub, "learner": learner_pb2_grpc.LearnerStub,
         "rollout": rollout_pb2_grpc.RolloutStub}
EVIL = '''
import pathlib, os
pathlib.Path(os.environ["RLF_SENTINEL"]).write_text("imported")
class Task:
    def __init__(self, **options): pass
    def problem(self, rng): return None
def reward(prompt, completion, answer, **fields): return 0.0
'''


def specs(name: str) -> dict[str, dict]:
    """One spec per field that names code, each naming ``name`` there."""
    text = {"adapter": "text", "num_envs": 2, "eval_envs": 2}
    return {
        "task": {"env": {**text, "id": name, "options": {"group_size": 2}}},
        "reward": {"env": {**text, "id": "arith", "options": {"group_size": 2, "reward": name}}},
        "eval reward": {"env": {**text, "id": "arith", "eval_options": {"reward": name}}},
        "policy": {"policy": {"name": name}},
        "adapter": {"env": {"adapter": name, "id": "CartPole-v1"}},
        "backend": {"rollout": {"backend": name}},
        "collector": {"rollout": {"collector": name}},
    }


NAMES = ("subprocess:Popen", "os:system", "builtins:exec", "rlf_evil:Task", "rlf_evil:reward")


@pytest.fixture
def unflagged_stack(tmp_path, monkeypatch):
    """Every service as its own process, started the way an operator starts them, without the flag; the module
    ``rlf_evil`` is importable in each (PYTHONPATH), and importing it anywhere writes the sentinel."""
    from rlfabric.services.coordinator.client import CoordinatorClient

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "rlf_evil.py").write_text(EVIL)
    sentinel = tmp_path / "sentinel"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("RLF_SENTINEL", str(sentinel))
    monkeypatch.setenv("RLFABRIC_LAUNCH", "exec")  # a fresh interpreter each, so PYTHONPATH reaches it
    stack = LocalStack(log_dir=tmp_path / "logs", runs_root=tmp_path / "runs", roles=ROLES, heartbeat_timeout_s=5.0)
    assert not stack.allow_import_paths
    stack.start()
    stack.client = CoordinatorClient(stack.address)
    try:
        wait_for_workers(stack, len(ROLES))
        yield stack, sentinel
    finally:
        stack.client.close()
        stack.stop()


def test_a_spec_that_names_code_by_import_path_is_refused_everywhere_without_the_operators_flag(unflagged_stack):
    stack, sentinel = unflagged_stack
    workers = {ROLE_NAMES[w.role]: w.endpoint.grpc for w in stack.client.workers() if w.alive}
    cases = [(f"{kind}={name}", spec) for name in NAMES for kind, spec in specs(name).items()]
    cases += [(f"gymnasium env.id {env_id}", {"env": {"id": env_id}})
              for env_id in ("subprocess:CartPole-v1", "rlf_evil:Evil-v0")]
    refused_by_workers = 0
    for label, spec in cases:
        with pytest.raises(grpc.RpcError) as info:
            stack.client.submit(json.dumps({"name": "attack", **spec}))  # (JSON is YAML)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, info.value.details())
        assert IMPORT_PATHS_FLAG in info.value.details(), (label, info.value.details())
        # and straight to each worker, past the coordinator: a token holder can call them too
        config = RunConfig().model_dump(mode="json")
        for section, values in spec.items():
            config[section].update(values)
        for role, address in workers.items():
            with grpc_channel(address) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    STUBS[role](channel).Configure(common_pb2.ConfigureRequest(
                        run_id="attack", config_json=json.dumps(config), context_json="{}"), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, role, info.value.details())
            assert IMPORT_PATHS_FLAG in info.value.details(), (label, role, info.value.details())
            refused_by_workers += 1
    assert refused_by_workers == len(cases) * len(ROLES)
    assert not sentinel.exists(), "a service imported the module a run spec named"
    assert not stack.dead() and len([w for w in stack.client.workers() if w.alive]) == len(ROLES)
