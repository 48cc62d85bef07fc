"""``k3bundle validate``: judge a device run against the goldens and write the sign-off report.

The device under test is one of ``validate.devices`` (the built-in executor in this process or
one process per rank, or an external runtime's dumps); each yields, per case, the candidate's
taps and its teacher-forced layer outputs. ``validate()`` only loops over the cases and judges
(``judge.py``). A case that yields nothing to compare is "not run", never "pass". Exit codes:
0 pass, 1 numerical fail, 2 bad input.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from k3bundle.bundle.manifest import read_manifest
from k3bundle.bundle.signoff import BINDING_FIELDS, binding, file_digest
from k3bundle.config import load_config
from k3bundle.file_names import (GOLDEN_FILES, GOLDEN_INPUTS, GOLDEN_INTERMEDIATES, GOLDEN_TOLERANCES, MANIFEST,
                                  VALIDATION_DIR)
from k3bundle.golden.errors import GoldenFileError
from k3bundle.golden.noise import near_tie_margin
from k3bundle.golden.store import check_goldens, read_meta, read_npz
from k3bundle.golden.tolerances import Tolerances, load_tolerances, tolerance_path
from k3bundle.executor.taps import forward_key
from k3bundle.validate.compare import GreedyResult, TapResult, compare_greedy, nonfinite_text
from k3bundle.validate.devices import Device, as_tensor
from k3bundle.validate.errors import ValidateError
from k3bundle.validate.findings import first_failure, kernels_of, ops_behind
from k3bundle.validate.judge import drift_limits, inherited_checks, layer_checks, state_drift
from k3bundle.metrics import kld


@dataclass
class CaseReport:
    name: str
    kind: str
    status: str  # "pass" / "fail" / "not run"
    reason: str = ""
    results: list[TapResult] = field(default_factory=list)
    greedy: GreedyResult | None = None
    drift: dict[str, list[float]] = field(default_factory=dict)
    drift_limit: float = 0.0  # the tolerance file's limit
    drift_limits: dict[str, float] = field(default_factory=dict)  # per state, widened with the BF16 noise
    drift_basis: dict[str, dict] = field(default_factory=dict)  # per state, what its limit came from
    kld_by_position: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the prompt positions kld_by_position is at
    first_failure: TapResult | None = None
    kernel_ops: list[str] = field(default_factory=list)  # the backend's ops that ran at the first failure
    layer_checks: str = ""  # why teacher-forced checks were skipped, if they were
    seconds: float = 0.0  # the device's run of the case and its judging
    serving: list = field(default_factory=list)  # validate.serving.PathResult per serving path (validate --serving)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def limit_of(self, state: str) -> float:
        """A decode state's drift limit (widened with the BF16 noise where the goldens have it)."""
        return self.drift_limits.get(state, self.drift_limit)

    @property
    def drift_worst(self) -> tuple[float, float]:
        """(drift, limit) of the state nearest to (or furthest over) its own limit."""
        pairs = [(max(v), self.limit_of(n)) for n, v in self.drift.items() if v]
        return max(pairs, key=lambda p: p[0] / p[1] if p[1] > 0 else float("inf"), default=(0.0, self.drift_limit))


@dataclass
class Report:
    bundle: str
    mode: str  # "device" or "dumps"
    device: str
    tolerances: Tolerances
    cases: list[CaseReport]
    golden_meta: dict
    seconds: float = 0.0
    exact: str = ""  # the exact check: "ran" or why not (devices.exact_applies)
    integrity: str = ""  # the bundle's files against its manifest: the level that ran and what it covered
    integrity_problems: list[str] = field(default_factory=list)  # files that differ: no sign-off
    binding: dict = field(default_factory=dict)  # what was judged (bundle.signoff.binding), as the run began
    backend: str | None = None  # --backend: the kernels the built-in executor ran (None: the reference's)
    run_id: str = ""  # the run its key's run marker names (bundle.signoff.write_run_marker)
    run: dict = field(default_factory=dict)  # key, started, finished, device, ranks, backend, dumps (report.Run)
    kernels: dict | None = None  # the backend the device ran (findings.kernels_of); None: the reference

    @property
    def passed(self) -> bool:
        return (not self.integrity_problems and all(c.status != "fail" for c in self.cases)
                and any(c.status == "pass" for c in self.cases)
                and all(p.status != "fail" for c in self.cases for p in c.serving))

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def nonfinite(self) -> list[dict]:
        """Every NaN/Inf finding, in case and forward order: a tap whose values (device or golden)
        were not all finite, and a greedy step taken over non-finite device logits."""
        out = []
        for c in self.cases:
            for r in sorted((r for r in c.results if r.nonfinite), key=lambda r: forward_key(r.tap)):
                out.append({"case": c.name, "tap": r.tap, "mode": r.mode, **r.nonfinite,
                            "text": f"{r.tap}: {nonfinite_text(r.nonfinite)}"})
            if c.greedy is not None and c.greedy.nonfinite_step is not None:
                s = c.greedy.nonfinite_step
                out.append({"case": c.name, "tap": "greedy_tokens", "mode": "greedy", "step": s,
                            "text": f"greedy step {s}: token chosen over non-finite logits"})
        return out


