"""A backend: the primitives of ``graph_manifest.json`` ``custom_ops`` that a device brings.

A backend is a Python module (or any object) with functions named after the ops it provides;
every op it lacks runs on the reference (the executor's own block functions) and is reported
"not covered". The contract of each op — arguments, shapes, dtypes, layouts — is in
``k3bundle.ops.contract.OP_CONTRACTS`` and docs/kernels.md; the reference implementations are the
executor's block modules, gathered in ``k3bundle.kernels.reference``.

Where a backend comes from (``load``):
- a built-in name: ``reference``, ``fla`` (fla-core's KDA kernels), ``torch`` (SDPA MLA prefill,
  batched-matmul MLA decode, grouped MXFP4 experts), ``planted:<bug>`` (one planted bug each);
- an entry point of group ``k3bundle.backends`` (name -> module);
- a dotted module path (``mypkg.k3_ops``), imported like any installed module, or from the
  working directory (``my_ops.py`` there, as ``python -m`` would find it).

A public function of the module whose name is close to an op's but is none (``gated_mla_prefil``)
is named in ``Backend.warnings``: it would otherwise be dropped silently, its op run on the
reference.

A module may also define ``NAME`` (for reports), ``DEVICES`` (device types it runs on, e.g.
``("cuda",)``) and ``setup(device)`` (called once before use; may raise to refuse the device).
"""

from __future__ import annotations

import difflib
import importlib
import sys
import types
from pathlib import Path

from k3bundle.errors import K3Error
from k3bundle.ops.contract import OP_CONTRACTS, OPS, REFERENCE, Backend  # noqa: F401 (the interface, re-exported)

ENTRY_POINT_GROUP = "k3bundle.backends"
BUILTIN = {"reference": "k3bundle.kernels.reference", "fla": "k3bundle.kernels.fla_kda",
           "torch": "k3bundle.kernels.torch_ops"}
PLANTED_PREFIX = "planted:"


def near_misses(mod: types.ModuleType) -> list[str]:
    """One line for each public function defined in ``mod`` whose name is close to an op name
    but is none: a misspelt op, which would otherwise run on the reference unnoticed."""
    out = []
    for attr, value in sorted(vars(mod).items()):
        mine = callable(value) and getattr(value, "__module__", None) == mod.__name__  # not an import
        if attr.startswith("_") or attr in OPS or not mine:
            continue
        close = difflib.get_close_matches(attr, OPS, n=1, cutoff=0.8)
        if close:
            out.append(f"backend module {mod.__name__}: function {attr!r} is no op; did you mean {close[0]!r}? "
                       f"(its op runs on the reference)")
    return out


def from_module(mod: types.ModuleType, name: str) -> Backend:
    ops = {op: getattr(mod, op) for op in OPS if callable(getattr(mod, op, None))}
    misses = near_misses(mod)
    if not ops:
        hint = f" ({misses[0]})" if misses else ""
        raise K3Error(f"backend {name!r} ({mod.__name__}) defines none of the ops {', '.join(OPS)}{hint}")
    devices = getattr(mod, "DEVICES", None)
    return Backend(getattr(mod, "NAME", name), ops, tuple(devices) if devices else None,
                   getattr(mod, "setup", None), tuple(misses), mod.__name__)


def print_warnings(backend: Backend) -> None:
    """``backend.warnings`` on stderr, one ``warning:`` line each (the commands that load one)."""
    for w in backend.warnings:
        sys.stderr.write(f"warning: {w}\n")


def _import(name: str) -> types.ModuleType:
    """``importlib.import_module``, falling back to the working directory (where ``python -m``
    would look, and the ``k3bundle`` script does not) when the module is not found elsewhere."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top, cwd = name.split(".")[0], str(Path.cwd())
        here = (Path(cwd) / f"{top}.py").is_file() or (Path(cwd) / top).is_dir()
        if e.name != top or not here or cwd in sys.path:
            raise
        sys.path.append(cwd)  # after the installed packages: a local file never shadows one
        return importlib.import_module(name)


def _entry_point(name: str):
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep
    return None


def load(name: str | None) -> Backend:
    """The backend called ``name`` (see the module docstring); None or "reference": the reference."""
    if name is None:
        return REFERENCE
    if name.startswith(PLANTED_PREFIX):
        from k3bundle.kernels import planted

        return planted.backend(name[len(PLANTED_PREFIX):])
    if name in BUILTIN:
        return from_module(importlib.import_module(BUILTIN[name]), name)
    ep = _entry_point(name)
    try:
        mod = ep.load() if ep is not None else _import(name)
    except ImportError as e:
        raise K3Error(f"backend {name!r}: cannot import it ({e}); give a built-in name "
                      f"({', '.join(BUILTIN)}, planted:<bug>), an entry point of group {ENTRY_POINT_GROUP!r} "
                      "or an importable module path (installed, on PYTHONPATH or in the working directory)") from None
    if not isinstance(mod, types.ModuleType):  # an entry point may name an object
        ops = {op: getattr(mod, op) for op in OPS if callable(getattr(mod, op, None))}
        return Backend(getattr(mod, "NAME", name), ops, module=ep.value)
    return from_module(mod, name)
