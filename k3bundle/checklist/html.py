"""The checklist as a page (``reports/checklist.html``): capacity as a stacked bar per rank, the
roofline tables, kernel coverage with each op's conformance status, fault paths and soak, and the
nine stages with their evidence or the command that produces what is missing.
"""

from __future__ import annotations

from k3bundle.bundle.signoff_runs import describe_run
from k3bundle.checklist.build import Checklist
from k3bundle.checklist.capacity import CAPACITY_MARGIN
from k3bundle.checklist.conformance import kernel_conformance
from k3bundle.checklist.faults import FAULT_PATHS, SOAK_REQUIREMENTS
from k3bundle.checklist.quantity import Quantity, gb
from k3bundle.checklist.render import engine_lines, vision_intro
from k3bundle.checklist.roofline import Phase
from k3bundle.file_names import GRAPH_MANIFEST, SIGNOFF_RUNS_DIR, SOAK_REPORT
from k3bundle.pages.html import COLOURS, badge, esc, meta, page, table
from k3bundle.pages.svg import Mark, stacked_bars


def _quantities(rows: list[Quantity]) -> str:
    return table(["quantity", "value", "formula"],
                 [[esc(q.label), f"<b>{esc(q.text)}</b>", f"<span class='mono'>{esc(q.formula)}</span>"]
                  for q in rows], num=(1,))


def _source(cl: Checklist, section: str) -> str:
    """Where a section's figures come from (``build.figure_sources``), above them."""
    return f"<p class='source'><b>Source:</b> {esc(cl.sources[section])}</p>"


def _cmd(step: str) -> str:
    return f"<code>{esc(step)}</code>" if step.startswith("k3bundle ") else esc(step)


def capacity_chart(cl: Checklist) -> str:
    """One bar per rank: weights, cache and state for the batch, free, runtime reserve; the line
    where the free memory would fall below the capacity margin."""
    plan, cap = cl.plan, cl.capacity
    hbm, reserve, usable = cap.hbm, cap.reserve, cap.usable
    by_stage = {s.stage: s for s in cap.stages}
    rows = []
    for info, weights in zip(plan.ranks, plan.rank_bytes):
        cache = by_stage[info.stage].batch_bytes
        free = usable - weights - cache
        margin = free / usable
        segs = [(min(weights, usable), COLOURS["weights"], "weights"),
                (min(cache, max(usable - weights, 0)), COLOURS["cache"], "cache and state"),
                (max(free, 0), COLOURS["free"], "free"), (reserve, COLOURS["reserve"], "runtime reserve")]
        if free < 0:
            segs.insert(2, (0, COLOURS["fail"], "over"))
        note = f"margin {margin:.1%}" + (" ✗" if margin < CAPACITY_MARGIN else "")
        label = f"rank {info.rank}" + (f" (stage {info.stage})" if plan.layout.parallel.pp > 1 else "")
        rows.append((label, segs, note))
    need = usable * (1 - CAPACITY_MARGIN)
    svg = stacked_bars(rows, hbm, [Mark(need, f"{CAPACITY_MARGIN:.0%} margin", COLOURS["fail"])],
                       legend=[("weights", COLOURS["weights"]), ("cache and state", COLOURS["cache"]),
                               ("free", COLOURS["free"]), ("runtime reserve", COLOURS["reserve"])])
    return (f"<figure class='chart capacity'>{svg}<figcaption>HBM per rank ({gb(hbm)}): weights in their stored "
            f"formats, the KV latent and KDA state for batch {cl.batch:,} × {cl.context:,} tokens, what is left free, "
            f"and the runtime reserve. Free memory must reach past the dashed line ({CAPACITY_MARGIN:.0%} of the "
            f"{gb(usable)} usable).</figcaption></figure>")


def _phase(ph: Phase, title: str) -> str:
    parts = [f"<h3>{esc(title)}: batch {ph.batch:,}, context {ph.context:,} tokens</h3>",
             f"<p><b>{esc(ph.bound.label)} {esc(ph.bound.text)}</b> ({esc(ph.bound_by)}-bound)</p>",
             _quantities(ph.bytes), _quantities(ph.flops), _quantities([ph.t_memory, ph.t_compute, ph.bound, *ph.extra])]
    if len(ph.stages) > 1:
        parts.append(table(["stage", "ranks", "bytes", "FLOPs", "t_memory", "t_compute", "bound"],
                           [[str(s["stage"]), str(s["ranks"]), gb(s["bytes"]), f"{s['flops']:.3e}",
                             f"{s['t_memory_s'] * 1e3:.3f} ms", f"{s['t_compute_s'] * 1e3:.3f} ms",
                             f"{s['bound_s'] * 1e3:.3f} ms"] for s in ph.stages], num=(1, 2, 3, 4, 5, 6)))
    return "\n".join(parts)


