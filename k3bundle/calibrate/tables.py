"""What records say: per check, the clean worst against the least severe located fault
(``separation``); false-alarm and detection rates (``rates``), also per preset and layout
(``clean_counts``); a tolerance file's limits between the two (``limit_rows``)."""

from __future__ import annotations

from k3bundle.calibrate.records import worse
from k3bundle.golden.tolerances import METRICS, Tolerances
from k3bundle.validate.margin import check_key, ratio

EXACT_MODES = ("exact", "exact_gpu")  # the exact check's tolerance sections (validate.devices)
GATED = ("nmse", "cosine", "kld_mean", "kld_p99", "top1", "expert_set", "drift_nmse")  # metrics with limits


def _job(r: dict) -> tuple:
    return r["preset"], r["seed"], r["layout"], r["device"]


def separation(records: list[dict]) -> dict[str, dict]:
    """Per check key: the clean worst (with the preset/device that set it) and, over faulted runs
    whose first failure is at the planted tap, the faulted best value of that check."""
    table: dict[str, dict] = {}
    for r in records:
        if r.get("status") in ("error", "n/a"):
            continue
        for key, v in r.get("checks", {}).items():
            metric = key.rsplit("/", 1)[1]
            t = table.setdefault(key, {"direction": METRICS.get(metric, "max"), "clean_worst": None,
                                       "clean_by": None, "clean_n": 0, "fault_best": None, "fault_by": None})
            if r["fault"] is None:
                t["clean_n"] += 1
                if worse(metric, v, t["clean_worst"]):
                    t["clean_worst"], t["clean_by"] = v, f"{r['preset']}:{r['seed']} {r['layout']} {r['device']} {r['case']}"
    for r in records:  # faulted runs located at the planted tap: every check's value there
        if r["fault"] is None or r.get("status") != "fail" or not r.get("first_failure"):
            continue
        if r["first_failure"]["tap"] != r["planted"]["tap"]:
            continue
        exact_only = r["first_failure"].get("mode") in EXACT_MODES
        for mode, tap, values in r.get("taps", []):
            # a fault only the exact check sees is below the device-precision checks' reach: it
            # says nothing about where their limits separate clean from faulted
            if tap != r["planted"]["tap"] or (exact_only and mode not in EXACT_MODES):
                continue
            for metric, v in values.items():
                t = table.get(check_key(mode, tap, metric))
                if t is None or metric not in METRICS:
                    continue
                if t["fault_best"] is None or worse(metric, t["fault_best"], v):  # the least severe
                    t["fault_best"], t["fault_by"] = v, f"{r['fault']} {r['preset']}:{r['seed']} {r['layout']}"
    return table


def is_located(r: dict) -> bool:
    """A faulted record whose first failure names the planted layer and tap (a refusal names the
    tensor, so its layer)."""
    ff = r.get("first_failure")
    if r.get("status") not in ("fail", "refused") or not ff:
        return False
    return ff["layer"] == r["planted"]["layer"] and ff["tap"] in (r["planted"]["tap"],
                                                                 None if r["status"] == "refused" else "")


def rates(records: list[dict]) -> dict:
    """Clean false alarms (per case and per bundle) and, per fault, runs / detected / located."""
    clean = [r for r in records if r["fault"] is None and r.get("status") in ("pass", "fail")]
    faulted = [r for r in records if r["fault"] is not None and r.get("status") in ("pass", "fail", "refused")]
    bundles = {_job(r) for r in clean}
    failed_bundles = {_job(r) for r in clean if r["status"] == "fail"}
    by_fault: dict[str, list[int]] = {}
    for r in faulted:
        d = by_fault.setdefault(r["fault"], [0, 0, 0])
        d[0] += 1
        d[1] += r["status"] in ("fail", "refused")
        d[2] += is_located(r)
    ratios = [r["added_noise_ratio"] for r in clean if r.get("added_noise_ratio") is not None]
    return {"clean_cases": len(clean), "clean_case_failures": sum(r["status"] == "fail" for r in clean),
            "added_noise_ratio_worst": max(ratios, default=None),
            "clean_bundles": len(bundles), "clean_bundle_failures": len(failed_bundles),
            "false_alarms": [f"{r['preset']}:{r['seed']} {r['layout']} {r['device']} {r['case']}: "
                             f"{(r.get('first_failure') or {}).get('tap')} {r.get('reason', '')}"
                             for r in clean if r["status"] == "fail"],
            "faults": {k: {"runs": v[0], "detected": v[1], "located": v[2]} for k, v in by_fault.items()}}


