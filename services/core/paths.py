"""What a run spec may name on a worker's host: paths under the operator's data roots, endpoints on the operator's
allow-list. A token holder chooses a run spec; the operator chooses where that spec may read, write and connect.

- **Paths** (``storage.root``, ``policy.init_checkpoint``, ``algorithm.expert_checkpoint``, ``replay.datasets``, the
  run directory a worker is handed): a relative path is taken from the first ``--data-root``; whatever resolves
  outside every root (an absolute path elsewhere, '..', a symlink out) is refused, the coordinator's ``confine``
  rule for run directories. Files are read only when they are regular files (no FIFO that wedges a reader, no
  ``/dev/zero`` that fills its memory) of at most ``MAX_READ_BYTES``.
- **Endpoints** (``storage.endpoint``, ``replay.redis_url``): a worker connects only to ``--allow-endpoints``
  entries (``host:port``; ``*`` for any), so a spec cannot point a worker's signed S3 requests or its Redis client
  at a host of its choosing.
"""

from __future__ import annotations

import argparse
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

MAX_READ_BYTES = 64 << 30  # the largest file a run spec may have a worker read (a checkpoint, a data set)
DATA_ROOT_FLAG = "--data-root"
ALLOW_ENDPOINTS_FLAG = "--allow-endpoints"
ANY_ENDPOINT = "*"


class PathRefused(ValueError):
    """A client-named path outside the operator's roots, or not a readable regular file; the message names the
    field, the root and the flag that sets it."""


class EndpointRefused(ValueError):
    """A client-named endpoint not on the operator's allow-list; the message names the field and the flag."""


