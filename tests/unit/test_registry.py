"""One registry for extension points (services/core/registry.py): built-ins, entry points of installed packages and
literal ``package.module:attr`` names resolve the same way in every process; an unknown name gets one error that
lists what exists and how to add one; ``rollout.collector: auto`` takes the collector the env adapter declares."""

from __future__ import annotations

import json
import sys
import textwrap

import pydantic
import pytest

from rlfabric.services.core.registry import Registry, is_literal
from rlfabric.services.env.adapters import ENV_ADAPTERS, EnvAdapter
from rlfabric.services.rollout.collectors import COLLECTORS, collector_class, collector_name
from tests.conftest import short_config


def _plugin(root, name: str, group: str, entries: dict[str, str], source: str) -> None:
    """An installed package as importlib.metadata sees one: a module and a dist-info with its entry points."""
    (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}\n")


PLUGIN_ADAPTER = """
    import gymnasium as gym

    from rlfabric.services.env.adapters.gymnasium import make_vector_env as _gym_vector_env

    collector = "{collector}"

    def check(env_cfg):
        pass

    def make_vector_env(env_cfg, num_envs, vectorization="sync"):
        return _gym_vector_env(env_cfg, num_envs, vectorization)
"""


@pytest.fixture
def unload(monkeypatch):
    """Forget what the module-level registries loaded in a test (they cache per name)."""
    for reg in (ENV_ADAPTERS, COLLECTORS):
        monkeypatch.setattr(reg, "_loaded", {})
        monkeypatch.setattr(reg, "_builtins", dict(reg._builtins))
    yield
    for name in [m for m in sys.modules if m.startswith("rlf_test_")]:
        del sys.modules[name]


