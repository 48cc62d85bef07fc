"""Modules a storage format loads only when it encodes or decodes.

The registry imports every format module, and ``k3bundle trace`` asks the registry for a
format's geometry, which is plain arithmetic; torch, numpy and the codecs take a second or more
to import. A format module therefore names them through ``lazy`` and they load on first use.
"""

from __future__ import annotations

import importlib


class lazy:  # noqa: N801 (used like a module)
    """A module imported on its first attribute use. Format modules reach torch, numpy and their
    codecs through it, so that importing a format (the registry does, for every one) costs
    nothing until it encodes or decodes."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name, self._module = name, None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
