"""The sign-off report: ``reports/signoff.json`` (machines), ``.md`` (people), ``.html`` (plots).

Every failure line names the case, mode, tap, metric values and limits, Polygraphy-style; each
case names its first failing layer and tap, and lists its failures teacher-forced first
(``findings``). The HTML page is ``html.to_html``.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from k3bundle import __version__
from k3bundle.bundle.signoff import SIGNOFF_SCHEMA_VERSION, write_run_marker
from k3bundle.file_names import REPORTS_DIR, SIGNOFF_NAMES, VALIDATE_RUN
from k3bundle.io.files import remove_temps_of, temp_path, write_atomic
from k3bundle.io.strict_json import nonfinite_as_text
from k3bundle.validate.errors import ValidateError
from k3bundle.validate.findings import failures, finding
from k3bundle.validate.html import tie_text, to_html
from k3bundle.validate.margin import NEAR, margins, show, show_use



def _result(r) -> dict:
    return {"tap": r.tap, "layer": r.layer, "mode": r.mode, "passed": r.passed,
            "values": r.values, "limits": r.limits, "limit_basis": r.basis, "min_required": r.min_required,
            "nonfinite": r.nonfinite}


def to_json(rep) -> dict:
    cases = []
    for c in rep.cases:
        d = {"name": c.name, "kind": c.kind, "status": c.status, "reason": c.reason,
             "layer_checks": c.layer_checks or "ran", "seconds": round(c.seconds, 2)}
        if c.status != "not run":
            ff = c.first_failure
            d.update({
                "first_failure": None if ff is None else {"layer": ff.layer, "tap": ff.tap, "mode": ff.mode,
                                                          "line": ff.line(), "ops": c.kernel_ops},
                "checks": len(c.results), "failed": sum(not r.passed for r in c.results),
                "greedy": None if c.greedy is None else c.greedy.__dict__,
                "state_drift_max": max((max(v) for v in c.drift.values() if v), default=0.0),
                "state_drift_limit": c.drift_limit,
                "state_drift_limits": c.drift_limits, "state_drift_basis": c.drift_basis,
                "kld_by_position": c.kld_by_position, "positions": c.positions,
                "results": [_result(r) for r in c.results],
                "margins": [m.as_dict() for m in margins(c, rep.tolerances)],
            })
        cases.append(d)
    return nonfinite_as_text({  # "nan" / "inf" as text: the sign-off stays JSON the strict reader takes
            "schema_version": SIGNOFF_SCHEMA_VERSION, "k3bundle_version": __version__, "bundle": rep.bundle,
            "mode": rep.mode, "device": rep.device, "backend": rep.backend, "kernels": rep.kernels,
            "tolerances": rep.tolerances.name,
            **rep.binding, "run_id": rep.run_id,  # what was judged: the checklist ticks only while it is the bundle's now
            "golden_content_hash": rep.golden_meta.get("content_hash"), "passed": rep.passed, "exact_check": rep.exact,
            "integrity": rep.integrity, "integrity_problems": rep.integrity_problems,
            "exit_code": rep.exit_code, "seconds": round(rep.seconds, 2), "cases": cases,
            "nonfinite": rep.nonfinite()})


def to_markdown(rep) -> str:
    verdict = "PASS" if rep.passed else "FAIL"
    lines = [f"# Sign-off: {verdict}", "",
             f"- bundle: `{rep.bundle}`", f"- device under test: {rep.mode} ({rep.device})",
             f"- tolerances: `{rep.tolerances.name}` ({rep.tolerances.path})",
             f"- goldens: content hash `{rep.golden_meta.get('content_hash', '?')[:16]}…`, "
             f"dtype {rep.golden_meta.get('dtype')}, k3bundle {rep.golden_meta.get('k3bundle_version')}",
             f"- k3bundle {__version__}, {rep.seconds:.1f} s",
             f"- limits calibrated: {rep.tolerances.calibration_run or 'no calibration recorded'}",
             f"- exact check (float32 on the goldens' own weights): {rep.exact or 'not run'}",
             f"- bundle files against the manifest: {rep.integrity or 'not checked'}", "",
             "| case | kind | status | checks failed | first failing layer / tap | greedy | state drift max | s |",
             "|---|---|---|---|---|---|---|---|"]
    for c in rep.cases:
        if c.status == "not run":
            lines.append(f"| {c.name} | {c.kind} | not run | – | {c.reason} | – | – | – |")
            continue
        ff = c.first_failure
        where = "–" if ff is None else finding(ff, c.kernel_ops, rep.kernels, _md_code)
        g = c.greedy
        greedy = "–" if g is None else (f"{g.matched}/{g.total} equal" + ("" if g.first_divergence is None
                                        else f", first divergence at step {g.first_divergence}"
                                        + " " + tie_text(g)))
        drift, drift_limit = c.drift_worst
        failed = sum(not r.passed for r in c.results)
        lines.append(f"| {c.name} | {c.kind} | {c.status.upper()} | {failed}/{len(c.results)} | {where} | "
                     f"{greedy} | {drift:.2e} (limit {drift_limit:.1e}) | {c.seconds:.1f} |")
    lines += ["", "## Non-finite values", ""]
    found = rep.nonfinite()
    lines += [f"- {f['case']} ({f['mode']}): {f['text']}" for f in found[:40]] or \
        ["none: every compared value was finite on both sides"]
    if len(found) > 40:
        lines.append(f"- … and {len(found) - 40} more (signoff.json has all)")
    for c in rep.cases:
        bad = failures(c.results)  # the ones that locate the fault first
        near = margins(c, rep.tolerances) if c.status != "not run" else []
        if bad or c.layer_checks or near:
            lines += ["", f"## {c.name}", ""]
            if c.layer_checks:
                lines.append(f"- teacher-forced layer checks skipped: {c.layer_checks}")
            lines += [f"    {r.line()}" for r in bad[:40]]
            if len(bad) > 40:
                lines.append(f"    … and {len(bad) - 40} more failing checks (signoff.json has all)")
            if near:
                lines += margin_table(near[:20])
                if len(near) > 20:
                    lines.append(f"… and {len(near) - 20} more (signoff.json has all)")
    return "\n".join(lines) + "\n"


def _md_code(text: str) -> str:
    return f"`{text}`"


def margin_table(rows) -> list[str]:
    """Checks at or over NEAR of their limit: how far from the limit and from the calibrated clean worst."""
    out = ["", f"Checks at {NEAR:.0%} of their limit or beyond (use of the limit; the worst clean value in "
           "the calibration run; this value relative to it, > 1× is worse than any clean bundle seen):", "",
           "| check | tap | value | limit | limit from | use of limit | calibrated clean worst | × clean worst |",
           "|---|---|---|---|---|---|---|---|"]
    for m in rows:
        cw = "–" if m.clean_worst is None else show(m.metric, m.clean_worst)
        bc = "–" if m.beyond_clean is None else f"{m.beyond_clean:.3g}×"
        out.append(f"| {m.mode} {m.metric} | `{m.tap}` | {show(m.metric, m.value)} | {show(m.metric, m.limit)} | "
                   f"{m.limit_from} | {show_use(m.use)} | {cw} | {bc} |")
    return out


def remove_reports(out_dir: str | Path) -> None:
    """Remove an earlier run's reports (and a killed run's temp files): a run that could not be
    judged must not leave them in place. Where the folder forbids removing them (read-only,
    immutable) each is emptied in place instead; an ``OSError`` when neither can be done."""
    out = Path(out_dir)
    if out.is_dir() and not out.is_symlink():
        remove_temps_of(out, SIGNOFF_NAMES)
        for name in SIGNOFF_NAMES:
            p = out / name
            if p.is_file() or p.is_symlink():
                _remove_or_empty(p)


def discard_reports(out_dir: str | Path) -> None:
    """``remove_reports`` on a path that is already failing: what cannot be removed stays, and the
    run's own error is the one reported (the run marker keeps what stays from ticking)."""
    try:
        remove_reports(out_dir)
    except OSError:
        pass


