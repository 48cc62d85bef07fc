"""From a plan to the bundle's device files: names, headers and byte offsets, before any I/O.

Every device file draws from exactly one source file: rank r's tensors from source shard
``model-0000N-of-0000NN.safetensors`` go to ``device_weights/rank-00r/model-0000N-of-0000NN-partPP
.safetensors``, split into parts at the layout's ``files.max_bytes`` (a tensor larger than the cap
gets a part of its own). So converting one source file is one unit of work that reads that
file once, front to back, and writes a known set of files: units run in any order, in any
number of processes, and a finished unit can be checked by hash alone.

Inside a file, tensors are sorted by name and laid out contiguously in that order, and the
header is exactly ``k3bundle.io.build_header``'s (plus space padding to ``files.data_alignment``),
so a file's bytes are a function of the plan and the source bytes only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from k3bundle.file_names import DEVICE_DIR
from k3bundle.io import build_header
from k3bundle.plan.placement import Plan, Target
from k3bundle.plan.storage import DevicePart


@dataclass(frozen=True, slots=True)
class DeviceTensor:
    """One tensor of a device file: what it holds and where it comes from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    target: Target
    part: DevicePart
    expert: int | None  # an unstacked expert's id; None for non-expert and stacked tensors

    @property
    def stacked(self) -> bool:
        return self.target.experts is not None and self.expert is None


@dataclass(frozen=True)
class OutFile:
    path: str  # relative to the bundle root
    rank: int
    shard: str
    tensors: tuple[DeviceTensor, ...]  # file order (sorted by name)
    offsets: tuple[int, ...]  # data_offsets begin of each tensor, relative to the data buffer
    prefix: bytes  # 8-byte header length + header JSON (+ padding): the file's first bytes

    @property
    def data_start(self) -> int:
        return len(self.prefix)

    @property
    def size(self) -> int:
        return self.data_start + sum(t.nbytes for t in self.tensors)


def shard_stem(shard: str) -> str:
    return shard[: -len(".safetensors")] if shard.endswith(".safetensors") else shard


def file_path(rank: int, shard: str, part: int) -> str:
    return f"{DEVICE_DIR}/rank-{rank:03d}/{shard_stem(shard)}-part{part:02d}.safetensors"


def device_tensors(plan: Plan, t: Target) -> list[DeviceTensor]:
    """The device tensors of one target (one per part; per expert unless stacked)."""
    schema, out = plan.schema, []
    specs = None
    for dp in plan.parts(t):
        if plan.stacked(t):
            name = schema.device_name(t.role, t.layer, None, dp.suffix, stacked=True)
            shape = (t.n_experts, *dp.shape)
            out.append(DeviceTensor(name, dp.dtype, shape, dp.nbytes * t.n_experts, t, dp, None))
            continue
        for e in t.expert_ids():
            if dp.suffix is None:  # the source tensor's own name
                specs = specs or {s.part: s for s in schema.specs(t.role, t.layer)}
                name = specs[dp.source_part].name
            else:
                name = schema.device_name(t.role, t.layer, e, dp.suffix)
            out.append(DeviceTensor(name, dp.dtype, dp.shape, dp.nbytes, t, dp, e))
    return out


def _prefix(tensors: list[DeviceTensor], metadata: dict[str, str], align: int) -> bytes:
    header = build_header(tensors, metadata)
    header += b" " * (-(8 + len(header)) % align)
    return struct.pack("<Q", len(header)) + header


def shard_files(plan: Plan, shard: str) -> list[OutFile]:
    """Every device file fed by source file ``shard``, in (rank, part) order."""
    by_rank: dict[int, list[DeviceTensor]] = {}
    for t in plan.by_shard[shard]:
        by_rank.setdefault(t.rank, []).extend(device_tensors(plan, t))
    cap, align = plan.layout.max_file_bytes, plan.layout.data_alignment
    files = []
    for rank in sorted(by_rank):
        tensors = sorted(by_rank[rank], key=lambda d: d.name)
        for a, b in zip(tensors, tensors[1:]):
            if a.name == b.name:  # a schema or plan bug, never a user error
                raise AssertionError(f"rank {rank}: duplicate device tensor {a.name}")
        parts: list[list[DeviceTensor]] = [[]]
        size = 0
        for d in tensors:
            if parts[-1] and size + d.nbytes > cap:
                parts.append([])
                size = 0
            parts[-1].append(d)
            size += d.nbytes
        for i, part in enumerate(parts, 1):
            meta = {"format": "pt", "k3bundle.rank": str(rank), "k3bundle.source_file": shard,
                    "k3bundle.target": plan.layout.name}
            offsets, off = [], 0
            for d in part:
                offsets.append(off)
                off += d.nbytes
            files.append(OutFile(file_path(rank, shard, i), rank, shard, tuple(part), tuple(offsets),
                                 _prefix(part, meta, align)))
    return files


def all_files(plan: Plan) -> list[OutFile]:
    return [f for shard in plan.shards for f in shard_files(plan, shard)]
