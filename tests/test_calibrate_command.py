"""``k3bundle calibrate``: one trained-tiny job on the CPU (seed 0, greedy case, two faults) writes a
tolerance file whose calibration section holds the run's evidence, and ``validate --tolerances
FILE`` judges by it: a clean bundle of the same model passes, a faulted one fails at the layer
and tap where the fault was planted. Bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest

from k3bundle.golden.tolerances import load_tolerances
from tests.conftest import REPO, run_cli

FAULTS = ("dt_bias", "kda_state_late")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    cases = root / "cases"
    cases.mkdir()
    shutil.copy(REPO / "golden" / "cases" / "greedy.yaml", cases)
    out = root / "cal"
    r = run_cli("calibrate", "--out", str(out), "--preset", "tiny-trained:0", "--layout", "b300-tp8", "--cases", str(cases),
                "--faults", ",".join(FAULTS), "--threads", "2", "--json")
    return {"root": root, "cases": cases, "out": out, "result": r}


def test_calibrate_writes_a_tolerance_file_with_its_evidence(calibrated):
    r = calibrated["result"]
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    summary = json.loads(r.stdout)
    path = Path(summary["tolerance_file"])
    assert path == calibrated["out"] / "tolerances.yaml"
    tol = load_tolerances(path)
    # the base file's limits (bf16, the layout's format) are kept where the clean run sat well inside them
    base = load_tolerances(REPO / "tolerances" / "bf16.yaml")
    assert tol.added == base.added and tol.router == base.router
    assert "tiny-trained:0" in tol.calibration_run and "device cpu" in tol.calibration_run
    worst = tol.calibrated_clean_worst
    assert 0 < worst["added/mixer_out/nmse"] < base.added["mixer_out"]["nmse"]
    assert worst["exact/mixer_out/nmse"] == 0.0  # float32 on the goldens' own weights, same CPU
    # the least severe located fault: dt_bias at layers.2.mixer_out, far beyond the clean worst
    assert tol.calibrated_fault_best["added/mixer_out/nmse"] > 10 * worst["added/mixer_out/nmse"]
    rates = tol.calibration_rates
    assert rates["clean_bundles"] == 1 and rates["clean_bundle_failures"] == 0 and rates["clean_cases"] == 1
    assert rates["faults"] == {f: {"runs": 1, "detected": 1, "located": 1} for f in FAULTS}
    lines = (calibrated["out"] / "records.jsonl").read_text().splitlines()
    assert len(lines) == 1 + len(FAULTS)
    assert "tiny-trained:0 b300-tp8 cpu" in r.stderr  # a progress line per job


def test_validate_judges_by_the_calibrated_file(calibrated, tiny_trained_ckpt, tmp_path):
    from k3bundle.calibrate.weight_faults import dt_bias
    from k3bundle.convert import convert
    from k3bundle.golden.generate import generate_goldens
    from k3bundle.golden.store import read_npz

    tol_file = calibrated["out"] / "tolerances.yaml"
    bundle = tmp_path / "bundle"
    convert(tiny_trained_ckpt, "b300-tp8", bundle, workers=1)
    generate_goldens(bundle, cases_dir=calibrated["cases"])
    r = run_cli("validate", str(bundle), "--tolerances", str(tol_file), "--json")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    signoff = json.loads((bundle / "reports" / "validate" / "builtin-cpu" / "signoff.json").read_text())
    assert signoff["tolerances_file"] == str(tol_file.resolve())

    assert signoff["tolerances_sha256"] == hashlib.sha256(tol_file.read_bytes()).hexdigest()

    faulted = tmp_path / "faulted"
    shutil.copytree(bundle, faulted)
    shutil.rmtree(faulted / "reports")
    where = dt_bias(faulted, read_npz(faulted / "validation" / "golden_intermediates.npz"), random.Random(0))
    r = run_cli("validate", str(faulted), "--tolerances", str(tol_file), "--json")
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    ff = [c for c in json.loads(r.stdout)["cases"] if c["status"] == "fail"][0]["first_failure"]
    assert (ff["layer"], ff["tap"]) == (where.layer, where.tap) == (2, "layers.2.mixer_out")

    r = run_cli("validate", str(bundle), "--tolerances", str(tmp_path / "none.yaml"))
    assert r.returncode == 2 and r.stderr.startswith("error: tolerance set") and "none.yaml" in r.stderr


@pytest.mark.parametrize("args, message", [
    ({"presets": ["huge:0"]}, "no preset 'huge'"),
    ({"presets": ["tiny:x"]}, "seeds must be"),
    ({"layouts": ["no-such-layout"]}, "no-such-layout"),
    ({"faults": ["dt_bias", "bogus"]}, "no fault 'bogus' in the catalogue"),
    ({"device": "nonsense"}, "is not a torch device"),
    ({"workers": 0}, "must be at least 1"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, args, message):
    from k3bundle.calibrate.run import calibrate
    from k3bundle.errors import K3Error

    given = {"presets": ["tiny:0"], "layouts": ["b300-tp8"], "faults": [], **args}
    with pytest.raises(K3Error) as e:
        calibrate(tmp_path / "cal", **given)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "cal").exists()


def test_bad_input_on_the_command_line_is_one_line_exit_2(tmp_path):
    r = run_cli("calibrate", "--out", str(tmp_path / "cal"), "--preset", "tiny:0", "--layout", "no-such-layout",
                "--faults", "none")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and "no-such-layout" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "cal").exists()
