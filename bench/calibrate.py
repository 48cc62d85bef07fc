"""Calibrate validate's limits: every check's metric on many clean and faulted bundles.

The harness is ``k3bundle.calibrate`` (``k3bundle calibrate`` runs one device's calibration and
writes its tolerance file); this script keeps the commands of the committed runs:

    # record (one JSON line per case run) — seeds 0-9 set the limits, seeds 100+ measure rates
    python bench/calibrate.py run --out /tmp/cal --preset tiny:0-9 --preset tiny-trained:0-9 \\
        --layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8 --device cpu --workers 2
    # the separation table and the limits it implies (Markdown; --json for data)
    python bench/calibrate.py table /tmp/cal/records.jsonl --seeds 0-9
    # false-alarm and detection rates on held-out seeds, against the shipped tolerance files
    python bench/calibrate.py rates /tmp/cal/records.jsonl --seeds 100-149
    # the clean runs per preset and layout as a Markdown table (docs/validation.md's counts)
    python bench/calibrate.py count tolerances/calibration/clean-*.jsonl.gz
    # each limit of a tolerance file between the clean worst and the faulted best; --write
    # records the clean worst in the file's calibration section (the sign-off report shows it)
    python bench/calibrate.py limits /tmp/cal/records.jsonl --seeds 0-9 --tolerance bf16 [--write --run TEXT]

Jobs, faults and records: ``k3bundle/calibrate/`` (docs/validation.md "Calibration").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3bundle.calibrate.faults import FAULTS  # noqa: E402
from k3bundle.calibrate.jobs import make_jobs, run_jobs  # noqa: E402
from k3bundle.calibrate.records import load_records, parse_seeds  # noqa: E402
from k3bundle.calibrate.tables import clean_counts, limit_rows, rates, separation  # noqa: E402
from k3bundle.calibrate.tolerance_file import calibration_yaml  # noqa: E402
from k3bundle.calibrate.tolerance_for import TOLERANCE_FOR  # noqa: E402
from k3bundle.validate.margin import show  # noqa: E402


def cmd_run(args) -> None:
    presets = [(p, parse_seeds(s or "0")) for p, _, s in (spec.partition(":") for spec in args.preset)]
    jobs = make_jobs(args.out, presets, args.layout, args.device, [] if args.no_faults else args.fault or list(FAULTS),
                     clean=not args.faults_only, long_tokens=args.long_tokens, threads=args.threads,
                     golden_device=args.golden_device)
    run_jobs(jobs, args.out, args.workers, progress=lambda s: print(s, flush=True))


def _records(args) -> list[dict]:
    return load_records(args.records, parse_seeds(args.seeds) if args.seeds else None)


def cmd_table(args) -> None:
    table = separation(_records(args))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1, sort_keys=True))
    print("| check (mode/tap kind/metric) | clean runs | clean worst | set by | faulted best (located there) | margin |")
    print("|---|---|---|---|---|---|")
    for key in sorted(table):
        t = table[key]
        cw, fb = t["clean_worst"], t["fault_best"]
        if cw is None:
            continue
        if fb is None:
            margin = "–"
        elif t["direction"] == "max":
            margin = f"{fb / cw:.3g}×" if cw > 0 else "∞"
        else:
            margin = f"{(1 - fb) / (1 - cw):.3g}×" if cw < 1 else "∞"
        fbs = "–" if fb is None else f"{fb:.3g} ({t['fault_by']})"
        print(f"| {key} | {t['clean_n']} | {cw:.3g} | {t['clean_by']} | {fbs} | {margin} |")


def cmd_rates(args) -> None:
    recs = _records(args)
    out = {device: rates([r for r in recs if r["device"] == device]) for device in sorted({r["device"] for r in recs})}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def _seed_ranges(seeds: list[int]) -> str:
    runs, start = [], None
    for i, s in enumerate(seeds):
        start = s if start is None else start
        if i + 1 == len(seeds) or seeds[i + 1] != s + 1:
            runs.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return ", ".join(runs)


def cmd_count(args) -> None:
    rows = clean_counts(_records(args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("| preset | layout | device | seeds | clean bundles failing | clean cases failing | jobs in error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['layout']} | {r['device']} | {_seed_ranges(r['seeds'])} | "
              f"{r['failed_bundles']} / {r['bundles']} | {r['failed_cases']} / {r['cases']} | {r['errors']} |")
    total = lambda k: sum(r[k] for r in rows)  # noqa: E731
    print(f"| **all** | | | | **{total('failed_bundles')} / {total('bundles')}** | "
          f"{total('failed_cases')} / {total('cases')} | {total('errors')} |")


def cmd_limits(args) -> None:
    from k3bundle.golden.tolerances import load_tolerances, tolerance_path
    recs = _records(args)
    path = tolerance_path(args.tolerance)
    layouts = [k for k, v in TOLERANCE_FOR.items() if v == path.stem]
    table = separation([r for r in recs if r["layout"] in layouts])
    tol = load_tolerances(path)
    print(f"{path} (layouts {', '.join(layouts)}; {len(recs)} records)\n")
    print("| check | limit | calibrated clean worst | limit / clean (safety) | faulted best | fault / limit | |")
    print("|---|---|---|---|---|---|---|")
    for r in limit_rows(table, tol):
        m = r["key"].rsplit("/", 1)[1]
        fb = "–" if r["fault_best"] is None else f"{show(m, r['fault_best'])} ({r['fault_by']})"
        hr = "–" if r["headroom"] is None else f"{r['headroom']:.3g}×"
        print(f"| {r['key']} | {show(m, r['limit'])} | {show(m, r['clean_worst'])} ({r['clean_by']}) | {r['safety']:.3g}× | "
              f"{fb} | {hr} | {'between' if r['between'] else 'floor, widened per golden' if r['floor'] else '**not between**'} |")
    if args.write:
        text = path.read_text()
        head = text.split("\ncalibration:", 1)[0].rstrip("\n") + "\n"
        path.write_text(head + calibration_yaml(table, args.run or "see tolerances/calibration/"))
        load_tolerances(path)  # what was written reads back
        print(f"\nwrote the calibration section of {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--preset", action="append", required=True, help="PRESET:SEEDS, e.g. tiny:0-9")
    r.add_argument("--layout", action="append", required=True)
    r.add_argument("--device", default="cpu")
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    r.add_argument("--long-tokens", type=int, default=512)
    r.add_argument("--golden-device", default="cpu",
                   help="where the float32 goldens are made (cuda: for presets too slow for one CPU core)")
    r.add_argument("--no-faults", action="store_true")
    r.add_argument("--faults-only", action="store_true")
    r.add_argument("--fault", action="append", choices=list(FAULTS), help="only these faults (default: all)")
    r.set_defaults(fn=cmd_run)
    for name, fn in (("table", cmd_table), ("rates", cmd_rates), ("count", cmd_count)):
        t = sub.add_parser(name)
        t.add_argument("records", type=Path, nargs="+")
        t.add_argument("--seeds")
        t.add_argument("--json")
        t.set_defaults(fn=fn)
    lim = sub.add_parser("limits", help="each limit of a tolerance file against the calibrated clean worst and "
                                        "faulted best; --write records the clean worst in the file")
    lim.add_argument("records", type=Path, nargs="+")
    lim.add_argument("--tolerance", required=True, help="bf16, fp8 or a file")
    lim.add_argument("--seeds")
    lim.add_argument("--write", action="store_true")
    lim.add_argument("--run", help="the citation written into the file (seeds, presets, devices, date)")
    lim.set_defaults(fn=cmd_limits)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
