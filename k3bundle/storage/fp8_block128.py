"""``fp8-e4m3-block128``: BF16 linear weights as E4M3 with one f32 scale per 128x128 block."""

from __future__ import annotations

import math

import numpy as np
import torch

from k3bundle.formats import fp8
from k3bundle.formats.geometry import FP8_BLOCK as BLOCK
from k3bundle.storage.base import DevicePart, StorageFormat, bf16_linear_misfit, bf16_rows, u8


class FP8Block128(StorageFormat):
    name = "fp8-e4m3-block128"
    layout_names = ("fp8-e4m3-block128",)
    gemm_op = "fp8_e4m3_block128_gemm"
    peak_bucket = "fp8"
    described = {"compressed-tensors": {"format": "float-quantized", "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "block",
        "block_structure": [BLOCK, BLOCK], "dynamic": False}}}

    def fits(self, layout_name, role):
        return bf16_linear_misfit(layout_name, role)

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        rows, cols = shape
        grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
        name = self.convention.suffix
        return [DevicePart("weight", name("weight"), "F8_E4M3", (rows, cols), "weight", self.name, BLOCK),
                DevicePart("scale", name("scale"), "F32", grid, "weight", self.name, BLOCK, rows_per_row=BLOCK)]

    def encode(self, part: str, rows: np.ndarray, scale_rule) -> dict[str, np.ndarray]:
        """Up to 128 BF16 rows [n, 2C] -> weight [n, C] E4M3 bytes, scale [1, ceil(C/128) * 4]."""
        q, scale = fp8.quantize_block(bf16_rows(rows), BLOCK)
        return {"weight": u8(q), "scale": u8(scale.to(torch.float32))}

    def decode(self, parts, out_dtype):
        return fp8.dequantize_block(parts["weight"], parts["scale"], out_dtype)


FORMAT = FP8Block128()
