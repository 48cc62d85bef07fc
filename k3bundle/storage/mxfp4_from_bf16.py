"""``mxfp4-from-bf16``: BF16 linear weights quantized to MXFP4 with a declared scale rule.

Writes the same tensors (names, dtypes, scale layout) as the ``mxfp4`` pass-through; the scale
rule (``floor`` / ``rceil`` / ``even``, docs/formats.md) is part of the transform's name.
"""

from __future__ import annotations

import numpy as np

from k3bundle.formats import mxfp4
from k3bundle.storage.base import StorageFormat, bf16_linear_misfit, bf16_rows
from k3bundle.storage.mxfp4 import MXFP4_SCHEME, mxfp4_decode, mxfp4_parts


class MXFP4FromBF16(StorageFormat):
    name = "mxfp4-from-bf16"
    layout_names = ("mxfp4-from-bf16",)
    scale_rules = mxfp4.SCALE_RULES
    column_block = mxfp4.BLOCK
    gemm_op = "mxfp4_weight_gemm"
    peak_bucket = "mxfp4"
    swizzles_scales = True
    described = {"compressed-tensors": MXFP4_SCHEME}

    def fits(self, layout_name, role):
        return bf16_linear_misfit(layout_name, role)

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        return mxfp4_parts(self, shape, swizzled, f"mxfp4-from-bf16({scale_rule})", 1, pass_through=False)

    def encode(self, part: str, rows: np.ndarray, scale_rule) -> dict[str, np.ndarray]:
        """BF16 rows [n, 2C] -> packed [n, C/2], scale [n, C/32] (``mxfp4.quantize``)."""
        packed, scales = mxfp4.quantize(bf16_rows(rows), scale_rule=scale_rule)
        return {"packed": packed.numpy(), "scale": scales.numpy()}

    def decode(self, parts, out_dtype):
        return mxfp4_decode(parts, out_dtype)


FORMAT = MXFP4FromBF16()
