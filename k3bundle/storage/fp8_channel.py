"""``fp8-e4m3-channel``: BF16 linear weights as E4M3 with one f32 scale per output channel."""

from __future__ import annotations

import numpy as np
import torch

from k3bundle.formats import fp8
from k3bundle.storage.base import DevicePart, StorageFormat, bf16_linear_misfit, bf16_rows, u8


class FP8Channel(StorageFormat):
    name = "fp8-e4m3-channel"
    layout_names = ("fp8-e4m3-channel",)
    gemm_op = "fp8_e4m3_channel_gemm"
    peak_bucket = "fp8"
    described = {"compressed-tensors": {"format": "float-quantized", "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
        "dynamic": False}}}

    def fits(self, layout_name, role):
        return bf16_linear_misfit(layout_name, role)

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        rows, cols = shape
        name = self.convention.suffix
        # [rows, 1]: compressed-tensors' channel-strategy scale, broadcast over the row's columns
        return [DevicePart("weight", name("weight"), "F8_E4M3", (rows, cols), "weight", self.name, 1),
                DevicePart("scale", name("scale"), "F32", (rows, 1), "weight", self.name, 1)]

    def encode(self, part: str, rows: np.ndarray, scale_rule) -> dict[str, np.ndarray]:
        """BF16 rows [n, 2C] -> weight [n, C] E4M3 bytes, scale [n, 4] (f32 dequant multiplier)."""
        q, scale = fp8.quantize_channel(bf16_rows(rows))
        return {"weight": u8(q), "scale": u8(scale.to(torch.float32))}

    def decode(self, parts, out_dtype):
        q = parts["weight"]
        return fp8.dequantize_channel(q, parts["scale"].reshape(q.shape[:-1]), out_dtype)


FORMAT = FP8Channel()
