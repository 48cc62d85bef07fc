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
- a dotted module path (``mypkg.k3_ops``), imported like any installed module.

A module may also define ``NAME`` (for reports), ``DEVICES`` (device types it runs on, e.g.
``("cuda",)``) and ``setup(device)`` (called once before use; may raise to refuse the device).
"""

from __future__ import annotations

import importlib
import types

from k3bundle.errors import K3Error
from k3bundle.ops.contract import OP_CONTRACTS, OPS, REFERENCE, Backend  # noqa: F401 (the interface, re-exported)

ENTRY_POINT_GROUP = "k3bundle.backends"
BUILTIN = {"reference": "k3bundle.kernels.reference", "fla": "k3bundle.kernels.fla_kda",
           "torch": "k3bundle.kernels.torch_ops"}
PLANTED_PREFIX = "planted:"


def from_module(mod: types.ModuleType, name: str) -> Backend:
    ops = {op: getattr(mod, op) for op in OPS if callable(getattr(mod, op, None))}
    if not ops:
        raise K3Error(f"backend {name!r} ({mod.__name__}) defines none of the ops {', '.join(OPS)}")
    devices = getattr(mod, "DEVICES", None)
    return Backend(getattr(mod, "NAME", name), ops, tuple(devices) if devices else None,
                   getattr(mod, "setup", None))


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
        mod = ep.load() if ep is not None else importlib.import_module(name)
    except ImportError as e:
        raise K3Error(f"backend {name!r}: cannot import it ({e}); give a built-in name "
                      f"({', '.join(BUILTIN)}, planted:<bug>), an entry point of group {ENTRY_POINT_GROUP!r} "
                      "or an importable module path") from None
    if not isinstance(mod, types.ModuleType):  # an entry point may name an object
        ops = {op: getattr(mod, op) for op in OPS if callable(getattr(mod, op, None))}
        return Backend(getattr(mod, "NAME", name), ops)
    return from_module(mod, name)
