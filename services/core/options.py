"""Options sections of extensions, without torch: a policy's ``policy.<name>`` and a rollout backend's
``rollout.<name>``, each a pydantic model of its own package, validated as strictly as the rest of a run spec.

A policy (or backend) registers two things: its class (``rlfabric.policies`` / ``rlfabric.backends``: imports
torch) and its options model (``rlfabric.policy_options`` / ``rlfabric.backend_options``: a torch-free module,
since the coordinator validates every spec without torch)::

    [project.entry-points."rlfabric.policies"]
    my_policy = "my_pkg.policy:MyPolicy"

    [project.entry-points."rlfabric.policy_options"]
    my_policy = "my_pkg.options:MyPolicyOptions"

The config schema (services/core/config.py) gives every registered options model a section named after its
policy (backend), built with its defaults when a spec leaves it out; ``config.policy.my_policy.width`` is what the
policy reads. An options model subclasses ``PolicyOptions`` (``BackendOptions``): unknown fields are refused, and
the error names the field (``policy.my_policy.widht``). Its class variables say, without importing the policy, what
the services need to know of it:

    serves      the interface its policy serves (policies only; e.g. ``actor_critic``: act, evaluate, value), so
                the coordinator checks ``policy.name`` against the algorithm without importing the class
    paths       its fields that name files on a worker's host, by kind (``{"model": ("path",)}``): each worker
                confines them under its ``--data-root`` (services/core/paths.py)
    runs_code   its boolean fields that, when true, run a checkpoint's own Python (``trust_remote_code``): refused by
                a service whose operator did not allow import paths

Options models come from entry points, read once when a process first loads the schema (like algorithm specs):
install the package, then start the services.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from rlfabric.services.core.registry import Registry

PATH_KINDS = {  # what a path field names; every kind is confined under the worker's data roots alike
    "model": "a saved model directory or checkpoint its library reads (its modeling code too, with trust_remote_code)",
    "data": "a data file read whole (a tokenizer's corpus, a data set)",
}
SECTION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class Options(BaseModel):
    """Base of an extension's options section: unknown fields are errors, assignments are validated. Every field
    needs a default (a spec that does not name the extension still builds its section)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    paths: ClassVar[dict[str, tuple[str, ...]]] = {}  # kind (PATH_KINDS) -> the fields that hold such paths
    runs_code: ClassVar[tuple[str, ...]] = ()  # boolean fields that, true, run a checkpoint's own code

    def path_fields(self) -> list[tuple[str, str]]:
        """(field, value) of every path this section names (empty values are no path)."""
        return [(f, getattr(self, f)) for fields in type(self).paths.values() for f in fields if getattr(self, f)]


class PolicyOptions(Options):
    """Base of a policy's options section, ``policy.<name>``."""

    serves: ClassVar[str | None] = None  # the interface the policy serves (None: its class says, where it is loaded)


class BackendOptions(Options):
    """Base of a rollout backend's options section, ``rollout.<name>``."""


class LoRAConfig(Options):
    """LoRA adapters (peft) on a language model; rank 0 trains every parameter."""

    rank: int = Field(0, ge=0, le=1024)
    alpha: float = Field(16.0, gt=0, allow_inf_nan=False)
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                               description="module names that get adapters")


def check_options_model(value: Any) -> None:
    """An options model is a pydantic model class that refuses unknown fields and builds from its defaults alone,
    with well-formed declarations: checked when the schema loads it, before any spec is validated."""
    if not (isinstance(value, type) and issubclass(value, BaseModel)):
        raise ValueError("an options model is a pydantic model class (subclass rlfabric.services.core.options."
                         "PolicyOptions or BackendOptions)")
    if value.model_config.get("extra") != "forbid":
        raise ValueError("an options model refuses unknown fields, so a misspelled option is an error naming it "
                         "(model_config extra='forbid'; subclassing PolicyOptions or BackendOptions gives it)")
    paths = getattr(value, "paths", {})
    for kind, fields in paths.items():
        if kind not in PATH_KINDS:
            raise ValueError(f"paths kind {kind!r} is none of {sorted(PATH_KINDS)}")
        unknown = [f for f in fields if f not in value.model_fields]
        if unknown:
            raise ValueError(f"paths names {unknown}, which are not fields of the model")
    unknown = [f for f in getattr(value, "runs_code", ()) if f not in value.model_fields]
    if unknown:
        raise ValueError(f"runs_code names {unknown}, which are not fields of the model")
    try:
        value()
    except ValidationError as exc:
        raise ValueError(f"every field needs a default (a spec that leaves the section out still builds it): "
                         f"{exc.errors()[0]['loc']} has none") from None


POLICY_OPTIONS = Registry("policy_options", "policy.name", {}, noun="policy options model", literals=False,
                          check=check_options_model,
                          home="the torch-free options module of its policy (services/policies/options.py for "
                               "rlfabric's own, listed in rlfabric's pyproject.toml)")
BACKEND_OPTIONS = Registry("backend_options", "rollout.backend", {}, noun="backend options model", literals=False,
                           check=check_options_model, home="a torch-free options module beside the backend")


def option_sections(registry: Registry, where: str, taken: dict[str, Any]) -> dict[str, tuple[type, FieldInfo]]:
    """One field per options model ``registry`` lists (an entry point of an installed package), named after its
    extension and built from its defaults: what the schema adds to ``where`` (``policy``, ``rollout``). A name that
    is not a plain section name or that ``taken`` (the section's own fields) holds already is refused."""
    fields: dict[str, tuple[type, FieldInfo]] = {}
    for name in sorted(registry.available()):
        if not SECTION_NAME.match(name):
            raise RuntimeError(f"{registry.group} entry point {name!r}: a section name is lowercase letters, digits "
                               f"and '_' (at most 64)")
        if name in taken:
            raise RuntimeError(f"{registry.group} entry point {name!r} would be {where}.{name}, which is a field of "
                               f"{where} already. Fix: register the extension under another name")
        try:
            model = registry.load(name)
        except ValueError as exc:
            raise RuntimeError(f"{registry.group} entry point {name!r}: {exc}") from None
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        fields[name] = (model, Field(default_factory=model, description=doc or f"the options of {name}"))
    return fields


__all__ = ["BACKEND_OPTIONS", "BackendOptions", "LoRAConfig", "Options", "PATH_KINDS", "POLICY_OPTIONS",
           "PolicyOptions", "check_options_model", "option_sections"]
