"""The storage-format registry: every way a weight slice may be stored on the device.

One module per format, each defining ``FORMAT`` (a ``base.StorageFormat``): its names in a
layout, whether it fits a role, its device parts and their geometry, how the converter encodes
them, how the bundle reader decodes them and where a device byte came from (``trace_element``).
Layouts, plan, convert, the bundle reader, verify, trace and the checklist ask this registry and
never branch on a format's name. Adding a format is adding a module (docs/formats.md): one of
this package, or one of an installed package named by an entry point of group
``k3bundle.storage_formats`` (name -> module defining ``FORMAT``), found the first time a name
is not among the package's own.

Importing the registry loads no torch (``storage.lazy``): ``k3bundle trace`` reads geometry only.

May import ``k3bundle.formats`` (the codecs), ``k3bundle.schema`` and ``k3bundle.io``; never
layouts, plan, convert or bundle.
"""

from __future__ import annotations

import importlib
import pkgutil

from k3bundle.errors import K3Error
from k3bundle.schema import Role
from k3bundle.storage.base import COPY, EXACT_TRANSFORMS, SWIZZLE, DevicePart, SliceSource, StorageFormat, is_swizzled
from k3bundle.storage.conventions import COMPRESSED_TENSORS, CONVENTIONS, MODELOPT, Convention, convention

ENTRY_POINT_GROUP = "k3bundle.storage_formats"
#: the layout format name that keeps every role as the checkpoint stores it
AS_STORED = "source"
#: modules of this package that define no format
_NOT_FORMATS = {"arrays", "base", "conventions", "lazy"}

#: storage name (as written in the bundle index) -> format
STORAGE: dict[str, StorageFormat] = {}
#: format name a layout may write -> the format it selects
LAYOUT_NAMES: dict[str, StorageFormat] = {}
_installed: set[str] = set()  # entry points already registered ("name = value")


def register(fmt: StorageFormat, where: str) -> None:
    """Add ``fmt`` (defined in ``where``) to the registry; a name already taken is an error."""
    if not isinstance(fmt, StorageFormat) or not fmt.name or not fmt.layout_names:
        raise K3Error(f"storage format module {where}: FORMAT must be a StorageFormat with a name and layout_names")
    taken = [n for n in fmt.layout_names if n in LAYOUT_NAMES] + ([fmt.name] if fmt.name in STORAGE else [])
    if taken:
        raise K3Error(f"storage format module {where}: the name {taken[0]!r} is taken by another format")
    STORAGE[fmt.name] = fmt
    LAYOUT_NAMES.update({n: fmt for n in fmt.layout_names})


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name not in _NOT_FORMATS:
            register(importlib.import_module(f"{__name__}.{info.name}").FORMAT, f"{__name__}.{info.name}")


def load_installed() -> None:
    """Register the formats of installed packages (entry points of ``ENTRY_POINT_GROUP``, each
    naming a module that defines ``FORMAT``) not registered yet."""
    from importlib.metadata import entry_points  # costs 60 ms: only when a name is not the package's

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if f"{ep.name} = {ep.value}" in _installed:
            continue
        try:
            module = ep.load()
        except ImportError as e:
            raise K3Error(f"storage format entry point {ep.name!r} ({ep.value}): cannot import it ({e})") from None
        _installed.add(f"{ep.name} = {ep.value}")
        register(getattr(module, "FORMAT", module), ep.value)


def stored_format(name: str) -> StorageFormat | None:
    """The format a bundle index's ``storage`` names, None when no format has that name."""
    if name not in STORAGE:
        load_installed()
    return STORAGE.get(name)


def layout_format(layout_name: str) -> StorageFormat | None:
    """The format a layout's format name selects, None when no format takes that name."""
    if layout_name not in LAYOUT_NAMES:
        load_installed()
    return LAYOUT_NAMES.get(layout_name)


def storage_for(layout_name: str, role: Role, convention_name: str = COMPRESSED_TENSORS) -> StorageFormat:
    """The concrete storage of ``role`` when a layout gives it ``layout_name``, under the layout's
    tensor convention (names and scale semantics, ``storage.conventions``)."""
    return STORAGE[layout_format(layout_name).resolve(role)].under(convention_name)


_discover()

__all__ = ["AS_STORED", "COMPRESSED_TENSORS", "CONVENTIONS", "COPY", "Convention", "DevicePart",
           "ENTRY_POINT_GROUP", "EXACT_TRANSFORMS", "LAYOUT_NAMES", "MODELOPT", "STORAGE", "SWIZZLE",
           "SliceSource", "StorageFormat", "convention", "is_swizzled", "layout_format", "load_installed",
           "register", "storage_for", "stored_format"]
