"""Device storage formats: which tensors a format writes for one weight slice, and their shapes.

A layout's ``formats`` gives each role a ``FormatRule`` (``k3bundle.layouts``). Given the
rule, the scale layout and the shape of one rank's (padded) slice of a weight, ``device_parts``
lists the device tensors that store it: part name, name suffix (from the schema's
``DEVICE_PARTS``; ``None`` keeps the source tensor's own name), dtype, shape, which source part
it is read from, the transform, and the row granularity the encoder works in.

Shapes are per weight (per expert for routed experts); stacking adds a leading expert dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3bundle.formats import mxfp4, nvfp4
from k3bundle.formats.scale_swizzle import swizzled_size
from k3bundle.io.dtypes import tensor_nbytes
from k3bundle.layouts import FormatRule
from k3bundle.schema import DEVICE_PARTS, Format, Role

FP8_BLOCK = 128

# mxfp4-from-bf16 writes the same tensors (and names) as MXFP4 pass-through
_NAMES_FROM = {"mxfp4-from-bf16": "mxfp4"}

#: Transforms whose output bytes are the source bytes, re-arranged at most (reassembly-provable).
EXACT_TRANSFORMS = ("copy", "swizzle-128x4")


@dataclass(frozen=True, slots=True)
class DevicePart:
    part: str  # "weight", "packed", "scale", "global_scale"
    suffix: str | None  # appended to the weight stem; None = the source tensor's own name
    dtype: str
    shape: tuple[int, ...]  # per weight (per expert)
    source_part: str | None  # the source part it is read from; None = every part (derived formats)
    transform: str  # "copy", "swizzle-128x4", "fp8-e4m3-channel", "nvfp4-from-mxfp4", ...
    rows_per_group: int  # input rows per encoder call: 1, 128 (FP8 blocks), 0 = the whole source tensor

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def storage_name(rule: FormatRule, role: Role) -> str:
    """The concrete storage of a role: ``source``/``bf16``/``f32`` collapse to the source format."""
    if rule.format in ("source", "bf16", "f32", "mxfp4"):
        return "mxfp4" if role.fmt is Format.MXFP4 else "source"
    return rule.format


def device_parts(role: Role, rule: FormatRule, swizzled: bool, shape: tuple[int, ...],
                 source_dtype: str) -> list[DevicePart]:
    """The device tensors storing one (padded) slice of ``role`` of logical ``shape``.

    Args:
        role: the tensor role.
        rule: its format rule from the layout.
        swizzled: the layout's scale layout is ``swizzled-128x4`` (MXFP4/NVFP4 scales only).
        shape: logical shape of the slice, padding included (dequantized shape for MXFP4).
        source_dtype: the stored dtype of the (non-MXFP4) source tensor.
    """
    name = storage_name(rule, role)
    if name == "source":
        return [DevicePart("weight", None, source_dtype, shape, "weight", "copy", 1)]
    rows, cols = shape
    suffixes = {p: s for p, s, _ in DEVICE_PARTS[_NAMES_FROM.get(name, name)]}
    if name == "mxfp4":  # pass-through of an MXFP4 pair; swizzling the scale is a pure permutation
        nb = cols // mxfp4.BLOCK
        if swizzled:
            scale = DevicePart("scale", suffixes["scale"], "U8", (swizzled_size(rows, nb),), "scale",
                               "swizzle-128x4", 1)
        else:
            scale = DevicePart("scale", suffixes["scale"], "U8", (rows, nb), "scale", "copy", 1)
        return [DevicePart("packed", suffixes["packed"], "U8", (rows, cols // 2), "packed", "copy", 1), scale]
    if name == "nvfp4":
        nb = cols // nvfp4.BLOCK
        scale_shape = (swizzled_size(rows, nb),) if swizzled else (rows, nb)
        t = "nvfp4-from-mxfp4"
        return [DevicePart("packed", suffixes["packed"], "U8", (rows, cols // 2), None, t, 0),
                DevicePart("scale", suffixes["scale"], "F8_E4M3", scale_shape, None,
                           t + ("+swizzle-128x4" if swizzled else ""), 0),
                DevicePart("global_scale", suffixes["global_scale"], "F32", (1,), None, t, 0)]
    if name == "fp8-e4m3-channel":
        return [DevicePart("weight", suffixes["weight"], "F8_E4M3", (rows, cols), None, name, 1),
                DevicePart("scale", suffixes["scale"], "F32", (rows,), None, name, 1)]
    if name == "fp8-e4m3-block128":
        grid = (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
        return [DevicePart("weight", suffixes["weight"], "F8_E4M3", (rows, cols), None, name, FP8_BLOCK),
                DevicePart("scale", suffixes["scale"], "F32", grid, None, name, FP8_BLOCK)]
    if name == "mxfp4-from-bf16":
        t = f"mxfp4-from-bf16({rule.scale_rule})"
        g = 1
        nb = cols // mxfp4.BLOCK
        scale_shape = (swizzled_size(rows, nb),) if swizzled else (rows, nb)
        return [DevicePart("packed", suffixes["packed"], "U8", (rows, cols // 2), None, t, g),
                DevicePart("scale", suffixes["scale"], "U8", scale_shape, None,
                           t + ("+swizzle-128x4" if swizzled else ""), g)]
    raise ValueError(f"unknown storage {name!r}")  # parse_layout only lets known formats through
