"""Bytes in, hashed once: streaming Hub downloads, resume, keeping verified files, the worker pool.

Every byte that ends up under ``--out`` goes through exactly one :class:`Hasher` in this pull:

* **streamed** bytes are hashed in the loop that writes them (``hasher.update(chunk)`` then
  ``file.write(chunk)``, same buffer): nothing is read back after the download;
* a **resumed** ``NAME.part`` left by a killed pull is read once from disk to rebuild the
  hash state of its prefix (hashlib cannot save a mid-stream state), then the rest is asked
  for with ``Range: bytes=N-`` and hashed as it streams;
* a connection that **drops** inside one pull is retried with ``Range`` from the current
  offset *with the same hasher object*, so nothing is re-read at all;
* a file that is **already verified** (recorded in the state file, unchanged since) is kept
  without reading it; an existing file that is not recorded is hashed once and adopted if it
  matches, refused otherwise.

``Counters`` records ``bytes_downloaded`` (from the network), ``bytes_read`` (read from a local
disk and hashed: local sources, resumed prefixes, existing files) and ``bytes_hashed`` (fed to
sha256), so a test or ``--json`` can show that ``bytes_hashed == bytes_downloaded + bytes_read``
and, for a fresh pull, ``== total bytes``.

The GET itself uses the ``httpx`` client of ``huggingface_hub.get_session()`` (same proxy,
TLS, offline-mode and user-agent settings as every other Hub call, auth headers from
``build_hf_headers``) instead of ``hf_hub_download``: that function writes into its own cache
or ``--local-dir`` and does not hash (huggingface_hub issue #2364), so verifying afterwards
would be the second read this command exists to avoid, and it also hides the Range/resume
step. ``hf_xet`` is not used for the same reason: its bytes never pass through our hasher.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import stat as _stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from k3bundle.pull.errors import PullError
from k3bundle.pull.paths import BAD_SUFFIX, PART_SUFFIX, target_path
from k3bundle.pull.record import FileEntry
from k3bundle.pull.state import PullState, Verified, stat_key

CHUNK = 1 << 20  # 1 MiB: hashlib releases the GIL on it, and 8 workers hold 8 MiB
_HEX = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")

Progress = Callable[[int, int, str], None]


# ---------------------------------------------------------------- counting, hashing


@dataclass
class Counters:
    """What one pull did, thread-safe. ``bytes_hashed`` is the number of bytes fed to sha256."""

    total_bytes: int = 0
    total_files: int = 0
    bytes_downloaded: int = 0
    bytes_read: int = 0
    bytes_hashed: int = 0
    bytes_discarded: int = 0   # downloaded or hashed, then thrown away (server ignored Range, bad resume)
    actions: dict = field(default_factory=dict)
    progress: Progress | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    _done: int = 0
    _files_done: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def advance(self, n: int) -> None:
        if self.cancel.is_set():
            raise PullError("pull cancelled")
        with self._lock:
            self._done += n
            done, files = self._done, self._files_done
        if self.progress is not None:
            self.progress(done, self.total_bytes, f"{files}/{self.total_files} files")

    def rewind(self, n: int) -> None:
        self.advance(-n)

    def finished(self, action: str) -> None:
        with self._lock:
            self.actions[action] = self.actions.get(action, 0) + 1
            self._files_done += 1
        self.advance(0)


class Hasher:
    """sha256 of the bytes, plus the git blob sha1 when the Hub gave one to check against.

    ``git blob sha1 = sha1(b"blob <size>\\0" + content)``: what the Hub lists as ``oid`` for a
    non-LFS file. Both digests are fed from the same buffer: still one pass over the bytes.
    """

    def __init__(self, counters: Counters, git_size: int | None = None):
        self.counters = counters
        self.git_size = git_size
        self.reset()

    def reset(self) -> None:
        self.sha256 = hashlib.sha256()
        self.sha1 = hashlib.sha1(b"blob %d\x00" % self.git_size) if self.git_size is not None else None
        self.n = 0

    def update(self, b: bytes | memoryview) -> None:
        self.sha256.update(b)
        if self.sha1 is not None:
            self.sha1.update(b)
        self.n += len(b)
        self.counters.add(bytes_hashed=len(b))

    def hexdigests(self) -> tuple[str, str | None]:
        return self.sha256.hexdigest(), (self.sha1.hexdigest() if self.sha1 is not None else None)


def hash_into(hasher: Hasher, path: Path, counters: Counters, limit: int | None = None,
              progress: bool = True) -> int:
    """Feed ``path`` (its first ``limit`` bytes) to ``hasher``: one read, counted in ``bytes_read``."""
    n = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while limit is None or n < limit:
            want = CHUNK if limit is None else min(CHUNK, limit - n)
            k = f.readinto(view[:want])
            if not k:
                break
            hasher.update(view[:k])
            n += k
            counters.add(bytes_read=k)
            if progress:
                counters.advance(k)
    return n


def short(h: str | None) -> str:
    return (h[:12] + "…") if h else "none"


# ---------------------------------------------------------------- one wanted file


@dataclass(frozen=True)
class Wanted:
    """A file the pull must produce at ``out/path`` (from the Hub, or copied from ``src``)."""

    path: str
    size: int
    lfs: bool = False
    sha256: str | None = None         # expected content sha256 (Hub LFS files)
    git_blob_sha1: str | None = None  # expected git blob id (Hub non-LFS files)
    url: str | None = None
    src: Path | None = None           # local pulls: the file to copy or hash
    src_stat: tuple | None = None

    def entry(self, sha256: str, git_blob_sha1: str | None) -> FileEntry:
        return FileEntry(path=self.path, size=self.size, sha256=sha256, lfs=self.lfs,
                         git_blob_sha1=git_blob_sha1 if self.git_blob_sha1 else None, url=self.url)


def mismatch(w: Wanted, sha256: str, sha1: str | None) -> str | None:
    """The one-line reason the digests disagree with what the record expects, or None."""
    if w.sha256 is not None and sha256 != w.sha256:
        who = "the source has" if w.src is not None else "the Hub records"
        return f"sha256 mismatch: got {short(sha256)}, {who} {short(w.sha256)}"
    if w.git_blob_sha1 is not None and sha1 != w.git_blob_sha1:
        return f"git blob sha1 mismatch: got {short(sha1)}, the Hub records {short(w.git_blob_sha1)}"
    return None


@dataclass
class Context:
    out: Path
    state: PullState
    counters: Counters
    recheck: bool = False
    retries: int = 5
    http: "Http | None" = None
    commit: str | None = None


def keep_existing(w: Wanted, final: Path, ctx: Context) -> FileEntry | None:
    """If ``final`` already exists: keep it (verified before, unchanged), adopt it (hashes to the
    expected value, one read), or refuse (it differs). None if it does not exist."""
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return None
    if _stat.S_ISLNK(st.st_mode) or not _stat.S_ISREG(st.st_mode):
        raise PullError(f"{w.path}: exists in {ctx.out} and is not a regular file (a symlink or folder); "
                        f"move it away and rerun")
    rec = ctx.state.get(w.path)
    if (rec is not None and not ctx.recheck and rec.size == w.size and rec.stat == stat_key(st)
            and (w.sha256 is None or rec.sha256 == w.sha256)
            and (w.git_blob_sha1 is None or rec.git_blob_sha1 == w.git_blob_sha1)
            and (w.src is None or rec.src_stat == list(w.src_stat or ()))):
        ctx.counters.advance(w.size)
        ctx.counters.finished("kept")
        return w.entry(rec.sha256, rec.git_blob_sha1)
    if st.st_size != w.size:
        raise PullError(f"{w.path}: already in {ctx.out} with {st.st_size:,} bytes, the source has "
                        f"{w.size:,}; move it away or pull into a new --out")
    h = Hasher(ctx.counters, git_size=w.size if w.git_blob_sha1 else None)
    hash_into(h, final, ctx.counters)
    sha256, sha1 = h.hexdigests()
    if w.src is not None:  # local copy: the expected hash is the source file's
        hs = Hasher(ctx.counters)
        hash_into(hs, w.src, ctx.counters, progress=False)
        w = replace(w, sha256=hs.hexdigests()[0])
    why = mismatch(w, sha256, sha1)
    if why:
        raise PullError(f"{w.path}: already in {ctx.out} with different content ({why.split(': ', 1)[1]}); "
                        f"k3bundle does not overwrite it: move it away or pull into a new --out")
    record_verified(w, final, sha256, sha1, ctx)
    ctx.counters.finished("verified")
    return w.entry(sha256, sha1)


def record_verified(w: Wanted, final: Path, sha256: str, sha1: str | None, ctx: Context) -> None:
    ctx.state.put(w.path, Verified(size=w.size, sha256=sha256, git_blob_sha1=sha1,
                                   stat=stat_key(os.stat(final)),
                                   src_stat=list(w.src_stat) if w.src_stat else None))


def finish_part(w: Wanted, part: Path, final: Path, h: Hasher, ctx: Context, how: str) -> FileEntry:
    """Verify a complete ``.part``; rename it into place, or aside to ``.bad`` and raise."""
    sha256, sha1 = h.hexdigests()
    why = mismatch(w, sha256, sha1)
    if why:
        bad = part.with_name(final.name + BAD_SUFFIX)
        os.replace(part, bad)
        raise PullError(f"{w.path}: {why} (file kept as {bad.name})")
    os.replace(part, final)
    record_verified(w, final, sha256, sha1, ctx)
    stale = final.with_name(final.name + BAD_SUFFIX)
    if stale.exists():
        stale.unlink()
    ctx.counters.finished(how)
    return w.entry(sha256, sha1)


# ---------------------------------------------------------------- HTTP


class _Retry(Exception):
    """A transient failure: retry from the current offset (after ``wait`` s if the server said so)."""

    def __init__(self, msg: str, wait: float | None = None):
        super().__init__(msg)
        self.wait = wait


class Http:
    """The streaming GET: ``huggingface_hub.get_session()`` (an httpx client) + Hub headers."""

    def __init__(self, token: str | bool | None = None):
        from huggingface_hub import constants, get_session
        from huggingface_hub.utils import build_hf_headers

        self.session = get_session()
        if not hasattr(self.session, "stream"):
            import huggingface_hub

            raise PullError(f"k3bundle pull needs huggingface_hub >= 1.0 (an httpx client); found "
                            f"{huggingface_hub.__version__}: pip install -U huggingface_hub")
        mod = importlib.import_module(type(self.session).__module__.split(".")[0])
        self.transient = (mod.TransportError,)
        # identity: the bytes on the wire are the bytes on disk, Content-Length is the file's,
        # and Range offsets mean file offsets (gzip would break all three).
        self.headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
        self.timeout = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
        self.backoff = 0.1


def _norm_etag(v: str | None) -> str | None:
    if not v:
        return None
    v = v.strip()
    if v.startswith("W/"):
        v = v[2:]
    return v.strip('"').lower()


def _stream_once(w: Wanted, t: "_Transfer", ctx: Context) -> None:
    """One GET from ``t.pos``; appends to ``t.f`` and ``t.h``; raises _Retry on transient trouble."""
    http = ctx.http
    headers = dict(http.headers)
    if t.pos:
        headers["Range"] = f"bytes={t.pos}-"
    with http.session.stream("GET", w.url, headers=headers, follow_redirects=True,
                             timeout=http.timeout) as r:
        status = r.status_code
        if status in (408, 429) or status >= 500:
            after = r.headers.get("Retry-After", "")
            raise _Retry(f"HTTP {status}", wait=min(float(after), 60.0) if after.isdigit() else None)
        if status == 416:
            raise PullError(f"{w.path}: the server refused byte range {t.pos:,}- (HTTP 416): it has fewer "
                            f"bytes than the {w.size:,} the Hub records (partial kept as {t.part.name})")
        if status >= 400:
            hint = " (gated or private: log in with `hf auth login` or set HF_TOKEN)" if status in (401, 403) else ""
            raise PullError(f"{w.path}: HTTP {status} from {w.url}{hint}")
        first = r.history[0] if r.history else r
        commit = first.headers.get("X-Repo-Commit")
        if ctx.commit and commit and commit != ctx.commit:
            raise PullError(f"{w.path}: the Hub served commit {commit} for a request pinned to {ctx.commit}")
        etag = _norm_etag(first.headers.get("X-Linked-Etag") or first.headers.get("ETag"))
        expected = w.sha256 or w.git_blob_sha1
        if etag and expected and _HEX.match(etag) and etag != expected:
            raise PullError(f"{w.path}: the resolve ETag {short(etag)} differs from the listing's "
                            f"{short(expected)} for commit {ctx.commit}")
        linked = first.headers.get("X-Linked-Size")
        if linked and linked.isdigit() and int(linked) != w.size:
            raise PullError(f"{w.path}: the Hub's resolve says {int(linked):,} bytes (X-Linked-Size), "
                            f"its listing says {w.size:,}")
        if t.pos and status == 200:  # Range ignored: start over (hash state included)
            t.restart(ctx)
        elif status == 206:
            m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", r.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != t.pos or (m.group(3) != "*" and int(m.group(3)) != w.size):
                raise PullError(f"{w.path}: asked for bytes {t.pos:,}- and got Content-Range "
                                f"{r.headers.get('Content-Range')!r} (file is {w.size:,} bytes)")
        elif status != 200:
            raise PullError(f"{w.path}: unexpected HTTP {status} from {w.url}")
        enc = r.headers.get("Content-Encoding", "identity").lower()
        cl = r.headers.get("Content-Length")
        if enc == "identity" and cl is not None and cl.isdigit() and int(cl) != w.size - t.pos:
            raise PullError(f"{w.path}: the server announces {int(cl) + t.pos:,} bytes (Content-Length), "
                            f"the Hub records {w.size:,}")
        # iter_bytes() without a chunk size yields what the socket delivered; with one, httpx
        # would hold up to a chunk in its own buffer and lose it when the connection drops.
        # We coalesce into 1 MiB ourselves and flush whatever arrived, error or not.
        buf = bytearray()
        try:
            for chunk in r.iter_bytes():
                if t.pos + len(buf) + len(chunk) > w.size:
                    buf = buf[:w.size - t.pos]
                    raise PullError(f"{w.path}: the server sent more than the {w.size:,} bytes the Hub "
                                    f"records (partial kept as {t.part.name})")
                buf += chunk
                if len(buf) >= CHUNK:
                    t.write(buf, ctx)
                    buf = bytearray()
        finally:
            if buf:
                t.write(buf, ctx)
    if t.pos < w.size:
        raise _Retry(f"the response ended at byte {t.pos:,}")


@dataclass
class _Transfer:
    part: Path
    f: object
    h: Hasher
    pos: int

    def write(self, b: bytearray, ctx: Context) -> None:
        """Hash and write the same buffer: the one pass over these bytes."""
        self.h.update(b)
        self.f.write(b)
        self.pos += len(b)
        ctx.counters.add(bytes_downloaded=len(b))
        ctx.counters.advance(len(b))

    def restart(self, ctx: Context) -> None:
        ctx.counters.add(bytes_discarded=self.pos)
        ctx.counters.rewind(self.pos)
        self.f.seek(0)
        self.f.truncate()
        self.h.reset()
        self.pos = 0


def prepare_target(w: Wanted, ctx: Context) -> tuple[Path, Path, FileEntry | None]:
    """(final path, its in-flight ``.part`` path, the entry of a file already there and kept)."""
    final = target_path(ctx.out, w.path)
    kept = keep_existing(w, final, ctx)
    part = final.with_name(final.name + PART_SUFFIX)
    if kept is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        if part.is_symlink() or (part.exists() and not part.is_file()):
            raise PullError(f"{w.path}: {part.name} exists and is not a regular file; move it away")
    return final, part, kept


def fetch_hub_file(w: Wanted, ctx: Context) -> FileEntry:
    """Produce ``out/w.path`` from the Hub, verified, or raise a PullError naming it."""
    final, part, kept = prepare_target(w, ctx)
    if kept is not None:
        return kept
    h = Hasher(ctx.counters, git_size=w.size if w.git_blob_sha1 else None)
    resumed = 0
    if part.exists():
        if part.stat().st_size <= w.size:
            resumed = hash_into(h, part, ctx.counters)  # the one read of the prefix
        else:
            part.unlink()
    for attempt in (0, 1):
        with open(part, "r+b" if resumed else "wb") as f:
            f.seek(resumed)
            f.truncate()
            t = _Transfer(part, f, h, resumed)
            _download_rest(w, t, ctx)
            f.flush()
            os.fsync(f.fileno())
        if attempt == 0 and resumed and mismatch(w, *h.hexdigests()):
            # The prefix on disk was bad (not the server's bytes): drop it and fetch it all once.
            ctx.counters.add(bytes_discarded=w.size)
            ctx.counters.rewind(w.size)
            h.reset()
            resumed = 0
            continue
        break
    return finish_part(w, part, final, h, ctx, "resumed" if resumed else "downloaded")


def _download_rest(w: Wanted, t: _Transfer, ctx: Context) -> None:
    http = ctx.http
    failures = 0
    while t.pos < w.size:
        before = t.pos
        try:
            _stream_once(w, t, ctx)
        except (_Retry, *http.transient) as e:
            failures = 1 if t.pos > before else failures + 1
            if failures > ctx.retries:
                raise PullError(f"{w.path}: transfer stopped at {t.pos:,} of {w.size:,} bytes after "
                                f"{failures} attempt(s) without progress ({_brief(e)}); partial kept as "
                                f"{t.part.name}, rerun to resume") from None
            wait = getattr(e, "wait", None)
            time.sleep(wait if wait is not None else min(http.backoff * 2 ** (failures - 1), 5.0))


def _brief(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {s}" if not isinstance(e, _Retry) else s


# ---------------------------------------------------------------- the pool


def run_pool(items: list[Wanted], fn: Callable[[Wanted, Context], FileEntry], ctx: Context,
             workers: int) -> list[FileEntry]:
    """Run ``fn`` over ``items`` (largest first) on ``workers`` threads. Every file is attempted;
    if any failed, raise one PullError naming the first failure and counting the rest."""
    order = sorted(items, key=lambda w: (-w.size, w.path))
    results: dict[str, FileEntry] = {}
    errors: list[tuple[str, str]] = []

    def one(w: Wanted) -> None:
        try:
            results[w.path] = fn(w, ctx)
        except PullError as e:
            errors.append((w.path, str(e)))
        except OSError as e:  # disk full, permissions: bad environment, not a bug
            errors.append((w.path, f"{w.path}: {e.strerror or e}: {e.filename or ''}".rstrip(": ")))

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="k3pull") as pool:
        futures = [pool.submit(one, w) for w in order]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            ctx.counters.cancel.set()  # running workers stop at their next chunk
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if errors:
        errors.sort()
        msg = errors[0][1]
        if len(errors) > 1:
            msg += f" [and {len(errors) - 1} more file(s) failed: {', '.join(p for p, _ in errors[1:4])}" \
                   f"{', …' if len(errors) > 4 else ''}]"
        raise PullError(msg)
    return [results[w.path] for w in sorted(items, key=lambda w: w.path)]
