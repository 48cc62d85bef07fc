"""``k3bundle plan``: how a layout places every tensor, and bytes per rank against the card."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import ConfigOpt, JsonOpt, Output, exit_with
from k3bundle.plan.report import plan_from, plan_text

EXAMPLES = [
    "k3bundle plan --target b300-tp8 --config /ckpt/Kimi-K3/config.json",
    "k3bundle plan --target h200-tp16-ep16 --source /ckpt/Kimi-K3 --json",
    "k3bundle plan --target b200-tp8-pp2 --preset tiny --tensors",
    "k3bundle plan --target ./layouts/my-card.yaml --preset full",
]


def plan(
    target: Annotated[str, typer.Option("--target", "-t", help="Layout name (layouts/NAME.yaml) or a path to a layout YAML.")],
    source: Annotated[Path | None, typer.Option("--source", help="A checkpoint directory (headers only; no weight I/O).")] = None,
    config: ConfigOpt = None,
    preset: Annotated[str | None, typer.Option(help="A built-in config: full (the release), tiny, small or full-depth.")] = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="Also list every device tensor: rank, file, key, dtype, shape, source slice, transform.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Place every tensor on the target's ranks from shapes alone; check the layout's rules; bytes per rank vs memory.

    Exits 1 when a rank's weights exceed the card's memory minus the runtime reserve.
    """
    if sum(x is not None for x in (source, config, preset)) != 1:
        raise typer.BadParameter("give exactly one of --source, --config or --preset")
    p = plan_from(target, source=source, config=config, preset=preset)
    out = Output(json_)
    summary = p.summary()
    if tensors:
        from k3bundle.bundle.index_writer import iter_entries
        from k3bundle.plan.files import all_files

        entries = iter_entries(p, sorted(all_files(p), key=lambda f: (f.rank, f.path)))
        if json_:
            summary["tensors"] = list(entries)
        else:
            out.result(plan_text(p, summary), summary)
            for e in entries:
                s = e["source"]
                key = s.get("key") or f"{s['key_template']} for experts {s['experts'][0]}..{s['experts'][1] - 1}"
                sys.stdout.write(f"{e['rank']}\t{e['file']}\t{e['key']}\t{e['dtype']}\t{e['shape']}\t"
                                 f"{s['file']}:{key}\trows {s['rows']} cols {s['cols']}\t{e['transform']}\n")
            exit_with(0 if summary["fits"] else 1)
            return
    out.result(plan_text(p, summary), summary)
    exit_with(0 if summary["fits"] else 1)


__all__ = ["plan", "EXAMPLES"]
