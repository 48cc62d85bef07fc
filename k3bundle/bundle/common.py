"""Shared pieces of the bundle files: deterministic JSON and versioned JSON reading."""

from __future__ import annotations

import json
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.errors import JsonFileError
from k3bundle.io import strict_json
from k3bundle.io.files import relpath_problem


def json_bytes(doc: dict) -> bytes:
    """Deterministic JSON: sorted keys, 1-space indent, UTF-8, trailing newline."""
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def read_json(path: str | Path, kind: str, version: int) -> dict:
    """Read a k3bundle JSON file strictly (``io.strict_json``) and check its ``kind`` and
    ``schema_version``; a problem is a ``BundleError`` naming the file."""
    try:
        return strict_json.read_json(path, kind=kind, version=version)
    except JsonFileError as e:
        raise BundleError(str(e)) from None


def check_relpath(name: object, where: str) -> None:
    """Refuse a file name read from a bundle file unless it is a normalised relative path inside
    the bundle (``io.files.relpath_problem``, the rule pull applies to a checkpoint's names): an
    index or manifest edited to name ``../other/model.safetensors`` must not make verify, golden
    or validate read another folder's weights."""
    why = relpath_problem(name)
    if why:
        raise BundleError(f"{where} names {name!r}: {why}; a bundle's files are relative paths inside it")
