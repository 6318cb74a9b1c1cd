"""Every pixel adapter the README documents, through `rlfabric train` under default settings (rollout.collector:
auto, the default policy and plan) and once with every service in its own process: a few iterations to exit 0.
These adapters once failed at rollout Configure ("no collector serves env.adapter 'mujoco_pixels'"), and the
default CNN once refused a 32x32 camera; no test ran them through a rollout worker.

Then a user's package, outside the repo, with one of each extension point (a policy and a backend with their own
options sections too), through every service."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

pytestmark = pytest.mark.minutes(2.0)  # on CI's 2 cores: the tiers start long files first

TOTAL_STEPS = 256
CASES = {  # adapter -> (env id, the package it needs, the extra that brings it)
    "mujoco_pixels": ("Reacher-v5", "mujoco", "robotics"),
    "robotics": ("FetchReach-v4", "gymnasium_robotics", "robotics"),
    "metaworld": ("reach-v3", "metaworld", "metaworld"),  # pins its own mujoco: not installed in CI
}


def _train(tmp_path, adapter: str, *sets: str) -> list[dict[str, str]]:
    env_id, package, extra = CASES[adapter]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"env.adapter {adapter} needs the {package} package, not installed here (pip install -e "
                    f"'.[{extra}]')")
    spec = {"name": f"smoke-{adapter}",
            "env": {"adapter": adapter, "id": env_id, "options": {"image_size": 32}, "num_envs": 2, "eval_envs": 2},
            "train": {"total_env_steps": TOTAL_STEPS, "eval_every_iterations": 0}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    args = [item for s in sets for item in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(config), "--run-dir", str(run_dir),
                           "--quiet", *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(csv.DictReader(open(run_dir / "metrics.csv")))


@pytest.mark.slow
@pytest.mark.parametrize("adapter", sorted(CASES))
def test_each_pixel_adapter_trains_under_default_settings(tmp_path, adapter):
    rows = _train(tmp_path, adapter)
    assert int(rows[-1]["env_steps"]) == TOTAL_STEPS and len(rows) >= 2
    assert rows[-1]["eval_return_mean"]  # the final evaluation ran through the same collector


@pytest.mark.slow
@pytest.mark.parametrize("adapter", sorted(CASES))
def test_each_pixel_adapter_trains_with_every_service_in_its_own_process(tmp_path, adapter):
    """The env service steps the adapter, the rollout worker acts with the collector the adapter declares."""
    rows = _train(tmp_path, adapter, "scheduling.mode=disaggregated")
    assert int(rows[-1]["env_steps"]) == TOTAL_STEPS and len(rows) >= 2


PLUGIN = {  # a user's package, outside the repo: one of each extension point, registered by entry points only
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "rlf-smoke-plugin"
        version = "0.1"

        [tool.setuptools]
        packages = ["rlf_smoke_plugin"]

        [project.entry-points."rlfabric.env_adapters"]
        plug_env = "rlf_smoke_plugin.env"

        [project.entry-points."rlfabric.collectors"]
        plug_gym = "rlf_smoke_plugin.parts:PlugCollector"

        [project.entry-points."rlfabric.backends"]
        plug_torch = "rlf_smoke_plugin.parts:PlugBackend"

        [project.entry-points."rlfabric.tasks"]
        plug_task = "rlf_smoke_plugin.parts:PlugTask"

        [project.entry-points."rlfabric.rewards"]
        plug_half = "rlf_smoke_plugin.parts:half"

        [project.entry-points."rlfabric.policies"]
        my_policy = "rlf_smoke_plugin.policy:MyPolicy"

        [project.entry-points."rlfabric.policy_options"]
        my_policy = "rlf_smoke_plugin.options:MyPolicyOptions"

        [project.entry-points."rlfabric.backend_options"]
        plug_torch = "rlf_smoke_plugin.options:PlugTorchOptions"
    """,
    "rlf_smoke_plugin/__init__.py": """
        import os

        def mark(what):
            with open(os.environ["RLF_SMOKE_MARKS"], "a") as f:
                f.write(f"{what} {os.getpid()}\\n")
    """,
    "rlf_smoke_plugin/env.py": """
        from rlfabric.services.env.adapters import gymnasium as _gym
        from rlf_smoke_plugin import mark

        collector = "plug_gym"

        def check(env_cfg):
            _gym.check(env_cfg)

        def make_vector_env(env_cfg, num_envs, vectorization="sync"):
            mark("adapter")
            return _gym.make_vector_env(env_cfg, num_envs, vectorization)
    """,
    "rlf_smoke_plugin/parts.py": """
        from rlfabric.services.env.tasks.arith import ArithTask
        from rlfabric.services.rollout.backends.torch import TorchBackend
        from rlfabric.services.rollout.collectors.gym import GymCollector
        from rlf_smoke_plugin import mark

        class PlugCollector(GymCollector):
            def __init__(self, *args, **kwargs):
                mark("collector")
                super().__init__(*args, **kwargs)

        class PlugBackend(TorchBackend):
            def __init__(self, config, *args, **kwargs):
                mark("backend")
                mark(f"backend_tag={config.rollout.plug_torch.tag}")  # its own section, rollout.plug_torch
                super().__init__(config, *args, **kwargs)

        class PlugTask(ArithTask):
            def __init__(self, *args, **kwargs):
                mark("task")
                super().__init__(*args, **kwargs)

        def half(prompt, completion, answer, **fields):
            # 0.5, or a data-set row's own "weight"; marks the process it scores in (a reward pool worker)
            mark("reward")
            return float(fields.get("weight", 0.5))
    """,
    "rlf_smoke_plugin/options.py": """
        # torch-free: the coordinator validates every spec with these, and never imports a policy
        from typing import ClassVar

        from pydantic import Field

        from rlfabric.services.core.options import BackendOptions, PolicyOptions

        class MyPolicyOptions(PolicyOptions):
            \"\"\"An actor-critic MLP whose hidden layers are all one width.\"\"\"

            serves: ClassVar[str | None] = "actor_critic"
            width: int = Field(64, ge=1, le=4096, description="units of every hidden layer")
            layers: int = Field(2, ge=1, le=8, description="hidden layers of the actor and of the critic")

        class PlugTorchOptions(BackendOptions):
            tag: str = Field("", max_length=32, description="marked where the backend is built")
    """,
    "rlf_smoke_plugin/policy.py": """
        from rlfabric.services.core.models.actor_critic import ActorCritic
        from rlf_smoke_plugin import mark

        class MyPolicy(ActorCritic):
            serves = "actor_critic"

            def __init__(self, obs_space, action_space, cfg):
                own = cfg.my_policy  # its own section, policy.my_policy
                mark(f"policy_width={own.width}")
                super().__init__(obs_space, action_space,
                                 cfg.model_copy(update={"hidden_sizes": [own.width] * own.layers}))
    """,
}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The package installed with ``pip install -e`` into a folder of its own (not the shared environment), which
    the services see through PYTHONPATH as they would see site-packages."""
    root = tmp_path_factory.mktemp("plugin")
    for name, text in PLUGIN.items():
        (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "src" / name).write_text(textwrap.dedent(text).lstrip())
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                           "--no-index", "--target", str(root / "site"), "-e", str(root / "src")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((root / "site").glob("rlf_smoke_plugin-0.1.dist-info/entry_points.txt"))
    return root


def _plugin_env(plugin, marks) -> dict[str, str]:
    """The environment of a process (and the services it starts) that sees the plug-in as installed."""
    return dict(os.environ, RLF_SMOKE_MARKS=str(marks),
                PYTHONPATH=os.pathsep.join([str(plugin / "site"), str(plugin / "src"), os.environ.get("PYTHONPATH", "")]))


def _cli_train(plugin, tmp_path, spec: dict, *sets: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(spec))
    args = [item for s in sets for item in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "train", str(config), "--run-dir",
                           str(tmp_path / "run"), "--quiet", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=_plugin_env(plugin, tmp_path / "marks"))


def _train_with(plugin, tmp_path, spec: dict, *sets: str) -> tuple[list[dict[str, str]], list[str]]:
    proc = _cli_train(plugin, tmp_path, spec, *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(csv.DictReader(open(tmp_path / "run" / "metrics.csv"))), (tmp_path / "marks").read_text().split("\n")


@pytest.mark.slow
def test_a_plugin_packages_adapter_collector_and_backend_run_through_every_service(plugin, tmp_path):
    spec = {"name": "plugin-gym", "env": {"adapter": "plug_env", "id": "CartPole-v1", "num_envs": 4, "eval_envs": 2},
            "rollout": {"backend": "plug_torch", "plug_torch": {"tag": "t7"}},
            "algorithm": {"name": "ppo", "n_steps": 16, "batch_size": 64, "n_epochs": 1},
            "train": {"total_env_steps": 128, "eval_every_iterations": 0, "eval_episodes": 2}}
    rows, marks = _train_with(plugin, tmp_path, spec, "scheduling.mode=disaggregated")
    assert int(rows[-1]["env_steps"]) == 128
    by_part = {line.split()[0]: line.split()[1] for line in marks if line}
    assert {"adapter", "collector", "backend", "backend_tag=t7"} <= set(by_part)  # its options section, read
    assert by_part["adapter"] != by_part["collector"] == by_part["backend"]  # env service vs rollout worker


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["plug_half", "rlf_smoke_plugin.parts:half"])
def test_a_plugin_packages_text_task_and_reward_score_every_sample(plugin, tmp_path, reward):
    spec = {"name": "plugin-text", "seed": 0,
            "env": {"adapter": "text", "id": "plug_task", "num_envs": 16, "eval_envs": 8,
                    "options": {"group_size": 4, "reward": reward}, "eval_options": {"group_size": 1}},
            "policy": {"lm": {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "layers": 1, "heads": 2,
                              "max_positions": 64}},
            "rollout": {"backend": "hf", "max_new_tokens": 4},
            "algorithm": {"name": "grpo", "minibatch_size": 16, "epochs": 1},
            "train": {"total_env_steps": 32, "eval_every_iterations": 0, "eval_episodes": 8}}
    rows, marks = _train_with(plugin, tmp_path, spec)
    assert [float(r["train_return_mean"]) for r in rows if r["train_return_mean"]] == [0.5, 0.5]
    assert float(rows[-1]["eval_return_mean"]) == 0.5 and any(m.startswith("task ") for m in marks)
    by_part = {}
    for line in filter(None, marks):
        by_part.setdefault(line.split()[0], set()).add(line.split()[1])
    assert by_part["reward"] and not by_part["reward"] & by_part["task"]  # rewards score in the pool's workers


@pytest.mark.slow
def test_a_plugin_packages_reward_scores_a_jsonl_data_set_through_every_service(plugin, tmp_path):
    """Config only: the data-set task reads a JSONL file, the plug-in's entry-point reward gets each row's other
    fields (its "weight") in the env service's reward pool."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} plus 2?", "answer": f"#### {i + 2}",
                                        "weight": 0.25}) + "\n" for i in range(40)))
    spec = {"name": "plugin-dataset", "seed": 0,
            "env": {"adapter": "text", "id": "dataset", "num_envs": 8, "eval_envs": 4,
                    "options": {"path": str(data), "prompt_field": "question", "reward": "plug_half",
                                "group_size": 4, "template": "Q: {prompt} A:"},
                    "eval_options": {"split": "held_out", "group_size": 1}},
            "policy": {"lm": {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "layers": 1, "heads": 2,
                              "max_positions": 64}},
            "rollout": {"backend": "hf", "max_new_tokens": 4},
            "algorithm": {"name": "grpo", "minibatch_size": 8, "epochs": 1},
            "train": {"total_env_steps": 16, "eval_every_iterations": 0, "eval_episodes": 4}}
    rows, marks = _train_with(plugin, tmp_path, spec, "scheduling.mode=disaggregated")
    assert int(rows[-1]["env_steps"]) == 16
    assert [float(r["train_return_mean"]) for r in rows if r["train_return_mean"]] == [0.25, 0.25]
    assert float(rows[-1]["eval_return_mean"]) == 0.25
    assert any(m.startswith("reward ") for m in marks)


