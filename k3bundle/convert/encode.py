"""Encoders for the derived storage formats: source rows in, device bytes out (no I/O).

Arrays are numpy ``uint8`` views of raw little-endian bytes, one row per weight row; the
codecs themselves are ``k3bundle.formats`` (torch). Quantization always works on one rank's
slice of a weight (its rows and columns), so a device file depends only on the bytes of the
source slice it holds. The NVFP4 transcode is the exception that proves the rule: its global
scale is a property of the whole source tensor, so ``nvfp4_from_mxfp4`` sees the whole
expert tensor and every rank slices the result (all ranks of an expert share one scale).
"""

from __future__ import annotations

import numpy as np
import torch

from k3bundle.formats import fp8, mxfp4, nvfp4
from k3bundle.formats.scale_swizzle import swizzle


def bf16_rows(rows: np.ndarray) -> torch.Tensor:
    """[n, 2C] uint8 (BF16 bytes) -> [n, C] torch.bfloat16 sharing memory."""
    return torch.from_numpy(np.ascontiguousarray(rows)).view(torch.bfloat16)


def u8(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's bytes as a uint8 array of shape [rows, row_bytes] (1-D -> [n, itemsize])."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], -1).numpy()


def fp8_channel(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Per-output-channel E4M3: weight [n, C] bytes, scale [n, 4] (f32 dequant multiplier)."""
    q, scale = fp8.quantize_channel(bf16_rows(rows))
    return {"weight": u8(q), "scale": u8(scale.to(torch.float32))}


def fp8_block(rows: np.ndarray) -> dict[str, np.ndarray]:
    """128x128-block E4M3 of up to 128 rows: weight [n, C], scale [1, ceil(C/128) * 4]."""
    q, scale = fp8.quantize_block(bf16_rows(rows))
    return {"weight": u8(q), "scale": u8(scale.to(torch.float32))}


def mxfp4_from_bf16(rows: np.ndarray, scale_rule: str) -> dict[str, np.ndarray]:
    """MXFP4 with the declared scale rule: packed [n, C/2], scale [n, C/32]."""
    packed, scales = mxfp4.quantize(bf16_rows(rows), scale_rule=scale_rule)
    return {"packed": packed.numpy(), "scale": scales.numpy()}


def nvfp4_from_mxfp4(packed: np.ndarray, scale: np.ndarray
                     ) -> tuple[dict[str, np.ndarray], list[list[int]]]:
    """Whole-tensor MXFP4 -> NVFP4 transcode (``nvfp4.from_mxfp4``).

    Returns the parts (packed [R, C/2], scale [R, C/16] E4M3 bytes, global_scale [1, 4] f32)
    and the re-quantized 32-blocks as ``[row, block]`` pairs (empty when lossless).
    """
    p16, s16, g, bad = nvfp4.from_mxfp4(torch.from_numpy(np.ascontiguousarray(packed)),
                                        torch.from_numpy(np.ascontiguousarray(scale)))
    blocks = [[int(r), int(b)] for r, b in bad.nonzero().tolist()] if bool(bad.any()) else []
    return {"packed": p16.numpy(), "scale": s16.numpy(),
            "global_scale": u8(g.reshape(1).to(torch.float32))}, blocks


def pad_cols(rows: np.ndarray, width: int) -> np.ndarray:
    """Append zero bytes to each row up to ``width`` bytes (no copy when already that wide)."""
    if rows.shape[1] == width:
        return rows
    out = np.zeros((rows.shape[0], width), dtype=np.uint8)
    out[:, : rows.shape[1]] = rows
    return out


def swizzle_rows(scale_rows: np.ndarray) -> np.ndarray:
    """Row-major scale bytes [R, C] -> the 128x4 swizzled layout (flat, zero padded)."""
    return swizzle(torch.from_numpy(np.ascontiguousarray(scale_rows))).numpy()
