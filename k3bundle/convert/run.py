"""``k3bundle convert``: a source checkpoint + a layout -> a model bundle (docs/bundle-format.md).

Order of work, each step failing closed:

1. check the source (config, index vs every shard header, tensor schema) and ``source.json``
   (every file convert reads must be listed with its size); plan the layout (rules, capacity);
2. open the output: a new or empty directory, or a partial run of the *same* plan (resume);
3. convert each source file (``k3bundle.convert.unit``), in worker processes when asked; a unit
   the journal records is skipped only after its outputs re-hash to the recorded sha256;
4. copy config.json / tokenizer / processor files (checked against source.json), write
   ``device_weights/layout.yaml``, ``weights.index.json`` and ``graph_manifest.json``;
5. write ``manifest.json`` last, atomically. Any failure before it leaves no manifest.

The bytes of every file depend on the source bytes, the resolved layout and the k3bundle
version only: not on the worker count, the order units finish in, the time or the paths.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from k3bundle import __version__
from k3bundle.bundle.common import json_bytes
from k3bundle.bundle.graph import GRAPH_NAME, graph_manifest
from k3bundle.bundle.index import INDEX_NAME, write_index
from k3bundle.bundle.manifest import MANIFEST_NAME
from k3bundle.convert.errors import ConvertError
from k3bundle.convert.journal import JOURNAL, Journal
from k3bundle.convert.manifest import build_manifest, convention_file
from k3bundle.convert.sources import SourceFiles
from k3bundle.convert.unit import TMP_SUFFIX, UnitResult, build_unit, run_unit
from k3bundle.io import INDEX_NAME as SOURCE_INDEX
from k3bundle.io.files import sha256_file, write_atomic
from k3bundle.layouts import load_layout
from k3bundle.plan import Plan, plan_for_source
from k3bundle.plan.files import DEVICE_DIR, shard_files
from k3bundle.source import SourceCheckpoint

LAYOUT_PATH = f"{DEVICE_DIR}/layout.yaml"
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
           "config": hashlib.sha256(files.read_small("config.json")).hexdigest(),
           "index": hashlib.sha256(files.read_small(SOURCE_INDEX)).hexdigest(),
           "source_json": files.source_json_digest()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        ours = (out / MANIFEST_NAME).exists() or (out / JOURNAL).exists()
        if not ours:
            raise ConvertError(f"{out}: not empty and not a k3bundle bundle; choose an empty or new --out")
        if force:
            shutil.rmtree(out)
        elif (out / MANIFEST_NAME).exists():
            raise ConvertError(f"{out}: already a complete bundle (manifest.json present); check it with "
                               f"`k3bundle verify {out}`, or pass --force to convert again")
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / DEVICE_DIR).glob(f"*/.*{TMP_SUFFIX}") if (out / DEVICE_DIR).is_dir() else ():
        stale.unlink()


def _check_space(out: Path, needed: int) -> None:
    if os.environ.get(SKIP_SPACE_CHECK_ENV):
        return
    free = shutil.disk_usage(out).free
    if needed > free:
        raise ConvertError(f"{out}: the bundle needs {needed:,} more bytes but the file system has {free:,} free; "
                           "free space or choose another --out")


_PLAN: Plan | None = None  # the plan a forked worker inherited (see _run_units)


def _worker_init(plan: Plan) -> None:
    import torch

    global _PLAN
    _PLAN = plan
    torch.set_num_threads(1)  # an OpenMP pool inherited through fork must never be entered


def _convert_shard(shard: str, expected: str | None, source: Path, out: Path) -> UnitResult:
    """Worker task: plan this source file's unit here (in parallel), then convert it."""
    return run_unit(build_unit(_PLAN, shard, expected), source, out)


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
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(plan,)) as pool:
        try:
            while True:
                while len(pending) < 2 * workers:
                    shard = next(todo, None)
                    if shard is None:
                        break
                    pending.add(pool.submit(_convert_shard, shard, files.expected_sha256(shard), source, out))
                if not pending:
                    break
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    r = fut.result()
                    journal.record(r)
                    on_done(r)
        except BrokenProcessPool:
            raise ConvertError("a conversion worker process died (killed, or out of memory); rerun to resume") from None
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise


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
    _prepare_out(out, force)
    journal = Journal(out, pid)
    try:
        result = _convert(plan, src, files, source, out, workers, journal, progress, t0)
    except BaseException:
        journal.close()
        for stale in (out / DEVICE_DIR).glob(f"*/.*{TMP_SUFFIX}") if (out / DEVICE_DIR).is_dir() else ():
            stale.unlink(missing_ok=True)
        raise
    return result


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
    bundle_files: dict[str, tuple[str, int]] = {}
    for r in results.values():
        for path, sha, size in r.outputs:
            bundle_files[path] = (sha, size)
    for c in files.copies:
        (out / c.dest).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out / c.dest, files.read_small(c.source))
        bundle_files[c.dest] = files.small_digest(c.source)
    layout_bytes = plan.layout.to_yaml()
    (out / DEVICE_DIR).mkdir(exist_ok=True)
    write_atomic(out / LAYOUT_PATH, layout_bytes)
    bundle_files[LAYOUT_PATH] = (hashlib.sha256(layout_bytes).hexdigest(), len(layout_bytes))
    quant_path, quant_bytes = convention_file(plan)  # the device weights' quantization, in the convention's file
    write_atomic(out / quant_path, quant_bytes)
    bundle_files[quant_path] = (hashlib.sha256(quant_bytes).hexdigest(), len(quant_bytes))
    shard_digests = {s: {"sha256": results[s].sha256, "size": results[s].size} for s in plan.shards}
    write_index(out / INDEX_NAME, plan, shard_digests)
    bundle_files[INDEX_NAME] = sha256_file(out / INDEX_NAME)
    graph = json_bytes(graph_manifest(plan))
    write_atomic(out / GRAPH_NAME, graph)
    bundle_files[GRAPH_NAME] = (hashlib.sha256(graph).hexdigest(), len(graph))

    source_hashes = {s: (d["sha256"], d["size"]) for s, d in shard_digests.items()}
    for name in [SOURCE_INDEX] + [c.source for c in files.copies]:
        source_hashes[name] = files.small_digest(name)
    requantized = sorted((q for r in results.values() for q in r.nvfp4_requantized), key=lambda q: q["source_key"])
    manifest = build_manifest(plan, files, source_hashes, bundle_files, requantized)
    data = json_bytes(manifest)
    journal.remove()
    write_atomic(out / MANIFEST_NAME, data)
    return ConvertResult(out, plan.layout.name, len(plan.ranks), len(bundle_files),
                         sum(s for _, s in bundle_files.values()), total, len(plan.shards), reused,
                         time.monotonic() - t0, sum(len(q["blocks"]) for q in requantized),
                         hashlib.sha256(data).hexdigest())
