"""Fault injection for the reliability tests: a disk that fills up at the Nth write, a run killed
at a chosen point.

In process::

    with disk_full(root, nth=3) as writes:   # the 3rd write under ROOT raises ENOSPC
        ...
    writes.count                              # how many writes were attempted under ROOT

Every way k3bundle writes is counted: ``os.write``, ``os.pwrite(v)``, ``os.posix_fallocate``,
``os.sendfile``/``copy_file_range``/``splice`` and ``write`` on files from ``open`` (atomic
writes, the journal, reports). Descriptors are named through ``/proc/self/fd`` (Linux).

In a subprocess (a real kill: no ``finally`` runs)::

    run_cli_faulted(["convert", ...], kill_at="k3bundle.convert.journal:Journal.remove")
    run_cli_faulted(["golden", ...], enospc_at=2, under=out)

``kill_at`` is ``module:qualname``; the process SIGKILLs itself when that function is called
(``when="before"``) or has returned (``"after"``), on its ``nth`` call.
"""

from __future__ import annotations

import builtins
import errno
import functools
import importlib
import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SPEC_ENV = "K3BUNDLE_TEST_FAULTS"


class _Writes:
    def __init__(self, root: Path, nth: int | None):
        self.root, self.nth, self.count = str(Path(root).resolve()), nth, 0

    def hit(self, path: str | None) -> None:
        if path is None or not os.path.abspath(path).startswith(self.root):
            return
        self.count += 1
        if self.nth is not None and self.count >= self.nth:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


class _File:
    """A writable file object whose writes are counted (and may fail)."""

    def __init__(self, f, path: str, writes: _Writes):
        self._f, self._path, self._writes = f, path, writes

    def write(self, data):
        self._writes.hit(self._path)
        return self._f.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


@contextmanager
def disk_full(root: str | Path, nth: int | None = 1):
    """Make the ``nth`` write (and every later one) under ``root`` fail with ENOSPC; ``nth=None``
    only counts. Yields the counter (``.count``)."""
    writes = _Writes(root, nth)
    real = {n: getattr(os, n) for n in ("write", "pwrite", "pwritev", "posix_fallocate", "sendfile",
                                        "copy_file_range", "splice") if hasattr(os, n)}
    real_open = builtins.open

    def counted(name):
        def call(fd, *a, **kw):
            # the written descriptor: the first argument, but the second for copy_file_range/splice
            out_fd = a[0] if name in ("copy_file_range", "splice") else fd
            writes.hit(_fd_path(out_fd))
            return real[name](fd, *a, **kw)
        return call

    def open_(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        if any(c in mode for c in "wax+") and isinstance(file, (str, os.PathLike)):
            return _File(f, os.fspath(file), writes)
        return f

    try:
        for n in real:
            setattr(os, n, counted(n))
        builtins.open = open_
        yield writes
    finally:
        for n, f in real.items():
            setattr(os, n, f)
        builtins.open = real_open


def _resolve(target: str):
    module, qual = target.split(":")
    owner = importlib.import_module(module)
    parts = qual.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    return owner, parts[-1]


def kill_at(target: str, when: str = "before", nth: int = 1) -> None:
    """Patch ``module:qualname`` so that this process SIGKILLs itself at its ``nth`` call."""
    owner, name = _resolve(target)
    real = getattr(owner, name)
    calls = [0]

    @functools.wraps(real)
    def wrapper(*a, **kw):
        calls[0] += 1
        if when == "before" and calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*a, **kw)
        if when == "after" and calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, name, wrapper)


def run_cli_faulted(args: list[str], kill_at: str | None = None, when: str = "before", nth: int = 1,
                    enospc_at: int | None = None, under: str | Path | None = None,
                    env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m k3bundle ARGS`` in a subprocess with a kill point and/or a disk that fills up."""
    spec = {"kill_at": kill_at, "when": when, "nth": nth, "enospc_at": enospc_at,
            "under": str(under) if under else None}
    e = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
         _SPEC_ENV: json.dumps(spec), **(env or {})}
    e.pop("K3BUNDLE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tests.faults", *args], env=e, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _main() -> None:
    spec = json.loads(os.environ.pop(_SPEC_ENV))
    if spec["kill_at"]:
        kill_at(spec["kill_at"], spec["when"], spec["nth"])
    from k3bundle.cli.app import main

    sys.argv = ["k3bundle", *sys.argv[1:]]
    if spec["enospc_at"]:
        with disk_full(spec["under"], spec["enospc_at"]):
            main()
    else:
        main()


if __name__ == "__main__":
    _main()
