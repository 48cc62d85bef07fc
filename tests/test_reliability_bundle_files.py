"""A bundle's own files as a hostile colleague would edit them: an index or manifest that names
files outside the bundle is refused by every command that reads it."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.index import read_index
from k3bundle.bundle.manifest import read_manifest
from k3bundle.io.files import relpath_problem
from k3bundle.pull.errors import PullError
from k3bundle.pull.paths import check_name
from tests.conftest import REPO, run_cli

TINY_TP2 = REPO / "tests" / "layouts" / "tiny-tp2.yaml"


@pytest.mark.parametrize("name, why", [
    ("../other/model.safetensors", "'..' component escapes"),
    ("device_weights/../../x", "'..' component escapes"),
    ("/etc/passwd", "absolute path"),
    ("C:x.safetensors", "absolute path"),
    ("a//b", "empty or '.' path component"),
    ("./a", "empty or '.' path component"),
    ("a\\b", "backslash"),
    ("a\x00b", "NUL byte"),
    ("", "empty file name"),
    (7, "not a string"),
])
def test_one_rule_for_file_names_read_from_files(name, why):
    assert why in relpath_problem(name)
    with pytest.raises(PullError, match="refusing this file name"):  # pull's listing: the same rule
        check_name(name)
    assert relpath_problem("device_weights/rank-000/model-00001-of-00002.safetensors") == ""


@pytest.fixture(scope="module")
def bundle(tiny_ckpt, tmp_path_factory):
    """A TP2 bundle of the tiny model with goldens of one short case."""
    from k3bundle.convert import convert
    from k3bundle.golden.generate import generate_goldens

    root = tmp_path_factory.mktemp("escape")
    cases = root / "cases"
    cases.mkdir()
    shutil.copy(REPO / "golden" / "cases" / "greedy.yaml", cases)
    out = root / "b"
    convert(tiny_ckpt, str(TINY_TP2), out, workers=1)
    generate_goldens(out, cases_dir=cases, noise=False)
    return {"bundle": out, "cases": cases}


def _rehash(bundle, rel: str) -> None:
    """Record ``rel``'s new hash and size in the manifest, as a careful forger would."""
    m = json.loads((bundle / "manifest.json").read_text())
    data = (bundle / rel).read_bytes()
    for f in m["files"]:
        if f["path"] == rel:
            f["sha256"], f["size"] = hashlib.sha256(data).hexdigest(), len(data)
    (bundle / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))


def test_an_index_pointing_outside_the_bundle_is_refused_by_verify_golden_and_validate(bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundle["bundle"], b)
    shutil.copytree(b / "device_weights", tmp_path / "other" / "device_weights")  # the weights read instead
    text = (b / "weights.index.json").read_text()
    forged = text.replace('"file":"device_weights/', '"file":"../other/device_weights/')
    assert forged != text
    (b / "weights.index.json").write_text(forged)
    _rehash(b, "weights.index.json")
    with pytest.raises(BundleError, match=r"tensors\[0\]\.file names '\.\./other/device_weights/.*'\.\.' component"):
        read_index(b / "weights.index.json")
    for argv in (["verify", str(b)],
                 ["golden", str(b), "--out", str(tmp_path / "g"), "--cases", str(bundle["cases"]), "--no-noise"],
                 ["validate", str(b)]):
        r = run_cli(*argv)
        assert r.returncode == 2, (argv, r.returncode, r.stderr)
        assert "'..' component escapes" in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert r.stderr.strip().count("\n") == 0, (argv, r.stderr)
    assert not (tmp_path / "g").exists() and not (b / "reports" / "signoff.json").exists()


def test_a_manifest_listing_a_path_outside_the_bundle_is_refused(bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundle["bundle"], b)
    m = json.loads((b / "manifest.json").read_text())
    m["files"][0]["path"] = "/etc/hostname"
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"files\[0\]\.path names '/etc/hostname': absolute path"):
        read_manifest(b)
    r = run_cli("verify", str(b))
    assert r.returncode == 2 and "absolute path" in r.stderr and "Traceback" not in r.stderr, r.stderr