# The acceptance: a policy from a package outside the repo, with its own options section (policy.my_policy),
# solves CartPole-v1 (deterministic eval >= 475) through `rlfabric train` and through a client's submit to a served
# stack, on the hyper-parameters of examples/cartpole_ppo.yaml (seed 0 gets there at 5120 env steps: seconds).
PLUGIN_POLICY_SPEC = {**yaml.safe_load(open("examples/cartpole_ppo.yaml")), "name": "plugin-policy",
                      "policy": {"name": "my_policy", "my_policy": {"width": 32}}}


def _solved(rows: list[dict[str, str]], marks: list[str]) -> None:
    evals = [float(r["eval_return_mean"]) for r in rows if r["eval_return_mean"]]
    assert evals and evals[-1] >= 475, evals
    built = {line.split()[1] for line in marks if line.startswith("policy_width=32 ")}
    assert len(built) >= 2, marks  # the learner and the rollout worker each built it from policy.my_policy
    assert not [line for line in marks if line.startswith("policy_width=") and not line.startswith("policy_width=32 ")]


def test_a_plugin_policy_with_its_own_options_solves_cartpole_through_rlfabric_train(plugin, tmp_path):
    rows, marks = _train_with(plugin, tmp_path, PLUGIN_POLICY_SPEC)
    _solved(rows, marks)