def load_goldens(validation: Path) -> tuple[dict, dict, dict, Tolerances]:
    for name in GOLDEN_FILES:
        if not (validation / name).is_file():
            raise ValidateError(f"{validation / name}: missing; run `k3bundle golden` first")
    inputs = read_npz(validation / GOLDEN_INPUTS)
    inter = read_npz(validation / GOLDEN_INTERMEDIATES)
    meta = check_goldens(validation / GOLDEN_INTERMEDIATES, inter)
    if read_meta(inputs).get("content_hash") != meta.get("content_hash"):
        raise GoldenFileError(f"{validation}: {GOLDEN_INPUTS} and {GOLDEN_INTERMEDIATES} come from different runs")
    for entry in meta.get("cases", []):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or (entry.get("status") == "ok" and f"{name}/ids" not in inputs):
            raise GoldenFileError(f"{validation / GOLDEN_INPUTS}: lacks the ids of case {name!r}")
        if entry.get("status") == "ok" and not np.array_equal(inputs.get(f"{name}/greedy_tokens"),
                                                              inter.get(f"{name}/greedy_tokens")):
            raise GoldenFileError(f"{validation / GOLDEN_INPUTS}: greedy tokens of case {name!r} differ "
                                  f"from {GOLDEN_INTERMEDIATES}; rerun `k3bundle golden`")
    check_tolerance_file(validation / GOLDEN_TOLERANCES, meta)
    return inputs, inter, meta, load_tolerances(validation / GOLDEN_TOLERANCES)


_LAYER_TAP = re.compile(r"[/.]layers\.(\d+)\.")  # "case/layers.3.mixer_out", "case/decode.layers.3.ffn_out"


def check_same_model(bundle: Path, validation: Path, inputs: dict, inter: dict, cases: list[dict]) -> None:
    """Refuse goldens of another model before any case runs: their hidden width, vocabulary and
    depth must be the bundle's (``config.json``), and their ids within its vocabulary. Goldens of
    a wider model would otherwise end in a size-mismatch deep inside the forward."""
    if not (bundle / "config.json").is_file():
        return
    text = load_config(bundle).text
    layers = {int(m.group(1)) for k in inter if (m := _LAYER_TAP.search(k))}
    for entry in cases:
        name = entry["name"]
        if entry.get("status") != "ok":
            continue
        for tap, size, field in (("embed", text.hidden_size, "hidden_size"), ("logits", text.vocab_size, "vocab_size")):
            a = inter.get(f"{name}/{tap}")
            if a is not None and a.ndim and a.shape[-1] != size:
                raise GoldenFileError(f"{validation}: the goldens are of another model: case {name!r} has {tap} of "
                                      f"width {a.shape[-1]}, {bundle / 'config.json'} has {field} {size}; run "
                                      f"`k3bundle golden {bundle}`")
        ids = inputs[f"{name}/ids"]
        if ids.size and (ids.min() < 0 or ids.max() >= text.vocab_size):
            raise GoldenFileError(f"{validation}: case {name!r} holds token id {int(ids.max())}, outside "
                                  f"{bundle / 'config.json'}'s vocab_size {text.vocab_size}")
    if layers and max(layers) >= text.num_hidden_layers:
        raise GoldenFileError(f"{validation}: the goldens are of another model: they tap layer {max(layers)}, "
                              f"{bundle / 'config.json'} has num_hidden_layers {text.num_hidden_layers}")


def check_tolerance_file(path: Path, meta: dict) -> None:
    """The goldens and their tolerance file are one unit: the file beside them must be the one
    ``golden`` wrote with them (its sha256 is in their metadata). A run cut between golden's writes,
    or a tolerance file edited or copied in afterwards, is refused rather than judged by."""
    recorded, actual = meta.get("tolerances_sha256"), file_digest(path)
    if recorded is None:
        raise GoldenFileError(f"{path}: the goldens do not record their tolerance file's sha256 (an older "
                              "k3bundle made them); rerun `k3bundle golden`")
    if recorded != actual:
        raise GoldenFileError(f"{path}: not the tolerance file the goldens were made with (sha256 {actual[:16]}…, "
                              f"the goldens record {recorded[:16]}…); rerun `k3bundle golden` "
                              "(--tolerances FILE for other limits)")


