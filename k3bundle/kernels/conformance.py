"""``k3bundle kernels``: every op a backend provides against the reference, at a layout's shapes.

For each op of the target's ``graph_manifest.json`` ``custom_ops`` with a contract
(``ops.contract.OP_CONTRACTS``) and each case of ``golden/kernel_cases.yaml``: the inputs are drawn
in the activation dtype; the backend runs them on the device; the reference runs the same
values upcast to float64 on the same device (the exact oracle). Metrics per output: NMSE,
max-abs, cosine over the elements finite in the reference; NaN must appear where the reference
has it and nowhere outside the case's region (a NaN input must neither vanish nor spread to other
heads or requests). Limits per op and dtype: ``tolerances/kernels.yaml``. The cases marked
``timed`` are also timed (median of ``reps`` calls after a warm-up) and set against the op's
roofline bound on the device: max(bytes / HBM bandwidth, FLOPs / BF16 peak) of the device's card.

Ops the backend lacks are "not covered" (the reference would run them); ops without a contract
(AttnRes, SiTU-GLU, RMSNorm, the dense GEMMs) are listed as such.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from k3bundle.data_dirs import data_dirs
from k3bundle.errors import K3Error
from k3bundle.io.strict_yaml import read_yaml
from k3bundle.kernels import reference
from k3bundle.ops.contract import OP_CONTRACTS, Backend
from k3bundle.kernels.cases import Case, Sizes, load_cases, make_case, upcast

TOLERANCES_FILE = "kernels.yaml"
ACT = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class CaseResult:
    name: str
    passed: bool
    metrics: dict  # per output: {nmse, max_abs, cosine}; router: ids
    failures: list[str]
    time_s: float | None = None
    bound_s: float | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.time_s is None or not self.bound_s else self.time_s / self.bound_s


@dataclass
class OpResult:
    op: str
    status: str  # "pass" / "fail" / "not covered" / "no contract"
    limits: dict = field(default_factory=dict)
    cases: list[CaseResult] = field(default_factory=list)

    def failing(self) -> CaseResult | None:
        return next((c for c in self.cases if not c.passed), None)


@dataclass
class Conformance:
    backend: str
    device: str
    target: str
    dtype: str
    card: str | None
    sizes: dict
    ops: list[OpResult]
    model: str | None = None  # the config whose per-rank shapes ran (``kernels --config``); None: the release's

    @property
    def shapes_of(self) -> str:
        return shapes_of(self.model)

    @property
    def passed(self) -> bool:
        return all(o.status != "fail" for o in self.ops)

    def covered(self) -> list[str]:
        return [o.op for o in self.ops if o.status in ("pass", "fail")]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = "k3bundle.kernel_conformance"
        d["passed"] = self.passed
        for o, od in zip(self.ops, d["ops"]):
            for c, cd in zip(o.cases, od["cases"]):
                cd["ratio"] = c.ratio
        return d


def shapes_of(model: str | None) -> str:
    """Whose per-rank shapes a conformance report ran at, as its ``model`` field says."""
    return "the released Kimi K3 config (full-size shapes)" if model is None else f"the config {model}"


def load_tolerances() -> dict:
    for d in data_dirs("tolerances"):
        p = d / TOLERANCES_FILE
        if p.is_file():
            return read_yaml(p)
    raise K3Error(f"no tolerances/{TOLERANCES_FILE} found beside the package")


def limits_for(tol: dict, op: str, dtype: str) -> dict:
    sec = tol.get(dtype) or {}
    return {**sec.get("default", {}), **sec.get(op, {})}


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def compare(dev: torch.Tensor, ref: torch.Tensor, region: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[dict, list[str]]:
    """Metrics of one output over the elements finite in both, and what is wrong with its NaN
    pattern: ``region`` = (where NaN must be, where it may be); without one, NaN/Inf must match the
    reference's exactly."""
    dev, ref = dev.detach().to(torch.float64), ref.detach().to(torch.float64)
    problems = []
    if dev.shape != ref.shape:
        return {}, [f"shape {list(dev.shape)}, the reference's is {list(ref.shape)}"]
    ref_nan, dev_nan = ~torch.isfinite(ref), ~torch.isfinite(dev)
    must, may = (ref_nan, ref_nan) if region is None else (region[0].to(dev.device), region[1].to(dev.device) | ref_nan)
    if bool((must & ~dev_nan).any()):
        problems.append(f"{int((must & ~dev_nan).sum())} elements finite that depend on a NaN input (it vanished)")
    if bool((dev_nan & ~may).any()):
        problems.append(f"{int((dev_nan & ~may).sum())} NaN/Inf elements where the reference is finite"
                        + ("" if region is None else ", outside the NaN's head/request (it spread)"))
    both = ~ref_nan & ~dev_nan
    d, r = dev[both], ref[both]
    err = (d - r).pow(2).sum()
    den = r.pow(2).sum()
    nmse = float(err / den) if den > 0 else float(err)
    cos = float((d * r).sum() / (d.norm() * r.norm())) if d.norm() > 0 and r.norm() > 0 else (1.0 if err == 0 else 0.0)
    mx = float((d - r).abs().max()) if d.numel() else 0.0
    return {"nmse": nmse, "cosine": cos, "max_abs": mx}, problems


