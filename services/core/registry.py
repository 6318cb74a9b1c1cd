"""One registry mechanism for every extension point (env adapters, collectors, backends, ...): a name in a run spec
becomes the object it names in whichever process reads the spec, so a user's package works in every service, local
or remote, with no edit to rlfabric and no registration call (a call changes only the process that makes it).

A name resolves, in order, through
    built-ins      name -> "package.module:attr" (or "package.module"), imported when first asked for
    entry points   group ``rlfabric.<kind>`` of any installed package (``[project.entry-points."rlfabric.<kind>"]``)
    a literal      ``package.module:attr`` (or ``package.module``) written in the run spec, imported as named

Nothing is imported until a name is asked for, so an extension whose dependencies are an optional extra costs
nothing until a run names it.

A literal can name any module installed where the service runs (``subprocess:Popen``, ``os:system``), and a run
spec comes from the network: a token holder is not the operator who chose what code a host runs. So a service
resolves literals only when its operator started it with ``--allow-import-paths`` (``allow_import_paths``; a
local ``rlfabric train`` does, as its user is its operator). A process that is not a service (the CLI, a notebook,
a test) resolves what its own user names.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

GROUP_PREFIX = "rlfabric."
BUILTIN_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
LITERAL = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$", re.ASCII)
IMPORT_PATHS_FLAG = "--allow-import-paths"
_import_paths = True  # a service sets its operator's choice at start (run_service); other processes are their user's


def allow_import_paths(allowed: bool) -> None:
    """Whether this process resolves ``package.module:attr`` names from run specs (a service: its operator's
    ``--allow-import-paths``)."""
    global _import_paths
    _import_paths = allowed


def import_paths_allowed() -> bool:
    return _import_paths


class ImportPathRefused(ValueError):
    """A run spec named code by its import path on a service whose operator did not allow it."""


def refuse_import_path(field: str, name: str) -> ImportPathRefused:
    return ImportPathRefused(
        f"{field} {name[:200]!r} names code by its import path, and this service resolves only built-in and "
        f"installed (entry-point) names: a run spec comes from the network, so it may not choose what a host "
        f"imports. Fix: install a package that registers it as an entry point, or have the operator start every "
        f"service with {IMPORT_PATHS_FLAG} (a local `rlfabric train` does)")


def is_literal(name: str) -> bool:
    """A name with a dot or a colon names code by its import path; registered names never have either."""
    return ("." in name or ":" in name) and bool(LITERAL.match(name))


def protocol_members(protocol: type, methods_only: bool = False) -> tuple[str, ...]:
    """The attributes and methods a Protocol declares (typing.get_protocol_members is Python 3.13+); a class
    offers only the methods before it is built (its instances set the attributes)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls is object or getattr(cls, "_is_protocol", False) is False or cls.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}
        if not methods_only:
            names |= {n for n in getattr(cls, "__annotations__", {}) if not n.startswith("_")}
    return tuple(sorted(names))


def missing_members(value: Any, protocol: type) -> list[str]:
    """What ``value`` lacks of ``protocol``: every member for an object or module, the methods for a class."""
    return [m for m in protocol_members(protocol, isinstance(value, type)) if not hasattr(value, m)]


def load_target(target: str) -> Any:
    """Import ``package.module:attr`` (attr may be dotted) or ``package.module``. Errors propagate: the registry
    turns them into messages that name the field."""
    module_name, _, attr = target.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        value = getattr(value, part)
    return value


