"""The sign-off and checklist pages, opened in headless Chromium as a reader would; the sign-off diff.

Reports are built from ``Report`` objects directly (a passing run and one with a fault injected at
one layer), on the released config's 61-layer KDA/MLA pattern, so the pages are checked without
running the executor.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from k3bundle.checklist import make_checklist, save_checklist
from k3bundle.checklist.conformance import kernel_conformance
from k3bundle.config import load_config, release_config_path
from k3bundle.golden.tolerances import tolerance_dirs
from k3bundle.golden.tolerances import load_tolerances
from k3bundle.validate.compare import GreedyResult, TapResult
from k3bundle.validate.diff import diff_signoffs, load_signoff
from k3bundle.validate.errors import ValidateError
from k3bundle.validate.report import to_json, write_reports
from k3bundle.validate.run import CaseReport, Report
from tests import browser
from tests.conftest import run_cli

FAULT_LAYER = 5


def _bundle(tmp: Path) -> Path:
    b = tmp / "bundle"
    b.mkdir(parents=True)
    shutil.copy(release_config_path(), b / "config.json")
    return b


def _case(name: str, kind: str, text, tol, fault: bool, positions: list[int] | None = None) -> CaseReport:
    res = []
    for l in range(text.num_hidden_layers):
        for tap, base in (("attn_res_out", 2e-6), ("mixer_out", 3e-5), ("ffn_out", 1.5e-5)):
            t = f"layers.{l}.{tap}"
            v = base * (1 + 0.3 * ((l * 7) % 5)) * (800 if fault and l == FAULT_LAYER and tap == "mixer_out" else 1)
            lim = tol.limits("added", t)
            res.append(TapResult(name, t, "added", {"nmse": v, "cosine": 1 - v}, lim, v <= lim["nmse"],
                                 {} if v <= lim["nmse"] else {"nmse": v}))
            limi = tol.limits("inherited", t)  # a clean run carries 2-20% of the limit, a faulted one 30x that
            vi = 0.02 * limi["nmse"] * (1 + l / 10) * (30 if fault and l >= FAULT_LAYER else 1)
            res.append(TapResult(name, t, "inherited", {"nmse": vi, "cosine": 1 - vi}, limi, vi <= limi["nmse"],
                                 {} if vi <= limi["nmse"] else {"nmse": vi}))
        if text.is_moe(l):
            agree = 0.93 if fault and l == FAULT_LAYER + 1 else 1.0
            res.append(TapResult(name, f"layers.{l}.router_ids", "router", {"expert_set": agree, "near_tie_exempt": 0.0},
                                 {"expert_set": 0.999}, agree >= 0.999, {} if agree >= 0.999 else {"expert_set": agree}))
    pos = positions or list(range(40))
    c = CaseReport(name, kind, "pass", results=res, greedy=GreedyResult(12, 12, None, False, True),
                   drift={f"decode_states.layers.{l}.kda_state": [1e-3, 2e-3] for l in (0, 1)}, drift_limit=5e-2,
                   kld_by_position=[1e-4 * (1 + (p % 7)) * (40 if fault else 1) for p in pos], positions=pos)
    bad = [r for r in res if not r.passed]
    if bad:
        from k3bundle.validate.findings import first_failure
        c.status, c.first_failure = "fail", first_failure([r for r in bad if r.mode != "inherited"])
    return c


def make_report(tmp: Path, fault: bool) -> Report:
    bundle = _bundle(tmp)
    text = load_config(bundle / "config.json").text
    tol = load_tolerances(tolerance_dirs()[0] / "bf16.yaml")
    long_pos = list(range(0, 4000, 97))
    cases = [_case("greedy", "greedy", text, tol, fault), _case("thinking", "thinking", text, tol, False),
             _case("long_context", "long_context", text, tol, False, long_pos),
             CaseReport("image", "image", "not run", "the model has no vision tower")]
    meta = {"content_hash": "ab" * 32, "dtype": "float32", "k3bundle_version": "0",
            "cases": [{"name": c.name, "kind": c.kind, "tokens": 4000 if c.name == "long_context" else 40}
                      for c in cases]}
    return Report(str(bundle), "device", "cpu", tol, cases, meta, 1.0)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    root = tmp_path_factory.mktemp("pages")
    out = {}
    for name, fault in (("pass", False), ("fail", True)):
        rep = make_report(root / name, fault)
        write_reports(rep, root / name / "reports" / "validate" / "builtin-cpu")  # a bundle's, as validate keys it
        out[name] = (rep, root / name / "reports" / "validate" / "builtin-cpu")
    return root, out


def _summary_rows(dom: str) -> list[str]:
    table = re.search(r"<table class=\"sortable summary\">(.*?)</table>", dom, re.S).group(1)
    return re.findall(r"<tr[^>]*>.*?</tr>", table.split("<tbody>", 1)[1], re.S)


def test_png_reader_reads_what_was_written(tmp_path):
    import struct
    import zlib

    import numpy as np
    w, h = 5, 4
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    rows = b""
    for y in range(h):  # each row with a different filter, encoded by the specification's rules
        f, line, prev = y % 5, img[y].reshape(-1).astype(int), (img[y - 1].reshape(-1).astype(int) if y else
                                                              np.zeros(w * 3, int))
        left = np.concatenate([np.zeros(3, int), line[:-3]])
        ul = np.concatenate([np.zeros(3, int), prev[:-3]])
        pred = {0: 0, 1: left, 2: prev, 3: (left + prev) // 2,
                4: np.array([browser._paeth(a, b, c) for a, b, c in zip(left, prev, ul)])}[f]
        rows += bytes([f]) + bytes(((line - pred) % 256).astype(np.uint8))
    chunk = lambda k, d: struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d))  # noqa: E731
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    (tmp_path / "x.png").write_bytes(png)
    assert (browser.read_png(tmp_path / "x.png") == img).all()


def test_a_blank_page_reads_as_blank(tmp_path):
    (tmp_path / "blank.html").write_text("<!doctype html><title>x</title><body></body>")
    assert browser.ink(browser.screenshot(tmp_path / "blank.html", tmp_path / "b.png", tmp_path, "800,600")) < 1e-4


def test_failing_signoff_page_in_chromium(pages, tmp_path):
    root, reps = pages
    rep, out = reps["fail"]
    dom = browser.dump_dom(out / "signoff.html", tmp_path)
    rows = _summary_rows(dom)
    assert len(rows) == len(rep.cases)  # one summary row per case
    greedy = next(r for r in rows if ">greedy<" in r)
    assert "FAIL" in greedy and f"layer {FAULT_LAYER}" in greedy and "mixer_out" in greedy
    assert sum("PASS" in r for r in rows) == 2 and "NOT RUN" in rows[-1]
    section = dom.split('id="case-greedy"', 1)[1].split("<h2", 1)[0]
    assert f"first failure: layer {FAULT_LAYER} mixer_out (added)" in section  # the failing layer is marked
    assert section.count('class="mark"') >= 1 and section.count('class="limit"') >= 2  # added and inherited limits
    assert "KDA" not in section or "MLA" in section  # the axis names layer types
    assert re.search(r">K<.*>M<", section, re.S)  # 61 layers: types abbreviated on the axis
    assert "would pass at" in section  # the failing added check and the limit that would have passed:
    # the planted value is 3e-5 x 800 = 0.024 (see _case); its limit is the shipped bf16 file's
    lim = load_tolerances(tolerance_dirs()[0] / "bf16.yaml").limits("added", f"layers.{FAULT_LAYER}.mixer_out")["nmse"]
    row = (f'<td>added</td><td class="num">{FAULT_LAYER}</td><td><code>layers.{FAULT_LAYER}.mixer_out</code></td>'
           f'<td>nmse</td><td class="num">0.024</td><td class="num">≤ {lim:.2e}</td>'
           f"<td>{0.024 / lim:.3g}× the limit</td><td>≤ 0.024</td>")
    assert row in section, row
    long = dom.split('id="case-long-context"', 1)[1].split("<h2", 1)[0]
    assert "42 of 4,000 positions are sampled" in long and long.count('class="rug"') == 42
    png = browser.screenshot(out / "signoff.html", tmp_path / "fail.png", tmp_path)
    assert browser.ink(png) > 0.02


def test_passing_signoff_page_in_chromium(pages, tmp_path):
    rep, out = pages[1]["pass"]
    dom = browser.dump_dom(out / "signoff.html", tmp_path)
    assert len(_summary_rows(dom)) == len(rep.cases)
    assert 'class="mark"' not in dom and "first failure" not in dom
    assert dom.count('class="limit"') >= 3 * 2  # each computed case: added and inherited limits
    assert browser.ink(browser.screenshot(out / "signoff.html", tmp_path / "pass.png", tmp_path)) > 0.02


def test_checklist_page_in_chromium(tmp_path):
    cl = make_checklist("b300-tp8")
    md, js, page = save_checklist(cl, tmp_path / "reports" / "checklist.md")
    assert page == tmp_path / "reports" / "checklist.html" and md.is_file() and js.is_file()
    dom = browser.dump_dom(page, tmp_path)
    assert dom.count('class="seg"') >= 3 * len(cl.plan.ranks)  # a stacked bar per rank
    stages = dom.split('class="stages"', 1)[1].split("</table>", 1)[0]
    assert stages.count("<tr") == 1 + len(cl.stages) == 10
    assert "k3bundle convert SOURCE --target b300-tp8 --out BUNDLE" in stages  # the command for a missing stage
    kernels = dom.split('id="kernels"', 1)[1].split("</table>", 1)[0]
    assert kernels.count("UNTESTED") == len(cl.kernels)  # no bundle, no sign-off: nothing is claimed
    assert browser.ink(browser.screenshot(page, tmp_path / "cl.png", tmp_path)) > 0.02


def test_kernel_conformance_follows_the_signoff(pages):
    rep, _ = pages[1]["fail"]
    text = load_config(Path(rep.bundle) / "config.json").text
    assert not text.is_mla(FAULT_LAYER)
    ops = ["kda_chunked_prefill", "gated_mla_prefill", "situ_glu", "sigmoid_biased_topk_router",
           "kda_recurrent_decode", "moonvit_rope2d_attention"]
    got = {c.op: c for c in kernel_conformance(ops, to_json(rep), text)}
    assert got["kda_chunked_prefill"].status == "fail" and f"layer {FAULT_LAYER}" in got["kda_chunked_prefill"].detail
    assert got["gated_mla_prefill"].status == "pass" and got["situ_glu"].status == "pass"
    assert got["sigmoid_biased_topk_router"].status == "fail"
    assert got["kda_recurrent_decode"].status == "untested" and got["moonvit_rope2d_attention"].status == "untested"
    assert {c.status for c in kernel_conformance(ops, None, text, "no signoff")} == {"untested"}


def test_diff_names_the_moved_layer(pages, tmp_path):
    _, reps = pages
    a, b = load_signoff(reps["pass"][1])[1], load_signoff(reps["fail"][1].parents[2])[1]  # the folder, or the bundle
    d = diff_signoffs(a, b)
    first = d.moved[0]
    assert first.change == "now fails" and first.case == "greedy"
    moved = {(m.mode, m.tap, m.metric) for m in d.moved if m.case == "greedy"}
    assert ("added", f"layers.{FAULT_LAYER}.mixer_out", "nmse") in moved
    assert not any(m.mode == "added" and m.tap != f"layers.{FAULT_LAYER}.mixer_out" for m in d.moved)
    assert ("greedy", "pass", "fail") in d.cases and ("thinking", "pass", "pass") in d.cases
    assert diff_signoffs(a, a).moved == []


def test_report_diff_cli(pages, tmp_path):
    _, reps = pages
    html = tmp_path / "diff.html"
    r = run_cli("report", "diff", str(reps["pass"][1]), str(reps["fail"][1] / "signoff.json"), "--html", str(html),
                "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["moved"][0]["change"] == "now fails" and html.is_file()
    dom = browser.dump_dom(html, tmp_path)
    assert f"layers.{FAULT_LAYER}.mixer_out" in dom and dom.count("<svg") >= 3
    r = run_cli("report", "diff", str(tmp_path / "nothing"), str(reps["fail"][1]))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nothing" in r.stderr
    with pytest.raises(ValidateError, match="not readable JSON"):
        (tmp_path / "signoff.json").write_text("{")
        load_signoff(tmp_path)


def test_exact_zeros_and_nan_stay_on_a_log_plot():
    from k3bundle.pages.svg import Axis, Series, line_chart
    svg = line_chart([Series("emulation", [(0, 0.0), (1, 1e-5), (2, float("nan"))], "#000")],
                     Axis(-0.5, 2.5), Axis(-6, -4, log=True))
    assert svg.count("<circle") == 3 + 1 and "r='6'" in svg  # three points (the NaN a ring at the top) + legend
