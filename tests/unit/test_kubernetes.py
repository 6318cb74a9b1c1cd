"""deploy/kubernetes, checked offline (no cluster runs in CI): the kustomization rendered here as kubectl would
build it, every document validated against the Kubernetes schemas in strict mode, and the manifests checked
against what the services need: the flags `rlfabric serve` takes, compose's choices, ports, probes, secrets, the
peers each role must let in, and the GPU overlay."""

from __future__ import annotations

import base64
import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from rlfabric.services.core import certs, healthcheck
from tests.serve_flags import service_flags

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
DOCS = ROOT / "docs" / "deployment.md"
KUBERNETES_VERSION = "1.37.0"  # the newest schemas kubernetes-validate ships
NAMESPACE = "rlfabric"
RLFABRIC = ("coordinator", "env", "replay", "learner", "rollout")
BACKING = ("redis", "minio")
GPU_ROLES = ("learner", "rollout")
SECRET_VARIABLES = {"RLFABRIC_TOKEN", "RLFABRIC_S3_ACCESS_KEY", "RLFABRIC_S3_SECRET_KEY", "RLFABRIC_REDIS_PASSWORD"}
# What the manifests set beyond compose, and why: the node's memory is not the pod's (see replay.yaml).
BEYOND_COMPOSE = {"replay": {"RLFABRIC_MAX_MEMORY_BYTES"}}
HEALTHCHECK = ["python", "-m", "rlfabric.services.core.healthcheck"]


# -- the renderer: what `kubectl kustomize` makes of the fields deploy/kubernetes uses, and nothing else ----------

class Unsupported(ValueError):
    """A kustomization field, option or kind this renderer does not implement: teach it before using it, or the
    documents it would change go unvalidated."""


