"""The declared tensor convention: layouts declare it, bundles follow it, and a writer that breaks
it is caught by ``verify --source`` with a message naming the tensor and the convention, although
re-deriving the bundle with the same writer gives the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from k3bundle.provenance.verify import verify
from k3bundle.convert import convert
from k3bundle.layouts import LayoutError, parse_layout
from k3bundle.storage import CONVENTIONS
from tests._bundles import SHIPPED, bundles, single_threaded_torch  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def _b300(**changes) -> dict:
    data = yaml.safe_load((REPO / "layouts" / "b300-tp8.yaml").read_text())
    data.update(changes)
    return data


@pytest.mark.parametrize("layout", SHIPPED)
def test_every_shipped_layout_declares_its_convention(layout):
    data = yaml.safe_load((REPO / "layouts" / f"{layout}.yaml").read_text())
    assert data.get("convention") in CONVENTIONS


def test_a_convention_that_cannot_name_a_format_is_refused():
    with pytest.raises(LayoutError) as e:
        parse_layout(_b300(convention="modelopt", formats={"moe.expert.*": "mxfp4", "*": "source"}))
    assert set(e.value.rules) == {"format-convention"} and "modelopt" in str(e.value)
    with pytest.raises(LayoutError) as e:
        parse_layout(_b300(convention="gguf"))
    assert "convention" in str(e.value)


def test_config_json_is_the_release_byte_for_byte_and_the_description_sits_beside_the_weights(bundles, tiny_ckpt):
    for name, bundle in bundles.items():
        assert (bundle / "config.json").read_bytes() == (tiny_ckpt / "config.json").read_bytes(), name
        listed = {f["path"] for f in json.loads((bundle / "manifest.json").read_text())["files"]}
        assert "device_weights/quantization_config.json" in listed, name


def test_global_scale_is_stored_as_the_convention_means_it(bundles):
    """compressed-tensors' weight_global_scale is the quantization scale: 1 / the dequant multiplier."""
    from k3bundle.formats import nvfp4
    from k3bundle.bundle.weights import BundleWeights

    bundle = bundles["b300-tp8"]
    index = json.loads((bundle / "weights.index.json").read_text())["tensors"]
    g = next(e for e in index if e["key"].endswith(".weight_global_scale"))
    stored = np.frombuffer((bundle / g["file"]).read_bytes()[slice(*g["byte_range"])], dtype="<f4")
    assert (stored > 1).all()  # the tiny model's weights are O(1): the multiplier is a small power of two
    bw = BundleWeights(bundle, dtype="float32")
    try:
        assert bw.convention == "compressed-tensors"
        (entry, value), *_ = bw.slices(g["role"], g["layer"], g["source"]["experts"][0])
        assert value.abs().amax() < 100  # read through the convention: the weights' own magnitude
    finally:
        bw.close()
    assert nvfp4.BLOCK == 16


# ---- planted writer errors: the re-derivation agrees with them, the value check does not ----

def _swap_nibbles(a: torch.Tensor) -> torch.Tensor:
    return ((a & 0x0F) << 4) | (a >> 4)


def _plant_inverted_global(monkeypatch):
    from k3bundle.storage.conventions import Convention

    monkeypatch.setattr(Convention, "store_global", lambda self, m: m.to(torch.float32))  # the multiplier itself


def _plant_unswizzled(monkeypatch):
    import k3bundle.convert.unit as unit

    def row_major_in_place(rows: np.ndarray) -> np.ndarray:  # right size, tiles never permuted
        from k3bundle.formats.scale_swizzle import swizzled_size

        if rows.ndim == 3:  # convert's stack of experts: each one as a 2-D scale matrix
            return np.stack([row_major_in_place(r) for r in rows])
        flat = np.zeros(swizzled_size(*rows.shape), dtype=rows.dtype)
        flat[: rows.size] = rows.reshape(-1)
        return flat

    monkeypatch.setattr(unit, "swizzle_rows", row_major_in_place)


def _plant_swapped_nibbles(monkeypatch):
    from k3bundle.formats import nvfp4

    def swapping(real):
        def swapped(packed, scales):
            p16, s16, g, bad = real(packed, scales)
            return _swap_nibbles(p16), s16, g, bad
        return swapped

    # the transcode of one tensor and of a stack of them (convert's path for many experts)
    monkeypatch.setattr(nvfp4, "from_mxfp4", swapping(nvfp4.from_mxfp4))
    monkeypatch.setattr(nvfp4, "from_mxfp4_stack", swapping(nvfp4.from_mxfp4_stack))


@pytest.mark.parametrize("plant,convention", [(_plant_inverted_global, "compressed-tensors"),
                                              (_plant_inverted_global, "modelopt"),
                                              (_plant_unswizzled, "compressed-tensors"),
                                              (_plant_swapped_nibbles, "compressed-tensors")])
def test_a_planted_convention_error_fails_verify_naming_the_tensor_and_convention(
        tiny_ckpt, tmp_path, monkeypatch, plant, convention):
    layout = tmp_path / "layout.yaml"
    layout.write_text(yaml.safe_dump(_b300(name="planted", convention=convention), sort_keys=False))
    plant(monkeypatch)
    if plant is _plant_inverted_global and convention == "modelopt":
        from k3bundle.storage.conventions import Convention

        monkeypatch.setattr(Convention, "store_global", lambda self, m: (1.0 / m.double()).float())
    convert(tiny_ckpt, str(layout), tmp_path / "bundle", workers=1)
    report = verify(tmp_path / "bundle", tiny_ckpt)
    assert report.rederived_files and not any("re-derivation" in p for p in report.problems)  # same writer
    assert not report.ok
    named = [p for p in report.problems if f"declared {convention} convention" in p]
    assert named, report.problems
    suffix = ".weight_packed" if convention == "compressed-tensors" else ".weight"
    assert all("block_sparse_moe.experts.w" in p and suffix + " expert " in p for p in named), named[:3]


def test_the_same_bundles_unplanted_pass_the_value_check(bundles, tiny_ckpt):
    report = verify(bundles["b300-tp8"], tiny_ckpt)
    assert report.ok, report.problems
    assert report.value_checked_tensors > 0 and report.value_checked_slices >= report.value_checked_tensors
