"""A rank of ``validate --ranks distributed`` that stalls or dies (gloo, world size 2, the tiny
preset): every process is gone within the collective timeout plus a margin, one line names the
rank, exit 2, and no sign-off (an earlier PASS included) is left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, run_cli

TIMEOUT_S = 10  # --collective-timeout of these runs
MARGIN_S = 45  # process start-up and torchrun's teardown on a loaded 2-core machine


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tiny_ckpt):
    from k3bundle.convert import convert
    from k3bundle.golden.generate import generate_goldens

    root = tmp_path_factory.mktemp("ranks")
    cases = root / "cases"
    cases.mkdir()
    shutil.copy(REPO / "golden" / "cases" / "greedy.yaml", cases)
    out = root / "tiny-tp2"
    convert(tiny_ckpt, str(REPO / "tests" / "layouts" / "tiny-tp2.yaml"), out, workers=1)
    generate_goldens(tiny_ckpt, out=out / "validation", cases_dir=cases)
    return out


def _processes_naming(path: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(path) in a for a in p.info["cmdline"] or ()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.parametrize("fault,word", [("stall:1", "stalled"), ("die:1", "died")])
def test_a_rank_that_stalls_or_dies_is_named_and_leaves_no_pass(bundle, fault, word):
    reports = bundle / "reports" / "validate" / "builtin-cpu-distributed"
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "signoff.json").write_text(json.dumps({"passed": True}))  # an earlier PASS
    (reports / "signoff.md").write_text("PASS")
    t0 = time.monotonic()
    r = run_cli("validate", str(bundle), "--ranks", "distributed", "--collective-timeout", str(TIMEOUT_S),
                env={"OMP_NUM_THREADS": "1", "K3BUNDLE_TEST_RANK_FAULT": fault})
    seconds = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-2000:]
    assert seconds < TIMEOUT_S + MARGIN_S, seconds
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and f"rank 1 {word}" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not _processes_naming(bundle), "a rank outlived validate"
    assert not any(f.name.startswith("signoff") for f in reports.iterdir()) if reports.is_dir() else True


def test_a_launch_whose_ranks_all_go_silent_is_killed_with_its_children(tmp_path):
    """The last guard: no heartbeat for the limit, and the launcher's whole session is killed
    (a grandchild too), however the ranks hang."""
    from k3bundle.validate.distributed import _launch

    marker = str(tmp_path / "silent-run")
    child = "import time; time.sleep(300)"
    cmd = [sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
           f"{child!r}, sys.argv[1]]); time.sleep(300)", marker]
    t0 = time.monotonic()
    code, _, silent = _launch(cmd, {}, tmp_path, 2.0)
    assert silent and time.monotonic() - t0 < 15
    assert code != 0
    time.sleep(0.5)
    assert not _processes_naming(tmp_path / "silent-run")


def test_the_rank_faults_are_recorded_as_clean_errors_naming_the_rank(bundle):
    """What ``k3bundle faults BUNDLE --rank-faults`` records: both faults a clean error naming
    rank 1 within the timeout and margin, then a clean run re-validates."""
    from k3bundle.validate.rank_faults import run_rank_faults

    got = run_rank_faults(bundle, timeout_s=TIMEOUT_S)
    assert [r.key for r in got] == ["rank_stall", "rank_death"]
    for r, word in zip(got, ("stalled", "died")):
        assert r.clean, r.line
        assert f"rank 1 {word}" in r.line and 0 < r.seconds < TIMEOUT_S + MARGIN_S
        assert r.revalidated is True
    assert not _processes_naming(bundle)


def test_rank_faults_need_a_bundle():
    r = run_cli("faults", "--endpoint", "http://127.0.0.1:9/v1", "--rank-faults", "5")
    assert r.returncode == 2 and "--rank-faults runs validate --ranks distributed on a bundle" in r.stderr
