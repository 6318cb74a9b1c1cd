"""Object store: where weight versions, checkpoints and run artefacts live, behind one small interface.

``FilesystemObjectStore`` is the embedded default (a directory). Writes are atomic: a reader never sees a
half-written object.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from services.core.config import StorageConfig


class ObjectStore:
    def put_bytes(self, key: str, data: bytes) -> str:
        raise NotImplementedError

    def get_bytes(self, key: str) -> bytes:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        raise NotImplementedError

    def uri(self, key: str) -> str:
        raise NotImplementedError


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"object key {key!r} must be a relative path like 'checkpoints/final.pt' without '..'")
    return key


class FilesystemObjectStore(ObjectStore):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put_bytes(self, key: str, data: bytes) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no object {key!r} in {self.root}")
        return path.read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*")
                      if p.is_file() and not p.name.startswith(".") and str(p.relative_to(self.root)).startswith(prefix))

    def uri(self, key: str) -> str:
        return f"file://{self._path(key)}"


def open_store(config: StorageConfig, default_root: str | Path) -> ObjectStore:
    return FilesystemObjectStore(config.root or default_root)
