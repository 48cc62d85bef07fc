"""``source`` (and ``bf16``, ``f32``): a tensor exactly as the checkpoint stores it.

A layout's ``source`` keeps every role's own storage: a BF16/F32 tensor is copied under its own
name, and an MXFP4 pair resolves to the ``mxfp4`` pass-through format. ``bf16`` and ``f32`` say
the same for a role and additionally assert its source dtype.
"""

from __future__ import annotations

import math

from k3bundle.schema import Format, Role
from k3bundle.storage.base import COPY, DevicePart, SliceSource, StorageFormat


class Source(StorageFormat):
    name = "source"
    layout_names = ("source", "bf16", "f32")
    peak_bucket = "bf16"

    def resolve(self, role: Role) -> str:
        return "mxfp4" if role.fmt is Format.MXFP4 else self.name

    def fits(self, layout_name: str, role: Role) -> str:
        if layout_name == "source" or role.fmt.value == layout_name:
            return ""
        return (f"{layout_name} keeps a {layout_name.upper()} tensor as is, but {role.role} is stored "
                f"{role.fmt.value}")

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        return [DevicePart("weight", None, source_dtype, shape, "weight", COPY, 1)]

    def trace_element(self, part: str, i: int, j: int, byte: int, s: SliceSource) -> dict:
        """A copy: one device byte <- the same byte of the same element of the source."""
        logical = s.logical_shape
        inner = math.prod(logical[1:]) if len(logical) > 1 else 1
        row, col = s.rows[0] + i, s.c0 + j
        b = (row * inner + col) * s.element_bytes + byte
        return {"source": {"file": s.file, "key": s.key, "element": [row, col] if len(logical) > 1 else [row],
                           "bytes": [b, b + 1]}}

    def encode(self, part, rows, scale_rule):
        return {part: rows}

    def decode(self, parts, out_dtype):
        return parts["weight"]


FORMAT = Source()
