"""``k3bundle pull DIR``: the same record for a local checkpoint; names, symlinks, source.json I/O."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from k3bundle.pull import FileEntry, PullError, SourceRecord, pull, read_source, write_source
from k3bundle.pull import download as dl
from k3bundle.pull.paths import check_name, selected
from tests.conftest import run_cli
from tests.pull_fixtures import BIG, clean_pull, hub, hub_tree, sha256_of  # noqa: F401
from tests.test_pull_hub import CountingHashlib


def _triples(rec: SourceRecord):
    return [(f.path, f.size, f.sha256) for f in rec.files]


def test_local_copy_has_the_hub_pulls_hashes(hub_tree, clean_pull, tmp_path, monkeypatch):
    counting = CountingHashlib()
    monkeypatch.setattr(dl, "hashlib", counting)
    out = tmp_path / "copy"
    r = run_cli("pull", str(hub_tree), "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    local, hubrec = read_source(out), read_source(clean_pull)
    assert _triples(local) == _triples(hubrec)
    assert (local.kind, local.repo_id, local.revision, local.commit) == ("local", None, "", None)
    assert local.license == "modified-mit"
    assert all(f.url is None and f.lfs is False and f.git_blob_sha1 is None for f in local.files)
    for f in local.files:
        assert (out / f.path).read_bytes() == (hub_tree / f.path).read_bytes()
    # one read of each source byte, hashed in the copy loop; the copies are never read
    assert s["bytes_read"] == s["bytes_hashed"] == s["bytes"] and s["actions"] == {"copied": 27}
    # in-process too, with an independent counter on sha256
    s2 = pull(str(hub_tree), tmp_path / "copy2").summary()
    assert counting.sha256_bytes == s2["bytes"]
    assert (tmp_path / "copy2" / "source.json").read_bytes() == (out / "source.json").read_bytes()
    # a rerun keeps the copies without reading source or copy
    s3 = pull(str(hub_tree), tmp_path / "copy2").summary()
    assert s3["actions"] == {"kept": 27} and s3["bytes_hashed"] == 0


def test_local_in_place_and_rerun_is_identical(hub_tree, clean_pull, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(hub_tree, d)
    r1 = pull(str(d))
    assert r1.in_place and r1.summary()["actions"] == {"hashed": 27}
    first = (d / "source.json").read_bytes()
    r2 = pull(str(d), d)  # --out equal to the source is in place too; its own source.json is skipped
    assert r2.summary()["actions"] == {"hashed": 27}
    assert (d / "source.json").read_bytes() == first
    assert _triples(read_source(d)) == _triples(read_source(clean_pull))
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".k3")) == []  # no state in place


def test_local_in_place_over_a_hub_record_is_refused(clean_pull, tmp_path):
    d = tmp_path / "pulled"
    shutil.copytree(clean_pull, d)
    with pytest.raises(PullError, match=r"records a Hub pull of .*; an in-place local pull would replace it"):
        pull(str(d))
    # copying it elsewhere is fine, and skips its .part/.bad/state leftovers
    (d / f"{BIG}.part").write_bytes(b"x")
    rec = pull(str(d), tmp_path / "copy").record
    assert _triples(rec) == _triples(read_source(clean_pull))


def test_symlinks_inside_followed_outside_refused(hub_tree, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_bytes((hub_tree / "config.json").read_bytes())
    (d / "alias.json").symlink_to("config.json")
    rec = pull(str(d), tmp_path / "o1").record
    assert rec.by_path()["alias.json"].sha256 == rec.by_path()["config.json"].sha256
    assert not (tmp_path / "o1" / "alias.json").is_symlink()

    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (d / "leak.txt").symlink_to(secret)
    with pytest.raises(PullError, match=r"^leak.txt: symlink to .*secret.txt points outside"):
        pull(str(d), tmp_path / "o2")
    assert not (tmp_path / "o2" / "leak.txt").exists()
    rec = pull(str(d), tmp_path / "o3", exclude=["leak.txt"]).record  # excluded: never followed
    assert "leak.txt" not in rec.by_path() and rec.complete is False


def test_hf_cache_snapshot_symlinks_into_blobs_are_allowed(hub_tree, tmp_path):
    repo = tmp_path / "hub" / "models--moonshotai--Kimi-K3"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    data = (hub_tree / "config.json").read_bytes()
    blob = repo / "blobs" / sha256_of(hub_tree / "config.json")
    blob.write_bytes(data)
    (snap / "config.json").symlink_to(os.path.relpath(blob, snap))
    rec = pull(str(snap), tmp_path / "out").record
    assert [(f.path, f.sha256) for f in rec.files] == [("config.json", blob.name)]


def test_out_inside_the_source_is_refused(hub_tree, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(hub_tree, d)
    with pytest.raises(PullError, match=r"is inside the source"):
        pull(str(d), d / "sub")


def test_local_existing_different_file_is_not_overwritten(hub_tree, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(PullError, match=r"^config.json: already in .* with 2 bytes, the source has 4,008"):
        pull(str(hub_tree), out)
    assert (out / "config.json").read_text() == "{}"


def test_revision_with_a_directory_is_an_error(hub_tree):
    with pytest.raises(PullError, match=r"--revision applies to Hub pulls; a local directory has no revisions"):
        pull(str(hub_tree), revision="main")


# ------------------------------------------------------------------ names, globs, source.json


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "C:/x", "a\\b", "a//b", "./a", "a/.", "",
                                  "a\x00b"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(PullError, match="refusing this file name"):
        check_name(name)


@pytest.mark.parametrize("name", ["config.json", "a/b/c.safetensors", ".gitattributes", "a..b", "..a", "a b"])
def test_safe_names_pass(name):
    assert check_name(name) == name


def test_globs():
    assert selected("config.json", ["config.json", "*token*"], [])
    assert selected("tokenizer_config.json", ["config.json", "*token*"], [])
    assert not selected("model-00001-of-000012.safetensors", ["config.json", "*token*"], [])
    assert selected("extra/notes.txt", ["extra/"], []) and not selected("extra/notes.txt", [], ["extra/"])
    assert selected("a/b.py", ["*.py"], []) and not selected("a/b.py", [], ["*.py"])


def test_source_json_round_trip_and_checks(tmp_path):
    rec = SourceRecord(kind="hub", repo_id="o/n", revision="main", commit="c" * 40, license=None,
                       files=(FileEntry("b.bin", 1, "1" * 64, True, None, "u"), FileEntry("a.txt", 2, "2" * 64)))
    p = write_source(tmp_path, rec)
    text = p.read_text()
    assert text.endswith("}\n") and json.loads(text)["files"][0]["path"] == "a.txt"
    back = read_source(tmp_path)
    assert [f.path for f in back.files] == ["a.txt", "b.bin"] and back.commit == "c" * 40
    assert write_source(tmp_path, back).read_text() == text
    d = json.loads(text)
    d["commit"] = "main"
    p.write_text(json.dumps(d))
    with pytest.raises(PullError, match=r"commit 'main' is not a 40-hex sha"):
        read_source(p)
    d["commit"], d["schema_version"] = "c" * 40, 2
    p.write_text(json.dumps(d))
    with pytest.raises(PullError, match=r"schema_version 2, this k3bundle reads 1"):
        read_source(p)
