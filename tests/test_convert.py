"""k3bundle convert: every shipped layout, determinism, exactness, provenance, kill/resume, disk full."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from k3bundle.bundle.manifest import read_manifest
from k3bundle.provenance.verify import verify
from k3bundle.convert import ConvertError, convert
from k3bundle.convert.journal import JOURNAL
from k3bundle.formats import fp8, mxfp4, nvfp4
from k3bundle.formats.scale_swizzle import unswizzle
from tests._bundles import SHIPPED, bundles, file_bytes, file_hashes, raw_tensor, single_threaded_torch  # noqa: F401
from tests._memory import VMHWM, child_env
from tests.conftest import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}




def _index(bundle: Path) -> list[dict]:
    return json.loads((bundle / "weights.index.json").read_text())["tensors"]


def _device_bytes(bundle: Path, e: dict) -> bytes:
    return file_bytes(bundle / e["file"], *e["byte_range"])


def _source(tiny_ckpt: Path, e: dict, expert=None, part_key="key") -> tuple[dict, bytes]:
    src = e["source"] if part_key == "key" else e["source"]["scale"]
    key = src.get("key") or src["key_template"].replace("{eid}", str(expert))
    return raw_tensor(tiny_ckpt / e["source"]["file"], key)


def _experts(e: dict):
    src = e["source"]
    if "expert_stride" in src:
        return [(x, (x - src["experts"][0]) * src["expert_stride"], src["expert_stride"]) for x in range(*src["experts"])]
    return [(None, 0, e["byte_range"][1] - e["byte_range"][0])]


@pytest.mark.parametrize("name", SHIPPED)
def test_tiny_converts_under_every_layout_and_verifies_with_source(bundles, tiny_ckpt, name):
    b = bundles[name]
    report = verify(b, tiny_ckpt)
    assert report.ok, report.problems
    devfiles = [p for p in (b / "device_weights").rglob("*.safetensors")]
    assert report.rederived_files == len(devfiles) > 0
    assert report.reassembled_tensors > 0 and report.source_files > 12
    manifest = read_manifest(b)
    assert manifest["plan"]["fits"] and manifest["target"] == name


def test_bundle_contents(bundles, tiny_ckpt):
    b = bundles["b300-tp8"]
    assert (b / "config.json").read_bytes() == (tiny_ckpt / "config.json").read_bytes()
    for rel in ("tokenizer/tiktoken.model", "tokenizer/tokenizer_config.json", "tokenizer/generation_config.json",
                "tokenizer/tokenization_kimi.py", "tokenizer/encoding_k3.py", "processor/preprocessor_config.json"):
        assert (b / rel).read_bytes() == (tiny_ckpt / rel.split("/")[1]).read_bytes(), rel
    manifest = read_manifest(b)
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = {p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(listed) == on_disk
    for path, f in listed.items():
        data = (b / path).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (f["sha256"], f["size"]), path
    for path in ("manifest.json", "weights.index.json", "graph_manifest.json"):
        assert json.loads((b / path).read_text())["schema_version"] == 1
    assert yaml.safe_load((b / "device_weights/layout.yaml").read_text())["schema_version"] == 1
    assert manifest["layout"]["sha256"] == listed["device_weights/layout.yaml"]["sha256"]
    src_files = {f["path"]: f for f in manifest["source"]["files"]}
    for p in tiny_ckpt.iterdir():
        assert src_files[p.name]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    text = (b / "manifest.json").read_text()
    assert str(tiny_ckpt) not in text and str(b) not in text  # no absolute paths: reproducible
    assert manifest["source"]["provenance"] is None and not manifest["source"]["checked_against_source_json"]
    assert not (b / JOURNAL).exists()


def test_graph_manifest(bundles):
    g = json.loads((bundles["h200-tp16-ep16"] / "graph_manifest.json").read_text())
    assert [x["mixer"] for x in g["layers"]] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla", "mla"]
    st = g["state_schema"]
    # tiny: KDA 16 heads x 16 dims, conv kernel 4; MLA latent 32 + 8
    assert st["kda"]["per_layer_per_request"]["recurrent"] == {"dtype": "F32", "shape": [16, 16, 16],
                                                              "bytes": 16 * 16 * 16 * 4}
    assert st["kda"]["per_layer_per_request"]["conv"]["bytes"] == 3 * 256 * 3 * 2
    assert st["mla"]["bytes_per_token"] == 3 * 40 * 2
    assert st["per_rank"][0]["kda_bytes_per_request"] == 6 * (16 * 16 * 16 * 4 + 3 * 256 * 3 * 2) // 16
    ops = {o["op"] for o in g["custom_ops"]}
    assert {"kda_chunked_prefill", "gated_mla_decode_latent_cache", "mxfp4_weight_gemm_grouped"} <= ops


def test_full_k3_state_sizes_match_the_spec(release_config):
    from k3bundle.bundle.graph import graph_manifest
    from k3bundle.layouts import load_layout
    from k3bundle.plan import make_plan

    g = graph_manifest(make_plan(release_config, load_layout("b300-tp8")))
    assert g["state_schema"]["mla"]["bytes_per_token"] == 27_648  # spec §5.3
    assert g["state_schema"]["kda"]["per_layer_per_request"]["recurrent"]["bytes"] == 6_291_456
    assert g["state_schema"]["kda"]["per_layer_per_request"]["conv"]["bytes"] == 221_184
    assert round(g["state_schema"]["kda"]["bytes_per_request"] / 1e6, 1) == 449.4
    assert round(g["state_schema"]["per_rank"][0]["kda_bytes_per_request"] / 1e6) == 56  # ÷ TP8


def test_workers_1_and_2_give_identical_bytes(bundles, tiny_ckpt, tmp_path):
    out = tmp_path / "w2"
    r = subprocess.run([sys.executable, "-m", "k3bundle", "convert", str(tiny_ckpt), "--target", "b300-tp8",
                        "--out", str(out), "--workers", "2", "--json"], capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert file_hashes(out) == file_hashes(bundles["b300-tp8"])


@pytest.mark.parametrize("name", ["h200-tp16-ep16", "b200-tp8-pp2", "gb300-dep16"])
def test_routed_expert_mxfp4_bytes_pass_through_bit_exact(bundles, tiny_ckpt, name):
    b, n = bundles[name], 0
    for e in _index(b):
        if e["role"].startswith("moe.expert") and e["storage"] == "mxfp4":
            dev = _device_bytes(b, e)
            for x, off, size in _experts(e):
                entry, src = _source(tiny_ckpt, e, x)
                chunk = dev[off: off + size]
                if "swizzle" in e["transform"]:
                    rows, cols = entry["shape"]
                    chunk = unswizzle(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), rows, cols).numpy().tobytes()
                assert chunk == src, (e["key"], x)  # EP moves whole experts: the source bytes exactly
                n += 1
    assert n == 8 * 16 * 3 * 2  # 8 MoE layers x 16 experts x 3 projections x (packed, scale)


def _nvfp4_parts(b: Path, entries: dict, e: dict, x, off: int):
    shape = e["shape"][1:]
    packed = np.frombuffer(_device_bytes(b, e)[off: off + e["source"]["expert_stride"]], np.uint8).reshape(shape)
    se = entries[e["scale"]["device_key"], e["rank"]]
    ge = entries[e["scale"]["device_global_key"], e["rank"]]
    stride = se["source"]["expert_stride"]
    i = x - e["source"]["experts"][0]
    flat = np.frombuffer(_device_bytes(b, se)[i * stride: (i + 1) * stride], np.uint8)
    rows, cols2 = shape
    scale = unswizzle(torch.from_numpy(flat.copy()), rows, cols2 * 2 // 16)
    g = np.frombuffer(_device_bytes(b, ge)[i * 4: i * 4 + 4], np.float32)[0]
    # compressed-tensors' weight_global_scale is the quantization scale: the multiplier is its reciprocal
    return torch.from_numpy(packed.copy()), scale, 1.0 / float(g)


def test_nvfp4_transcode_is_bit_exact_where_it_fits(bundles, tiny_ckpt):
    b = bundles["b300-tp8"]
    idx = _index(b)
    entries = {(e["key"], e["rank"]): e for e in idx}
    n = 0
    for e in idx:
        if e["storage"] != "nvfp4" or e["part"] != "packed":
            continue
        src = e["source"]
        r0, r1 = src["rows"]
        c0, c1 = src["cols"]
        for x, off, _ in _experts(e):
            packed, scale, g = _nvfp4_parts(b, entries, e, x, off)
            got = nvfp4.dequantize(packed, scale, g)
            ent_p, p_bytes = _source(tiny_ckpt, e, x)
            ent_s, s_bytes = _source(tiny_ckpt, e, x, "scale")
            want = mxfp4.dequantize(torch.frombuffer(bytearray(p_bytes), dtype=torch.uint8).reshape(ent_p["shape"]),
                                    torch.frombuffer(bytearray(s_bytes), dtype=torch.uint8).reshape(ent_s["shape"]))
            want = want[r0:r1, c0:c1]
            assert torch.equal(got[: r1 - r0, : c1 - c0], want), (e["key"], x)
            assert not got[r1 - r0:].any() and not got[:, c1 - c0:].any()  # padding dequantizes to zero
            n += 1
    assert n == 8 * 8 * 16 * 3  # 8 ranks x 8 layers x 16 experts x 3 projections
    assert read_manifest(b)["nvfp4_requantized"] == []


def test_nvfp4_out_of_range_blocks_are_listed(tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    shard = src / "model-00002-of-000012.safetensors"
    key = "language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_scale"
    import struct
    data = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    begin = json.loads(data[8: 8 + n])[key]["data_offsets"][0]
    data[8 + n + begin + 5 * 4 + 2] = 1  # row 5, block 2 (4 blocks per row): 2^-126, far below the rest
    shard.write_bytes(bytes(data))
    r = convert(src, "b300-tp8", tmp_path / "out")
    assert r.nvfp4_requantized_blocks == 1
    listed = read_manifest(tmp_path / "out")["nvfp4_requantized"]
    assert listed == [{"source_key": key.replace("weight_scale", "weight_packed"), "blocks": [[5, 2]]}]
    assert verify(tmp_path / "out", src).ok


def test_fp8_and_mxfp4_from_bf16_are_the_codecs_on_each_slice(bundles, tiny_ckpt):
    checked = set()
    for name in ("mi355x-tp8", "new-accelerator.example"):
        b = bundles[name]
        idx = _index(b)
        entries = {(e["key"], e["rank"]): e for e in idx}
        for e in idx:
            if e["storage"] not in ("fp8-e4m3-channel", "fp8-e4m3-block128", "mxfp4-from-bf16") or \
                    e["part"] not in ("weight", "packed"):
                continue
            src = e["source"]
            ent, raw = _source(tiny_ckpt, e)
            w = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(ent["shape"])
            w = w[src["rows"][0]: src["rows"][1], src["cols"][0]: src["cols"][1]]
            se = entries[e["scale"]["device_key"], e["rank"]]
            dev = _device_bytes(b, e)
            sdev = _device_bytes(b, se)
            if e["storage"] == "mxfp4-from-bf16":
                packed, scales = mxfp4.quantize(w, scale_rule="even")
                assert dev == packed.numpy().tobytes() and sdev == scales.numpy().tobytes(), e["key"]
            else:
                q, s = (fp8.quantize_channel if "channel" in e["storage"] else fp8.quantize_block)(w)
                assert dev == q.view(torch.uint8).numpy().tobytes(), e["key"]
                assert sdev == s.numpy().tobytes(), e["key"]
                deq = (fp8.dequantize_channel if "channel" in e["storage"] else fp8.dequantize_block)(q, s)
                rel = (deq - w.float()).norm() / w.float().norm()
                assert rel < 0.05
            checked.add(e["storage"])
    assert checked == {"fp8-e4m3-channel", "fp8-e4m3-block128", "mxfp4-from-bf16"}


def _with_source_json(tiny_ckpt: Path, dest: Path) -> Path:
    shutil.copytree(tiny_ckpt, dest)
    files = [{"path": p.name, "size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
              "lfs": p.suffix == ".safetensors", "git_blob_sha1": None,
              "url": f"https://huggingface.co/moonshotai/Kimi-K3-synth/resolve/abc123/{p.name}"}
             for p in sorted(dest.iterdir())]
    doc = {"schema_version": 1, "k3bundle_version": "0.1.0", "kind": "hub", "repo_id": "moonshotai/Kimi-K3-synth",
           "revision": "main", "commit": "abc123" * 6 + "abcd", "license": "other", "files": files}
    (dest / "source.json").write_text(json.dumps(doc))
    return dest


def test_source_json_is_checked_and_recorded(tiny_ckpt, tmp_path, bundles):
    src = _with_source_json(tiny_ckpt, tmp_path / "pulled")
    out = tmp_path / "out"
    convert(src, "b300-tp8", out)
    m = read_manifest(out)
    assert m["source"]["checked_against_source_json"]
    assert m["source"]["provenance"]["repo_id"] == "moonshotai/Kimi-K3-synth"
    assert m["source"]["provenance"]["commit"] == "abc123" * 6 + "abcd"
    listed = {f["path"]: f for f in m["source"]["files"]}
    assert listed["model-00003-of-000012.safetensors"]["url"].endswith("/abc123/model-00003-of-000012.safetensors")
    assert all(f["read_by_convert"] for p, f in listed.items() if p.endswith(".safetensors"))
    # the device files are the same bytes as without source.json; only the manifest differs
    a, b = file_hashes(out), file_hashes(bundles["b300-tp8"])
    assert {k: v for k, v in a.items() if k != "manifest.json"} == {k: v for k, v in b.items() if k != "manifest.json"}


def test_flipped_byte_in_a_shard_is_refused_naming_the_file(tiny_ckpt, tmp_path):
    src = _with_source_json(tiny_ckpt, tmp_path / "pulled")
    shard = src / "model-00005-of-000012.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit: only the hash can tell
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(ConvertError) as e:
        convert(src, "h200-tp16-ep16", out, workers=1)
    msg = str(e.value)
    assert "model-00005-of-000012.safetensors" in msg and "does not match source.json" in msg
    assert not (out / "manifest.json").exists()
    assert not list(out.rglob("*.k3tmp"))


def test_an_unfinished_pull_is_refused(tiny_ckpt, tmp_path):
    src = _with_source_json(tiny_ckpt, tmp_path / "pulled")
    doc = json.loads((src / "source.json").read_text())
    (src / "source.json").write_text(json.dumps({**doc, "complete": False}))
    with pytest.raises(ConvertError, match="did not finish"):
        convert(src, "b300-tp8", tmp_path / "out")


def test_sigkill_then_rerun_gives_the_identical_bundle(bundles, tiny_ckpt, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "k3bundle", "convert", str(tiny_ckpt), "--target", "b300-tp8", "--out", str(out),
           "--json"]
    p = subprocess.Popen(cmd, env={**ENV, "K3BUNDLE_CONVERT_THROTTLE_S": "0.4"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    journal = out / JOURNAL
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait for 3 finished units (first line is the plan id)
        if journal.exists() and len(journal.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (out / "manifest.json").exists()
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["units_reused"] >= 3
    assert file_hashes(out) == file_hashes(bundles["b300-tp8"])


def test_resume_rehashes_finished_files_and_redoes_a_tampered_one(bundles, tiny_ckpt, tmp_path, monkeypatch):
    import k3bundle.convert.run as run_mod

    out = tmp_path / "partial"
    calls = []

    def dies_after_four(*args, **kw):
        if len(calls) == 4:
            raise KeyboardInterrupt  # stand-in for a kill between units
        calls.append(1)
        return real(*args, **kw)

    real = run_mod.run_unit
    monkeypatch.setattr(run_mod, "run_unit", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_ckpt, "h200-tp16-ep16", out)
    monkeypatch.setattr(run_mod, "run_unit", real)
    entries = [json.loads(x) for x in (out / JOURNAL).read_text().splitlines()[1:]]
    assert len(entries) == 4
    victim = out / entries[0]["outputs"][0][0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # a finished file damaged after the journal recorded it
    victim.write_bytes(bytes(data))
    r = convert(tiny_ckpt, "h200-tp16-ep16", out)
    assert r.units_reused == 3  # the damaged unit was re-hashed, caught and converted again
    assert file_hashes(out) == file_hashes(bundles["h200-tp16-ep16"])


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_full_disk_gives_a_clean_error_and_no_manifest(tiny_ckpt, tmp_path, monkeypatch):
    disk = tmp_path / "disk"
    if _mount_tmpfs(disk, "6m"):
        try:
            with pytest.raises(ConvertError) as e:  # the free-space check, before any unit runs
                convert(tiny_ckpt, "b300-tp8", disk / "out")
            assert "free" in str(e.value)
            assert not (disk / "out" / "manifest.json").exists()
            monkeypatch.setenv("K3BUNDLE_SKIP_SPACE_CHECK", "1")  # now let the disk really fill up
            with pytest.raises(ConvertError) as e:
                convert(tiny_ckpt, "b300-tp8", disk / "out2")
            assert "No space left on device" in str(e.value) and "device_weights/rank-" in str(e.value)
            assert not (disk / "out2" / "manifest.json").exists()
            assert not list((disk / "out2").rglob("*.k3tmp"))
        finally:
            subprocess.run(["umount", str(disk)], check=True)
        return
    # no tmpfs: a per-process file size limit makes the same write fail (EFBIG)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000)); "
            "from k3bundle.cli.app import main; sys.argv = ['k3bundle'] + sys.argv[1:]; main()")
    r = subprocess.run([sys.executable, "-c", code, "convert", str(tiny_ckpt), "--target", "b300-tp8", "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and "File too large" in r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_output_directory_rules(bundles, tiny_ckpt, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConvertError, match="not empty and not a k3bundle bundle"):
        convert(tiny_ckpt, "b300-tp8", foreign)
    done = tmp_path / "done"
    shutil.copytree(bundles["mi355x-tp8"], done)
    with pytest.raises(ConvertError, match="already a complete bundle"):
        convert(tiny_ckpt, "mi355x-tp8", done)
    r = convert(tiny_ckpt, "mi355x-tp8", done, force=True)
    assert r.units_reused == 0 and file_hashes(done) == file_hashes(bundles["mi355x-tp8"])
    other = tmp_path / "other"
    other.mkdir()
    (other / JOURNAL).write_text(json.dumps({"schema_version": 1, "plan_id": "another plan"}) + "\n")
    with pytest.raises(ConvertError, match="different plan"):
        convert(tiny_ckpt, "mi355x-tp8", other)


def test_file_size_cap_splits_rank_files(tiny_ckpt, tmp_path):
    d = yaml.safe_load((REPO / "layouts" / "h200-tp16-ep16.yaml").read_text())
    d["name"] = "h200-small-files"
    d["files"]["max_bytes"] = 100_000
    (tmp_path / "h200-small-files.yaml").write_text(yaml.safe_dump(d))
    out = tmp_path / "out"
    convert(tiny_ckpt, str(tmp_path / "h200-small-files.yaml"), out)
    files = list((out / "device_weights").rglob("*.safetensors"))
    assert any(p.name.endswith("-part02.safetensors") for p in files)
    idx = _index(out)
    for e in idx:  # a part holds at most the cap, unless one tensor alone is larger
        size = (out / e["file"]).stat().st_size
        assert size <= 100_000 + 8192 or len([x for x in idx if x["file"] == e["file"]]) == 1
    assert verify(out, tiny_ckpt).ok


def test_a_target_that_does_not_fit_is_refused_before_writing(tiny_ckpt, tmp_path):
    d = yaml.safe_load((REPO / "layouts" / "b300-tp8.yaml").read_text())
    d["card"]["hbm_bytes"] = 3_000_000
    d["memory"]["runtime_reserve_bytes"] = 0
    (tmp_path / "tiny-card.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ConvertError, match="needs .* bytes of weights"):
        convert(tiny_ckpt, str(tmp_path / "tiny-card.yaml"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_peak_memory_does_not_hold_the_model(tiny_ckpt, tmp_path):
    code = ("import sys; from k3bundle.convert import convert; "
            "convert(sys.argv[1], 'gb300-dep16', sys.argv[2]); print(%s)" % VMHWM)
    r = subprocess.run([sys.executable, "-c", code, str(tiny_ckpt), str(tmp_path / "o")], capture_output=True,
                       text=True, env=child_env(PYTHONPATH=str(REPO)), timeout=300)  # glibc thresholds fixed
    assert r.returncode == 0, r.stderr
    # gb300-dep16 writes ~360 MB (16 full replicas); the process stays at interpreter + torch size
    print(f"convert peak {int(r.stdout.split()[-1]):,} B")
    assert int(r.stdout.split()[-1]) < 600 << 20


def test_cli_convert_json(tiny_ckpt, tmp_path):
    from tests.conftest import run_cli

    r = run_cli("convert", str(tiny_ckpt), "--target", "h200-tp16-ep16", "--out", str(tmp_path / "b"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["world"] == 16 and doc["units"] == 12 and len(doc["manifest_sha256"]) == 64
    r = run_cli("convert", str(tiny_ckpt), "--target", "h200-tp16-ep16", "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "already a complete bundle" in r.stderr




def test_source_hash_one_block_behind_equals_hashlib_of_the_whole_stream():
    """convert hashes the source on a thread, one block behind the reader (big blocks) or in place
    (small ones): the digest must be sha256 of the bytes in order, as hashlib computes it at once."""
    import hashlib

    import numpy as np

    from k3bundle.convert.unit import _HashBehind

    rng = np.random.default_rng(0)
    sizes = [3, 5 << 20, 17, 2 << 20, (1 << 20) - 1, 1 << 20, 0, 9 << 20, 100]
    blocks = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    h = _HashBehind()
    for b in blocks:
        h.update(b)
    try:
        assert h.hexdigest() == hashlib.sha256(b"".join(b.tobytes() for b in blocks)).hexdigest()
    finally:
        h.close()
