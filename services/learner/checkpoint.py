"""Checkpoints: what a run needs to continue exactly where it was, stored atomically and verified on load.

An object is ``MAGIC + sha256(payload) + payload`` where the payload is ``torch.save`` of plain containers and
tensors, loaded with ``weights_only=True`` (never arbitrary objects). Object-store writes are atomic, so a
checkpoint is either whole or absent; a corrupt one (bit rot, a truncated copy) fails its checksum and the
next older one is used instead, with a warning.
"""

from __future__ import annotations

import hashlib
import io
import re

import torch

from rlfabric.services.core.objectstore import ObjectStore

MAGIC = b"RLFCKPT1"
FORMAT = "rlfabric-checkpoint-v1"
PERIODIC = re.compile(r"^checkpoints/ckpt-(\d+)\.pt$")


class CorruptCheckpoint(ValueError):
    pass


def pack(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    payload = buf.getvalue()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def unpack(data: bytes, name: str = "checkpoint") -> dict:
    if data[: len(MAGIC)] != MAGIC:
        raise CorruptCheckpoint(f"{name} is not an rlfabric checkpoint (bad magic bytes)")
    digest, payload = data[len(MAGIC): len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{name} is corrupt: its sha256 does not match its contents")
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{name} has an unknown format (expected {FORMAT!r})")
    return state


def periodic_key(version: int) -> str:
    return f"checkpoints/ckpt-{version:010d}.pt"


def periodic_keys(store: ObjectStore) -> list[str]:
    """Periodic checkpoints, newest first."""
    keys = [k for k in store.list("checkpoints/") if PERIODIC.match(k)]
    return sorted(keys, key=lambda k: int(PERIODIC.match(k).group(1)), reverse=True)


def load_latest(store: ObjectStore) -> tuple[str, dict, list[str]]:
    """The newest checkpoint that verifies, and why each newer one was skipped."""
    skipped: list[str] = []
    candidates = periodic_keys(store)
    if store.exists("checkpoints/final.pt"):
        candidates.insert(0, "checkpoints/final.pt")
    for key in candidates:
        try:
            return key, unpack(store.get_bytes(key), key), skipped
        except (CorruptCheckpoint, RuntimeError, EOFError) as exc:  # torch raises RuntimeError on bad payloads
            skipped.append(f"{key}: {exc}")
    raise FileNotFoundError("no valid checkpoint to resume from" + (
        f"; skipped: {'; '.join(skipped)}" if skipped else " (none written yet)"))


def prune(store: ObjectStore, keep: int) -> list[str]:
    """Delete periodic checkpoints beyond the newest ``keep``."""
    old = periodic_keys(store)[keep:]
    for key in old:
        store.delete(key)
    return old
