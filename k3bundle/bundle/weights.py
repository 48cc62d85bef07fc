"""A bundle's device weights as an executor ``WeightSource``: every rank merged, or one rank.

The executor (``k3bundle.executor``) asks for tensors by schema role. Here each request is
answered from ``weights.index.json``: the device tensors of that role instance are read from
the rank files (only their byte ranges; one expert's bytes out of a stacked tensor), decoded
from their stored format exactly (MXFP4 / NVFP4 / FP8 dequantization, scale un-swizzling), as
the bundle's declared tensor convention names them and defines their scales (an NVFP4
``weight_global_scale`` is read as compressed-tensors defines it, ``weight_scale_2`` as ModelOpt does),
stripped of padding, and either

- **merged**: placed at their logical rows/cols, so the executor sees the original tensor
  (what a bundle's ranks hold together), or
- **one rank** (``rank=r``): kept as that rank's local slice; the executor's block code reads
  head counts from weight shapes, partial sums go through ``reduce`` (``all_reduce``) and
  vocab-parallel logits through ``gather_vocab`` (``all_gather``), so one process per rank
  under ``torch.distributed`` really exchanges partial results.

Nothing is trusted from names: every tensor is found by (rank, role, layer) in the index.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from pathlib import Path

import torch

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.index import entry_format, read_index
from k3bundle.bundle.manifest import read_manifest
from k3bundle.config import load_config
from k3bundle.file_names import CONFIG, MANIFEST, WEIGHTS_INDEX
from k3bundle.executor.weights import EXPERT_ROLES, LayerWeights, WeightSource, policy
from k3bundle.formats import mxfp4
from k3bundle.ops.expert_weight import ExpertWeight
from k3bundle.io import SafetensorsFile
from k3bundle.schema import Format, Schema
from k3bundle.schema.roles import ROLE_BY_NAME, Scope
from k3bundle.storage import AS_STORED, CONVENTIONS, StorageFormat, storage_for


#: rank files a bundle reader keeps open at once: a b300-tp8 bundle of the release has 864 of them
#: and a process's descriptor limit is often 1,024 (``ulimit -n``), shared by every reader it opens
MAX_OPEN_FILES = 64


class _Files:
    """Rank files opened on demand, at most ``MAX_OPEN_FILES`` at once (the least recently used
    closed first; a file opened again reuses its checked header, and is refused if its size changed)."""

    def __init__(self, root: Path):
        self.root = root
        self.open: OrderedDict[str, SafetensorsFile] = OrderedDict()
        self._headers: dict = {}

    def reader(self, name: str) -> SafetensorsFile:
        f = self.open.pop(name, None)
        if f is None:
            while len(self.open) >= MAX_OPEN_FILES:
                self.open.popitem(last=False)[1].close()
            f = SafetensorsFile(self.root / name, header=self._headers.get(name))
            self._headers[name] = f.header
        self.open[name] = f  # most recently used last
        return f

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()

    def get(self, entry: dict, expert: int | None = None) -> torch.Tensor:
        f = self.reader(entry["file"])
        src = entry["source"]
        if expert is None or "experts" not in src:
            return f.get(entry["key"])
        first = src["experts"][0]
        stride = src["expert_stride"]  # bytes of one expert inside the stacked tensor
        raw = f.read_bytes(entry["key"], (expert - first) * stride, (expert - first + 1) * stride)
        t = torch.frombuffer(bytearray(raw), dtype=f.info(entry["key"]).torch_dtype)
        return t.reshape(entry["shape"][1:])


def read_format(entry: dict, convention: str) -> StorageFormat:
    """The storage format of an index entry, reading its tensors as ``convention`` names them."""
    return entry_format(entry).under(convention)


def bundle_convention(manifest: dict, where: str | Path) -> str:
    """The tensor convention a bundle's resolved layout declares (docs/bundle-format.md "Conventions")."""
    name = manifest.get("layout", {}).get("resolved", {}).get("convention")
    if name not in CONVENTIONS:
        raise BundleError(f"{where}: manifest.json declares no known tensor convention ({name!r}); the bundle "
                          "predates conventions or is damaged: convert it again")
    return name


