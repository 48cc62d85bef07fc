"""Verification levels (``verify(level=...)``, ``checklist --verify``, ``validate --verify``):
what each level re-hashes, what it only sizes, and that the report says so."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from k3bundle.provenance.verify import sample_size, verify
from tests._bundles import bundles, single_threaded_torch  # noqa: F401 (fixtures)
from tests.conftest import run_cli

LAYOUT = "h200-tp16-ep16"  # 16 ranks: enough weight files for a sample to leave some out


def _copy(bundles, tmp_path: Path) -> Path:
    out = tmp_path / "b"
    shutil.copytree(bundles[LAYOUT], out)
    return out


def _weights(bundle: Path) -> list[str]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    return sorted(f["path"] for f in manifest["files"] if f["path"].endswith(".safetensors"))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a data byte (the header is at the front): the size stays the same
    path.write_bytes(bytes(data))


def test_levels_hash_what_they_say(bundles, tmp_path):
    b = _copy(bundles, tmp_path)
    weights = _weights(b)
    n_files = len(json.loads((b / "manifest.json").read_text())["files"])
    full, sample, sizes = (verify(b, level=lv, seed=3) for lv in ("full", "sample", "manifest"))
    assert full.ok and sample.ok and sizes.ok
    assert full.hashed_files == full.files == n_files
    assert sizes.hashed_files == 0 and sizes.files == n_files
    metadata = n_files - len(weights)
    assert sample.hashed_files == metadata + sample_size(len(weights)) < n_files
    assert "level sample" in sample.coverage and "seed 3" in sample.coverage
    assert "nothing re-hashed" in sizes.coverage


def test_sample_finds_a_changed_byte_in_a_sampled_file_and_in_every_file_read(bundles, tmp_path):
    b = _copy(bundles, tmp_path)
    weights = _weights(b)
    picked = random.Random(5).sample(weights, sample_size(len(weights)))  # the rule, recomputed here
    left_out = sorted(set(weights) - set(picked))
    assert left_out
    _flip_last_byte(b / picked[0])
    r = verify(b, level="sample", seed=5)
    assert not r.ok and picked[0] in r.problems[0] and "sha256" in r.problems[0]
    shutil.copy(bundles[LAYOUT] / picked[0], b / picked[0])
    _flip_last_byte(b / left_out[0])
    assert verify(b, level="sample", seed=5).ok  # not sampled, same size: by design not seen ...
    r = verify(b, level="sample", seed=5, reads=[left_out[0]])  # ... unless a check reads it
    assert not r.ok and left_out[0] in r.problems[0]
    assert not verify(b, level="full").ok


def test_every_level_sees_a_missing_or_resized_file(bundles, tmp_path):
    b = _copy(bundles, tmp_path)
    victim = b / _weights(b)[-1]
    with open(victim, "ab") as f:
        f.write(b"\0")
    for level in ("full", "sample", "manifest"):
        r = verify(b, level=level)
        assert not r.ok and "bytes, manifest says" in r.problems[0], level
    victim.unlink()
    assert all("missing" in verify(b, level=lv).problems[0] for lv in ("full", "sample", "manifest"))


def test_unknown_level_and_source_below_full_are_refused(bundles, tiny_ckpt):
    with pytest.raises(ValueError, match="choose one of full, sample, manifest"):
        verify(bundles[LAYOUT], level="some")
    with pytest.raises(ValueError, match="level full only"):
        verify(bundles[LAYOUT], source=tiny_ckpt, level="sample")


def test_checklist_says_which_level_ran(bundles, tmp_path):
    b = _copy(bundles, tmp_path)
    r = run_cli("checklist", "--target", LAYOUT, "--bundle", str(b), "--json")
    stage = next(s for s in json.loads(r.stdout)["stages"] if s["key"] == "conversion")
    assert stage["done"] and "level sample" in stage["evidence"]
    r = run_cli("checklist", "--target", LAYOUT, "--bundle", str(b), "--verify", "full", "--json")
    stage = next(s for s in json.loads(r.stdout)["stages"] if s["key"] == "conversion")
    assert stage["done"] and "level full: all" in stage["evidence"]
    r = run_cli("checklist", "--target", LAYOUT, "--bundle", str(b), "--verify", "most")
    assert r.returncode == 2 and "--verify most: choose one of full, sample, manifest" in r.stderr


def test_verify_source_with_workers_reports_what_one_process_does(bundles, tiny_ckpt, tmp_path):
    """--workers re-derives source files in parallel: the same checks, the same problems, in the
    same order; a changed device byte is located by both."""
    b = _copy(bundles, tmp_path)
    one, two = verify(b, tiny_ckpt), verify(b, tiny_ckpt, workers=2)
    assert one.ok and two.ok
    counts = lambda r: (r.files, r.source_files, r.rederived_files, r.reassembled_tensors,  # noqa: E731
                        r.value_checked_tensors)
    assert counts(one) == counts(two)
    victim = b / _weights(b)[3]
    _flip_last_byte(victim)
    one, two = verify(b, tiny_ckpt), verify(b, tiny_ckpt, workers=2)
    assert not one.ok and one.problems == two.problems and any(_weights(b)[3] in p for p in one.problems)
    assert not list(tmp_path.glob(".b.verify-*"))  # the scratch directory is gone
