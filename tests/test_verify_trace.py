"""verify and trace: tampering is caught and located; slices reassemble; random bytes trace back."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from k3bundle.bundle.errors import BundleError
from k3bundle.provenance.trace import trace
from k3bundle.provenance.verify import verify
from k3bundle.formats import fp8
from k3bundle.formats.scale_swizzle import unswizzle
from tests._bundles import bundles, file_bytes, raw_tensor, single_threaded_torch  # noqa: F401 (fixtures)
from tests.conftest import run_cli




def _index(bundle: Path) -> dict:
    return json.loads((bundle / "weights.index.json").read_text())


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_catches_and_locates_a_flipped_device_byte(bundles, tiny_ckpt, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundles["h200-tp16-ep16"], b)
    e = next(x for x in _index(b)["tensors"] if x["key"].endswith("self_attn.q_proj.weight") and x["rank"] == 5)
    _flip(b / e["file"], e["byte_range"][0] + 100)
    r = verify(b)
    assert not r.ok
    assert any(e["file"] in p and "does not match the manifest" in p for p in r.problems)
    r = verify(b, tiny_ckpt)
    located = [p for p in r.problems if "differs from its re-derivation" in p]
    assert located and f"at byte {e['byte_range'][0] + 100} in tensor {e['key']} (byte 100" in located[0]
    assert any("differs from source" in p and e["key"] in p for p in r.problems)  # reassembly sees it too
    cli = run_cli("verify", str(b))
    assert cli.returncode == 1 and "FAILED" in cli.stdout


def test_verify_reports_missing_and_unlisted_files(bundles, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundles["mi355x-tp8"], b)
    (b / "tokenizer" / "tiktoken.model").unlink()
    (b / "stray.bin").write_bytes(b"x")
    (b / "reports").mkdir()
    (b / "reports" / "later.json").write_text("{}")  # written later by validate: allowed
    r = verify(b)
    assert "tokenizer/tiktoken.model: missing" in r.problems
    assert "stray.bin: not listed in the manifest" in r.problems
    assert not any("reports/" in p for p in r.problems)


def test_verify_needs_a_manifest(tiny_ckpt, tmp_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        verify(tmp_path)
    r = run_cli("verify", str(tmp_path))
    assert r.returncode == 2 and "no manifest.json" in r.stderr


def test_verify_with_a_different_source_fails(bundles, tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    _flip(src / "model-00011-of-000012.safetensors", 20_000)
    r = verify(bundles["b200-tp8-pp2"], src)
    assert not r.ok and any("model-00011-of-000012.safetensors" in p and "sha256" in p for p in r.problems)


@pytest.mark.parametrize("name", ["h200-tp16-ep16", "b200-tp8-pp2", "b300-tp8"])
def test_reassembling_rank_slices_reproduces_every_pass_through_tensor(bundles, tiny_ckpt, name):
    """Independent of the converter and of verify: cat the slices the index names, compare."""
    b = bundles[name]
    idx = _index(b)["tensors"]
    pieces: dict[str, list] = {}
    for e in idx:
        if e["transform"] not in ("copy", "swizzle-128x4"):
            continue
        s = e["source"]
        dev = file_bytes(b / e["file"], *e["byte_range"])
        for k, x in enumerate(range(*s["experts"]) if "expert_stride" in s else [None]):
            stride = s.get("expert_stride", len(dev))
            key = s.get("key") or s["key_template"].replace("{eid}", str(x))
            pieces.setdefault(key, []).append((e, dev[k * stride: (k + 1) * stride]))
    assert pieces
    for key, parts in pieces.items():
        file = parts[0][0]["source"]["file"]
        entry, raw = raw_tensor(tiny_ckpt / file, key)
        rows = entry["shape"][0] if entry["shape"] else 1
        src = np.frombuffer(raw, np.uint8).reshape(rows, -1)
        got = np.zeros_like(src)
        seen = np.zeros(src.shape, dtype=np.int32)
        for e, dev in parts:
            s = e["source"]
            r0, r1 = s["rows"]
            per = 2 if e["part"] == "packed" else 32 if (e["storage"] == "mxfp4" and e["part"] == "scale") else 1
            es = src.shape[1] // (s["logical_shape"][1] // per) if s["cols"] and len(entry["shape"]) == 2 else 0
            c0, c1 = (s["cols"][0] // per * es, s["cols"][1] // per * es) if es else (0, src.shape[1])
            pad_rows = s.get("pad_rows", 0)
            w = c1 - c0 + (s.get("pad_cols", 0) // per * es if es else 0)
            arr = np.frombuffer(dev, np.uint8)
            if e["transform"] == "swizzle-128x4":
                arr = unswizzle(torch.from_numpy(arr.copy()), r1 - r0 + pad_rows, w).numpy()
            arr = arr.reshape(r1 - r0 + pad_rows, w)
            assert not arr[r1 - r0:].any() and not arr[:, c1 - c0:].any(), (key, "padding must be zero")
            got[r0:r1, c0:c1] = arr[: r1 - r0, : c1 - c0]
            seen[r0:r1, c0:c1] += 1
        held = seen.any(axis=1)
        assert np.array_equal(got[held], src[held]), key
        assert src[~held].sum() == 0, key  # rows no rank holds: only A_log's zero padding
        copies = set(seen[held].ravel().tolist())
        assert len(copies) == 1, (key, copies)  # every element held equally often (replicas x 1 slice)


def _sample(idx: list[dict], rng: random.Random, n: int, pred) -> list[tuple[dict, int]]:
    pool = [e for e in idx if pred(e)]
    return [(e, rng.randrange(e["byte_range"][1] - e["byte_range"][0])) for e in rng.choices(pool, k=n)]


@pytest.mark.parametrize("name", ["h200-tp16-ep16", "b200-tp8-pp2", "b300-tp8", "gb300-dep16"])
def test_trace_round_trip_on_random_bytes(bundles, tiny_ckpt, name):
    b = bundles[name]
    index = _index(b)
    rng = random.Random(name)
    padding = exact = 0
    for e, off in _sample(index["tensors"], rng, 400, lambda e: e["transform"] in ("copy", "swizzle-128x4")):
        t = trace(b, e["rank"], e["key"], off, index=index)["byte"]
        dev = file_bytes(b / e["file"], t["file_offset"], t["file_offset"] + 1)
        if t["padding"]:
            assert dev == b"\0"
            padding += 1
            continue
        # the traced source byte, read here with an independent safetensors parser
        _, raw = raw_tensor(tiny_ckpt / t["source"]["file"], t["source"]["key"])
        b0, b1 = t["source"]["bytes"]
        assert raw[b0:b1] == dev, (e["key"], off, t)
        exact += 1
    assert exact > 300


def test_trace_of_nvfp4_and_fp8_bytes(bundles, tiny_ckpt):
    b = bundles["b300-tp8"]
    index = _index(b)
    rng = random.Random(3)
    for e, off in _sample(index["tensors"], rng, 200, lambda e: e["storage"] == "nvfp4" and e["part"] == "packed"):
        t = trace(b, e["rank"], e["key"], off, index=index)["byte"]
        dev = file_bytes(b / e["file"], t["file_offset"], t["file_offset"] + 1)
        if t["padding"]:
            assert dev == b"\0"
            continue
        _, raw = raw_tensor(tiny_ckpt / t["source"]["file"], t["source"]["key"])
        assert raw[t["source"]["bytes"][0]: t["source"]["bytes"][1]] == dev  # lossless: same E2M1 codes
        assert t["scale"]["key"].endswith(".weight_scale")
    b = bundles["mi355x-tp8"]
    index = _index(b)
    entries = {(x["key"], x["rank"]): x for x in index["tensors"]}
    for e, off in _sample(index["tensors"], rng, 200,
                          lambda e: e["storage"] == "fp8-e4m3-channel" and e["part"] == "weight"):
        t = trace(b, e["rank"], e["key"], off, index=index)
        byte = t["byte"]
        q = torch.tensor([file_bytes(b / e["file"], byte["file_offset"], byte["file_offset"] + 1)[0]],
                         dtype=torch.uint8).view(torch.float8_e4m3fn)
        se = entries[t["device_scale"]["device_key"], e["rank"]]
        i = byte["device_element"][0]
        scale = np.frombuffer(file_bytes(b / se["file"], se["byte_range"][0] + 4 * i, se["byte_range"][0] + 4 * i + 4),
                              np.float32)[0]
        got = float(fp8.dequantize_channel(q.reshape(1, 1), torch.tensor([scale]))[0, 0])
        _, raw = raw_tensor(tiny_ckpt / byte["source"]["file"], byte["source"]["key"])
        s0, s1 = byte["source"]["bytes"]
        want = float(torch.frombuffer(bytearray(raw[s0:s1]), dtype=torch.bfloat16)[0])
        assert abs(got - want) <= abs(want) * 0.07 + scale * 2 ** -6, (e["key"], off, got, want)


def test_trace_cli_and_errors(bundles):
    b = bundles["h200-tp16-ep16"]
    key = "language_model.model.layers.1.block_sparse_moe.experts.w2.weight_packed"
    r = run_cli("trace", str(b), "7", key, "--offset", "5")
    assert r.returncode == 0, r.stderr
    assert "experts.{eid}.w2.weight_packed (experts 7..7)" in r.stdout and "expert 7" in r.stdout
    r = run_cli("trace", str(b), "7", key, "--json")
    doc = json.loads(r.stdout)
    assert doc["source"]["experts"] == [7, 8] and doc["source"]["sha256"]
    r = run_cli("trace", str(b), "7", key.replace("w2", "w9"))
    assert r.returncode == 2 and "has no tensor" in r.stderr
    with pytest.raises(BundleError, match="outside tensor"):
        trace(b, 7, key, 10**9)


@pytest.mark.parametrize("name", ["h200-tp16-ep16", "b300-tp8"])
def test_index_lookup_finds_every_entry_as_the_full_parse_does(bundles, name, tmp_path):
    """lookup reads one entry by its line; the oracle is json.loads of the whole file. The index's
    device keys repeat across ranks and can equal a source key on the same line, so every entry is
    looked up. A re-formatted file (indented by another tool) must still be read, by the full parse."""
    from k3bundle.bundle.index import lookup

    path = bundles[name] / "weights.index.json"
    whole = _index(bundles[name])
    head = {k: v for k, v in whole.items() if k != "tensors"}
    for e in whole["tensors"]:
        assert lookup(path, e["rank"], e["key"]) == (head, e)
    pretty = tmp_path / "weights.index.json"
    pretty.write_text(json.dumps(whole, indent=2))
    e = whole["tensors"][-1]
    assert lookup(pretty, e["rank"], e["key"]) == (head, e)
    with pytest.raises(BundleError, match="has no tensor"):
        lookup(path, e["rank"], e["key"] + "x")
    not_index = tmp_path / "other.json"
    not_index.write_text(json.dumps({**whole, "kind": "something.else"}, separators=(",", ":")))
    with pytest.raises(BundleError, match="not a k3bundle.weights_index file"):
        lookup(not_index, e["rank"], e["key"])


def test_trace_command_does_not_load_torch(bundles):
    """trace must answer in well under a second at 497,220 tensors: no torch import (1+ s) on its path."""
    import subprocess
    import sys

    from tests.conftest import REPO

    key = "language_model.model.layers.1.block_sparse_moe.experts.w2.weight_packed"
    code = ("import sys; sys.argv = ['k3bundle', 'trace', %r, '7', %r, '--offset', '5']\n"
            "from k3bundle.cli.app import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted(m for m in ('torch', 'numpy', 'triton', 'safetensors') if m in sys.modules))"
            % (str(bundles["h200-tp16-ep16"]), key))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "expert 7" in r.stdout and r.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", ["h200-tp16-ep16", "gb300-dep16"])
def test_reassembly_compares_stacked_experts_as_stacks_and_names_the_expert(bundles, tiny_ckpt, tmp_path, name):
    """A byte of one expert in a rank's stacked tensor (MXFP4 as released; gb300: swizzled scales):
    the stack comparison finds it and names the rank, the key and the expert, and only that expert's
    source tensor fails to reassemble."""
    b = tmp_path / "b"
    shutil.copytree(bundles[name], b)
    index = _index(b)
    stacks = [x for x in index["tensors"] if "expert_stride" in x["source"] and x["part"] == "scale"]
    e = max(stacks, key=lambda x: x["source"]["experts"][1] - x["source"]["experts"][0])  # the most experts
    expert = e["source"]["experts"][1] - 1  # the last of them
    at = e["byte_range"][0] + (expert - e["source"]["experts"][0]) * e["source"]["expert_stride"] + 3
    data = bytearray((b / e["file"]).read_bytes())
    data[at] ^= 0x10
    (b / e["file"]).write_bytes(bytes(data))
    clean = verify(bundles[name], tiny_ckpt)
    r = verify(b, tiny_ckpt)
    named = [p for p in r.problems if "differs from source" in p or "padding is not zero" in p]
    assert len(named) == 1 and f"rank {e['rank']} {e['key']} expert {expert}" in named[0], r.problems
    assert r.reassembled_tensors == clean.reassembled_tensors - 1
    assert r.reassembled_slices == clean.reassembled_slices
