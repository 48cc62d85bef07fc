"""``mxfp4``: the release's MXFP4 routed experts passed through byte for byte.

The E2M1 codes (``weight_packed``) are copied; the E8M0 scales per 32 (``weight_scale``) are
copied, or permuted into the 128x4 swizzled layout, which is exact too (docs/formats.md).
"""

from __future__ import annotations

import numpy as np
import torch

from k3bundle.formats import mxfp4
from k3bundle.schema import Format, Role
from k3bundle.storage.base import DevicePart, StorageFormat, block_scale, row_major_scale

#: compressed-tensors' config-group description of MXFP4 weights (its ``MXFP4A16`` preset)
MXFP4_SCHEME = {"format": "mxfp4-pack-quantized", "weights": {
    "num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group", "dynamic": False,
    "scale_dtype": "torch.uint8"}}


def mxfp4_parts(fmt: StorageFormat, shape: tuple[int, ...], swizzled: bool, transform: str,
                rows_per_group: int, pass_through: bool) -> list[DevicePart]:
    """The packed codes [rows, cols/2] and the E8M0 scales [rows, cols/32] of an MXFP4 slice.

    ``pass_through``: each part is read from the source part of the same name (else from the
    BF16 weight).
    """
    rows, cols = shape
    name = fmt.convention.suffix  # compressed-tensors: the checkpoint's own pair of names
    packed = DevicePart("packed", name("packed"), "U8", (rows, cols // 2), "packed" if pass_through else "weight",
                        transform, rows_per_group)
    scale = block_scale(name("scale"), "U8", rows, cols // mxfp4.BLOCK, swizzled,
                        "scale" if pass_through else "weight", transform, rows_per_group)
    return [packed, scale]


def mxfp4_decode(parts: dict[str, torch.Tensor], out_dtype: torch.dtype, stack: int = 0) -> torch.Tensor:
    packed = parts["packed"]
    rows, cols = packed.shape[-2], packed.shape[-1] * 2
    scale = row_major_scale(parts["scale"], rows, cols // mxfp4.BLOCK, stack)
    return mxfp4.dequantize(packed, scale.view(torch.uint8), out_dtype)


class MXFP4(StorageFormat):
    name = "mxfp4"
    layout_names = ("mxfp4",)
    column_block = mxfp4.BLOCK
    gemm_op = "mxfp4_weight_gemm"
    peak_bucket = "mxfp4"
    swizzles_scales = True
    described = {"compressed-tensors": MXFP4_SCHEME}

    def fits(self, layout_name: str, role: Role) -> str:
        if role.fmt is Format.MXFP4:
            return ""
        return (f"{layout_name} needs an MXFP4 source (routed experts), but {role.role} is stored "
                f"{role.fmt.value}; use mxfp4-from-bf16 to quantize it")

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        return mxfp4_parts(self, shape, swizzled, "copy", 1, pass_through=True)

    def encode(self, part: str, rows: np.ndarray, scale_rule) -> dict[str, np.ndarray]:
        return {part: rows}

    def decode(self, parts, out_dtype):
        return mxfp4_decode(parts, out_dtype)

    def decode_stack(self, parts, out_dtype):
        return mxfp4_decode(parts, out_dtype, stack=parts["packed"].shape[0])


FORMAT = MXFP4()
