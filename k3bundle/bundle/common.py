"""Shared pieces of the bundle files: the error, versioned JSON read/write, file hashing."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from k3bundle.errors import K3Error

HASH_CHUNK = 16 << 20


class BundleError(K3Error):
    """A bundle file is missing, malformed, or of a schema version this k3bundle cannot read."""


def json_bytes(doc: dict) -> bytes:
    """Deterministic JSON: sorted keys, 1-space indent, UTF-8, trailing newline."""
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_atomic(path: str | Path, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to a hidden temp file beside ``path``, fsync, rename into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise


def read_json(path: str | Path, kind: str, version: int) -> dict:
    """Read a k3bundle JSON file and check its ``kind`` and ``schema_version``."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: not a readable JSON file: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        raise BundleError(f"{path}: not a {kind} file (kind {doc.get('kind') if isinstance(doc, dict) else None!r})")
    if doc.get("schema_version") != version:
        raise BundleError(f"{path}: schema_version {doc.get('schema_version')!r}; this k3bundle reads {version}")
    return doc


def sha256_file(path: str | Path) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read once in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size
