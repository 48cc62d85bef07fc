"""A bundle's own files as a hostile colleague would edit them: an index or manifest that names
files outside the bundle, a FIFO for the tokenizer, goldens of another model, a sign-off whose
cases are not case reports: each refused in one line, never a hang or a traceback."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import pytest

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.index import read_index
from k3bundle.bundle.manifest import read_manifest
from k3bundle.io.files import relpath_problem
from k3bundle.pull.errors import PullError
from k3bundle.pull.paths import check_name
from tests._bundles import bundle_with_goldens
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
    out, cases = bundle_with_goldens(tiny_ckpt, TINY_TP2, tmp_path_factory.mktemp("escape"), noise=False)
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
    assert not (tmp_path / "g").exists() and not (b / "reports" / "validate" / "builtin-cpu" / "signoff.json").exists()


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


def test_a_fifo_in_place_of_the_tokenizer_is_named_not_waited_on(bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundle["bundle"], b, ignore=shutil.ignore_patterns("*.safetensors"))
    (b / "tokenizer" / "tiktoken.model").unlink()
    os.mkfifo(b / "tokenizer" / "tiktoken.model")
    t0 = time.monotonic()
    r = run_cli("golden", str(b), "--out", str(tmp_path / "g"), "--cases", str(bundle["cases"]), "--no-noise")
    assert r.returncode == 2 and "tiktoken.model: cannot read: is a FIFO, not a regular file" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 120 and not (tmp_path / "g").exists()


def test_validate_against_goldens_of_another_model_width_is_one_line(bundle, tiny_trained_ckpt, tmp_path):
    from k3bundle.golden.generate import generate_goldens

    b = tmp_path / "b"
    shutil.copytree(bundle["bundle"], b, ignore=shutil.ignore_patterns("validation"))
    generate_goldens(tiny_trained_ckpt, out=b / "validation", cases_dir=bundle["cases"], noise=False)  # width 128
    r = run_cli("validate", str(b))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "the goldens are of another model: case 'greedy' has embed of width 128" in r.stderr
    assert "hidden_size 256" in r.stderr and not (b / "reports" / "validate" / "builtin-cpu" / "signoff.json").exists()


def test_checklist_on_a_signoff_whose_cases_are_not_case_reports_names_them(bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(bundle["bundle"], b, ignore=shutil.ignore_patterns("*.safetensors"))
    (b / "reports" / "validate" / "builtin-cpu").mkdir(parents=True)
    (b / "reports" / "validate" / "builtin-cpu" / "signoff.json").write_text(
        json.dumps({"schema_version": 1, "passed": True, "cases": [1]}))
    r = run_cli("checklist", "--target", str(TINY_TP2), "--bundle", str(b), "--verify", "manifest", "--json")
    assert "Traceback" not in r.stderr and r.returncode in (0, 1), r.stderr
    stages = {s["title"]: s for s in json.loads(r.stdout)["stages"]}
    for title in ("per-layer numerics", "end-to-end cases"):
        assert not stages[title]["done"], stages[title]
        assert "signoff.json: cases[0] is not a case report" in stages[title]["missing"], stages[title]
