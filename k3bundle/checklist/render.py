"""The checklist as Markdown: one section per part, every number beside its formula."""

from __future__ import annotations

from k3bundle.checklist.build import Checklist
from k3bundle.checklist.capacity import CAPACITY_MARGIN, Capacity
from k3bundle.checklist.faults import FAULT_PATHS, SOAK_REQUIREMENTS
from k3bundle.checklist.quantity import Quantity, gb
from k3bundle.checklist.roofline import Phase
from k3bundle.file_names import (FAULTS_REPORT, GRAPH_MANIFEST, KERNELS_REPORT, REPORTS_DIR, SIGNOFF_RUNS_DIR,
                                  SOAK_REPORT)

SECTIONS = ("Summary", "1. Capacity", "2. Roofline lower bounds", "3. Kernel coverage", "4. Fault paths and soak",
            "5. Stages (sign-off order)")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[Quantity]) -> list[str]:
    out = ["| quantity | value | formula |", "|---|---|---|"]
    out += [f"| {_cell(q.label)} | **{_cell(q.text)}** | {_cell(q.formula)} |" for q in rows]
    return out


def engine_lines(cap: Capacity) -> list[str]:
    """The engine settings the capacity numbers assume, as the engine's flags say them."""
    s = cap.serving
    f = s.gpu_memory_utilization
    return [f"Engine settings: `--kv-cache-dtype {s.kv_cache_dtype}` ({s.dtype.layout}; {s.dtype.engines}); "
            + (f"`--gpu-memory-utilization {f:g}` (the engine may use {f:g} × HBM, weights included)" if f is not None
               else "the layout's runtime reserve") + f"; attention_dp {cap.attention_dp} × attention TP {cap.tp}; "
            f"MLA pages of {s.page_tokens} tokens; handoff link {s.link_gbps:g} Gbit/s per rank."]


def _next(step: str) -> str:
    """Commands in backticks; a described step as text."""
    return f"`{step}`" if step.startswith("k3bundle ") else step


def _box(done: bool) -> str:
    return "[x]" if done else "[ ]"


def _phase(ph: Phase, title: str) -> list[str]:
    lines = [f"### {title}: batch {ph.batch:,}, context {ph.context:,} tokens", "",
             f"**{ph.bound.label} {ph.bound.text}** ({ph.bound_by}-bound)", ""]
    lines += _table(ph.bytes)
    lines += [""] + _table(ph.flops)
    lines += [""] + _table([ph.t_memory, ph.t_compute, ph.bound, *ph.extra])
    if len(ph.stages) > 1:
        lines += ["", "| stage | ranks | bytes | FLOPs | t_memory | t_compute | bound |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {s['stage']} | {s['ranks']} | {gb(s['bytes'])} | {s['flops']:.3e} | "
                  f"{s['t_memory_s'] * 1e3:.3f} ms | {s['t_compute_s'] * 1e3:.3f} ms | {s['bound_s'] * 1e3:.3f} ms |"
                  for s in ph.stages]
    return lines + [""]


def vision_intro(cl: Checklist) -> str:
    """What the vision bound is of: the image, its grid, and the rule that gives them."""
    s = cl.vision.shapes
    return (f"One {s.width:,} × {s.height:,} image, padded by the processor's size rule to {s.padded[0]:,} × "
            f"{s.padded[1]:,} (docs/vision.md): {s.grid[0]} × {s.grid[1]} = {s.patches:,} patches through "
            f"{s.blocks} blocks, {s.tokens:,} merged tokens through the projector. The tower is replicated on "
            "stage 0, so one card encodes one image: t ≥ max(weight bytes / HBM bandwidth, FLOPs / peak). "
            "Activations, norms and RoPE are left out, which keeps the bound a lower bound.")


