"""Bundles read by other tools: every storage format a shipped layout uses, decoded by a reader
that is not k3bundle's, must give the source's values decoded by a reader that is not k3bundle's.

Readers: compressed-tensors' own compressors (NVFP4, MXFP4) and its ModelOpt -> compressed-tensors
converter, torchao's ``to_blocked`` for the 128x4 swizzle, torch's float8 dtype for FP8, the
``safetensors`` package for the files. Checked with compressed-tensors 0.20.1, torchao 0.18.0,
torch 2.13, safetensors 0.8 (docs/bundle-format.md "Conventions").
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests._bundles import bundles, single_threaded_torch  # noqa: F401

ct = pytest.importorskip("compressed_tensors")
safetensors = pytest.importorskip("safetensors")
to_blocked = pytest.importorskip("torchao.prototype.mx_formats.utils").to_blocked

from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NVFP4_SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4A16)
MXFP4_SCHEME = QuantizationScheme(targets=["Linear"], **MXFP4A16)


def _get(path: Path, key: str) -> torch.Tensor:
    with safetensors.safe_open(str(path), "pt") as f:
        return f.get_tensor(key)


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Invert torchao's ``to_blocked`` (the 128x4 layout) by pushing element numbers through it."""
    order = to_blocked(torch.arange(1, rows * cols + 1, dtype=torch.float64).reshape(rows, cols)).reshape(-1).long()
    out = torch.empty(rows * cols, dtype=flat.dtype)
    live = order > 0
    out[order[live] - 1] = flat.reshape(-1)[live]
    return out.reshape(rows, cols)


def _index(bundle: Path) -> list[dict]:
    return json.loads((bundle / "weights.index.json").read_text())["tensors"]


def _device(bundle: Path, entry: dict, key: str, expert: int | None) -> torch.Tensor:
    t = _get(bundle / entry["file"], key)
    return t[expert - entry["source"]["experts"][0]] if "experts" in entry["source"] else t


def _experts(entry: dict) -> list[int | None]:
    src = entry["source"]
    return list(range(*src["experts"]))[:3] if "experts" in src else [None]


def _source_mxfp4(source: Path, entry: dict, expert: int | None) -> torch.Tensor:
    """The source slice, decoded by compressed-tensors' MXFP4 compressor (the release's format)."""
    s = entry["source"]
    key = s["key_template"].format(eid=expert) if "key_template" in s else s["key"]
    skey = s["scale"]["key_template"].format(eid=expert) if "key_template" in s["scale"] else s["scale"]["key"]
    w = MXFP4PackedCompressor.decompress({"weight_packed": _get(source / s["file"], key),
                                          "weight_scale": _get(source / s["file"], skey)}, MXFP4_SCHEME)["weight"]
    (r0, r1), (c0, c1) = s["rows"], s["cols"]
    return w[r0:r1, c0:c1]


