"""The common interface of a storage format and the device tensors it writes.

A *storage format* says how one weight slice is stored on the device: which tensors (parts)
hold it, how the converter makes their bytes from the source checkpoint's bytes, and how the
bundle reader turns them back into values. Each format is one module of ``k3bundle.storage``
defining ``FORMAT``, an instance of a ``StorageFormat`` subclass; the package collects them
(docs/formats.md "Adding a storage format").

Encoders are pure functions on numpy ``uint8`` arrays of raw little-endian bytes, one row per
weight row; the math is the codecs of ``k3bundle.formats`` (torch).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from k3bundle.formats import mxfp4
from k3bundle.formats.scale_swizzle import swizzle, swizzle_stack, swizzled_size, unswizzle, unswizzle_stack
from k3bundle.io.dtypes import dtype_bits, tensor_nbytes
from k3bundle.schema import Format, Role
from k3bundle.storage.conventions import COMPRESSED_TENSORS, Convention, convention

#: Transforms whose output bytes are the source bytes, re-arranged at most (reassembly-provable).
EXACT_TRANSFORMS = ("copy", "swizzle-128x4")
SWIZZLE = "swizzle-128x4"


@dataclass(frozen=True, slots=True)
class DevicePart:
    """One device tensor storing a weight slice (per expert for routed experts)."""

    part: str  # "weight", "packed", "scale", "global_scale"
    suffix: str | None  # appended to the weight stem; None = the source tensor's own name
    dtype: str
    shape: tuple[int, ...]  # per weight (per expert); stacking adds a leading expert dim
    source_part: str  # the source part it is read from ("weight", "packed", "scale"); the index names its key
    transform: str  # "copy", "swizzle-128x4", "fp8-e4m3-channel", "nvfp4-from-mxfp4", ...
    rows_per_group: int  # input rows per encoder call: 1, 128 (FP8 blocks), 0 = the whole source tensor
    rows_per_row: int = 1  # input rows per stored row (128 for FP8 block scales)
    swizzled_cols: int = 0  # columns of the scale matrix before the 128x4 swizzle; 0 = not swizzled

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the row-major (un-swizzled) part."""
        if self.swizzled_cols:
            return self.swizzled_cols * dtype_bits(self.dtype) // 8
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


def block_scale(suffix: str, dtype: str, rows: int, blocks: int, swizzled: bool, source_part: str,
                transform: str, rows_per_group: int) -> DevicePart:
    """A per-row block-scale part [rows, blocks], or its flat 128x4 swizzle (``swizzled``)."""
    if not swizzled:
        return DevicePart("scale", suffix, dtype, (rows, blocks), source_part, transform, rows_per_group)
    t = SWIZZLE if transform == "copy" else f"{transform}+{SWIZZLE}"
    return DevicePart("scale", suffix, dtype, (swizzled_size(rows, blocks),), source_part, t, rows_per_group,
                      swizzled_cols=blocks)


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


def source_byte_cols(part: str, cols: tuple[int, int], dtype: str) -> tuple[int, int]:
    """Byte columns of a stored *source* part holding logical columns ``cols``.

    The checkpoint stores BF16/F32 tensors as they are and MXFP4 as a pair: ``packed`` holds
    two E2M1 codes per byte, ``scale`` one E8M0 byte per 32-element block (spec §2.10).
    """
    c, d = cols
    if part == "packed":
        return c // 2, d // 2
    if part == "scale":
        return c // mxfp4.BLOCK, d // mxfp4.BLOCK
    s = dtype_bits(dtype) // 8
    return c * s, d * s


def bf16_linear_misfit(name: str, role: Role) -> str:
    """Why a format that quantizes BF16 linear weights cannot store ``role`` ('' when it can)."""
    if role.fmt is not Format.BF16:
        return f"{name} quantizes BF16 weights, but {role.role} is stored {role.fmt.value}"
    if len(role.shape) != 2 or not role.template.endswith(".weight"):
        return f"{name} quantizes 2-D linear weights, but {role.role} has shape [{', '.join(role.shape)}]"
    return ""


_UNDER: dict[tuple[str, str], "StorageFormat"] = {}


