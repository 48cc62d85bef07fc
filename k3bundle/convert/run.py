"""``k3bundle convert``: a source checkpoint + a layout -> a model bundle (docs/bundle-format.md).

Order of work, each step failing closed:

1. check the source (config, index vs every shard header, tensor schema) and ``source.json``
   (every file convert reads must be listed with its size); plan the layout (rules, capacity);
2. lock the output folder (before anything in it is touched), then open it: a new or empty
   directory, or a partial run of the *same* plan (resume); ``--force`` removes only the files
   the old manifest or journal lists. No path below ``--out`` is written or resumed through a link;
3. convert each source file (``k3bundle.convert.unit``), in worker processes when asked; a unit
   the journal records is skipped only after its outputs re-hash to the recorded sha256;
4. copy config.json / tokenizer / processor files (checked against source.json), write
   ``device_weights/layout.yaml``, ``weights.index.json`` and ``graph_manifest.json``;
5. write ``manifest.json`` last, atomically, then delete the journal. Any failure before it leaves
   no manifest; a kill between the two leaves both, which a rerun resumes. Worker processes die
   with the parent (Linux ``PR_SET_PDEATHSIG``) and SIGTERM stops the run cleanly.

The bytes of every file depend on the source bytes, the resolved layout and the k3bundle
version only: not on the worker count, the order units finish in, the time or the paths.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from k3bundle import __version__
from k3bundle.bundle.common import json_bytes
from k3bundle.bundle.graph import graph_manifest
from k3bundle.bundle.index_writer import write_index
from k3bundle.convert.errors import ConvertError
from k3bundle.convert.journal import JOURNAL, Journal, recorded
from k3bundle.convert.manifest import build_manifest, convention_file
from k3bundle.convert.source_files import SourceFiles
from k3bundle.convert.unit import TMP_SUFFIX, UnitResult, build_unit, disk_error, run_unit
from k3bundle.errors import JsonFileError
from k3bundle.file_names import CONFIG, DEVICE_DIR, GRAPH_MANIFEST, LAYOUT, MANIFEST, SOURCE_INDEX, WEIGHTS_INDEX
from k3bundle.io.files import TEMP_SUFFIX, link_in_path, sha256_file, write_atomic
from k3bundle.io.strict_json import read_json
from k3bundle.layouts import load_layout
from k3bundle.plan import Plan, plan_for_source
from k3bundle.plan.files import shard_files
from k3bundle.checkpoint import SourceCheckpoint

SKIP_SPACE_CHECK_ENV = "K3BUNDLE_SKIP_SPACE_CHECK"  # test hook: exercise a real ENOSPC mid-write

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    target: str
    world: int
    files: int
    bundle_bytes: int
    source_bytes: int
    units: int
    units_reused: int
    seconds: float
    nvfp4_requantized_blocks: int
    manifest_sha256: str


def plan_id(plan: Plan, files: SourceFiles) -> str:
    """What a partial bundle must match to be resumed: version, layout, config, index, source.json."""
    doc = {"k3bundle_version": __version__, "layout": plan.layout.to_dict(), "prefix": plan.schema.prefix,
           "config": hashlib.sha256(files.read_small(CONFIG)).hexdigest(),
           "index": hashlib.sha256(files.read_small(SOURCE_INDEX)).hexdigest(),
           "source_json": files.source_json_digest()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _lock_out(out: Path) -> int:
    """Create ``out`` if needed and take the run's lock: an exclusive ``flock`` on the folder itself,
    before anything in it is read, removed or written. Returns the descriptor holding it."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ConvertError(f"{out}: cannot create or open the output folder: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConvertError(f"{out}: another k3bundle convert is writing this bundle; wait for it to finish "
                           "or choose another --out") from None
    return fd


def _refuse_links(out: Path, paths: list[str]) -> None:
    for rel in paths:
        link = link_in_path(out, rel)
        if link is not None:
            raise ConvertError(f"{link}: is a symbolic link inside the bundle; convert never writes or "
                               "resumes through links: remove it and rerun")


def _ours(out: Path) -> set[str]:
    """Every path the bundle's manifest or journal lists, plus those two files themselves."""
    paths = {MANIFEST, JOURNAL}
    if (out / MANIFEST).is_file():
        try:
            listed = read_json(out / MANIFEST)["files"]
            paths.update(f["path"] for f in listed)
        except (JsonFileError, KeyError, TypeError):
            raise ConvertError(f"{out / MANIFEST}: unreadable, so --force cannot tell k3bundle's files from "
                               "others; remove the folder yourself or choose another --out") from None
    paths.update(recorded(out)[1])
    return {p for p in paths if isinstance(p, str) and not Path(p).is_absolute() and ".." not in Path(p).parts}