@dataclass(frozen=True)
class DataRoots:
    """The directories a run spec's paths may resolve into. The first one is where relative paths start."""

    roots: tuple[Path, ...]

    @classmethod
    def parse(cls, text: str) -> DataRoots:
        """``--data-root`` as given: directories separated by ``os.pathsep``."""
        parts = [p for p in text.split(os.pathsep) if p.strip()] or ["."]
        return cls(tuple(Path(p).expanduser().resolve() for p in parts))

    @classmethod
    def anywhere(cls) -> DataRoots:
        """No confinement (relative paths from the current directory): for a user's own tools, not services."""
        return cls((Path.cwd().resolve(), Path("/")))

    def describe(self) -> str:
        return os.pathsep.join(str(r) for r in self.roots)

    def confine(self, path: str | Path, field: str) -> Path:
        """``path`` resolved (symlinks followed) under one of the roots, else PathRefused naming ``field``."""
        text = str(path)
        if "\x00" in text:
            raise PathRefused(f"{field}={text[:200]!r} holds a NUL byte. Fix: name a file under {self.describe()}")
        given = Path(text).expanduser()
        resolved = (given if given.is_absolute() else self.roots[0] / given).resolve()
        if not any(resolved == root or root in resolved.parents for root in self.roots):
            raise PathRefused(
                f"{field}={text[:200]!r} resolves to {resolved}, outside this worker's data root(s) "
                f"{self.describe()}. Fix: name a path under them (a relative one is taken from {self.roots[0]}), or "
                f"have the operator start the worker with {DATA_ROOT_FLAG} (env RLFABRIC_DATA_ROOT) covering it")
        return resolved

    def read_bytes(self, path: str | Path, field: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """The whole file, confined and checked: a regular file of at most ``max_bytes``."""
        with self.open(path, field, max_bytes) as f:
            size = os.fstat(f.fileno()).st_size  # (checked against max_bytes as it was opened)
            data = f.read(size + 1)
        if len(data) > size:
            raise PathRefused(f"{field}={str(path)[:200]!r} grew while it was read. Fix: name a finished file")
        return data

    def open(self, path: str | Path, field: str, max_bytes: int = MAX_READ_BYTES):
        """A binary file object of the confined path, opened only if it is a regular file of at most ``max_bytes``
        (checked before and after opening: O_NONBLOCK so a FIFO never blocks the open, O_NOFOLLOW so a symlink
        swapped in after the check is not followed)."""
        resolved = self.confine(path, field)
        shown = f"{field}={str(path)[:200]!r}"
        try:
            before = os.stat(resolved)
        except OSError as exc:
            raise PathRefused(f"{shown} cannot be read ({exc.strerror}: {resolved}). Fix: name an existing file "
                              f"under {self.describe()}") from None
        _regular(before, shown, resolved, max_bytes)
        try:
            fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise PathRefused(f"{shown} cannot be opened ({exc.strerror}: {resolved})") from None
        try:
            after = os.fstat(fd)
            _regular(after, shown, resolved, max_bytes)
            if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
                raise PathRefused(f"{shown}: {resolved} was replaced while it was opened. Fix: name a file that "
                                  f"stays put")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise


def _regular(st: os.stat_result, shown: str, resolved: Path, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise PathRefused(f"{shown}: {resolved} is {kind}, not a regular file. Fix: name a checkpoint or data set "
                          f"file")
    if st.st_size > max_bytes:
        raise PathRefused(f"{shown}: {resolved} holds {st.st_size} bytes, over the {max_bytes}-byte bound "
                          f"(paths.MAX_READ_BYTES) on a file a run spec names")


@dataclass(frozen=True)
class Endpoints:
    """The endpoints a run spec may have this worker connect to: ``host:port`` entries (``unix:/path`` for a
    socket), or ``*`` for any."""

    allowed: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> Endpoints:
        return cls(frozenset(e.strip().lower() for e in text.split(",") if e.strip()))

    def check(self, endpoint: str, field: str, shown: str | None = None) -> None:
        """``endpoint`` is a host:port (or unix:/path) the operator allowed, else EndpointRefused."""
        if ANY_ENDPOINT in self.allowed or endpoint.lower() in self.allowed:
            return
        allowed = ", ".join(sorted(self.allowed)) or "none"
        raise EndpointRefused(
            f"{field}={shown if shown is not None else endpoint!r} names {endpoint}, which this worker may not "
            f"connect to (allowed: {allowed}). Fix: use an endpoint the operator allowed, or have the operator "
            f"start the worker with {ALLOW_ENDPOINTS_FLAG} {endpoint} (env RLFABRIC_ALLOW_ENDPOINTS)")


_process_endpoints: Endpoints | None = None


def set_process_endpoints(endpoints: Endpoints | None) -> None:
    """What this worker process may connect to where a run spec says, for code that has no worker object at hand
    (an env adapter dialing a robot gateway): the service's ``--allow-endpoints``."""
    global _process_endpoints
    _process_endpoints = endpoints


def process_endpoints() -> Endpoints:
    """The service's allow-list, else any endpoint (a user's own process: the CLI, a notebook, a test)."""
    return _process_endpoints if _process_endpoints is not None else Endpoints(frozenset({ANY_ENDPOINT}))


def s3_endpoint(endpoint: str) -> str:
    """storage.endpoint as host:port (the scheme, if any, dropped; port 80 or 443 by it when missing)."""
    text = endpoint.strip()
    lower = text.lower()
    default = "443" if lower.startswith("https://") else "80"
    for scheme in ("http://", "https://"):
        if lower.startswith(scheme):
            text = text[len(scheme):]
    text = text.split("/", 1)[0]
    host, sep, port = text.rpartition(":")
    return text if sep and host and port.isdigit() else f"{text}:{default}"


def redis_endpoint(url: str) -> str:
    """replay.redis_url's host:port (unix:/path for a socket); a URL that does not parse is its own endpoint,
    so the allow-list refuses it unless it allows anything."""
    try:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return f"unix:{parts.path}"
        host = parts.hostname or ""
        return f"{f'[{host}]' if ':' in host else host}:{parts.port or 6379}"  # an IPv6 host as [::1]:6379
    except ValueError:
        return url


def add_arguments(parser: argparse.ArgumentParser, endpoints: bool = True) -> None:
    """The operator's flags of a worker that reads (and connects) where a run spec says."""
    parser.add_argument(DATA_ROOT_FLAG, default=".",
                        help=f"directories a run spec's paths (storage.root, policy.init_checkpoint, "
                             f"algorithm.expert_checkpoint, replay.datasets) must resolve into, separated by "
                             f"'{os.pathsep}'; relative paths start at the first one")
    if endpoints:
        parser.add_argument(ALLOW_ENDPOINTS_FLAG, default="",
                            help="host:port entries, comma-separated, that a run spec's storage.endpoint and "
                                 "replay.redis_url may name ('*': any); default none")


def local_stack_args(host: str, runs_root: str | Path) -> list[str]:
    """A local stack's worker flags. One bound to loopback serves only the user who started it (its secret is
    made per stack), so its workers read what that user names and reach the endpoints the user's spec names; one
    bound to another interface reads under the launcher's RLFABRIC_DATA_ROOT (else the directory it was started in)
    and its runs root, and connects where the launcher's own RLFABRIC_ALLOW_ENDPOINTS says."""
    from rlfabric.services.core import auth

    cwd = os.getcwd()
    if auth.is_loopback(host):
        return [DATA_ROOT_FLAG, os.pathsep.join([cwd, "/"]), ALLOW_ENDPOINTS_FLAG, ANY_ENDPOINT]
    roots = os.environ.get("RLFABRIC_DATA_ROOT", "").strip()
    return [DATA_ROOT_FLAG, os.pathsep.join([roots or cwd, str(Path(runs_root).resolve())]),
            ALLOW_ENDPOINTS_FLAG, os.environ.get("RLFABRIC_ALLOW_ENDPOINTS", "")]


def confine_storage(storage, run_dir: str, roots: DataRoots, endpoints: Endpoints | None):
    """(``storage`` with its filesystem root confined, the run directory a worker was handed confined): what a
    worker opens its object store with. An S3 store's endpoint must be allowed; a filesystem store's root (or the
    run directory it defaults to) must lie under the data roots."""
    confined_dir = str(roots.confine(run_dir or ".", "context_json.run_dir (the run directory)"))
    if storage.kind == "s3":
        if endpoints is not None:
            endpoints.check(s3_endpoint(storage.endpoint), "storage.endpoint")
    elif storage.root:
        storage = storage.model_copy(update={"root": str(roots.confine(storage.root, "storage.root"))})
    return storage, confined_dir


def confine_model(config, roots: DataRoots):
    """``config`` with every path its options sections declare (``paths`` of ``policy.lm``, of each policy's
    ``policy.<name>`` and each backend's ``rollout.<name>``: saved model directories read by their libraries
    themselves, a VLM's modeling code too when trust_remote_code is on, and data files such as a tokenizer's
    corpus; services/core/options.py) resolved under the data roots, else PathRefused naming the field."""
    update = {}
    for where in ("policy", "rollout"):
        parent = getattr(config, where)
        sections = {}
        for name, section in parent.extension_sections().items():
            confined = {f: str(roots.confine(value, f"{where}.{name}.{f}")) for f, value in section.path_fields()}
            if confined:
                sections[name] = section.model_copy(update=confined)
        if sections:
            update[where] = parent.model_copy(update=sections)
    return config.model_copy(update=update) if update else config
