"""Assemble the checklist of one target: plan → capacity, roofline, kernels, fault paths, stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.graph import graph_manifest
from k3bundle.bundle.signoff_runs import SignoffRun, choose_run, describe_run
from k3bundle.provenance.verify import verify
from k3bundle.checklist.capacity import Capacity, capacity
from k3bundle.checklist.errors import ChecklistError
from k3bundle.checklist.faults import FAULT_PATHS, SOAK_REQUIREMENTS
from k3bundle.checklist.kernels import Kernel, kernel_coverage
from k3bundle.checklist.op_reports import op_status, read_kernel_report
from k3bundle.checklist.roofline import Roofline, roofline
from k3bundle.checklist.serving import Serving, apply_to_layout, cache_manifest
from k3bundle.checklist.stages import Stage, evaluate_stages
from k3bundle.checklist.vision import VisionRoofline, vision_roofline
from k3bundle.config import load_config, release_config_path
from k3bundle.errors import JsonFileError
from k3bundle.file_names import CONFIG, GRAPH_MANIFEST, MANIFEST
from k3bundle.io.strict_json import read_json
from k3bundle.layouts import load_layout
from k3bundle.plan import Plan, make_plan

CHECKLIST_SCHEMA_VERSION = 1
CHECKLIST_KIND = "k3bundle.checklist"
DEFAULT_CONTEXT = 131_072  # tokens per request: a long-context request (K3 serves up to 1,048,576)
DEFAULT_BATCH = 1


@dataclass
class Checklist:
    target: str
    model: str  # where the config came from
    bundle: str | None
    plan: Plan
    context: int
    batch: int
    capacity: Capacity
    roofline: Roofline
    kernels: list[Kernel]
    stages: list[Stage]
    op_conformance: dict[str, tuple[str, str]] = field(default_factory=dict)  # reports/kernels.json
    signoff: SignoffRun | None = None  # the validate run the numerics stages read (choose_run)
    signoff_how: str = ""  # how it was chosen, or why there is none
    signoff_runs: list[SignoffRun] = field(default_factory=list)  # every run in reports/validate/, newest first
    sources: dict[str, str] = field(default_factory=dict)  # section -> where its figures come from (figure_sources)
    vision: VisionRoofline | None = None  # one image through the tower and projector (checklist.vision)

    @property
    def passed(self) -> bool:
        """The capacity verdict: the one item a checklist can fail by computation alone."""
        return self.capacity.passed

    @property
    def ticked(self) -> int:
        return sum(s.done for s in self.stages)

    def summary(self) -> str:
        c, d = self.capacity, self.roofline.decode
        return (f"{self.target}: capacity {'PASS' if c.passed else 'FAIL'} (margin {c.margin:.1%}), "
                f"TPOT ≥ {d.bound.text}, TTFT ≥ {self.roofline.prefill.bound.text} at batch {self.batch} × "
                f"{self.context:,} tokens; {self.ticked} of {len(self.stages)} stages ticked")

    def _op_conformance(self, op: str) -> dict:
        status, evidence = self.op_conformance.get(op, ("open", "no bundle given (--bundle)"))
        return {"op_conformance": status, "op_conformance_evidence": evidence}

    def signoff_read(self) -> str:
        """Which validate run's sign-off the stages read: its key, what ran, when, its file."""
        r = self.signoff
        if r is None:
            return f"none ({self.signoff_how})"
        more = f"; {len(self.signoff_runs) - 1} other run(s), read with --run KEY" if len(self.signoff_runs) > 1 else ""
        return (f"run {r.key} ({describe_run(r.run)}; finished {r.finished}), {r.path}, {self.signoff_how}{more}")

    def _signoff_dict(self) -> dict:
        runs = [{"key": r.key, "path": r.path, "run": r.run, "passed": (r.doc or {}).get("passed"), "why": r.why}
                for r in self.signoff_runs]
        chosen = None if self.signoff is None else {"key": self.signoff.key, "path": self.signoff.path,
                                                     "run": self.signoff.run, "why": self.signoff.why}
        return {"signoff_read": chosen, "signoff_chosen": self.signoff_how, "signoff_runs": runs}

    def to_dict(self) -> dict:
        lay = self.plan.layout
        c, p = lay.card, lay.parallel
        return {
            "schema_version": CHECKLIST_SCHEMA_VERSION, "kind": CHECKLIST_KIND, "target": self.target,
            "model": self.model, "bundle": self.bundle, "context": self.context, "batch": self.batch,
            "card": {"name": c.name, "count": c.count, "hbm_bytes": c.hbm_bytes,
                     "hbm_bandwidth_bytes_per_s": c.hbm_bandwidth_bytes_per_s,
                     "link_bandwidth_bytes_per_s": c.link_bandwidth_bytes_per_s, "peak_flops": dict(c.peak_flops)},
            "parallel": {"tp": p.tp, "attention_dp": p.attention_dp, "ep": p.ep, "moe_tp": p.moe_tp, "pp": p.pp,
                         "pp_layers": list(self.plan.stage_layers)},
            "passed": self.passed, "summary": self.summary(),
            "capacity": self.capacity.to_dict(),
            "roofline": self.roofline.to_dict() | {"vision": None if self.vision is None else self.vision.to_dict()},
            "kernels": [k.to_dict() | self._op_conformance(k.op) for k in self.kernels],
            "fault_paths": [f.to_dict() for f in FAULT_PATHS],
            "soak": [{"key": k, "requirement": r} for k, r in SOAK_REQUIREMENTS],
            "stages": [s.to_dict() for s in self.stages],
            **(self._signoff_dict() if self.bundle is not None else {}),
            "sources": self.sources,
        }