def test_an_unknown_name_lists_builtins_and_entry_points_and_the_three_ways_to_add_one(tmp_path, monkeypatch,
                                                                                        unload):
    _plugin(tmp_path, "rlf_test_listed", "rlfabric.env_adapters", {"listed_env": "rlf_test_listed"},
            PLUGIN_ADAPTER.format(collector="gym"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        ENV_ADAPTERS.load("mujoco_pixel")
    message = str(err.value)
    assert message.startswith("env.adapter 'mujoco_pixel' is not a registered env adapter")
    for name in ("gymnasium", "mujoco_pixels", "robotics", "metaworld", "minigrid", "text", "robot", "listed_env"):
        assert repr(name) in message, name
    assert "services/env/adapters" in message and "'rlfabric.env_adapters'" in message
    assert "package.module:attr in the run spec" in message


def test_an_entry_point_of_an_installed_package_resolves_and_brings_its_collector(tmp_path, monkeypatch, unload):
    """A user's package registers an env adapter and the collector it declares, no edit to rlfabric: auto finds
    the collector through the adapter, in this process (as every rollout worker does)."""
    _plugin(tmp_path, "rlf_test_adapter", "rlfabric.env_adapters", {"my_env": "rlf_test_adapter"},
            PLUGIN_ADAPTER.format(collector="my_gym"))
    _plugin(tmp_path, "rlf_test_collector", "rlfabric.collectors",
            {"my_gym": "rlf_test_collector:MyCollector"}, """
        from rlfabric.services.rollout.collectors.gym import GymCollector

        class MyCollector(GymCollector):
            pass
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ENV_ADAPTERS.entry_points()["my_env"] == "rlf_test_adapter"
    assert "my_env" in ENV_ADAPTERS and "my_gym" in COLLECTORS
    module = ENV_ADAPTERS.load("my_env")
    assert module.__name__ == "rlf_test_adapter" and isinstance(module, EnvAdapter)
    config = short_config(env__adapter="my_env")
    assert collector_name(config) == "my_gym"
    assert collector_class(config).__module__ == "rlf_test_collector"


def test_literal_names_resolve_by_import_and_are_checked_against_the_protocol(unload):
    assert is_literal("pkg.module:Attr") and is_literal("pkg.module") and not is_literal("gym")
    assert not is_literal("pkg..module") and not is_literal("pkg.module:") and not is_literal("../x")
    cls = COLLECTORS.load("rlfabric.services.rollout.collectors.gym:GymCollector")
    assert cls.__name__ == "GymCollector"
    assert ENV_ADAPTERS.load("rlfabric.services.env.adapters.minigrid").collector == "gym"
    with pytest.raises(ValueError, match=r"lacks \['collect', 'evaluate', 'probe', 'reset'\], which every collector"):
        COLLECTORS.load("rlfabric.services.rollout.collectors.gym:Evaluation")
    with pytest.raises(ValueError, match="does not resolve .*has no attribute 'Nope'"):
        COLLECTORS.load("rlfabric.services.rollout.collectors.gym:Nope")
    with pytest.raises(ValueError, match="module 'rlf_test_absent.mod' cannot be imported"):
        ENV_ADAPTERS.load("rlf_test_absent.mod")


def test_a_missing_dependency_of_an_existing_module_names_the_package(tmp_path, monkeypatch, unload):
    (tmp_path / "rlf_test_needs").mkdir()
    (tmp_path / "rlf_test_needs" / "__init__.py").write_text("")
    (tmp_path / "rlf_test_needs" / "env.py").write_text("import rlf_test_not_installed  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"needs a package that is not installed \(rlf_test_not_installed\)"):
        ENV_ADAPTERS.load("rlf_test_needs.env")


@pytest.mark.parametrize("adapter,collector", [("gymnasium", "gym"), ("mujoco_pixels", "gym"), ("robotics", "gym"),
                                               ("metaworld", "gym"), ("minigrid", "gym"), ("robot", "gym"),
                                               ("text", "llm")])
def test_auto_takes_the_collector_every_builtin_adapter_declares(adapter, collector):
    """mujoco_pixels, robotics and metaworld had no row in the old BY_ADAPTER table: auto failed at Configure."""
    assert collector_name(short_config(env__adapter=adapter)) == collector
    assert collector_name(short_config(env__adapter=adapter, rollout__collector="llm")) == "llm"


def test_an_adapter_that_declares_no_collector_is_refused_by_name(tmp_path, monkeypatch, unload):
    (tmp_path / "rlf_test_bare").mkdir()
    (tmp_path / "rlf_test_bare" / "__init__.py").write_text("")
    (tmp_path / "rlf_test_bare" / "env.py").write_text("def check(c):\n    pass\n\n\ndef make_vector_env(c, n, v):\n"
                                               "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"env.adapter 'rlf_test_bare.env': 'rlf_test_bare.env' lacks \['collector'\], "
                                         r"which every env adapter provides"):
        collector_name(short_config(env__adapter="rlf_test_bare.env"))


def test_register_changes_this_process_and_keeps_names_plain():
    reg = Registry("widgets", "x.widget", {"a": "rlfabric.services.core.registry:Registry"}, home="services/x")
    reg.register("b", "rlfabric.services.core.registry:is_literal")
    assert reg.load("b") is is_literal and set(reg.available()) == {"a", "b"}
    with pytest.raises(ValueError, match="use lowercase letters"):
        reg.register("Not.Plain", "x:y")


@pytest.mark.parametrize("name", ["../etc/passwd", "a b", "pkg.mod:attr:more", "-x", "x" * 301])
def test_the_run_spec_refuses_names_that_are_no_name_or_import_path(name):
    with pytest.raises(pydantic.ValidationError):
        short_config(env__adapter=name)
    with pytest.raises(pydantic.ValidationError):
        short_config(rollout__collector=name)


def test_a_backend_from_an_entry_point_is_built_and_checked_against_the_protocol(tmp_path, monkeypatch):
    from rlfabric.services.rollout.backends import BACKENDS, build_backend
    from rlfabric.services.rollout.evaluate import _env_spec

    monkeypatch.setattr(BACKENDS, "_loaded", {})
    _plugin(tmp_path, "rlf_test_backend", "rlfabric.backends",
            {"my_torch": "rlf_test_backend:MyBackend", "half_made": "rlf_test_backend:HalfMade"}, """
        from rlfabric.services.rollout.backends.torch import TorchBackend

        class MyBackend(TorchBackend):
            pass

        class HalfMade:
            def __init__(self, config, env_spec, device):
                self.version = -1

            def load(self, version, tensors):
                self.version = version
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = short_config(rollout__backend="my_torch")
    backend = build_backend("my_torch", config, _env_spec(config), "cpu")
    assert type(backend).__name__ == "MyBackend" and backend.version == -1 and backend.receiver is not None
    with pytest.raises(ValueError, match=r"rollout.backend 'half_made': HalfMade built without \['generator', "
                                         r"'has_value', 'policy', 'receiver'\]"):
        build_backend("half_made", config, _env_spec(config), "cpu")
    with pytest.raises(ValueError, match=r"rollout.backend 'tourch' is not a registered backend") as err:
        build_backend("tourch", config, _env_spec(config), "cpu")
    assert all(repr(n) in str(err.value) for n in ("half_made", "hf", "my_torch", "sglang", "torch", "vllm"))
    del sys.modules["rlf_test_backend"]


def test_a_text_task_and_rewards_from_a_users_package_score_through_the_text_adapter(tmp_path, monkeypatch):
    """A task and a reward by entry point, a second reward by ``module:function``: the env pool (as the env service
    builds it) resolves each in its own process."""
    from types import SimpleNamespace

    from rlfabric.services.core.batch import Ragged
    from rlfabric.services.env.pool import EnvPool
    from rlfabric.services.env.tasks import TASKS
    from rlfabric.services.env.tasks.rewards import REWARDS

    for reg in (TASKS, REWARDS):
        monkeypatch.setattr(reg, "_loaded", {})
    _plugin(tmp_path, "rlf_test_text", "rlfabric.tasks", {"doubled": "rlf_test_text:Doubled"}, """
        from rlfabric.services.env.tasks.arith import ArithTask, Problem

        class Doubled(ArithTask):  # every reference answer is 42
            def problem(self, rng):
                return Problem(super().problem(rng).question, "42")

        def always_half(prompt, completion, answer, **fields):
            return 0.5
    """)
    info = tmp_path / "rlf_test_text-0.1.dist-info" / "entry_points.txt"
    info.write_text(info.read_text() + "[rlfabric.rewards]\nlenient = rlf_test_text:always_half\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for reward, expected in (("lenient", [0.5, 0.5]), ("rlf_test_text:always_half", [0.5, 0.5]),
                             ("exact_match", [1.0, 0.0])):
        env = SimpleNamespace(id="doubled", adapter="text", num_envs=2, action_chunk=1, eval_envs=2, kwargs={},
                              options={"reward": reward}, eval_options={})
        pool = EnvPool(env, 2)
        pool.reset(0)
        out = pool.step(0, Ragged.from_texts(["42", "41"]))
        assert out["reward"].tolist() == expected, reward
    with pytest.raises(ValueError, match=r"env.options.reward 'rlf_test_text:nope': .* does not resolve"):
        REWARDS.load("rlf_test_text:nope")
    with pytest.raises(ValueError, match=r"env.id 'doubld' is not a registered text task") as err:
        TASKS.load("doubld")
    assert all(repr(n) in str(err.value) for n in ("arith", "arith_tool", "doubled"))
    del sys.modules["rlf_test_text"]


def test_a_policy_from_an_entry_point_serves_the_algorithm_it_declares(tmp_path, monkeypatch):
    from rlfabric.services.core.config import ConfigError, parse_config
    from rlfabric.services.core.models import POLICIES, build_policy
    from rlfabric.services.rollout.evaluate import _env_spec

    monkeypatch.setattr(POLICIES, "_loaded", {})
    _plugin(tmp_path, "rlf_test_policy", "rlfabric.policies", {"wide": "rlf_test_policy:Wide"}, """
        from rlfabric.services.core.models.actor_critic import ActorCritic

        class Wide(ActorCritic):
            serves = "actor_critic"
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = parse_config("policy: {name: wide, hidden_sizes: [8]}")
    assert config.policy_name == "wide"
    assert type(build_policy(config.policy_name, _env_spec(config), config.policy)).__name__ == "Wide"
    with pytest.raises(ConfigError, match=r"policy.name 'rlf_test_policy:Nope': .* does not resolve"):
        parse_config("policy: {name: 'rlf_test_policy:Nope'}")
    del sys.modules["rlf_test_policy"]


@pytest.fixture
def service_without_the_flag():
    """This process as a service its operator started without --allow-import-paths."""
    from rlfabric.services.core import registry

    registry.allow_import_paths(False)
    yield
    registry.allow_import_paths(True)


def test_a_service_without_the_flag_refuses_import_paths_even_ones_it_loaded_before(service_without_the_flag):
    from rlfabric.services.core.registry import IMPORT_PATHS_FLAG, ImportPathRefused, allow_import_paths
    from rlfabric.services.env.tasks import TASKS

    allow_import_paths(True)
    assert COLLECTORS.load("rlfabric.services.rollout.collectors.gym:GymCollector")  # now cached in this process
    allow_import_paths(False)
    for registry, name in ((COLLECTORS, "rlfabric.services.rollout.collectors.gym:GymCollector"), (TASKS, "os:system"),
                           (ENV_ADAPTERS, "subprocess"), (ENV_ADAPTERS, "rlfabric.services.env.adapters.gymnasium")):
        with pytest.raises(ValueError) as info:
            registry.load(name)
        if is_literal(name):
            assert isinstance(info.value, ImportPathRefused) and IMPORT_PATHS_FLAG in str(info.value)
            assert registry.field in str(info.value) and name not in registry
        else:  # a plain name that is no built-in or entry point is unknown, and the error offers no import path
            assert "not a registered" in str(info.value) and "package.module:attr in the run spec" not in str(
                info.value)
    assert TASKS.load("arith").__name__ == "ArithTask" and COLLECTORS.load("gym")  # built-ins still resolve


@pytest.mark.parametrize("field, spec", [
    ("env.id", {"env": {"adapter": "text", "id": "subprocess:Popen"}}),
    ("env.id", {"env": {"id": "os:CartPole-v1"}}),  # gymnasium's module:EnvId imports the module
    ("env.options.reward", {"env": {"adapter": "text", "id": "arith", "options": {"reward": "os:system"}}}),
    ("env.eval_options.reward", {"env": {"adapter": "text", "id": "arith", "eval_options": {"reward": "os:system"}}}),
    ("env.adapter", {"env": {"adapter": "os:system"}}),
    ("policy.name", {"policy": {"name": "os:system"}}),
    ("rollout.backend", {"rollout": {"backend": "builtins:exec"}}),
    ("rollout.collector", {"rollout": {"collector": "builtins:exec"}}),
    ("policy.vlm.trust_remote_code", {"policy": {"name": "vlm", "vlm": {"trust_remote_code": True}}}),
    ("policy.vla_tokens.trust_remote_code", {"policy": {"name": "vla_tokens",  # (read from its options model's
                                                        "vla_tokens": {"trust_remote_code": True}}}),  # runs_code)
])
def test_a_spec_naming_code_is_refused_by_a_service_without_the_flag_and_read_by_the_users_process(
        field, spec, service_without_the_flag):
    from rlfabric.services.core import registry
    from rlfabric.services.core.config import parse_config
    from rlfabric.services.core.spec_yaml import ConfigError

    text = json.dumps(spec)
    with pytest.raises(ConfigError) as info:
        parse_config(text, "spec")
    assert field in str(info.value) and registry.IMPORT_PATHS_FLAG in str(info.value)
    registry.allow_import_paths(True)  # the user's own process (CLI, notebook): its user names the code
    try:
        parse_config(text, "spec")
    except ConfigError as exc:  # a name that is not of its kind may still fail, but not for its import path
        assert registry.IMPORT_PATHS_FLAG not in str(exc)


@pytest.mark.parametrize("registry, name, why", [
    ("tasks", "subprocess:Popen", "a class with a problem"),
    ("rewards", "os:system", "Python function"),
    ("rewards", "builtins:exec", "Python function"),
    ("rewards", "subprocess:Popen", "Python function"),
    ("rewards", "rlfabric.services.env.tasks.arith:ArithTask", "Python function"),
])
def test_a_resolved_name_is_checked_as_its_kind_before_anything_calls_it(registry, name, why):
    from rlfabric.services.env.tasks import TASKS
    from rlfabric.services.env.tasks.rewards import REWARDS

    kind = {"tasks": TASKS, "rewards": REWARDS}[registry]
    with pytest.raises(ValueError, match=why):
        kind.load(name)


def test_what_each_built_in_policy_serves_is_written_as_its_class_says():
    """The coordinator learns what a policy serves without importing it (no torch there): core's own table for its
    models, the options model's ``serves`` for rlfabric's model families (entry points, as a plug-in's): both
    must say what each class does, and each class must provide that interface's Protocol."""
    from rlfabric.services.core.options import POLICY_OPTIONS
    from rlfabric.services.core.policy import INTERFACES
    from rlfabric.services.core.policy_names import BUILTINS, POLICIES, policy_class, serves
    from rlfabric.services.core.registry import missing_members

    families = {n for n, target in POLICIES.entry_points().items() if target.startswith("rlfabric.services.policies.")}
    assert families == {"vla", "pi0", "vla_tokens", "vlm", "flow_actor", "latent_noise"} <= set(POLICY_OPTIONS.available())
    for name, (_, written) in BUILTINS.items():
        assert getattr(policy_class(name), "serves", name) == written == serves(name), name
    for name in families:
        cls = policy_class(name)
        assert POLICY_OPTIONS.load(name).serves == cls.serves == serves(name), name
    for name in [*BUILTINS, *families]:
        cls = policy_class(name)
        assert not missing_members(cls, INTERFACES[getattr(cls, "serves", name)]), name


def test_every_builtin_policy_declares_its_optional_capabilities_as_protocols():
    """What the learner and the rollout ask of a policy beyond its interface (value_modules, random_actions,
    imitation_loss, shard_units, forward_methods) is a runtime-checkable Protocol each, not a probe by name."""
    from rlfabric.services.core import policy as P
    from rlfabric.services.core.models import build_policy
    from rlfabric.services.rollout.evaluate import _env_spec

    config = short_config()
    actor_critic = build_policy("actor_critic", _env_spec(config), config.policy)
    assert isinstance(actor_critic, P.ActorCriticPolicy) and isinstance(actor_critic, P.OwnCritic)
    assert isinstance(actor_critic, P.FlatActions) and not isinstance(actor_critic, P.DrawsRandomActions)
    assert not isinstance(actor_critic, P.Imitates) and not isinstance(actor_critic, P.ShardUnits)
    assert not P.reads_privileged(type(actor_critic))
    pendulum = short_config(env__id="Pendulum-v1")
    actor = build_policy("squashed_gaussian", _env_spec(pendulum), pendulum.policy)
    assert isinstance(actor, P.SquashedGaussianPolicy) and not isinstance(actor, P.ActorCriticPolicy)
    assert not isinstance(actor, P.OwnCritic)
    from rlfabric.services.core.models.lm import CausalLMPolicy
    from rlfabric.services.policies.chunk_policy import ChunkPolicy
    from rlfabric.services.policies.pi0 import PI0Policy
    from rlfabric.services.policies.vla import VLAPolicy

    for cls, capabilities in ((CausalLMPolicy, ("shard_units", "forward_methods", "save_pretrained")),
                              (ChunkPolicy, ("random_actions", "value_modules")),
                              (VLAPolicy, ("imitation_loss", "random_actions", "value_modules")),
                              (PI0Policy, ("imitation_loss", "save_pretrained", "critic_only_privileged"))):
        for name in capabilities:
            assert hasattr(cls, name), (cls, name)
    assert P.reads_privileged(PI0Policy) and not P.reads_privileged(VLAPolicy)


def test_a_policy_that_lacks_its_interface_is_refused_by_name_when_built(tmp_path, monkeypatch):
    from rlfabric.services.core.models import POLICIES, build_policy
    from rlfabric.services.rollout.evaluate import _env_spec

    monkeypatch.setattr(POLICIES, "_loaded", {})
    _plugin(tmp_path, "rlf_test_half_policy", "rlfabric.policies", {"half": "rlf_test_half_policy:Half"}, """
        import torch

        class Half(torch.nn.Module):  # says it serves actor_critic, but cannot be evaluated by an update
            serves = "actor_critic"
            has_value = False

            def __init__(self, obs_space, action_space, cfg):
                super().__init__()

            def act(self, obs, deterministic=False, generator=None):
                pass

            def env_actions(self, actions):
                pass
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = short_config()
    with pytest.raises(ValueError, match=r"policy.name 'half': Half serves 'actor_critic' and lacks \['evaluate', "
                                         r"'value'\].*rlfabric.services.core.policy.ActorCriticPolicy"):
        build_policy("half", _env_spec(config), config.policy)
    del sys.modules["rlf_test_half_policy"]


PLUGIN_POLICY = """
    from typing import ClassVar

    from pydantic import Field

    from rlfabric.services.core.options import BackendOptions, PolicyOptions


    class MyPolicyOptions(PolicyOptions):
        \"\"\"An actor-critic MLP of one width.\"\"\"

        serves: ClassVar[str | None] = "actor_critic"
        paths: ClassVar[dict[str, tuple[str, ...]]] = {"model": ("weights",)}
        runs_code: ClassVar[tuple[str, ...]] = ("own_code",)
        width: int = Field(16, ge=1, le=4096)
        layers: int = Field(2, ge=1, le=8)
        weights: str = ""
        own_code: bool = False


    class MyBackendOptions(BackendOptions):
        depth: int = Field(1, ge=1)


    class Loose(PolicyOptions):
        model_config = {"extra": "allow"}
"""

PLUGIN_POLICY_CLASS = """
    from rlfabric.services.core.models.actor_critic import ActorCritic
    from rlfabric.services.rollout.backends.torch import TorchBackend


    class MyPolicy(ActorCritic):
        serves = "actor_critic"

        def __init__(self, obs_space, action_space, cfg):
            own = cfg.my_policy
            super().__init__(obs_space, action_space, cfg.model_copy(update={"hidden_sizes": [own.width] * own.layers}))


    class MyBackend(TorchBackend):
        def __init__(self, config, env_spec, device):
            super().__init__(config, env_spec, device)
            self.depth = config.rollout.my_backend.depth
"""


def _plugin_with_options(root, options: dict[str, str] | None = None) -> None:
    """A package with a policy and a backend, each with its options model (a torch-free module of its own)."""
    _plugin(root, "rlf_test_options", "rlfabric.policy_options",
            options or {"my_policy": "rlf_test_options:MyPolicyOptions"}, PLUGIN_POLICY)
    info = root / "rlf_test_options-0.1.dist-info" / "entry_points.txt"
    info.write_text(info.read_text() + "[rlfabric.backend_options]\nmy_backend = rlf_test_options:MyBackendOptions\n"
                    "[rlfabric.policies]\nmy_policy = rlf_test_options_torch:MyPolicy\n"
                    "[rlfabric.backends]\nmy_backend = rlf_test_options_torch:MyBackend\n")
    (root / "rlf_test_options_torch.py").write_text(textwrap.dedent(PLUGIN_POLICY_CLASS))


def _fresh(code: str, path) -> dict:
    """``code`` in a fresh interpreter (the schema reads options models once, when it loads) with ``path`` on
    sys.path as site-packages would be; its last line of output, as JSON."""
    import subprocess

    script = f"import json, sys\nsys.path.insert(0, {str(path)!r})\n" + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_plugin_policy_has_its_own_options_section_as_strict_as_a_builtins(tmp_path):
    """policy: {name: my_policy, my_policy: {width: 32}}: the section comes from the plug-in's options model, a
    misspelled option is an error naming it, and all of it without torch (the coordinator's validation)."""
    _plugin_with_options(tmp_path)
    out = _fresh("""
        import rlfabric.registries
        from rlfabric.services.core import registry
        from rlfabric.services.core.config import ConfigError, parse_config
        from rlfabric.services.core.paths import DataRoots, PathRefused, confine_model

        config = parse_config("policy: {name: my_policy, my_policy: {width: 32}}")
        assert config.policy.my_policy.width == 32 and config.policy.my_policy.layers == 2
        assert parse_config("name: x").policy.my_policy.width == 16  # built from its defaults
        assert config.policy.pi0.flow_steps == 4  # rlfabric's own families are sections the same way
        errors = {}
        for name, spec in {"typo": "policy: {name: my_policy, my_policy: {widht: 32}}",
                           "range": "policy: {name: my_policy, my_policy: {width: 0}}",
                           "serves": "{policy: {name: my_policy}, algorithm: {name: sac}, env: {id: Pendulum-v1}}",
                           "section": "policy: {name: my_policy, my_polcy: {width: 32}}"}.items():
            try:
                parse_config(spec, "spec.yaml")
            except ConfigError as exc:
                errors[name] = str(exc)
        roots = DataRoots.parse({str(path)!r})
        inside = confine_model(parse_config("policy: {my_policy: {weights: w.pt}}"), roots)
        try:
            confine_model(parse_config("policy: {my_policy: {weights: /etc/passwd}}"), roots)
        except PathRefused as exc:
            errors["path"] = str(exc)
        registry.allow_import_paths(False)  # a service whose operator did not allow a checkpoint's own code
        try:
            parse_config("policy: {my_policy: {own_code: true}}")
        except ConfigError as exc:
            errors["code"] = str(exc)
        print(json.dumps({"errors": errors, "torch": "torch" in sys.modules,
                          "weights": inside.policy.my_policy.weights,
                          "options": rlfabric.registries.policy_options(),
                          "backend_options": rlfabric.registries.backend_options()}))
    """.replace("{str(path)!r}", repr(str(tmp_path))), tmp_path)
    errors = out["errors"]
    assert not out["torch"], "validating a plug-in's options section imported torch"
    assert "policy.my_policy.widht: unknown field" in errors["typo"]
    assert "did you mean 'policy.my_policy.width'?" in errors["typo"]
    assert "policy.my_policy.width:" in errors["range"] and "greater than or equal to 1" in errors["range"]
    assert "policy.name='my_policy' serves as 'actor_critic'" in errors["serves"]  # told without importing it
    assert "policy.my_polcy: unknown field" in errors["section"] and "'policy.my_policy'" in errors["section"]
    assert out["weights"] == str(tmp_path / "w.pt")
    assert "policy.my_policy.weights='/etc/passwd'" in errors["path"]
    assert "policy.my_policy.own_code: true runs the checkpoint's own Python" in errors["code"]
    assert out["options"]["my_policy"] == "rlf_test_options:MyPolicyOptions"
    assert out["options"]["pi0"] == "rlfabric.services.policies.options:PI0PolicyConfig"
    assert out["backend_options"] == {"my_backend": "rlf_test_options:MyBackendOptions"}


def test_a_plugin_policy_and_backend_read_their_sections_where_they_are_built(tmp_path):
    _plugin_with_options(tmp_path)
    out = _fresh("""
        from rlfabric.services.core.config import ConfigError, parse_config
        from rlfabric.services.core.models import build_policy
        from rlfabric.services.rollout.backends import build_backend
        from rlfabric.services.rollout.evaluate import _env_spec

        spec = ("{policy: {name: my_policy, my_policy: {width: 32, layers: 1}}, "
                "rollout: {backend: my_backend, my_backend: {depth: 3}}}")
        config = parse_config(spec)
        policy = build_policy(config.policy_name, _env_spec(config), config.policy)
        backend = build_backend(config.rollout.backend, config, _env_spec(config), "cpu")
        try:
            parse_config("rollout: {backend: my_backend, my_backend: {dept: 3}}", "spec.yaml")
        except ConfigError as exc:
            typo = str(exc)
        print(json.dumps({"widths": [p.shape[0] for n, p in policy.named_parameters() if n.endswith("weight")],
                          "depth": backend.depth, "has_value": backend.has_value, "typo": typo}))
    """, tmp_path)
    assert out["widths"] == [32, 32, 2, 1]  # pi_body, vf_body, pi_head, vf_head: the width its section says
    assert out["depth"] == 3 and out["has_value"]
    assert "rollout.my_backend.dept: unknown field" in out["typo"] and "'rollout.my_backend.depth'" in out["typo"]


@pytest.mark.parametrize("entry, why", [
    ({"loose": "rlf_test_options:Loose"}, "refuses unknown fields"),
    ({"lm": "rlf_test_options:MyPolicyOptions"}, "would be policy.lm, which is a field of policy already"),
    ({"my_policy": "rlf_test_options:Nope"}, "does not resolve"),
    ({"my_policy": "rlf_test_options:PolicyOptions.serves"}, "is not a policy options model"),
])
def test_an_options_model_that_would_weaken_the_schema_is_refused_when_it_loads(tmp_path, entry, why):
    _plugin_with_options(tmp_path, entry)
    out = _fresh("""
        try:
            import rlfabric.services.core.config
            print(json.dumps({"error": ""}))
        except RuntimeError as exc:
            print(json.dumps({"error": str(exc)}))
    """, tmp_path)
    assert out["error"].startswith(f"rlfabric.policy_options entry point {next(iter(entry))!r}")
    assert why in out["error"]