def clean_counts(records: list[dict]) -> list[dict]:
    """The clean runs per (preset, layout, device): seeds, bundles and cases run and failing,
    and jobs that ended in an error (counted apart: an error judged nothing). Sorted by key."""
    groups: dict[tuple, dict] = {}
    for r in records:
        if r["fault"] is not None:
            continue
        g = groups.setdefault((r["preset"], r["layout"], r["device"]),
                              {"seeds": set(), "bundles": set(), "failed_bundles": set(), "cases": 0,
                               "failed_cases": 0, "errors": set()})
        if r.get("status") == "error":
            g["errors"].add(_job(r))
        elif r.get("status") in ("pass", "fail"):
            g["seeds"].add(r["seed"])
            g["bundles"].add(_job(r))
            g["cases"] += 1
            if r["status"] == "fail":
                g["failed_cases"] += 1
                g["failed_bundles"].add(_job(r))
    return [{"preset": p, "layout": l, "device": d, "seeds": sorted(g["seeds"]), "bundles": len(g["bundles"]),
             "failed_bundles": len(g["failed_bundles"]), "cases": g["cases"], "failed_cases": g["failed_cases"],
             "errors": len(g["errors"] - g["bundles"])}  # a job rerun after an error counts once, as judged
            for (p, l, d), g in sorted(groups.items())]


def limit_of(tol: Tolerances, key: str) -> float | None:
    """The tolerance file's (fixed) limit for a check key, None where it has none."""
    mode, kind, metric = key.split("/")
    if mode in ("added", "inherited", "emulation", *EXACT_MODES):
        return tol.limits(mode, kind).get(metric)
    section = {"distribution": tol.logits, "router": tol.router, "state": tol.state}.get(mode, {})
    return section.get(metric)


def is_floor(tol: Tolerances, key: str) -> bool:
    """A free-running limit is a floor: validate widens it per golden with the reference's own
    BF16 noise (golden/noise.py), so its evidence is the held-out false-alarm rate; so is an added
    one, with the reference's own teacher-forced BF16 noise."""
    mode = key.split("/")[0]
    return ((mode in ("inherited", "distribution", "state") and tol.noise.get("factor", 0) > 0)
            or (mode == "added" and tol.noise.get("added_factor", 0) > 0))


def limit_rows(table: dict, tol: Tolerances) -> list[dict]:
    """Per gated check: the limit against the calibrated clean worst and the faulted best."""
    rows = []
    for key in sorted(table):
        t, metric = table[key], key.rsplit("/", 1)[1]
        limit = limit_of(tol, key)
        if metric not in GATED or limit is None or t["clean_worst"] is None:
            continue
        cw, fb = t["clean_worst"], t["fault_best"]
        clean_ok = not worse(metric, cw, limit) and cw != limit
        fault_ok = fb is None or worse(metric, fb, limit)
        rows.append({"key": key, "limit": limit, "clean_worst": cw, "clean_by": t["clean_by"], "fault_best": fb,
                     "fault_by": t["fault_by"], "between": clean_ok and fault_ok, "floor": is_floor(tol, key),
                     "safety": ratio(metric, limit, cw), "headroom": None if fb is None else ratio(metric, fb, limit)})
    return rows