def _vision(cl: Checklist) -> str:
    """The vision tower's per-image bound (nothing for a model without one)."""
    v = cl.vision
    if v is None:
        return ""
    return "\n".join(["<h3>Vision tower and projector (per image)</h3>", f"<p>{esc(vision_intro(cl))}</p>",
                      f"<p><b>{esc(v.bound.label)} {esc(v.bound.text)}</b></p>", _quantities(v.bytes),
                      _quantities(v.flops), _quantities([v.t_memory, v.t_compute, v.bound])])


def _kernels(cl: Checklist) -> str:
    signoff = cl.signoff.doc if cl.signoff is not None else None
    why = cl.signoff_how if cl.signoff is None else f"run {cl.signoff.key}: {cl.signoff.why}"
    if signoff is None and cl.bundle:
        why += f"; run `k3bundle validate {cl.bundle}`"
    status = {c.op: c for c in kernel_conformance([k.op for k in cl.kernels], signoff, cl.plan.config.text, why)}
    ops = {k.op: cl.op_conformance.get(k.op, ("open", "")) for k in cl.kernels}
    rows = [[f"<code>{esc(k.op)}</code>", str(k.layers or "–"), badge(status[k.op].status),
             esc(status[k.op].detail), badge(ops[k.op][0]), esc(ops[k.op][1]), esc(k.shapes), esc(k.spec)]
            for k in cl.kernels]
    return table(["op", "layers", "in the model", "evidence", "op conformance", "evidence (k3bundle kernels)",
                  "shapes per rank", "spec"], rows, cls="sortable",
                 num=(1,), row_cls=["bad" if "fail" in (status[k.op].status, ops[k.op][0]) else "" for k in cl.kernels])


def _stages(cl: Checklist) -> str:
    items = []
    for i, s in enumerate(cl.stages, 1):
        text = (esc(s.evidence) if s.done else
                f"<b>missing:</b> {esc(s.missing)}" + (f"<br><b>next:</b> {_cmd(s.next)}" if s.next else "")
                + (f"<br><span class='muted'>so far: {esc(s.evidence)}</span>" if s.evidence else ""))
        notes = "".join(f"<li>{esc(n)}</li>" for n in s.notes)
        items.append(f"<tr{'' if s.done else ' class=open'}><td class=num>{i}</td><td>{badge('done' if s.done else 'open')}"
                     f"</td><td><b>{esc(s.title)}</b></td><td>{text}{f'<ul>{notes}</ul>' if notes else ''}</td></tr>")
    runs = ""
    if len(cl.signoff_runs) > 1:
        runs = (f"<p>Validate runs in <code>{SIGNOFF_RUNS_DIR}/</code>, newest first (<code>--run KEY</code> reads "
                "another):</p>" + table(["run key", "what ran", "finished", "verdict", ""],
                                        [[f"<code>{esc(r.key)}</code>", esc(describe_run(r.run) if r.doc else r.why),
                                          esc(r.finished), badge("pass" if (r.doc or {}).get("passed") else "fail")
                                          if r.doc else "–", "<b>read</b>" if r is cl.signoff else ""]
                                         for r in cl.signoff_runs]))
    return ("<table class='stages'><thead><tr><th class=num>#</th><th>status</th><th>stage</th><th>evidence</th>"
            f"</tr></thead><tbody>{''.join(items)}</tbody></table>{runs}")


def _faults(cl: Checklist) -> str:
    by_key = {s.key: s for s in cl.stages}
    noted = {n.split(":", 1)[0]: n for n in by_key["fault_paths"].notes}
    rows = [[badge("done" if f.key in noted else "open"), f"{esc(f.title)} <code>{esc(f.key)}</code>",
             esc(f.inject), esc(f.clear_error), esc(noted.get(f.key, "–"))] for f in FAULT_PATHS]
    soak = by_key["soak"]
    return (table(["", "fault", "how to inject", "a clear error path means", "evidence"], rows)
            + f"<p>Soak (<code>{SOAK_REPORT}</code>): {badge('done' if soak.done else 'open')} "
            + esc(soak.evidence if soak.done else soak.missing) + "</p><ul>"
            + "".join(f"<li>{esc(k.replace('_', ' '))}: {esc(r)}</li>" for k, r in SOAK_REQUIREMENTS) + "</ul>")


