"""Write a checklist to disk: Markdown and an HTML page for people, JSON beside them for machines."""

from __future__ import annotations

import json
from pathlib import Path

from k3bundle.checklist.build import DEFAULT_BATCH, DEFAULT_CONTEXT, Checklist, make_checklist
from k3bundle.checklist.errors import ChecklistError
from k3bundle.checklist.html import to_html
from k3bundle.checklist.render import to_markdown
from k3bundle.io.files import write_atomic


def save_checklist(cl: Checklist, out: str | Path) -> tuple[Path, Path, Path]:
    """Write ``cl`` as Markdown to ``out``, and as JSON and an HTML page beside it (``out`` with
    suffix ``.json``, ``.html``)."""
    out = Path(out)
    if out.suffix in (".json", ".html"):
        raise ChecklistError(f"{out}: name the Markdown file (e.g. checklist.md); the JSON and HTML are written "
                             "beside it")
    out.parent.mkdir(parents=True, exist_ok=True)
    js, page = out.with_suffix(".json"), out.with_suffix(".html")
    files = {out: to_markdown(cl), js: json.dumps(cl.to_dict(), indent=2, sort_keys=True, default=str) + "\n",
             page: to_html(cl)}  # every file rendered before any is written: no half-written output
    for path, text in files.items():
        write_atomic(path, text)
    return out, js, page


def write_checklist(target: str, config: str | Path | None = None, bundle: str | Path | None = None,
                    context: int = DEFAULT_CONTEXT, batch: int = DEFAULT_BATCH,
                    out: str | Path | None = None) -> str:
    """Make the checklist; with ``out``, write it (``save_checklist``). Returns ``Checklist.summary()``."""
    if out is not None and Path(out).suffix == ".json":
        raise ChecklistError(f"{out}: name the Markdown file (e.g. checklist.md); the JSON is written beside it")
    cl = make_checklist(target, config=config, bundle=bundle, context=context, batch=batch)
    if out is not None:
        save_checklist(cl, out)
    return cl.summary()
