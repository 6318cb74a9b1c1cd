"""Artefacts that take a minute or more to build and that several tests, xdist workers or tiers read (a supervised
checkpoint, a VLA's warm-start stages): built once, by whichever process asks first, under pytest's cache directory
(``.pytest_cache/d/artefacts/<name>-<key>``), and read by every later test, worker and tier of this checkout.

The key hashes what the artefact is built from: the caller's inputs, and every file under ``services/`` and
``examples/`` plus ``pyproject.toml`` and this file. A change to the code that builds an artefact builds it again,
so a cached artefact never hides one."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("services", "examples")
ARTEFACTS = ROOT / ".pytest_cache" / "d" / "artefacts"
"""Where they are: pytest's ``config.cache.mkdir("artefacts")`` for this checkout (tests/prebuild.py builds there
without a pytest session)."""


@cache
def source_digest() -> str:
    """What every artefact depends on besides its inputs: the bytes of the repository's code, specs and pins."""
    h = hashlib.sha256()
    files = sorted(f for d in SOURCES for f in (ROOT / d).rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    for f in [*files, ROOT / "pyproject.toml", Path(__file__).resolve()]:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cached(config, name: str, inputs: dict, build: Callable[[Path], None]) -> Path:
    """The directory of artefact ``name`` built from ``inputs`` (JSON-able): ``build(directory)`` fills a fresh
    directory the first time; later callers, in this or another process, wait for it and get the same one. A
    build that raises leaves nothing behind. ``config``: pytest's, or None outside a session (the same place)."""
    key = hashlib.sha256((json.dumps(inputs, sort_keys=True, default=str) + source_digest()).encode()).hexdigest()
    root = Path(config.cache.mkdir("artefacts")) if config is not None else ARTEFACTS
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{name}-{key[:16]}"
    with FileLock(str(out) + ".lock"):  # built where it stays: what it holds may name its own paths
        if not (out / ".built").is_file():
            shutil.rmtree(out, ignore_errors=True)  # a build killed midway
            out.mkdir()
            try:
                build(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            (out / ".built").write_text(json.dumps(inputs, sort_keys=True, default=str))
    return out


def undisturbed(run_dir: Path) -> None:
    """Refuse to keep a run that recovered from a lost worker as an artefact: its trajectory is not the seed's (a
    run built on a starved core, tests/prebuild.py, may lose one). The next caller builds it again."""
    if (run_dir / "recoveries.csv").exists():
        raise RuntimeError(f"{run_dir} recovered from a lost worker ({(run_dir / 'recoveries.csv').read_text()!r}): "
                           f"not kept as an artefact")
