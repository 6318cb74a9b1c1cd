"""The layering rules the code base keeps, checked on its source: algorithms are named only in their own files,
the shared runtime imports no service and names no policy family, one MLP builder, and no process-wide switch of
torch.distributions checks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rlfabric.services.core.algorithm import load_algorithms

SERVICES = Path(__file__).resolve().parents[2] / "services"
ALGORITHM_DIR = SERVICES / "learner" / "algorithms"


def _sources(root: Path = SERVICES) -> list[Path]:
    return [p for p in root.rglob("*.py") if "proto" not in p.relative_to(SERVICES).parts]


def test_no_file_outside_the_algorithm_specs_names_an_algorithm():
    names = sorted(load_algorithms())
    assert {"ppo", "sac", "iql", "bc"} <= set(names)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b", re.IGNORECASE)
    offenders = []
    for path in _sources():
        if ALGORITHM_DIR in path.parents:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(SERVICES.parent)}:{n}: {line.strip()}")
    assert not offenders, "algorithm names outside services/learner/algorithms/ (make it a spec field):\n" + \
        "\n".join(offenders)


def test_the_shared_runtime_imports_no_service_and_no_policy():
    """services/core is what every process shares: it names no service and no policy (a policy is one file of
    services/policies, found by its registered name)."""
    services = ("learner", "rollout", "env", "replay", "coordinator", "robot_gateway", "policies")
    offenders = []
    for path in _sources(SERVICES / "core"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {m}" for m in modules
                          if m.split(".")[:3] in [["rlfabric", "services", s] for s in services]]
    assert not offenders, offenders


def test_the_shared_runtime_names_no_policy_family_not_even_as_a_string():
    """rlfabric's model families (services/policies) reach core as any plug-in's do, by entry point: no module path
    of theirs in services/core (a built-in table, a lazy import), and none of their names (an options section, a
    path table keyed by policy, an error that lists them)."""
    from importlib.metadata import entry_points

    families = {ep.name for ep in entry_points(group="rlfabric.policies")
                if ep.value.startswith("rlfabric.services.policies.")}
    assert {"vla", "pi0", "vla_tokens", "vlm"} <= families
    named = re.compile(r"rlfabric\.services\.policies\b|\b(" + "|".join(sorted(families)) + r")\b")
    offenders = [f"{path.relative_to(SERVICES.parent)}:{n}: {line.strip()}"
                 for path in _sources(SERVICES / "core")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if named.search(line)]
    assert not offenders, "services/core names a policy of services/policies:\n" + "\n".join(offenders)


def test_one_mlp_builder_and_no_global_distribution_switch():
    builders = [str(p) for p in _sources() if re.search(r"^def _?mlp\(", p.read_text(), re.MULTILINE)]
    assert builders == [str(SERVICES / "core" / "models" / "mlp.py")]
    assert not [p for p in _sources() if "set_default_validate_args" in p.read_text()]


def test_every_algorithm_hyper_parameter_is_documented_where_it_is_declared():
    """What a user reads in the schema (and `rlfabric` errors quote): each field of every algorithm's config says
    what it does, inherited fields included."""
    missing = [f"{name}.{field}" for name, algo in sorted(load_algorithms().items())
               for field, info in algo.Config.model_fields.items() if field != "name" and not info.description]
    assert not missing, f"algorithm fields without a description: {missing}"
