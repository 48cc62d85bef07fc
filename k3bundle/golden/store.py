"""Golden files: deterministic npz containers, zstd-compressed, with a content hash.

``golden_inputs.npz`` is a plain npz (``numpy.load`` opens it). ``golden_intermediates.npz``
is the same npz layout compressed as one zstd frame (``zstd -d < golden_intermediates.npz >
x.npz`` gives a plain npz; ``read_npz`` reads either form). Both are written with fixed zip
timestamps and members in sorted order, so identical content gives identical bytes.

The content hash is sha256 over every array in name order (name, dtype, shape, bytes); it
does not depend on the container, so it identifies what was computed, not how it was stored.
Arrays never hold Python objects: metadata is JSON stored as a uint8 array under
``__meta__`` and every load passes ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import torch
import zstandard

from k3bundle.errors import JsonFileError
from k3bundle.golden.errors import GoldenFileError
from k3bundle.io.files import write_atomic
from k3bundle.io.strict_json import loads

META_KEY = "__meta__"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_EPOCH = (1980, 1, 1, 0, 0, 0)
MAX_GOLDEN_BYTES = 1 << 40  # far above any case suite; a bound, not a size anyone should reach


def to_numpy(t) -> np.ndarray:
    """A torch tensor as stored in a golden file (numpy has no bfloat16: those become float32)."""
    t = t.detach().cpu()
    return (t.float() if str(t.dtype) == "torch.bfloat16" else t).numpy()


def as_tensor(a) -> torch.Tensor | None:
    """A golden array (numpy) as a torch tensor, without a copy; tensors and None pass through."""
    if a is None or isinstance(a, torch.Tensor):
        return a
    return torch.from_numpy(np.ascontiguousarray(a))


def content_hash(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def meta_array(meta: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)


def read_meta(arrays: dict[str, np.ndarray]) -> dict:
    if META_KEY not in arrays:
        return {}
    try:
        meta = loads(bytes(arrays[META_KEY]), META_KEY)
    except JsonFileError as e:
        raise GoldenFileError(f"golden metadata {META_KEY!r} is not JSON: {e.problem}") from None
    if not isinstance(meta, dict):
        raise GoldenFileError(f"golden metadata {META_KEY!r} is not a JSON object")
    return meta


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            a = np.ascontiguousarray(arrays[name])
            if a.dtype == object:
                raise GoldenFileError(f"array {name!r} has dtype object; goldens hold numbers only")
            info = zipfile.ZipInfo(name + ".npy", date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, a, allow_pickle=False)
    return buf.getvalue()


def write_npz(path: str | Path, arrays: dict[str, np.ndarray], compress: bool = False) -> None:
    """Write ``arrays`` atomically (temp file + rename); ``compress`` wraps it in zstd."""
    path = Path(path)
    data = _npz_bytes(arrays)
    if compress:
        data = zstandard.ZstdCompressor(level=3).compress(data)
    write_atomic(path, data)


def _declared_npz_size(data: bytes, path: Path) -> int:
    """The decompressed size a zstd frame declares; refused when absent (goldens are written with
    it) so that a crafted header cannot make the reader allocate without bound."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise GoldenFileError(f"{path}: corrupt zstd frame header: {e}") from None
    if size < 0:
        raise GoldenFileError(f"{path}: the zstd frame does not declare its size; rewrite it with `k3bundle golden`")
    return size


def _inflate(data: bytes, limit: int, path: Path) -> bytes:
    """Decompress in chunks, never holding more than what was really decompressed and never more
    than ``limit`` + one chunk (a header can claim any size; memory follows the real stream)."""
    chunks, total = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as r:
            while chunk := r.read(16 << 20):
                total += len(chunk)
                if total > limit:
                    raise GoldenFileError(f"{path}: the zstd stream holds more than the {limit:,} bytes its "
                                          "header declares")
                chunks.append(chunk)
    except zstandard.ZstdError as e:
        raise GoldenFileError(f"{path}: corrupt zstd stream: {e}") from None
    return b"".join(chunks)


def read_npz(path: str | Path, max_bytes: int = MAX_GOLDEN_BYTES) -> dict[str, np.ndarray]:
    """Every array of a golden npz (plain or zstd). Bounded by what the file declares: a zstd frame
    may expand to at most ``max_bytes`` and to no more than its header says; an npz member to no
    more than the zip directory says. Any malformed container is a one-line ``GoldenFileError``."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise GoldenFileError(f"{path}: not a regular file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GoldenFileError(f"{path}: cannot read: {e.strerror}") from None
    if not data:
        raise GoldenFileError(f"{path}: empty file; rerun `k3bundle golden`")
    if data[:4] == _ZSTD_MAGIC:
        size = _declared_npz_size(data, path)
        if size > max_bytes:
            raise GoldenFileError(f"{path}: the zstd frame declares {size:,} bytes, more than the {max_bytes:,} "
                                  "a golden file may hold")
        data = _inflate(data, size, path)
        if len(data) != size:
            raise GoldenFileError(f"{path}: the zstd frame gave {len(data):,} bytes, its header declares {size:,}")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise ValueError("a single array, not an npz archive")
            return {k: z[k] for k in z.files}
    except (ValueError, EOFError, zipfile.BadZipFile, OSError, KeyError) as e:
        raise GoldenFileError(f"{path}: not an npz file: {e}") from None


def check_goldens(path: str | Path, arrays: dict[str, np.ndarray]) -> dict:
    """The metadata of a goldens file after checking its content: the recorded content hash must be
    the hash of the arrays (a tap edited after generation is refused) and every float must be finite
    (a NaN in a golden is a broken golden, not a device failure). Returns the metadata."""
    meta = read_meta(arrays)
    recorded = meta.get("content_hash")
    data = {k: v for k, v in arrays.items() if k != META_KEY}
    if not data:
        raise GoldenFileError(f"{path}: holds no golden arrays; rerun `k3bundle golden`")
    actual = content_hash(data)
    if recorded != actual:
        raise GoldenFileError(f"{path}: content hash {actual[:16]}… does not match the recorded "
                              f"{str(recorded)[:16]}…: the goldens were changed after they were written; "
                              "rerun `k3bundle golden`")
    for name in sorted(data):
        a = data[name]
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise GoldenFileError(f"{path}: golden {name!r} has {int((~np.isfinite(a)).sum())} NaN/Inf value(s); "
                                  "regenerate the goldens (check the checkpoint and config)")
    return meta
