"""The storage-format registry: every way a weight slice may be stored on the device.

One module per format, each defining ``FORMAT`` (a ``base.StorageFormat``): its names in a
layout, whether it fits a role, its device parts, how the converter encodes them and how the
bundle reader decodes them. Layouts, plan, convert and the bundle reader ask this registry and
never branch on a format's name. Adding a format is adding a module (docs/formats.md).

May import ``k3bundle.formats`` (the codecs), ``k3bundle.schema`` and ``k3bundle.io``; never
layouts, plan, convert or bundle.
"""

from __future__ import annotations

import importlib
import pkgutil

from k3bundle.schema import Role
from k3bundle.storage.base import EXACT_TRANSFORMS, DevicePart, StorageFormat
from k3bundle.storage.conventions import COMPRESSED_TENSORS, CONVENTIONS, MODELOPT, Convention, convention


def _discover() -> dict[str, StorageFormat]:
    found: dict[str, StorageFormat] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        fmt = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FORMAT", None)
        if fmt is None:
            continue
        if fmt.name in found:
            raise RuntimeError(f"storage format {fmt.name!r} is defined twice ({info.name})")
        found[fmt.name] = fmt
    return found


#: storage name (as written in the bundle index) -> format
STORAGE: dict[str, StorageFormat] = _discover()
#: format name a layout may write -> the format it selects
LAYOUT_NAMES: dict[str, StorageFormat] = {n: f for f in STORAGE.values() for n in f.layout_names}
assert len(LAYOUT_NAMES) == sum(len(f.layout_names) for f in STORAGE.values()), "a layout name is taken twice"


def storage_for(layout_name: str, role: Role, convention_name: str = COMPRESSED_TENSORS) -> StorageFormat:
    """The concrete storage of ``role`` when a layout gives it ``layout_name``, under the layout's
    tensor convention (names and scale semantics, ``storage.conventions``)."""
    return STORAGE[LAYOUT_NAMES[layout_name].resolve(role)].under(convention_name)


__all__ = ["COMPRESSED_TENSORS", "CONVENTIONS", "Convention", "DevicePart", "EXACT_TRANSFORMS", "LAYOUT_NAMES",
           "MODELOPT", "STORAGE", "StorageFormat", "convention", "storage_for"]
