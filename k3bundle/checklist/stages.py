"""Sign-off stages, in order, each ticked only from evidence on disk (or the capacity computation).

capacity → conversion → golden → per-layer numerics → end-to-end cases → performance → fault
paths → soak → sign-off. Evidence, all inside the bundle:

* conversion — ``manifest.json`` for this target, every file it lists re-hashed and matching
  (``k3bundle.provenance.verify.verify``), ``weights.index.json`` agreeing with every device header;
* golden — ``validation/golden_inputs.npz``, ``golden_intermediates.npz``, ``tolerances.yaml``,
  both npz files from the same run (content hash);
* per-layer numerics / end-to-end cases — one run's ``reports/validate/RUN_KEY/signoff.json``
  (the latest, or the one ``--run`` names: ``bundle.signoff_runs.choose_run``) written by
  ``validate`` on the bundle as it is now: the manifest, goldens, tolerance file and case list it
  records are the bundle's, and it is the run its key's run marker names
  (``bundle.signoff.stale_because``);
* performance, fault paths, soak — ``reports/performance.json``, ``faults.json``, ``soak.json``
  written by the bring-up team (format in docs/bring-up.md), checked against this checklist.
A stage that is not ticked says what is missing and the command that produces it.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.signoff import binding, judged_tolerances, read_run_marker, stale_because
from k3bundle.bundle.signoff_runs import SignoffRun
from k3bundle.checklist import faults as F
from k3bundle.errors import JsonFileError
from k3bundle.file_names import (FAULTS_REPORT, GOLDEN_FILES, GOLDEN_INPUTS, GOLDEN_INTERMEDIATES,
                                  MANIFEST, PERFORMANCE_REPORT, SOAK_REPORT, VALIDATION_DIR)
from k3bundle.io.strict_json import loads, read_json

PERFORMANCE_KIND, FAULTS_KIND, SOAK_KIND = "k3bundle.performance", "k3bundle.faults", "k3bundle.soak"
EVIDENCE_SCHEMA_VERSION = 1
#: Case kinds the end-to-end stage needs (design.md "Golden, validate, sign-off").
REQUIRED_CASE_KINDS = ("greedy", "thinking", "tool_call", "multi_turn", "long_context", "image")
#: Teacher-forced per-layer result modes in signoff.json (validate: device "added", dumps "emulation").
LAYER_MODES = ("added", "emulation")


@dataclass
class Stage:
    key: str
    title: str
    done: bool
    evidence: str = ""  # what ticked it
    missing: str = ""  # what is missing (open stages)
    next: str = ""  # the command or step that produces the evidence
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------------
# evidence readers


def _golden_meta(path: Path) -> dict:
    """``__meta__`` of a golden npz (plain or zstd), without loading the other arrays."""
    data = path.read_bytes()
    if data[:4] == b"\x28\xb5\x2f\xfd":
        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 40)
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        if "__meta__" not in z.files:
            return {}
        return loads(bytes(z["__meta__"]), str(path))


def read_goldens(bundle: Path) -> tuple[dict | None, str]:
    """(meta of the goldens, '') or (None, what is wrong)."""
    vdir = bundle / VALIDATION_DIR
    missing = [n for n in GOLDEN_FILES if not (vdir / n).is_file()]
    if missing:
        return None, f"{VALIDATION_DIR}/ lacks {', '.join(missing)}"
    try:
        a, b = _golden_meta(vdir / GOLDEN_INPUTS), _golden_meta(vdir / GOLDEN_INTERMEDIATES)
    except (OSError, ValueError, JsonFileError, zipfile.BadZipFile, zstandard.ZstdError) as e:
        return None, f"{VALIDATION_DIR}/: the golden files cannot be read ({type(e).__name__}: {e})"
    if not a.get("content_hash") or a.get("content_hash") != b.get("content_hash"):
        return None, (f"{VALIDATION_DIR}/: {GOLDEN_INPUTS} and {GOLDEN_INTERMEDIATES} come from different runs "
                      f"(content hash {str(a.get('content_hash'))[:16]} vs {str(b.get('content_hash'))[:16]})")
    return b, ""


def read_report(bundle: Path, rel: str) -> tuple[object | None, str]:
    """(the parsed JSON of the report ``bundle/rel``, '') or (None, why it cannot be read)."""
    path = bundle / rel
    if not path.is_file():
        return None, f"no {rel}"
    try:
        return read_json(path), ""
    except JsonFileError as e:
        return None, f"{rel}: not readable JSON ({e.problem})"


def read_evidence(bundle: Path, rel: str, kind: str) -> tuple[dict | None, str]:
    path = bundle / rel
    if not path.is_file():
        return None, f"no {rel}"
    try:
        return read_json(path, kind=kind, version=EVIDENCE_SCHEMA_VERSION), ""
    except JsonFileError as e:
        return None, str(e)


# ------------------------------------------------------------------------------------------
# stages


def _conversion(bundle: Path | None, target: str, verify_fn: Callable) -> Stage:
    s = Stage("conversion", "conversion", False, next=f"k3bundle convert SOURCE --target {target} --out BUNDLE")
    if bundle is None:
        s.missing = "no bundle given (--bundle)"
        return s
    if not (bundle / MANIFEST).is_file():
        s.missing = f"{bundle}: no {MANIFEST} (the conversion did not finish)"
        s.next = f"rerun the same `k3bundle convert ... --out {bundle}` to resume it"
        return s
    try:
        r = verify_fn(bundle)
    except BundleError as e:
        s.missing = str(e)
        return s
    if not r.ok:
        s.missing = f"`k3bundle verify` finds {len(r.problems)} problem(s), first: {r.problems[0]}"
        s.next = f"k3bundle verify {bundle}"
        return s
    s.done = True
    s.evidence = (f"manifest.json for {target}, {r.coverage}: every sha256 and size checked matches; "
                  "weights.index.json agrees with every device file header")
    s.next = f"k3bundle verify {bundle} --source SOURCE  (re-derive every rank file from the source)"
    return s


def _golden(bundle: Path | None, goldens: dict | None, why: str) -> Stage:
    s = Stage("golden", "golden", False, next=f"k3bundle golden {bundle or 'BUNDLE'}")
    if bundle is None:
        s.missing = "no bundle given (--bundle)"
        return s
    if goldens is None:
        s.missing = why
        return s
    cases = goldens.get("cases", [])
    ok = [c["name"] for c in cases if c.get("status") == "ok"]
    s.done = bool(ok)
    s.evidence = (f"validation/: goldens {goldens['content_hash'][:16]}… ({goldens.get('dtype', '?')}), "
                  f"{len(ok)} of {len(cases)} cases computed")
    s.notes = [f"{c['name']}: not run ({c.get('reason', '')})" for c in cases if c.get("status") != "ok"]
    if not ok:
        s.missing = "the goldens hold no computed case"
    return s


def _signoff_checks(bundle: Path | None, goldens: dict | None, run: SignoffRun | None, why: str,
                    key: str, title: str) -> tuple[Stage, dict | None]:
    s = Stage(key, title, False, next=f"k3bundle validate {bundle or 'BUNDLE'} [--dumps DIR]")
    if bundle is None:
        s.missing = "no bundle given (--bundle)"
        return s, None
    if goldens is None:
        s.missing = "no goldens to judge against (stage golden)"
        s.next = f"k3bundle golden {bundle}, then k3bundle validate {bundle}"
        return s, None
    if run is None:
        s.missing = why
        return s, None
    if run.doc is None:
        s.missing = f"run {run.key}: {run.why}"
        return s, None
    stale = stale_because(run.doc, binding(bundle, goldens, judged_tolerances(bundle, run.doc)),
                          read_run_marker(bundle, run.key))
    if stale:
        s.missing = f"{run.path}: {stale}"
        return s, None
    return s, run.doc


def _layer_numerics(bundle, goldens, run, why) -> Stage:
    s, doc = _signoff_checks(bundle, goldens, run, why, "per_layer_numerics", "per-layer numerics")
    if doc is None:
        return s
    checked, failed = [], []
    for c in doc["cases"]:
        if c.get("status") == "not run":
            continue
        layer = [r for r in c.get("results", []) if r.get("mode") in LAYER_MODES]
        if not layer:
            s.notes.append(f"{c['name']}: no teacher-forced layer checks ({c.get('layer_checks') or 'none recorded'})")
            continue
        checked.append(c["name"])
        bad = [r for r in layer if not r.get("passed")]
        if bad:
            r = bad[0]
            failed.append(f"{c['name']}: {len(bad)} failing, first layer {r.get('layer')} `{r.get('tap')}`")
    if failed:
        s.missing = f"run {run.key}: teacher-forced layer checks fail: " + "; ".join(failed)
    elif not checked:
        s.missing = f"{run.path} has no teacher-forced layer checks for any case"
    else:
        s.done = True
        n = sum(len([r for r in c.get("results", []) if r.get("mode") in LAYER_MODES]) for c in doc["cases"]
                if c["name"] in checked)
        s.evidence = (f"{run.path} ({doc.get('mode')} on {doc.get('device')}, {doc.get('tolerances')} tolerances): "
                      f"{n} teacher-forced layer checks pass over {len(checked)} cases ({', '.join(checked)})")
    return s


def cannot_run_yet(goldens: dict) -> dict[str, str]:
    """Case (or, where the goldens have no case of it, required kind) -> why no validate run can
    pass it yet: the goldens hold no values for it (the executor lacks what it needs), or there is
    no golden case of a kind the stage requires."""
    cases = [c for c in goldens.get("cases", []) if isinstance(c, dict)]
    out = {c.get("name", "?"): c.get("reason") or "the goldens hold no values for it"
           for c in cases if c.get("status") != "ok"}
    kinds = {c.get("kind") for c in cases}
    out.update({k: f"the goldens have no {k} case" for k in REQUIRED_CASE_KINDS if k not in kinds})
    return out


def _end_to_end(bundle, goldens, run, why) -> Stage:
    s, doc = _signoff_checks(bundle, goldens, run, why, "end_to_end", "end-to-end cases")
    blocked = cannot_run_yet(goldens) if goldens is not None else {}
    if blocked:  # said first: no command can close these, so the next step names the rest only
        up_front = "cannot run yet: " + "; ".join(f"{n} ({r})" for n, r in blocked.items())
        s.missing = up_front + (f"; {s.missing}" if s.missing else "")
    if doc is None:
        return s
    by_kind: dict[str, list[dict]] = {}
    for c in doc["cases"]:
        by_kind.setdefault(c.get("kind", ""), []).append(c)
    gaps = []
    for kind in REQUIRED_CASE_KINDS:
        cases = by_kind.get(kind, [])
        if not cases and kind not in blocked:
            gaps.append(f"{kind}: no case")
        for c in cases:
            if c["name"] in blocked:
                continue
            if c.get("status") == "not run":
                gaps.append(f"{c['name']}: not run ({c.get('reason', '')})")
            elif c.get("status") != "pass":
                ff = (c.get("first_failure") or {}).get("line", "")
                gaps.append(f"{c['name']}: {str(c.get('status')).upper()}" + (f" ({ff})" if ff else ""))
    passed = [c["name"] for c in doc["cases"] if c.get("status") == "pass"]
    if gaps or blocked:
        s.missing = "; ".join(([up_front] if blocked else []) + gaps)
    else:
        s.done = True
    if blocked and not gaps:
        s.next = ""  # every case that can run passes: nothing to run until k3bundle runs the rest
        s.missing += "; every other case passes, so no command can close this stage yet"
    s.evidence = (f"{run.path}: {len(passed)} of {len(doc['cases'])} cases pass ({', '.join(passed) or 'none'})")
    return s


def _evidence_file(s: Stage, bundle: Path | None, rel: str, kind: str) -> dict | None:
    """The evidence document of an open stage, or None with ``s.missing`` saying why."""
    if bundle is None:
        s.missing = "no bundle given (--bundle)"
        return None
    doc, why = read_evidence(bundle, rel, kind)
    if doc is None:
        s.missing = why
    return doc


def _performance(bundle: Path | None, bounds: Callable[[int, int], tuple[float, float]]) -> Stage:
    s = Stage("performance", "performance", False,
              next=f"measure TPOT and TTFT on the target; write {PERFORMANCE_REPORT} (docs/bring-up.md)")
    doc = _evidence_file(s, bundle, PERFORMANCE_REPORT, PERFORMANCE_KIND)
    if doc is None:
        return s
    runs = doc.get("runs") or []
    problems, lines = [], []
    for i, r in enumerate(runs):
        try:
            b, n, tpot, ttft = int(r["batch"]), int(r["context"]), float(r["tpot_s"]), float(r["ttft_s"])
            # optional: the batch TTFT's bound is taken at (k3bundle perf: 1, a request's own prefill)
            tb = int(r.get("ttft_batch", b))
        except (KeyError, TypeError, ValueError, AttributeError):
            problems.append(f"run {i}: needs batch, context, tpot_s and ttft_s")
            continue
        if b < 1 or n < 1 or not 1 <= tb <= b:
            problems.append(f"run {i}: batch and context must be ≥ 1 and ttft_batch in 1..batch")
            continue
        lo_tpot, lo_ttft = bounds(b, n)[0], bounds(tb, n)[1]
        if tpot < lo_tpot or ttft < lo_ttft:
            problems.append(f"run {i} (batch {b}, context {n:,}) is faster than the roofline lower bound "
                            f"(TPOT {tpot:.4g} s vs ≥ {lo_tpot:.4g} s, TTFT {ttft:.4g} s vs ≥ {lo_ttft:.4g} s): "
                            "check the measurement")
            continue
        what = f" ({r['workload']})" if isinstance(r.get("workload"), str) else ""
        lines.append(f"batch {b}, context {n:,}{what}: TPOT {tpot * 1e3:.3f} ms ({lo_tpot / tpot:.0%} of roofline), "
                     f"TTFT {ttft:.3f} s ({lo_ttft / ttft:.0%} of roofline)")
    if not runs:
        problems.append(f"{PERFORMANCE_REPORT} lists no runs")
    s.notes = lines
    if problems:
        s.missing = "; ".join(problems)
    else:
        s.done = True
        s.evidence = f"{PERFORMANCE_REPORT}: {len(runs)} measured run(s), each at or above its lower bound"
    return s


def fault_paths_stage(bundle: Path | None) -> Stage:
    """The fault-paths stage from ``reports/faults.json`` alone."""
    s = Stage("fault_paths", "fault paths", False,
              next=f"inject each fault, record the outcome in {FAULTS_REPORT}, re-validate (docs/bring-up.md; "
                   "`k3bundle faults --endpoint URL --out BUNDLE/reports` runs the endpoint's own)")
    doc = _evidence_file(s, bundle, FAULTS_REPORT, FAULTS_KIND)
    if doc is None:
        return s
    got = {e.get("fault"): e for e in doc.get("faults") or [] if isinstance(e, dict)}
    gaps = []
    for f in F.FAULT_PATHS:
        e = got.get(f.key)
        if e is None:
            gaps.append(f"{f.key}: not injected")
        elif e.get("outcome") != "clean_error":
            gaps.append(f"{f.key}: outcome {e.get('outcome')!r}, not 'clean_error'")
        elif not e.get("error"):
            gaps.append(f"{f.key}: no error message recorded")
        elif e.get("revalidated") is not True:
            gaps.append(f"{f.key}: not re-validated after the fault")
        else:
            s.notes.append(f"{f.key}: clean error — {e['error']}")
    # faults beyond the four (``k3bundle faults``: over_context, client_disconnect, ...): each that
    # was run must have ended cleanly and been re-validated; a failure recorded is never ignored
    for key, e in got.items():
        if key in {f.key for f in F.FAULT_PATHS} or e.get("outcome") == "not_run":
            continue
        if e.get("outcome") not in ("clean_error", "survived", "detected") or e.get("revalidated") is not True:
            gaps.append(f"{key}: outcome {e.get('outcome')!r}, re-validated {e.get('revalidated')!r}"
                        + (f" ({e['error']})" if e.get("error") else ""))
        else:
            s.notes.append(f"{key}: {e['outcome'].replace('_', ' ')}" + (f" — {e['error']}" if e.get("error") else ""))
    if gaps:
        s.missing = "; ".join(gaps)
    else:
        s.done = True
        s.evidence = f"{FAULTS_REPORT}: all {len(F.FAULT_PATHS)} faults end in a clear error and pass re-validation"
    return s


def soak_stage(bundle: Path | None) -> Stage:
    """The soak stage from ``reports/soak.json`` alone."""
    s = Stage("soak", "soak", False, next=f"run the soak (`k3bundle soak --endpoint URL --hours 24 --out BUNDLE/reports`) "
                                            f"and write {SOAK_REPORT} (docs/bring-up.md)")
    doc = _evidence_file(s, bundle, SOAK_REPORT, SOAK_KIND)
    if doc is None:
        return s
    gaps = []
    hours = doc.get("hours")
    host, dev = doc.get("host_memory_growth_bytes"), doc.get("device_memory_growth_bytes")
    checks, failures, hangs = doc.get("golden_rechecks"), doc.get("golden_recheck_failures"), doc.get("hangs")
    if not isinstance(hours, (int, float)) or hours < F.SOAK_MIN_HOURS:
        gaps.append(f"ran {hours:.3g} h, needs ≥ {F.SOAK_MIN_HOURS} h" if isinstance(hours, (int, float))
                    else f"ran {hours} h, needs ≥ {F.SOAK_MIN_HOURS} h")
    for what, grew, limit in (("host", host, F.SOAK_HOST_GROWTH_LIMIT_BYTES), ("device", dev, F.SOAK_DEVICE_GROWTH_LIMIT_BYTES)):
        if grew is None:
            gaps.append(f"{what} memory growth not measured")
        elif not isinstance(grew, int) or grew > limit:
            gaps.append(f"{what} memory grew {grew} B (limit {limit:,} B): leak")
    if checks is None:
        gaps.append("golden re-checks not run (needs ≥ 1, all passing)")
    elif not isinstance(checks, int) or checks < 1 or failures != 0:
        gaps.append(f"golden re-checks: {checks} run, {failures} failed (needs ≥ 1 and 0 failed)")
    if hangs != 0:
        gaps.append(f"{hangs} hang(s) recorded (needs 0)")
    # the format's extensions (``k3bundle soak``): an interrupted run or a named failure never ticks
    if doc.get("complete") is False:
        gaps.append("the soak was interrupted (complete: false)")
    named = [f for f in doc.get("failures") or [] if isinstance(f, dict)]
    if named:
        gaps.append(f"{len(named)} failure(s) recorded, first: {named[0].get('kind')} in {named[0].get('request')}: "
                    f"{named[0].get('detail')}")
    if gaps:
        s.missing = "; ".join(gaps)
    else:
        s.done = True
        s.evidence = (f"{SOAK_REPORT}: {hours} h, host +{host:,} B, device +{dev:,} B, {checks} golden re-checks pass, "
                      "no hang")
    return s


def evaluate_stages(target: str, capacity_passed: bool, capacity_verdict: str, bundle: Path | None,
                    bounds: Callable[[int, int], tuple[float, float]], verify_fn: Callable,
                    signoff: SignoffRun | None = None, signoff_why: str = "") -> list[Stage]:
    """Every stage in sign-off order.

    Args:
        bounds: ``(batch, context) -> (TPOT, TTFT)`` lower bounds, for the performance evidence.
        verify_fn: ``bundle -> VerifyReport`` (``k3bundle.provenance.verify.verify``).
        signoff: the validate run whose sign-off the numerics stages read (``choose_run``); None:
            ``signoff_why`` says why there is none.
    """
    cap = Stage("capacity", "capacity", capacity_passed,
                evidence=capacity_verdict if capacity_passed else "",
                missing="" if capacity_passed else capacity_verdict,
                next="" if capacity_passed else
                "change the layout (cards, degrees, formats, reserve) or the batch/context")
    goldens, gwhy = read_goldens(bundle) if bundle is not None else (None, "")
    stages = [cap, _conversion(bundle, target, verify_fn), _golden(bundle, goldens, gwhy),
              _layer_numerics(bundle, goldens, signoff, signoff_why),
              _end_to_end(bundle, goldens, signoff, signoff_why),
              _performance(bundle, bounds), fault_paths_stage(bundle), soak_stage(bundle)]
    open_ = [s.title for s in stages if not s.done]
    sign = Stage("signoff", "sign-off", not open_,
                 evidence="every stage above is ticked from evidence" if not open_ else "",
                 missing=("open: " + ", ".join(open_)) if open_ else "")
    return stages + [sign]
