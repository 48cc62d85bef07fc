"""``fp8-e4m3-channel``: BF16 linear weights as E4M3 with one f32 scale per output channel."""

from __future__ import annotations

from k3bundle.storage.base import QuantizedBF16, codes_and_scale
from k3bundle.storage.lazy import lazy

arrays, fp8, torch = lazy("k3bundle.storage.arrays"), lazy("k3bundle.formats.fp8"), lazy("torch")


def fp8_bound(want: torch.Tensor) -> torch.Tensor:
    """|x' - x| <= 2^-4 |x| + 2^-10 amax / 448: half an ulp of 3 mantissa bits, half a subnormal
    step of the largest scale."""
    return want.abs() * 2.0**-4 + want.abs().amax() * 2.0**-10 / fp8.E4M3_MAX


class FP8Channel(QuantizedBF16):
    name = "fp8-e4m3-channel"
    layout_names = ("fp8-e4m3-channel",)
    gemm_op = "fp8_e4m3_channel_gemm"
    peak_bucket = "fp8"
    described = {"compressed-tensors": {"format": "float-quantized", "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
        "dynamic": False}}}

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        # [rows, 1]: compressed-tensors' channel-strategy scale, broadcast over the row's columns
        return codes_and_scale(self, shape, "F8_E4M3", "F32", (shape[0], 1))

    def trace_element(self, part, i, j, byte, s):
        """An E4M3 element <- one BF16 element; a row's scale <- the whole row of the slice."""
        row = s.rows[0] + i
        if part == "weight":
            return {"source": s.bf16(row, row + 1, s.c0 + j, s.c0 + j + 1)}
        return {"source": s.bf16(row, row + 1, s.c0, s.c0 + (s.cols[1] - s.cols[0]))}

    def value_bound(self, want):
        return fp8_bound(want)

    def encode(self, part, rows, scale_rule):
        """BF16 rows [n, 2C] -> weight [n, C] E4M3 bytes, scale [n, 4] (f32 dequant multiplier)."""
        q, scale = fp8.quantize_channel(arrays.bf16_rows(rows))
        return {"weight": arrays.u8(q), "scale": arrays.u8(scale.to(torch.float32))}

    def decode(self, parts, out_dtype):
        q = parts["weight"]
        return fp8.dequantize_channel(q, parts["scale"].reshape(q.shape[:-1]), out_dtype)


FORMAT = FP8Channel()