def figure_sources(model: str, text, release: bool, kernels_report: dict | None, why: str = "",
                   bundle: bool = True) -> dict[str, str]:
    """Where each section's figures come from: the model the checklist was made for (a bundle's own
    ``config.json`` may be a small model of K3's architecture) placed by the layout, or, for op
    conformance, the shapes ``k3bundle kernels`` ran at (the release's unless it was given
    ``--config``). Section -> one line, for the Markdown and the page alike."""
    facts = f"hidden size {text.hidden_size:,}, {text.num_hidden_layers} layers, {text.num_experts} experts"
    which = f"{model} — {facts}" + ("" if release else " (not the released Kimi K3: figures at its own sizes)")
    placed = f"from {which}, placed by this layout"
    if kernels_report is None:
        measured = f"no conformance report read ({why.split('; ')[0]})"
    elif kernels_report.get("model") is None:
        measured = ("measured by `k3bundle kernels` at the layout's release shapes (the released Kimi K3 config, "
                    "full size)" + ("" if release else ", not at this model's sizes"))
    else:
        measured = f"measured by `k3bundle kernels` at the per-rank shapes of the config {kernels_report['model']}"
    return {"capacity": f"Figures {placed}: its weights in their stored formats, its cache and state per token "
                        "and request.",
            "roofline": f"Figures {placed}: its bytes and FLOPs per step.",
            "kernels": f"Shapes per rank {placed}. Op conformance: {measured}.",
            "stages": ("Ticked from the evidence files in the bundle (goldens, sign-off, reports), each made from "
                       "the bundle's own model." if bundle else
                       "Capacity ticks from the computation above; every other stage needs a bundle's evidence "
                       "(--bundle).")}


def _bundle_graph(bundle: Path) -> dict | None:
    path = bundle / GRAPH_MANIFEST
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
    except JsonFileError as e:
        raise ChecklistError(f"{path}: not readable JSON ({e.problem})") from None
    if not isinstance(doc, dict) or doc.get("kind") != "k3bundle.graph_manifest":
        raise ChecklistError(f"{path}: not a k3bundle graph manifest")
    return doc


def _plan_and_cache(layout, cfg_path: Path, bdir: Path | None, serving: Serving) -> tuple[Plan, dict]:
    """The plan of the config on the layout, and its cache manifest (the bundle's graph where given)."""
    plan = make_plan(load_config(cfg_path), layout)
    t = plan.config.text
    manifest = cache_manifest((_bundle_graph(bdir) if bdir is not None else None) or graph_manifest(plan),
                              t.kv_lora_rank, t.qk_rope_head_dim, serving)
    return plan, manifest


def _bounds(plan: Plan, manifest: dict) -> Callable[[int, int], tuple[float, float]]:
    def bounds(b: int, n: int) -> tuple[float, float]:
        r = roofline(plan, manifest, n, b)
        return r.decode.bound.value, r.prefill.bound.value

    return bounds


def performance_bounds(target: str, config: str | Path | None = None,
                       bundle: str | Path | None = None) -> Callable[[int, int], tuple[float, float]]:
    """``(batch, context) -> (TPOT, TTFT)`` lower bounds of ``target``, the ones the performance stage
    holds ``reports/performance.json`` against: the model of ``bundle`` (its config and graph),
    else ``config``, else the released K3, on the layout as written."""
    if config is not None and bundle is not None:
        raise ChecklistError("give --config or --bundle, not both (a bundle carries its own config.json)")
    bdir = Path(bundle) if bundle is not None else None
    if bdir is not None and not (bdir / CONFIG).is_file():
        raise ChecklistError(f"{bdir}: no {CONFIG}: not a bundle")
    cfg = bdir / CONFIG if bdir is not None else Path(config) if config is not None else release_config_path()
    return _bounds(*_plan_and_cache(load_layout(target), cfg, bdir, Serving()))


