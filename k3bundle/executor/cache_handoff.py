"""A request's whole cache as bytes, and back (docs/executor.md "Cache handoff format").

What a prefill process hands a decode process, or a prefix cache keeps off the device: every
layer's state (KDA recurrent + conv state, MLA latent rows) with what the receiver must know to
trust it — the layer's kind, the tokens it has consumed, the chunk boundary at or before that
position, each array's dtype and shape. The layout is an 8-byte magic, a little-endian u64
header length, a UTF-8 JSON header, then the arrays' raw little-endian bytes in C order at the
offsets the header names. No pickle: a reader in any language needs only JSON and byte views.

``to_bytes`` / ``from_bytes`` are pure; bad bytes raise ``CacheFormatError`` with one line that
names the field.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

from k3bundle.executor.cache import KDAState, MLAState, ModelCache
from k3bundle.executor.errors import ExecutorError
from k3bundle.executor.kda import CHUNK

MAGIC = b"K3CACHE\x01"
FORMAT, VERSION = "k3bundle-cache", 1
#: torch dtype ↔ name in the header ↔ little-endian numpy view of its bytes (bfloat16 as raw u16)
DTYPES = {torch.float64: ("float64", "<f8"), torch.float32: ("float32", "<f4"),
          torch.float16: ("float16", "<f2"), torch.bfloat16: ("bfloat16", "<u2")}
_BY_NAME = {name: (t, np.dtype(v)) for t, (name, v) in DTYPES.items()}
#: each layer kind's arrays, in the order they are written
ARRAYS = {"kda": ("recurrent", "conv"), "mla": ("latent",)}


class CacheFormatError(ExecutorError):
    """Bytes that are not a cache in this format (one line naming the field)."""


def _array_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.dtype not in DTYPES:
        raise CacheFormatError(f"cache tensor dtype {t.dtype} has no name in the cache format "
                               f"(known: {', '.join(n for n, _ in DTYPES.values())})")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype(DTYPES[t.dtype][1]).tobytes()


def _layer_arrays(s) -> tuple[str, int | None, list[tuple[str, torch.Tensor]]]:
    if isinstance(s, KDAState):
        return "kda", None, [("recurrent", s.recurrent_HKV), ("conv", s.conv_3WP)]
    return "mla", s.length, [("latent", s.latent_SC)]


def to_bytes(cache: ModelCache, chunk: int = CHUNK) -> bytes:
    """``cache`` (snapshots left out) as one self-describing byte string."""
    layers, blobs, offset = [], [], 0
    for l, s in enumerate(cache.layers):
        kind, length, arrays = _layer_arrays(s)
        length = cache.length if length is None else length
        entry = {"layer": l, "kind": kind, "length": length, "chunk_boundary": length // chunk * chunk, "arrays": []}
        for name, t in arrays:
            raw = _array_bytes(t)
            entry["arrays"].append({"name": name, "dtype": DTYPES[t.dtype][0], "shape": list(t.shape),
                                    "offset": offset, "nbytes": len(raw)})
            blobs.append(raw)
            offset += len(raw)
        layers.append(entry)
    header = json.dumps({"format": FORMAT, "version": VERSION, "length": cache.length, "chunk": chunk,
                         "chunk_boundary": cache.length // chunk * chunk, "data_bytes": offset,
                         "layers": layers}, separators=(",", ":"), sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(header)) + header + b"".join(blobs)


def header_of(data: bytes) -> tuple[dict, int]:
    """The parsed header and where the arrays start; the framing and top-level fields checked."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CacheFormatError(f"cache bytes: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if data[:len(MAGIC)] != MAGIC:
        raise CacheFormatError(f"cache bytes: magic is {data[:len(MAGIC)]!r}, expected {MAGIC!r}")
    if len(data) < len(MAGIC) + 8:
        raise CacheFormatError(f"cache bytes: {len(data)} bytes, too short for the header length")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8 + n
    if start > len(data):
        raise CacheFormatError(f"cache bytes: header_length {n} runs past the end ({len(data)} bytes)")
    try:
        header = json.loads(data[len(MAGIC) + 8:start].decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise CacheFormatError(f"cache bytes: header is not UTF-8 JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise CacheFormatError(f"cache bytes: header format/version must be {FORMAT!r}/{VERSION}, got "
                               f"{header.get('format') if isinstance(header, dict) else header!r}/"
                               f"{header.get('version') if isinstance(header, dict) else ''}")
    for key in ("length", "chunk", "chunk_boundary", "data_bytes"):
        v = header.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CacheFormatError(f"cache bytes: header field {key} must be a non-negative integer, got {v!r}")
    if header["data_bytes"] != len(data) - start:
        raise CacheFormatError(f"cache bytes: header data_bytes {header['data_bytes']} but {len(data) - start} "
                               "bytes follow the header (truncated or padded)")
    if not isinstance(header.get("layers"), list):
        raise CacheFormatError("cache bytes: header field layers must be a list")
    return header, start


def _array(data: bytes, start: int, a, where: str) -> torch.Tensor:
    if not isinstance(a, dict):
        raise CacheFormatError(f"cache bytes: {where} must be a mapping")
    if a.get("dtype") not in _BY_NAME:
        raise CacheFormatError(f"cache bytes: {where}.dtype {a.get('dtype')!r} is not one of {', '.join(_BY_NAME)}")
    dtype, view = _BY_NAME[a["dtype"]]
    shape = a.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CacheFormatError(f"cache bytes: {where}.shape must be a list of non-negative integers, got {shape!r}")
    offset, nbytes = a.get("offset"), a.get("nbytes")
    want = int(np.prod(shape, dtype=np.int64)) * view.itemsize
    if nbytes != want:
        raise CacheFormatError(f"cache bytes: {where}.nbytes is {nbytes!r}, shape {shape} of {a['dtype']} is {want}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or start + offset + want > len(data):
        raise CacheFormatError(f"cache bytes: {where}.offset {offset!r} (+{want} bytes) lies outside the data")
    arr = np.frombuffer(data, dtype=view, count=want // view.itemsize, offset=start + offset).reshape(shape)
    t = torch.from_numpy(arr.astype(view.newbyteorder("="), copy=True))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t.to(dtype)


def from_bytes(data: bytes, device="cpu") -> ModelCache:
    """The cache ``to_bytes`` wrote (on ``device``); ``CacheFormatError`` on anything else."""
    header, start = header_of(data)
    data = bytes(data)
    layers = []
    for i, entry in enumerate(header["layers"]):
        where = f"layers[{i}]"
        if not isinstance(entry, dict) or entry.get("layer") != i:
            raise CacheFormatError(f"cache bytes: {where}.layer must be {i}")
        kind = entry.get("kind")
        if kind not in ARRAYS:
            raise CacheFormatError(f"cache bytes: {where}.kind {kind!r} is not one of {', '.join(ARRAYS)}")
        arrays = entry.get("arrays")
        names = [a.get("name") if isinstance(a, dict) else None for a in arrays] if isinstance(arrays, list) else None
        if names != list(ARRAYS[kind]):
            raise CacheFormatError(f"cache bytes: {where}.arrays of a {kind} layer must be "
                                   f"{', '.join(ARRAYS[kind])}, got {names!r}")
        length = entry.get("length")
        if length != header["length"] or isinstance(length, bool):
            raise CacheFormatError(f"cache bytes: {where}.length {length!r} differs from the cache's {header['length']}")
        t = {n: _array(data, start, a, f"{where}.arrays.{n}").to(device) for n, a in zip(names, arrays)}
        if kind == "kda":
            layers.append(KDAState(t["recurrent"], t["conv"]))
        else:
            if t["latent"].dim() != 2 or t["latent"].shape[0] != length:
                raise CacheFormatError(f"cache bytes: {where}.arrays.latent shape {list(t['latent'].shape)} "
                                       f"is not [length {length}, width]")
            layers.append(MLAState(t["latent"], length))
    return ModelCache(layers, header["length"])