def _row_major(scale: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    return _unswizzle(scale, rows, blocks) if scale.ndim == 1 else scale


def _stem(key: str, suffix: str) -> str:
    assert key.endswith(suffix), key
    return key[: -len(suffix)]


def _parts(bundle: Path, storage: str) -> list[dict]:
    return [e for e in _index(bundle) if e["storage"] == storage and e["part"] in ("packed", "weight")]


# ---- NVFP4 under compressed-tensors (b300-tp8) ----

def test_nvfp4_reads_as_the_source_with_compressed_tensors(bundles, tiny_ckpt):
    bundle = bundles["b300-tp8"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["nvfp4_requantized"] == []  # the tiny model's exponents all fit: exact everywhere
    entries = _parts(bundle, "nvfp4")
    assert entries
    checked = 0
    for e in entries[:: max(1, len(entries) // 24)]:
        stem = _stem(e["key"], ".weight_packed")
        for x in _experts(e):
            packed = _device(bundle, e, e["key"], x)
            rows, blocks = packed.shape[0], packed.shape[1] * 2 // 16
            got = NVFP4PackedCompressor.decompress({
                "weight_packed": packed,
                "weight_scale": _row_major(_device(bundle, e, stem + ".weight_scale", x), rows, blocks),
                "weight_global_scale": _device(bundle, e, stem + ".weight_global_scale", x)}, NVFP4_SCHEME)["weight"]
            want = _source_mxfp4(tiny_ckpt, e, x)
            assert torch.equal(got[: want.shape[0], : want.shape[1]], want), (e["key"], x)
            assert not got[want.shape[0]:].any()  # padding rows read as zeros
            checked += 1
    assert checked >= 24


# ---- NVFP4 under ModelOpt, read by compressed-tensors' ModelOpt converter ----

@pytest.fixture(scope="module")
def modelopt_bundle(tiny_ckpt, tmp_path_factory):
    from k3bundle.convert import convert

    data = yaml.safe_load((REPO / "layouts" / "b300-tp8.yaml").read_text())
    data.update(name="b300-tp8-modelopt", convention="modelopt")
    tmp = tmp_path_factory.mktemp("modelopt")
    (tmp / "layout.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    convert(tiny_ckpt, str(tmp / "layout.yaml"), tmp / "bundle", workers=1)
    return tmp / "bundle"


def test_modelopt_names_convert_to_compressed_tensors_and_read_as_the_source(modelopt_bundle, tiny_ckpt):
    bundle = modelopt_bundle
    entries = _parts(bundle, "nvfp4")
    assert entries and all(e["key"].endswith(".weight") for e in entries)
    converter = ModelOptNvfp4Converter(targets=["re:.*block_sparse_moe\\.experts.*"])
    for e in entries[:: max(1, len(entries) // 12)]:
        stem = _stem(e["key"], ".weight")
        for x in _experts(e):
            packed = _device(bundle, e, e["key"], x)
            rows, blocks = packed.shape[0], packed.shape[1] * 2 // 16
            tensors = {stem + ".weight": packed,
                       stem + ".weight_scale": _row_major(_device(bundle, e, stem + ".weight_scale", x), rows, blocks),
                       stem + ".weight_scale_2": _device(bundle, e, stem + ".weight_scale_2", x)}
            as_ct = converter.validate(tensors)  # renames, and inverts weight_scale_2 into weight_global_scale
            assert sorted(as_ct) == sorted([stem + ".weight_packed", stem + ".weight_scale",
                                            stem + ".weight_global_scale"])
            got = NVFP4PackedCompressor.decompress({k[len(stem) + 1:]: v for k, v in as_ct.items()},
                                                   NVFP4_SCHEME)["weight"]
            want = _source_mxfp4(tiny_ckpt, e, x)
            assert torch.equal(got[: want.shape[0], : want.shape[1]], want), (e["key"], x)


def test_modelopt_description_names_what_is_quantized(modelopt_bundle):
    doc = json.loads((modelopt_bundle / "device_weights" / "hf_quant_config.json").read_text())
    q = doc["quantization"]
    assert (q["quant_algo"], q["group_size"]) == ("NVFP4", 16)
    assert not (modelopt_bundle / "device_weights" / "quantization_config.json").exists()
    excluded = q["exclude_modules"]
    for e in _index(modelopt_bundle):
        if e["part"] not in ("packed", "weight") or not e["key"].endswith(".weight") or len(e["shape"]) < 2:
            continue
        module = _stem(e["key"], ".weight")
        hit = any(fnmatch.fnmatchcase(module, p) for p in excluded)
        assert hit == (e["storage"] != "nvfp4"), module


# ---- MXFP4 pass-through, row-major (h200) and swizzled (gb300): compressed-tensors' MXFP4 reader ----

@pytest.mark.parametrize("layout", ["h200-tp16-ep16", "gb300-dep16"])
def test_mxfp4_reads_as_the_source_with_compressed_tensors(bundles, tiny_ckpt, layout):
    bundle = bundles[layout]
    entries = _parts(bundle, "mxfp4")
    assert entries
    for e in entries[:: max(1, len(entries) // 16)]:
        stem = _stem(e["key"], ".weight_packed")
        for x in _experts(e):
            packed = _device(bundle, e, e["key"], x)
            rows, blocks = packed.shape[0], packed.shape[1] * 2 // 32
            scale = _row_major(_device(bundle, e, stem + ".weight_scale", x), rows, blocks)
            got = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale},
                                                   MXFP4_SCHEME)["weight"]
            want = _source_mxfp4(tiny_ckpt, e, x)
            assert torch.equal(got[: want.shape[0], : want.shape[1]], want), (e["key"], x)


def test_mxfp4_from_bf16_reads_within_its_bound_with_compressed_tensors(bundles, tiny_ckpt):
    bundle = bundles["new-accelerator.example"]
    entries = _parts(bundle, "mxfp4-from-bf16")
    assert entries
    for e in entries:
        stem = _stem(e["key"], ".weight_packed")
        packed = _get(bundle / e["file"], e["key"])
        rows, blocks = packed.shape[0], packed.shape[1] * 2 // 32
        scale = _row_major(_get(bundle / e["file"], stem + ".weight_scale"), rows, blocks)
        got = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale},
                                               MXFP4_SCHEME)["weight"].float()
        want = _bf16_source(tiny_ckpt, e)
        got = got[: want.shape[0], : want.shape[1]]
        amax = want.abs().reshape(want.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)
        assert ((got - want).abs() <= amax / 3).all(), e["key"]  # E2M1 rounding, EVEN-rule saturation
        assert (got - want).norm() / want.norm() < 0.2


# ---- FP8: torch's float8_e4m3fn ----

def _bf16_source(source: Path, entry: dict) -> torch.Tensor:
    s = entry["source"]
    w = _get(source / s["file"], s["key"]).float()
    (r0, r1), (c0, c1) = s["rows"], s["cols"]
    return w[r0:r1, c0:c1]


@pytest.mark.parametrize("layout,storage", [("mi355x-tp8", "fp8-e4m3-channel"),
                                            ("new-accelerator.example", "fp8-e4m3-block128")])
def test_fp8_reads_within_e4m3_precision_with_torch_float8(bundles, tiny_ckpt, layout, storage):
    bundle = bundles[layout]
    entries = _parts(bundle, storage)
    assert entries
    for e in entries:
        w = _get(bundle / e["file"], e["key"])
        scale = _get(bundle / e["file"], _stem(e["key"], ".weight") + ".weight_scale")
        assert w.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        if storage == "fp8-e4m3-channel":
            assert scale.shape == (w.shape[0], 1)  # compressed-tensors' channel strategy
            got = w.float() * scale
        else:
            got = w.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        want = _bf16_source(tiny_ckpt, e)
        got = got[: want.shape[0], : want.shape[1]]
        assert ((got - want).abs() <= want.abs() * 2.0**-4 + want.abs().amax() * 2.0**-10 / 448).all(), e["key"]


# ---- the compressed-tensors description matches the tensors ----

@pytest.mark.parametrize("layout", ["b300-tp8", "gb300-dep16", "mi355x-tp8", "new-accelerator.example"])
def test_compressed_tensors_description_targets_exactly_the_quantized_modules(bundles, layout):
    bundle = bundles[layout]
    doc = json.loads((bundle / "device_weights" / "quantization_config.json").read_text())
    cfg = QuantizationConfig.model_validate(doc)
    assert cfg.quant_method == "compressed-tensors" and cfg.quantization_status == "compressed"
    fmt_of = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized",
              "mxfp4-from-bf16": "mxfp4-pack-quantized", "fp8-e4m3-channel": "float-quantized",
              "fp8-e4m3-block128": "float-quantized"}
    for e in _index(bundle):
        if e["part"] not in ("packed", "weight"):
            continue
        module = e["key"].rsplit(".", 1)[0]
        groups = [g for g in cfg.config_groups.values() if any(match_name(module, t) for t in g.targets)]
        if e["storage"] == "source":
            assert not groups, module
            continue
        assert len(groups) == 1, module
        assert groups[0].format == fmt_of[e["storage"]], module
        if e["storage"] == "nvfp4":
            assert groups[0].weights.model_dump() == QuantizationScheme(targets=["x"], **NVFP4A16).weights.model_dump()