def make_checklist(target: str, config: str | Path | None = None, bundle: str | Path | None = None,
                   context: int = DEFAULT_CONTEXT, batch: int = DEFAULT_BATCH, verify_level: str = "sample",
                   verify_seed: int = 0, serving: Serving | None = None, run: str | None = None) -> Checklist:
    """The bring-up checklist of ``target``, from a config (default: the released K3) or a bundle.

    Args:
        target (`str`): a layout name (``layouts/NAME.yaml``) or a path to a layout YAML.
        config (`Path`, optional): a released-style ``config.json``; not with ``bundle``.
        bundle (`Path`, optional): a bundle converted for ``target``: its ``config.json`` and
            ``graph_manifest.json`` are used and its manifest, goldens and reports are the evidence.
        context (`int`): tokens per request. Defaults to 131,072.
        batch (`int`): concurrent requests over the deployment. Defaults to 1.
        verify_level (`str`): how the bundle's files are checked against its manifest
            (``check.verify.LEVELS``): ``sample`` (default) re-hashes the metadata and a seeded
            sample of the weight files, ``full`` every file, ``manifest`` none (sizes only).
        verify_seed (`int`): the sample's seed.
        serving (`Serving`, optional): the engine's settings (``--kv-cache-dtype``,
            ``--gpu-memory-utilization``, ``--attention-dp``, prefix-cache policy, link); default
            a BF16 latent and the layout as written.
        run (`str`, optional): the run key (``reports/validate/KEY``) whose sign-off the numerics
            stages read; default the latest run (``bundle.signoff_runs.choose_run``).

    Example:
        >>> make_checklist("b300-tp8").capacity.tokens_fit
        1136140
    """
    if config is not None and bundle is not None:
        raise ChecklistError("give --config or --bundle, not both (a bundle carries its own config.json)")
    if context < 1 or batch < 1:
        raise ChecklistError(f"--context ({context}) and --batch ({batch}) must be positive")
    if run is not None and bundle is None:
        raise ChecklistError(f"--run {run}: a run key names a validate run of a bundle; give --bundle too")
    serving = serving or Serving()
    serving.check()
    written = load_layout(target)
    layout = apply_to_layout(written, serving)
    bdir = Path(bundle) if bundle is not None else None
    if bdir is not None:
        if not (bdir / CONFIG).is_file():
            raise ChecklistError(f"{bdir}: no {CONFIG}: not a bundle (convert one with `k3bundle convert SOURCE "
                                 f"--target {layout.name} --out {bdir}`)")
        mpath = bdir / MANIFEST
        if mpath.is_file():
            try:
                made_for = read_json(mpath).get("target")
            except (JsonFileError, AttributeError):
                made_for = None  # the conversion stage reports an unreadable manifest
            if made_for is not None and made_for != layout.name:
                raise ChecklistError(f"{bdir} was converted for layout {made_for!r}, not {layout.name!r}; run "
                                     f"`k3bundle checklist --target {made_for} --bundle {bdir}`")
        cfg_path = bdir / CONFIG
    else:
        cfg_path = Path(config) if config is not None else release_config_path()
    if bdir is not None and layout.parallel != written.parallel:
        raise ChecklistError(f"--attention-dp {serving.attention_dp}: {bdir} was converted for attention_dp "
                             f"{written.parallel.attention_dp}; its weights are placed for that split")
    plan, manifest = _plan_and_cache(layout, cfg_path, bdir, serving)
    cap = capacity(plan, manifest, context, batch, serving)
    roof = roofline(plan, manifest, context, batch)
    bounds = _bounds(plan, manifest)

    def verify_bundle(b):
        return verify(b, level=verify_level, seed=verify_seed)

    signoff, how, runs = None, "no bundle given (--bundle)", []
    if bdir is not None:
        try:
            signoff, how, runs = choose_run(bdir, run)
        except BundleError as e:
            raise ChecklistError(str(e)) from None
    stages = evaluate_stages(layout.name, cap.passed, cap.verdict, bdir, bounds, verify_bundle, signoff, how)
    model = str(cfg_path) if config is not None or bdir is not None else f"released Kimi K3 config ({cfg_path.name})"
    kernels = kernel_coverage(plan, manifest)
    report, why = read_kernel_report(bdir, layout.name) if bdir is not None else (None, "no bundle given (--bundle)")
    if report is None and bdir is not None:
        why += f"; run `k3bundle kernels --target {layout.name} --backend B --out {bdir}/reports`"
    release = plan.config.text == load_config(release_config_path()).text
    what = (f"the bundle's model ({cfg_path})" if bdir is not None else
            f"the config {cfg_path}" if config is not None else f"the {model}")
    sources = figure_sources(what, plan.config.text, release, report, why, bdir is not None)
    return Checklist(layout.name, model, str(bdir) if bdir is not None else None, plan, context, batch, cap, roof,
                     kernels, stages, op_status([k.op for k in kernels], report, why), signoff, how, runs, sources,
                     vision_roofline(plan))
