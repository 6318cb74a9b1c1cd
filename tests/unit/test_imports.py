"""Processes that do not train do not import torch: the coordinator, the robot gateway (a small computer beside an
arm), replay, and env with an adapter that needs no torch. Each check runs in a fresh interpreter, since this test
process has torch loaded already; a failure names the chain of imports that brought torch in."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlfabric.services.core.lazy import LazyModule, lazy_import

ROOT = Path(__file__).resolve().parents[2]

# Runs first in the child: remembers which repository frames imported torch first (the failure message).
_WATCH = textwrap.dedent("""
    import json, sys, traceback

    first = []

    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" and not first:
                first.extend(f"{f.filename.removeprefix(ROOT + '/')}:{f.lineno}" for f in traceback.extract_stack()
                             if f.filename.startswith(ROOT + "/services"))
            return None

    sys.meta_path.insert(0, Watch())
""").replace("ROOT", repr(str(ROOT)))


def _torch_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; whether torch got imported, and from where."""
    script = _WATCH + textwrap.dedent(code) + textwrap.dedent("""
        print(json.dumps({"torch": "torch" in sys.modules, "via": " <- ".join(reversed(first))}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", ["rlfabric.services.coordinator.server", "rlfabric.services.robot_gateway.server",
                                    "rlfabric.services.replay.server", "rlfabric.services.env.server"])
def test_a_service_that_does_not_train_imports_no_torch(module):
    result = _torch_after(f"import {module}")
    assert not result["torch"], f"importing {module} imports torch, via {result['via']}"


def test_the_config_schema_and_every_algorithms_declarations_need_no_torch():
    """The coordinator validates run specs and reads every algorithm's declarations (data access, roles,
    iterations): all of that without torch."""
    result = _torch_after("""
        import rlfabric.registries
        from rlfabric.services.core.algorithm import load_algorithms
        from rlfabric.services.core.config import RunConfig

        assert {"ppo", "sac", "iql", "bc", "grpo", "sft"} <= set(load_algorithms())
        assert rlfabric.registries.algorithms() == load_algorithms()
        for name, spec in load_algorithms().items():
            spec.needs(spec.Config())
            spec.data(spec.Config())
        run = RunConfig.model_validate({"algorithm": {"name": "ppo"}, "env": {"id": "CartPole-v1"}})
        assert run.iterations() > 0 and run.spec.data(run.algorithm).on_policy_fifo
    """)
    assert not result["torch"], f"the config schema imports torch, via {result['via']}"


def test_the_coordinator_validates_every_example_spec_without_torch():
    """Issue 40: a spec that names a policy (policy.name: pi0) made validation import the policy's class, so the
    coordinator loaded torch for 4 of the examples. What a built-in policy serves is now read without importing it."""
    result = _torch_after("""
        import glob
        import rlfabric.services.coordinator.server
        from rlfabric.services.core.config import load_config

        examples = sorted(glob.glob("examples/*.yaml"))
        assert len(examples) > 20
        for path in examples:
            load_config(path)
        assert {load_config(p).policy.name for p in examples} >= {"pi0", "vla_tokens", "vla"}
    """)
    assert not result["torch"], f"validating the examples imports torch, via {result['via']}"


def test_every_registered_options_model_and_the_policy_protocols_need_no_torch():
    """Each policy's (backend's) options section is a model the coordinator loads with the schema: its module, and
    what a policy must provide (services/core/policy.py), import no torch."""
    result = _torch_after("""
        import rlfabric.registries
        import rlfabric.services.core.policy
        from rlfabric.services.core.options import BACKEND_OPTIONS, POLICY_OPTIONS

        assert {"vla", "pi0", "vla_tokens", "vlm"} <= set(rlfabric.registries.policy_options())
        for registry in (POLICY_OPTIONS, BACKEND_OPTIONS):
            for name in registry.available():
                registry.load(name)()
    """)
    assert not result["torch"], f"an options model imports torch, via {result['via']}"


@pytest.mark.parametrize("adapter,env_id", [("gymnasium", "CartPole-v1"), ("text", "arith")])
def test_an_env_service_whose_adapter_needs_no_torch_steps_without_it(adapter, env_id):
    result = _torch_after(f"""
        import rlfabric.services.env.server
        from rlfabric.services.core.config import EnvConfig
        from rlfabric.services.env.pool import EnvPool

        EnvPool(EnvConfig(adapter={adapter!r}, id={env_id!r}), 2).reset(0)
    """)
    assert not result["torch"], f"an env service with env.adapter={adapter} imports torch, via {result['via']}"


def test_the_learner_gets_torch_when_an_update_runs():
    """The other side: an algorithm file's lazily bound torch is the real one once its update code uses it."""
    result = _torch_after("""
        from rlfabric.services.learner.algorithms import ppo

        assert "torch" not in sys.modules
        gamma = ppo.torch.ones(3)
        advantages, returns = ppo.compute_gae(gamma * 0, gamma * 0, gamma * 0, gamma[:1] * 0, 0.9, 0.9)
        assert type(advantages) is sys.modules["torch"].Tensor
    """)
    assert result["torch"]


def test_a_lazy_module_is_imported_on_first_use(tmp_path, monkeypatch):
    (tmp_path / "lazy_probe.py").write_text("VALUE = 42\nimported = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_probe", raising=False)
    probe = lazy_import("lazy_probe")
    assert isinstance(probe, LazyModule) and "lazy_probe" not in sys.modules
    assert "not imported yet" in repr(probe)
    assert probe.VALUE == 42
    assert sys.modules["lazy_probe"].imported and "loaded" in repr(probe)
    sys.modules["lazy_probe"].LATER = "read through"  # an attribute the module gains after the first read
    assert probe.LATER == "read through"
    with pytest.raises(AttributeError):
        probe.missing  # noqa: B018


def test_a_plugin_spec_that_imports_torch_eagerly_is_named_in_a_warning(tmp_path):
    """A plug-in algorithm still loads when its file imports torch at the top, but every service then pays for it:
    the log names the module and the fix."""
    (tmp_path / "eager_specs").mkdir()
    (tmp_path / "eager_specs" / "__init__.py").write_text("")
    (tmp_path / "eager_specs" / "heavy.py").write_text("import torch  # noqa: F401\n")
    result = _torch_after(f"""
        import io, logging
        from importlib.metadata import EntryPoint

        sys.path.insert(0, {str(tmp_path)!r})
        import rlfabric.services.core.algorithm as algorithm

        builtin = algorithm.entry_points
        algorithm.entry_points = lambda group: [*builtin(group=group), EntryPoint("eager", "eager_specs", group)]
        log = io.StringIO()
        logging.basicConfig(stream=log, level=logging.WARNING)
        assert "ppo" in algorithm.load_algorithms()
        warned = [line for line in log.getvalue().splitlines() if "imports torch" in line]
        assert len(warned) == 1 and "eager_specs.heavy" in warned[0] and "lazy_import" in warned[0], warned
    """)
    assert result["torch"]
