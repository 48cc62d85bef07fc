"""``pull``: one call from a repo id or a directory to a verified folder with ``source.json``."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from k3bundle.pull.download import Context, Counters, Http, Progress, Wanted, fetch_hub_file, run_pool
from k3bundle.pull.errors import PullError
from k3bundle.pull.hub import list_hub
from k3bundle.pull.local import copy_file, hash_in_place, list_local, local_license
from k3bundle.pull.paths import SOURCE_JSON, check_collisions, check_name, selected, target_path
from k3bundle.io.files import fsync_dir
from k3bundle.io.strict_json import read_json
from k3bundle.pull.record import SourceRecord, is_ours, write_source
from k3bundle.pull.state import PullState


@dataclass
class PullResult:
    """What a pull wrote and what it cost. ``record`` is exactly what ``source.json`` holds."""

    out: Path
    source_json: Path
    record: SourceRecord
    counters: Counters
    seconds: float
    listed: int        # files the source lists
    in_place: bool = False

    def summary(self) -> dict:
        c, r = self.counters, self.record
        return {
            "out": str(self.out), "source_json": str(self.source_json), "kind": r.kind,
            "repo_id": r.repo_id, "revision": r.revision, "commit": r.commit, "license": r.license,
            "in_place": self.in_place, "files": len(r.files), "listed": self.listed,
            "complete": r.complete, "bytes": r.total_size,
            "actions": dict(sorted(c.actions.items())),
            "bytes_downloaded": c.bytes_downloaded, "bytes_read": c.bytes_read,
            "bytes_hashed": c.bytes_hashed, "bytes_discarded": c.bytes_discarded,
            "seconds": round(self.seconds, 3),
        }


def looks_local(source: str) -> bool:
    """A directory that exists, or something spelled like a path (so a typo is not sent to the Hub)."""
    if Path(source).expanduser().is_dir():
        return True
    return source.startswith((".", "/", "~")) or source.endswith("/") or source.count("/") > 1


def pull(source: str | Path, out: str | Path | None = None, *, revision: str | None = None,
         include: Sequence[str] = (), exclude: Sequence[str] = (), workers: int = 8, retries: int = 5,
         recheck: bool = False, token: str | bool | None = None, progress: Progress | None = None) -> PullResult:
    """Pull a Hub repo (``org/name``) or a local directory; see :func:`pull_hub`, :func:`pull_local`."""
    s = str(source)
    if looks_local(s):
        if not Path(s).expanduser().is_dir():
            raise PullError(f"{s}: no such directory (a Hub repo id looks like org/name)")
        if revision is not None:
            raise PullError(f"{s}: --revision applies to Hub pulls; a local directory has no revisions")
        return pull_local(Path(s).expanduser(), out, include=include, exclude=exclude, workers=workers,
                          recheck=recheck, progress=progress)
    if out is None:
        raise PullError(f"{s}: pass --out DIR, the folder to download into (k3bundle does not use the HF cache)")
    return pull_hub(s, out, revision=revision, include=include, exclude=exclude, workers=workers,
                    retries=retries, recheck=recheck, token=token, progress=progress)


def _check_args(workers: int, retries: int = 0) -> None:
    if workers < 1:
        raise PullError(f"--workers {workers}: needs at least 1")
    if retries < 0:
        raise PullError(f"--retries {retries}: cannot be negative")


def _prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise PullError(f"{out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PullError(f"{out}: cannot create the output folder: {e.strerror}") from None
    sj = out / SOURCE_JSON
    if sj.is_symlink() or (sj.exists() and not is_ours(sj)):
        raise PullError(f"{sj}: exists and was not written by k3bundle; move it away or pick another --out")


@contextmanager
def _locked(out: Path):
    """One pull at a time per output folder: an exclusive flock on the folder itself (no lock
    file to leave behind; the kernel drops it when the process dies, SIGKILL included)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PullError(f"{out}: another k3bundle pull is writing into this folder; wait for it to "
                            f"finish") from None
        yield
    finally:
        os.close(fd)


def _counters(items: list[Wanted], progress: Progress | None) -> Counters:
    return Counters(total_bytes=sum(w.size for w in items), total_files=len(items), progress=progress)


