"""``k3bundle trace``: the source bytes behind a device tensor, or behind one byte of it.

Works from the bundle alone (``weights.index.json``): the entry of (rank, key) gives the source
file and key, the logical slice and the transform; a byte offset inside the tensor is mapped back
through stacking (expert), the swizzle (inverted), padding and the format's element geometry to
the source element(s) and the source bytes it was made from, plus the scale that goes with it.

Here: the stacking, the swizzle and the padding, from the entry and the format's ``span``; the
format's ``trace_element`` maps the device element to what it was made from (byte-exact
transforms one device byte to one source byte; derived formats the source elements it encodes:
an FP8 byte one BF16 element, an MXFP4-from-BF16 byte two, a scale byte its block).
"""

from __future__ import annotations

import math
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.index import entry_format, find_entry, lookup
from k3bundle.file_names import WEIGHTS_INDEX
from k3bundle.formats.geometry import SWIZZLE_TILE_COLS, SWIZZLE_TILE_ROWS
from k3bundle.io.dtypes import dtype_bits
from k3bundle.storage import SliceSource, is_swizzled


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
        index, e = lookup(Path(bundle) / WEIGHTS_INDEX, rank, key)
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
    fmt = entry_format(e)
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
    part = e["part"]
    per_row, per_col = fmt.span(part)  # source rows and columns behind one stored element
    res: dict = {"offset": offset, "file_offset": e["byte_range"][0] + offset}
    if expert is not None:
        res["expert"] = expert
    if is_swizzled(e["transform"]):  # flat swizzled scale: back to (row, block) of the row-major matrix
        i, j = _unswizzle_index(elem, (n_cols + src.get("pad_cols", 0)) // per_col)
        res["device_element"] = [i, j]
        padding = i >= n_rows or j >= n_cols // per_col
    else:
        inner = math.prod(shape[1:]) if len(shape) > 1 else 1
        i, j = divmod(elem, inner)
        res["device_element"] = [i, j] if len(shape) > 1 else [i]
        padding = i >= math.ceil(n_rows / per_row) or (
            "pad_cols" in src and len(shape) > 1 and j >= math.ceil(n_cols / per_col))
    res["padding"] = padding
    if padding:
        return res
    scale = src.get("scale")
    where = SliceSource(src["file"], source_key(src, expert), scale and source_key(src, expert, "scale"),
                        src["logical_shape"], rows, cols, ds, scale)
    res.update(fmt.trace_element(part, i, j, in_elem, where))
    return res
