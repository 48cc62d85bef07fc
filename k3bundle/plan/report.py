"""Plan a layout from a source, a config file or a preset, and print it for people."""

from __future__ import annotations

from pathlib import Path

from k3bundle.config import load_config
from k3bundle.layouts import load_layout
from k3bundle.plan.placement import Plan, make_plan, plan_for_source
from k3bundle.presets import preset_config
from k3bundle.checkpoint import SourceCheckpoint


def plan_from(target: str, source: Path | None = None, config: Path | None = None,
              preset: str | None = None) -> Plan:
    """The plan of ``target`` for a checkpoint directory, a config.json or a built-in preset."""
    layout = load_layout(target)
    if source is not None:
        with SourceCheckpoint(source) as src:
            return plan_for_source(src, layout)
    if config is not None:
        return make_plan(load_config(config), layout)
    return make_plan(preset_config(preset), layout)


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB"


def plan_text(plan: Plan, s: dict) -> str:
    lay, par = plan.layout, plan.layout.parallel
    lines = [
        f"target {lay.name}: {lay.card.count} x {lay.card.name}, {_gb(lay.card.hbm_bytes)} each "
        f"({_gb(plan.usable_bytes)} usable after a {_gb(lay.runtime_reserve_bytes)} runtime reserve)",
        f"parallel: tp {par.tp}, attention_dp {par.attention_dp}, ep {par.ep} (moe_tp {par.moe_tp}), "
        f"pp {par.pp} (layers per stage {list(plan.stage_layers)}); every layout rule holds",
        f"source {_gb(s['source_bytes'])} -> device {_gb(s['total_device_bytes'])} over {len(plan.ranks)} ranks "
        f"({s['targets']:,} placements)",
        "",
        f"{'rank':>4} {'stage':>5} {'tp':>3} {'ep':>3} {'mtp':>3} {'weights':>11} {'experts':>11} "
        f"{'other':>10} {'headroom':>11}  fits",
    ]
    for r in s["ranks"]:
        other = r["weight_bytes"] - r["by_group"]["routed_experts"]
        lines.append(f"{r['rank']:>4} {r['stage']:>5} {r['tp_rank']:>3} {r['ep_rank']:>3} {r['moe_tp_rank']:>3} "
                     f"{_gb(r['weight_bytes']):>11} {_gb(r['by_group']['routed_experts']):>11} {_gb(other):>10} "
                     f"{_gb(r['headroom_bytes']):>11}  {'yes' if r['fits'] else 'NO'}")
    w = s["worst_rank"]
    verdict = "FITS" if s["fits"] else "DOES NOT FIT"
    lines += ["", f"{verdict}: the largest rank ({w}) needs {_gb(s['max_rank_bytes'])} of weights; a "
                  f"{lay.card.name} leaves {_gb(plan.usable_bytes)} (hbm {_gb(lay.card.hbm_bytes)} - reserve "
                  f"{_gb(lay.runtime_reserve_bytes)})"]
    return "\n".join(lines)
