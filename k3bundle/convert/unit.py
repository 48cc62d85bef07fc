"""Convert one source file: read it once, front to back, hash it, write its device files.

A ``UnitWork`` (built from the plan in the parent process, shipped to a worker) lists the
device files fed by one source file, with every byte range planned, and every *group* (one
source role instance: a tensor, an MXFP4 pair, one expert's pair) with its *sinks* (where
each rank's slice of it lands). The worker:

1. creates every output as a hidden temp file of its final size (``posix_fallocate``, so a
   full disk fails here, before any data is written) and writes the planned header;
2. reads the source file sequentially — header, then tensors in file order — in blocks,
   feeding each block to sha256 and to the sinks that need it; sinks ``pwrite`` their bytes
   at planned offsets (stacked experts arrive out of file order, so writes are positioned);
3. compares the source sha256 with ``source.json`` when the pull recorded one;
4. hashes each output (read back from the page cache, several at once) and renames it into place.

The source is hashed one block behind the reader, on a thread (``_HashBehind``), so hashing
overlaps reading and encoding.

Each source byte is read once. Peak memory is one read block plus what the sinks buffer
(128 rows for FP8 blocks; up to ``STACK_BYTES`` of expert tensors for NVFP4, encoded as one
stack; one scale slice for swizzling),
independent of the model's size.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from k3bundle.convert.errors import ConvertError
from k3bundle.io import read_header
from k3bundle.io.files import discard, link_in_path, publish, sha256_file
from k3bundle.plan import Plan, Target
from k3bundle.plan.files import OutFile, shard_files
from k3bundle.plan.storage import DevicePart, storage_format
from k3bundle.storage import StorageFormat
from k3bundle.storage.arrays import swizzle_rows
from k3bundle.storage.base import source_byte_cols

READ_WHOLE = 64 << 20  # tensors up to this size are read in one piece
READ_BLOCK = 32 << 20  # larger ones in blocks of whole rows of about this size
READ_AHEAD = 256 << 20  # kept requested from the kernel (posix_fadvise WILLNEED) ahead of the reader
STACK_BYTES = 64 << 20  # whole-tensor groups (NVFP4 experts) collected and encoded together up to this
TMP_SUFFIX = ".k3tmp"
OUTPUT_HASH_THREADS = 4  # a unit's outputs are hashed (from the page cache) this many at once
THROTTLE_ENV = "K3BUNDLE_CONVERT_THROTTLE_S"  # test hook: sleep per unit before renaming outputs


@dataclass
class Sink:
    """Where one rank's slice of one source role instance (one expert) lands."""

    target: Target
    expert: int | None
    parts: tuple[DevicePart, ...]
    dests: dict[str, tuple[int, int]]  # device part -> (file index, absolute offset of this weight)
    shape: tuple[int, ...]  # logical shape of the device slice, padding included
    row_lo: int  # source rows taken
    row_hi: int
    cols: tuple[int, int] | None  # source logical columns taken (row-parallel), None = all

    @property
    def storage(self) -> StorageFormat:
        return storage_format(self.target.rule, self.target.role)

    def part(self, name: str) -> DevicePart:
        return next(p for p in self.parts if p.part == name)


@dataclass
class Group:
    """One source role instance: its stored tensors (by part) and every sink of it."""

    names: dict[str, str]  # source part -> tensor name
    dtype: str  # stored dtype of the "weight" part (BF16/F32) or U8
    sinks: list[Sink] = field(default_factory=list)

    @property
    def storage(self) -> StorageFormat:
        return self.sinks[0].storage


@dataclass
class UnitWork:
    shard: str
    files: list[OutFile]
    groups: list[Group]
    expected_sha256: str | None = None  # from source.json

    @property
    def out_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class UnitResult:
    shard: str
    sha256: str
    size: int
    mtime_ns: int
    outputs: list[tuple[str, str, int]]  # (path, sha256, size)
    nvfp4_requantized: list[dict]


