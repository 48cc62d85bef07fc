"""The safetensors dtype table, as data.

Keys are the spec's own dtype strings (``safetensors/src/tensor.rs`` ``Dtype``). Each row
gives the torch dtype that holds one element, or ``None`` where this torch has no such
dtype (or where the torch dtype would mean something else: ``torch.float4_e2m1fn_x2``
packs two F4 elements per byte, so it is not the F4 element), and the element size in
bits. Sub-byte dtypes (F4, F6_*) are sized in bits so that ``numel * bits / 8`` is the
spec's rule for a tensor's byte length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    import torch

#: safetensors dtype string -> (name of the torch dtype, or None, element size in bits). Names, not
#: torch objects, so that the table (and ``dtype_bits``) is importable without torch: ``k3bundle
#: trace`` maps bytes with it and never loads torch.
DTYPES: dict[str, tuple[Optional[str], int]] = {
    "BOOL": ("bool", 8),
    "F4": (None, 4),  # OCP MX e2m1 element; torch only has the packed pair type
    "F6_E2M3": (None, 6),  # OCP MX FP6
    "F6_E3M2": (None, 6),  # OCP MX FP6
    "U8": ("uint8", 8),
    "I8": ("int8", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),  # python binding only
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8),  # python binding only
    "F8_E8M0": ("float8_e8m0fnu", 8),  # MX block scale
    "I16": ("int16", 16),
    "U16": ("uint16", 16),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I32": ("int32", 32),
    "U32": ("uint32", 32),
    "F32": ("float32", 32),
    "C64": ("complex64", 64),
    "F64": ("float64", 64),
    "I64": ("int64", 64),
    "U64": ("uint64", 64),
}

_TORCH_TABLES: tuple[dict, dict] | None = None


def _torch_tables() -> tuple[dict, dict]:
    """(``SAFETENSORS_DTYPES``, ``TORCH_TO_SAFETENSORS``), built from ``DTYPES`` on first use."""
    global _TORCH_TABLES
    if _TORCH_TABLES is None:
        import torch

        # Older torch builds lack the float8 and unsigned types; they map to None, not to an if.
        rows = {k: (getattr(torch, n, None) if n else None, bits) for k, (n, bits) in DTYPES.items()}
        _TORCH_TABLES = rows, {dt: k for k, (dt, _bits) in rows.items() if dt is not None}
    return _TORCH_TABLES


def __getattr__(name: str):
    # SAFETENSORS_DTYPES: str -> (torch dtype or None, bits); TORCH_TO_SAFETENSORS: torch dtype -> str
    # (only the rows this torch can hold). Module attributes built on first access (PEP 562).
    if name == "SAFETENSORS_DTYPES":
        return _torch_tables()[0]
    if name == "TORCH_TO_SAFETENSORS":
        return _torch_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Largest byte length the spec allows (``usize`` on a 64-bit host).
MAX_NBYTES = 2**64 - 1


def dtype_bits(dtype: str) -> int:
    """Element size of a safetensors dtype, in bits.

    Args:
        dtype (`str`): a safetensors dtype string such as ``"BF16"``.

    Returns:
        `int`: bits per element. Raises ``KeyError`` for an unknown dtype.
    """
    return DTYPES[dtype][1]


def to_torch(dtype: str) -> Optional["torch.dtype"]:
    """The torch dtype for a safetensors dtype string, or ``None`` if torch cannot hold it.

    Args:
        dtype (`str`): a safetensors dtype string. Raises ``KeyError`` if unknown.

    Returns:
        `torch.dtype | None`
    """
    return _torch_tables()[0][dtype][0]


def from_torch(dtype: "torch.dtype") -> str:
    """The safetensors dtype string for a torch dtype.

    Args:
        dtype (`torch.dtype`): e.g. ``torch.bfloat16``. Raises ``KeyError`` if it has none.

    Returns:
        `str`: e.g. ``"BF16"``.
    """
    return _torch_tables()[1][dtype]


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Byte length of a tensor, ``numel * bits / 8``, in checked arithmetic.

    Args:
        dtype (`str`): a known safetensors dtype string.
        shape (`Sequence[int]`): non-negative dimensions.

    Returns:
        `int`: the byte length. Raises ``ValueError`` with a short reason (no file or
        tensor name; callers add those) when the length passes 2**64 - 1 or when a
        sub-byte dtype does not end on a whole byte.
    """
    bits = dtype_bits(dtype)
    numel = 1
    for dim in shape:
        numel *= dim
        if numel * bits > 8 * MAX_NBYTES:
            raise ValueError(f"shape {list(shape)} {dtype} overflows 2**64 bytes")
    total_bits = numel * bits
    if total_bits % 8:
        raise ValueError(
            f"shape {list(shape)} {dtype} is {total_bits} bits, not a whole number of bytes"
        )
    return total_bits // 8
