"""``k3bundle trace``: the source bytes behind a device tensor, or behind one byte of it.

Works from the bundle alone (``weights.index.json``): the entry of (rank, key) gives the source
file and key, the logical slice and the transform; a byte offset inside the tensor is mapped back
through stacking (expert), the swizzle (inverted), padding and the format's element geometry to
the source element(s) and the source bytes it was made from, plus the scale that goes with it.

Byte-exact transforms (``copy``, ``swizzle-128x4``) map one device byte to one source byte; the
derived formats map a device byte to the source elements it encodes (an FP8 byte to one BF16
element, an MXFP4-from-BF16 byte to two, a scale byte to its block).
"""

from __future__ import annotations

import math
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.index import INDEX_NAME, find_entry, lookup
from k3bundle.formats.geometry import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, SWIZZLE_TILE_COLS, SWIZZLE_TILE_ROWS
from k3bundle.io.dtypes import dtype_bits


def _unswizzle_index(k: int, scale_cols: int) -> tuple[int, int]:
    """Position ``k`` of a swizzled 128x4 scale layout -> (row, col) of the row-major matrix."""
    n_ct = math.ceil(scale_cols / SWIZZLE_TILE_COLS)
    tile, w = divmod(k, SWIZZLE_TILE_ROWS * SWIZZLE_TILE_COLS)
    rt, ct = divmod(tile, n_ct)
    p, rest = divmod(w, 16)
    q, c = divmod(rest, SWIZZLE_TILE_COLS)
    return rt * SWIZZLE_TILE_ROWS + q * 32 + p, ct * SWIZZLE_TILE_COLS + c


def source_key(src: dict, expert: int | None, which: str = "data") -> str:
    """The source key of the data (or, ``which="scale"``, of its MXFP4 scale) for ``expert``."""
    d = src if which == "data" else src["scale"]
    if "key" in d:
        return d["key"]
    return d["key_template"].replace("{eid}", str(expert))  # template from Schema.expert_name_template


def trace(bundle: str | Path, rank: int, key: str, offset: int | None = None, index: dict | None = None) -> dict:
    """The source of device tensor ``key`` on ``rank``; with ``offset``, of that byte of its data."""
    if index is None:  # one entry of the file, without parsing the rest (bundle/index.py "Layout")
        index, e = lookup(Path(bundle) / INDEX_NAME, rank, key)
    else:
        e = find_entry(index, rank, key)
    src = e["source"]
    out = {k: e[k] for k in ("rank", "file", "key", "dtype", "shape", "byte_range", "role", "layer",
                             "storage", "part", "transform")}
    out["source"] = dict(src, sha256=index["source_files"].get(src["file"], {}).get("sha256"))
    if "scale" in e:
        out["device_scale"] = e["scale"]
    if offset is None:
        return out
    size = e["byte_range"][1] - e["byte_range"][0]
    if not 0 <= offset < size:
        raise BundleError(f"offset {offset} is outside tensor {key} ({size} bytes)")
    out["byte"] = _trace_byte(e, offset)
    return out


