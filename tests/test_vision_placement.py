"""The vision tower and projector in a bundle: replicated verbatim on every rank of stage 0.

Oracles, independent of the converter: the expected ranks from the layout YAML's degrees
(stage 0 = the first ``tp x attention_dp`` ranks), the tensors and their bytes read from the
source shards and the device files with the ``safetensors`` library, and the source file of
each key found by reading every source shard's header here.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from k3bundle.layouts import LayoutError, parse_layout
from k3bundle.provenance.trace import trace
from k3bundle.provenance.verify import verify
from k3bundle.schema import Schema, Section
from k3bundle.schema.roles import ROLE_BY_NAME
from k3bundle.config import load_config
from tests._bundles import SHIPPED, bundles, single_threaded_torch  # noqa: F401 (fixtures)
from tests.conftest import REPO, run_cli

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def _raw_bytes(f, key: str) -> bytes:
    t = f.get_tensor(key)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _source_vision(ckpt: Path) -> dict[str, tuple[str, str, list[int], bytes]]:
    """key -> (source file, dtype, shape, bytes) of every vision / projector tensor of the source."""
    out = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.startswith(VISION_PREFIXES):
                    assert key not in out, f"{key} in two source files"
                    s = f.get_slice(key)
                    out[key] = (path.name, s.get_dtype(), list(s.get_shape()), _raw_bytes(f, key))
    return out


def _device_vision(bundle: Path) -> dict[int, dict[str, tuple[str, list[int], bytes]]]:
    """rank -> key -> (dtype, shape, bytes) of the vision / projector tensors in its device files."""
    out: dict[int, dict] = {}
    for rank_dir in sorted((bundle / "device_weights").glob("rank-*")):
        rank = int(rank_dir.name.removeprefix("rank-"))
        held = out.setdefault(rank, {})
        for path in sorted(rank_dir.glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key.startswith(VISION_PREFIXES):
                        s = f.get_slice(key)
                        held[key] = (s.get_dtype(), list(s.get_shape()), _raw_bytes(f, key))
    return out


def _stage0_ranks(layout: str) -> tuple[set[int], int]:
    """(ranks of pipeline stage 0, world) from the layout file's own numbers."""
    d = yaml.safe_load((REPO / "layouts" / f"{layout}.yaml").read_text())
    par = d["parallel"]
    per_stage = par["tp"] * par.get("attention_dp", 1)
    return set(range(per_stage)), per_stage * par.get("pp", 1)


@pytest.fixture(scope="module")
def source_vision(tiny_ckpt):
    return _source_vision(tiny_ckpt)


def test_the_source_holds_exactly_the_schemas_vision_tensors(tiny_ckpt, source_vision):
    schema = Schema(load_config(tiny_ckpt / "config.json"))
    names = {spec.name for role, layer in schema.instances() if role.section is not Section.TEXT
             for spec in schema.specs(role, layer)}
    assert names == set(source_vision)
    assert len(names) == 2 + 6 * 2 + 1 + 3  # patch embed + pos emb, 6 per block x 2 blocks, final norm, projector
    assert {v[1] for v in source_vision.values()} == {"BF16"}


@pytest.mark.parametrize("name", SHIPPED)
def test_vision_tensors_sit_verbatim_on_every_stage0_rank(bundles, source_vision, name):
    stage0, world = _stage0_ranks(name)
    device = _device_vision(bundles[name])
    assert set(device) == set(range(world))
    for rank in range(world):
        if rank in stage0:
            assert set(device[rank]) == set(source_vision), rank
        else:
            assert device[rank] == {}, (rank, sorted(device[rank])[:3])  # later stages hold none
    for rank in stage0:
        for key, (dtype, shape, data) in device[rank].items():
            _, src_dtype, src_shape, src_data = source_vision[key]
            assert (dtype, shape) == ("BF16", src_shape) and src_dtype == "BF16", (rank, key)
            assert data == src_data, (rank, key)