def _unpad(t: torch.Tensor, src: dict, stacked: bool = False) -> torch.Tensor:
    """A device slice without its padding rows and columns (``stacked``: of each expert of a stack)."""
    rows = 1 if stacked else 0
    r0, r1 = src["rows"]
    t = t.narrow(rows, 0, r1 - r0) if src.get("pad_rows") else t
    if src.get("pad_cols") and src.get("cols") is not None:
        c0, c1 = src["cols"]
        t = t.narrow(rows + 1, 0, c1 - c0)
    return t


class BundleWeights(WeightSource):
    """Device weights of a bundle, merged over ranks (``rank=None``) or one rank's slices.

    Args:
        bundle (`Path`): the bundle directory (manifest.json, weights.index.json, device_weights/).
        dtype (`str`): the executor's dtype policy ("bfloat16" emulates a serving engine).
        device (`str`): torch device.
        rank (`int`, optional): read only this rank's tensors (one process per rank).
        group: the torch.distributed process group for ``reduce``/``gather_vocab`` (per-rank mode).
        resident_bytes (`int`): keep decoded tensors and experts after first use, up to this many
            bytes on ``device`` (``executor.weights.resident_budget``). A teacher-forced run asks for
            every layer at the prompt and again at each decode step; at the release widths one
            layer takes seconds to read, merge and decode, so ``validate`` keeps what fits. 0: read
            every request afresh (the real model merged does not fit anywhere).
    """

    def __init__(self, bundle: str | Path, dtype: str = "bfloat16", device: str | torch.device = "cpu",
                 rank: int | None = None, group=None, resident_bytes: int = 0):
        self.root = Path(bundle)
        if not (self.root / MANIFEST).is_file():
            raise BundleError(f"{self.root}: no {MANIFEST}; the bundle is incomplete (convert did not finish)")
        self.convention = bundle_convention(read_manifest(self.root), self.root)
        self.config = load_config(self.root / CONFIG)
        self.schema = Schema(self.config)
        self.policy = policy(dtype)
        self.device = torch.device(device)
        self.rank, self.group = rank, group
        index = read_index(self.root / WEIGHTS_INDEX)
        self.world = int(index.get("world", 1))
        if rank is not None and not 0 <= rank < self.world:
            raise BundleError(f"{self.root}: rank {rank} out of range 0..{self.world - 1}")
        # (role, layer) -> entries; per entry one part of one rank's slice
        self.entries: dict[tuple[str, int | None], list[dict]] = defaultdict(list)
        for e in index["tensors"]:
            if rank is None or e["rank"] == rank:
                self.entries[(e["role"], e["layer"])].append(e)
        if rank is not None:
            heads = self.config.text.linear_attn_config.num_heads
            if heads % self.world:
                raise BundleError(f"{self.root}: {self.world} ranks do not split {heads} KDA heads evenly")
            self.kda_heads = heads // self.world
        self.files = _Files(self.root)
        self._experts: dict[int, OrderedDict] = {}
        self.expert_reads = 0
        self.resident_bytes = int(resident_bytes)
        self._kept: dict[tuple, object] = {}  # (role, layer) or ("expert", layer, e) -> decoded, on device
        self.kept_bytes = 0

    def _keep(self, key: tuple, make, nbytes: int | None = None):
        """``make()``, kept for the next request while the resident budget allows."""
        if key in self._kept:
            return self._kept[key]
        value = make()
        size = nbytes if nbytes is not None else (value.numel() * value.element_size() if value is not None else 0)
        if self.kept_bytes + size <= self.resident_bytes:
            self._kept[key] = value
            self.kept_bytes += size
        return value

    # ---- decoding ----
    def _dtype(self, role: str) -> torch.dtype:
        return self.policy.f32 if ROLE_BY_NAME[role].fmt is Format.F32 else self.policy.weight

    def _parts_by_rank(self, role: str, layer: int | None, expert: int | None) -> dict[int, dict[str, dict]]:
        """{rank: {part: index entry}} of the slices holding the role instance (one expert's)."""
        by_rank: dict[int, dict[str, dict]] = defaultdict(dict)
        for e in self.entries.get((role, layer), []):
            src = e["source"]
            if expert is not None:
                if "experts" in src:
                    a, b = src["experts"]
                    if not a <= expert < b:
                        continue
                elif f".experts.{expert}." not in src.get("key", "") + ".":
                    continue
            by_rank[e["rank"]][e["part"]] = e
        return by_rank

    def slices(self, role: str, layer: int | None, expert: int | None = None) -> list[tuple[dict, torch.Tensor]]:
        """[(index entry of the slice's first part, decoded local tensor without padding)] for every
        rank holding a slice of the role instance; read through the bundle's declared convention."""
        by_rank = self._parts_by_rank(role, layer, expert)
        out = []
        for r in sorted(by_rank):
            parts = by_rank[r]
            first = next(iter(parts.values()))
            tensors = {p: self.files.get(e, expert) for p, e in parts.items()}
            fmt = read_format(first, self.convention)
            value = fmt.decode(tensors, self._decode_dtype)
            out.append((parts.get("packed") or parts.get("weight") or first, _unpad(value, first["source"])))
        return out

    def mxfp4_expert(self, role: str, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One expert's projection as stored MXFP4 (codes [rows, cols/2], row-major E8M0 scales
        [rows, cols/32], padding removed), where one slice holds all of it here: EP layouts merged,
        any layout per rank. None otherwise (other formats, an expert split over merged ranks)."""
        by_rank = self._parts_by_rank(role, layer, expert)
        if len(by_rank) != 1:
            return None
        parts = next(iter(by_rank.values()))
        fmt = read_format(next(iter(parts.values())), self.convention)
        if not fmt.stores_mxfp4:
            return None
        src = parts["packed"]["source"]
        whole = list(src["rows"]) == [0, src["logical_shape"][0]] and \
            list(src.get("cols") or [0, src["logical_shape"][1]]) == [0, src["logical_shape"][1]]
        if self.rank is None and not whole:  # merged: a TP-split expert is assembled from several slices
            return None
        packed, scale = fmt.mxfp4_pair({p: self.files.get(e, expert) for p, e in parts.items()})
        rows_p, cols_p = packed.shape[-2], packed.shape[-1] * 2
        r0, r1 = src["rows"]
        rows = r1 - r0 if src.get("pad_rows") else rows_p
        cols = (src["cols"][1] - src["cols"][0]) if src.get("pad_cols") and src.get("cols") is not None else cols_p
        return (packed[:rows, :cols // 2].contiguous().to(self.device),
                scale[:rows, :cols // mxfp4.BLOCK].contiguous().to(self.device))

    def expert_stacks(self, role: str, layer: int) -> list[tuple[dict, tuple[int, int], torch.Tensor]] | None:
        """Every rank's stacked experts of a routed-expert role instance, each decoded at once:
        [(index entry of the first part, (first, stop) expert ids, [stop - first, rows, cols]
        without padding)]; None when the bundle stores the role's experts one by one."""
        by_rank = self._stacked_by_rank(role, layer)
        if by_rank is None:
            return None
        out = []
        for r in sorted(by_rank):
            parts = by_rank[r]
            first = next(iter(parts.values()))
            fmt = read_format(first, self.convention)
            value = fmt.decode_stack({p: self.files.get(e) for p, e in parts.items()}, self._decode_dtype)
            src = first["source"]
            out.append((parts.get("packed") or parts.get("weight") or first, tuple(src["experts"]),
                        _unpad(value, src, stacked=True)))
        return out

    @property
    def _decode_dtype(self) -> torch.dtype:
        """What stored formats decode to before the policy's dtype: FP64 under float64, else FP32."""
        return torch.float64 if self.policy.weight == torch.float64 else torch.float32

    def _stacked_by_rank(self, role: str, layer: int) -> dict[int, dict[str, dict]] | None:
        """{rank: {part: index entry}} of a routed-expert role instance whose slices are all stacked
        tensors; None when the bundle stores its experts one by one."""
        by_rank: dict[int, dict[str, dict]] = defaultdict(dict)
        for e in self.entries.get((role, layer), []):
            if "experts" not in e["source"]:
                return None
            by_rank[e["rank"]][e["part"]] = e
        return by_rank or None

    def _stack_decode(self, role: str, layer: int) -> tuple[tuple[int, ...], dict[int, dict[str, dict]]] | None:
        """(an expert's value shape here, ``_stacked_by_rank``) where the experts of this role can be
        decoded a rank stack at a time: stacked, and no two ranks hold the same region (a replica,
        which the one-by-one path compares); None otherwise."""
        by_rank = self._stacked_by_rank(role, layer)
        if by_rank is None:
            return None
        cover = [(tuple(s["rows"]), tuple(s.get("cols") or ()), tuple(s["experts"]))
                 for s in (next(iter(parts.values()))["source"] for parts in by_rank.values())]
        if len(set(cover)) != len(cover):
            return None
        src = next(iter(next(iter(by_rank.values())).values()))["source"]
        if self.rank is None:
            shape = tuple(src["logical_shape"])
        else:
            (r0, r1), cols = src["rows"], src.get("cols")
            shape = (r1 - r0, *((cols[1] - cols[0],) if cols is not None else src["logical_shape"][1:]))
        return shape, by_rank

    def _expert_values(self, role: str, ids: list[int], shape: tuple[int, ...],
                       by_rank: dict[int, dict[str, dict]]) -> list[torch.Tensor]:
        """``_tensor(role, layer, e)`` for every e of ``ids`` (``shape`` and ``by_rank`` from
        ``_stack_decode``): each rank's slices of those experts read one by one out of its stack and
        decoded as one stack (``decode_stack``: bit for bit the per-expert decode), then placed at
        their rows/cols as ``_tensor`` places them."""
        out = torch.zeros(len(ids), *shape, dtype=self._decode_dtype)
        for r in sorted(by_rank):
            parts = by_rank[r]
            first = next(iter(parts.values()))
            src = first["source"]
            a, b = src["experts"]
            held = [(i, e) for i, e in enumerate(ids) if a <= e < b]
            if not held:
                continue
            stack = {p: torch.stack([self.files.get(entry, e) for _, e in held]) for p, entry in parts.items()}
            value = _unpad(read_format(first, self.convention).decode_stack(stack, self._decode_dtype), src,
                           stacked=True)
            at = torch.tensor([i for i, _ in held])
            if self.rank is not None or value.ndim != 3:
                out[at] = value
            else:
                (r0, r1), cols = src["rows"], src.get("cols")
                c0, c1 = cols if cols is not None else (0, value.shape[2])
                out[at, r0:r1, c0:c1] = value
        return list(out.to(device=self.device, dtype=self._dtype(role)).unbind(0))

    def _tensor(self, role: str, layer: int | None, expert: int | None = None) -> torch.Tensor | None:
        slices = self.slices(role, layer, expert)
        if not slices:
            if self.rank is None:
                raise BundleError(f"{self.root}: weights.index.json has no tensor of role {role} "
                                  f"(layer {layer}{'' if expert is None else f', expert {expert}'})")
            return None
        if self.rank is not None:
            t = slices[0][1]
        else:
            t = torch.zeros(slices[0][0]["source"]["logical_shape"], dtype=slices[0][1].dtype)
            seen: dict[tuple, tuple[int, torch.Tensor]] = {}
            for entry, v in slices:
                src = entry["source"]
                r0, r1 = src["rows"]
                region = (r0, r1, *(src.get("cols") or ()))
                if region in seen:  # a replica (attention-DP, replicated norms): must equal the first
                    r_first, v_first = seen[region]
                    if not torch.equal(v, v_first):
                        raise BundleError(f"{self.root}: rank {entry['rank']}'s replica of {entry['key']} differs "
                                          f"from rank {r_first}'s (a replicated tensor must be identical on "
                                          f"every rank; run `k3bundle verify`)")
                    continue
                seen[region] = (entry["rank"], v)
                if src.get("cols") is None or t.ndim != 2:
                    t[r0:r1] = v
                else:
                    c0, c1 = src["cols"]
                    t[r0:r1, c0:c1] = v
        return t.to(device=self.device, dtype=self._dtype(role))

    # ---- WeightSource ----
    def layer(self, layer: int, decode: bool = False) -> LayerWeights:
        roles = [r.role for r in self.schema.layer_roles(layer) if r.scope is not Scope.EXPERT]
        tensors = {role: self._keep((role, layer), lambda r=role: self._tensor(r, layer)) for role in roles}
        tensors = {k: v for k, v in tensors.items() if v is not None}
        if not self.config.text.is_moe(layer):
            return LayerWeights(layer, tensors, reduce=self.reduce)
        cache = self._experts.setdefault(layer, OrderedDict())
        t = self.config.text
        expert_bytes = 3 * t.moe_intermediate_size * t.routed_expert_hidden_size * \
            torch.empty(0, dtype=self.policy.weight).element_size()  # decoded; the codes are less

        shapes, batches = {}, {}  # per role: the value's shape; the stack decode, where the experts are stacked
        for role in EXPERT_ROLES:
            stacked = self._stack_decode(role, layer)  # once per layer request, for every group of it
            if stacked is not None:
                shapes[role] = stacked[0]
                batches[role] = (("bundle", id(self), layer, role),
                                 lambda ids, r=role, st=stacked: self._expert_values(r, ids, *st))

        def expert(e: int):
            if ("expert", layer, e) in self._kept:
                return self._kept[("expert", layer, e)]
            if e in cache:
                return cache[e]
            if self.rank is not None and any(not self._parts_by_rank(role, layer, e) for role in EXPERT_ROLES):
                return None  # owned by another expert-parallel rank (merged: a missing expert is an error, on use)
            parts = {role: ExpertWeight(lambda r=role: self._tensor(r, layer, e),
                                        lambda r=role: self.mxfp4_expert(r, layer, e), shape=shapes.get(role),
                                        batch=batches.get(role) and (*batches[role], e)) for role in EXPERT_ROLES}
            self.expert_reads += 1
            if self.kept_bytes + expert_bytes <= self.resident_bytes:
                self._kept[("expert", layer, e)] = parts
                self.kept_bytes += expert_bytes
            elif decode:
                cache[e] = parts
                while len(cache) > self.config.text.num_experts_per_token:
                    cache.popitem(last=False)
            return parts

        return LayerWeights(layer, tensors, expert, reduce=self.reduce, expert_op=self._expert_op(layer))

    def _expert_op(self, layer: int) -> str:
        """The grouped GEMM op of this layer's expert storage (graph_manifest custom_ops)."""
        entries = self.entries.get(("moe.expert.w1", layer))
        fmt = read_format(entries[0], self.convention) if entries else \
            storage_for(AS_STORED, ROLE_BY_NAME["moe.expert.w1"])  # as released
        return (fmt.gemm_op or "bf16_gemm") + "_grouped"

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self._embed_rows()
        if self.rank is None:
            return w[ids.to(w.device)].to(self.policy.act)
        r0, r1 = next(e["source"]["rows"] for e in self.entries[("embed", None)])
        local = (ids >= r0) & (ids < r1)
        rows = torch.zeros(ids.shape[0], w.shape[1], dtype=w.dtype, device=w.device)
        rows[local.to(w.device)] = w[(ids[local] - r0).to(w.device)]
        return self.reduce(rows).to(self.policy.act)  # vocab-parallel embedding: sum over ranks

    def _embed_rows(self) -> torch.Tensor:
        if not hasattr(self, "_embed"):
            self._embed = self._tensor("embed", None)
        return self._embed

    def global_tensor(self, role: str) -> torch.Tensor:
        return self._keep((role, None), lambda: self._tensor(role, None))

    def vision_tensor(self, role: str, block: int | None = None) -> torch.Tensor:
        if self.config.vision is None:
            raise BundleError(f"{self.root}: config.json has no vision_config; the bundle has no vision tower")
        return self._keep((role, block), lambda: self._tensor(role, block))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            return x
        import torch.distributed as dist

        # partial sums travel in FP32 (gloo has no BF16 sum; serving engines accumulate in FP32)
        y = x.to(torch.float32 if x.dtype != torch.float64 else x.dtype).contiguous()
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            return logits
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        self.files.close()


def bundle_layout(bundle: str | Path) -> dict:
    """The resolved layout recorded in the bundle's manifest."""
    m = read_manifest(bundle)
    return m["layout"]["resolved"]
