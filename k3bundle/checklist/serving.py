"""The serving engine's settings, stated as engines state them, and what they change in the checklist.

``Serving`` carries ``checklist``'s engine options (docs/bring-up.md "Engine terms"):

* ``kv_cache_dtype``: how the MLA latent is stored (``k3bundle/data/kv_cache_dtypes.yaml``: bytes
  per value of the latent and rope parts and per-token scales, as vLLM and SGLang allocate them);
* ``gpu_memory_utilization``: vLLM's meaning, the share of each card's HBM the engine may use,
  weights included; it replaces the layout's fixed ``memory.runtime_reserve_bytes`` by
  ``hbm − floor(F × hbm)``;
* ``attention_dp``: SGLang's ``--dp N --enable-dp-attention`` over a stage's ``R = tp × attention_dp``
  ranks: ``N`` replicas of attention TP ``R / N`` (``attn_tp_size = tp_size // dp_size``,
  sglang ``layers/dp_attention.py``); the routed experts keep their ``ep`` × ``moe_tp`` split;
* the prefix-cache snapshot policy, the MLA page size and the prefill/decode link (``cache_budget``).

``apply_to_layout`` and ``cache_manifest`` are pure: a layout and a graph manifest in, the ones the
engine would run with out, so capacity and the roofline read one set of numbers.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

from k3bundle.checklist.errors import ChecklistError
from k3bundle.errors import YamlFileError
from k3bundle.io.strict_yaml import loads_yaml
from k3bundle.layouts import Layout

KV_CACHE_DTYPES_FILE = "kv_cache_dtypes.yaml"
DEFAULT_KV_CACHE_DTYPE = "bf16"
#: tokens per MLA page: FlashMLA's block size (vLLM and SGLang use 64 for it)
DEFAULT_PAGE_TOKENS = 64
#: Gbit/s per rank for a prefill/decode handoff: one 400G NIC per GPU (ConnectX-7 class)
DEFAULT_LINK_GBPS = 400.0


@dataclass(frozen=True)
class KvCacheDtype:
    """One row of ``kv_cache_dtypes.yaml``: how an engine stores a token's latent in one MLA layer."""

    name: str
    latent_bytes: int  # per value of the kv_lora_rank part
    rope_bytes: int  # per value of the qk_rope_head_dim part
    scale_group: int | None  # latent values per stored per-token scale; None: no per-token scale
    scale_bytes: int
    engines: str
    layout: str

    def scales(self, kv_lora_rank: int) -> int:
        return 0 if self.scale_group is None else -(-kv_lora_rank // self.scale_group)

    def bytes_per_layer(self, kv_lora_rank: int, rope_dim: int) -> int:
        """Bytes of one token's latent in one MLA layer."""
        return kv_lora_rank * self.latent_bytes + self.scales(kv_lora_rank) * self.scale_bytes + rope_dim * self.rope_bytes

    def formula(self, kv_lora_rank: int, rope_dim: int) -> str:
        """``bytes_per_layer`` written out: ``512 × 1 B + 4 × 4 B + 64 × 2 B``."""
        parts = [f"{kv_lora_rank} × {self.latent_bytes} B"]
        if self.scale_group is not None:
            parts.append(f"{self.scales(kv_lora_rank)} × {self.scale_bytes} B scales")
        parts.append(f"{rope_dim} × {self.rope_bytes} B")
        return " + ".join(parts)


def _field(row: dict, key: str, where: str, optional: bool = False):
    v = row.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key != "scale_bytes" else 0):
        raise ChecklistError(f"{where}.{key}: must be a {'positive' if key != 'scale_bytes' else 'non-negative'} "
                             f"integer, got {v!r}")
    return v


@lru_cache(maxsize=1)
def kv_cache_dtypes() -> dict[str, KvCacheDtype]:
    """The table of ``k3bundle/data/kv_cache_dtypes.yaml``, name -> format."""
    res = resources.files("k3bundle") / "data" / KV_CACHE_DTYPES_FILE
    where = f"k3bundle/data/{KV_CACHE_DTYPES_FILE}"
    try:
        doc = loads_yaml(res.read_text(encoding="utf-8"), where)
    except YamlFileError as e:
        raise ChecklistError(str(e)) from None
    rows = doc.get("dtypes") if isinstance(doc, dict) else None
    if not isinstance(rows, dict) or not rows:
        raise ChecklistError(f"{where}: dtypes must be a mapping of name -> format")
    out = {}
    for name, row in rows.items():
        at = f"{where}: dtypes.{name}"
        if not isinstance(row, dict):
            raise ChecklistError(f"{at}: must be a mapping")
        out[name] = KvCacheDtype(name, _field(row, "latent_bytes", at), _field(row, "rope_bytes", at),
                                 _field(row, "scale_group", at, optional=True), _field(row, "scale_bytes", at),
                                 str(row.get("engines", "")), str(row.get("layout", "")))
    return out