@pytest.mark.parametrize("name", SHIPPED)
def test_trace_names_the_source_file_key_and_whole_slice(bundles, source_vision, name):
    b = bundles[name]
    index = json.loads((b / "weights.index.json").read_text())
    stage0, _ = _stage0_ranks(name)
    rng = random.Random(name)
    for rank in sorted(stage0):
        for key, (file, _, shape, data) in source_vision.items():
            t = trace(b, rank, key, index=index)
            src = t["source"]
            assert (src["file"], src["key"], src["logical_shape"]) == (file, key, shape), (rank, key)
            assert src["rows"] == [0, shape[0]] and src["cols"] in (None, [0, shape[1]] if len(shape) > 1 else None)
            assert (t["storage"], t["transform"], t["dtype"], t["shape"]) == ("source", "copy", "BF16", shape)
            off = rng.randrange(len(data))
            byte = trace(b, rank, key, off, index=index)["byte"]
            b0, b1 = byte["source"]["bytes"]
            assert (byte["source"]["file"], byte["source"]["key"]) == (file, key)
            assert (b0, b1) == (off, off + 1), (rank, key, off, byte)  # a copy: the same byte of the same key


def test_trace_cli_for_a_vision_tensor_and_a_rank_that_has_none(bundles, tiny_ckpt):
    b = bundles["b200-tp8-pp2"]
    key = "vision_tower.encoder.blocks.1.wqkv.weight"
    r = run_cli("trace", str(b), "7", key, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    with safe_open(tiny_ckpt / doc["source"]["file"], framework="pt") as f:
        assert key in f.keys()
    assert doc["source"]["key"] == key and doc["rank"] == 7
    r = run_cli("trace", str(b), "8", key)  # stage 1: no vision tower
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"rank 8 has no tensor '{key}'" in r.stderr and "it is on ranks 0-7" in r.stderr


def test_verify_locates_a_flipped_byte_in_a_replicated_vision_tensor(bundles, tiny_ckpt, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundles["b200-tp8-pp2"], b)
    index = json.loads((b / "weights.index.json").read_text())
    e = next(x for x in index["tensors"] if x["key"] == "mm_projector.proj.0.weight" and x["rank"] == 5)
    path = b / e["file"]
    data = bytearray(path.read_bytes())
    data[e["byte_range"][0] + 40] ^= 0x01
    path.write_bytes(bytes(data))
    r = verify(b, tiny_ckpt)
    located = [p for p in r.problems if "differs from its re-derivation" in p]
    assert located and f"in tensor {e['key']} (byte 40" in located[0] and "rank-005" in located[0], r.problems


@pytest.mark.parametrize("pattern,fmt", [("vit.*", "fp8-e4m3-channel"), ("*fc*", "fp8-e4m3-block128"),
                                         ("proj.fc1", "mxfp4-from-bf16")])
def test_a_layout_that_would_recode_the_vision_tower_is_refused(pattern, fmt):
    d = yaml.safe_load((REPO / "layouts" / "b300-tp8.yaml").read_text())
    spec = {"format": fmt, "scale_rule": "even"} if fmt == "mxfp4-from-bf16" else fmt
    d["formats"] = {"moe.expert.*": "nvfp4", pattern: spec, "*": "source"}
    with pytest.raises(LayoutError) as e:
        parse_layout(d, "test.yaml")
    assert e.value.rules == ["vision-as-released"], str(e.value)
    assert f"formats[{pattern!r}]" in str(e.value) and str(e.value).count("\n") == 0


def test_a_layout_may_spell_the_vision_tower_bf16_or_source():
    d = yaml.safe_load((REPO / "layouts" / "b300-tp8.yaml").read_text())
    d["formats"] = {"moe.expert.*": "nvfp4", "vit.*": "bf16", "proj.*": "source", "*": "source"}
    lay = parse_layout(d, "test.yaml")
    assert lay.rule_for(ROLE_BY_NAME["vit.wqkv"]).format == "bf16"
    assert lay.rule_for(ROLE_BY_NAME["proj.fc2"]).format == "source"


def test_a_miss_names_the_ranks_that_hold_the_key():
    from k3bundle.bundle.errors import BundleError
    from k3bundle.bundle.index import find_entry

    index = {"tensors": [{"rank": r, "key": "a.weight"} for r in (0, 1, 2, 3, 8)] + [{"rank": 5, "key": "b.weight"}]}
    with pytest.raises(BundleError, match=r"rank 5 has no tensor 'a.weight' \(1 tensors\); it is on ranks 0-3, 8$"):
        find_entry(index, 5, "a.weight")
    with pytest.raises(BundleError, match=r"; it is on rank 5$"):
        find_entry(index, 0, "b.weight")
