"""``nvfp4``: the release's MXFP4 routed experts transcoded to NVFP4.

E2M1 codes, an E4M3 scale per 16 (row-major or swizzled 128x4) and one f32 global scale per
tensor (docs/formats.md). The codec's global scale is the dequant multiplier; the layout's
convention says what is stored (compressed-tensors: its reciprocal; ModelOpt: itself) and names
the tensors (``storage.conventions``). The global scale is a property of the
whole source tensor, so the transcode (``nvfp4.from_mxfp4``) sees the whole expert tensor and
every rank slices the result: all ranks of an expert share one global scale.
"""

from __future__ import annotations

from k3bundle.formats.geometry import MXFP4_BLOCK, NVFP4_BLOCK
from k3bundle.schema import Format, Role
from k3bundle.storage.base import DevicePart, StorageFormat, block_scale
from k3bundle.storage.lazy import lazy
from k3bundle.storage.mxfp4 import source_code_byte, source_scale_byte

arrays, nvfp4 = lazy("k3bundle.storage.arrays"), lazy("k3bundle.formats.nvfp4")
np, torch = lazy("numpy"), lazy("torch")

TRANSFORM = "nvfp4-from-mxfp4"


class NVFP4(StorageFormat):
    name = "nvfp4"
    layout_names = ("nvfp4",)
    column_block = MXFP4_BLOCK  # slices of the MXFP4 source
    whole_tensor = True
    requantized_part = "packed"
    gemm_op = "nvfp4_weight_gemm"
    peak_bucket = "nvfp4"
    swizzles_scales = True
    described = {"compressed-tensors": {"format": "nvfp4-pack-quantized", "weights": {
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
        "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}},
        "modelopt": {"quant_algo": "NVFP4", "group_size": 16}}

    def fits(self, layout_name: str, role: Role) -> str:
        if role.fmt is Format.MXFP4:
            return ""
        return (f"{layout_name} needs an MXFP4 source (routed experts), but {role.role} is stored "
                f"{role.fmt.value}")

    def parts(self, shape, swizzled, source_dtype, scale_rule):
        rows, cols = shape
        # each part reads the whole pair; source_part names the tensor its codes/scales come from
        name = self.convention.suffix
        return [DevicePart("packed", name("packed"), "U8", (rows, cols // 2), "packed", TRANSFORM, 0),
                block_scale(name("scale"), "F8_E4M3", rows, cols // NVFP4_BLOCK, swizzled, "scale", TRANSFORM, 0),
                DevicePart("global_scale", name("global_scale"), "F32", (1,), "packed", TRANSFORM, 0)]

    def span(self, part):
        return {"packed": (1, 2), "scale": (1, NVFP4_BLOCK)}.get(part, (1, 1))

    def trace_element(self, part, i, j, byte, s):
        """A code byte <- the same codes in the MXFP4 source (unless its block was re-quantized); an
        E4M3 scale <- the E8M0 scale of the 32-block its 16 columns lie in; the global scale <- the
        whole source tensor."""
        row = s.rows[0] + i
        if part == "global_scale":
            return {"source": {"file": s.file, "key": s.key, "rows": s.rows, "cols": s.cols,
                               "note": "multiplier 2^(largest live exponent - 8) over the whole source tensor, "
                                       "stored as the layout's convention means it (compressed-tensors: 1 / multiplier)"},
                    "scale": {"key": s.scale_key, "rows": s.scale["rows"], "cols": s.scale["cols"]}}
        if part == "packed":
            col = s.c0 // 2 + j
            return {"source": {**source_code_byte(s, row, col),
                               "note": "same E2M1 codes as this source byte when its 32-block fits E4M3 "
                                       "(else re-quantized: manifest nvfp4_requantized)"},
                    "scale": source_scale_byte(s, s.scale_key, row, (2 * col) // MXFP4_BLOCK)}
        lc = s.c0 + j * NVFP4_BLOCK
        return {"source": {"file": s.file, **source_scale_byte(s, s.key, row, lc // MXFP4_BLOCK),
                           "logical_cols": [lc, lc + NVFP4_BLOCK]}}

    def encode_tensor(self, parts: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[list[int]]]:
        """Whole MXFP4 pair -> packed [R, C/2], scale [R, C/16] E4M3 bytes, global_scale [1, 4] f32
        (the dequant multiplier as the convention stores it), and the re-quantized 32-blocks as
        ``[row, block]`` pairs (empty when lossless)."""
        out, blocks = self.encode_stack([parts])
        return {k: v[0] for k, v in out.items()}, blocks[0]

    def encode_stack(self, stack):
        """``encode_tensor`` of T same-shaped pairs in one ``nvfp4.from_mxfp4_stack`` pass."""
        packed = torch.from_numpy(np.stack([p["packed"] for p in stack]))
        scale = torch.from_numpy(np.stack([p["scale"] for p in stack]))
        p16, s16, g, bad = nvfp4.from_mxfp4_stack(packed, scale)
        any_bad = bad.reshape(len(stack), -1).any(-1).tolist()
        blocks = [[[int(r), int(b)] for r, b in bad[t].nonzero().tolist()] if any_bad[t] else []
                  for t in range(len(stack))]
        stored = arrays.u8(self.convention.store_global(g)).reshape(len(stack), 1, -1)
        return {"packed": p16.numpy(), "scale": s16.numpy(), "global_scale": stored}, blocks

    def slice_tensor(self, parts, rows, cols):
        r = slice(*rows)
        packed, scale = parts["packed"][..., r, :], parts["scale"][..., r, :]
        if cols is not None:
            c, d = cols
            packed = packed[..., c // 2: d // 2]
            scale = scale[..., c // NVFP4_BLOCK: d // NVFP4_BLOCK]
        return {"packed": packed, "scale": scale, "global_scale": parts["global_scale"]}

    def decode(self, parts, out_dtype):
        packed = parts["packed"]
        rows, cols = packed.shape[-2], packed.shape[-1] * 2
        scale = arrays.row_major_scale(parts["scale"], rows, cols // NVFP4_BLOCK)
        multiplier = self.convention.load_global(parts["global_scale"].reshape(()))
        return nvfp4.dequantize(packed, scale.view(torch.uint8), multiplier, out_dtype)

    def decode_stack(self, parts, out_dtype):
        packed = parts["packed"]
        n, rows, cols = packed.shape[0], packed.shape[-2], packed.shape[-1] * 2
        scale = arrays.row_major_scale(parts["scale"], rows, cols // NVFP4_BLOCK, stack=n)
        multiplier = self.convention.load_global(parts["global_scale"].reshape(n)).reshape(n, 1, 1, 1)
        return nvfp4.dequantize(packed, scale.view(torch.uint8), multiplier, out_dtype)


FORMAT = NVFP4()
