"""Strict, lazy safetensors reader.

The header is read and validated in one pass when the file is opened; each format rule is
one check that raises one ``SafetensorsError`` naming the file, the tensor and the numbers.
Tensor data is never read until asked for, and then only the bytes asked for, with
``os.preadv`` straight into a torch-owned buffer (no mmap, no pickle, no whole-file read).

Rules checked, in order (mirroring ``safetensors`` ``read_metadata``/``Metadata::validate``):

1. the file holds the 8-byte little-endian header length;
2. header length <= ``max_header_bytes`` (100 MB by default);
3. header bytes lie within the file;
4. header starts with ``{``, is UTF-8, is JSON, and is an object;
5. no duplicate key at any level;
6. ``__metadata__``, if present, maps str to str;
7. each entry is ``{"dtype", "shape", "data_offsets"}`` and nothing else;
8. known dtype; shape of non-negative ints; ``data_offsets`` two non-negative ints, begin <= end;
9. ``end - begin == numel * bits / 8`` (checked: overflow and sub-byte misalignment are errors);
10. in offset order the tensors tile the buffer from 0: a hole is "offsets not contiguous",
    a tensor starting before the previous one ends is "overlapping";
11. the buffer ends exactly at the end of the file (else "truncated" or "trailing bytes").

Byte order: safetensors data is little-endian, and tensors are returned as stored, so this
module assumes a little-endian host (every target k3bundle serves is one).
"""

from __future__ import annotations

import difflib
import json
import os
import struct
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from k3bundle.errors import JsonFileError, SafetensorsError
from k3bundle.io.dtypes import SAFETENSORS_DTYPES, tensor_nbytes
from k3bundle.io.files import open_regular
from k3bundle.io.strict_json import dotted, loads

PathLike = Union[str, "os.PathLike[str]"]

#: Default cap on the JSON header, as in the reference implementation.
DEFAULT_MAX_HEADER_BYTES = 100_000_000

# One preadv call reads at most this much; Linux caps a single read near 2 GiB anyway.
_MAX_READ = 1 << 30

_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One header entry, validated.

    ``begin``/``end`` are the header's ``data_offsets`` (relative to the data buffer);
    ``data_start`` is where the buffer starts in the file, so ``abs_begin``/``abs_end`` are
    absolute file offsets.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    data_start: int

    @property
    def dtype_str(self) -> str:
        """The safetensors dtype string (alias of ``dtype``)."""
        return self.dtype

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The torch dtype, or ``None`` where this torch cannot hold the dtype."""
        return SAFETENSORS_DTYPES[self.dtype][0]

    @property
    def bits(self) -> int:
        """Element size in bits."""
        return SAFETENSORS_DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        """Byte length of the tensor's data."""
        return self.end - self.begin

    @property
    def abs_begin(self) -> int:
        """Absolute file offset of the first data byte."""
        return self.data_start + self.begin

    @property
    def abs_end(self) -> int:
        """Absolute file offset one past the last data byte."""
        return self.data_start + self.end


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: tensors in header order, metadata, and where the data lies."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int

    @property
    def buffer_size(self) -> int:
        """Bytes in the data buffer (``file_size - data_start``)."""
        return self.file_size - self.data_start


def _json_type(value: object) -> str:
    """A parsed JSON value's type in JSON's words (never a Python class name)."""
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), "a value")


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:  # short reads are legal; an empty read means the file shrank
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise SafetensorsError(
                f"{path}: file shrank while reading: wanted {n} bytes at offset {offset}, "
                f"got {len(data)}"
            )
        data += more
    return data


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_json(path: str, raw: bytes) -> dict:
    if not raw.startswith(b"{"):
        raise SafetensorsError(f"{path}: header does not start with '{{' (first byte {raw[:1]!r})")
    try:
        return loads(raw, path)  # a JSON object: it starts with '{'
    except JsonFileError as e:
        if e.key is None:
            raise SafetensorsError(f"{path}: header: {e.problem}") from None
        at = e.at
        where = ("header" if not at else "__metadata__" if at == ("__metadata__",)
                 else f"tensor {at[0]!r}" + (f" at {dotted(at[1:])}" if at[1:] else ""))
        raise SafetensorsError(f"{path}: duplicate key {e.key!r} in {where}") from None


