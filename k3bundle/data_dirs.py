"""Where the data files k3bundle interprets live: layouts, golden cases, tolerances.

In a source checkout they sit at the repository root, beside the package; an installed wheel
carries the same trees in ``k3bundle/_data`` (pyproject.toml maps them there).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dirs(name: str) -> list[Path]:
    """The folders named ``name`` (e.g. ``"layouts"``, ``"golden/cases"``) that exist, in lookup
    order: the repository's first, then the wheel's ``_data`` copy."""
    return [d for d in (_PACKAGE.parent / name, _PACKAGE / "_data" / name) if d.is_dir()]
