"""Pull from a local directory: the same verified record as a Hub pull, for files already on disk.

``k3bundle pull ./ckpt --out DIR`` copies every file, hashing each byte in the loop that
copies it (one read of the source, no read of the copy); ``k3bundle pull ./ckpt`` (no
``--out``, or ``--out`` equal to the source) hashes in place and writes ``source.json``
next to the files. No file is ever imported or executed; ``*.py`` files are bytes.

What is listed: every regular file under the directory, recursively, except ``.git/``,
``.cache/huggingface/`` (metadata ``huggingface-cli download --local-dir`` leaves), a
``source.json`` that k3bundle wrote, and, in a directory that is itself a k3bundle pull
output, its state file and ``*.part``/``*.bad`` leftovers. Symlinks are followed only when
they resolve inside the directory (or, for a Hugging Face cache snapshot
``models--ORG--NAME/snapshots/SHA``, inside ``models--ORG--NAME``, where its ``blobs/``
live); anything else is refused, as are FIFOs, sockets and devices.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from k3bundle.io.files import is_temp_of
from k3bundle.pull.download import Context, Hasher, Wanted, finish_part, hash_into, prepare_target
from k3bundle.pull.errors import PullError
from k3bundle.pull.hub import license_of
from k3bundle.pull.paths import BAD_SUFFIX, PART_SUFFIX, SOURCE_JSON, STATE_FILE, check_name, selected
from k3bundle.pull.record import FileEntry, is_ours
from k3bundle.pull.state import stat_key

CHUNK = 1 << 20


def containment_root(root: Path) -> Path:
    """Where symlinks may point: the directory, or the repo folder of an HF cache snapshot."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        return root.parent.parent
    return root


def list_local(src: str | Path, include: Sequence[str] = (), exclude: Sequence[str] = ()
               ) -> tuple[list[Wanted], int]:
    """The files of a local checkpoint as ``Wanted`` items (sorted), and how many the globs left out."""
    src = Path(src)
    root = Path(os.path.realpath(src))
    if not root.is_dir():
        raise PullError(f"{src}: not a directory")
    contain = containment_root(root)
    k3_out = (root / STATE_FILE).exists()
    items: list[Wanted] = []
    skipped = 0

    def add(rel: str, path: Path) -> None:
        nonlocal skipped
        if not selected(rel, include, exclude):
            skipped += 1
            return
        st = os.stat(path)
        items.append(Wanted(path=rel, size=st.st_size, src=path, src_stat=tuple(stat_key(st))))

    def walk(d: Path, rel: str, seen: frozenset) -> None:
        nonlocal skipped
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            name = e.name
            relp = f"{rel}/{name}" if rel else name
            path = d / name
            if (rel == "" and name == ".git") or (rel == ".cache" and name == "huggingface"):
                continue
            if rel == "" and (name == STATE_FILE or is_temp_of(name, SOURCE_JSON)
                              or (name == SOURCE_JSON and is_ours(path))):
                continue
            if k3_out and (name.endswith(PART_SUFFIX) or name.endswith(BAD_SUFFIX)):
                continue
            check_name(relp)
            if e.is_symlink():
                target = Path(os.path.realpath(path))
                if not target.is_dir() and not selected(relp, include, exclude):
                    skipped += 1  # an excluded link is never followed
                    continue
                if not target.is_relative_to(contain):
                    raise PullError(f"{relp}: symlink to {target} points outside {src}; "
                                    f"copy the file in, remove the link, or --exclude it")
                if not target.exists():
                    raise PullError(f"{relp}: broken symlink to {target}")
                if target.is_dir():
                    if target in seen:
                        raise PullError(f"{relp}: symlink loop back to {target}")
                    walk(target, relp, seen | {target})
                elif target.is_file():
                    add(relp, target)
                else:
                    raise PullError(f"{relp}: symlink to {target}, which is not a regular file")
            elif e.is_dir(follow_symlinks=False):
                walk(path, relp, seen | {Path(os.path.realpath(path))})
            elif e.is_file(follow_symlinks=False):
                add(relp, path)
            elif selected(relp, include, exclude):
                raise PullError(f"{relp}: not a regular file (FIFO, socket or device); remove it or --exclude it")

    walk(root, "", frozenset({root}))
    items.sort(key=lambda w: w.path)
    return items, skipped


def _check_unchanged(w: Wanted, n: int) -> None:
    st = os.stat(w.src)
    if n != w.size or list(stat_key(st)) != list(w.src_stat):
        raise PullError(f"{w.path}: changed while k3bundle was reading it ({w.size:,} bytes listed, "
                        f"{n:,} read); rerun when nothing writes to the source")


def hash_in_place(w: Wanted, ctx: Context) -> FileEntry:
    """In-place pull: hash the file where it is (one read)."""
    h = Hasher(ctx.counters)
    n = hash_into(h, w.src, ctx.counters)
    _check_unchanged(w, n)
    ctx.counters.finished("hashed")
    return w.entry(h.hexdigests()[0], None)


def copy_file(w: Wanted, ctx: Context) -> FileEntry:
    """Copy ``w.src`` to ``out/w.path`` through the hasher (one read of the source, none of the copy)."""
    final, part, kept = prepare_target(w, ctx)
    if kept is not None:
        return kept
    h = Hasher(ctx.counters)
    n = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(w.src, "rb", buffering=0) as fin, open(part, "wb") as fout:
        while True:
            k = fin.readinto(view)
            if not k:
                break
            h.update(view[:k])
            fout.write(view[:k])
            n += k
            ctx.counters.add(bytes_read=k)
            ctx.counters.advance(k)
        fout.flush()
        os.fsync(fout.fileno())
    _check_unchanged(w, n)
    return finish_part(w, part, final, h, ctx, "copied")


def local_license(root: Path) -> str | None:
    """``license`` from README.md's YAML front matter (parsed as data with ``yaml.safe_load``)."""
    readme = root / "README.md"
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith("---"):
        return None
    end = text.find("\n---", 3)
    if end < 0:
        return None
    import yaml

    try:
        meta = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return None
    return license_of(meta if isinstance(meta, dict) else None)