def test_a_plugin_policy_with_its_own_options_solves_cartpole_submitted_to_rlfabric_up(plugin, tmp_path):
    import grpc

    from rlfabric.services.coordinator.client import CoordinatorClient
    from rlfabric.services.core.proto.rlfabric.v1 import coordinator_pb2

    marks, runs = tmp_path / "marks", tmp_path / "runs"
    up = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", "up", "--runs-root", str(runs)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                          env=_plugin_env(plugin, marks))
    try:
        address = up.stdout.readline().strip()
        with CoordinatorClient(address, token_file=str(runs / ".rlfabric" / "token")) as client:
            client.wait_ready(60)
            deadline = time.monotonic() + 90
            while len([w for w in client.workers() if w.alive]) < 4:
                assert time.monotonic() < deadline and up.poll() is None, up.stderr.read()[-3000:]
                time.sleep(0.2)
            typo = yaml.safe_dump({**PLUGIN_POLICY_SPEC, "policy": {"name": "my_policy", "my_policy": {"widht": 32}}})
            with pytest.raises(grpc.RpcError) as refused:  # the coordinator validates with the plug-in's section
                client.submit(typo)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "policy.my_policy.widht: unknown field" in refused.value.details()
            status = client.wait(client.submit(yaml.safe_dump(PLUGIN_POLICY_SPEC)).run_id)
            assert status.state == coordinator_pb2.SUCCEEDED, status.reason
            rows = list(csv.DictReader(open(os.path.join(status.run_dir, "metrics.csv"))))
        _solved(rows, marks.read_text().split("\n"))
    finally:
        up.terminate()
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def test_a_misspelled_option_of_a_plugin_policy_exits_2_naming_the_field(plugin, tmp_path):
    spec = {**PLUGIN_POLICY_SPEC, "policy": {"name": "my_policy", "my_policy": {"widht": 32}}}
    proc = _cli_train(plugin, tmp_path, spec)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "policy.my_policy.widht: unknown field" in proc.stderr
    assert "did you mean 'policy.my_policy.width'?" in proc.stderr
    assert not (tmp_path / "marks").exists()  # refused before any service started
