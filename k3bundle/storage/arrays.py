"""The array helpers of the storage formats' encoders and decoders (torch and numpy).

Kept apart from ``base`` so that the registry and the geometry load neither: a format module
reaches these through ``base.lazy`` when it encodes or decodes.
"""

from __future__ import annotations

import numpy as np
import torch

from k3bundle.formats.scale_swizzle import swizzle, swizzle_stack, unswizzle, unswizzle_stack

def row_major_scale(scale: torch.Tensor, rows: int, blocks: int, stack: int = 0) -> torch.Tensor:
    """A stored block scale as a [rows, blocks] matrix: un-swizzled when it is stored flat. With
    ``stack`` = T, a stack of T experts' scales ([T, rows, blocks], or [T, flat]) -> [T, rows, blocks]."""
    if stack:
        if scale.ndim == 3:
            return scale
        return unswizzle_stack(scale.reshape(stack, -1), rows, blocks)
    if scale.ndim == 1 or scale.shape[-1] != blocks:
        return unswizzle(scale.reshape(-1), rows, blocks)
    return scale


def swizzle_rows(scale_rows: np.ndarray) -> np.ndarray:
    """Row-major scale bytes [R, C] -> the 128x4 swizzled layout (flat, zero padded); a stack
    [T, R, C] -> [T, flat] (each matrix swizzled on its own)."""
    t = torch.from_numpy(np.ascontiguousarray(scale_rows))
    return (swizzle_stack(t) if t.ndim == 3 else swizzle(t)).numpy()


def bf16_rows(rows: np.ndarray) -> torch.Tensor:
    """[n, 2C] uint8 (BF16 bytes) -> [n, C] torch.bfloat16 sharing memory."""
    return torch.from_numpy(np.ascontiguousarray(rows)).view(torch.bfloat16)


def u8(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's bytes as a uint8 array of shape [rows, row_bytes] (1-D -> [n, itemsize])."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], -1).numpy()


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element of [rows, cols], the largest magnitude of its ``block``-column block."""
    rows, cols = x.shape
    a = x.abs().reshape(rows, cols // block, block).amax(-1, keepdim=True)
    return a.expand(rows, cols // block, block).reshape(rows, cols)