def _remove_or_empty(p: Path) -> None:
    try:
        p.unlink()
    except PermissionError:  # the folder cannot change; the file itself may: no old verdict stays readable
        if p.is_symlink():
            raise
        os.close(os.open(p, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK))


def start_run(bundle: str | Path, out_dir: str | Path) -> str:
    """Before a run judges anything: remove an earlier run's reports (``remove_reports``) and, where
    the reports are the bundle's own (``reports/``, the ones the checklist ticks from), name the run
    in the bundle's run marker first; the run's id, which its sign-off records. Where either cannot
    be done, a one-line error (exit 2) before any work; the marker, when written, already keeps the
    earlier reports from ticking (``bundle.signoff.stale_because``)."""
    run_id = secrets.token_hex(8)
    if Path(out_dir).resolve() == (Path(bundle) / REPORTS_DIR).resolve():
        try:
            write_run_marker(bundle, run_id, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        except OSError as e:
            raise ValidateError(f"{Path(bundle) / VALIDATE_RUN}: cannot write the run marker: {e.strerror or e}; "
                                "make the bundle's validation/ folder writable, or write the reports elsewhere "
                                "(--out)") from None
    try:
        remove_reports(out_dir)
    except OSError as e:
        raise ValidateError(f"{out_dir}: cannot remove the earlier reports: {e.strerror or e}; make the folder "
                            "writable (or choose another --out) and rerun") from None
    if Path(out_dir).is_dir() and not Path(out_dir).is_symlink():
        probe = temp_path(Path(out_dir) / SIGNOFF_NAMES[0])  # a run whose verdict cannot be written is not begun
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            os.unlink(probe)
        except OSError as e:
            raise ValidateError(f"{out_dir}: cannot write the reports: {e.strerror or e}; make the folder "
                                "writable (or choose another --out) and rerun") from None
    return run_id


def write_reports(rep, out_dir: str | Path) -> list[Path]:
    """Write the three reports (each atomically). Never through a link; on a failure (a full disk)
    none of them is left, so an old report cannot pass for this run's."""
    out = Path(out_dir)
    if out.is_symlink():
        raise ValidateError(f"{out}: is a symbolic link; reports are never written through links")
    files = dict(zip(SIGNOFF_NAMES, ((json.dumps(to_json(rep), indent=2, sort_keys=True) + "\n").encode(),
                                     to_markdown(rep).encode(), to_html(rep).encode())))
    try:
        out.mkdir(parents=True, exist_ok=True)
        remove_reports(out)
        for name, data in files.items():
            write_atomic(out / name, data)
    except OSError as e:
        discard_reports(out)
        raise ValidateError(f"{out}: cannot write the reports: {e.strerror or e}") from None
    return [out / n for n in files]
