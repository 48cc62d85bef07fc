"""A verdict is bound to what it judged: no stale PASS after the bundle, its goldens or its
tolerance file change, after a run that could not finish (SIGTERM) or could not write its reports,
and goldens whose tolerance file is not their own are refused.

One small bundle (the trained tiny, TP 2, the greedy case) validated once; each test works on a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3bundle.golden.errors import GoldenFileError
from k3bundle.golden.tolerances import tolerance_path
from k3bundle.validate.errors import ValidateError
from tests._bundles import bundle_with_goldens
from tests.conftest import REPO, run_cli
from tests.faults import run_cli_faulted

LAYOUT = REPO / "tests" / "layouts" / "tiny-tp2.yaml"
SIGNOFF_FILES = ("signoff.json", "signoff.md", "signoff.html")
BUILTIN = Path("reports") / "validate" / "builtin-cpu"  # the run key of `validate BUNDLE` (docs/validation.md)
MARKER = Path("validation") / ".k3bundle-validate.builtin-cpu.run"
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """In-process runs on one torch thread: spinning OpenMP threads beside the CLI's subprocesses
    make them many times slower on a small machine (docs/performance.md "Under load")."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def signed(tmp_path_factory, tiny_trained_ckpt):
    """A converted bundle with goldens (greedy case) that `validate` passed, and its root folder."""
    root = tmp_path_factory.mktemp("verdicts")
    bundle, cases = bundle_with_goldens(tiny_trained_ckpt, LAYOUT, root)
    r = run_cli("validate", str(bundle), "--json", env=ENV)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {"bundle": bundle, "cases": cases, "root": root}