KUSTOMIZATION = ("kustomize.config.k8s.io/v1beta1", "Kustomization")
FIELDS = {"apiVersion", "kind", "resources", "namespace", "secretGenerator", "generatorOptions", "patches", "images"}
# The namespace transformer sets metadata.namespace on these and renames a v1 Namespace; kinds it rewrites more
# of (RoleBinding subjects, webhooks, ...) are refused.
NAMESPACED = {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim", "NetworkPolicy", "Secret", "ConfigMap"}
CLUSTER_SCOPED = {"Namespace"}
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")  # kustomize's IsEnvVarName


def render(directory: Path) -> list[dict]:
    """The documents `kubectl apply -k directory` would apply (without kustomize's ordering)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if unknown := set(spec) - FIELDS:
        raise Unsupported(f"{directory}: kustomization fields {sorted(unknown)}")
    if (spec.get("apiVersion"), spec.get("kind")) != KUSTOMIZATION:
        raise Unsupported(f"{directory}: not a {KUSTOMIZATION}")
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs += render(path)
        elif path.is_file():
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        else:
            raise Unsupported(f"{directory}: resource {entry!r} is neither a file nor a directory here")
    docs += _generate_secrets(directory, spec.get("secretGenerator", []), spec.get("generatorOptions", {}))
    for kind in {d.get("kind") for d in docs} - NAMESPACED - CLUSTER_SCOPED:
        raise Unsupported(f"{directory}: kind {kind!r}")
    for patch in spec.get("patches", []):  # kustomize's order: patches, namespace, images
        _apply_patch(directory, docs, patch)
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] == "Namespace":
                doc["metadata"]["name"] = spec["namespace"]
            else:
                doc["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        _set_image(docs, image)
    return docs


def _generate_secrets(directory: Path, generators: list, options: dict) -> list[dict]:
    if set(options) - {"disableNameSuffixHash"}:
        raise Unsupported(f"generatorOptions {sorted(set(options) - {'disableNameSuffixHash'})}")
    if generators and options.get("disableNameSuffixHash") is not True:
        # a hash suffix renames the Secret and every reference to it: not implemented here
        raise Unsupported("secretGenerator without generatorOptions.disableNameSuffixHash: true")
    secrets = []
    for gen in generators:
        if unknown := set(gen) - {"name", "envs", "files"}:
            raise Unsupported(f"secretGenerator {gen.get('name')!r}: fields {sorted(unknown)}")
        data: dict[str, bytes] = {}
        for env_file in gen.get("envs", []):
            data |= {k: v.encode() for k, v in _env_file(directory / env_file).items()}
        for source in gen.get("files", []):
            key, _, path = source.rpartition("=") if "=" in source else (Path(source).name, "", source)
            data[key] = (directory / path).read_bytes()
        secrets.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]}, "type": "Opaque",
                        "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})
    return secrets


def _env_file(path: Path) -> dict[str, str]:
    """kustomize's env-file rules: leading blanks dropped, blank and # lines skipped, KEY=VALUE split at the first
    `=`, the value taken as written (no unquoting)."""
    pairs = {}
    for number, line in enumerate(path.read_text().split("\n")):
        line = line.removesuffix("\r").removeprefix("\ufeff" if number == 0 else "").lstrip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:  # kustomize versions differ here (the process environment, or empty)
            raise Unsupported(f"{path}:{number + 1}: a line without '='")
        key, value = line.split("=", 1)
        if not ENV_NAME.match(key):
            raise ValueError(f"{path}:{number + 1}: {key!r} is not a variable name")
        pairs[key] = value
    return pairs


def _apply_patch(directory: Path, docs: list[dict], patch: dict) -> None:
    if set(patch) - {"target", "patch", "path"} or set(patch.get("target", {})) - {"kind", "name"}:
        raise Unsupported(f"patch fields {patch}: only a JSON6902 patch with a target of kind and name")
    target = patch.get("target")
    ops = yaml.safe_load(patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text())
    if not target or not isinstance(ops, list):
        raise Unsupported(f"patch {patch}: a strategic-merge patch (only JSON6902 is implemented)")
    matched = [d for d in docs if d.get("kind") == target.get("kind", d.get("kind"))
               and d["metadata"].get("name") == target.get("name", d["metadata"].get("name"))]
    if not matched:
        raise ValueError(f"patch target {target} matches no document")
    for doc in matched:
        for op in ops:
            _json6902(doc, op)


def _json6902(doc: dict, op: dict) -> None:
    """RFC 6902 add and replace (RFC 6901 pointers)."""
    if op.get("op") not in ("add", "replace") or set(op) != {"op", "path", "value"}:
        raise Unsupported(f"JSON6902 operation {op}: only add and replace")
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op["op"] == "add":
            node.insert(index, op["value"])
        else:
            node[index] = op["value"]
    else:
        if op["op"] == "replace" and last not in node:
            raise ValueError(f"replace {op['path']}: no such member")
        node[last] = op["value"]


def _set_image(docs: list[dict], image: dict) -> None:
    if set(image) - {"name", "newName", "newTag", "digest"}:
        raise Unsupported(f"images entry {image}")
    for container in (c for d in docs for c in _containers(d, init=True)):
        name, digest = container["image"].partition("@")[::2]
        name, tag = (name.rsplit(":", 1) if ":" in name.rsplit("/", 1)[-1] else (name, ""))  # (a registry's port)
        if name != image["name"]:
            continue
        suffix = f"@{image['digest']}" if "digest" in image else f":{image['newTag']}" if "newTag" in image \
            else f":{tag}" * bool(tag) + f"@{digest}" * bool(digest)
        container["image"] = image.get("newName", name) + suffix


# -- helpers ---------------------------------------------------------------------------------------------------

def _containers(doc: dict, init: bool = False) -> list[dict]:
    if doc.get("kind") not in ("Deployment", "StatefulSet"):
        return []
    pod = doc["spec"]["template"]["spec"]
    return [*(pod.get("initContainers", []) if init else []), *pod["containers"]]


def _find(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} documents"
    return found[0]


def _main(docs: list[dict], role: str) -> dict:
    (container,) = _find(docs, "Deployment", role)["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, object]:
    """name -> value, or ("secret", secret name, key) for a secretKeyRef."""
    out = {}
    for var in container.get("env", []):
        assert set(var) in ({"name", "value"}, {"name", "valueFrom"}), var
        if "value" in var:
            out[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            out[var["name"]] = ("secret", ref["name"], ref["key"])
    assert len(out) == len(container.get("env", [])), f"{container['name']}: a variable set twice"
    return out


def _selects(selector: dict, labels: dict) -> bool:
    if set(selector) - {"matchLabels"}:
        raise Unsupported(f"selector {selector}: matchLabels only")
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pods(docs: list[dict]) -> dict[str, dict]:
    """Deployment name -> its pod template."""
    return {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] == "Deployment"}


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _health_address(command: list[str], monkeypatch) -> str:
    """The address a health-check command asks, parsed by the health check's own main (its real flags)."""
    assert command[:3] == HEALTHCHECK, command
    asked = []

    def check(address: str, timeout_s: float = 3.0, service: str = "") -> tuple[bool, str]:
        asked.append(address)
        return True, f"{address}: SERVING"

    monkeypatch.setattr(healthcheck, "check", check)
    assert healthcheck.main(command[3:]) == 0
    return asked[0]


def _quantity(text: object, kind: str) -> float:
    text = str(text)
    if kind == "cpu" and (m := re.fullmatch(r"(\d+)(m?)", text)):
        return int(m[1]) / (1000 if m[2] else 1)
    if kind == "memory" and (m := re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)):
        return int(m[1]) * {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, None: 1}[m[2]]
    raise ValueError(f"{kind} quantity {text!r}")


