"""``mxfp4``: the release's MXFP4 routed experts passed through byte for byte.

The E2M1 codes (``weight_packed``) are copied; the E8M0 scales per 32 (``weight_scale``) are
copied, or permuted into the 128x4 swizzled layout, which is exact too (docs/formats.md).
"""

from __future__ import annotations

from k3bundle.formats.geometry import MXFP4_BLOCK as BLOCK
from k3bundle.schema import Format, Role
from k3bundle.storage.base import COPY, DevicePart, SliceSource, StorageFormat, block_scale
from k3bundle.storage.lazy import lazy

arrays, mxfp4, torch = lazy("k3bundle.storage.arrays"), lazy("k3bundle.formats.mxfp4"), lazy("torch")

#: compressed-tensors' config-group description of MXFP4 weights (its ``MXFP4A16`` preset)
MXFP4_SCHEME = {"format": "mxfp4-pack-quantized", "weights": {
    "num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group", "dynamic": False,
    "scale_dtype": "torch.uint8"}}
#: (rows, columns) of the logical weight behind one stored element of each part of an MXFP4 pair
PAIR_SPAN = {"packed": (1, 2), "scale": (1, BLOCK)}


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
    scale = block_scale(name("scale"), "U8", rows, cols // BLOCK, swizzled,
                        "scale" if pass_through else "weight", transform, rows_per_group)
    return [packed, scale]


def mxfp4_decode(parts: dict[str, torch.Tensor], out_dtype: torch.dtype, stack: int = 0) -> torch.Tensor:
    return mxfp4.dequantize(*stored_pair(parts, stack), out_dtype)


def stored_pair(parts: dict[str, torch.Tensor], stack: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored codes and the E8M0 scales as a row-major uint8 matrix (of each expert, with ``stack``)."""
    packed = parts["packed"]
    rows, cols = packed.shape[-2], packed.shape[-1] * 2
    return packed, arrays.row_major_scale(parts["scale"], rows, cols // BLOCK, stack).view(torch.uint8)


def source_code_byte(s: SliceSource, row: int, col: int) -> dict:
    """Byte ``col`` (two codes) of row ``row`` of the source's packed codes."""
    b = row * (s.logical_shape[1] // 2) + col
    return {"file": s.file, "key": s.key, "element": [row, col], "bytes": [b, b + 1],
            "logical_cols": [2 * col, 2 * col + 2]}


def source_scale_byte(s: SliceSource, key: str, row: int, block: int) -> dict:
    """The E8M0 scale of 32-block ``block`` of row ``row`` in the source's scale tensor ``key``."""
    b = row * (s.logical_shape[1] // BLOCK) + block
    return {"key": key, "element": [row, block], "bytes": [b, b + 1]}


class MXFP4(StorageFormat):
    name = "mxfp4"
    layout_names = ("mxfp4",)
    column_block = BLOCK
    gemm_op = "mxfp4_weight_gemm"
    peak_bucket = "mxfp4"
    swizzles_scales = True
    stores_mxfp4 = True
    described = {"compressed-tensors": MXFP4_SCHEME}

    def fits(self, layout_name: str, role: Role) -> str:
        if role.fmt is Format.MXFP4:
            return ""
        return (f"{layout_name} needs an MXFP4 source (routed experts), but {role.role} is stored "
                f"{role.fmt.value}; use mxfp4-from-bf16 to quantize it")

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        return mxfp4_parts(self, shape, swizzled, COPY, 1, pass_through=True)

    def span(self, part):
        return PAIR_SPAN[part]

    def trace_element(self, part, i, j, byte, s):
        """The pass-through pair: a code byte or a scale byte <- the same byte of the source's."""
        row = s.rows[0] + i
        if part == "packed":
            col = s.c0 // 2 + j
            return {"source": source_code_byte(s, row, col),
                    "scale": source_scale_byte(s, s.scale_key, row, (2 * col) // BLOCK)}
        col = s.c0 // BLOCK + j
        return {"source": {"file": s.file, **source_scale_byte(s, s.key, row, col),
                           "logical_cols": [col * BLOCK, (col + 1) * BLOCK]}}

    def encode(self, part, rows, scale_rule):
        return {part: rows}

    def decode(self, parts, out_dtype):
        return mxfp4_decode(parts, out_dtype)

    def decode_stack(self, parts, out_dtype):
        return mxfp4_decode(parts, out_dtype, stack=parts["packed"].shape[0])

    def mxfp4_pair(self, parts):
        return stored_pair(parts)


FORMAT = MXFP4()