def _metadata(path: str, meta: object) -> dict[str, str]:
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{path}: __metadata__ is not a JSON object")
    for key, item in meta.items():
        if not isinstance(item, str):
            raise SafetensorsError(
                f"{path}: __metadata__ value for '{key}' is {_json_type(item)}, not a string"
            )
    return meta


def _entry(path: str, name: str, value: object, data_start: int) -> TensorInfo:
    where = f"{path}: tensor '{name}'"
    if not isinstance(value, dict):
        raise SafetensorsError(f"{where} entry is not a JSON object")
    fields = value
    for field in fields:
        if field not in _ENTRY_FIELDS:
            raise SafetensorsError(f"{where} has unknown field '{field}'")
    for field in _ENTRY_FIELDS:
        if field not in fields:
            raise SafetensorsError(f"{where} lacks '{field}'")
    dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise SafetensorsError(f"{where} has unknown dtype {json.dumps(dtype)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise SafetensorsError(f"{where} has invalid shape {json.dumps(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_uint, offsets)):
        raise SafetensorsError(f"{where} has invalid data_offsets {json.dumps(offsets)}")
    begin, end = offsets
    if end < begin:
        raise SafetensorsError(f"{where} data_offsets [{begin}, {end}] end before they begin")
    try:
        need = tensor_nbytes(dtype, shape)
    except ValueError as e:
        raise SafetensorsError(f"{where}: {e}") from None
    if need != end - begin:
        raise SafetensorsError(
            f"{where} needs {need} bytes (shape {_shape_str(shape)} {dtype}) "
            f"but its data_offsets span {end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end, data_start)


def _check_tiling(path: str, tensors: dict[str, TensorInfo]) -> tuple[int, Optional[TensorInfo]]:
    """Check the tensors tile the buffer from 0; return the buffer end and the last tensor."""
    expected, prev = 0, None
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < expected:
            raise SafetensorsError(
                f"{path}: tensor '{info.name}' data_offsets [{info.begin}, {info.end}] "
                f"overlapping tensor '{prev.name}' [{prev.begin}, {prev.end}]"
            )
        if info.begin > expected:
            after = f"tensor '{prev.name}' ends at {expected}" if prev else "the buffer starts at 0"
            raise SafetensorsError(
                f"{path}: offsets not contiguous: tensor '{info.name}' starts at {info.begin} "
                f"but {after} (hole of {info.begin - expected} bytes)"
            )
        expected, prev = info.end, info
    return expected, prev


def _parse_header(fd: int, path: str, file_size: int, max_header_bytes: int) -> SafetensorsHeader:
    if file_size < 8:
        raise SafetensorsError(f"{path}: file is {file_size} bytes, too small for a header length")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path))
    if n > max_header_bytes:
        raise SafetensorsError(f"{path}: header length {n} exceeds the limit of {max_header_bytes}")
    if 8 + n > file_size:
        raise SafetensorsError(
            f"{path}: header length {n} runs past the end of the file ({file_size} bytes)"
        )
    header = _parse_json(path, _pread_exact(fd, n, 8, path))
    data_start = 8 + n
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    for key, value in header.items():
        if key == "__metadata__":
            metadata = _metadata(path, value)
        else:
            tensors[key] = _entry(path, key, value, data_start)
    buffer_end, last = _check_tiling(path, tensors)
    have = file_size - data_start
    last_name = f"tensor '{last.name}'" if last else "the empty buffer"
    if buffer_end > have:
        raise SafetensorsError(
            f"{path}: truncated: {last_name} ends at buffer byte {buffer_end} "
            f"but the file holds {have} buffer bytes"
        )
    if buffer_end < have:
        raise SafetensorsError(
            f"{path}: trailing bytes: {have - buffer_end} bytes after {last_name}, "
            f"which ends at buffer byte {buffer_end}"
        )
    return SafetensorsHeader(path, tensors, metadata, data_start, file_size)


