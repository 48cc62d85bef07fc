"""``k3bundle calibrate``: clean seeds and the fault catalogue on one device (and kernel backend)
-> records and a calibrated tolerance file (``tolerance_file``), usable as ``validate
--tolerances FILE``. Bad input is refused before any job runs; a job that fails ends the run
with its reason and no tolerance file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3bundle.calibrate.errors import CalibrateError
from k3bundle.calibrate.faults import FAULTS, fault
from k3bundle.calibrate.jobs import RECORDS, make_jobs, run_jobs
from k3bundle.calibrate.records import JOB_KEYS, load_records, parse_seeds
from k3bundle.calibrate.tables import is_located, rates, separation
from k3bundle.calibrate.tolerance_file import write_calibrated
from k3bundle.calibrate.tolerance_for import tolerance_for

TOLERANCE_FILE = "tolerances.yaml"  # the calibrated file, in the output folder beside the records


@dataclass
class Calibration:
    records: Path
    tolerance_file: Path
    rates: dict
    widened: dict[str, tuple[float, float]]
    not_separated: list[str]
    not_located: dict[str, str] = field(default_factory=dict)  # fault -> the first failure its runs got instead

    @property
    def exit_code(self) -> int:
        """0: every fault located and every check separates clean from faulted; 1: not so."""
        return 1 if self.not_located or self.not_separated else 0


def parse_presets(specs: list[str]) -> list[tuple[str, list[int]]]:
    """``PRESET[:SEEDS]`` (``tiny:0-4``, ``tiny-trained:0,3``) -> [(preset, seeds)]."""
    from k3bundle.presets import preset_names

    out = []
    for spec in specs:
        name, _, seeds = spec.partition(":")
        if name not in preset_names():
            raise CalibrateError(f"--preset {spec}: no preset {name!r}; known: {', '.join(preset_names())}")
        try:
            out.append((name, parse_seeds(seeds or "0")))
        except ValueError:
            raise CalibrateError(f"--preset {spec}: seeds must be N, N-M or a comma list of them, got {seeds!r}") from None
    return out


def check_device(device: str, backend: str | None) -> None:
    """The device exists here, and the backend loads and accepts it."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise CalibrateError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CalibrateError(f"--device {device}: no CUDA device on this machine")
    if backend is not None:
        from k3bundle.kernels.backend import load, print_warnings

        kern = load(backend)
        print_warnings(kern)
        kern.setup(device)


def calibrate(out: Path, presets: list[str], layouts: list[str], device: str = "cpu", backend: str | None = None,
              faults: list[str] | None = None, tolerances: str | None = None, long_tokens: int = 512,
              cases: Path | None = None, workers: int = 1, threads: int = 2, golden_device: str = "cpu",
              run: str | None = None, progress: Callable[[str], None] = print) -> Calibration:
    """Run the jobs ``out/records.jsonl`` lacks, then write ``out/tolerances.yaml`` from this
    run's records: ``tolerances`` (default: the layouts' shipped file) calibrated on them."""
    from k3bundle.golden.tolerances import load_tolerances, tolerance_path
    from k3bundle.layouts import load_layout

    chosen = parse_presets(presets)
    if not layouts:
        raise CalibrateError("give at least one --layout")
    for name in layouts:
        load_layout(name)  # a bad name or file is one line naming it
    names = list(FAULTS) if faults is None else faults
    for name in names:
        fault(name)
    check_device(device, backend)
    bases = {tolerance_for(name) for name in layouts}
    if tolerances is None and len(bases) > 1:
        raise CalibrateError(f"the layouts are judged by different tolerance files ({', '.join(sorted(bases))}): "
                             "give --tolerances, or calibrate each format on its own")
    base = tolerance_path(tolerances or bases.pop())
    load_tolerances(base)
    if cases is not None and not Path(cases).is_dir():
        raise CalibrateError(f"--cases {cases}: not a folder of case files")
    if workers < 1 or threads < 1 or long_tokens < 1:
        raise CalibrateError("--workers, --threads and --long-tokens must be at least 1")
    if Path(out).exists() and not Path(out).is_dir():
        raise CalibrateError(f"--out {out}: exists and is not a folder")

    jobs = make_jobs(Path(out), chosen, layouts, device, names, long_tokens=long_tokens, threads=threads,
                     golden_device=golden_device, backend=backend, tolerance=str(base),
                     cases_dir=None if cases is None else str(Path(cases).resolve()))
    run_jobs(jobs, Path(out), workers, progress)
    wanted = {(p, s, l, device) for p, seeds in chosen for s in seeds for l in layouts}
    recs = [r for r in load_records([Path(out) / RECORDS]) if tuple(r[k] for k in JOB_KEYS) in wanted]
    ran = {tuple(r[k] for k in JOB_KEYS) for r in recs if r.get("status") != "error"}
    errors = [r for r in recs if r.get("status") == "error" and tuple(r[k] for k in JOB_KEYS) not in ran]
    if errors:
        e = errors[0]
        raise CalibrateError(f"job {e['preset']}:{e['seed']} {e['layout']} {e['device']} failed: {e['reason']} "
                             "(run calibrate again to retry it)")
    recs = [r for r in recs if r.get("status") != "error"]
    table, summary = separation(recs), rates(recs)
    failed = {k for r in recs if r["fault"] is None for k in r.get("failed_checks", [])}
    text = run or (f"k3bundle calibrate: {', '.join(presets)}; layouts {', '.join(layouts)}; device {device}"
                   + (f", backend {backend}" if backend else "") + f"; {summary['clean_bundles']} clean bundles, "
                   f"faults {', '.join(names) if names else 'none'}")
    changed = write_calibrated(base, Path(out) / TOLERANCE_FILE, table, summary, text, failed)
    not_located = {}
    for r in recs:
        if r["fault"] is not None and r.get("status") != "n/a" and r["fault"] not in not_located:
            if not is_located(r):
                ff = r.get("first_failure") or {}
                not_located[r["fault"]] = (f"{r['status']}: first failure {ff.get('tap')} ({ff.get('mode')}), "
                                           f"planted {r['planted']['tap']}" if ff else f"{r['status']}, planted "
                                           f"{r['planted']['tap']}")
    return Calibration(Path(out) / RECORDS, Path(out) / TOLERANCE_FILE, summary, changed["widened"],
                       changed["not_separated"], not_located)
