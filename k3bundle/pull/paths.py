"""File names from a repo listing or a local tree: refuse the unsafe ones, apply the globs.

A repo is untrusted input. Every name it lists must be a relative POSIX path whose
components are ordinary names, and the path it maps to under ``--out`` must stay inside
``--out`` after resolving any symlinks already there. Names k3bundle writes itself
(``source.json``, the state file, ``NAME.part`` / ``NAME.bad`` next to a file) must not
collide with listed names.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from k3bundle.file_names import SOURCE_RECORD as SOURCE_JSON
from k3bundle.io.files import relpath_problem
from k3bundle.pull.errors import PullError

STATE_FILE = ".k3bundle-pull.json"
PART_SUFFIX = ".part"
BAD_SUFFIX = ".bad"
RESERVED = (SOURCE_JSON, STATE_FILE)


def check_name(name: str) -> str:
    """Return ``name`` if it is a safe relative POSIX path (``io.files.relpath_problem``), else raise
    a one-line PullError."""
    why = relpath_problem(name)
    if why:
        raise PullError(f"{name!r}: refusing this file name: {why}")
    return name


def target_path(out: Path, name: str) -> Path:
    """``out / name`` after checking that, with symlinks resolved, it stays inside ``out``."""
    check_name(name)
    root = Path(os.path.realpath(out))
    dest = root.joinpath(*name.split("/"))
    # Resolve what already exists (a symlinked folder inside --out could point anywhere).
    real = Path(os.path.realpath(dest))
    if real != dest and not real.is_relative_to(root):
        raise PullError(f"{name}: refusing to write through a symlink: {dest} resolves to {real}, "
                        f"outside {root}")
    return dest


def check_collisions(names: Iterable[str]) -> None:
    """Refuse listings that clash with the names k3bundle writes itself."""
    names = set(names)
    for n in sorted(names):
        if n in RESERVED:
            raise PullError(f"{n}: the repo has a file with this name, which k3bundle writes itself; "
                            f"exclude it with --exclude '{n}'")
        for suffix in (PART_SUFFIX, BAD_SUFFIX):
            if n + suffix in names:
                raise PullError(f"{n + suffix}: clashes with the {suffix} file k3bundle keeps next to {n}; "
                                f"exclude one of them with --exclude")


def selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """fnmatch globs on the whole relative path (``*`` also matches ``/``), like huggingface_hub's
    ``allow_patterns``/``ignore_patterns``: kept if it matches an include (or none is given) and
    no exclude. A pattern ending in ``/`` means everything under that folder."""

    def norm(p: str) -> str:
        return p + "*" if p.endswith("/") else p

    if include and not any(fnmatch.fnmatchcase(name, norm(p)) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(name, norm(p)) for p in exclude)