def _docs_kubernetes_section() -> str:
    text = DOCS.read_text()
    start = text.index("\n## Kubernetes\n")
    return text[start:text.index("\n## ", start + 1)]


def _docs_command(prefix: str) -> list[str]:
    """The one command of the docs' Kubernetes section that starts with ``prefix``, as argv."""
    lines = [line.strip() for line in _docs_kubernetes_section().splitlines() if line.strip().startswith(prefix)]
    assert len(lines) == 1, f"docs/deployment.md, Kubernetes: {len(lines)} lines start with {prefix!r}"
    return shlex.split(lines[0])


# -- fixtures: the tree as the operator has it after the one-time steps, rendered ----------------------------

TEST_CREDENTIALS = {name: f"k8s-test-{name.lower()}-0123456789" for name in SECRET_VARIABLES}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of deploy/kubernetes with credentials.env filled from the example and tls/ made by the docs'
    `rlfabric certs` command (a developer's real secret files are left behind)."""
    from rlfabric.services.cli import build_parser, cmd_certs

    root = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(BASE, root, ignore=lambda _d, names: [n for n in names if n in ("credentials.env", "tls")])
    example = (root / "credentials.env.example").read_text()
    filled = re.sub(r"^(\w+)=$", lambda m: f"{m[1]}={TEST_CREDENTIALS[m[1]]}", example, flags=re.M)
    (root / "credentials.env").write_text(filled)
    argv = _docs_command("rlfabric certs")
    args = build_parser().parse_args(argv[1:])  # the command's real flags
    assert Path(args.out_dir) == Path("deploy/kubernetes/tls")
    args.out_dir, args.ca_key_dir = str(root / "tls"), str(root.parent / "ca-key")
    assert cmd_certs(args) == 0
    return root


@pytest.fixture(scope="module")
def base(tree) -> list[dict]:
    return render(tree)


@pytest.fixture(scope="module")
def gpu(tree) -> list[dict]:
    return render(tree / "overlays" / "gpu")


@pytest.fixture(scope="module")
def ranks(tree) -> list[dict]:
    return render(tree / "overlays" / "learner-ranks")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# -- the renderer refuses what it does not implement ----------------------------------------------------------

@pytest.mark.parametrize("edit", [
    lambda k: k.update(commonLabels={"a": "b"}),
    lambda k: k.update(configMapGenerator=[{"name": "x", "literals": ["a=b"]}]),
    lambda k: k.pop("generatorOptions"),
    lambda k: k["secretGenerator"][0].update(behavior="merge"),
    lambda k: k.update(patches=[{"target": {"kind": "Deployment", "name": "env"},
                                 "patch": "- {op: remove, path: /spec/replicas}"}]),
    lambda k: k.update(patches=[{"target": {"kind": "Deployment", "labelSelector": "a=b"},
                                 "patch": "- {op: add, path: /spec/replicas, value: 2}"}]),
    lambda k: k.update(patches=[{"target": {"kind": "Deployment", "name": "env"},
                                 "patch": "spec: {replicas: 2}"}]),
], ids=["commonLabels", "configMapGenerator", "name-hash", "generator-behavior", "remove-op", "label-target",
        "strategic-merge"])
def test_renderer_refuses_fields_it_does_not_implement(tree, tmp_path, edit):
    copy_dir = tmp_path / "kubernetes"
    shutil.copytree(tree, copy_dir)
    spec = yaml.safe_load((copy_dir / "kustomization.yaml").read_text())
    edit(spec)
    (copy_dir / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(Unsupported):
        render(copy_dir)


def test_renderer_refuses_kinds_whose_namespacing_it_does_not_implement(tree, tmp_path):
    copy_dir = tmp_path / "kubernetes"
    shutil.copytree(tree, copy_dir)
    (copy_dir / "binding.yaml").write_text(yaml.safe_dump({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "x"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "x"}}))
    spec = yaml.safe_load((copy_dir / "kustomization.yaml").read_text())
    spec["resources"].append("binding.yaml")
    (copy_dir / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(Unsupported, match="RoleBinding"):
        render(copy_dir)


def test_env_file_rules_are_kustomizes(tmp_path):
    path = tmp_path / "x.env"
    path.write_text("\ufeffA=1\n  # comment\n\n  B=two=2\r\nC=\"quoted\"\nD=\n")
    assert _env_file(path) == {"A": "1", "B": "two=2", "C": '"quoted"', "D": ""}
    path.write_text("A=1\nB\n")
    with pytest.raises(Unsupported):
        _env_file(path)


# -- schemas ---------------------------------------------------------------------------------------------------

def test_every_document_validates_against_the_kubernetes_schemas_strictly(base, gpu, ranks):
    for doc in [*base, *gpu, *ranks]:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # The same call must refuse an unknown field and a mistyped one, or the loop above proves nothing.
    broken = copy.deepcopy(_find(base, "Deployment", "learner"))
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(_find(base, "Service", "env"))
    broken["spec"]["ports"][0]["port"] = "50052"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_base_holds_each_service_its_claims_and_secrets_in_one_namespace(base):
    names = {(d["kind"], d["metadata"]["name"]) for d in base}
    assert len(names) == len(base), "a document twice"
    for role in (*RLFABRIC, *BACKING):
        assert ("Deployment", role) in names and ("Service", role) in names
    assert {n for k, n in names if k == "Deployment"} == {*RLFABRIC, *BACKING}
    assert {n for k, n in names if k == "PersistentVolumeClaim"} == {"redis-data", "minio-data", "coordinator-runs"}
    assert {n for k, n in names if k == "Secret"} == {"rlfabric-credentials", "rlfabric-tls"}
    assert {n for k, n in names if k == "Namespace"} == {NAMESPACE}
    assert all(d["metadata"].get("namespace") == NAMESPACE for d in base if d["kind"] != "Namespace")
    for role in (*RLFABRIC, *BACKING):  # one pod per advertised name, and never two at once
        deployment = _find(base, "Deployment", role)
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
        assert deployment["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": role}


# -- the rlfabric services: compose's choices, the flags serve takes --------------------------------------------

def _compose_env(service: dict) -> dict[str, object]:
    """compose's environment in _env's terms: a required ${VAR:?} is a Secret key, ${VAR:-x} its default."""
    out = {}
    for name, value in service["environment"].items():
        if m := re.fullmatch(r"\$\{(\w+):\?[^}]*\}", str(value)):
            out[name] = ("secret", "rlfabric-credentials", m[1])
        elif m := re.fullmatch(r"\$\{\w+:-([^}]*)\}", str(value)):
            out[name] = m[1]
        else:
            assert "$" not in str(value), (name, value)
            out[name] = str(value)
    return out


def test_rlfabric_containers_make_composes_choices(base, compose):
    image = re.fullmatch(r"\$\{\w+:-([^}]*)\}", compose["x-rlfabric"]["image"])[1]
    for role in RLFABRIC:
        container = _main(base, role)
        assert container["image"] == image and container["args"] == ["serve", role]
        env = _env(container)
        expected = _compose_env(compose["services"][role])
        extra = set(env) - set(expected)
        assert extra == BEYOND_COMPOSE.get(role, set()), f"{role}: {sorted(extra)} beyond compose"
        assert {k: env[k] for k in expected} == expected, role
        assert env["RLFABRIC_ADVERTISE_HOST"] == role and env["RLFABRIC_HOST"] == "0.0.0.0"


def test_rlfabric_variables_are_flags_of_rlfabric_serve(base):
    for role in RLFABRIC:
        names = {k for k in _env(_main(base, role)) if k.startswith("RLFABRIC_")} - SECRET_VARIABLES
        unknown = names - service_flags(role)
        assert not unknown, f"{role}: {sorted(unknown)} are not flags of `rlfabric serve {role}`"
        for init in _find(base, "Deployment", role)["spec"]["template"]["spec"].get("initContainers", []):
            # a client: the token and the TLS files, which the health check reads
            assert set(_env(init)) <= {"RLFABRIC_TOKEN", "RLFABRIC_TLS_CERT", "RLFABRIC_TLS_KEY", "RLFABRIC_TLS_CA"}
            assert _env(init) == {k: _env(_main(base, role))[k] for k in _env(init)}


def test_ports_services_and_probes_agree(base, monkeypatch):
    pods = _pods(base)
    for role in RLFABRIC:
        container = _main(base, role)
        env = _env(container)
        assert _ports(container) == {"grpc": int(env["RLFABRIC_PORT"]), "metrics": int(env["RLFABRIC_METRICS_PORT"])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # the container's own gRPC port, on loopback: the Service would wait on the readiness it decides
            assert _health_address(container[probe]["exec"]["command"], monkeypatch) == \
                f"127.0.0.1:{env['RLFABRIC_PORT']}", (role, probe)
        if role != "coordinator":  # the init container waits on the coordinator the worker registers with
            (init,) = _find(base, "Deployment", role)["spec"]["template"]["spec"]["initContainers"]
            loop = re.fullmatch(r"until (.+); do sleep \d+; done", init["command"][2])
            assert init["command"][:2] == ["sh", "-c"] and loop, init["command"]
            assert _health_address(shlex.split(loop[1]), monkeypatch) == env["RLFABRIC_COORDINATOR"]
            assert init["image"] == container["image"]
    for service in (d for d in base if d["kind"] == "Service"):
        selected = [name for name, pod in pods.items() if _selects({"matchLabels": service["spec"]["selector"]},
                                                                    pod["metadata"]["labels"])]
        assert selected == [service["metadata"]["name"]], (service["metadata"]["name"], selected)
        ports = _ports(_main(base, selected[0]))
        for port in service["spec"]["ports"]:  # a port the pod exposes, under compose's number
            target = ports.get(port["targetPort"]) if isinstance(port["targetPort"], str) else port["targetPort"]
            assert target in ports.values() and target == port["port"], (service["metadata"]["name"], port)
    for role in RLFABRIC:  # workers' random data-plane ports: their names resolve to the pod itself
        spec = _find(base, "Service", role)["spec"]
        headless = spec.get("clusterIP") == "None" and spec.get("publishNotReadyAddresses") is True
        assert headless == (role != "coordinator"), role


def test_the_services_certificate_holds_every_name_dialled(tree, base):
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tree / "tls" / "server.pem").read_bytes())
    names = set(map(str, cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                    .get_values_for_type(x509.DNSName)))
    names |= {str(ip) for ip in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
              .get_values_for_type(x509.IPAddress)}
    dialled = {"127.0.0.1", "localhost"}  # the probes; clients through `kubectl port-forward`
    for role in RLFABRIC:
        env = _env(_main(base, role))
        dialled |= {env["RLFABRIC_ADVERTISE_HOST"], env.get("RLFABRIC_COORDINATOR", "x:0").rpartition(":")[0]}
    dialled.discard("x")
    assert dialled <= names, sorted(dialled - names)


def test_docs_build_and_load_the_image_the_manifests_name(base):
    build = _docs_command("docker build -f compose/Dockerfile")
    tag = build[build.index("-t") + 1]
    assert _docs_command("kind load docker-image")[3] == tag
    assert {c["image"] for role in RLFABRIC for c in _containers(_find(base, "Deployment", role), init=True)} == {tag}
    assert any(line.strip() == "kubectl apply -k deploy/kubernetes" for line in _docs_kubernetes_section().splitlines())


# -- secrets ---------------------------------------------------------------------------------------------------

def test_secrets_reach_exactly_the_containers_compose_gives_them_to(base, tree):
    secrets = {d["metadata"]["name"]: d for d in base if d["kind"] == "Secret"}
    credentials = {k: base64.b64decode(v).decode() for k, v in secrets["rlfabric-credentials"]["data"].items()}
    assert credentials == TEST_CREDENTIALS  # the example names every key the manifests read, and no other
    assert set(secrets["rlfabric-tls"]["data"]) == {"ca.pem", "server.pem", "server.key"}
    assert set(secrets["rlfabric-tls"]["data"]) <= set(certs.FILES) - {"ca.key"}  # what `rlfabric certs` writes
    holders: dict[str, set[str]] = {}
    for doc in base:
        for container in _containers(doc, init=True):
            for value in _env(container).values():
                if isinstance(value, tuple):
                    _, secret, key = value
                    assert key in (secrets[secret]["data"]), (container["name"], secret, key)
                    holders.setdefault(key, set()).add(doc["metadata"]["name"])
    assert holders["RLFABRIC_TOKEN"] == set(RLFABRIC)
    assert holders["RLFABRIC_REDIS_PASSWORD"] == {"replay", "redis"}
    assert holders["RLFABRIC_S3_ACCESS_KEY"] == holders["RLFABRIC_S3_SECRET_KEY"] == \
        {"replay", "learner", "rollout", "minio"}
    for name, pod in _pods(base).items():
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for volume in volumes.values():
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
                assert volume["secret"]["defaultMode"] & 0o137 == 0, (name, oct(volume["secret"]["defaultMode"]))
        for container in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            for mount in container.get("volumeMounts", []):
                if "secret" in volumes[mount["name"]]:
                    assert mount.get("readOnly") is True, (name, mount)
        if name in RLFABRIC:
            assert volumes["tls"]["secret"] == {"secretName": "rlfabric-tls", "defaultMode": 0o440}


def test_git_ignores_the_operators_secret_files():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    assert ignored("deploy/kubernetes/credentials.env") and ignored("deploy/kubernetes/tls/server.key")
    assert not ignored("deploy/kubernetes/credentials.env.example")
    tracked = subprocess.run(["git", "ls-files", "deploy/kubernetes"], cwd=ROOT, capture_output=True, text=True)
    assert not [p for p in tracked.stdout.split() if p.endswith("credentials.env") or "/tls/" in p]


# -- pods: non-root as the image, resources, data ----------------------------------------------------------------

def test_pods_run_as_the_images_user_and_meet_the_restricted_pod_security_level(base):
    uid = int(re.search(r"^RUN useradd .*--uid (\d+)", DOCKERFILE.read_text(), re.M)[1])
    namespace = _find(base, "Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name, pod in _pods(base).items():
        spec = pod["spec"]
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        if name in RLFABRIC:
            assert context["runAsUser"] == context["fsGroup"] == uid, name
        assert spec["automountServiceAccountToken"] is False
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
        assert all(set(v) & {"secret", "emptyDir", "persistentVolumeClaim"} for v in spec.get("volumes", []))
        for container in spec.get("initContainers", []) + spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert not sc.get("privileged") and not any("hostPort" in p for p in container.get("ports", []))


def test_every_container_has_requests_within_limits(base, gpu, ranks):
    for doc in [*base, *gpu, *ranks]:
        for container in _containers(doc, init=True):
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                request = _quantity(resources["requests"][kind], kind)
                assert 0 < request <= _quantity(resources["limits"][kind], kind), (container["name"], kind)
    replay = _main(base, "replay")  # a memory replay's bound, not the node's half, inside the pod's limit
    limit = _quantity(replay["resources"]["limits"]["memory"], "memory")
    assert 0 < int(_env(replay)["RLFABRIC_MAX_MEMORY_BYTES"]) <= limit / 2


def test_redis_minio_and_runs_keep_their_data_in_claims(base):
    workdir = re.search(r"^WORKDIR (\S+)", DOCKERFILE.read_text(), re.M)[1]
    claims = {d["metadata"]["name"] for d in base if d["kind"] == "PersistentVolumeClaim"}
    runs_root = _env(_main(base, "coordinator"))["RLFABRIC_RUNS_ROOT"]
    for role, claim, path in (("redis", "redis-data", "/data"), ("minio", "minio-data", "/data"),
                              ("coordinator", "coordinator-runs", f"{workdir}/{runs_root}")):
        pod = _pods(base)[role]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in pod["containers"][0]["volumeMounts"]}
        assert mounted[path].get("persistentVolumeClaim", {}).get("claimName") == claim, role
    used = {v["persistentVolumeClaim"]["claimName"] for p in _pods(base).values() for v in p["spec"].get("volumes", [])
            if "persistentVolumeClaim" in v}
    assert used == claims
    redis = _main(base, "redis")
    script = redis["command"][2]
    assert redis["command"][:2] == ["sh", "-c"] and 'test -n "$REDISCLI_AUTH" ||' in script
    argv = shlex.split(script.rsplit("exec ", 1)[1])
    assert argv[0] == "redis-server"
    options = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert options == {"--appendonly": "yes", "--appendfsync": "always", "--requirepass": "$REDISCLI_AUTH"}
    assert _env(redis)["REDISCLI_AUTH"] == ("secret", "rlfabric-credentials", "RLFABRIC_REDIS_PASSWORD")


# -- network policies --------------------------------------------------------------------------------------------

ANYONE, ANY_PORT, DATA_PORT = "*", None, 40000  # DATA_PORT: a port a worker picked at random
SCRAPER = "monitoring"
# Who must reach whom (docs/architecture.md): role -> {(source, port name or ANY_PORT)}.
REACHES = {
    "coordinator": {(ANYONE, "grpc"), (SCRAPER, "metrics")},
    "env": {("coordinator", "grpc"), ("rollout", ANY_PORT), (SCRAPER, "metrics")},
    "replay": {("coordinator", "grpc"), ("rollout", ANY_PORT), ("learner", ANY_PORT), (SCRAPER, "metrics")},
    "learner": {("coordinator", "grpc"), ("rollout", ANY_PORT), (SCRAPER, "metrics")},
    "rollout": {("coordinator", "grpc"), ("learner", ANY_PORT), (SCRAPER, "metrics")},
    "redis": {("replay", "redis")},
    "minio": {("replay", "s3"), ("learner", "s3"), ("rollout", "s3")},
}


def _admits(policies: list[dict], destination: dict, port: int, source: tuple[dict, dict | None]) -> bool:
    """Whether ``source`` (its namespace's labels, its pod's labels) may open ``port`` on ``destination`` (a pod
    template in this namespace)."""
    source_ns, source_pod = source
    labels, ports = destination["metadata"]["labels"], _ports(destination["spec"]["containers"][0])
    isolating = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
    if not isolating:
        return True

    def peer_matches(peer: dict) -> bool:
        if set(peer) - {"podSelector", "namespaceSelector"}:
            raise Unsupported(f"peer {peer}")
        in_namespace = _selects(peer["namespaceSelector"], source_ns) if "namespaceSelector" in peer \
            else source_ns.get("kubernetes.io/metadata.name") == NAMESPACE
        return in_namespace and ("podSelector" not in peer or (source_pod is not None
                                                                and _selects(peer["podSelector"], source_pod)))

    def port_matches(entry: dict) -> bool:
        if set(entry) - {"port", "protocol"} or entry.get("protocol", "TCP") != "TCP":
            raise Unsupported(f"policy port {entry}")
        return (ports.get(entry["port"]) if isinstance(entry["port"], str) else entry["port"]) == port

    for policy in isolating:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            if ("from" not in rule or any(map(peer_matches, rule["from"]))) and \
                    ("ports" not in rule or any(map(port_matches, rule["ports"]))):
                return True
    return False


def test_network_policies_let_in_exactly_the_peers_that_must_reach_each_role(base):
    policies = [d for d in base if d["kind"] == "NetworkPolicy"]
    pods = _pods(base)
    deny = _find(base, "NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}
    for policy in policies:  # every selector names pods that exist, every port one they expose
        spec = policy["spec"]
        targets = [p for p in pods.values() if _selects(spec["podSelector"], p["metadata"]["labels"])]
        assert targets, policy["metadata"]["name"]
        for rule in spec.get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert any(_selects(peer["podSelector"], p["metadata"]["labels"]) for p in pods.values())
            for entry in rule.get("ports", []):
                assert all(entry["port"] in _ports(t["spec"]["containers"][0]) for t in targets), entry
    namespace_labels = {**_find(base, "Namespace", NAMESPACE)["metadata"]["labels"],
                        "kubernetes.io/metadata.name": NAMESPACE}
    sources = {name: (namespace_labels, pod["metadata"]["labels"]) for name, pod in pods.items()}
    sources[SCRAPER] = ({"kubernetes.io/metadata.name": "monitoring", "rlfabric-scrape": "true"}, {})
    sources["elsewhere"] = ({"kubernetes.io/metadata.name": "default"}, {"app.kubernetes.io/name": "coordinator"})
    for role, destination in pods.items():
        ports = {**_ports(destination["spec"]["containers"][0]), "data": DATA_PORT}
        admitted = {(source, name) for source, labels in sources.items() for name, number in ports.items()
                    if _admits(policies, destination, number, labels)}
        expected = {(source, name) for source in sources for name in ports
                    for who, port in REACHES[role]
                    if who in (source, ANYONE) and port in (name, ANY_PORT)}
        assert admitted == expected, (role, sorted(admitted ^ expected))


# -- the GPU overlay ---------------------------------------------------------------------------------------------

def test_gpu_overlay_adds_one_gpu_to_the_learner_and_rollout_only(base, gpu):
    assert not any("nvidia.com/gpu" in str(c.get("resources")) for d in base for c in _containers(d, init=True))
    expected = copy.deepcopy(base)
    for role in GPU_ROLES:
        _main(expected, role)["resources"]["limits"]["nvidia.com/gpu"] = 1
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(gpu, key=key) == sorted(expected, key=key)


def test_an_images_entry_points_every_rlfabric_container_at_a_registry(tree, tmp_path):
    overlay = tmp_path / "kubernetes"
    shutil.copytree(tree, overlay)
    path = overlay / "overlays" / "gpu" / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text())
    spec["images"] = [{"name": "rlfabric", "newName": "registry.invalid/rlfabric", "newTag": "v1"}]
    path.write_text(yaml.safe_dump(spec))
    images = {c["name"]: c["image"] for d in render(overlay / "overlays" / "gpu") for c in _containers(d, init=True)}
    assert {images[r] for r in (*RLFABRIC, "wait-for-coordinator")} == {"registry.invalid/rlfabric:v1"}
    assert images["redis"] == "redis:7.4-alpine" and images["minio"].startswith("minio/minio")


# -- learner ranks on other nodes ----------------------------------------------------------------------------------

def test_learner_ranks_overlay_runs_the_rank_hosts_its_learner_names(tree, gpu, ranks, monkeypatch):
    """overlays/learner-ranks: the GPU overlay plus a StatefulSet of rank hosts (`serve learner --rank-host-for`)
    behind a headless Service, each pod's stable name in the learner's RLFABRIC_RANK_HOSTS and in the services'
    certificate, as many GPUs per pod as the learner's, and policies that let the learner and its ranks reach each
    other (rendezvous, HostRanks, collectives) and nothing else new."""
    from cryptography import x509

    stateful = _find(ranks, "StatefulSet", "learner-ranks")
    service = _find(ranks, "Service", stateful["spec"]["serviceName"])
    pod = stateful["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert _selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    assert stateful["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "learner-ranks"}
    assert _selects(stateful["spec"]["selector"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    env, learner = _env(container), _main(ranks, "learner")
    assert container["args"] == ["serve", "learner"] and container["image"] == learner["image"]
    unknown = {k for k in env if k.startswith("RLFABRIC_")} - SECRET_VARIABLES - service_flags("learner")
    assert not unknown, f"{sorted(unknown)} are not flags of `rlfabric serve learner`"
    learner_env = _env(learner)
    assert env["RLFABRIC_RANK_HOST_FOR"] == learner_env["RLFABRIC_ADVERTISE_HOST"]
    assert env["RLFABRIC_TOKEN"] == learner_env["RLFABRIC_TOKEN"]  # CURVE and the bearer: the deployment's secret
    names = [f"{stateful['metadata']['name']}-{i}.{service['metadata']['name']}"
             for i in range(stateful["spec"]["replicas"])]
    assert learner_env["RLFABRIC_RANK_HOSTS"].split(",") == [f"{n}:{env['RLFABRIC_PORT']}" for n in names]
    assert _ports(container) == {"grpc": int(env["RLFABRIC_PORT"]), "metrics": int(env["RLFABRIC_METRICS_PORT"])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _health_address(container[probe]["exec"]["command"], monkeypatch) == f"127.0.0.1:{env['RLFABRIC_PORT']}"
    gpus = learner["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus >= 2 and container["resources"]["limits"]["nvidia.com/gpu"] == gpus  # learner_ranks_per_host each
    cert = x509.load_pem_x509_certificate((tree / "tls" / "server.pem").read_bytes())
    dns = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
              .get_values_for_type(x509.DNSName))
    assert set(names) <= dns, "the learner dials its rank hosts by these names over TLS"

    # everything else is the GPU overlay's, bar the learner's GPUs and its rank hosts
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    others = sorted((d for d in ranks if d["metadata"]["name"] not in ("learner", "learner-ranks",
                                                                       "learner-ranks-ingress",
                                                                       "learner-from-its-ranks")), key=key)
    assert others == sorted((d for d in gpu if d["metadata"]["name"] != "learner"), key=key)

    policies = [d for d in ranks if d["kind"] == "NetworkPolicy"]
    pods = {**_pods(ranks), "learner-ranks": pod}
    namespace = {**_find(ranks, "Namespace", NAMESPACE)["metadata"]["labels"], "kubernetes.io/metadata.name": NAMESPACE}
    for destination, source, admitted in (("learner-ranks", "learner", True), ("learner", "learner-ranks", True),
                                          ("learner-ranks", "learner-ranks", True), ("learner-ranks", "rollout", False),
                                          ("learner-ranks", "coordinator", False), ("env", "learner-ranks", False)):
        for port in (int(env["RLFABRIC_PORT"]), DATA_PORT):
            assert _admits(policies, pods[destination], port, (namespace, pods[source]["metadata"]["labels"])) \
                == admitted, (source, destination, port)
