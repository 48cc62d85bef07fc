"""The repository itself: no large file is tracked by accident.

A tracked file over 1 MB must be on the allow-list below, each entry with the reason it is large;
anything else (a wheel, a bundle, a checkpoint left behind by a benchmark) fails here before it
bloats every clone.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1 << 20
ALLOWED = {
    "k3bundle/data/trained/*.safetensors.zst": "the trained tiny model the demo and validate tests run",
    "tolerances/calibration/*.jsonl.gz": "the calibration records the shipped limits are derived from",
    "docs/*.png": "the pictures of the documentation",
}


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.fail(f"{ROOT} is not a git checkout with git installed: the tracked files cannot be listed")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def too_large(files: list[str], size_of) -> list[str]:
    return [f"{p} ({size_of(p):,} bytes)" for p in files
            if size_of(p) > LIMIT and not any(fnmatch.fnmatch(p, pat) for pat in ALLOWED)]


def test_no_tracked_file_over_1_mb_outside_the_allow_list():
    files = tracked_files()
    assert "README.md" in files and "pyproject.toml" in files  # the listing is the repository's
    bad = too_large(files, lambda p: (ROOT / p).stat().st_size if (ROOT / p).is_file() else 0)
    assert not bad, f"tracked files over 1 MB not on the allow-list in {Path(__file__).name}: {bad}"


def test_the_rule_catches_a_stray_binary_and_spares_the_allow_list():
    sizes = {"py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl": 2_936_517, "bench/out/model.safetensors": LIMIT + 1,
             "k3bundle/data/trained/tiny-trained.safetensors.zst": 14_398_769, "docs/small.md": 10}
    assert too_large(list(sizes), sizes.get) == ["py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl (2,936,517 bytes)",
                                                 "bench/out/model.safetensors (1,048,577 bytes)"]
