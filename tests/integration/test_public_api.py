"""The notebook's API: ``import rlfabric`` gives the client, the run-spec schema, the batch type, a local stack and
the registries, without a top-level package called services."""

from __future__ import annotations

import subprocess
import sys

import rlfabric
from services.core.proto.rlfabric.v1 import coordinator_pb2


def test_a_notebook_session_through_the_public_api(tmp_path):
    stack = rlfabric.LocalStack(log_dir=tmp_path / "logs", runs_root=tmp_path)
    stack.start()
    try:
        client = rlfabric.Client(stack.address, token=stack.token)
        client.wait_ready(30)
        config = rlfabric.load_config("examples/cartpole_ppo.yaml", ["train.total_env_steps=1024",
                                                                     "train.stop_at_eval_return=null"])
        assert isinstance(config, rlfabric.RunConfig) and config.spec is rlfabric.registries.algorithms()["ppo"]
        run = client.submit(config, run_dir=tmp_path / "nb")
        rows = [e.metrics for e in client.watch(run.run_id) if e.HasField("metrics")]
        assert client.status(run.run_id).state == coordinator_pb2.SUCCEEDED
        assert [r.env_steps for r in rows] == [256, 512, 768, 1024]
        client.close()
    finally:
        stack.stop()


def test_registries_name_every_extension_point_and_the_import_stays_light():
    assert {"ppo", "sac", "iql", "bc"} <= set(rlfabric.registries.algorithms())
    assert {"actor_critic", "squashed_gaussian"} <= set(rlfabric.registries.policies())
    assert "gym" in rlfabric.registries.collectors() and "torch" in rlfabric.registries.backends()
    assert {"gymnasium", "minigrid"} <= set(rlfabric.registries.env_adapters())
    assert {"sim", "franka", "so100", "so101"} <= set(rlfabric.registries.drivers())
    assert {"exact_match", "gsm8k"} <= set(rlfabric.registries.rewards()) and "arith" in rlfabric.registries.tasks()
    probe = subprocess.run([sys.executable, "-c", "import sys, rlfabric; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False"  # a notebook pays for torch only when it needs a name that does
