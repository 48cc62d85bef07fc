"""Tiny-preset bundles converted once per test session and shared by the convert/verify tests.

Not a conftest fixture on purpose: the cache lives here so test_convert.py and
test_verify_trace.py share one conversion per layout. Tests must not modify these bundles
(copy one first).
"""

from __future__ import annotations

import contextlib
import functools
import json
import struct
from pathlib import Path

import pytest

SHIPPED = ["b200-tp8-pp2", "b300-tp8", "gb300-dep16", "h200-tp16-ep16", "mi355x-tp8", "new-accelerator.example"]

_CACHE: dict[str, Path] = {}


def bundle_for(layout: str, tiny_ckpt: Path, tmp_path_factory) -> Path:
    if layout not in _CACHE:
        from k3bundle.convert import convert

        out = tmp_path_factory.mktemp("bundle") / layout
        convert(tiny_ckpt, layout, out, workers=1)
        _CACHE[layout] = out
    return _CACHE[layout]


def bundle_with_goldens(ckpt: Path, layout: Path, root: Path, cases: tuple[str, ...] = ("greedy",),
                        noise: bool = True, long_tokens: int | None = None) -> tuple[Path, Path]:
    """``root/bundle``: ``ckpt`` converted with ``layout``, and goldens of the shipped ``cases``
    (copied to ``root/cases``; the long case ``long_tokens`` long). Returns (bundle, cases folder)."""
    import shutil

    from k3bundle.convert import convert
    from k3bundle.golden.generate import generate_goldens

    folder = root / "cases"
    folder.mkdir()
    for name in cases:
        shutil.copy(Path(__file__).resolve().parents[1] / "golden" / "cases" / f"{name}.yaml", folder)
    bundle = root / "bundle"
    convert(ckpt, str(layout), bundle, workers=1)
    generate_goldens(bundle, cases_dir=folder, noise=noise, long_tokens=long_tokens)
    return bundle, folder


def file_hashes(root: Path) -> dict[str, str]:
    import hashlib

    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@functools.lru_cache(maxsize=64)
def _file(path: Path) -> tuple[dict, bytes, int]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8: 8 + n]), data, 8 + n


def raw_tensor(path: Path, key: str) -> tuple[dict, bytes]:
    """(header entry, data bytes) of one tensor, parsed here without k3bundle's reader."""
    header, data, start = _file(path)
    entry = header[key]
    b, e = entry["data_offsets"]
    return entry, data[start + b: start + e]


def file_bytes(path: Path, begin: int, end: int) -> bytes:
    """Bytes [begin, end) of a (device) file, cached per file."""
    return _file_raw(path)[begin:end]


@functools.lru_cache(maxsize=64)
def _file_raw(path: Path) -> bytes:
    return path.read_bytes()


@contextlib.contextmanager
def one_torch_thread():
    """OpenMP with 2 threads is ~30x slower on a 2-core VM for the small ops the checks run."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bundles(tiny_ckpt, tmp_path_factory):
    """{layout: bundle dir} of the tiny preset under every shipped layout (converted once)."""
    return {name: bundle_for(name, tiny_ckpt, tmp_path_factory) for name in SHIPPED}


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch():
    with one_torch_thread():
        yield