class Registry:
    """The entries of one kind of extension. ``field`` is the run-spec field that names one (for errors),
    ``home`` where a built-in of this kind lives, ``protocol`` what a loaded entry must provide (checked on load).
    ``literals=False`` resolves installed names only, whatever the operator allows (a robot driver on the gateway
    beside an arm). ``check``, when given, vets a loaded value as this kind before anything calls it (a Task is a
    class with ``problem``, a reward takes ``(prompt, completion, answer)``), raising ValueError with the reason."""

    def __init__(self, kind: str, field: str, builtins: dict[str, str], home: str, protocol: type | None = None,
                 noun: str | None = None, literals: bool = True, check: Callable[[Any], None] | None = None):
        self.kind, self.field, self.home, self.protocol, self.literals = kind, field, home, protocol, literals
        self.kind_check = check
        self.group = GROUP_PREFIX + kind
        self.noun = noun or kind.removesuffix("s").replace("_", " ")
        self._builtins = dict(builtins)
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    def register(self, name: str, target: Any) -> None:
        """In-process only (tests, notebooks): services in other processes see entry points and literals.
        ``target`` is ``package.module:attr``, or the object itself."""
        if not BUILTIN_NAME.match(name):
            raise ValueError(f"{self.noun} name {name!r}: use lowercase letters, digits and '_' (at most 64)")
        if not isinstance(target, str):
            self._check(name, repr(target), target)
        with self._lock:
            self._builtins[name] = target if isinstance(target, str) else \
                f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"
            if isinstance(target, str):
                self._loaded.pop(name, None)
            else:
                self._loaded[name] = target

    def entry_points(self) -> dict[str, str]:
        return {ep.name: ep.value for ep in entry_points(group=self.group)}

    def available(self) -> dict[str, str]:
        """Every name this process can resolve, with its target. A built-in wins over an entry point of its name."""
        return {**self.entry_points(), **self._builtins}

    def _literals(self) -> bool:
        return self.literals and _import_paths

    def __contains__(self, name: str) -> bool:
        return name in self._builtins or (self._literals() and is_literal(name)) or name in self.entry_points()

    def target(self, name: str) -> str:
        if name in self._builtins:
            return self._builtins[name]
        found = self.entry_points()
        if name in found:
            return found[name]
        if is_literal(name) and self.literals:
            if not _import_paths:
                raise refuse_import_path(self.field, name)
            return name
        raise ValueError(self.unknown(name))

    def unknown(self, name: str) -> str:
        literal = ("; or name it as package.module:attr in the run spec (installed wherever the service runs)"
                   if self._literals() else "")
        return (f"{self.field} {name!r} is not a registered {self.noun}; available: {sorted(self.available())}. "
                f"To add one: a built-in in {self.home}; an entry point in group {self.group!r} of an installed "
                f"package ([project.entry-points.\"{self.group}\"] NAME = \"package.module:attr\"){literal}")

    def load(self, name: str) -> Any:
        """The object ``name`` names, imported once per process; checked against the kind's Protocol."""
        if not _import_paths and is_literal(name) and name not in self._builtins:
            self.target(name)  # refused unless an installed entry point has this name, even when loaded before
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        target = self.target(name)
        try:
            value = load_target(target)
        except ImportError as exc:
            module = target.partition(":")[0]
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                raise ValueError(f"{self.field} {name!r}: module {module!r} cannot be imported ({exc}). Fix: "
                                 f"install the package that provides it in every service's environment, or "
                                 f"correct the name") from None
            raise ValueError(f"{self.field} {name!r} needs a package that is not installed ({exc.name}). Fix: pip "
                             f"install the extra that brings it (see README)") from None
        except AttributeError as exc:
            raise ValueError(f"{self.field} {name!r}: {target!r} does not resolve ({exc}). Fix: name an attribute "
                             f"the module defines") from None
        self._check(name, target, value)
        with self._lock:
            self._loaded[name] = value
        return value

    def _check(self, name: str, target: str, value: Any) -> None:
        if self.kind_check is not None:
            try:
                self.kind_check(value)
            except ValueError as exc:
                raise ValueError(f"{self.field} {name!r}: {target!r} is not a {self.noun}: {exc}") from None
        if self.protocol is None:
            if not callable(value):
                raise ValueError(f"{self.field} {name!r}: {target!r} is not callable; a {self.noun} is")
            return
        missing = missing_members(value, self.protocol)
        if missing:
            raise ValueError(f"{self.field} {name!r}: {target!r} lacks {missing}, which every {self.noun} "
                             f"provides (see {self.protocol.__module__}.{self.protocol.__qualname__})")
