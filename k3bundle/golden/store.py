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
import zstandard

from k3bundle.golden.errors import GoldenFileError
from k3bundle.io.files import write_atomic

META_KEY = "__meta__"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_EPOCH = (1980, 1, 1, 0, 0, 0)


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
    return json.loads(bytes(arrays[META_KEY]).decode()) if META_KEY in arrays else {}


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


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GoldenFileError(f"{path}: cannot read: {e.strerror}") from None
    if data[:4] == _ZSTD_MAGIC:
        try:
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 40)
        except zstandard.ZstdError as e:
            raise GoldenFileError(f"{path}: corrupt zstd stream: {e}") from None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, zipfile.BadZipFile, OSError) as e:
        raise GoldenFileError(f"{path}: not an npz file: {e}") from None
