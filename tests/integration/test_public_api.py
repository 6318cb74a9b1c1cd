"""The notebook's API: ``import rlfabric`` gives the client, the run-spec schema, the batch type, a local stack and
the registries, without a top-level package called services."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlfabric
from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2


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


@pytest.mark.slow
def test_the_installed_package_is_one_namespace(tmp_path):
    """`pip install rlfabric` installs rlfabric (with rlfabric.services), and no top-level `services` package to
    collide with another one's: the wheel holds only rlfabric/, and installed from it, `import
    rlfabric.services.coordinator` works where `import services` fails."""
    import zipfile

    root = Path(__file__).resolve().parents[2]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(root)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("rlfabric-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"rlfabric"}, tops
    assert "rlfabric/services/coordinator/server.py" in names and "rlfabric/services/env/tasks/data/" in " ".join(names)
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    probe = ("import sys; sys.path[:0] = [sys.argv[1]]; import rlfabric.services.coordinator.server as s; "
             "print(s.__file__)\ntry:\n    import services\nexcept ImportError:\n    print('no services')")
    ran = subprocess.run([sys.executable, "-S", "-c", probe, str(target)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": _site_packages()})
    assert ran.returncode == 0, ran.stderr[-2000:]
    where, verdict = ran.stdout.strip().split("\n")
    assert where.startswith(str(target)) and verdict == "no services", ran.stdout


def _site_packages() -> str:
    """This environment's installed dependencies, without its editable rlfabric (the probe must import the wheel's)."""
    import site

    return os.pathsep.join(site.getsitepackages())