@dataclass(frozen=True)
class Serving:
    """``checklist``'s engine options; ``None`` keeps what the layout says."""

    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    gpu_memory_utilization: float | None = None
    attention_dp: int | None = None
    snapshot_every: int | None = None  # tokens between KDA snapshots of a request
    snapshot_turns: int | None = None  # KDA snapshots per request, one per turn boundary
    page_tokens: int = DEFAULT_PAGE_TOKENS
    link_gbps: float = DEFAULT_LINK_GBPS

    def check(self) -> None:
        """One ``ChecklistError`` line for the first option out of range."""
        table = kv_cache_dtypes()
        if self.kv_cache_dtype not in table:
            raise ChecklistError(f"--kv-cache-dtype {self.kv_cache_dtype}: choose one of {', '.join(table)}")
        f = self.gpu_memory_utilization
        if f is not None and not (isinstance(f, (int, float)) and math.isfinite(f) and 0 < f <= 1):
            raise ChecklistError(f"--gpu-memory-utilization {f}: must be a share of the card's memory, "
                                 "greater than 0 and at most 1 (vLLM's default is 0.9)")
        for flag, v in (("--attention-dp", self.attention_dp), ("--snapshot-every", self.snapshot_every),
                        ("--snapshot-turns", self.snapshot_turns), ("--page-tokens", self.page_tokens)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ChecklistError(f"{flag} {v}: must be a positive integer")
        if self.snapshot_every is not None and self.snapshot_turns is not None:
            raise ChecklistError("give --snapshot-every or --snapshot-turns, not both (one snapshot policy)")
        g = self.link_gbps
        if not (isinstance(g, (int, float)) and math.isfinite(g) and g > 0):
            raise ChecklistError(f"--link-gbps {g}: must be a positive number of Gbit/s")

    @property
    def dtype(self) -> KvCacheDtype:
        return kv_cache_dtypes()[self.kv_cache_dtype]

    def reserve_formula(self, hbm: int, reserve: int) -> str:
        if self.gpu_memory_utilization is None:
            return "layout memory.runtime_reserve_bytes"
        return (f"hbm − floor(gpu_memory_utilization × hbm) = {hbm:,} − floor({self.gpu_memory_utilization:g} × "
                f"{hbm:,}) (--gpu-memory-utilization replaces the layout's reserve)")

    def to_dict(self) -> dict:
        return {"kv_cache_dtype": self.kv_cache_dtype, "gpu_memory_utilization": self.gpu_memory_utilization,
                "attention_dp": self.attention_dp, "snapshot_every": self.snapshot_every,
                "snapshot_turns": self.snapshot_turns, "page_tokens": self.page_tokens, "link_gbps": self.link_gbps}


def apply_to_layout(layout: Layout, s: Serving) -> Layout:
    """The layout the engine runs: its reserve from ``gpu_memory_utilization``, its attention split
    from ``attention_dp`` (the stage's ranks and the expert split unchanged)."""
    out = layout
    if s.gpu_memory_utilization is not None:
        hbm = layout.card.hbm_bytes
        out = replace(out, runtime_reserve_bytes=hbm - math.floor(s.gpu_memory_utilization * hbm))
    n = s.attention_dp
    if n is not None and n != layout.parallel.attention_dp:
        par = layout.parallel
        ranks = par.stage_ranks
        if ranks % n:
            raise ChecklistError(f"--attention-dp {n}: must divide the {ranks} ranks of a pipeline stage of "
                                 f"{layout.name} (tp {par.tp} × attention_dp {par.attention_dp}); attention TP is "
                                 "ranks / attention-dp")
        out = replace(out, parallel=replace(par, tp=ranks // n, attention_dp=n))
    return out


def cache_manifest(manifest: dict, kv_lora_rank: int, rope_dim: int, s: Serving) -> dict:
    """``manifest`` (a graph manifest) with the MLA latent in ``s.kv_cache_dtype``: the per-layer
    latent and every rank's ``mla_bytes_per_token``. The input is not changed."""
    dt = s.dtype
    per_layer = dt.bytes_per_layer(kv_lora_rank, rope_dim)
    out = copy.deepcopy(manifest)
    st = out["state_schema"]
    lat = st["mla"]["per_layer_per_token"]["latent"]
    lat.update({"dtype": dt.name, "bytes": per_layer, "kv_cache_dtype": dt.name,
                "formula": dt.formula(kv_lora_rank, rope_dim), "stored_as": dt.layout})
    st["mla"]["bytes_per_token"] = len(st["mla"]["layers"]) * per_layer
    for row in st["per_rank"]:
        row["mla_bytes_per_token"] = row["mla_layers"] * per_layer
    return out
