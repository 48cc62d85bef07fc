"""Deterministic, streaming, atomic safetensors writer.

Header form (identical bytes for identical input, whatever the dict insertion order):

    <u64 LE N> {"__metadata__":{"k":"v",...},"name":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},...}<spaces>

- ``__metadata__`` comes first, its keys sorted; it is left out when metadata is empty/None.
- Tensors follow sorted by name (Python ``str`` order, i.e. by code point), and their data
  is laid out in that same order, contiguous from offset 0.
- Each entry's fields are in the order ``dtype``, ``shape``, ``data_offsets`` (as the
  reference implementation writes them); separators are ``,`` and ``:`` with no spaces;
  strings are JSON-escaped with non-ASCII kept as raw UTF-8 (``ensure_ascii=False``).
- The JSON is right-padded with spaces so that N is a multiple of 8.

For tensors that all share one dtype this is byte-identical to
``safetensors.torch.save_file``. Data offsets are not aligned to the element size when
dtypes are mixed (the name order wins), which the spec allows.

Safety: bytes go to a hidden temp file in the target directory, then ``fsync`` and
``os.replace``; on any exception the temp file is removed, so an interrupted write never
leaves a complete-looking file. The sha256 is computed while writing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Optional, Union

import torch

from k3bundle.errors import SafetensorsError
from k3bundle.io.dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS, tensor_nbytes
from k3bundle.io.files import atomic_output

#: Slice size when writing a torch tensor's bytes.
DEFAULT_CHUNK_BYTES = 16 << 20

BytesLike = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class TensorSource:
    """A tensor given as dtype, shape and a one-shot iterable of byte chunks.

    The writer never materialises it: chunks are written as they come, and together they
    must deliver exactly ``nbytes`` bytes.

    Args:
        dtype (`str`): safetensors dtype string, e.g. ``"BF16"``.
        shape (`tuple[int, ...]`): dimensions.
        chunks (`Iterable[bytes-like]`): the raw little-endian data, in order.
    """

    dtype: str
    shape: tuple[int, ...]
    chunks: Iterable[BytesLike]

    @property
    def nbytes(self) -> int:
        """``numel * bits / 8``."""
        return tensor_nbytes(self.dtype, self.shape)

    @classmethod
    def from_file(cls, sf: Any, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> "TensorSource":
        """Pass a tensor through from an open ``SafetensorsFile`` without decoding it.

        Args:
            sf (`SafetensorsFile`): the open source file.
            key (`str`): tensor name in ``sf``.
            chunk_bytes (`int`, *optional*): read size. Defaults to 16 MiB.

        Returns:
            `TensorSource`
        """
        info = sf.info(key)
        return cls(info.dtype, info.shape, sf.iter_chunks(key, chunk_bytes))


class WrittenFile(NamedTuple):
    """What ``write_safetensors`` wrote: final path, sha256 hex of the file, byte size."""

    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class _Planned:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: Iterable[BytesLike]


def _tensor_chunks(t: torch.Tensor, chunk_bytes: int) -> Iterator[memoryview]:
    if t.numel() == 0:
        return
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    for start in range(0, len(raw), chunk_bytes):
        yield raw[start : start + chunk_bytes]


def _plan_tensor(path: str, name: str, t: torch.Tensor, chunk_bytes: int) -> _Planned:
    where = f"{path}: tensor '{name}'"
    dtype = TORCH_TO_SAFETENSORS.get(t.dtype)
    if dtype is None:
        raise SafetensorsError(f"{where} has torch dtype {t.dtype}, which safetensors cannot name")
    if t.device.type == "meta":
        raise SafetensorsError(f"{where} is on the meta device and has no data")
    if not t.is_contiguous():
        raise SafetensorsError(f"{where} is not contiguous; call .contiguous() before saving")
    t = t.detach().resolve_conj().resolve_neg().cpu()
    shape = tuple(t.shape)
    return _Planned(name, dtype, shape, tensor_nbytes(dtype, shape), _tensor_chunks(t, chunk_bytes))


def _plan_source(path: str, name: str, src: Any) -> _Planned:
    where = f"{path}: tensor '{name}'"
    dtype, shape = getattr(src, "dtype", None), getattr(src, "shape", None)
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise SafetensorsError(f"{where} has unknown dtype {dtype!r}")
    try:
        shape = tuple(shape)
        ok = all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    except TypeError:
        ok = False
    if not ok:
        raise SafetensorsError(f"{where} has invalid shape {shape!r}")
    try:
        nbytes = tensor_nbytes(dtype, shape)
    except ValueError as e:
        raise SafetensorsError(f"{where}: {e}") from None
    declared = getattr(src, "nbytes", nbytes)
    if declared != nbytes:
        raise SafetensorsError(
            f"{where} declares {declared} bytes but shape {list(shape)} {dtype} needs {nbytes}"
        )
    return _Planned(name, dtype, shape, nbytes, src.chunks)


def _plan(path: str, tensors: Any, chunk_bytes: int) -> list[_Planned]:
    items = tensors.items() if hasattr(tensors, "items") else tensors
    planned: dict[str, _Planned] = {}
    for name, value in items:
        if not isinstance(name, str):
            raise SafetensorsError(f"{path}: tensor name {name!r} is not a string")
        if name == "__metadata__":
            raise SafetensorsError(f"{path}: '__metadata__' is reserved and cannot name a tensor")
        if name in planned:
            raise SafetensorsError(f"{path}: duplicate tensor '{name}'")
        if isinstance(value, torch.Tensor):
            planned[name] = _plan_tensor(path, name, value, chunk_bytes)
        else:
            planned[name] = _plan_source(path, name, value)
    return [planned[name] for name in sorted(planned)]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def build_header(planned_or_infos: Iterable[Any], metadata: Optional[Mapping[str, str]]) -> bytes:
    """Encode the header JSON (without the length prefix), space-padded to a multiple of 8.

    Args:
        planned_or_infos (`Iterable`): objects with ``name``, ``dtype``, ``shape``,
            ``nbytes``, already in file order.
        metadata (`Mapping[str, str] | None`): written sorted; omitted when empty or None.

    Returns:
        `bytes`: the padded header.
    """
    parts = []
    if metadata:
        parts.append('"__metadata__":' + _dumps({k: metadata[k] for k in sorted(metadata)}))
    offset = 0
    for p in planned_or_infos:
        end = offset + p.nbytes
        parts.append(
            f'{_dumps(p.name)}:{{"dtype":{_dumps(p.dtype)},"shape":{_dumps(list(p.shape))},'
            f'"data_offsets":[{offset},{end}]}}'
        )
        offset = end
    header = ("{" + ",".join(parts) + "}").encode("utf-8")
    return header + b" " * (-len(header) % 8)


def _check_metadata(path: str, metadata: Optional[Mapping[str, str]]) -> None:
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SafetensorsError(
                f"{path}: metadata entry {key!r}: {value!r} is not a str -> str pair"
            )


def _write_all(f: Any, path: str, header: bytes, planned: list[_Planned]) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0

    def put(data: BytesLike) -> None:
        nonlocal size
        f.write(data)
        digest.update(data)
        size += len(data)

    put(struct.pack("<Q", len(header)))
    put(header)
    for p in planned:
        got = 0
        for chunk in p.chunks:
            view = memoryview(chunk).cast("B")
            got += len(view)
            if got > p.nbytes:
                raise SafetensorsError(
                    f"{path}: tensor '{p.name}' source delivered more than its {p.nbytes} bytes "
                    f"(shape {list(p.shape)} {p.dtype})"
                )
            put(view)
        if got != p.nbytes:
            raise SafetensorsError(
                f"{path}: tensor '{p.name}' source delivered {got} of {p.nbytes} bytes "
                f"(shape {list(p.shape)} {p.dtype})"
            )
    return digest.hexdigest(), size


def write_safetensors(
    path: Union[str, "os.PathLike[str]"],
    tensors: Union[Mapping[str, Any], Iterable[tuple[str, Any]]],
    metadata: Optional[Mapping[str, str]] = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> WrittenFile:
    """Write a safetensors file deterministically, streaming, and atomically.

    Args:
        path (`str | os.PathLike`): destination; its directory must exist.
        tensors (`Mapping[str, torch.Tensor | TensorSource]` or iterable of pairs): the
            tensors; any order (they are written sorted by name). A source may be any object
            with ``dtype`` (str), ``shape`` and ``chunks`` (and optionally ``nbytes``).
        metadata (`Mapping[str, str] | None`, *optional*): the ``__metadata__`` map.
        chunk_bytes (`int`, *optional*): slice size for torch tensors. Defaults to 16 MiB.

    Returns:
        `WrittenFile`: ``(path, sha256 hex, size in bytes)``, hashed while writing.

    Example:
        >>> write_safetensors("out.safetensors", {"w": torch.zeros(2, 2)})  # doctest: +SKIP
        WrittenFile(path='out.safetensors', sha256='...', size=88)
    """
    final = os.fspath(path)
    _check_metadata(final, metadata)
    planned = _plan(final, tensors, chunk_bytes)
    header = build_header(planned, metadata)
    with atomic_output(final) as f:
        sha, size = _write_all(f, final, header, planned)
    return WrittenFile(final, sha, size)