class StorageFormat:
    """One storage format. Subclasses set the attributes and implement the methods they use.

    Encoding comes in two kinds. *Row* formats (``rows_per_group`` >= 1 in their parts) see one
    rank's slice of a source part a few rows at a time: ``encode`` maps those rows to the rows
    of each device part. *Whole-tensor* formats (``rows_per_group`` 0) need every part of the
    whole source tensor first (NVFP4's global scale spans the tensor): ``encode_tensor`` makes
    the device parts of the whole tensor and ``slice_tensor`` cuts one rank's slice out of them.
    """

    name: str = ""  # as written in the bundle index ("storage")
    layout_names: tuple[str, ...] = ()  # format names a layout may give a role to select it
    scale_rules: tuple[str, ...] = ()  # choices of the layout's ``scale_rule`` (empty: it takes none)
    column_block: int = 0  # a slice must hold whole blocks of this many columns (0: any slice)
    whole_tensor: bool = False  # encode_tensor/slice_tensor instead of encode
    requantized_part: str = ""  # whole-tensor formats: the source part that re-quantized blocks index
    gemm_op: str = ""  # the GEMM kernel a serving engine needs for weights in this format
    peak_bucket: str = "bf16"  # the card's peak_flops entry those GEMMs run at
    swizzles_scales: bool = False  # the layout's scale_layout applies to its scales
    #: per convention, how its description file describes weights in this format: compressed-tensors
    #: a config group's ``format`` and ``weights``; modelopt a ``quant_algo`` and ``group_size``.
    #: Empty for formats that do not quantize.
    described: dict[str, dict] = {}
    #: the layout's tensor convention: device names and scale semantics (``storage.conventions``)
    convention: Convention = convention(COMPRESSED_TENSORS)

    def under(self, name: str) -> "StorageFormat":
        """This format writing and reading its tensors by convention ``name``."""
        if name == self.convention.name:
            return self
        key = (self.name, name)
        if key not in _UNDER:
            other = copy.copy(self)
            other.convention = convention(name)
            _UNDER[key] = other
        return _UNDER[key]

    def resolve(self, role: Role) -> str:
        """The concrete storage name of ``role`` under this format (e.g. source -> mxfp4)."""
        return self.name

    def fits(self, layout_name: str, role: Role) -> str:
        """Why ``layout_name`` cannot store ``role``, in one line ('' when it can)."""
        raise NotImplementedError

    def parts(self, shape: tuple[int, ...], swizzled: bool, source_dtype: str,
              scale_rule: str | None) -> list[DevicePart]:
        """The device tensors storing one (padded) slice of logical ``shape``.

        ``swizzled``: the layout's scale layout is swizzled-128x4; ``source_dtype``: the stored
        dtype of a non-MXFP4 source tensor; ``scale_rule``: the layout's rule, if the format takes one.
        """
        raise NotImplementedError

    def encode(self, part: str, rows: np.ndarray, scale_rule: str | None) -> dict[str, np.ndarray]:
        """Row formats: rows of source ``part`` (one rank's columns) -> rows of each device part."""
        raise NotImplementedError

    def encode_tensor(self, parts: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[list[int]]]:
        """Whole-tensor formats: every source part -> (device parts, re-quantized [row, block]s)."""
        raise NotImplementedError

    def encode_stack(self, stack: list[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], list[list[list[int]]]]:
        """Whole-tensor formats: ``encode_tensor`` of each member of a stack of same-shaped
        tensors, each device part stacked [T, ...] (convert's batch of small experts)."""
        outs = [self.encode_tensor(parts) for parts in stack]
        return {k: np.stack([o[k] for o, _ in outs]) for k in outs[0][0]}, [r for _, r in outs]

    def slice_tensor(self, parts: dict[str, np.ndarray], rows: tuple[int, int],
                     cols: tuple[int, int] | None) -> dict[str, np.ndarray]:
        """Whole-tensor formats: one rank's slice (logical rows/cols) of ``encode_tensor``'s
        parts; the same for ``encode_stack``'s (the slice is of the last two dimensions)."""
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
        """The device parts of one slice back to logical values (padding included)."""
        raise NotImplementedError

    def decode_stack(self, parts: dict[str, torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
        """``decode`` of a rank's stacked experts ([T, ...] per part) -> [T, rows, cols]; formats
        that decode a stack in one pass override this (verify's value check of 82k experts)."""
        n = next(iter(parts.values())).shape[0]
        return torch.stack([self.decode({k: v[t] for k, v in parts.items()}, out_dtype) for t in range(n)])