def _copy(signed, tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    shutil.copytree(signed["bundle"], out)
    return out


def _numerics(bundle: Path, run: str | None = None):
    from k3bundle.checklist import make_checklist

    return next(s for s in make_checklist(str(LAYOUT), bundle=bundle, run=run).stages if s.key == "per_layer_numerics")


def test_the_signoff_names_what_it_judged(signed):
    b = signed["bundle"]
    doc = json.loads((b / BUILTIN / "signoff.json").read_text())
    marker = json.loads((b / MARKER).read_text())
    assert doc["bundle_manifest_sha256"] == sha256(b / "manifest.json")
    assert doc["tolerances_sha256"] == sha256(b / "validation" / "tolerances.yaml")
    assert doc["case_list"] == ["greedy"] and [c["name"] for c in doc["cases"]] == ["greedy"]
    assert doc["device"] == "cpu" and doc["backend"] is None and doc["mode"] == "device"
    assert doc["run_id"] == marker["run_id"] and len(doc["run_id"]) == 16
    assert doc["run"]["key"] == marker["run_key"] == "builtin-cpu" and doc["run"]["started"] == marker["started"]
    assert json.loads((b / "reports" / "validate" / "latest.json").read_text())["run_key"] == "builtin-cpu"
    assert _numerics(b).done


def test_runs_of_other_keys_keep_their_reports_and_the_checklist_names_the_run_it_read(signed, tmp_path):
    """A backend run after the built-in one: each keeps its reports under its run key, the checklist
    reads the latest and says which (key, what ran, when, file), lists both, reads the other on
    --run, and judges each run stale on its own (its own marker, its own binding)."""
    b = _copy(signed, tmp_path)
    builtin = {n: (b / BUILTIN / n).read_bytes() for n in SIGNOFF_FILES}
    r = run_cli("validate", str(b), "--backend", "torch", env=ENV)
    assert r.returncode == 0 and "reports (run backend-torch-cpu): " in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    other = b / "reports" / "validate" / "backend-torch-cpu"
    assert {n: (b / BUILTIN / n).read_bytes() for n in SIGNOFF_FILES} == builtin  # untouched
    doc = json.loads((other / "signoff.json").read_text())
    assert all((other / n).is_file() for n in SIGNOFF_FILES)
    assert doc["backend"] == "torch" and doc["run"]["key"] == "backend-torch-cpu"
    assert (doc["run"]["device"], doc["run"]["ranks"], doc["run"]["backend"], doc["run"]["dumps"]) == \
        ("cpu", "merged", "torch", None)
    assert doc["run"]["started"] <= doc["run"]["finished"]
    latest = json.loads((b / "reports" / "validate" / "latest.json").read_text())
    assert latest == {"run_key": "backend-torch-cpu", "run_id": doc["run_id"], "finished": doc["run"]["finished"],
                      "signoff": "reports/validate/backend-torch-cpu/signoff.json"}

    out = tmp_path / "cl" / "checklist.md"
    r = run_cli("checklist", "--target", str(LAYOUT), "--bundle", str(b), "--verify", "manifest", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    md, page = out.read_text(), out.with_suffix(".html").read_text()
    said = (f"run backend-torch-cpu (built-in executor on cpu, backend torch; finished {doc['run']['finished']}), "
            "reports/validate/backend-torch-cpu/signoff.json, the latest run (reports/validate/latest.json); "
            "1 other run(s), read with --run KEY")
    assert f"- sign-off read (stages per-layer numerics, end-to-end cases): {said}" in md
    assert f"<dt>sign-off read</dt><dd>{said}</dd>" in page and "<code>builtin-cpu</code>" in page and "<code>backend-torch-cpu</code>" in page
    listed = md.split("Validate runs in `reports/validate/`")[1].split("\n\n")[1].splitlines()
    assert [line.split(" (")[0] for line in listed] == ["- **read**: backend-torch-cpu", "- builtin-cpu"]
    assert "built-in executor on cpu, reference kernels" in listed[1] and listed[1].endswith("PASS)")
    assert "reports/validate/backend-torch-cpu/signoff.json (device on cpu" in md  # the stage's evidence
    js = json.loads(out.with_suffix(".json").read_text())
    assert js["signoff_read"]["key"] == "backend-torch-cpu"
    assert [x["key"] for x in js["signoff_runs"]] == ["backend-torch-cpu", "builtin-cpu"]

    s = _numerics(b, run="builtin-cpu")
    assert s.done and s.evidence.startswith("reports/validate/builtin-cpu/signoff.json (device on cpu, ")
    r = run_cli("checklist", "--target", str(LAYOUT), "--bundle", str(b), "--run", "dumps-x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "no run 'dumps-x' (runs there: backend-torch-cpu, builtin-cpu)" in r.stderr

    # a later built-in run that wrote no reports unbinds the built-in sign-off only
    marker = b / MARKER
    marker.write_text(json.dumps({"run_key": "builtin-cpu", "run_id": "f" * 16, "started": "2099-01-01T00:00:00Z"}))
    assert "stale: a later validate run (started 2099-01-01" in _numerics(b, run="builtin-cpu").missing
    assert _numerics(b).done
    # and a sign-off that judged another manifest is stale on its own
    path = other / "signoff.json"
    path.write_text(json.dumps({**doc, "bundle_manifest_sha256": "0" * 64}))
    assert "stale: the bundle changed after this sign-off (manifest.json: judged 0000" in _numerics(b).missing
    marker.write_text(json.dumps({"run_key": "builtin-cpu", "run_id": json.loads(builtin["signoff.json"])["run_id"]}))
    assert _numerics(b, run="builtin-cpu").done


def test_a_bundle_converted_again_from_another_checkpoint_is_stale(signed, tmp_path, tiny_ckpt):
    """convert --force from a different checkpoint into the validated bundle: the goldens and the
    sign-off are the user's files and stay, but the sign-off judged another manifest."""
    from k3bundle.convert import convert

    b = _copy(signed, tmp_path)
    before = sha256(b / "manifest.json")
    convert(tiny_ckpt, str(LAYOUT), b, workers=1, force=True)
    assert sha256(b / "manifest.json") != before and (b / BUILTIN / "signoff.json").is_file()
    s = _numerics(b)
    assert not s.done
    assert "stale: the bundle changed after this sign-off (manifest.json: judged " in s.missing
    assert f"judged {before[:16]}…, now {sha256(b / 'manifest.json')[:16]}…" in s.missing


def test_each_bound_field_unticks_on_its_own(signed, tmp_path):
    """A sign-off whose recorded manifest, goldens, tolerance file, case list or run differ from the
    bundle's names what changed; one without the fields (an older k3bundle) does not tick either."""
    b = _copy(signed, tmp_path)
    path = b / BUILTIN / "signoff.json"
    good = json.loads(path.read_text())
    for key, value, says in [("bundle_manifest_sha256", "0" * 64, "manifest.json: judged 0000"),
                             ("golden_content_hash", "1" * 64, "the goldens (content hash): judged 1111"),
                             ("tolerances_sha256", "2" * 64, "the goldens' tolerances.yaml: judged 2222"),
                             ("case_list", ["greedy", "image"], "the goldens' case list: judged ['greedy', 'image']"),
                             ("run_id", "3" * 16, "a later validate run (started "),
                             ("bundle_manifest_sha256", None, "does not record manifest.json")]:
        doc = {**good, key: value} if value is not None else {k: v for k, v in good.items() if k != key}
        path.write_text(json.dumps(doc))
        s = _numerics(b)
        assert not s.done and "stale" in s.missing and says in s.missing, (key, s.missing)
    path.write_text(json.dumps(good))
    assert _numerics(b).done


def test_validate_refuses_a_manifest_that_changes_while_it_runs(signed, tmp_path):
    """The bundle rewritten mid-run (played by a byte appended to manifest.json after the first
    case): no verdict, one line naming the manifest."""
    from k3bundle.validate.run import validate
    from k3bundle.validate.device_options import open_device

    b = _copy(signed, tmp_path)
    dut = open_device(b)
    judge_case = dut.case

    def case_then_rewrite(*a, **kw):
        out = judge_case(*a, **kw)
        with open(b / "manifest.json", "a") as f:
            f.write(" ")
        return out

    dut.case = case_then_rewrite
    with pytest.raises(ValidateError, match=r"^manifest.json changed while validate ran; no verdict is written"):
        validate(b, dut)


@contextlib.contextmanager
def _unchangeable(*paths: Path):
    """``paths`` made impossible to change for this user: immutable (root) or read-only."""
    root = os.geteuid() == 0
    for p in paths:
        if root:
            if subprocess.run(["chattr", "+i", str(p)], capture_output=True).returncode:
                pytest.skip("this filesystem cannot make a file immutable (chattr +i)")
        else:
            p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        yield
    finally:
        for p in paths:
            if root:
                subprocess.run(["chattr", "-i", str(p)], check=True)
            else:
                p.chmod(0o755 if p.is_dir() else 0o644)


def test_an_unwritable_reports_folder_is_one_line_and_leaves_no_pass(signed, tmp_path):
    """reports/ that cannot change: the earlier PASS is emptied in place, exit 2 before any work,
    one line. Where the files cannot change either they stay as they were, but the run marker names
    the new run, so the checklist no longer ticks from them."""
    b = _copy(signed, tmp_path)
    reports = b / BUILTIN
    old = {n: (reports / n).read_bytes() for n in SIGNOFF_FILES}
    marker = b / MARKER
    earlier_run = marker.read_bytes()
    with _unchangeable(reports):
        r = run_cli("validate", str(b), env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "reports" in r.stderr
    assert "cannot write the reports" in r.stderr and "make the folder writable" in r.stderr
    assert all((reports / n).read_bytes() == b"" for n in SIGNOFF_FILES)  # no PASS left to read
    assert "not readable JSON" in _numerics(b).missing

    assert marker.read_bytes() != earlier_run  # the failed run named itself
    for n, data in old.items():
        (reports / n).write_bytes(data)
    assert "stale: a later validate run (started " in _numerics(b).missing
    marker.write_bytes(earlier_run)  # as if that run had never been tried
    assert _numerics(b).done
    with _unchangeable(reports, *(reports / n for n in SIGNOFF_FILES)):
        r = run_cli("validate", str(b), env=ENV)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot remove the earlier reports" in r.stderr
        assert {n: (reports / n).read_bytes() for n in SIGNOFF_FILES} == old  # could not be touched
        s = _numerics(b)
    assert not s.done and "stale: a later validate run (started " in s.missing


def test_sigterm_during_validate_leaves_no_verdict(signed, tmp_path):
    b = _copy(signed, tmp_path)
    marker = b / MARKER
    before = marker.read_text()
    e = {**os.environ, **ENV}
    e.pop("K3BUNDLE_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "k3bundle", "validate", str(b)], env=e, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while marker.read_text() == before and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # the run has begun once it names itself in the marker
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-2000:])
    *progress, last = err.splitlines()  # stderr is a pipe: the stage lines of the run so far come first
    assert last == "error: stopped by SIGTERM; no verdict written: rerun validate"
    assert all(line.startswith("validate: ") for line in progress), err
    assert sorted(q.name for q in (b / BUILTIN).iterdir()) == []  # nor any temp file
    assert "run builtin-cpu: no reports/validate/builtin-cpu/signoff.json" in _numerics(b).missing


def test_goldens_and_their_tolerance_file_are_one_unit(signed, tmp_path):
    """A kill between golden's writes (the goldens of a `--tolerances mxfp4` run published, its
    tolerance file not): validate refuses the pair in one line instead of judging by bf16's limits;
    the temp file the kill left is removed by the next golden run, whose goldens validate takes."""
    b = _copy(signed, tmp_path)
    v = b / "validation"
    assert sha256(v / "tolerances.yaml") == sha256(tolerance_path("bf16"))
    r = run_cli_faulted(["golden", str(b), "--cases", str(signed["cases"]), "--tolerances", "mxfp4"],
                        kill_at="k3bundle.io.files:publish", nth=3, env=ENV)  # the 3rd: tolerances.yaml
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    temps = [p.name for p in v.iterdir() if p.name.startswith(".tolerances.yaml.") and p.name.endswith(".tmp")]
    assert len(temps) == 1 and sha256(v / "tolerances.yaml") == sha256(tolerance_path("bf16"))

    from k3bundle.validate.run import load_goldens

    with pytest.raises(GoldenFileError, match="not the tolerance file the goldens were made with"):
        load_goldens(v)
    r = run_cli("validate", str(b), env=ENV)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "tolerances.yaml: not the tolerance file the goldens were made with" in r.stderr
    assert not (b / BUILTIN / "signoff.json").exists()

    from k3bundle.golden.generate import generate_goldens

    generate_goldens(b, cases_dir=signed["cases"], tolerance="mxfp4")
    assert not [p.name for p in v.iterdir() if p.name.endswith(".tmp")]
    assert sha256(v / "tolerances.yaml") == sha256(tolerance_path("mxfp4"))
    assert load_goldens(v)[3].name == "mxfp4"


def test_run_keys_are_the_ones_docs_validation_lists():
    """The run key of each command in docs/validation.md "Where the reports go" is the one
    validate uses (the documented table is the oracle); the key of a dumps run is its folder's name."""
    import shlex

    from k3bundle.bundle.signoff_runs import run_key

    text = (REPO / "docs" / "validation.md").read_text().split("### Where the reports go")[1].split("\n\n")[2]
    rows = [line.split("|")[1:3] for line in text.splitlines()[2:]]
    assert len(rows) == 6
    for cmd, key in rows:
        argv = shlex.split(cmd.strip().strip("`"))[2:]
        opts = dict(zip(argv[::2], argv[1::2]))
        assert run_key(opts.get("--device", "cpu"), opts.get("--ranks", "merged"), opts.get("--backend"),
                       opts.get("--dumps")) == key.strip().split("`")[1], cmd
    assert run_key(dumps=".") == "dumps-" + Path.cwd().name.replace(" ", "-")