def _router_metrics(case: Case, dev_out, ref_out, tie_eps: float) -> tuple[dict, list[str], int]:
    """ids agreement on tokens that are not ties; weights compared where the sets agree."""
    (d_ids, d_w), (r_ids, r_w) = dev_out, ref_out
    x, w, bias = (a.to(torch.float64) for a in case.args)
    k = case.kwargs["top_k"]
    top = torch.topk(torch.sigmoid(x @ w.T) + bias, k + 1, dim=-1).values
    tie = (top[:, k - 1] - top[:, k]).abs() <= tie_eps
    if case.kwargs.get("forced_ids") is not None:
        tie = torch.zeros_like(tie)
    same = (d_ids.sort(-1).values.to(r_ids.device) == r_ids.sort(-1).values).all(-1)
    judged = ~tie
    share = float(same[judged].float().mean()) if bool(judged.any()) else 1.0
    keep = same & judged
    # weights in the reference's slot order: gather the backend's weight of each reference id
    order = (d_ids[keep][:, :, None] == r_ids[keep][:, None, :]).to(torch.float64)
    d_w_ref = (d_w[keep].to(torch.float64)[:, :, None] * order).sum(1)
    m, problems = compare(d_w_ref, r_w[keep], None)
    m["ids"] = share
    return m, problems, int(tie.sum())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, reps: int = 5) -> float:
    fn()  # warm-up: compilation, autotuning, allocation
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def judge(metrics: dict, lim: dict, tag: str) -> list[str]:
    bad = []
    if "nmse" in lim and "nmse" in metrics and not metrics["nmse"] <= lim["nmse"]:
        bad.append(f"{tag} NMSE {metrics['nmse']:.3g} > {lim['nmse']:.3g}")
    if "cosine" in lim and "cosine" in metrics and not metrics["cosine"] >= lim["cosine"]:
        bad.append(f"{tag} cosine {metrics['cosine']:.9f} < {lim['cosine']}")
    if "ids" in lim and "ids" in metrics and not metrics["ids"] >= lim["ids"]:
        bad.append(f"{tag} expert sets agree on {metrics['ids']:.3f} of tokens < {lim['ids']}")
    return bad


OUTPUT_NAMES = {"kda_chunked_prefill": ("o", "state"), "kda_recurrent_decode": ("o", "state"),
                "causal_short_conv1d_with_state": ("out", "state"), "sigmoid_biased_topk_router": ("weights",)}


def run_case(backend: Backend, case: Case, lim: dict, tie_eps: float, device: torch.device,
             card: dict | None, reps: int) -> CaseResult:
    op = backend.op(case.op, reference.op(case.op))
    dev_out = op(*case.args, **case.kwargs)
    ref_args, ref_kw = upcast(case.args, case.kwargs)
    ref_out = getattr(reference, case.op)(*ref_args, **ref_kw)
    metrics, failures = {}, []
    if case.op == "sigmoid_biased_topk_router":
        m, probs, ties = _router_metrics(case, dev_out, ref_out, tie_eps)
        metrics["weights"] = {**m, "ties": ties}
        failures += [f"weights: {p}" for p in probs] + judge(m, lim, "weights")
    else:
        names = OUTPUT_NAMES.get(case.op, ("out",))
        for i, (d, r) in enumerate(zip(_flat(dev_out), _flat(ref_out))):
            tag = names[i] if i < len(names) else f"output {i}"
            m, probs = compare(d, r, case.nan_region.get(i))
            metrics[tag] = m
            failures += [f"{tag}: {p}" for p in probs] + (judge(m, lim, tag) if m else [])
    res = CaseResult(case.name, not failures, metrics, failures)
    if case.timed and reps > 0:
        res.time_s = time_call(lambda: op(*case.args, **case.kwargs), device, reps)
        if card:
            res.bound_s = max(case.bytes / card["hbm_bandwidth_bytes_per_s"], case.flops / card["peak_flops"]["bf16"])
    return res


def run(backend: Backend, dims: dict, ops: list[str], target: str, device: str = "cpu", dtype: str = "bfloat16",
        sizes: Sizes = Sizes(), seed: int = 0, reps: int = 5, card: dict | None = None,
        only_cases: list[str] | None = None, progress=None) -> Conformance:
    """Conformance of ``backend`` on ``device`` for ``ops`` (the target's custom_ops), at ``dims``."""
    if dtype not in ACT:
        raise K3Error(f"--dtype {dtype}: choose one of {', '.join(ACT)}")
    dev = torch.device(device)
    backend.setup(dev)
    tol, cases = load_tolerances(), load_cases()
    results = []
    for op in ops:
        if op not in OP_CONTRACTS:
            results.append(OpResult(op, "no contract"))
            continue
        if not backend.provides(op):
            results.append(OpResult(op, "not covered"))
            continue
        lim = limits_for(tol, op, dtype)
        res = OpResult(op, "pass", lim)
        for i, (name, spec) in enumerate(cases.get(op, {}).items()):
            if only_cases and name not in only_cases:
                continue
            if progress:
                progress(f"{op} / {name}")
            case = make_case(op, name, spec, dims, sizes, seed * 1000 + i, ACT[dtype], dev)
            res.cases.append(run_case(backend, case, lim, tol.get("tie_eps", 1e-6), dev, card, reps))
        res.status = "fail" if res.failing() else "pass"
        results.append(res)
    return Conformance(backend.name, str(dev), target, dtype, card["name"] if card else None, asdict(sizes), results)
