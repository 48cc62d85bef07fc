"""``k3bundle validate``: judge a device run against the goldens and write the sign-off report.

Two devices under test: the built-in executor on a bundle's device weights (``--device``), or
intermediates dumped by an external runtime (``--dumps DIR``, docs/dump-format.md). Exit codes:
0 pass, 1 numerical fail, 2 bad input.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3bundle.errors import K3Error
from k3bundle.golden.store import GoldenFileError, read_meta, read_npz
from k3bundle.golden.tolerances import Tolerances, load_tolerances
from k3bundle.validate.compare import GreedyResult, TapResult, compare_greedy, first_failure
from k3bundle.validate.device import (
    _t, compare_layer_outputs, device_case, inherited_checks, layer_outputs, state_drift,
)
from k3bundle.validate.dumps import read_dump


class ValidateError(K3Error):
    """validate cannot run: missing goldens, bad arguments."""


@dataclass
class CaseReport:
    name: str
    kind: str
    status: str  # "pass" / "fail" / "not run"
    reason: str = ""
    results: list[TapResult] = field(default_factory=list)
    greedy: GreedyResult | None = None
    drift: dict[str, list[float]] = field(default_factory=dict)
    drift_limit: float = 0.0
    kld_by_position: list[float] = field(default_factory=list)
    first_failure: TapResult | None = None
    layer_checks: str = ""  # why teacher-forced checks were skipped, if they were

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class Report:
    bundle: str
    mode: str  # "device" or "dumps"
    device: str
    tolerances: Tolerances
    cases: list[CaseReport]
    golden_meta: dict
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.status != "fail" for c in self.cases) and any(c.status == "pass" for c in self.cases)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1


def load_goldens(validation: Path) -> tuple[dict, dict, dict, Tolerances]:
    for name in ("golden_inputs.npz", "golden_intermediates.npz", "tolerances.yaml"):
        if not (validation / name).is_file():
            raise ValidateError(f"{validation / name}: missing; run `k3bundle golden` first")
    inputs = read_npz(validation / "golden_inputs.npz")
    inter = read_npz(validation / "golden_intermediates.npz")
    meta = read_meta(inter)
    if read_meta(inputs).get("content_hash") != meta.get("content_hash"):
        raise GoldenFileError(f"{validation}: golden_inputs.npz and golden_intermediates.npz come from different runs")
    return inputs, inter, meta, load_tolerances(validation / "tolerances.yaml")


def _case_arrays(inter: dict, case: str) -> dict:
    p = f"{case}/"
    return {k[len(p):]: v for k, v in inter.items() if k.startswith(p)}


def _finish(rep: CaseReport, tol: Tolerances) -> CaseReport:
    drift_ok = all(v <= tol.state.get("drift_nmse", float("inf")) for vals in rep.drift.values() for v in vals)
    greedy_ok = rep.greedy is None or rep.greedy.passed
    ok = all(r.passed for r in rep.results) and drift_ok and greedy_ok
    local = [r for r in rep.results if r.mode in ("added", "emulation", "router")]
    rep.first_failure = first_failure(local) or first_failure(rep.results)
    rep.status = "pass" if ok else "fail"
    if not ok and rep.first_failure is None:
        rep.reason = "greedy divergence before a near tie" if not greedy_ok else "state drift above the limit"
    return rep


def validate(bundle: str | Path, weights_factory: Callable[[str], object] | None = None,
             dumps: str | Path | None = None, device: str = "cpu", validation: str | Path | None = None,
             progress: Callable[[int, int, str], None] | None = None) -> Report:
    """Judge the device (``weights_factory(dtype)`` -> WeightSource) or ``dumps`` against the goldens.

    Args:
        bundle (`Path`): the bundle (or checkpoint) whose ``validation/`` holds the goldens.
        weights_factory (`callable`): builds the device's WeightSource for a dtype policy name.
        dumps (`Path`, optional): a dump directory; then the device is the external runtime.
    """
    t0 = time.time()
    bundle = Path(bundle)
    vdir = Path(validation) if validation else bundle / "validation"
    inputs, inter, meta, tol = load_goldens(vdir)
    distributed = getattr(weights_factory, "distributed", False)
    if dumps is None and distributed:  # one torch.distributed process per rank computes everything
        computed = weights_factory.run(vdir)
    device_weights = weights_factory("bfloat16") if dumps is None and not distributed else None
    reference = {}
    cases = []
    listed = meta.get("cases", [])
    for i, entry in enumerate(listed):
        name = entry["name"]
        if progress:
            progress(i, len(listed), name)
        if entry.get("status") != "ok":
            cases.append(CaseReport(name, entry.get("kind", ""), "not run", entry.get("reason", "")))
            continue
        golden = _case_arrays(inter, name)
        ids = inputs[f"{name}/ids"]
        rep = CaseReport(name, entry["kind"], "fail")
        full = int(golden["positions"].size) == int(ids.size)
        if dumps is None:
            if distributed:
                cand, outs = computed[name]
            else:
                cand = device_case(device_weights, golden, ids)
                outs = layer_outputs(device_weights, golden.get) if full else None
            rep.results += inherited_checks(golden, cand, name, tol, routers=False)
            if full:
                rep.results += compare_layer_outputs(outs, golden.get, name, tol, "added", margins=golden.get)
            else:
                rep.layer_checks = "sampled positions: teacher-forced layer checks need every position"
        else:
            cand = read_dump(dumps, name, golden, _num_layers(golden))
            rep.results += inherited_checks(golden, cand, name, tol, routers=True)
            if full:
                dtype = "bfloat16" if cand["logits"].dtype == torch.bfloat16 else "float32"
                if dtype not in reference:
                    reference[dtype] = weights_factory(dtype)
                feed = {**cand, "embed": _t(golden["embed"])}
                outs = layer_outputs(reference[dtype], feed.get)
                rep.results += compare_layer_outputs(outs, feed.get, name, tol, "emulation", margins=golden.get)
            else:
                rep.layer_checks = "sampled positions: emulation layer checks need every position"
        if "greedy_tokens" in cand and golden["greedy_tokens"].size:
            rep.greedy = compare_greedy(golden["greedy_tokens"], cand["greedy_tokens"].tolist(),
                                        _t(golden["step_logits"]), tol)
        rep.drift = state_drift(golden, cand)
        rep.drift_limit = tol.state.get("drift_nmse", 0.0)
        if "logits" in cand:
            from k3bundle.validate.metrics import kld
            rep.kld_by_position = kld(_t(golden["logits"]), cand["logits"].to(torch.float64)).tolist()
        cases.append(_finish(rep, tol))
    if progress:
        progress(len(listed), len(listed), "")
    return Report(str(bundle), "dumps" if dumps else "device", device, tol, cases, meta, time.time() - t0)


def _num_layers(golden: dict) -> int:
    """Number of decoder layers, from the golden taps (a dump's required taps depend on it)."""
    layers = {int(k.split(".")[1]) for k in golden if k.startswith("layers.")}
    return max(layers) + 1 if layers else 0
