"""Capacity: weights per rank (from the plan), cache per token and per request, what fits, margin.

Per rank, for the rank with the most weight bytes in each pipeline stage, with the engine's
settings (``serving.Serving``: the layout and graph manifest it is given are already the engine's,
``serving.apply_to_layout`` and ``serving.cache_manifest``):

* ``usable = card.hbm_bytes − memory.runtime_reserve_bytes`` (the layout's reserve covers
  activations, graphs and communication buffers; ``--gpu-memory-utilization F`` replaces it by
  ``hbm − floor(F × hbm)``, vLLM's share of the card the engine may use, weights included);
* ``free = usable − weights`` (weights from ``Plan.rank_bytes``, in their stored formats);
* MLA latent per token = ``n_mla(stage) × latent per layer`` in the ``--kv-cache-dtype`` format
  (bf16: ``(kv_lora_rank + qk_rope_head_dim) × 2 B``; ``k3bundle/data/kv_cache_dtypes.yaml``), the
  whole latent on every attention-TP rank (docs/kimi-k3.md §5.3: replicated unless decode context
  parallelism); attention data parallelism does not shrink it, it multiplies the replicas that hold
  different requests;
* KDA state per request = ``n_kda(stage) × (recurrent FP32 [H, d, d] + conv BF16 3 × [kc−1, H·d]) / tp`` (the conv
  state in the op contract's notation, ``[W-1, P]`` once each for q, k and v)
  (heads are split by attention TP);
* a request of ``context`` tokens costs ``context × latent + state`` on each rank that serves it;
  an attention-DP replica serves ``ceil(batch / attention_dp)`` of the batch.

Margin = ``(free − cache for the batch) / usable``, the share of the memory the model may use
that is left unused; capacity fails below ``CAPACITY_MARGIN``. The per-layer cache bytes come
from ``graph_manifest`` (``k3bundle.bundle.graph``), the same numbers a bundle ships, with the
latent in the engine's cache dtype. The prefix-cache and prefill/decode handoff budgets are
``cache_budget``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3bundle.checklist.cache_budget import handoff, prefix_cache
from k3bundle.checklist.quantity import Quantity, ceil_div, floor_div, gb
from k3bundle.checklist.serving import Serving
from k3bundle.plan import Plan

CAPACITY_MARGIN = 0.10  # design.md "Bring-up checklist": margin >= 10%


@dataclass(frozen=True)
class StageCapacity:
    """One pipeline stage, seen from its rank with the most weight bytes."""

    stage: int
    rank: int
    weights: int
    free: int  # usable − weights; negative when the weights do not fit
    kda_layers: int
    mla_layers: int
    latent_per_token: int  # per rank
    state_per_request: int  # per rank
    per_request: int  # context × latent_per_token + state_per_request
    tokens_fit: int | None  # this stage's replica; None when the stage has no MLA layer
    requests_fit: int
    requests_fit_at_margin: int
    batch_bytes: int  # cache for this replica's share of the batch
    margin: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Capacity:
    target: str
    card: str
    hbm: int
    reserve: int
    usable: int
    context: int
    batch: int
    tp: int
    attention_dp: int
    stages: list[StageCapacity]
    limiting: StageCapacity  # the stage with the smallest margin
    weights_fit: bool
    tokens_fit: int | None
    concurrency: int
    concurrency_at_margin: int
    margin: float
    passed: bool
    verdict: str
    serving: Serving = field(default_factory=Serving)
    quantities: list[Quantity] = field(default_factory=list)
    prefix_cache: list[Quantity] = field(default_factory=list)  # cache_budget.prefix_cache
    handoff: list[Quantity] = field(default_factory=list)  # cache_budget.handoff

    def to_dict(self) -> dict:
        return {"passed": self.passed, "verdict": self.verdict, "margin": self.margin, "serving": self.serving.to_dict(),
                "margin_limit": CAPACITY_MARGIN, "weights_fit": self.weights_fit,
                "context": self.context, "batch": self.batch, "hbm_bytes": self.hbm,
                "runtime_reserve_bytes": self.reserve, "usable_bytes": self.usable,
                "tokens_fit": self.tokens_fit, "concurrency": self.concurrency,
                "concurrency_at_margin": self.concurrency_at_margin, "limiting_stage": self.limiting.stage,
                "stages": [s.to_dict() for s in self.stages],
                "quantities": [q.to_dict() for q in self.quantities],
                "prefix_cache": [q.to_dict() for q in self.prefix_cache],
                "handoff": [q.to_dict() for q in self.handoff]}


def _stage(plan: Plan, manifest: dict, stage: int, context: int, per_replica_batch: int) -> StageCapacity:
    ranks = [r.rank for r in plan.ranks if r.stage == stage]
    rank = max(ranks, key=lambda r: (plan.rank_bytes[r], -r))
    row = manifest["state_schema"]["per_rank"][rank]
    weights = plan.rank_bytes[rank]
    usable = plan.usable_bytes
    free = usable - weights
    latent, state = row["mla_bytes_per_token"], row["kda_bytes_per_request"]
    per_request = context * latent + state
    budget = free - int(CAPACITY_MARGIN * usable)
    batch_bytes = per_replica_batch * per_request
    return StageCapacity(
        stage=stage, rank=rank, weights=weights, free=free, kda_layers=row["kda_layers"],
        mla_layers=row["mla_layers"], latent_per_token=latent, state_per_request=state, per_request=per_request,
        tokens_fit=floor_div(free, latent) if latent else None,
        requests_fit=floor_div(free, per_request), requests_fit_at_margin=floor_div(budget, per_request),
        batch_bytes=batch_bytes, margin=(free - batch_bytes) / usable)


def capacity(plan: Plan, manifest: dict, context: int, batch: int, serving: Serving | None = None) -> Capacity:
    """Capacity of ``plan`` for ``batch`` requests of ``context`` tokens.

    Args:
        plan (`Plan`): the target's plan (``k3bundle.plan.make_plan``) under the engine's layout
            (``serving.apply_to_layout``).
        manifest (`dict`): its ``graph_manifest`` (state schema per rank), the latent in the
            engine's cache dtype (``serving.cache_manifest``).
        context (`int`): tokens per request (prompt + output) the cache must hold.
        batch (`int`): concurrent requests, over the whole deployment.
        serving (`Serving`, optional): the engine options, for the formulas and the prefix-cache
            and handoff budgets; default BF16 latent and the layout's reserve.
    """
    serving = serving or Serving()
    lay, par = plan.layout, plan.layout.parallel
    dp = par.attention_dp
    per_replica = ceil_div(batch, dp)
    stages = [_stage(plan, manifest, s, context, per_replica) for s in range(par.pp)]
    lim = min(stages, key=lambda s: (s.margin, s.stage))
    worst_w = min(stages, key=lambda s: (s.free, s.stage))
    weights_fit = worst_w.free >= 0
    with_latent = [s.tokens_fit for s in stages if s.tokens_fit is not None]
    tokens_fit = dp * min(with_latent) if with_latent else None
    concurrency = dp * min(s.requests_fit for s in stages)
    at_margin = dp * min(s.requests_fit_at_margin for s in stages)
    margin = lim.margin
    passed = weights_fit and margin >= CAPACITY_MARGIN
    usable = plan.usable_bytes
    card = lay.card
    req = f"{batch:,} request{'s' if batch != 1 else ''} of {context:,} tokens"
    if not weights_fit:
        over = -worst_w.free
        beyond = (f"; that is more than the whole {gb(card.hbm_bytes)} HBM, by {gb(worst_w.weights - card.hbm_bytes)}"
                  if worst_w.weights > card.hbm_bytes else "")
        verdict = (f"FAIL: the weights alone do not fit: rank {worst_w.rank} needs {gb(worst_w.weights)} of weights "
                   f"but each {card.name} leaves {gb(usable)} (HBM {gb(card.hbm_bytes)} − runtime reserve "
                   f"{gb(lay.runtime_reserve_bytes)}{_reserve_why(serving)}): {gb(over)} over, {over / usable:.1%} of the usable memory"
                   f"{beyond}. More cards, higher TP/EP/PP degrees or a smaller storage format are needed.")
    elif margin < CAPACITY_MARGIN:
        need = int(CAPACITY_MARGIN * usable)
        left = lim.free - lim.batch_bytes
        short = need - left
        verdict = (f"FAIL: margin {margin:.1%} is below {CAPACITY_MARGIN:.0%}: rank {lim.rank} holds "
                   f"{gb(lim.weights)} of weights + {gb(lim.batch_bytes)} of cache and state for {req}, "
                   f"leaving {gb(left)} of {gb(usable)} usable; {gb(short)} short of the "
                   f"{CAPACITY_MARGIN:.0%} margin ({gb(need)}). {at_margin:,} request(s) of {context:,} tokens "
                   "keep the margin.")
    else:
        verdict = (f"PASS: margin {margin:.1%} ≥ {CAPACITY_MARGIN:.0%}: rank {lim.rank} holds {gb(lim.weights)} of "
                   f"weights + {gb(lim.batch_bytes)} of cache and state for {req}, leaving "
                   f"{gb(lim.free - lim.batch_bytes)} of {gb(usable)} usable.")
    cap = Capacity(lay.name, card.name, card.hbm_bytes, lay.runtime_reserve_bytes, usable, context, batch, par.tp,
                   dp, stages, lim, weights_fit, tokens_fit, concurrency, at_margin, margin, passed, verdict, serving)
    cap.quantities = _quantities(plan, manifest, cap)
    st = manifest["state_schema"]
    state_layer = sum(v["bytes"] for v in st["kda"]["per_layer_per_request"].values())
    latent_layer = st["mla"]["per_layer_per_token"]["latent"]["bytes"]
    cap.prefix_cache = prefix_cache(lim, state_layer, latent_layer, par.tp, dp, context, batch, serving)
    cap.handoff = handoff(stages, len(st["kda"]["layers"]), len(st["mla"]["layers"]), state_layer, latent_layer,
                          context, serving)
    return cap


def _reserve_why(s: Serving) -> str:
    f = s.gpu_memory_utilization
    return "" if f is None else f", from --gpu-memory-utilization {f:g}"


def _latent(lat: dict, s: Serving) -> str:
    """One layer's latent per token in words: the cache dtype and its bytes written out."""
    if "formula" in lat:  # serving.cache_manifest
        return f"--kv-cache-dtype {s.kv_cache_dtype}: {lat['formula']}"
    return f"(kv_lora_rank + qk_rope_head_dim) × 2 B = {lat['values']} × 2"


