"""``fp8-e4m3-block128``: BF16 linear weights as E4M3 with one f32 scale per 128x128 block."""

from __future__ import annotations

import math

from k3bundle.formats.geometry import FP8_BLOCK as BLOCK
from k3bundle.storage.base import QuantizedBF16, codes_and_scale
from k3bundle.storage.fp8_channel import fp8_bound
from k3bundle.storage.lazy import lazy

arrays, fp8, torch = lazy("k3bundle.storage.arrays"), lazy("k3bundle.formats.fp8"), lazy("torch")


class FP8Block128(QuantizedBF16):
    name = "fp8-e4m3-block128"
    layout_names = ("fp8-e4m3-block128",)
    gemm_op = "fp8_e4m3_block128_gemm"
    peak_bucket = "fp8"
    described = {"compressed-tensors": {"format": "float-quantized", "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "block",
        "block_structure": [BLOCK, BLOCK], "dynamic": False}}}

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        grid = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
        return codes_and_scale(self, shape, "F8_E4M3", "F32", grid, rows_per_group=BLOCK, rows_per_row=BLOCK)

    def span(self, part):
        return (BLOCK, BLOCK) if part == "scale" else (1, 1)

    def trace_element(self, part, i, j, byte, s):
        """An E4M3 element <- one BF16 element; a scale <- its 128x128 block (cut at the slice's edge)."""
        if part == "weight":
            row = s.rows[0] + i
            return {"source": s.bf16(row, row + 1, s.c0 + j, s.c0 + j + 1)}
        r0, k0 = s.rows[0] + BLOCK * i, s.c0 + BLOCK * j
        return {"source": s.bf16(r0, min(r0 + BLOCK, s.rows[1]), k0, min(k0 + BLOCK, s.cols[1]))}

    def value_bound(self, want):
        return fp8_bound(want)

    def encode(self, part, rows, scale_rule):
        """Up to 128 BF16 rows [n, 2C] -> weight [n, C] E4M3 bytes, scale [1, ceil(C/128) * 4]."""
        q, scale = fp8.quantize_block(arrays.bf16_rows(rows), BLOCK)
        return {"weight": arrays.u8(q), "scale": arrays.u8(scale.to(torch.float32))}

    def decode(self, parts, out_dtype):
        return fp8.dequantize_block(parts["weight"], parts["scale"], out_dtype)


FORMAT = FP8Block128()
