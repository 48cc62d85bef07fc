"""``k3bundle pull``: pinned, hash-verified, resumable pull from the Hugging Face Hub or a local directory."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output

EXAMPLES = [
    "k3bundle pull moonshotai/Kimi-K3 --revision main --out /data/k3",
    "k3bundle pull moonshotai/Kimi-K3 --revision main --out /data/k3 --include 'config.json' --include '*token*'",
    "k3bundle pull moonshotai/Kimi-K3 --revision 0123456789abcdef0123456789abcdef01234567 --out /data/k3 --workers 16",
    "k3bundle pull ./k3-local --out /data/k3",
    "k3bundle pull /data/k3-copy   # in place: hash and write source.json next to the files",
]


@contextmanager
def byte_progress(enabled: bool):
    """A rich bar with bytes, bytes/s and ETA on stderr, only when stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("pull"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[label]}"),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("pull", total=None, label="")

        def update(done: int, total: int, label: str = "") -> None:
            bar.update(task, completed=done, total=total, label=label)

        yield update


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def pull(
    source: Annotated[str, typer.Argument(help="Hub repo id (org/name), or a local checkpoint directory.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder to write. Required for a Hub pull; "
                                             "for a local directory, leave it off to record in place.")] = None,
    revision: Annotated[str | None, typer.Option("--revision", "-r", help="Branch, tag or commit sha (Hub "
                                                 "pulls; default main). Resolved once to a commit sha.")] = None,
    include: Annotated[list[str] | None, typer.Option("--include", help="Only paths matching this fnmatch glob "
                                                      "(repeatable; '*' also matches '/').")] = None,
    exclude: Annotated[list[str] | None, typer.Option("--exclude", help="Skip paths matching this glob "
                                                      "(repeatable).")] = None,
    workers: Annotated[int, typer.Option(help="Files transferred and hashed in parallel.")] = 8,
    retries: Annotated[int, typer.Option(help="Retries per file after a dropped or short transfer "
                                         "without progress (each resumes with an HTTP Range).")] = 5,
    recheck: Annotated[bool, typer.Option(help="Re-hash files already verified by an earlier pull instead "
                                          "of trusting the state file.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Pull a checkpoint at a pinned commit, sha256-verify every byte as it streams, write source.json."""
    from k3bundle.pull import pull as do_pull

    out_ = Output(json_)
    with byte_progress(enabled=not json_) as update:
        r = do_pull(source, out, revision=revision, include=include or (), exclude=exclude or (),
                    workers=workers, retries=retries, recheck=recheck, progress=update)
    s = r.summary()
    rec = r.record
    what = (f"{rec.repo_id}@{rec.revision} (commit {rec.commit})" if rec.kind == "hub"
            else f"{source} ({'in place' if r.in_place else 'copied'})")
    acts = ", ".join(f"{v} {k}" for k, v in s["actions"].items())
    rate = s["bytes_hashed"] / s["seconds"] if s["seconds"] > 0 else 0
    partial = "" if rec.complete else f" (of {r.listed} listed: --include/--exclude)"
    out_.result(
        f"pulled {what} into {r.out}: {len(rec.files)} files{partial}, {_human(rec.total_size)}; {acts}; "
        f"hashed {_human(s['bytes_hashed'])} once ({_human(rate)}/s); wrote {r.source_json}",
        s,
    )
