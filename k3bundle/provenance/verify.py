"""``k3bundle verify``: prove a bundle is what its manifest says, and (with the source) what it must be.

Always:
  1. every file of the manifest exists with its size and sha256 (each re-hashed); no unlisted
     files (``validation/`` and ``reports/`` are written later by other commands);
  2. ``weights.index.json`` agrees with every device file's header (key, dtype, shape, bytes).

Step 1 has three levels (``LEVELS``), for commands that check a bundle before they use it
(``checklist --bundle``, ``validate``) and cannot re-read 1.7 TB each time: ``full`` re-hashes
every file (``verify`` itself always does); ``sample`` re-hashes every file the caller will
read, every metadata file (JSON, YAML) and a seeded random subset of the rest (``sample_size``),
and checks the others' presence and size; ``manifest`` checks presence and size only. The
report says which level ran and what it covered; step 2 runs at every level (headers only).

With ``--source``:
  3. every source file the manifest records re-hashes to its sha256;
  4. every rank file is re-derived from the source (the conversion re-run into a scratch directory,
     one source file at a time) and must be byte-identical to the bundle's; so must
     ``weights.index.json``, ``graph_manifest.json``, ``layout.yaml`` and the copied files;
  5. reassembly: for every pass-through source tensor (``copy`` / ``swizzle-128x4``), the rank
     slices named by ``weights.index.json`` — un-swizzled, padding dropped — tile the tensor and
     reproduce its bytes exactly. This check reads the index and the files, not the converter's
     code, so it is an independent proof of the placement;
  6. values as an engine reads them (``check.values``): every re-coded device tensor, read through
     the layout's declared convention (names, scale meaning, scale layout), must give the source's
     values (exact where lossless). A writer that stores what a name does not mean re-derives to
     the same bytes; this check names the tensor and the convention it breaks.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import random
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from k3bundle.bundle.common import json_bytes
from k3bundle.bundle.graph import graph_manifest
from k3bundle.bundle.index import entry_format, read_index
from k3bundle.bundle.index_writer import write_index
from k3bundle.bundle.manifest import read_manifest
from k3bundle.provenance.trace import source_key
from k3bundle.provenance.values import check_values
from k3bundle.convert.manifest import convention_file
from k3bundle.convert.run import convert_shard, worker_init
from k3bundle.convert.unit import build_unit, run_unit
from k3bundle.errors import K3Error
from k3bundle.file_names import CONVERT_JOURNAL, DEVICE_DIR, GRAPH_MANIFEST, LATER_DIRS, LAYOUT, MANIFEST, WEIGHTS_INDEX
from k3bundle.formats.scale_swizzle import unswizzle, unswizzle_stack
from k3bundle.io import SafetensorsFile, read_header
from k3bundle.io.dtypes import dtype_bits
from k3bundle.io.files import sha256_file
from k3bundle.layouts import load_layout
from k3bundle.plan import plan_for_source
from k3bundle.plan.storage import EXACT_TRANSFORMS
from k3bundle.schema import ROLE_BY_NAME
from k3bundle.checkpoint import SourceCheckpoint
from k3bundle.storage import SWIZZLE

CHUNK = 64 << 20
MAX_PROBLEMS = 50
LEVELS = ("full", "sample", "manifest")


def sample_size(n_files: int) -> int:
    """Weight files re-hashed at level ``sample`` beyond those a check reads: 2%, at least 8."""
    return min(n_files, max(8, math.ceil(0.02 * n_files)))


@dataclass
class VerifyReport:
    bundle: str
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    source_checked: bool = False
    source_files: int = 0
    rederived_files: int = 0
    reassembled_tensors: int = 0
    reassembled_slices: int = 0
    value_checked_tensors: int = 0
    value_checked_slices: int = 0
    level: str = "full"
    seed: int = 0
    hashed_files: int = 0  # re-hashed against the manifest (all of them at level full)
    hashed_bytes: int = 0

    @property
    def coverage(self) -> str:
        """One line: which level ran and what it covered."""
        if self.level == "full":
            return f"level full: all {self.files} files ({self.bytes:,} bytes) re-hashed"
        if self.level == "manifest":
            how = f"{self.files} checked for presence and size only (nothing re-hashed)"
        else:
            how = (f"{self.hashed_files} re-hashed ({self.hashed_bytes:,} bytes: every file read here, the "
                   f"metadata and a random sample, seed {self.seed}), {self.files - self.hashed_files} checked "
                   "for presence and size only")
        return f"level {self.level}: of {self.files} files ({self.bytes:,} bytes) {how}"

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(message)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("... more problems not shown")


def hashed_paths(manifest: dict, level: str, seed: int, reads: Iterable[str]) -> set[str] | None:
    """The manifest paths re-hashed at ``level`` (None: every one)."""
    if level == "full":
        return None
    if level == "manifest":
        return set()
    paths = [f["path"] for f in manifest["files"]]
    metadata = {p for p in paths if not p.endswith(".safetensors")}
    rest = sorted(set(paths) - metadata - set(reads))
    picked = random.Random(seed).sample(rest, min(len(rest), sample_size(len(rest))))
    return metadata | set(reads) | set(picked)


def _listed_files(bundle: Path, manifest: dict, report: VerifyReport, to_hash: set[str] | None = None
                  ) -> dict[str, str]:
    actual: dict[str, str] = {}
    for f in manifest["files"]:
        p = bundle / f["path"]
        if not p.is_file():
            report.fail(f"{f['path']}: missing")
            continue
        report.files += 1
        if to_hash is not None and f["path"] not in to_hash:
            size = p.stat().st_size
            report.bytes += size
            if size != f["size"]:
                report.fail(f"{f['path']}: {size} bytes, manifest says {f['size']}")
            continue
        sha, size = sha256_file(p)
        actual[f["path"]] = sha
        report.bytes += size
        report.hashed_files += 1
        report.hashed_bytes += size
        if size != f["size"]:
            report.fail(f"{f['path']}: {size} bytes, manifest says {f['size']}")
        elif sha != f["sha256"]:
            report.fail(f"{f['path']}: sha256 {sha} does not match the manifest ({f['sha256']})")
    listed = {f["path"] for f in manifest["files"]} | {MANIFEST, CONVERT_JOURNAL}
    if (bundle / CONVERT_JOURNAL).exists():  # the manifest is written before the journal is removed
        report.fail(f"{CONVERT_JOURNAL}: the conversion did not finish; rerun the same convert command to resume it")
    for p in sorted(bundle.rglob("*")):
        rel = p.relative_to(bundle).as_posix()
        if p.is_symlink():
            report.fail(f"{rel}: a symbolic link inside the bundle")
        elif p.is_file() and rel not in listed and rel.split("/")[0] not in LATER_DIRS:
            report.fail(f"{rel}: not listed in the manifest")
    return actual


def _check_index(bundle: Path, index: dict, report: VerifyReport) -> None:
    by_file: dict[str, list[dict]] = {}
    for e in index["tensors"]:
        by_file.setdefault(e["file"], []).append(e)
    for path, entries in sorted(by_file.items()):
        try:
            h = read_header(bundle / path)
        except (K3Error, OSError) as err:
            report.fail(f"{path}: {err}")
            continue
        if len(h.tensors) != len(entries):
            report.fail(f"{path}: {len(h.tensors)} tensors in the file, {len(entries)} in {WEIGHTS_INDEX}")
        for e in entries:
            info = h.tensors.get(e["key"])
            if info is None:
                report.fail(f"{path}: {WEIGHTS_INDEX} lists {e['key']}, the file lacks it")
            elif (info.dtype, list(info.shape), [info.abs_begin, info.abs_end]) != (e["dtype"], e["shape"],
                                                                                   e["byte_range"]):
                report.fail(f"{path}: {e['key']} is {info.dtype} {list(info.shape)} at "
                            f"[{info.abs_begin}, {info.abs_end}), {WEIGHTS_INDEX} says {e['dtype']} {e['shape']} "
                            f"at {e['byte_range']}")


def verify(bundle: str | Path, source: str | Path | None = None,
           progress: Callable[[int, int, str], None] | None = None, level: str = "full", seed: int = 0,
           reads: Iterable[str] = (), workers: int = 1) -> VerifyReport:
    """Verify ``bundle`` (see the module docstring); problems are collected, not raised.

    ``level`` (``LEVELS``) and ``seed`` choose what step 1 re-hashes; ``reads`` are the manifest
    paths the caller will read, re-hashed at level ``sample``. ``--source`` needs level full;
    ``workers`` re-derive that many source files at once (forked processes, as convert).
    """
    if level not in LEVELS:
        raise ValueError(f"verification level {level!r}: choose one of {', '.join(LEVELS)}")
    if source is not None and level != "full":
        raise ValueError("verify --source re-derives every file: it runs at level full only")
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    report = VerifyReport(str(bundle), level=level, seed=seed)
    actual = _listed_files(bundle, manifest, report, hashed_paths(manifest, level, seed, reads))
    index = read_index(bundle / WEIGHTS_INDEX)
    _check_index(bundle, index, report)
    if source is not None:
        _verify_source(bundle, Path(source), manifest, index, actual, report, progress, workers)
    return report


# ------------------------------------------------------------------------------------------
# with the source


def _verify_source(bundle: Path, source: Path, manifest: dict, index: dict, actual: dict[str, str],
                   report: VerifyReport, progress, workers: int = 1) -> None:
    report.source_checked = True
    recorded = {f["path"]: f for f in manifest["source"]["files"]}
    src = SourceCheckpoint(source)
    layout = load_layout(str(bundle / LAYOUT))
    plan = plan_for_source(src, layout)
    if plan.layout.to_yaml() != (bundle / LAYOUT).read_bytes():
        report.fail(f"{LAYOUT}: re-resolving it against {source} gives a different layout")
    listed = {f["path"]: f for f in manifest["files"]}
    # 3 + 4: re-derive every unit in a scratch directory beside the bundle, one source file at a time
    parent = bundle.resolve().parent  # beside the bundle (same file system), never inside it
    scratch = Path(tempfile.mkdtemp(prefix=f".{bundle.name}.verify-",
                                    dir=parent if os.access(parent, os.W_OK) else None))
    shard_digests: dict[str, dict] = {}
    try:
        total = len(plan.shards)
        expected = {s: (recorded[s]["sha256"] if s in recorded else None) for s in plan.shards}
        for n, (shard, r) in enumerate(_rederive(plan, expected, source, scratch, workers)):
            if progress:
                progress(n, total, shard)
            if isinstance(r, str):
                report.fail(f"{shard}: {r}")
                continue
            report.source_files += 1
            shard_digests[shard] = {"sha256": r.sha256, "size": r.size}
            for path, sha, size in r.outputs:
                report.rederived_files += 1
                if path not in listed:
                    report.fail(f"{path}: re-derived from {shard} but not in the manifest")
                elif sha != listed[path]["sha256"] or sha != actual.get(path):
                    report.fail(_first_difference(bundle / path, scratch / path, path, index))
                (scratch / path).unlink(missing_ok=True)  # one unit's outputs at a time on disk
        if progress:
            progress(total, total, "")
        for name, f in recorded.items():
            if name in shard_digests or not f.get("read_by_convert") or not (source / name).is_file():
                continue
            sha, _ = sha256_file(source / name)
            report.source_files += 1
            if sha != f["sha256"]:
                report.fail(f"source {name}: sha256 {sha} does not match the manifest ({f['sha256']})")
        if len(shard_digests) == len(plan.shards):
            write_index(scratch / WEIGHTS_INDEX, plan, shard_digests)
            _same(report, WEIGHTS_INDEX, sha256_file(scratch / WEIGHTS_INDEX)[0], actual)
        _same(report, GRAPH_MANIFEST, hashlib.sha256(json_bytes(graph_manifest(plan))).hexdigest(), actual)
        quant_path, quant_bytes = convention_file(plan)
        _same(report, quant_path, hashlib.sha256(quant_bytes).hexdigest(), actual)
        for path, f in listed.items():  # copied files: byte-identical to the source's
            name = path.rsplit("/", 1)[-1]
            if not path.startswith(f"{DEVICE_DIR}/") and path not in (WEIGHTS_INDEX, GRAPH_MANIFEST):
                if (source / name).is_file():
                    _same(report, path, sha256_file(source / name)[0], actual)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # 5: reassembly of every pass-through tensor from the rank slices
    with src:
        _reassemble(bundle, src, index, report)
        # 6: every re-coded tensor's values, read through the declared convention
        report.value_checked_tensors, report.value_checked_slices = check_values(bundle, src, index, manifest,
                                                                                 report.fail)


def _rederive(plan, expected: dict[str, str | None], source: Path, scratch: Path, workers: int):
    """(shard, UnitResult or error text) for every source file, in plan order; with ``workers`` > 1
    in convert's forked workers, at most 2 x workers units ahead (their outputs wait in ``scratch``)."""
    if workers <= 1:
        for shard in plan.shards:
            try:
                yield shard, run_unit(build_unit(plan, shard, expected[shard]), source, scratch)
            except K3Error as e:
                yield shard, str(e)
        return
    ctx = multiprocessing.get_context("fork")  # as convert: the plan is inherited, torch not re-imported
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=worker_init,
                             initargs=(plan,)) as pool:
        ahead: deque = deque()
        todo = iter(plan.shards)
        while True:
            while len(ahead) < 2 * workers:
                shard = next(todo, None)
                if shard is None:
                    break
                ahead.append((shard, pool.submit(convert_shard, shard, expected[shard], source, scratch)))
            if not ahead:
                return
            shard, fut = ahead.popleft()
            try:
                yield shard, fut.result()
            except K3Error as e:
                yield shard, str(e)