def _case_arrays(inter: dict, case: str) -> dict:
    p = f"{case}/"
    return {k[len(p):]: v for k, v in inter.items() if k.startswith(p)}


def _finish(rep: CaseReport, tol: Tolerances) -> CaseReport:
    if not rep.results and rep.greedy is None and not rep.drift:
        rep.status, rep.reason = "not run", "no comparisons: the device produced no tap the goldens have"
        return rep
    drifted = _drift_failures(rep)
    greedy_ok = rep.greedy is None or rep.greedy.passed
    ok = all(r.passed for r in rep.results) and not drifted and greedy_ok
    # a fault in prompt processing shows first in a teacher-forced check; one in the decode
    # path (a serving cache) in the first free-running tap or state it reaches, in layer order
    rep.first_failure = first_failure(rep.results + drifted)
    rep.status = "pass" if ok else "fail"
    if not ok and rep.first_failure is None:
        g = rep.greedy
        rep.reason = (f"greedy step {g.nonfinite_step} chosen over non-finite logits"
                      if g is not None and g.nonfinite_step is not None else "greedy divergence before a near tie")
    return rep


def _drift_failures(rep: CaseReport) -> list[TapResult]:
    """Each decode state whose drift exceeds its limit at some step, as a failed check."""
    out = []
    for n, vals in rep.drift.items():
        limit = rep.limit_of(n)
        if vals and max(vals) > limit:
            worst = max(vals)
            out.append(TapResult(rep.name, n, "state", {"drift_nmse": worst, "step": float(vals.index(worst))},
                                 {"drift_nmse": limit}, False, {"drift_nmse": worst}))
    return out


def judge_case(name: str, kind: str, golden: dict, out, tol: Tolerances) -> CaseReport:
    """Every check of one case on what the device produced (``devices.CaseOutput``)."""
    rep = CaseReport(name, kind, "fail", layer_checks=out.skipped)
    cand = out.cand
    rep.results += inherited_checks(golden, cand, name, tol, routers=not out.routes_replayed)
    if out.layers is not None:
        rep.results += layer_checks(out.layers, out.layer_ref, name, tol, out.layer_mode, margins=golden.get,
                                    exact_section=out.exact_section, noise=golden)
    if "greedy_tokens" in cand and golden["greedy_tokens"].size:
        factor = tol.noise.get("factor", 0.0)
        rep.greedy = compare_greedy(golden["greedy_tokens"], cand["greedy_tokens"].tolist(),
                                    as_tensor(golden["step_logits"]), tol,
                                    lambda step: near_tie_margin(tol.greedy.get("near_tie_margin", 0.0),
                                                                 golden, step, factor),
                                    step_logits=cand.get("step_logits"))
    if out.serving is not None:
        rep.serving = out.serving.judge(name, tol)
    rep.drift = state_drift(golden, cand)
    rep.drift_limit = tol.state.get("drift_nmse", float("inf"))
    rep.drift_limits, rep.drift_basis = drift_limits(golden, rep.drift, tol)
    if "logits" in cand:
        rep.kld_by_position = kld(as_tensor(golden["logits"]), cand["logits"].to(torch.float64)).tolist()
        rep.positions = [int(p) for p in golden["positions"]] if "positions" in golden else []
    return _finish(rep, tol)


def check_integrity(bundle: Path, level: str, seed: int, reads_weights: bool) -> tuple[str, list[str]]:
    """The bundle's files against its manifest at ``level``: (the coverage line, problems).

    A bundle whose bytes are not its manifest's cannot be signed off, whatever the numbers say;
    the cases still run, so a changed weight is also located to its layer. Level ``sample``
    re-hashes every file the run reads: the weights when the built-in device computes on them,
    else the metadata and a seeded sample."""
    from k3bundle.provenance.verify import verify

    if not (bundle / MANIFEST).is_file():
        return "not checked: a source checkpoint (no manifest)", []
    manifest = read_manifest(bundle)
    reads = [f["path"] for f in manifest["files"] if f["path"].endswith(".safetensors")] if reads_weights else []
    r = verify(bundle, level=level, seed=seed, reads=reads)
    if not r.ok:
        return (f"FAILED at {r.coverage}: {len(r.problems)} problem(s), first: {r.problems[0]} "
                f"(`k3bundle verify {bundle}` lists them)"), r.problems
    return r.coverage, []


def select_cases(listed: list[dict], names: Sequence[str] | None) -> list[dict]:
    """The goldens' case entries to judge: all of them, or those ``names`` picks (in the
    goldens' order); an unknown name is bad input that lists the known ones."""
    if not names:
        return listed
    known = [e["name"] for e in listed]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValidateError(f"--cases: unknown case{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(map(repr, unknown))}; the goldens have {', '.join(known)}")
    return [e for e in listed if e["name"] in names]


