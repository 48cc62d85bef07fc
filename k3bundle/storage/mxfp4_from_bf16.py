"""``mxfp4-from-bf16``: BF16 linear weights quantized to MXFP4 with a declared scale rule.

Writes the same tensors (names, dtypes, scale layout) as the ``mxfp4`` pass-through; the scale
rule (``floor`` / ``rceil`` / ``even``, docs/formats.md) is part of the transform's name.
"""

from __future__ import annotations

from k3bundle.formats.geometry import MXFP4_BLOCK as BLOCK
from k3bundle.formats.geometry import MXFP4_SCALE_RULES as SCALE_RULES
from k3bundle.storage.base import QuantizedBF16
from k3bundle.storage.lazy import lazy
from k3bundle.storage.mxfp4 import MXFP4_SCHEME, PAIR_SPAN, mxfp4_decode, mxfp4_parts, stored_pair

arrays, mxfp4 = lazy("k3bundle.storage.arrays"), lazy("k3bundle.formats.mxfp4")


class MXFP4FromBF16(QuantizedBF16):
    name = "mxfp4-from-bf16"
    layout_names = ("mxfp4-from-bf16",)
    scale_rules = SCALE_RULES
    column_block = BLOCK
    gemm_op = "mxfp4_weight_gemm"
    peak_bucket = "mxfp4"
    swizzles_scales = True
    stores_mxfp4 = True
    described = {"compressed-tensors": MXFP4_SCHEME}

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        return mxfp4_parts(self, shape, swizzled, f"mxfp4-from-bf16({scale_rule})", 1, pass_through=False)

    def span(self, part):
        return PAIR_SPAN[part]

    def trace_element(self, part, i, j, byte, s):
        """A byte of two E2M1 codes <- two BF16 elements; a scale <- its 32-block of BF16 elements."""
        row, per = s.rows[0] + i, PAIR_SPAN[part][1]
        k0 = s.c0 + per * j
        return {"source": s.bf16(row, row + 1, k0, k0 + per)}

    def value_bound(self, want):
        """E2M1 rounding and FLOOR saturation: a third of the 32-block's largest magnitude."""
        return arrays.block_amax(want, BLOCK) / 3

    def encode(self, part, rows, scale_rule):
        """BF16 rows [n, 2C] -> packed [n, C/2], scale [n, C/32] (``mxfp4.quantize``)."""
        packed, scales = mxfp4.quantize(arrays.bf16_rows(rows), scale_rule=scale_rule)
        return {"packed": packed.numpy(), "scale": scales.numpy()}

    def decode(self, parts, out_dtype):
        return mxfp4_decode(parts, out_dtype)

    def mxfp4_pair(self, parts):
        return stored_pair(parts)


FORMAT = MXFP4FromBF16()