def to_html(cl: Checklist) -> str:
    """The whole checklist as a self-contained page."""
    lay = cl.plan.layout
    card, par = lay.card, lay.parallel
    cap, roof = cl.capacity, cl.roofline
    verdict = "PASS" if cap.passed else "FAIL"
    peaks = ", ".join(f"{k} {v / 1e15:g} PFLOP/s" for k, v in card.peak_flops.items())
    body = [
        f"<h1><span class='verdict {verdict.lower()}'>{verdict}</span>Bring-up checklist: {esc(cl.target)}</h1>",
        f"<p class='sub'>capacity {verdict.lower()} · TPOT ≥ {esc(roof.decode.bound.text)} · TTFT ≥ "
        f"{esc(roof.prefill.bound.text)} · {cl.ticked} of {len(cl.stages)} stages ticked</p>",
        meta([("target", f"{card.count} × {esc(card.name)}: {gb(card.hbm_bytes)} HBM at "
                         f"{card.hbm_bandwidth_bytes_per_s / 1e12:g} TB/s, links "
                         f"{card.link_bandwidth_bytes_per_s / 1e12:g} TB/s, peak {esc(peaks)} per card"),
              ("parallel", f"tp {par.tp}, attention_dp {par.attention_dp}, ep {par.ep} (moe_tp {par.moe_tp}), "
                           f"pp {par.pp} (layers per stage {list(cl.plan.stage_layers)})"),
              ("model", esc(cl.model)), ("bundle", f"<code>{esc(cl.bundle)}</code>" if cl.bundle else "–"),
              *([("sign-off read", esc(cl.signoff_read()))] if cl.bundle else []),
              ("workload", f"batch {cl.batch:,} × context {cl.context:,} tokens")]),
        "<nav class='noprint'><a href='#capacity'>capacity</a> · <a href='#roofline'>roofline</a> · "
        "<a href='#kernels'>kernels</a> · <a href='#faults'>fault paths</a> · <a href='#stages'>stages</a></nav>",
        "<h2 id='stages'>Stages (sign-off order)</h2>", _source(cl, "stages"), _stages(cl),
        "<h2 id='capacity'>1. Capacity</h2>", _source(cl, "capacity"),
        f"<div class='callout{' ok' if cap.passed else ''}'>{esc(cap.verdict)}</div>", capacity_chart(cl),
        _quantities(cap.quantities), f"<p class='muted'>{esc(engine_lines(cap)[0].replace('`', ''))}</p>",
        "<h3>Prefix cache: KDA snapshots beside the latent</h3>", _quantities(cap.prefix_cache),
        "<h3>Prefill/decode handoff</h3>", _quantities(cap.handoff),
        "<h2 id='roofline'>2. Roofline lower bounds</h2>", _source(cl, "roofline"),
        f"<p class='muted'>Decode GEMMs: {roof.gemm_flops_per_token:,.0f} FLOP per token (the schema's active "
        f"parameters: {roof.active_params:,}). Communication, norms, AttnRes and launch overheads are left out, so "
        "every number is a lower bound (docs/bring-up.md).</p>",
        _phase(roof.decode, "Decode (per output token)"), _phase(roof.prefill, "Prefill (to the first token)"),
        _vision(cl),
        "<h2 id='kernels'>3. Kernel coverage</h2>", _source(cl, "kernels"),
        f"<p class='muted'>Primitives the target must implement (<code>{GRAPH_MANIFEST}</code> custom_ops), shapes "
        "per rank; an op with a backend contract in its notation (docs/kernels.md \"Op contracts\": arguments → "
        "results, T tokens in a step, B requests, N sequences, S keys attended; no dtype: the activation dtype); "
        "'in the model': from the checks of the sign-off read (above) that exercise each op, on the bundle's own "
        "model; 'op conformance': from <code>k3bundle kernels</code>, at the shapes the source line names.</p>",
        _kernels(cl),
        "<h2 id='faults'>4. Fault paths and soak</h2>", _faults(cl),
    ]
    return page(f"k3bundle checklist: {cl.target}", "\n".join(body))