def _same(report: VerifyReport, path: str, sha: str, actual: dict[str, str]) -> None:
    if actual.get(path) != sha:
        report.fail(f"{path}: differs from what the source and layout give (sha256 {sha})")


def _first_difference(a: Path, b: Path, path: str, index: dict) -> str:
    """Where a bundle file first differs from its re-derivation, traced to a tensor."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        off = 0
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                n = min(len(x), len(y))
                i = next((k for k in range(n) if x[k] != y[k]), n)
                pos = off + i
                break
            if not x:
                return f"{path}: re-derived sha256 differs but the bytes are equal (file changed while reading?)"
            off += len(x)
    hit = next((e for e in index["tensors"] if e["file"] == path and e["byte_range"][0] <= pos < e["byte_range"][1]),
               None)
    where = f" in tensor {hit['key']} (byte {pos - hit['byte_range'][0]}; see `k3bundle trace`)" if hit else \
        " in the header"
    return f"{path}: differs from its re-derivation from the source at byte {pos}{where}"


def _reassemble(bundle: Path, src: SourceCheckpoint, index: dict, report: VerifyReport) -> None:
    """Check every pass-through source tensor against the rank slices that hold it. A rank's stacked
    experts are compared as one stack (``_compare_stack``), every other slice by itself."""
    slices: dict[str, list[tuple[dict, int | None]]] = {}
    differ: set[str] = set()  # source keys a stack comparison found wrong
    for e in index["tensors"]:
        if e["transform"] not in EXACT_TRANSFORMS:
            continue
        s = e["source"]
        for x in range(*s["experts"]) if "experts" in s else (None,):
            slices.setdefault(source_key(s, x), []).append((e, x))
        if "expert_stride" in s:
            differ |= _compare_stack(bundle, e, src, report)
    for key in sorted(slices):
        entries = slices[key]
        sf = src.shard_file(entries[0][0]["source"]["file"])
        info = sf.info(key)
        ok = _coverage(key, entries, info, src.schema, ROLE_BY_NAME, sf, report) and key not in differ
        for e, x in entries:
            if "expert_stride" not in e["source"]:
                ok &= _compare_slice(bundle, e, x, sf, info, report)
            report.reassembled_slices += 1
        report.reassembled_tensors += ok


def _compare_stack(bundle: Path, e: dict, src: SourceCheckpoint, report: VerifyReport) -> set[str]:
    """``_compare_slice`` for every expert of a stacked device tensor, ``CHUNK`` bytes of source
    experts at a time; an expert that differs is compared again by itself, which names the place.
    Returns the source keys of the experts that differ."""
    s = e["source"]
    first, stop = s["experts"]
    keys = [source_key(s, x) for x in range(first, stop)]
    sf = src.shard_file(s["file"])
    info = sf.info(keys[0])
    es, div, c0, c1 = _geometry(e, info)
    rows_total = info.shape[0] if info.shape else 1
    row_bytes = info.nbytes // rows_total
    (r0, r1), stride = s["rows"], s["expert_stride"]
    w, pad_w = (c1 - c0) * es, s.get("pad_cols", 0) // div * es
    n_rows = r1 - r0 + s.get("pad_rows", 0)
    differ: set[str] = set()
    step = max(1, CHUNK // max(info.nbytes, 1))
    with open(bundle / e["file"], "rb") as f:
        for a in range(0, len(keys), step):
            chunk = keys[a: a + step]
            f.seek(e["byte_range"][0] + a * stride)
            dev = torch.frombuffer(bytearray(f.read(len(chunk) * stride)), dtype=torch.uint8).reshape(len(chunk), stride)
            if e["transform"] == SWIZZLE:
                dev = unswizzle_stack(dev, n_rows, (w + pad_w) // es)
            dev = dev.reshape(len(chunk), n_rows, w + pad_w)
            want = src.get_stack(chunk).view(torch.uint8).reshape(len(chunk), rows_total, row_bytes)
            same = (dev[:, : r1 - r0, :w] == want[:, r0:r1, c0 * es: c1 * es]).flatten(1).all(1)
            same &= (dev[:, r1 - r0:] == 0).flatten(1).all(1) & (dev[:, :, w:] == 0).flatten(1).all(1)  # padding
            for i in (~same).nonzero().flatten().tolist():
                differ.add(chunk[i])
                _compare_slice(bundle, e, first + a + i, sf, sf.info(chunk[i]), report)  # names the place
    return differ


def _geometry(e: dict, info) -> tuple[int, int, int, int]:
    """(bytes per source element, source columns per stored element, c0, c1) of a slice: its
    stored columns [c0, c1) of a source row, in source elements."""
    cols = e["source"]["cols"]
    es = dtype_bits(info.dtype) // 8
    if cols is None or len(info.shape) != 2:
        return es, 1, 0, math.prod(info.shape[1:]) if len(info.shape) > 1 else 1
    div = entry_format(e).span(e["part"])[1]  # an MXFP4 pair: 2 codes a byte, 32 a scale
    return es, div, cols[0] // div, cols[1] // div


def _coverage(key: str, entries, info, schema, roles, sf, report: VerifyReport) -> bool:
    """The distinct slices of ``key`` must tile it (padding rows of A_log are zero in the source)."""
    rects = {(tuple(e["source"]["rows"]), tuple(e["source"]["cols"] or (0, 1))) for e, _ in entries}
    rows_total = info.shape[0] if info.shape else 1
    e0 = entries[0][0]
    logical = e0["source"]["logical_shape"]
    cols_total = logical[1] if len(logical) > 1 and e0["source"]["cols"] is not None else 1
    area = sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in rects)
    ordered = sorted(rects)
    for a, b in zip(ordered, ordered[1:]):
        (ar, ac), (br, bc) = a, b
        if ar[0] < br[1] and br[0] < ar[1] and ac[0] < bc[1] and bc[0] < ac[1]:
            report.fail(f"{key}: rank slices {a} and {b} overlap")
            return False
    real_rows = max(r1 for (r0, r1), _ in rects)
    if area != real_rows * cols_total or min(r0 for (r0, _), _ in rects) != 0:
        report.fail(f"{key}: the rank slices cover {area} of {real_rows * cols_total} elements")
        return False
    if real_rows < rows_total:  # A_log: the rows no rank holds must be the zero padding
        rest = np.frombuffer(sf.read_bytes(key, real_rows * (info.nbytes // rows_total)), dtype=np.uint8)
        if rest.any():
            report.fail(f"{key}: rows {real_rows}..{rows_total - 1} are held by no rank but are not zero")
            return False
    return True


def _compare_slice(bundle: Path, e: dict, expert: int | None, sf: SafetensorsFile, info,
                   report: VerifyReport) -> bool:
    """Device bytes of one slice (un-swizzled, padding dropped) == the source bytes it claims."""
    src = e["source"]
    es, div, c0, c1 = _geometry(e, info)
    rows_total = info.shape[0] if info.shape else 1
    row_bytes = info.nbytes // rows_total if rows_total else 0
    r0, r1 = src["rows"]
    w = (c1 - c0) * es  # bytes of a row the slice holds
    pad_rows = src.get("pad_rows", 0)
    pad_w = src.get("pad_cols", 0) // div * es
    stride = src.get("expert_stride", e["byte_range"][1] - e["byte_range"][0])
    begin = e["byte_range"][0] + ((expert - src["experts"][0]) * stride if "expert_stride" in src else 0)
    where = f"rank {e['rank']} {e['key']}" + (f" expert {expert}" if expert is not None else "")
    with open(bundle / e["file"], "rb") as f:
        f.seek(begin)
        dev = np.frombuffer(f.read(stride), dtype=np.uint8)
    n_rows = r1 - r0 + pad_rows
    if e["transform"] == SWIZZLE:
        dev = unswizzle(torch.from_numpy(dev.copy()), n_rows, (w + pad_w) // es).numpy()
    dev = dev.reshape(n_rows, w + pad_w)
    if dev[r1 - r0:].any() or dev[:, w:].any():
        report.fail(f"{where}: padding is not zero")
        return False
    step = max(1, CHUNK // max(row_bytes, 1))
    for a in range(r0, r1, step):
        b = min(r1, a + step)
        got = np.frombuffer(sf.read_bytes(info.name, a * row_bytes, b * row_bytes), dtype=np.uint8)
        got = got.reshape(b - a, row_bytes)[:, c0 * es: c1 * es]
        if not np.array_equal(got, dev[a - r0: b - r0, :w]):
            bad = np.argwhere(got != dev[a - r0: b - r0, :w])[0]
            report.fail(f"{where}: differs from source {info.name} at row {a + int(bad[0])}, byte column "
                        f"{c0 * es + int(bad[1])}")
            return False
    return True


__all__ = ["VerifyReport", "verify"]
