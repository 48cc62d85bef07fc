"""How the command line uses the CPU: OpenMP's wait policy, torch's intra-op thread count, the collector.

torch's CPU kernels run on OpenMP (libgomp in the PyPI wheels). By default a libgomp thread that
reaches the end of a parallel region spins ~300,000 iterations before it sleeps; the executor's
ops on the shipped models are small, so its threads spend most of a run spinning. Alone on the
machine that only wastes power, but next to one other busy process the spinning threads and the
process take turns on the cores: the README's demo ran 4x to 10x slower where sharing 2 cores
should cost it at most 2x (docs/performance.md "Under load"). The command line therefore, once, at start:

- sets ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep at once), ``GOMP_SPINCOUNT=0`` and
  ``KMP_BLOCKTIME=0`` (the same for libgomp's own knob and for Intel's OpenMP), before torch is
  imported, because OpenMP reads them when it is loaded. Child processes (torchrun workers)
  inherit them. If the user set any of the three, none is touched.
- picks torch's intra-op thread count: ``K3BUNDLE_THREADS`` if set; else, if ``OMP_NUM_THREADS`` is
  set, torch's own choice from it; else the CPUs this process may use: its affinity mask, capped
  by a cgroup CPU quota (torch counts the mask only, so a container limited to 2 CPUs of a
  64-core host would run 64 threads).

- raises the cyclic garbage collector's thresholds (``GC_THRESHOLD``). A command at the release's
  497,220 tensors holds a few million small objects (header entries, index entries, specs) that
  live for the whole run and are freed by reference counting; with Python's default (700, 10, 10)
  the collector re-walks them over and over: opening the full-depth checkpoint took 12.1 s with it,
  6.0 s without (docs/performance.md "Release scale").

Measured on 2 cores (docs/performance.md "Under load"): with passive wait, one competing process
costs the demo ~1.0-1.1x (spinning: over 9x), for ~15% more time idle than spinning; a short spin
(``GOMP_SPINCOUNT=10000``) is no faster idle and 2.5x slower loaded; one thread and two run the
demo equally fast.

Library callers (the tests, scripts) keep torch's defaults unless they call ``apply()``.
"""

from __future__ import annotations

import gc
import math
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from k3bundle.errors import K3Error

THREADS_ENV = "K3BUNDLE_THREADS"
GC_THRESHOLD = (100_000, 20, 20)  # objects allocated between young collections; older-generation ratios
WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}


@dataclass(frozen=True)
class Policy:
    threads: int | None  # None: torch keeps its own choice (the user set OMP_NUM_THREADS)
    threads_from: str  # THREADS_ENV, "OMP_NUM_THREADS" or "available CPUs"
    wait: dict[str, str]  # the OpenMP wait variables this process (and its children) run with


def prepare_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the passive wait policy unless the user chose one; must run before torch is imported."""
    if not any(k in environ for k in WAIT_ENV):
        environ.update(WAIT_ENV)


def choose_threads(environ: MutableMapping[str, str] = os.environ, cpus: int | None = None) -> tuple[int | None, str]:
    """(intra-op threads to set, or None to keep torch's; where the number comes from)."""
    if environ.get(THREADS_ENV, "").strip():
        raw = environ[THREADS_ENV].strip()
        if not raw.isdigit() or int(raw) < 1:
            raise K3Error(f"{THREADS_ENV}={raw!r}: expected a whole number of threads >= 1")
        return int(raw), THREADS_ENV
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None, "OMP_NUM_THREADS"
    return (cpus if cpus is not None else available_cpus()), "available CPUs"


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (>= 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 ``cpu.max`` or v1 CFS quota); None: no limit."""
    try:
        v2 = (root / "cpu.max").read_text().split()
    except OSError:
        v2 = None
    if v2:
        return None if v2[0] == "max" else int(v2[0]) / int(v2[1])
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def apply(environ: MutableMapping[str, str] = os.environ) -> Policy:
    """The command line's policy: the wait environment first, then torch's thread count. Runs after
    the command's modules are imported: a command that does not load torch (``trace``) is not made
    to load it here, and one that does has it loaded by then (command modules import their
    libraries at the top)."""
    prepare_environment(environ)
    gc.set_threshold(*GC_THRESHOLD)
    threads, threads_from = choose_threads(environ)
    torch = sys.modules.get("torch")
    if threads is not None and torch is not None:
        torch.set_num_threads(threads)
    return Policy(threads, threads_from, {k: environ[k] for k in WAIT_ENV if k in environ})
