"""The common interface of a storage format and the device tensors it writes.

A *storage format* says how one weight slice is stored on the device: which tensors (parts)
hold it, their geometry (how many source rows and columns one stored element stands for), how
the converter makes their bytes from the source checkpoint's bytes, how the bundle reader turns
them back into values, and where any device byte came from (``k3bundle trace``). Each format is
one module defining ``FORMAT``, an instance of a ``StorageFormat`` subclass; the registry
collects them (docs/formats.md "Adding a storage format").

Encoders are pure functions on numpy ``uint8`` arrays of raw little-endian bytes, one row per
weight row; the math is the codecs of ``k3bundle.formats`` (torch). The geometry and the trace
arithmetic are plain numbers: a format module loads torch, numpy and its codec only when it
encodes or decodes (``storage.lazy``), so the registry, and ``k3bundle trace`` through it, load none.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from k3bundle.formats.geometry import MXFP4_BLOCK
from k3bundle.io.dtypes import dtype_bits, tensor_nbytes
from k3bundle.schema import Format, Role
from k3bundle.storage.conventions import COMPRESSED_TENSORS, Convention, convention
from k3bundle.storage.lazy import lazy


np, torch = lazy("numpy"), lazy("torch")
scale_swizzle = lazy("k3bundle.formats.scale_swizzle")

COPY = "copy"  # the transform of a part that is its source part's bytes
SWIZZLE = "swizzle-128x4"  # a scale permuted into 128x4 tiles; after another transform: "<that>+swizzle-128x4"
#: Transforms whose output bytes are the source bytes, re-arranged at most (reassembly-provable).
EXACT_TRANSFORMS = (COPY, SWIZZLE)


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


def is_swizzled(transform: str) -> bool:
    """Whether a part with this transform is a flat 128x4-swizzled scale."""
    return transform == SWIZZLE or transform.endswith(f"+{SWIZZLE}")


def block_scale(suffix: str, dtype: str, rows: int, blocks: int, swizzled: bool, source_part: str,
                transform: str, rows_per_group: int) -> DevicePart:
    """A per-row block-scale part [rows, blocks], or its flat 128x4 swizzle (``swizzled``)."""
    if not swizzled:
        return DevicePart("scale", suffix, dtype, (rows, blocks), source_part, transform, rows_per_group)
    t = SWIZZLE if transform == COPY else f"{transform}+{SWIZZLE}"
    return DevicePart("scale", suffix, dtype, (scale_swizzle.swizzled_size(rows, blocks),), source_part, t, rows_per_group,
                      swizzled_cols=blocks)


def codes_and_scale(fmt: "StorageFormat", shape: tuple[int, int], dtype: str, scale_dtype: str,
                    scale_shape: tuple[int, ...], rows_per_group: int = 1, rows_per_row: int = 1) -> list[DevicePart]:
    """The parts of a format that re-codes a BF16 weight: codes [rows, cols] of ``dtype`` and a
    row-major scale matrix, both made from the source weight by transform ``fmt.name``."""
    name = fmt.convention.suffix
    return [DevicePart("weight", name("weight"), dtype, shape, "weight", fmt.name, rows_per_group),
            DevicePart("scale", name("scale"), scale_dtype, scale_shape, "weight", fmt.name, rows_per_group,
                       rows_per_row=rows_per_row)]


def source_byte_cols(part: str, cols: tuple[int, int], dtype: str) -> tuple[int, int]:
    """Byte columns of a stored *source* part holding logical columns ``cols``.

    The checkpoint stores BF16/F32 tensors as they are and MXFP4 as a pair: ``packed`` holds
    two E2M1 codes per byte, ``scale`` one E8M0 byte per 32-element block (docs/formats.md).
    """
    c, d = cols
    if part == "packed":
        return c // 2, d // 2
    if part == "scale":
        return c // MXFP4_BLOCK, d // MXFP4_BLOCK
    s = dtype_bits(dtype) // 8
    return c * s, d * s


def bf16_linear_misfit(name: str, role: Role) -> str:
    """Why a format that quantizes BF16 linear weights cannot store ``role`` ('' when it can)."""
    if role.fmt is not Format.BF16:
        return f"{name} quantizes BF16 weights, but {role.role} is stored {role.fmt.value}"
    if len(role.shape) != 2 or not role.template.endswith(".weight"):
        return f"{name} quantizes 2-D linear weights, but {role.role} has shape [{', '.join(role.shape)}]"
    return ""


@dataclass(frozen=True)
class SliceSource:
    """The source of one device slice as the bundle index records it: what a format's
    ``trace_element`` maps device elements back into. Rows and columns are logical (codes, not
    bytes, for an MXFP4 pair), as in the index."""

    file: str
    key: str  # the source tensor this part is read from (one expert's, for stacked experts)
    scale_key: str | None  # the release's E8M0 scales paired with it (an MXFP4 source), else None
    logical_shape: list[int]
    rows: list[int]  # [first, stop) of the slice
    cols: list[int] | None  # [first, stop), None: every column
    element_bytes: int  # bytes of one element of the device part
    scale: dict | None = None  # the index's ``scale`` record of an MXFP4 source (rows, block cols)

    @property
    def c0(self) -> int:
        return self.cols[0] if self.cols else 0

    def bf16(self, r0: int, r1: int, k0: int, k1: int) -> dict:
        """Source BF16 elements rows [r0, r1) x columns [k0, k1), with the byte span they lie in."""
        c = self.logical_shape[1]
        return {"file": self.file, "key": self.key, "rows": [r0, r1], "cols": [k0, k1],
                "bytes": [(r0 * c + k0) * 2, ((r1 - 1) * c + k1) * 2]}


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
    #: decode gives the source values exactly (a whole-tensor format: except the blocks the manifest
    #: lists as re-quantized); lossy formats bound their error in ``value_bound``
    lossless: bool = True
    #: its parts are the release's MXFP4 pair (E2M1 codes, E8M0 scales per 32), which kernels that
    #: read MXFP4 directly may take as they are (``mxfp4_pair``)
    stores_mxfp4: bool = False
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

    def named_under(self, convention_name: str) -> bool:
        """Whether a layout of that tensor convention may store weights in this format: a format
        that quantizes must be described by the convention's description file."""
        return not self.described or convention_name in self.described

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

    def span(self, part: str) -> tuple[int, int]:
        """(source rows, source columns) one stored element of ``part`` stands for: (1, 1) an
        element kept or re-coded one for one, (1, 2) a byte of two E2M1 codes, (1, 32) an MXFP4
        block scale, (128, 128) an FP8 block scale. A stored part of a slice is its (padded) rows /
        span rows by its columns / span columns, so what lies beyond the slice's real rows and
        columns is padding, and a swizzled scale's row-major matrix has that many columns
        (``k3bundle trace``, verify's reassembly)."""
        return 1, 1

    def trace_element(self, part: str, i: int, j: int, byte: int, s: SliceSource) -> dict:
        """Where element (i, j) of device ``part`` of a slice (row i, column j of the part's
        row-major matrix; its byte ``byte``) came from: ``{"source": {...}}`` naming the source
        tensor, element(s) and byte span, plus ``"scale"`` where a source scale goes with it.
        Arithmetic on the index's numbers only: ``k3bundle trace`` loads no torch."""
        raise NotImplementedError

    def value_bound(self, want: torch.Tensor) -> torch.Tensor:
        """Lossy formats (``lossless`` False): the largest |decoded - source| allowed per element
        of one slice whose source values are ``want`` [rows, cols] (verify's value check)."""
        raise NotImplementedError

    def mxfp4_pair(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Formats that store the MXFP4 pair (``stores_mxfp4``): the stored codes [rows, cols/2]
        and E8M0 scales as a row-major [rows, cols/32] uint8 matrix (un-swizzled)."""
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


class QuantizedBF16(StorageFormat):
    """A format that quantizes BF16 2-D linear weights: it fits exactly those, and is lossy."""

    lossless = False

    def fits(self, layout_name: str, role: Role) -> str:
        return bf16_linear_misfit(layout_name, role)