def _remove_ours(out: Path) -> None:
    """``--force``: remove only what this bundle's manifest or journal lists (and convert's temp files);
    the user's other files and folders (notes, ``validation/``, ``reports/``) stay."""
    ours = sorted(_ours(out))
    _refuse_links(out, ours)
    dirs = set()
    for rel in ours:
        (out / rel).unlink(missing_ok=True)
        dirs.update(p for p in (out / rel).parents if p != out and out in p.parents)
    _remove_temps(out)
    for d in sorted(dirs, key=lambda p: -len(p.parts)):  # deepest first; only folders left empty
        try:
            d.rmdir()
        except OSError:
            pass


def _remove_temps(out: Path) -> None:
    device = out / DEVICE_DIR
    if device.is_dir() and not device.is_symlink():
        for d in [device, *(p for p in device.iterdir() if p.is_dir() and not p.is_symlink())]:
            for stale in d.glob(".*"):
                if stale.is_file() and (stale.name.endswith(TMP_SUFFIX) or stale.name.endswith(TEMP_SUFFIX)):
                    stale.unlink(missing_ok=True)


def _open_out(out: Path, pid: str, force: bool, planned: list[str]) -> Journal:
    """Decide what ``out`` holds (the lock is already taken) and open the journal.

    Every state a run can leave is handled: empty (start); a journal of this plan, with or without
    ``manifest.json`` (resume: units re-verified, the rest rewritten); a journal of another plan or a
    complete bundle (refused, or with ``--force`` replaced: only listed files are removed); anything
    else is the user's folder and is refused."""
    _refuse_links(out, [JOURNAL, MANIFEST, *planned])
    has_journal, has_manifest = (out / JOURNAL).exists(), (out / MANIFEST).exists()
    if any(out.iterdir()):
        if not (has_journal or has_manifest):
            raise ConvertError(f"{out}: not empty and not a k3bundle bundle; choose an empty or new --out")
        same_plan = has_journal and recorded(out)[0] in (pid, None)
        if not same_plan:
            if not force:
                if has_journal:
                    raise ConvertError(f"{out}: holds a partial conversion of a different plan (target, source "
                                       "or options differ); use another --out, or --force to start over")
                raise ConvertError(f"{out}: already a complete bundle (manifest.json present); check it with "
                                   f"`k3bundle verify {out}`, or pass --force to convert again")
            _remove_ours(out)
            in_the_way = [p for p in planned if (out / p).exists()]
            if in_the_way:
                raise ConvertError(f"{out / in_the_way[0]}: in the way: not listed by the bundle's manifest or "
                                   "journal, so --force leaves it; move it away or choose another --out")
    _remove_temps(out)
    return Journal(out, pid)


def _check_space(out: Path, needed: int) -> None:
    if os.environ.get(SKIP_SPACE_CHECK_ENV):
        return
    free = shutil.disk_usage(out).free
    if needed > free:
        raise ConvertError(f"{out}: the bundle needs {needed:,} more bytes but the file system has {free:,} free; "
                           "free space or choose another --out")


_PLAN: Plan | None = None  # the plan a forked worker inherited (see _run_units)


def _die_with_parent() -> None:
    """A worker must not outlive the convert that forked it: orphans would keep the bundle's lock
    (an inherited descriptor) and keep writing. Linux: the kernel sends SIGKILL when the parent dies."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call above took effect
        os._exit(1)


class Terminated(ConvertError):
    """SIGTERM: the run stops cleanly (workers ended, temp files removed); a rerun resumes."""

    exit_code = 128 + signal.SIGTERM


def _on_sigterm(signum, frame) -> None:
    raise Terminated("stopped by SIGTERM; finished files are kept: rerun the same command to resume")


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the workers now rather than wait for their units (``shutdown`` alone waits), and wait
    until they are gone: the interpreter's exit joins every child, so one left blocked on the
    pool's queue would hang the run holding the lock. A worker the pool was starting when it failed
    (EMFILE while forking) may be missing from its table: every child of this run is ended."""
    pool.shutdown(wait=False, cancel_futures=True)
    workers = {*(getattr(pool, "_processes", None) or {}).values(), *multiprocessing.active_children()}
    for p in workers:
        p.kill()  # a unit's temp files are the parent's to remove (``_remove_temps``), after this
    for p in workers:
        p.join(timeout=10)


