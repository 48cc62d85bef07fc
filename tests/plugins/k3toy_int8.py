"""A storage format from outside k3bundle, for tests/test_storage_plugin.py: ``int8-g64``.

BF16 linear weights as INT8 codes with one BF16 scale per 64 columns of a row (the group's
largest magnitude / 127). The test installs this module under a temporary directory with an
entry point of group ``k3bundle.storage_formats``; k3bundle itself never names it.
"""

from __future__ import annotations

from k3bundle.storage.base import QuantizedBF16, codes_and_scale
from k3bundle.storage.lazy import lazy

arrays, torch = lazy("k3bundle.storage.arrays"), lazy("torch")

GROUP = 64  # columns per scale
#: compressed-tensors' config-group description of these weights
SCHEME = {"format": "int-quantized", "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                 "group_size": GROUP, "strategy": "group", "dynamic": False}}


class Int8Group64(QuantizedBF16):
    name = "int8-g64"
    layout_names = ("int8-g64",)
    column_block = GROUP
    gemm_op, peak_bucket = "int8_g64_gemm", "fp8"  # no int8 chain in the roofline: no faster than FP8
    described = {"compressed-tensors": SCHEME}

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        return codes_and_scale(self, shape, "I8", "BF16", (shape[0], shape[1] // GROUP))

    def span(self, part):
        return (1, GROUP) if part == "scale" else (1, 1)

    def trace_element(self, part, i, j, byte, s):
        row, per = s.rows[0] + i, self.span(part)[1]
        return {"source": s.bf16(row, row + 1, s.c0 + per * j, s.c0 + per * (j + 1))}

    def value_bound(self, want):
        # rounding to a step of the scale (half a step), the scale's BF16 rounding (1/4 step at most)
        return arrays.block_amax(want, GROUP) / 127

    def encode(self, part, rows, scale_rule):
        x = arrays.bf16_rows(rows).to(torch.float32)
        g = x.reshape(x.shape[0], -1, GROUP)
        scale = (g.abs().amax(-1) / 127).to(torch.bfloat16)
        s = scale.to(torch.float32).unsqueeze(-1)
        q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
        return {"weight": arrays.u8(q.to(torch.int8).reshape(x.shape)), "scale": arrays.u8(scale)}

    def decode(self, parts, out_dtype):
        q, scale = parts["weight"], parts["scale"]
        g = q.to(torch.float32).reshape(*q.shape[:-1], -1, GROUP) * scale.to(torch.float32).unsqueeze(-1)
        return g.reshape(q.shape).to(out_dtype)


FORMAT = Int8Group64()
