"""Goldens and validate as a hostile user would feed them: edited, NaN, bombed, empty, stale."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch

from k3bundle.golden.errors import GoldenFileError, ToleranceError
from k3bundle.golden.store import META_KEY, check_goldens, content_hash, meta_array, read_meta, read_npz, write_npz
from k3bundle.golden.tolerances import load_tolerances, tolerance_path
from k3bundle.validate.dumps import read_dump
from k3bundle.validate.errors import DumpError
from tests.conftest import REPO, run_cli
from tests.faults import disk_full


def _goldens(tap: np.ndarray) -> dict:
    arrays = {"c/layers.0.mixer_out": tap, "c/greedy_tokens": np.arange(3, dtype=np.int64)}
    return {**arrays, META_KEY: meta_array({"content_hash": content_hash(arrays)})}


def test_an_edited_golden_is_refused_by_its_content_hash(tmp_path):
    g = _goldens(np.ones((2, 4), np.float32))
    check_goldens("g.npz", g)
    g["c/layers.0.mixer_out"] = g["c/layers.0.mixer_out"] * np.float32(1.0001)  # rewritten, hash kept
    write_npz(tmp_path / "g.npz", g, compress=True)
    with pytest.raises(GoldenFileError, match="does not match the recorded"):
        check_goldens(tmp_path / "g.npz", read_npz(tmp_path / "g.npz"))


def test_a_nan_golden_is_bad_input(tmp_path):
    g = _goldens(np.array([[1.0, np.nan]], np.float32))  # the hash is right: only the NaN is wrong
    with pytest.raises(GoldenFileError, match="NaN/Inf"):
        check_goldens("g.npz", g)


def test_a_zstd_frame_declaring_512_gib_is_refused_without_allocating(tmp_path):
    payload = b"PK\x05\x06" + b"\0" * 18  # an empty zip
    frame = (b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", 512 << 30)  # single segment, 8-byte size
             + struct.pack("<I", (len(payload) << 3) | 1)[:3] + payload)  # one raw, last block
    p = tmp_path / "golden_intermediates.npz"
    p.write_bytes(frame)
    with pytest.raises(GoldenFileError, match="zstd"):  # one line, no MemoryError
        read_npz(p)
    with pytest.raises(GoldenFileError, match="more than the 1,000"):
        read_npz(p, max_bytes=1000)


def test_an_empty_goldens_file_is_an_error_not_an_abort(tiny_ckpt, tmp_path):
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(GoldenFileError, match="empty file"):
        read_npz(tmp_path / "empty.npz")
    v = tmp_path / "b" / "validation"
    v.mkdir(parents=True)
    for n in ("golden_inputs.npz", "golden_intermediates.npz"):
        (v / n).write_bytes(b"")
    shutil.copyfile(tolerance_path("bf16"), v / "tolerances.yaml")
    shutil.copyfile(tiny_ckpt / "config.json", tmp_path / "b" / "config.json")
    (tmp_path / "dumps").mkdir()
    r = run_cli("validate", str(tmp_path / "b"), "--dumps", str(tmp_path / "dumps"))
    assert r.returncode == 2 and "empty file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_failed_validate_removes_an_earlier_pass_report(tmp_path):
    reports = tmp_path / "b" / "reports" / "validate" / "dumps-dumps.txt"  # the run key of --dumps .../dumps.txt
    reports.mkdir(parents=True)
    (reports / "signoff.json").write_text(json.dumps({"passed": True}))
    (reports / "signoff.md").write_text("PASS")
    (reports / "notes.txt").write_text("mine")
    (tmp_path / "dumps.txt").write_text("a file, not a folder")
    r = run_cli("validate", str(tmp_path / "b"), "--dumps", str(tmp_path / "dumps.txt"))
    assert r.returncode == 2 and "must be a folder" in r.stderr and "missing dump" not in r.stderr
    assert sorted(p.name for p in reports.iterdir()) == ["notes.txt"]


def test_a_nan_tolerance_is_refused(tmp_path):
    text = tolerance_path("bf16").read_text().replace("drift_nmse:", "drift_nmse: .nan #", 1)
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ToleranceError, match="must be a finite number"):
        load_tolerances(tmp_path / "t.yaml")


def _dump_case():
    golden = {"logits": np.zeros((2, 8), np.float32), "final_hidden": np.zeros((2, 4), np.float32),
              "layers.0.mixer_out": np.zeros((2, 4), np.float32), "layers.0.ffn_out": np.zeros((2, 4), np.float32),
              "layers.0.router_ids": np.zeros((2, 2), np.int64), "greedy_tokens": np.zeros(3, np.int64)}
    dump = {k: torch.from_numpy(v.copy()) for k, v in golden.items()}
    return golden, dump


@pytest.mark.parametrize("name,value,message", [
    ("greedy_tokens", torch.tensor([0.0, 1.0, 2.0]), "ids must be integers"),
    ("greedy_tokens", torch.tensor([0, -1, 2]), "negative id"),
    ("greedy_tokens", torch.tensor([0, 1, 8]), "outside 0..7"),
    ("layers.0.router_ids", torch.zeros(2, 2), "ids must be integers"),
    ("layers.0.router_ids", torch.tensor([[0, 1], [2, 16]]), "outside 0..15"),
    ("logits", torch.zeros(2, 8, dtype=torch.int32), "this tap holds floats"),
])
def test_dump_ids_dtypes_and_ranges_are_checked_before_judging(tmp_path, name, value, message):
    from safetensors.torch import save_file

    golden, dump = _dump_case()
    save_file(dump, str(tmp_path / "c.safetensors"))
    assert set(read_dump(tmp_path, "c", golden, vocab=8, experts=16)) == set(dump)  # the clean dump passes
    dump[name] = value
    save_file(dump, str(tmp_path / "c.safetensors"))
    with pytest.raises(DumpError, match=message):
        read_dump(tmp_path, "c", golden, vocab=8, experts=16)


def test_goldens_never_written_through_a_link_and_a_full_disk_is_one_line(tiny_ckpt, tmp_path):
    from k3bundle.golden.generate import generate_goldens

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(GoldenFileError, match="symbolic link"):
        generate_goldens(tiny_ckpt, out=tmp_path / "link")
    assert list(elsewhere.iterdir()) == []
    cases = tmp_path / "cases"
    cases.mkdir()
    shutil.copy(REPO / "golden" / "cases" / "greedy.yaml", cases)
    out = tmp_path / "v"
    with disk_full(out, nth=2) as writes, pytest.raises(GoldenFileError, match="No space left"):
        generate_goldens(tiny_ckpt, out=out, cases_dir=cases)  # the intermediates written, the inputs not
    assert writes.count == 2
    assert sorted(p.name for p in out.iterdir()) == ["golden_intermediates.npz"]  # no temp file left