def worker_init(plan: Plan) -> None:
    import torch

    global _PLAN
    _PLAN = plan
    # the parent's SIGTERM handler came with the fork: a worker ended by ``_stop_workers`` must just
    # end, not raise inside the pool's own code (which can leave its queue locked and the parent waiting)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    torch.set_num_threads(1)  # an OpenMP pool inherited through fork must never be entered


def convert_shard(shard: str, expected: str | None, source: Path, out: Path) -> UnitResult:
    """Worker task: plan this source file's unit here (in parallel), then convert it."""
    return run_unit(build_unit(_PLAN, shard, expected), source, out)


def _worker_failure(e: BaseException) -> BaseException:
    """What a failure of the worker pool is reported as: one line (a ``ConvertError``) for every
    failure but an interrupt, so that the run ends, the lock is released and a rerun resumes."""
    if isinstance(e, (ConvertError, KeyboardInterrupt, SystemExit)):
        return e
    if isinstance(e, BrokenProcessPool):
        return ConvertError("a conversion worker process died (killed, or out of memory); rerun to resume")
    if isinstance(e, OSError):  # e.g. EMFILE: starting a worker takes pipes
        return ConvertError(f"the conversion workers failed: {e.strerror or e}"
                            + (" (raise `ulimit -n`, or use --workers 1)" if e.errno == errno.EMFILE else "")
                            + "; finished files are kept: rerun the same command to resume")
    return ConvertError(f"a conversion worker failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                        "finished files are kept: rerun the same command to resume")


def _run_units(plan: Plan, shards: list[str], files: SourceFiles, source: Path, out: Path, workers: int,
               journal: Journal, on_done: Callable[[UnitResult], None]) -> None:
    if workers <= 1:
        for shard in shards:
            r = run_unit(build_unit(plan, shard, files.expected_sha256(shard)), source, out)
            journal.record(r)
            on_done(r)
        return
    # fork: the plan is inherited, not pickled; no re-import of __main__ or of torch per worker. Safe
    # with torch: the parent runs no torch op on this path and workers are single-threaded.
    ctx = multiprocessing.get_context("fork")
    pending = set()
    todo = iter(shards)
    try:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=worker_init, initargs=(plan,))
    except OSError as e:  # EMFILE: the pool's own locks and pipes
        raise _worker_failure(e) from None
    try:
        while True:
            while len(pending) < 2 * workers:
                shard = next(todo, None)
                if shard is None:
                    break
                pending.add(pool.submit(convert_shard, shard, files.expected_sha256(shard), source, out))
            if not pending:
                break
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                r = fut.result()
                journal.record(r)
                on_done(r)
    except BaseException as e:
        for fut in pending:
            fut.cancel()
        _stop_workers(pool)
        raise _worker_failure(e) from None
    pool.shutdown(wait=True)


def convert(source: str | Path, target: str, out: str | Path, workers: int = 1, force: bool = False,
            progress: Progress | None = None) -> ConvertResult:
    """Convert SOURCE for ``target`` into the bundle directory ``out`` (see the module docstring).

    Args:
        source: a checkpoint directory (``k3bundle pull`` output, or any release-layout directory).
        target: a layout name (``layouts/NAME.yaml``) or a path to a layout YAML file.
        out: the bundle directory: new, empty, or a partial conversion of the same plan (resumed).
        workers: worker processes; the output bytes do not depend on it.
        force: replace an existing bundle (or a partial one of another plan) in ``out``.
        progress: called as ``progress(done_bytes, total_bytes, label)`` over source bytes.
    """
    t0 = time.monotonic()
    source, out = Path(source), Path(out)
    if workers < 1:
        raise ConvertError(f"--workers must be at least 1, got {workers}")
    layout = load_layout(target)
    src = SourceCheckpoint(source)
    plan = plan_for_source(src, layout)
    if not plan.fits:
        s = plan.summary()
        raise ConvertError(
            f"target {layout.name}: rank {s['worst_rank']} needs {s['max_rank_bytes']:,} bytes of weights but a "
            f"{layout.card.name} leaves {plan.usable_bytes:,} (hbm_bytes - runtime_reserve_bytes); see "
            f"`k3bundle plan --target {target}`")
    missing = sorted(set(src.index.shards) - set(plan.shards))
    if missing:  # every shard holds schema tensors, so every shard has a target somewhere
        raise AssertionError(f"plan leaves source files unread: {missing}")
    files = SourceFiles(source, plan.shards, SOURCE_INDEX)
    pid = plan_id(plan, files)
    planned = [f.path for s in plan.shards for f in shard_files(plan, s)] + _small_files(files)
    lock = _lock_out(out)
    sigterm = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if sigterm else None
    try:
        journal = _open_out(out, pid, force, planned)
        try:
            return _convert(plan, src, files, source, out, workers, journal, progress, t0)
        finally:
            journal.close()
            _remove_temps(out)
    finally:
        os.close(lock)
        if sigterm:
            signal.signal(signal.SIGTERM, previous)