def _finish(out: Path, record: SourceRecord, items: list[Wanted], ctx: Context, t0: float, listed: int,
            in_place: bool = False) -> PullResult:
    for d in sorted({(out / w.path).parent for w in items}):
        fsync_dir(d)
    try:
        sj = write_source(out, record)
    except OSError as e:
        raise PullError(f"{out / SOURCE_JSON}: cannot write it: {e.strerror}") from None
    return PullResult(out=out, source_json=sj, record=record, counters=ctx.counters,
                      seconds=time.monotonic() - t0, listed=listed, in_place=in_place)


def pull_hub(repo_id: str, out: str | Path, *, revision: str | None = None, include: Sequence[str] = (),
             exclude: Sequence[str] = (), workers: int = 8, retries: int = 5, recheck: bool = False,
             token: str | bool | None = None, progress: Progress | None = None) -> PullResult:
    """Resolve ``revision`` to a commit, download the selected files of that commit into ``out``
    with each byte hashed once and checked against the Hub's record, then write source.json."""
    _check_args(workers, retries)
    t0 = time.monotonic()
    out = Path(out)
    revision = revision or "main"
    listing = list_hub(repo_id, revision, token=token)
    chosen = [f for f in listing.files if selected(f.path, include, exclude)]
    if not chosen:
        raise PullError(f"{repo_id}@{revision}: no file matches --include/--exclude "
                        f"({len(listing.files)} files listed)")
    for f in chosen:
        check_name(f.path)
    check_collisions(f.path for f in chosen)
    _prepare_out(out)
    for f in chosen:
        target_path(out, f.path)
    items = [Wanted(path=f.path, size=f.size, lfs=f.lfs, sha256=f.sha256, git_blob_sha1=f.git_blob_sha1,
                    url=f.url) for f in chosen]
    with _locked(out):
        ctx = Context(out=out, state=PullState(out), counters=_counters(items, progress), recheck=recheck,
                      retries=retries, http=Http(token), commit=listing.commit)
        entries = run_pool(items, fetch_hub_file, ctx, workers)
        record = SourceRecord(kind="hub", repo_id=repo_id, revision=revision, commit=listing.commit,
                              license=listing.license, files=tuple(entries), include=tuple(include),
                              exclude=tuple(exclude), complete=len(chosen) == len(listing.files))
        return _finish(out, record, items, ctx, t0, len(listing.files))


def pull_local(src: str | Path, out: str | Path | None = None, *, include: Sequence[str] = (),
               exclude: Sequence[str] = (), workers: int = 8, recheck: bool = False,
               progress: Progress | None = None) -> PullResult:
    """Record a local checkpoint: copy it into ``out`` through the hasher, or (``out`` None or the
    same directory) hash it in place; then write source.json."""
    _check_args(workers)
    t0 = time.monotonic()
    src = Path(src)
    root = Path(os.path.realpath(src))
    in_place = out is None or Path(os.path.realpath(out)) == root
    if not in_place and Path(os.path.realpath(out)).is_relative_to(root):
        raise PullError(f"--out {out} is inside the source {src}; pick a folder outside it, "
                        f"or leave --out off to record the directory in place")
    items, skipped = list_local(src, include, exclude)
    if not items:
        raise PullError(f"{src}: no file to pull (after --include/--exclude)")
    check_collisions(w.path for w in items)
    dest = root if in_place else Path(out)
    if in_place:
        sj = root / SOURCE_JSON
        if sj.exists() and is_ours(sj):
            prev = read_json(sj)
            if prev.get("kind") == "hub":
                raise PullError(f"{sj}: records a Hub pull of {prev.get('repo_id')}@{prev.get('commit')}; an "
                                f"in-place local pull would replace it. Re-check with `k3bundle pull "
                                f"{prev.get('repo_id')} --revision {prev.get('commit')} --out {src}` or "
                                f"copy with --out NEWDIR")
    _prepare_out(dest)
    with _locked(dest):
        ctx = Context(out=dest, state=PullState(dest), counters=_counters(items, progress), recheck=recheck)
        entries = run_pool(items, hash_in_place if in_place else copy_file, ctx, workers)
        record = SourceRecord(kind="local", repo_id=None, revision="", commit=None, license=local_license(root),
                              files=tuple(entries), include=tuple(include), exclude=tuple(exclude),
                              complete=skipped == 0)
        return _finish(dest, record, items if not in_place else [], ctx, t0, len(items) + skipped, in_place)
