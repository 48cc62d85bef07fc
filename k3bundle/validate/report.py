"""The sign-off report: ``signoff.json`` (machines), ``.md`` (people), ``.html`` (plots), in the
bundle's ``reports/validate/RUN_KEY/`` (``bundle.signoff_runs``) or a folder of the user's (``--out``).

Every failure line names the case, mode, tap, metric values and limits, Polygraphy-style; each
case names its first failing layer and tap, and lists its failures teacher-forced first
(``findings``). The HTML page is ``html.to_html``.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from k3bundle import __version__
from k3bundle.bundle.signoff import SIGNOFF_SCHEMA_VERSION, write_run_marker
from k3bundle.bundle.signoff_runs import run_key, write_latest
from k3bundle.file_names import REPORTS_DIR, SIGNOFF_LATEST, SIGNOFF_NAMES, signoff_run_dir, validate_run_marker
from k3bundle.io.files import remove_temps_of, temp_path, write_atomic
from k3bundle.io.strict_json import nonfinite_as_text
from k3bundle.validate.serving import NOT_RUN, SECTION_HEAD, SECTION_NOTE, section_rows
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
                "serving": [p.as_dict() for p in c.serving],
            })
        cases.append(d)
    return nonfinite_as_text({  # "nan" / "inf" as text: the sign-off stays JSON the strict reader takes
            "schema_version": SIGNOFF_SCHEMA_VERSION, "k3bundle_version": __version__, "bundle": rep.bundle,
            "mode": rep.mode, "device": rep.device, "backend": rep.backend, "kernels": rep.kernels,
            "tolerances": rep.tolerances.name,
            **rep.binding, "run_id": rep.run_id,  # what was judged: the checklist ticks only while it is the bundle's now
            "run": rep.run,  # its run key, when, and the options that say what ran (bundle.signoff_runs)
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
    lines += serving_section(rep)
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


def serving_section(rep) -> list[str]:
    """The serving paths (``validate --serving``): each against the uninterrupted run."""
    rows = section_rows(rep)
    out = ["", "## Serving paths", ""]
    if not rows:
        return out + [NOT_RUN]
    out += [SECTION_NOTE, "", "| " + " | ".join(SECTION_HEAD) + " |", "|" + "---|" * len(SECTION_HEAD)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


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


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass(frozen=True)
class Run:
    """A validate run: its key (what it validates), id, start, and where its reports go."""

    key: str
    run_id: str
    started: str
    reports: Path
    own: bool  # the bundle's own reports/validate/KEY: its run marker and latest.json are written
    options: dict  # device, ranks, backend, dumps: what ran, as the sign-off records it


def start_run(bundle: str | Path, out: str | Path | None = None, device: str = "cpu", ranks: str = "merged",
              backend: str | None = None, dumps: str | Path | None = None) -> Run:
    """Before a run judges anything: where its reports go — the bundle's ``reports/validate/KEY``
    (``out`` None or the bundle's ``reports/``), else ``out`` itself — with an earlier run's reports
    there removed (``remove_reports``); for the bundle's own, the run named in its key's run marker
    first. Where either cannot be done, a one-line error (exit 2) before any work; the marker, when
    written, already keeps the earlier reports of this key from ticking
    (``bundle.signoff.stale_because``)."""
    key, run_id, started = run_key(device, ranks, backend, dumps), secrets.token_hex(8), _now()
    own = out is None or Path(out).resolve() == (Path(bundle) / REPORTS_DIR).resolve()
    out_dir = Path(bundle) / signoff_run_dir(key) if own else Path(out)
    if own:
        try:
            write_run_marker(bundle, key, run_id, started)
        except OSError as e:
            raise ValidateError(f"{Path(bundle) / validate_run_marker(key)}: cannot write the run marker: "
                                f"{e.strerror or e}; make the bundle's validation/ folder writable, or write the "
                                "reports elsewhere (--out)") from None
    try:
        remove_reports(out_dir)
    except OSError as e:
        raise ValidateError(f"{out_dir}: cannot remove the earlier reports: {e.strerror or e}; make the folder "
                            "writable (or choose another --out) and rerun") from None
    probe_dir = next((p for p in (out_dir, *out_dir.parents) if p.exists()), None)
    if probe_dir is not None and probe_dir.is_dir() and not probe_dir.is_symlink():
        probe = temp_path(probe_dir / SIGNOFF_NAMES[0])  # a run whose verdict cannot be written is not begun
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            os.unlink(probe)
        except OSError as e:
            raise ValidateError(f"{out_dir}: cannot write the reports: {e.strerror or e}; make the folder "
                                "writable (or choose another --out) and rerun") from None
    options = {"device": device, "ranks": ranks, "backend": backend,
               "dumps": None if dumps is None else str(Path(os.path.abspath(dumps)))}
    return Run(key, run_id, started, out_dir, own, options)


def publish_reports(rep, run: Run, bundle: str | Path) -> list[Path]:
    """Record ``run`` in ``rep``, write its reports (``write_reports``) and, for the bundle's own,
    name it the latest (``reports/validate/latest.json``, after the reports)."""
    finished = _now()
    rep.run_id = run.run_id
    rep.run = {"key": run.key, "started": run.started, "finished": finished, **run.options}
    files = write_reports(rep, run.reports)
    if run.own:
        try:
            write_latest(bundle, run.key, run.run_id, finished)
        except OSError as e:
            discard_reports(run.reports)
            raise ValidateError(f"{Path(bundle) / SIGNOFF_LATEST}: cannot write: {e.strerror or e}") from None
    return files


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