def _small_files(files: SourceFiles) -> list[str]:
    """The files written after the units, in order; ``manifest.json`` comes after all of them."""
    return [c.dest for c in files.copies] + [LAYOUT, WEIGHTS_INDEX, GRAPH_MANIFEST]


def _write_final(out: Path, rel: str, data: bytes) -> tuple[str, int]:
    try:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out / rel, data)
    except OSError as e:
        raise disk_error(e, rel) from None
    return hashlib.sha256(data).hexdigest(), len(data)


def _convert(plan: Plan, src: SourceCheckpoint, files: SourceFiles, source: Path, out: Path, workers: int,
             journal: Journal, progress: Progress | None, t0: float) -> ConvertResult:
    sizes = {s: (source / s).stat().st_size for s in plan.shards}
    total = sum(sizes.values())
    results: dict[str, UnitResult] = {}
    todo: list[str] = []
    needed = sum(plan.rank_bytes) + (64 << 20)  # + headers, the small files and the indexes, generously
    for shard in sorted(plan.shards, key=lambda s: (-sizes[s], s)):  # biggest first: better balance
        if not journal.entries:  # a fresh run: nothing to re-verify
            todo.append(shard)
            continue
        outs = shard_files(plan, shard)
        r = journal.verified(shard, source, out, [f.path for f in outs], files.expected_sha256(shard))
        if r is None:
            todo.append(shard)
        else:
            results[shard] = r
            needed -= sum(f.size for f in outs)
    reused = len(results)
    done_bytes = sum(sizes[s] for s in results)
    _check_space(out, needed)
    if progress:
        progress(done_bytes, total, "")

    def on_done(r: UnitResult) -> None:
        nonlocal done_bytes
        results[r.shard] = r
        done_bytes += sizes[r.shard]
        if progress:
            progress(done_bytes, total, r.shard)

    _run_units(plan, todo, files, source, out, workers, journal, on_done)

    # ---- the small files, then the index, the graph manifest and finally the manifest ----
    journal.record_files(_small_files(files))
    bundle_files: dict[str, tuple[str, int]] = {}
    for r in results.values():
        for path, sha, size in r.outputs:
            bundle_files[path] = (sha, size)
    for c in files.copies:
        bundle_files[c.dest] = _write_final(out, c.dest, files.read_small(c.source))
    bundle_files[LAYOUT] = _write_final(out, LAYOUT, plan.layout.to_yaml())
    quant_path, quant_bytes = convention_file(plan)  # the device weights' quantization, in the convention's file
    bundle_files[quant_path] = _write_final(out, quant_path, quant_bytes)
    shard_digests = {s: {"sha256": results[s].sha256, "size": results[s].size} for s in plan.shards}
    try:  # streamed: the full model's index is too big to build in memory first
        write_index(out / WEIGHTS_INDEX, plan, shard_digests)
        bundle_files[WEIGHTS_INDEX] = sha256_file(out / WEIGHTS_INDEX)
    except OSError as e:
        raise disk_error(e, WEIGHTS_INDEX) from None
    bundle_files[GRAPH_MANIFEST] = _write_final(out, GRAPH_MANIFEST, json_bytes(graph_manifest(plan)))

    source_hashes = {s: (d["sha256"], d["size"]) for s, d in shard_digests.items()}
    for name in [SOURCE_INDEX] + [c.source for c in files.copies]:
        source_hashes[name] = files.small_digest(name)
    requantized = sorted((q for r in results.values() for q in r.nvfp4_requantized), key=lambda q: q["source_key"])
    manifest = build_manifest(plan, files, source_hashes, bundle_files, requantized)
    data = json_bytes(manifest)
    _write_final(out, MANIFEST, data)
    journal.remove()  # after the manifest: a kill in between leaves a resumable state, never neither
    return ConvertResult(out, plan.layout.name, len(plan.ranks), len(bundle_files),
                         sum(s for _, s in bundle_files.values()), total, len(plan.shards), reused,
                         time.monotonic() - t0, sum(len(q["blocks"]) for q in requantized),
                         hashlib.sha256(data).hexdigest())