def _open(name: str) -> int:
    try:
        return open_regular(name)
    except OSError as e:
        raise SafetensorsError(f"{name}: cannot open: {e.strerror}") from None


def read_header(
    path: PathLike, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Read and validate a safetensors header without touching the data.

    Args:
        path (`str | os.PathLike`): the .safetensors file.
        max_header_bytes (`int`, *optional*): refuse longer headers. Defaults to 100 MB.

    Returns:
        `SafetensorsHeader`: tensors (header order), metadata, data start and file size.

    Example:
        >>> hdr = read_header("model-00001-of-000096.safetensors")  # doctest: +SKIP
        >>> hdr.tensors["lm_head.weight"].shape  # doctest: +SKIP
    """
    name = os.fspath(path)
    fd = _open(name)
    try:
        return _parse_header(fd, name, os.fstat(fd).st_size, max_header_bytes)
    finally:
        os.close(fd)


class SafetensorsFile:
    """An open safetensors file: validated header, reads of single tensors or byte ranges.

    Args:
        path (`str | os.PathLike`): the .safetensors file.
        max_header_bytes (`int`, *optional*): refuse longer headers. Defaults to 100 MB.

    Example:
        >>> with SafetensorsFile("model.safetensors") as sf:  # doctest: +SKIP
        ...     w = sf.get_rows("lm_head.weight", 0, 128)
    """

    def __init__(self, path: PathLike, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 header: Optional[SafetensorsHeader] = None):
        self.path = os.fspath(path)
        self._fd = _open(self.path)
        try:
            size = os.fstat(self._fd).st_size
            if header is not None and header.file_size != size:  # validated before: it must still fit
                raise SafetensorsError(f"{self.path}: {size} bytes now, {header.file_size} when its header "
                                       "was read; the file changed")
            # ``header``: this file's header as ``read_header`` returned it (a checkpoint's index check
            # reads all of them first; 497,220 entries are not parsed twice)
            self.header = header or _parse_header(self._fd, self.path, size, max_header_bytes)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    # --- lifecycle ---

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # an OS descriptor, not a Python file object: nothing else closes it when the reader is
        # dropped without close() (a bundle opened per case would run a process out of descriptors)
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- header ---

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` map ({} when absent)."""
        return self.header.metadata

    def keys(self) -> list[str]:
        """Tensor names in header order."""
        return list(self.header.tensors)

    def sorted_keys(self) -> list[str]:
        """Tensor names sorted by name."""
        return sorted(self.header.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.header.tensors

    def __len__(self) -> int:
        return len(self.header.tensors)

    def info(self, key: str) -> TensorInfo:
        """The validated header entry of one tensor.

        Args:
            key (`str`): tensor name.

        Returns:
            `TensorInfo`. Raises ``SafetensorsError`` naming the file and key if absent.
        """
        try:
            return self.header.tensors[key]
        except KeyError:
            pass
        close = difflib.get_close_matches(key, self.header.tensors, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise SafetensorsError(
            f"{self.path}: no tensor '{key}' ({len(self.header.tensors)} tensors){hint}"
        )

    # --- data ---

    def _read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from absolute file ``offset``; the only place data is read."""
        if self._fd < 0:
            raise ValueError(f"{self.path}: read from a closed SafetensorsFile")
        done, total = 0, len(view)
        while done < total:
            part = view[done : done + min(total - done, _MAX_READ)]
            if hasattr(os, "preadv"):
                got = os.preadv(self._fd, [part], offset + done)
            else:  # Windows: one extra copy per call
                data = os.pread(self._fd, len(part), offset + done)
                got = len(data)
                part[:got] = data
            if got == 0:
                raise SafetensorsError(
                    f"{self.path}: file shrank while reading: wanted {total} bytes at offset "
                    f"{offset}, got {done}"
                )
            done += got

    def _tensor(self, info: TensorInfo, byte_begin: int, byte_end: int, shape: tuple) -> torch.Tensor:
        dt = info.torch_dtype
        if dt is None:
            raise SafetensorsError(
                f"{self.path}: tensor '{info.name}' has dtype {info.dtype}, which this torch "
                "cannot hold; use read_bytes"
            )
        nbytes = byte_end - byte_begin
        out = torch.empty(nbytes * 8 // info.bits, dtype=dt)
        if nbytes:
            self._read_into(memoryview(out.view(torch.uint8).numpy()), info.abs_begin + byte_begin)
        return out.reshape(shape)

    def get(self, key: str) -> torch.Tensor:
        """Read one whole tensor (only its bytes).

        Args:
            key (`str`): tensor name.

        Returns:
            `torch.Tensor`: owned, writable, CPU, with the stored dtype and shape.
        """
        info = self.info(key)
        return self._tensor(info, 0, info.nbytes, info.shape)

    def get_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """Read one whole tensor into ``out`` (contiguous, CPU, its dtype and shape), e.g. one row of
        a stack: thousands of small experts read without a tensor and a copy each.

        Returns:
            `torch.Tensor`: ``out``.
        """
        info = self.info(key)
        if out.dtype != info.torch_dtype or tuple(out.shape) != info.shape or not out.is_contiguous() \
                or out.device.type != "cpu":
            raise SafetensorsError(
                f"{self.path}: tensor '{key}' is {info.dtype} {list(info.shape)}; cannot read it into a "
                f"{out.dtype} {list(out.shape)} {out.device.type} tensor"
                + ("" if out.is_contiguous() else " that is not contiguous"))
        if info.nbytes:
            self._read_into(memoryview(out.view(torch.uint8).numpy()).cast("B"), info.abs_begin)
        return out

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Read rows ``start:stop`` of dim 0 (only those rows' bytes).

        Args:
            key (`str`): tensor name; the tensor must have at least one dimension.
            start (`int`): first row, ``0 <= start <= stop``.
            stop (`int`): one past the last row, ``stop <= shape[0]``.

        Returns:
            `torch.Tensor` of shape ``(stop - start, *shape[1:])``, owned and writable.
        """
        info = self.info(key)
        if not info.shape:
            raise SafetensorsError(f"{self.path}: tensor '{key}' is 0-dimensional; it has no rows")
        rows = info.shape[0]
        if not (0 <= start <= stop <= rows):
            raise SafetensorsError(
                f"{self.path}: tensor '{key}' rows [{start}, {stop}) out of range [0, {rows})"
            )
        row_bits = info.bits
        for dim in info.shape[1:]:
            row_bits *= dim
        if row_bits % 8:
            raise SafetensorsError(
                f"{self.path}: tensor '{key}' rows are {row_bits} bits, not whole bytes; "
                "use read_bytes"
            )
        row_bytes = row_bits // 8
        shape = (stop - start,) + info.shape[1:]
        return self._tensor(info, start * row_bytes, stop * row_bytes, shape)

    def read_bytes(self, key: str, start: int = 0, stop: Optional[int] = None) -> bytes:
        """Read raw bytes ``start:stop`` of one tensor's data (for hashing or pass-through).

        Args:
            key (`str`): tensor name.
            start (`int`, *optional*): first byte within the tensor. Defaults to 0.
            stop (`int`, *optional*): one past the last byte. Defaults to the tensor's length.

        Returns:
            `bytes`
        """
        info = self.info(key)
        stop = info.nbytes if stop is None else stop
        if not (0 <= start <= stop <= info.nbytes):
            raise SafetensorsError(
                f"{self.path}: tensor '{key}' byte range [{start}, {stop}) out of range "
                f"[0, {info.nbytes})"
            )
        buf = bytearray(stop - start)
        if buf:
            self._read_into(memoryview(buf), info.abs_begin + start)
        return bytes(buf)

    def iter_chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        """Yield a tensor's raw bytes in order, ``chunk_bytes`` at a time (last may be short).

        Args:
            key (`str`): tensor name.
            chunk_bytes (`int`): positive chunk size.

        Returns:
            `Iterator[bytes]`; an empty tensor yields nothing.
        """
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        nbytes = self.info(key).nbytes
        for start in range(0, nbytes, chunk_bytes):
            yield self.read_bytes(key, start, min(start + chunk_bytes, nbytes))