def build_unit(plan: Plan, shard: str, expected_sha256: str | None = None) -> UnitWork:
    """Plan the work of one source file: its device files and every group's sinks."""
    files = shard_files(plan, shard)
    # target -> expert -> device part -> (file index, offset); what depends on the target alone
    # is computed once per target, not per expert (full-depth: 896 experts x 8 ranks per layer)
    dests: dict[Target, dict[int | None, dict[str, tuple[int, int]]]] = {}
    for fi, f in enumerate(files):
        for d, off in zip(f.tensors, f.offsets):
            base = f.data_start + off
            by_expert = dests.setdefault(d.target, {})
            if d.stacked:
                e0, step, part = d.target.experts[0], d.part.nbytes, d.part.part
                for e in range(*d.target.experts):
                    by_expert.setdefault(e, {})[part] = (fi, base + (e - e0) * step)
            else:
                by_expert.setdefault(d.expert, {})[d.part.part] = (fi, base)
    groups: dict[tuple, Group] = {}
    schema = plan.schema
    for t, by_expert in dests.items():
        shape, parts = plan.slice_shape(t), tuple(plan.parts(t))
        rows = schema.logical_shape(t.role)[0]
        lo, hi = (0, rows) if t.split == "cols" else (t.start, t.stop)
        cols = (t.start, t.stop) if t.split == "cols" else None
        for e, where in by_expert.items():
            key = (t.role.role, t.layer, e)
            g = groups.get(key)
            if g is None:
                specs = schema.specs(t.role, t.layer, e)
                g = groups[key] = Group({s.part: s.name for s in specs}, specs[0].dtype)
            g.sinks.append(Sink(t, e, parts, where, shape, lo, hi, cols))
    return UnitWork(shard, files, list(groups.values()), expected_sha256)


# ------------------------------------------------------------------------------------------
# Worker side


def _pad_cols(rows: np.ndarray, width: int) -> np.ndarray:
    """Append zero bytes to each row (last dimension) up to ``width`` bytes (no copy when
    already that wide)."""
    if rows.shape[-1] == width:
        return rows
    out = np.zeros((*rows.shape[:-1], width), dtype=np.uint8)
    out[..., : rows.shape[-1]] = rows
    return out


