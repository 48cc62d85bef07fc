"""Where the executor's weights come from: one layer at a time, experts only when routed.

The executor asks a ``WeightSource`` for tensors by **schema role** ("kda.q_proj",
"moe.expert.w1", ...), never by name: the source resolves names through
``k3bundle.schema.Schema.name``. A source returns *logical* tensors (MXFP4 experts
dequantized, everything else as stored) converted to the dtype policy, on its device.

Memory contract (design.md "Executor"): ``layer(l)`` reads that layer's non-expert tensors;
the executor drops the ``LayerWeights`` before asking for the next layer, so peak memory is
one layer. Routed experts are read and dequantized from MXFP4 only when the router selects
them (``LayerWeights.expert(e)``) and freed after use, except for a small per-layer LRU that
decode fills (the last ``expert_cache`` experts each layer used).

Plug-in points for later sources (bundle files, merged TP shards, one TP/EP rank): implement
``layer``, ``embed`` and ``global_tensor``. Block code reads head counts from weight shapes,
never from the config, so a per-rank source may hand out local head slices; ``reduce`` (sum
partial outputs over ranks: after row-parallel projections and the routed-expert sum) and
``gather_vocab`` (join vocab-parallel logits) are identities in one process. ``expert(e)``
returns ``None`` for an expert another rank owns.

Dtype policy (name -> BF16-stored and MXFP4 weights / F32-stored tensors / activations /
recurrent state):

- ``float64``: f64 / f64 / f64 / f64 — tests; every stored value converts exactly.
- ``float32``: f32 / f32 / f32 / f32 — goldens; exact upcast of every stored value.
- ``bfloat16``: bf16 / f32 / bf16 / f32 — device emulation: weights as stored (MXFP4
  dequantizes exactly into bf16), activations in bf16 between ops, statistics, gates,
  softmax, router and KDA state in f32, as serving engines keep them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from k3bundle.config import K3Config
from k3bundle.executor.errors import ExecutorError
from k3bundle.formats import mxfp4
from k3bundle.ops.expert_weight import ExpertWeight, logical
from k3bundle.schema import Format, Schema
from k3bundle.schema.roles import ROLE_BY_NAME, Scope
from k3bundle.checkpoint import SourceCheckpoint

EXPERT_ROLES = ("moe.expert.w1", "moe.expert.w2", "moe.expert.w3")  # gate, down, up (docs/kimi-k3.md §2.3)
MXFP4_GROUPED = "mxfp4_weight_gemm_grouped"  # the release stores routed experts MXFP4


@dataclass(frozen=True)
class DtypePolicy:
    name: str
    weight: torch.dtype  # BF16-stored tensors and dequantized MXFP4 experts
    f32: torch.dtype  # F32-stored tensors (A_log, dt_bias, conv kernels, o_norm, router bias)
    act: torch.dtype  # activations between ops, conv state, MLA latent cache
    state: torch.dtype  # KDA recurrent state (FP32 in every serving engine, docs/kimi-k3.md §5.3)


POLICIES = {
    "float64": DtypePolicy("float64", torch.float64, torch.float64, torch.float64, torch.float64),
    "float32": DtypePolicy("float32", torch.float32, torch.float32, torch.float32, torch.float32),
    "bfloat16": DtypePolicy("bfloat16", torch.bfloat16, torch.float32, torch.bfloat16, torch.float32),
}


def policy(name: str | DtypePolicy) -> DtypePolicy:
    if isinstance(name, DtypePolicy):
        return name
    if name not in POLICIES:
        raise ExecutorError(f"dtype {name!r} is not one of {', '.join(POLICIES)}")
    return POLICIES[name]


class LayerWeights(Mapping):
    """One decoder layer's non-expert tensors by role, plus lazy access to its routed experts."""

    def __init__(self, layer: int, tensors: dict[str, torch.Tensor],
                 expert: Callable[[int], dict[str, ExpertWeight] | None] | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 expert_op: str = MXFP4_GROUPED):
        self.layer = layer
        self._tensors = tensors
        self._expert = expert
        self.reduce = reduce or (lambda x: x)
        self.expert_op = expert_op  # the grouped GEMM op of the experts' storage (graph_manifest custom_ops)

    def __getitem__(self, role: str) -> torch.Tensor:
        try:
            return self._tensors[role]
        except KeyError:
            raise KeyError(f"layer {self.layer} has no tensor of role {role!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def expert(self, e: int) -> dict[str, torch.Tensor] | None:
        """{"moe.expert.w1": gate [Ie, Lr], "...w3": up, "...w2": down [Lr, Ie]}, or None if not local."""
        return logical(self.stored_expert(e))

    def stored_expert(self, e: int) -> dict[str, ExpertWeight] | None:
        """The same as ``ExpertWeight``s: the stored MXFP4 form where the source has it (a backend's
        grouped-expert op reads it), the logical value on demand."""
        if not self._expert:
            return None
        w = self._expert(e)
        return None if w is None else {r: v if isinstance(v, ExpertWeight) else ExpertWeight(v) for r, v in w.items()}

    def shared(self) -> "LayerWeights":
        """The same layer for several runs at once: each routed expert fetched once, kept for the
        others (``model.drive_lockstep``)."""
        if not self._expert:
            return self
        fetch, kept = self._expert, {}

        def expert(e):
            if e not in kept:
                kept[e] = fetch(e)
            return kept[e]
        return LayerWeights(self.layer, self._tensors, expert, self.reduce, self.expert_op)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


class WeightSource(ABC):
    """What the executor needs from a checkpoint, a bundle or a rank of one."""

    config: K3Config
    policy: DtypePolicy
    device: torch.device

    @abstractmethod
    def layer(self, layer: int, decode: bool = False) -> LayerWeights:
        """Decoder layer ``layer``; ``decode`` lets it fill the per-layer expert cache."""

    @abstractmethod
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows [T, D] of token ids (E0), activation dtype."""

    @abstractmethod
    def global_tensor(self, role: str) -> torch.Tensor:
        """final_norm, out_res.norm, out_res.proj, lm_head."""

    def vision_tensor(self, role: str, block: int | None = None) -> torch.Tensor:
        """A vision tower or projector tensor by role (``vit.*`` per encoder ``block``, ``proj.*``)."""
        raise ExecutorError(f"{type(self).__name__} holds no vision tensors")

    #: KDA heads held by this source (a TP rank holds a slice); None = all of them
    kda_heads: int | None = None
    #: the kernels every executor on this source runs (``k3bundle.kernels``); None = the reference
    backend = None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


#: the share of free memory one dtype policy's resident weights may take: a run's BF16 device
#: weights and its float32 exact-check (or golden) weights fit together, with room for activations
RESIDENT_SHARE = {"bfloat16": 0.2, "float32": 0.4, "float64": 0.4}
#: at most this many bytes of one weight source stay resident in host memory (a CPU device): on a
#: host the cache competes with the page cache and every other process, and a command's peak RSS
#: must stay bounded whatever the model (under 2 GB at the release's 497,220 tensors; docs/
#: performance.md "Release scale"). The tiny model's float32 weights fit whole.
HOST_RESIDENT_MAX = 256 << 20


def resident_budget(device: str | torch.device, dtype: str, processes: int = 1) -> int:
    """Bytes a weight source of dtype policy ``dtype`` may keep resident on ``device``: its share
    of the free GPU memory (CUDA) or of the available RAM (``/proc/meminfo``; 0 where unknown) up
    to ``HOST_RESIDENT_MAX``, split over ``processes`` sharing that memory. A run that asks for a layer many times
    (teacher-forced decode) keeps what fits and re-reads the rest."""
    device, share = torch.device(device), RESIDENT_SHARE.get(dtype, 0.2) / max(1, processes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * share)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(int(int(line.split()[1]) * 1024 * share), int(HOST_RESIDENT_MAX / max(1, processes)))
    except OSError:
        pass
    return 0


class SourceWeights(WeightSource):
    """A ``SourceCheckpoint`` read through the schema, one layer at a time.

    Args:
        source (`SourceCheckpoint` or path): the checkpoint.
        dtype (`str`): "float64", "float32" or "bfloat16" (see module docstring).
        device (`str`): any torch device; tensors are read on CPU and moved once.
        resident (`bool`): keep non-expert tensors after first use (fast decode of small models).
        expert_cache (`int`, optional): experts kept per MoE layer for decode; default top-k,
            reduced so that the whole cache stays under ``expert_cache_bytes``.
        prefetch (`bool`): stream with read-ahead: while layer l computes, a reader thread
            brings layer l+1 (l = last: layer 0, the next forward's first) onto the device, on
            a side stream where the device is CUDA; for a prefill it also brings that layer's
            routed experts as stored (MXFP4 bytes), since a prefill routes to most of them. So
            the device holds two layers, never the model (``docs/executor.md`` "Streaming").
    """

    def __init__(self, source: SourceCheckpoint | str | Path, dtype: str = "float32",
                 device: str | torch.device = "cpu", resident: bool = False,
                 expert_cache: int | None = None, expert_cache_bytes: int = 512 << 20, prefetch: bool = False):
        self.src = source if isinstance(source, SourceCheckpoint) else SourceCheckpoint(source)
        self.config = self.src.config
        self.schema: Schema = self.src.schema
        self.policy = policy(dtype)
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise ExecutorError(f"bad device {device!r}: {e}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ExecutorError(f"device {device!r}: CUDA is not available on this machine")
        self.resident = resident
        self._resident: dict[tuple[str, int | None], torch.Tensor] = {}
        t = self.config.text
        per_expert = 3 * t.moe_intermediate_size * t.routed_expert_hidden_size * \
            torch.empty(0, dtype=self.policy.weight).element_size()
        fit = expert_cache_bytes // max(1, per_expert * max(1, len(t.moe_layers)))
        self.expert_cache = min(t.num_experts_per_token, fit) if expert_cache is None else expert_cache
        self._experts: dict[int, OrderedDict[int, dict[str, torch.Tensor]]] = {}
        self.expert_reads = 0  # experts read + dequantized (a test/bench counter)
        self.prefetch = prefetch and not resident
        self._ahead: dict[int, Future] = {}  # layer -> its tensors (and stored experts) being read
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="k3prefetch") if self.prefetch else None
        self._stream = torch.cuda.Stream(self.device) if self.prefetch and self.device.type == "cuda" else None

    # ---- reads ----
    def _convert(self, t: torch.Tensor, role: str) -> torch.Tensor:
        fmt = ROLE_BY_NAME[role].fmt
        dtype = self.policy.f32 if fmt is Format.F32 else self.policy.weight
        return t.to(device=self.device, dtype=dtype)

    def _read(self, role: str, layer: int | None = None) -> torch.Tensor:
        key = (role, layer)
        if key in self._resident:
            return self._resident[key]
        t = self._convert(self.src.get(self.schema.name(role, layer)), role)
        if self.resident:
            self._resident[key] = t
        return t

    def _read_stored(self, layer: int, e: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {role: tuple(self._to_device(self.src.get(self.schema.name(role, layer, e, part=part)))
                            for part in ("packed", "scale")) for role in EXPERT_ROLES}

    def _dense_roles(self, layer: int) -> list[str]:
        """The roles of ``layer``'s non-expert tensors."""
        return [r.role for r in self.schema.layer_roles(layer) if r.scope is not Scope.EXPERT]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._stream is not None and threading.current_thread() is not threading.main_thread():
            with torch.cuda.stream(self._stream):  # the reader thread's copies overlap the compute
                return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _read_ahead(self, layer: int, experts: bool):
        """What ``layer`` needs, read on the reader thread; an event marks the copies' end."""
        tensors = {role: self._convert_on_device(self._to_device(self.src.get(self.schema.name(role, layer))), role)
                   for role in self._dense_roles(layer)}
        stored = {}
        if experts and self.config.text.is_moe(layer):
            stored = {e: self._read_stored(layer, e) for e in range(self.config.text.num_experts)}
        done = None
        if self._stream is not None:
            done = torch.cuda.Event()
            done.record(self._stream)
        return tensors, stored, done

    def _convert_on_device(self, t: torch.Tensor, role: str) -> torch.Tensor:
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                return self._convert(t, role)
        return self._convert(t, role)

    def _take_ahead(self, layer: int, decode: bool):
        """Layer ``layer`` from the reader (or read now), and the read of the next one started."""
        fut = self._ahead.pop(layer, None)
        for f in self._ahead.values():  # a layer asked out of order: drop stale read-aheads
            f.cancel()
        self._ahead.clear()
        tensors, stored, done = fut.result() if fut is not None else self._read_ahead(layer, not decode)
        if done is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(done)  # the copies are complete before any kernel reads them
            for t in [*tensors.values(), *(x for s in stored.values() for pair in s.values() for x in pair)]:
                t.record_stream(cur)  # made on the side stream, used and freed on this one
        nxt = (layer + 1) % self.config.text.num_hidden_layers
        self._ahead[nxt] = self._reader.submit(self._read_ahead, nxt, not decode)
        return tensors, stored

    def _read_expert(self, layer: int, e: int, stored: dict | None = None) -> dict[str, ExpertWeight]:
        out = {}
        parts = (stored.pop(e, None) if stored else None) or self._read_stored(layer, e)  # read ahead, or now
        for role in EXPERT_ROLES:
            packed, scale = parts[role]
            decode = lambda p=packed, s=scale: mxfp4.dequantize(p, s, self.policy.weight,  # noqa: E731
                                                                block=self.config.text.mxfp4_group)
            out[role] = ExpertWeight(decode, (packed, scale))
        self.expert_reads += 1
        return out

    # ---- WeightSource ----
    def layer(self, layer: int, decode: bool = False) -> LayerWeights:
        stored = None
        if self.prefetch:
            tensors, stored = self._take_ahead(layer, decode)
        else:
            tensors = {role: self._read(role, layer) for role in self._dense_roles(layer)}
        if not self.config.text.is_moe(layer):
            return LayerWeights(layer, tensors, reduce=self.reduce)
        cache = self._experts.setdefault(layer, OrderedDict())

        def expert(e: int) -> dict[str, torch.Tensor]:
            if e in cache:
                cache.move_to_end(e)
                return cache[e]
            w = self._read_expert(layer, e, stored)
            if decode and self.expert_cache > 0:
                cache[e] = w
                while len(cache) > self.expert_cache:
                    cache.popitem(last=False)
            return w

        return LayerWeights(layer, tensors, expert, reduce=self.reduce)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        name = self.schema.name("embed")
        rows = [self.src.get_rows(name, i, i + 1) for i in ids.tolist()]
        return self._convert(torch.cat(rows), "embed").to(self.policy.act)

    def global_tensor(self, role: str) -> torch.Tensor:
        return self._read(role)

    def vision_tensor(self, role: str, block: int | None = None) -> torch.Tensor:
        if self.config.vision is None:
            raise ExecutorError(f"{self.src.dir}: config.json has no vision_config; the checkpoint has no vision tower")
        return self._read(role, block)

    def close(self) -> None:
        if self._reader is not None:
            for f in self._ahead.values():
                f.cancel()
            self._reader.shutdown(wait=True)
        self.src.close()
