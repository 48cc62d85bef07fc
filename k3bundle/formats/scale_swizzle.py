"""The 128x4 swizzled block-scale layout read by NVIDIA block-scaled GEMMs.

Source: cuBLAS documentation, "1D Block Scaling Factors Layout"
(https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout);
torchao ``to_blocked`` (torchao/prototype/mx_formats/utils.py) implements the same.

A scale matrix [R, C] (one byte per 32- or 16-element block, rows = output rows)
is zero-padded to [ceil(R/128)*128, ceil(C/4)*4] and cut into 128x4 tiles. Tiles
are stored one after another, row-major over (row tile, column tile); each tile
is 512 bytes where element (r, c) of the tile sits at
``(r % 32) * 16 + (r // 32) * 4 + c``.
"""

import torch

from k3bundle.errors import CodecError
from k3bundle.formats.geometry import SWIZZLE_TILE_COLS as TILE_COLS
from k3bundle.formats.geometry import SWIZZLE_TILE_ROWS as TILE_ROWS


def _tiles(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // TILE_ROWS), -(-cols // TILE_COLS)


def swizzled_size(rows: int, cols: int) -> int:
    """Number of elements in the swizzled layout of a [rows, cols] scale matrix."""
    n_rt, n_ct = _tiles(rows, cols)
    return n_rt * n_ct * TILE_ROWS * TILE_COLS


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """Row-major scales [R, C] -> flat swizzled tensor (same dtype, zero padding).

    Args:
        scales: 2-D tensor [R, C] of scale bytes (uint8, or any 1-byte/float dtype).

    Returns:
        1-D tensor of `swizzled_size(R, C)` elements.
    """
    if scales.ndim != 2:
        raise CodecError(f"scale_swizzle.swizzle: expected a 2-D scale matrix, got {tuple(scales.shape)}")
    rows, cols = scales.shape
    n_rt, n_ct = _tiles(rows, cols)
    padded = scales.new_zeros(n_rt * TILE_ROWS, n_ct * TILE_COLS)
    padded[:rows, :cols] = scales
    # row r = rt*128 + q*32 + p (q = r//32 within the tile, p = r%32); column = ct*4 + c
    by_rt_q_p_ct_c = padded.reshape(n_rt, 4, 32, n_ct, TILE_COLS)
    by_rt_ct_p_q_c = by_rt_q_p_ct_c.permute(0, 3, 2, 1, 4)
    return by_rt_ct_p_q_c.reshape(-1)


def unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle`: flat swizzled tensor -> [rows, cols] (padding dropped).

    Args:
        flat: 1-D tensor of `swizzled_size(rows, cols)` elements.
        rows, cols: shape of the original scale matrix.

    Returns:
        contiguous tensor [rows, cols] of the same dtype.
    """
    want = swizzled_size(rows, cols)
    if flat.ndim != 1 or flat.numel() != want:
        raise CodecError(
            f"scale_swizzle.unswizzle: flat {tuple(flat.shape)} does not hold [{rows}, {cols}] "
            f"swizzled ({want} elements)"
        )
    n_rt, n_ct = _tiles(rows, cols)
    by_rt_ct_p_q_c = flat.reshape(n_rt, n_ct, 32, 4, TILE_COLS)
    by_rt_q_p_ct_c = by_rt_ct_p_q_c.permute(0, 3, 2, 1, 4)
    padded = by_rt_q_p_ct_c.reshape(n_rt * TILE_ROWS, n_ct * TILE_COLS)
    return padded[:rows, :cols].contiguous()


def swizzle_stack(scales: torch.Tensor) -> torch.Tensor:
    """``swizzle`` of each matrix of a stack [T, R, C] at once -> [T, swizzled_size(R, C)]."""
    if scales.ndim != 3:
        raise CodecError(f"scale_swizzle.swizzle_stack: expected a stack [T, R, C], got {tuple(scales.shape)}")
    t, rows, cols = scales.shape
    n_rt, n_ct = _tiles(rows, cols)
    padded = scales.new_zeros(t, n_rt * TILE_ROWS, n_ct * TILE_COLS)
    padded[:, :rows, :cols] = scales
    by_rt_q_p_ct_c = padded.reshape(t, n_rt, 4, 32, n_ct, TILE_COLS)
    return by_rt_q_p_ct_c.permute(0, 1, 4, 3, 2, 5).reshape(t, -1)


def unswizzle_stack(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_stack``: [T, swizzled_size(rows, cols)] -> [T, rows, cols]."""
    want = swizzled_size(rows, cols)
    if flat.ndim != 2 or flat.shape[1] != want:
        raise CodecError(f"scale_swizzle.unswizzle_stack: {tuple(flat.shape)} does not hold a stack of "
                         f"[{rows}, {cols}] swizzled ({want} elements each)")
    t = flat.shape[0]
    n_rt, n_ct = _tiles(rows, cols)
    by_rt_q_p_ct_c = flat.reshape(t, n_rt, n_ct, 32, 4, TILE_COLS).permute(0, 1, 4, 3, 2, 5)
    return by_rt_q_p_ct_c.reshape(t, n_rt * TILE_ROWS, n_ct * TILE_COLS)[:, :rows, :cols].contiguous()