def validate(bundle: str | Path, device: Device, validation: str | Path | None = None,
             progress: Callable[[int, int | None, str], None] | None = None, verify_level: str = "sample",
             verify_seed: int = 0, cases: Sequence[str] | None = None,
             tolerances: str | Path | None = None) -> Report:
    """Judge ``device`` (``validate.device_options.open_device``) against the goldens of ``bundle``.

    Args:
        bundle (`Path`): the bundle (or checkpoint) whose ``validation/`` holds the goldens.
        device (`Device`): the device under test: in-process, distributed or dumps.
        validation (`Path`, optional): another goldens directory.
        verify_level (`str`): how the bundle's files are checked against its manifest first
            (``check.verify.LEVELS``; ``check_integrity``).
        cases (`list[str]`, optional): judge only these golden cases (the others are reported
            "not run: not selected"); a dump directory then needs only their files.
        tolerances (`str | Path`, optional): judge by this tolerance file (a shipped name or a
            .yaml, e.g. one ``k3bundle calibrate`` wrote) instead of the goldens' own; the sign-off
            records its path and sha256.
    """
    t0 = time.time()
    bundle = Path(bundle)
    vdir = Path(validation) if validation else bundle / VALIDATION_DIR
    tol_file = vdir / GOLDEN_TOLERANCES if tolerances is None else tolerance_path(str(tolerances)).resolve()
    own_tol = None if tolerances is None else load_tolerances(tol_file)  # bad limits refused before any work
    judged_manifest = binding(bundle, {}, tol_file)["bundle_manifest_sha256"]
    integrity, problems = check_integrity(bundle, verify_level, verify_seed, reads_weights=device.mode != "dumps")
    inputs, inter, meta, tol = load_goldens(vdir)
    tol = own_tol or tol
    judged = {**binding(bundle, meta, tol_file), "bundle_manifest_sha256": judged_manifest}
    if tolerances is not None:
        judged["tolerances_file"] = str(tol_file)
    listed = meta.get("cases", [])
    check_same_model(bundle, vdir, inputs, inter, listed)
    chosen = {e["name"] for e in select_cases(listed, cases)}
    ran = [e["name"] for e in listed if e.get("status") == "ok" and e["name"] in chosen]
    device.check({n: _case_arrays(inter, n) for n in ran})  # bad input first, all of it at once
    if progress and device.runs_cases_in_prepare:
        progress(0, None, f"running the cases on {device.name}")
    device.prepare(vdir, ran)
    case_reports = []
    for i, entry in enumerate(listed):
        if entry["name"] not in chosen:
            case_reports.append(CaseReport(entry["name"], entry.get("kind", ""), "not run", "not selected (--cases)"))
            continue
        if entry.get("status") != "ok":
            case_reports.append(CaseReport(entry["name"], entry.get("kind", ""), "not run", entry.get("reason", "")))
            continue
        if progress:  # a stage per case the device runs (the others take no time)
            progress(i, len(listed), f"case {entry['name']}")
        t_case = time.time()
        golden = _case_arrays(inter, entry["name"])
        out = device.case(entry["name"], golden, inputs[f"{entry['name']}/ids"])
        case_reports.append(judge_case(entry["name"], entry["kind"], golden, out, tol))
        case_reports[-1].seconds = time.time() - t_case
    if progress:
        progress(len(listed), len(listed), "")
    check_unchanged(judged, binding(bundle, meta, tol_file))
    if device.kernels is not None:
        name_kernel_ops(bundle, case_reports, device.kernels.ops)
    return Report(str(bundle), device.mode, device.name, tol, case_reports, meta, time.time() - t0, device.exact_status,
                  integrity, problems, judged, kernels=kernels_of(device.kernels))


def name_kernel_ops(bundle: Path, cases: list[CaseReport], ops) -> None:
    """Each failing case: which of the backend's ``ops`` ran where it first failed."""
    text = load_config(bundle).text
    for c in cases:
        if c.first_failure is not None:
            c.kernel_ops = ops_behind(c.first_failure.tap, c.first_failure.mode, text, ops)


def check_unchanged(judged: dict, now: dict) -> None:
    """No verdict on a bundle that changed while it was judged (a ``convert --force`` into it, a new
    tolerance file): what the run judged is neither what it began with nor what is there now."""
    changed = [what for key, what in BINDING_FIELDS.items() if judged.get(key) != now.get(key)]
    if changed:
        raise ValidateError(f"{', '.join(changed)} changed while validate ran; no verdict is written: "
                            "rerun validate once the bundle is finished")