class _Writer:
    """Feeds source blocks to each sink's storage format and writes device bytes at planned offsets.

    Row formats get a sink's rows (and columns) of a source part, grouped by the parts'
    ``rows_per_group``; whole-tensor formats get every part of the whole source tensor once.
    What the format returns is placed row by row; a swizzled scale is collected over the
    sink's rows and written once, swizzled.
    """

    def __init__(self, fds: list[int], paths: list[str]):
        self.fds, self.paths = fds, paths
        self.pending: dict[tuple, list] = {}  # (kind, sink id, part) -> buffered rows
        self.whole: dict[int, dict[str, np.ndarray]] = {}  # group id -> source parts read so far
        self.stacks: dict[tuple, list] = {}  # (format, part shapes) -> complete groups to encode together
        self.stacked_bytes = 0
        self.completed = 0  # whole-tensor groups complete so far: a group's rank in file order
        self.requantized: list[tuple[int, dict]] = []  # (file-order rank of the group, entry)

    def put(self, sink: Sink, part: str, rel: int, data: np.ndarray) -> None:
        fi, base = sink.dests[part]
        buf = np.ascontiguousarray(data)
        view = memoryview(buf).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fds[fi], view[done:], base + rel + done)
        except OSError as e:
            raise disk_error(e, self.paths[fi]) from None

    # ---- row formats: a sink's rows of one source part, in groups ----
    def rows(self, sink: Sink, part: str, dtype: str, r0: int, block: np.ndarray) -> None:
        x0, x1 = max(r0, sink.row_lo), min(r0 + len(block), sink.row_hi)
        if x0 >= x1:
            return
        rows = block[x0 - r0: x1 - r0]
        if sink.cols is not None:
            b0, b1 = source_byte_cols(part, sink.cols, dtype)
            rows = rows[:, b0:b1]
        g = sink.parts[0].rows_per_group
        rel, last = x0 - sink.row_lo, x1 == sink.row_hi
        if g == 1:
            self._encode(sink, part, rel, rows, last)
            return
        key = ("rows", id(sink), part)
        start, buf = self.pending.get(key, (rel, []))
        buf.append(rows)
        if sum(len(b) for b in buf) < g and not last:
            self.pending[key] = (start, buf)
            return
        rows = np.concatenate(buf) if len(buf) > 1 else buf[0]
        n_full = len(rows) if last else (len(rows) // g) * g
        for i in range(0, n_full, g):
            self._encode(sink, part, start + i, rows[i: i + g], last and i + g >= n_full)
        rest = rows[n_full:]
        if len(rest):
            self.pending[key] = (start + n_full, [rest])
        else:
            self.pending.pop(key, None)

    def _encode(self, sink: Sink, part: str, rel: int, rows: np.ndarray, last: bool) -> None:
        self._place(sink, rel, sink.storage.encode(part, rows, sink.target.rule.scale_rule), last)

    # ---- whole-tensor formats: every part of the source tensor, then every sink's slice ----
    def tensor_part(self, group: Group, part: str, block: np.ndarray) -> None:
        """Collect a group's source parts; complete groups of one shape are encoded as a stack
        (``STACK_BYTES`` at a time) so that thousands of small experts cost a few tensor
        operations and one positioned write per run of adjacent device slices, not one of each
        per expert and rank."""
        have = self.whole.setdefault(id(group), {})
        have[part] = block
        if len(have) < len(group.names):
            return
        del self.whole[id(group)]
        key = (id(group.storage), tuple(sorted((k, v.shape) for k, v in have.items())))
        self.stacks.setdefault(key, []).append((self.completed, group, have))
        self.completed += 1
        self.stacked_bytes += sum(v.nbytes for v in have.values())
        if self.stacked_bytes >= STACK_BYTES:
            self.flush()

    def flush(self) -> None:
        """Encode and place every collected whole-tensor group."""
        for members in self.stacks.values():
            fmt = members[0][1].storage
            out, requantized = fmt.encode_stack([have for _, _, have in members])
            for (seq, group, _), blocks in zip(members, requantized):
                if blocks:
                    self.requantized.append((seq, {"source_key": group.names[fmt.requantized_part], "blocks": blocks}))
            slots: dict[tuple, list[tuple[int, Sink]]] = {}  # one rank's slice of every member
            for t, (_, group, _) in enumerate(members):
                for sink in group.sinks:
                    slots.setdefault((id(sink.target), sink.row_lo, sink.row_hi, sink.cols), []).append((t, sink))
            for slot in slots.values():
                sink0 = slot[0][1]
                parts = fmt.slice_tensor(out, (sink0.row_lo, sink0.row_hi), sink0.cols)
                index = [t for t, _ in slot]
                for name, stack in parts.items():
                    dp = sink0.part(name)
                    rows = _pad_cols(stack[index], dp.row_bytes)
                    if dp.swizzled_cols:
                        rows = swizzle_rows(rows)
                    self.put_runs([s for _, s in slot], name, rows.reshape(len(slot), -1))
        self.stacks.clear()
        self.stacked_bytes = 0

    def put_runs(self, sinks: list[Sink], part: str, data: np.ndarray) -> None:
        """Write row i of ``data`` at sink i's offset, one ``pwrite`` per run of adjacent offsets."""
        order = sorted(range(len(sinks)), key=lambda i: sinks[i].dests[part])
        size = data.shape[1]
        i = 0
        while i < len(order):
            fi, base = sinks[order[i]].dests[part]
            j = i + 1
            while j < len(order) and sinks[order[j]].dests[part] == (fi, base + (j - i) * size):
                j += 1
            run = order[i:j]
            adjacent = run == list(range(run[0], run[-1] + 1))
            self.put(sinks[run[0]], part, 0, data[run[0]: run[-1] + 1] if adjacent else data[run])
            i = j

    def requantized_blocks(self) -> list[dict]:
        """Re-quantized blocks per source tensor, in source file order."""
        return [entry for _, entry in sorted(self.requantized, key=lambda x: x[0])]

    # ---- placement ----
    def _place(self, sink: Sink, rel: int, out: dict[str, np.ndarray], last: bool) -> None:
        """Write encoded rows starting at input row ``rel`` of the sink's slice, padded to full width."""
        for name, rows in out.items():
            dp = sink.part(name)
            rows = _pad_cols(rows, dp.row_bytes)
            if not dp.swizzled_cols:
                self.put(sink, name, (rel // dp.rows_per_row) * dp.row_bytes, rows)
                continue
            key = ("swizzle", id(sink), name)
            buf = self.pending.setdefault(key, [])
            buf.append(rows)
            if last:
                del self.pending[key]
                self.put(sink, name, 0, swizzle_rows(np.concatenate(buf) if len(buf) > 1 else buf[0]))


def _pread_into(fd: int, buf: np.ndarray, offset: int, path: Path) -> None:
    view, done = memoryview(buf).cast("B"), 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise ConvertError(f"{path}: {e.strerror} while reading at byte {offset + done}") from None
        if got == 0:
            raise ConvertError(f"{path}: file shrank while reading at byte {offset + done}")
        done += got


def disk_error(e: OSError, path: str) -> ConvertError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ConvertError(f"{path}: {os.strerror(e.errno)} while writing the bundle; free space (or raise "
                            "the limit) and rerun the same command: finished files are kept and re-verified")
    return ConvertError(f"{path}: {e.strerror or e} while writing the bundle")


def run_unit(work: UnitWork, source_dir: str | Path, out_dir: str | Path) -> UnitResult:
    """Convert one source file (see the module docstring). Raises ``ConvertError``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # units are the parallelism; intra-op threads only contend (36x slower)
    try:
        return _run_unit(work, Path(source_dir), Path(out_dir))
    finally:
        torch.set_num_threads(threads)


def _run_unit(work: UnitWork, source_dir: Path, out: Path) -> UnitResult:
    src = source_dir / work.shard
    header = read_header(src)  # strict: the layout of every byte below is validated here
    fds: list[int] = []
    tmps: list[Path] = []
    try:
        for f in work.files:
            final = out / f.path
            link = link_in_path(out, f.path)
            if link is not None:
                raise ConvertError(f"{link}: is a symbolic link inside the bundle; convert never writes "
                                   "through links: remove it and rerun")
            tmp = final.with_name(f".{final.name}{TMP_SUFFIX}")
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
                fds.append(fd)
                tmps.append(tmp)
                try:
                    os.posix_fallocate(fd, 0, f.size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(fd, f.size)
                os.pwrite(fd, f.prefix, 0)
            except OSError as e:
                raise disk_error(e, f.path) from None
        writer = _Writer(fds, [f.path for f in work.files])
        st = os.stat(src)
        sha = _read_and_dispatch(work, src, header, writer)
        writer.flush()
        if work.expected_sha256 and sha != work.expected_sha256:
            raise ConvertError(f"{src}: sha256 {sha} does not match source.json ({work.expected_sha256}); "
                               "the file changed or is corrupt since it was pulled: pull it again")
        throttle = float(os.environ.get(THROTTLE_ENV, "0") or 0)
        if throttle:
            time.sleep(throttle)
        outputs = []
        with ThreadPoolExecutor(min(OUTPUT_HASH_THREADS, len(tmps)) or 1) as pool:  # hashlib frees the GIL
            hashed = list(pool.map(sha256_file, tmps))
        for f, tmp, (out_sha, out_size) in zip(work.files, tmps, hashed):
            if out_size != f.size:
                raise OSError(errno.EIO, f"{tmp}: {out_size} bytes on disk, {f.size} planned")
            outputs.append((f.path, out_sha, f.size))
        for f, fd, tmp in zip(work.files, fds, tmps):
            publish(fd, tmp, out / f.path)
        for fd in fds:
            os.close(fd)
        fds.clear()
        tmps.clear()
        return UnitResult(work.shard, sha, header.file_size, st.st_mtime_ns, outputs, writer.requantized_blocks())
    except OSError as e:  # reads raise ConvertError themselves; this is the output side
        raise disk_error(e, str(out)) from None
    finally:
        for fd in fds:
            os.close(fd)
        for tmp in tmps:
            discard(tmp)


class _HashBehind:
    """sha256 of the source, block by block, one block behind the reader on a thread of its own:
    hashlib releases the GIL for large buffers, so hashing block k overlaps reading and encoding
    block k+1 (a worker hashes every source byte at ~1.4 GB/s per core; docs/performance.md
    "Release scale"). At most one block waits, so memory grows by one block at most; blocks under
    ``BEHIND_BYTES`` (most tensors of a narrow model) are hashed in place, where a hand-off to the
    thread would cost more than it saves."""

    BEHIND_BYTES = 1 << 20

    def __init__(self):
        self._sha = hashlib.sha256()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def update(self, block: np.ndarray) -> None:
        self._wait()  # blocks are hashed in order
        if block.nbytes < self.BEHIND_BYTES:
            self._sha.update(block)
            return
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="k3bundle-hash")
        self._pending = self._pool.submit(self._sha.update, block)  # the block is not written after this

    def hexdigest(self) -> str:
        self._wait()
        return self._sha.hexdigest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _read_and_dispatch(work: UnitWork, src: Path, header, writer: _Writer) -> str:
    by_name: dict[str, tuple[Group, str]] = {}
    for g in work.groups:
        for part, name in g.names.items():
            by_name[name] = (g, part)
    hasher = _HashBehind()
    fd = os.open(src, os.O_RDONLY)
    ahead = 0  # the kernel reads ahead of us (cold cache: disk reads overlap hashing and writing)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    try:
        head = np.empty(header.data_start, dtype=np.uint8)
        _pread_into(fd, head, 0, src)
        hasher.update(head)
        for info in sorted(header.tensors.values(), key=lambda i: i.begin):
            hit = by_name.pop(info.name, None)
            if info.nbytes == 0:
                continue
            rows = info.shape[0] if info.shape else 1
            row_bytes = info.nbytes // rows if rows else 0
            if info.nbytes <= READ_WHOLE or (hit and hit[0].storage.whole_tensor):
                step = rows
            else:
                step = max(1, READ_BLOCK // max(row_bytes, 1))
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                block = np.empty((n, row_bytes), dtype=np.uint8)
                pos = info.abs_begin + r0 * row_bytes
                if hasattr(os, "posix_fadvise") and ahead < pos + READ_AHEAD // 2:
                    # keep the kernel reading [pos, pos + READ_AHEAD) in the background
                    start = max(ahead, pos)
                    os.posix_fadvise(fd, start, pos + READ_AHEAD - start, os.POSIX_FADV_WILLNEED)
                    ahead = pos + READ_AHEAD
                _pread_into(fd, block, pos, src)
                hasher.update(block)
                if hit is not None:
                    _dispatch(writer, hit[0], hit[1], info.dtype, r0, block)
        digest = hasher.hexdigest()
    finally:
        os.close(fd)
        hasher.close()
    if by_name:
        first = min(by_name)
        raise ConvertError(f"{src}: {len(by_name)} planned tensor(s) are not in the file, first {first!r}")
    return digest


def _dispatch(writer: _Writer, group: Group, part: str, dtype: str, r0: int, block: np.ndarray) -> None:
    if group.storage.whole_tensor:
        writer.tensor_part(group, part, block)
    else:
        for sink in group.sinks:
            writer.rows(sink, part, dtype, r0, block)
