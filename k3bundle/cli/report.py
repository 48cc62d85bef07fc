"""``k3bundle report diff A B``: two sign-offs side by side — which checks moved, by how much."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output
from k3bundle.io.files import write_atomic
from k3bundle.validate.diff import diff_signoffs, load_signoff, to_html, to_text

EXAMPLES = [
    "k3bundle report diff BUNDLE/reports/validate/builtin-cpu BUNDLE/reports/validate/dumps-vllm",
    "k3bundle report diff /bundles/k3/reports/validate/builtin-cpu/signoff.json /tmp/rerun/signoff.json --html diff.html",
    "k3bundle report diff BUNDLE_A BUNDLE_B --rel 0.1 --json",
]

app = typer.Typer(help="Compare sign-off reports.", no_args_is_help=True, add_completion=False)


@app.command("diff", epilog="Examples:\n\n" + "\n\n".join(f"  $ {e}" for e in EXAMPLES))
def diff(
    a: Annotated[Path, typer.Argument(help="The earlier sign-off: signoff.json, the folder holding it, or a bundle (its latest validate run).")],
    b: Annotated[Path, typer.Argument(help="The later sign-off, likewise.")],
    rel: Annotated[float, typer.Option(help="A value moved when it changed by more than this share of the larger.")] = 0.25,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the diff as a page here.")] = None,
    json_: JsonOpt = False,
) -> None:
    """Which checks changed status or moved by more than --rel between two sign-offs, per case and layer."""
    if rel < 0:
        raise typer.BadParameter(f"--rel must be ≥ 0, got {rel}")
    pa, da = load_signoff(a)
    pb, db = load_signoff(b)
    d = diff_signoffs(da, db, rel=rel, names=(str(pa), str(pb)))
    o = Output(json_)
    if html is not None:
        write_atomic(html, to_html(d))
        o.info(f"wrote {html}")
    o.result(to_text(d), d.to_dict())