def _trace_byte(e: dict, offset: int) -> dict:
    src = e["source"]
    expert, local = None, offset
    shape = list(e["shape"])
    if "experts" in src:
        if "expert_stride" in src:  # stacked: expert along dim 0
            idx, local = divmod(offset, src["expert_stride"])
            expert = src["experts"][0] + idx
            shape = shape[1:]
    ds = max(dtype_bits(e["dtype"]) // 8, 1)
    elem, in_elem = divmod(local, ds)
    rows, cols = src["rows"], src["cols"]
    n_rows = rows[1] - rows[0]
    n_cols = cols[1] - cols[0] if cols else None
    storage, part, transform = e["storage"], e["part"], e["transform"]
    res: dict = {"offset": offset, "file_offset": e["byte_range"][0] + offset}
    if expert is not None:
        res["expert"] = expert
    skey = source_key(src, expert)
    if "swizzle" in transform:  # flat swizzled scale: back to (row, block) of the row-major matrix
        block = NVFP4_BLOCK if storage == "nvfp4" else MXFP4_BLOCK
        pad_cols = src.get("pad_cols", 0)
        scale_cols = (n_cols + pad_cols) // block
        i, j = _unswizzle_index(elem, scale_cols)
        res["device_element"] = [i, j]
        real_cols = n_cols // block
        if i >= n_rows or j >= real_cols:
            res["padding"] = True
            return res
        return _derive(res, e, src, skey, expert, storage, part, i, j, in_elem, block_units=True)
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    i, j = divmod(elem, inner)
    res["device_element"] = [i, j] if len(shape) > 1 else [i]
    if part == "global_scale":
        res["padding"] = False
        res["source"] = {"file": src["file"], "key": skey, "rows": rows, "cols": cols,
                         "note": "multiplier 2^(largest live exponent - 8) over the whole source tensor, "
                                 "stored as the layout's convention means it (compressed-tensors: 1 / multiplier)"}
        res["scale"] = {"key": source_key(src, expert, "scale"), "rows": src["scale"]["rows"],
                        "cols": src["scale"]["cols"]}
        return res
    # logical source columns per device column, and rows per device row, of this part
    per_col = {"packed": 2, "scale": {"nvfp4": NVFP4_BLOCK, "fp8-e4m3-block128": FP8_BLOCK}.get(storage, MXFP4_BLOCK)
               }.get(part, 1)
    per_row = FP8_BLOCK if (storage, part) == ("fp8-e4m3-block128", "scale") else 1
    if i >= math.ceil(n_rows / per_row) or (
            "pad_cols" in src and len(shape) > 1 and j >= math.ceil(n_cols / per_col)):
        res["padding"] = True
        return res
    return _derive(res, e, src, skey, expert, storage, part, i, j, in_elem, block_units=False)


def _derive(res: dict, e: dict, src: dict, skey: str, expert: int | None, storage: str, part: str,
            i: int, j: int, in_elem: int, block_units: bool) -> dict:
    """Fill ``res`` with the source element(s)/bytes of device element (i, j) of a slice."""
    logical = src["logical_shape"]
    rows, cols = src["rows"], src["cols"]
    row = rows[0] + i
    c0 = cols[0] if cols else 0
    res["padding"] = False
    if storage == "source":  # copy: one device byte <- one source byte
        inner = math.prod(logical[1:]) if len(logical) > 1 else 1
        col = c0 + j
        ds = max(dtype_bits(e["dtype"]) // 8, 1)
        b = (row * inner + col) * ds + in_elem
        res["source"] = {"file": src["file"], "key": skey, "element": [row, col] if len(logical) > 1 else [row],
                         "bytes": [b, b + 1]}
        return res
    C = logical[1]
    if storage == "mxfp4":  # pass-through pair: packed byte or scale byte, same position in the source
        if part == "packed":
            col = c0 // 2 + j
            b = row * (C // 2) + col
            res["source"] = {"file": src["file"], "key": skey, "element": [row, col], "bytes": [b, b + 1],
                             "logical_cols": [2 * col, 2 * col + 2]}
            sc = (2 * col) // MXFP4_BLOCK
            res["scale"] = {"key": source_key(src, expert, "scale"), "element": [row, sc],
                            "bytes": [row * (C // MXFP4_BLOCK) + sc, row * (C // MXFP4_BLOCK) + sc + 1]}
        else:
            col = c0 // MXFP4_BLOCK + j
            b = row * (C // MXFP4_BLOCK) + col
            res["source"] = {"file": src["file"], "key": skey, "element": [row, col], "bytes": [b, b + 1],
                             "logical_cols": [col * MXFP4_BLOCK, (col + 1) * MXFP4_BLOCK]}
        return res
    if storage == "nvfp4":
        skey_packed = source_key(src, expert)
        if part == "packed":
            col = c0 // 2 + j
            sc = (2 * col) // MXFP4_BLOCK
            res["source"] = {"file": src["file"], "key": skey_packed, "element": [row, col],
                             "bytes": [row * (C // 2) + col, row * (C // 2) + col + 1],
                             "logical_cols": [2 * col, 2 * col + 2],
                             "note": "same E2M1 codes as this source byte when its 32-block fits E4M3 "
                                     "(else re-quantized: manifest nvfp4_requantized)"}
        else:
            lc = c0 + j * NVFP4_BLOCK
            sc = lc // MXFP4_BLOCK
            res["source"] = {"file": src["file"], "key": skey, "element": [row, sc],
                             "bytes": [row * (C // MXFP4_BLOCK) + sc, row * (C // MXFP4_BLOCK) + sc + 1],
                             "logical_cols": [lc, lc + NVFP4_BLOCK]}
            return res
        res["scale"] = {"key": source_key(src, expert, "scale"), "element": [row, sc],
                        "bytes": [row * (C // MXFP4_BLOCK) + sc, row * (C // MXFP4_BLOCK) + sc + 1]}
        return res
    # derived from BF16: fp8-e4m3-channel / fp8-e4m3-block128 / mxfp4-from-bf16
    def elems(r0: int, r1: int, k0: int, k1: int) -> dict:
        return {"file": src["file"], "key": skey, "rows": [r0, r1], "cols": [k0, k1],
                "bytes": [(r0 * C + k0) * 2, ((r1 - 1) * C + k1) * 2]}
    if part == "weight":  # FP8 element <- one BF16 element
        res["source"] = elems(row, row + 1, c0 + j, c0 + j + 1)
    elif part == "packed":  # two E2M1 codes <- two BF16 elements
        res["source"] = elems(row, row + 1, c0 + 2 * j, c0 + 2 * j + 2)
    elif storage == "fp8-e4m3-channel":  # the row's scale <- the whole row of the slice
        res["source"] = elems(row, row + 1, c0, c0 + (cols[1] - cols[0]))
    elif storage == "fp8-e4m3-block128":
        r0, k0 = rows[0] + FP8_BLOCK * i, c0 + FP8_BLOCK * j
        res["source"] = elems(r0, min(r0 + FP8_BLOCK, rows[1]), k0, min(k0 + FP8_BLOCK, cols[1]))
    else:  # mxfp4-from-bf16 scale: one 32-block
        k0 = c0 + MXFP4_BLOCK * j
        res["source"] = elems(row, row + 1, k0, k0 + MXFP4_BLOCK)
    return res
