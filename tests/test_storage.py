"""The storage-format registry is the only list of formats: layouts, encode/decode and convert agree with it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from k3bundle.formats import fp8, mxfp4, nvfp4
from k3bundle.formats.scale_swizzle import swizzle
from k3bundle.io.dtypes import SAFETENSORS_DTYPES
from k3bundle.layouts import FORMATS, LayoutError, parse_layout
from k3bundle.schema import ROLES, Format, Scope, Section
from k3bundle.storage import LAYOUT_NAMES, STORAGE, storage_for
from tests.conftest import REPO

ROWS, COLS = 200, 96  # a slice: more than one 128-row FP8 block, a partial one, whole 32-blocks


def _fitting_roles(name: str):
    return [r for r in ROLES if not LAYOUT_NAMES[name].fits(name, r)]


def _spec(name: str):
    choices = LAYOUT_NAMES[name].scale_rules
    return {"format": name, "scale_rule": choices[0]} if choices else name


# ---- layouts accept exactly the registry's names ----

def test_layouts_accept_exactly_the_registry_names():
    assert sorted(FORMATS) == sorted(LAYOUT_NAMES)
    raw = yaml.safe_load((REPO / "layouts" / "b300-tp8.yaml").read_text())
    for name in LAYOUT_NAMES:
        role = _fitting_roles(name)[0]
        parse_layout({**raw, "formats": {role.role: _spec(name), "*": "source"}})
    with pytest.raises(LayoutError) as e:
        parse_layout({**raw, "formats": {"kda.q_proj": "int4", "*": "source"}})
    assert e.value.rules == ["format-name"]


def test_every_layout_name_resolves_for_the_roles_it_fits():
    for name in LAYOUT_NAMES:
        for role in _fitting_roles(name):
            fmt = storage_for(name, role)
            assert fmt is STORAGE[fmt.name]
    # source keeps a role's own storage: an MXFP4 pair passes through as mxfp4
    expert = next(r for r in ROLES if r.fmt is Format.MXFP4)
    assert storage_for("source", expert).name == "mxfp4"
    assert storage_for("source", ROLES[0]).name == "source"


# ---- every format round-trips encode -> decode against the codec math ----

def _source_parts(fmt_name: str, rng) -> tuple[dict[str, np.ndarray], torch.Tensor, str]:
    """Source bytes of a [ROWS, COLS] slice (one row per weight row), its values, and its dtype."""
    if fmt_name in ("mxfp4", "nvfp4"):
        packed = torch.from_numpy(rng.integers(0, 256, (ROWS, COLS // 2), dtype=np.uint8))
        scale = torch.from_numpy(rng.integers(120, 134, (ROWS, COLS // mxfp4.BLOCK), dtype=np.uint8))
        return ({"packed": packed.numpy(), "scale": scale.numpy()},
                mxfp4.dequantize(packed, scale, torch.float32), "U8")
    w = torch.from_numpy(rng.standard_normal((ROWS, COLS), dtype=np.float32)).to(torch.bfloat16)
    return {"weight": w.view(torch.uint8).numpy()}, w.float(), "BF16"


def _encode_slice(fmt, parts, src: dict[str, np.ndarray], scale_rule) -> dict[str, np.ndarray]:
    """Every device part of the slice: groups of rows_per_group rows concatenated, then swizzled."""
    if fmt.whole_tensor:
        full, _ = fmt.encode_tensor(src)
        out = fmt.slice_tensor(full, (0, ROWS), None)
    else:
        chunks: dict[str, list] = {}
        for part, rows in src.items():
            g = parts[0].rows_per_group
            for r in range(0, ROWS, g):
                for k, v in fmt.encode(part, rows[r: r + g], scale_rule).items():
                    chunks.setdefault(k, []).append(v)
        out = {k: np.concatenate(v) for k, v in chunks.items()}
    for p in parts:
        if p.swizzled_cols:
            out[p.part] = swizzle(torch.from_numpy(np.ascontiguousarray(out[p.part]))).numpy()
    return out


def _as_tensor(raw: np.ndarray, dtype: str, shape) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)).view(SAFETENSORS_DTYPES[dtype][0]).reshape(shape)


def _oracle_mxfp4(w, rule):
    return mxfp4.dequantize(*mxfp4.quantize(w.to(torch.bfloat16), scale_rule=rule), torch.float32)


# per storage format: the expected decoded slice from the codecs (a format's own tests add its row)
ORACLES = {
    "source": lambda w, rule: w,
    "mxfp4": lambda w, rule: w,  # pass-through: the source pair's values
    "nvfp4": lambda w, rule: w,  # lossless transcode of in-range blocks
    "mxfp4-from-bf16": _oracle_mxfp4,
    "fp8-e4m3-channel": lambda w, rule: fp8.dequantize_channel(*fp8.quantize_channel(w.to(torch.bfloat16))),
    "fp8-e4m3-block128": lambda w, rule: fp8.dequantize_block(*fp8.quantize_block(w.to(torch.bfloat16))),
}


def test_every_registered_format_has_a_round_trip_oracle():
    assert set(ORACLES) == set(STORAGE)


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("name", sorted(STORAGE))
def test_every_format_round_trips_encode_decode(name, swizzled):
    fmt = STORAGE[name]
    rule = fmt.scale_rules[0] if fmt.scale_rules else None
    src, values, dtype = _source_parts(name, np.random.default_rng(7))
    parts = fmt.parts((ROWS, COLS), swizzled, dtype, rule)
    out = _encode_slice(fmt, parts, src, rule)
    assert sorted(out) == sorted(p.part for p in parts)
    device = {}
    for p in parts:
        assert out[p.part].nbytes == p.nbytes, p
        device[p.part] = _as_tensor(out[p.part], p.dtype, p.shape)
    got = fmt.decode(device, torch.float32)
    want = ORACLES[name](values, rule)
    assert got.shape == (ROWS, COLS)
    assert torch.equal(got.float(), want.float())
    if name == "nvfp4":  # the global scale is the one the codec picks for the whole tensor
        _, _, g, _ = nvfp4.from_mxfp4(torch.from_numpy(src["packed"]), torch.from_numpy(src["scale"]))
        assert device["global_scale"].item() == 1 / g.item()  # compressed-tensors stores 1 / multiplier


# ---- every format's parts are what convert writes ----

def _layout_using_every_format(scale_layout: str) -> dict:
    """A one-card layout giving each registry name its own role of the tiny model."""
    formats, taken = {}, set()
    for name in sorted(LAYOUT_NAMES, key=lambda n: len(_fitting_roles(n))):  # scarcest roles first
        role = next(r for r in _fitting_roles(name) if r.role not in taken and r.section is Section.TEXT
                    and r.scope is not Scope.GLOBAL)
        taken.add(role.role)
        formats[role.role] = _spec(name)
    formats["*"] = "source"
    return {"schema_version": 1, "name": f"every-format-{scale_layout}", "card": {
        "name": "test", "count": 1, "hbm_bytes": 10**12, "hbm_bandwidth_bytes_per_s": 10**12,
        "link_bandwidth_bytes_per_s": 10**11, "peak_flops": {"bf16": 10**15}},
        "parallel": {"tp": 1}, "formats": formats, "scale_layout": scale_layout}


@pytest.mark.parametrize("scale_layout", ["row-major", "swizzled-128x4"])
def test_every_format_parts_match_what_convert_writes(tiny_ckpt, tmp_path, scale_layout):
    from k3bundle.provenance.verify import verify
    from k3bundle.convert import convert
    from k3bundle.schema import ROLE_BY_NAME, Schema
    from k3bundle.config import load_config

    data = _layout_using_every_format(scale_layout)
    path = tmp_path / "layout.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))  # formats: first match wins
    layout = parse_layout(data)
    out = tmp_path / "bundle"
    convert(tiny_ckpt, str(path), out, workers=1)
    schema = Schema(load_config(tiny_ckpt / "config.json"))
    index = json.loads((out / "weights.index.json").read_text())["tensors"]
    seen = set()
    for e in index:
        role = ROLE_BY_NAME[e["role"]]
        rule = layout.rule_for(role)
        fmt = storage_for(rule.format, role)
        assert e["storage"] == fmt.name
        shape = tuple(schema.logical_shape(role))
        if role.padded:
            shape = (schema.dims[role.unit], *shape[1:])
        parts = {p.part: p for p in fmt.parts(shape, layout.swizzled, schema.stored_dtype(role, "weight"),
                                               rule.scale_rule)}
        p = parts[e["part"]]
        lead = e["shape"][:1] if "experts" in e["source"] else []
        assert (e["dtype"], e["shape"], e["transform"]) == (p.dtype, [*lead, *p.shape], p.transform), e["key"]
        assert e["byte_range"][1] - e["byte_range"][0] == p.nbytes * math.prod(lead)
        seen.add(fmt.name)
    assert seen == set(STORAGE)
    report = verify(out, tiny_ckpt)
    assert report.ok, report.problems


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("swizzled", [False, True])
def test_decode_stack_is_decode_of_each_expert(name, swizzled):
    """verify's value check decodes a rank's stacked experts at once: the same values, bit for
    bit, as decoding each expert's slice (what a loader of one expert reads)."""
    import numpy as np

    from k3bundle.formats import mxfp4
    from k3bundle.formats.scale_swizzle import swizzle_stack
    from k3bundle.storage import STORAGE

    fmt = STORAGE[name]
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (4, 64, 32), generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 136, (4, 64, 2), generator=g, dtype=torch.uint8)
    if name == "nvfp4":
        stack = [{"packed": packed[t].numpy(), "scale": scale[t].numpy()} for t in range(4)]
        out, _ = fmt.encode_stack(stack)
        parts = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items() if k != "global_scale"}
        parts["global_scale"] = torch.from_numpy(out["global_scale"].reshape(4, 4).copy().view("<f4"))  # F32 [4, 1]
    else:
        parts = {"packed": packed, "scale": scale}
    if swizzled:
        parts["scale"] = swizzle_stack(parts["scale"])
    got = fmt.decode_stack(parts, torch.float32)
    for t in range(4):
        one = fmt.decode({k: v[t] for k, v in parts.items()}, torch.float32)
        assert torch.equal(got[t].view(torch.int32), one.view(torch.int32))
    if name == "mxfp4" and not swizzled:
        assert torch.equal(got, mxfp4.dequantize(packed, scale))