def vision_lines(cl: Checklist) -> list[str]:
    """The vision tower's per-image bound, or nothing for a model without one."""
    if cl.vision is None:
        return []
    v = cl.vision
    return (["### Vision tower and projector (per image)", "", vision_intro(cl), "",
             f"**{v.bound.label} {v.bound.text}**", ""]
            + _table(v.bytes) + [""] + _table(v.flops) + [""] + _table([v.t_memory, v.t_compute, v.bound]) + [""])


def to_markdown(cl: Checklist) -> str:
    """The whole checklist as Markdown."""
    lay = cl.plan.layout
    card, par = lay.card, lay.parallel
    cap, roof = cl.capacity, cl.roofline
    peaks = ", ".join(f"{k} {v / 1e15:g} PFLOP/s" for k, v in card.peak_flops.items())
    lines = [
        f"# Bring-up checklist: {cl.target}", "",
        f"- target: {card.count} × {card.name}: {gb(card.hbm_bytes)} HBM at "
        f"{card.hbm_bandwidth_bytes_per_s / 1e12:g} TB/s, links {card.link_bandwidth_bytes_per_s / 1e12:g} TB/s, "
        f"peak {peaks} (per card)",
        f"- parallel: tp {par.tp}, attention_dp {par.attention_dp}, ep {par.ep} (moe_tp {par.moe_tp}), pp {par.pp} "
        f"(layers per stage {list(cl.plan.stage_layers)})",
        f"- model: {cl.model}" + (f"; bundle `{cl.bundle}`" if cl.bundle else ""),
        *([f"- sign-off read (stages per-layer numerics, end-to-end cases): {cl.signoff_read()}"] if cl.bundle else []),
        f"- workload: batch {cl.batch:,} × context {cl.context:,} tokens (`--batch`, `--context`)",
        "- every number is computed from the plan, the layout and the config; its formula is beside it "
        "(docs/bring-up.md explains each)", "",
        "## Summary", "",
        f"- {_box(cap.passed)} capacity: {cap.verdict}",
        f"- decode: time per output token ≥ **{roof.decode.bound.text}** ({roof.decode.bound_by}-bound); "
        f"prefill: time to first token ≥ **{roof.prefill.bound.text}** ({roof.prefill.bound_by}-bound)",
        f"- kernels: {len(cl.kernels)} primitives to implement",
        f"- stages: {cl.ticked} of {len(cl.stages)} ticked from evidence", "",
        "## 1. Capacity", "",
        f"Source: {cl.sources['capacity']}", "",
        f"**{cap.verdict}**", "",
    ]
    lines += _table(cap.quantities)
    if len(cap.stages) > 1:
        lines += ["", "| stage | rank | weights | free | latent/token | state/request | tokens fit | requests fit "
                      "| margin |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {s.stage} | {s.rank} | {gb(s.weights)} | {gb(s.free)} | {s.latent_per_token:,} B | "
                  f"{gb(s.state_per_request)} | {s.tokens_fit if s.tokens_fit is None else f'{s.tokens_fit:,}'} | "
                  f"{s.requests_fit:,} | {s.margin:.1%} |" for s in cap.stages]
        lines += ["", f"Tokens and requests that fit are the smallest over the stages × attention_dp; the margin is "
                      f"the smallest stage's (limit {CAPACITY_MARGIN:.0%})."]
    lines += ["", *engine_lines(cap), ""]
    lines += ["### Prefix cache: KDA snapshots beside the latent", ""] + _table(cap.prefix_cache)
    lines += ["", "### Prefill/decode handoff", ""] + _table(cap.handoff)
    lines += ["", "## 2. Roofline lower bounds", "", f"Source: {cl.sources['roofline']}", "",
              "Per pipeline stage, t_s ≥ max(max(bytes_s / ranks_s, busiest rank's bytes_s) / HBM bandwidth, "
              "Σ_p FLOPs_s,p / (ranks_s × peak_p)). One stage: that is the bound. Several: decode is bounded by the "
              "slowest stage at the batch and by the sum of the stages at batch 1 (a token crosses them in turn), "
              "prefill by the slowest stage. Communication, norms, AttnRes and launch overheads are left out, "
              "which keeps every number a lower bound. "
              f"Decode GEMMs: {roof.gemm_flops_per_token:,.0f} FLOP per token = 2 FLOP × "
              f"{roof.gemm_flops_per_token / 2:,.0f} GEMM weights used per token (the schema's active parameters: "
              f"{roof.active_params:,}; the rest are norms, convs and AttnRes vectors).", ""]
    lines += _phase(roof.decode, "Decode (per output token)")
    lines += _phase(roof.prefill, "Prefill (to the first token)")
    lines += vision_lines(cl)
    lines += ["## 3. Kernel coverage", "", f"Source: {cl.sources['kernels']}", "",
              f"Primitives the target must implement (`{GRAPH_MANIFEST}` custom_ops), shapes per rank at this layout; "
              "an op with a backend contract is shown in its notation (docs/kernels.md \"Op contracts\": arguments "
              "→ results, T tokens in a step, B requests, N sequences, S keys attended; a tensor with no dtype is in "
              f"the activation dtype). Op conformance: `{KERNELS_REPORT}` "
              f"(`k3bundle kernels --out BUNDLE/{REPORTS_DIR}`) ticks the ops it covered and passed.", "",
              "| op | decoder layers | op conformance | shapes per rank | spec |", "|---|---|---|---|---|"]
    for k in cl.kernels:
        st, ev = cl.op_conformance.get(k.op, ("open", ""))
        mark = {"pass": "[x]", "fail": "[ ] **FAIL**"}.get(st, "[ ]")
        lines.append(f"| `{k.op}` | {k.layers or '–'} | {mark} {_cell(ev)} | {_cell(k.shapes)} | {_cell(k.spec)} |")
    by_key = {s.key: s for s in cl.stages}
    fstage, sstage = by_key["fault_paths"], by_key["soak"]
    lines += ["", "## 4. Fault paths and soak", "",
              f"Each fault needs a clear error path, then re-validation (`{FAULTS_REPORT}`):", "",
              "| fault | how to inject | a clear error path means | evidence |", "|---|---|---|---|"]
    noted = {n.split(":", 1)[0]: n for n in fstage.notes}
    for f in FAULT_PATHS:
        ev = noted.get(f.key, "open")
        lines.append(f"| {_box(f.key in noted)} {f.title} (`{f.key}`) | {_cell(f.inject)} | {_cell(f.clear_error)} | "
                     f"{_cell(ev)} |")
    lines += ["", f"Soak (`{SOAK_REPORT}`): " + ("**ticked** — " + sstage.evidence if sstage.done
                                                     else "open — " + sstage.missing), ""]
    lines += [f"- {_box(sstage.done)} {key.replace('_', ' ')}: {req}" for key, req in SOAK_REQUIREMENTS]
    lines += ["", "## 5. Stages (sign-off order)", "", f"Source: {cl.sources['stages']}", ""]
    if len(cl.signoff_runs) > 1:
        lines += [f"Validate runs in `{SIGNOFF_RUNS_DIR}/`, newest first (`--run KEY` reads another):", ""]
        lines += [f"- {'**read**: ' if r is cl.signoff else ''}{r.summary()}" for r in cl.signoff_runs] + [""]
    for i, s in enumerate(cl.stages, 1):
        if s.done:
            lines.append(f"{i}. {_box(True)} **{s.title}** — {s.evidence}")
        else:
            lines.append(f"{i}. {_box(False)} **{s.title}** — missing: {s.missing.rstrip('.')}"
                         + (f"; next: {_next(s.next)}" if s.next else ""))
            if s.evidence:
                lines.append(f"   - so far: {s.evidence}")
        lines += [f"   - {n}" for n in s.notes]
    return "\n".join(lines) + "\n"