def _conv_shape(shape: list[int]) -> str:
    """The manifest's conv state [3·P, W-1] in the op contract's notation: 3 × [W-1, P] (q, k, v)."""
    return f"3 × [{shape[1]}, {shape[0] // 3}]"


def _quantities(plan: Plan, manifest: dict, c: Capacity) -> list[Quantity]:
    """The capacity numbers of the limiting stage, each with its formula."""
    s = c.limiting
    st = manifest["state_schema"]
    rec = st["kda"]["per_layer_per_request"]["recurrent"]
    conv = st["kda"]["per_layer_per_request"]["conv"]
    lat = st["mla"]["per_layer_per_token"]["latent"]
    dp, tp = c.attention_dp, c.tp
    where = f" (stage {s.stage})" if plan.layout.parallel.pp > 1 else ""
    latent_note = ("every TP rank holds the whole latent" if tp > 1 else "one copy per attention-DP replica")
    per_replica = ceil_div(c.batch, dp)
    # each "fits" number is set by its own smallest stage
    with_latent = [x for x in c.stages if x.tokens_fit is not None]
    t = min(with_latent, key=lambda x: (x.tokens_fit, x.stage)) if with_latent else None
    r = min(c.stages, key=lambda x: (x.requests_fit, x.stage))
    a = min(c.stages, key=lambda x: (x.requests_fit_at_margin, x.stage))

    def _at(x: StageCapacity) -> str:
        return f", stage {x.stage}" if plan.layout.parallel.pp > 1 else ""

    q = [
        Quantity("hbm_bytes", "HBM per card", c.hbm, "B", "layout card.hbm_bytes"),
        Quantity("runtime_reserve_bytes", "runtime reserve", c.reserve, "B", c.serving.reserve_formula(c.hbm, c.reserve)),
        Quantity("usable_bytes", "usable per card", c.usable, "B",
                 f"hbm − reserve = {c.hbm:,} − {c.reserve:,}"),
        Quantity("weights_bytes_per_rank", f"weights per rank{where}", s.weights, "B",
                 f"plan: rank {s.rank}, every tensor placed on it in its stored format = {s.weights:,} B"),
        Quantity("free_bytes_per_rank", "free for cache and state", s.free, "B",
                 f"usable − weights = {c.usable:,} − {s.weights:,}"),
        Quantity("mla_latent_bytes_per_token", "MLA latent per token per rank", s.latent_per_token, "B/token",
                 f"n_mla × latent per layer ({_latent(lat, c.serving)}) = {s.mla_layers} × {lat['bytes']:,}; "
                 + latent_note),
        Quantity("kda_state_bytes_per_request_total", "KDA state per request (all heads)",
                 s.kda_layers * (rec["bytes"] + conv["bytes"]), "B/request",
                 f"n_kda × (recurrent FP32 {rec['shape']} + conv BF16 {_conv_shape(conv['shape'])}) = {s.kda_layers} × "
                 f"({rec['bytes']:,} + {conv['bytes']:,})"),
        Quantity("kda_state_bytes_per_request", "KDA state per request per rank", s.state_per_request, "B/request",
                 f"KDA state per request / tp = {s.kda_layers * (rec['bytes'] + conv['bytes']):,} / {tp}"),
        Quantity("cache_bytes_per_request", f"cache + state per request at {c.context:,} tokens", s.per_request,
                 "B/request", f"context × latent + state = {c.context:,} × {s.latent_per_token:,} + "
                              f"{s.state_per_request:,}"),
        Quantity("tokens_fit", "cached tokens that fit", c.tokens_fit, "tokens",
                 f"attention_dp × floor(free / latent per token){_at(t)} = {dp} × floor({t.free:,} / "
                 f"{t.latent_per_token:,})" if t is not None
                 else "no MLA layer: the latent cache does not bound the tokens"),
        Quantity("concurrency", f"requests of {c.context:,} tokens that fit", c.concurrency, "requests",
                 f"attention_dp × floor(free / per request){_at(r)} = {dp} × floor({r.free:,} / {r.per_request:,})"),
        Quantity("batch_cache_bytes", f"cache + state for batch {c.batch:,}", s.batch_bytes, "B",
                 f"ceil(batch / attention_dp) × per request = {per_replica:,} × {s.per_request:,}"),
        Quantity("margin", "margin", c.margin, "ratio",
                 f"(free − batch cache) / usable = ({s.free:,} − {s.batch_bytes:,}) / {c.usable:,}; "
                 f"fails below {CAPACITY_MARGIN:.0%}"),
        Quantity("concurrency_at_margin", f"requests of {c.context:,} tokens keeping the margin",
                 c.concurrency_at_margin, "requests",
                 f"attention_dp × floor((free − {CAPACITY_MARGIN:.0%} × usable) / per request){_at(a)} = {dp} × "
                 f"floor(({a.free:,} − {int(CAPACITY_MARGIN * c.usable):,}) / {a.per_request:,})"),
    ]
    return q
