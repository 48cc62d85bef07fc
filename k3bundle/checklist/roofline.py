"""Roofline lower bounds: time per output token (decode) and time to first token (prefill).

A step is bounded below by the bytes it must move through HBM and the FLOPs it must do, each at
the card's peak. Per pipeline stage s:

    t_s ≥ max( max(bytes_s / ranks_s, busiest rank's bytes_s) / hbm_bandwidth,
               Σ_p FLOPs_s,p / (ranks_s × peak_p) )

``bytes_s / ranks_s`` is the average rank, never more than the slowest, so it holds however
experts or requests fall on ranks; the busiest rank term is one rank alone (all its weights and
its attention-DP replica's share of the cache), which matters when attention-DP replicas sit idle.
One stage: ``t ≥ t_s``. Several: decode ≥ max(slowest stage at the batch, Σ_s t_s at batch 1) (a
token crosses the stages in turn; micro-batches may overlap stages, but no stage is faster than
with one request); prefill ≥ the slowest stage (chunks of a prompt fill every stage at once).
Every term left out (communication, norms, AttnRes, activations, the embedding lookup, kernel
launch) would only add time, so leaving it out keeps the bound a lower bound.

Bytes (decode, per step of ``batch`` requests at ``context`` cached tokens):
  weights read every step — each rank's non-expert weights in their stored format, without the
  vision tower and the embedding table (a lookup reads ``batch`` rows); routed experts — a layer's
  expert bytes × the expected share of experts ``n`` tokens touch, ``1 − (1 − k/E)^n`` (uniform
  routing; exactly ``k/E`` at ``n = 1``); the MLA latent read, ``batch × context × latent/token ×
  tp`` (every TP rank reads the whole latent); the KDA state read and written, ``2 × batch ×
  state/request``. Prefill writes the latent and the state instead and touches experts with
  ``batch × context`` tokens.

FLOPs: every GEMM weight of the schema counts ``2 × out × in`` per token (routed experts ``k``
times), at the peak of its storage format (``PEAK_CHAINS``); KDA's core is the recurrence (decode)
or the chunked form (prefill, ``executor.kda.CHUNK``); MLA attends on the absorbed latent
(decode) or causally over the prompt (prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3bundle.checklist.quantity import Quantity, flops
from k3bundle.executor.kda import CHUNK
from k3bundle.plan import Plan, storage_name
from k3bundle.schema import Role, Scope, Section
from k3bundle.storage import AS_STORED, STORAGE

#: Peak to use for a GEMM by weight storage: the storage's own key if the layout lists it, else the
#: next key down in precision (a card without the format runs it no faster than that).
PEAK_CHAINS: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16", "fp16", "tf32", "fp32"),
    "fp8": ("fp8", "int8", "bf16", "fp16", "tf32", "fp32"),
    "mxfp4": ("mxfp4", "fp4", "nvfp4", "fp6", "fp8", "int8", "bf16", "fp16", "tf32", "fp32"),
    "nvfp4": ("nvfp4", "fp4", "mxfp4", "fp6", "fp8", "int8", "bf16", "fp16", "tf32", "fp32"),
}

# (row key, label, layer type whose count multiplies it)
ROWS = (
    ("kda_proj", "KDA projections", "kda"),
    ("kda_core", "KDA core", "kda"),
    ("mla_proj", "MLA projections", "mla"),
    ("mla_attn", "MLA attention", "mla"),
    ("dense_ffn", "dense FFN", "dense"),
    ("moe_shared", "MoE router, latent down/up, shared experts", "moe"),
    ("routed", "routed experts (top-k)", "moe"),
    ("lm_head", "lm_head", "head"),
)
_ROW_OF_SCOPE = {Scope.KDA: "kda_proj", Scope.MLA: "mla_proj", Scope.DENSE: "dense_ffn", Scope.MOE: "moe_shared",
                 Scope.EXPERT: "routed"}


def peak(peaks: dict[str, float], bucket: str) -> tuple[str, float]:
    """(key, FLOP/s) for a GEMM of ``bucket``; the fastest listed key if the chain finds none."""
    for key in PEAK_CHAINS[bucket]:
        if key in peaks:
            return key, float(peaks[key])
    key = max(peaks, key=lambda k: peaks[k])
    return key, float(peaks[key])


def _is_gemm(role: Role) -> bool:
    return (role.section is Section.TEXT and len(role.shape) == 2 and role.shape[0] != "1"
            and role.role != "embed")


@dataclass
class _Stage:
    ranks: int
    counts: dict[str, int]  # layer type -> layers in this stage ("head": 1 on the last stage)
    dense: list[tuple[int, int]]  # per rank (attention-DP replica, bytes read every step: no routed
    #                               experts, vision tower or embedding table)
    expert_bytes: int  # Σ ranks: every routed expert stored in the stage
    latent_per_token: int  # whole latent of the stage's MLA layers (what one TP rank holds)
    state_per_request: int  # whole KDA state of the stage's KDA layers (all heads)


@dataclass
class Phase:
    """One bound (decode or prefill) with every number behind it."""

    name: str
    batch: int
    context: int
    bytes: list[Quantity]
    flops: list[Quantity]
    t_memory: Quantity
    t_compute: Quantity
    bound: Quantity
    bound_by: str  # "memory" or "compute" (of the stage that dominates)
    extra: list[Quantity] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "batch": self.batch, "context": self.context, "bound_by": self.bound_by,
                "bound_s": self.bound.value, "bytes": [q.to_dict() for q in self.bytes],
                "flops": [q.to_dict() for q in self.flops], "t_memory": self.t_memory.to_dict(),
                "t_compute": self.t_compute.to_dict(), "bound": self.bound.to_dict(),
                "extra": [q.to_dict() for q in self.extra], "stages": self.stages}


class _Model:
    """Per-token FLOPs by row and peak bucket, and per-stage bytes, for one plan."""

    def __init__(self, plan: Plan, manifest: dict):
        self.plan = plan
        t = plan.config.text
        self.t = t
        self.la = t.linear_attn_config
        lay = plan.layout
        self.card = lay.card
        self.tp = lay.parallel.tp
        self.dp = lay.parallel.attention_dp
        self.k, self.E = t.num_experts_per_token, t.num_experts
        schema = plan.schema
        # GEMM FLOPs per token per layer of each type, split by peak bucket; roles listed for formulas
        self.gemm: dict[str, dict[str, float]] = {r: {} for r, _, _ in ROWS}
        self.roles: dict[str, list[str]] = {r: [] for r, _, _ in ROWS}
        self.expert_format = AS_STORED
        seen: set[str] = set()
        for role, layer in schema.instances():
            if not _is_gemm(role) or role.role in seen:
                continue
            seen.add(role.role)
            row = "lm_head" if role.role == "lm_head" else _ROW_OF_SCOPE.get(role.scope)
            if row is None:
                continue
            out, inp = schema.logical_shape(role)
            name = storage_name(lay.rule_for(role), role)
            if role.scope is Scope.EXPERT:
                self.expert_format = name
            bucket = STORAGE[name].peak_bucket
            mult = self.k if role.scope is Scope.EXPERT else 1
            self.gemm[row][bucket] = self.gemm[row].get(bucket, 0.0) + 2.0 * out * inp * mult
            self.roles[row].append(f"{role.role.split('.', 1)[-1]} {out}×{inp}")
        # per-stage bytes
        st = manifest["state_schema"]
        lat = st["mla"]["per_layer_per_token"]["latent"]["bytes"]
        kda = st["kda"]["per_layer_per_request"]
        kda_layer = kda["recurrent"]["bytes"] + kda["conv"]["bytes"]
        embed = [0] * len(plan.ranks)
        for tg in plan.targets:
            if tg.role.role == "embed":
                embed[tg.rank] += plan.target_bytes(tg)
        self.stages: list[_Stage] = []
        pp = lay.parallel.pp
        for s in range(pp):
            ranks = [r.rank for r in plan.ranks if r.stage == s]
            layers = [i for i in range(t.num_hidden_layers) if plan.stage_of_layer[i] == s]
            counts = {"kda": sum(not t.is_mla(i) for i in layers), "mla": sum(t.is_mla(i) for i in layers),
                      "dense": sum(not t.is_moe(i) for i in layers), "moe": sum(t.is_moe(i) for i in layers),
                      "head": 1 if s == pp - 1 else 0}
            br = plan.rank_breakdown
            dense = [(plan.ranks[r].dp_rank,
                      plan.rank_bytes[r] - br[r]["routed_experts"] - br[r]["vision"] - embed[r]) for r in ranks]
            self.stages.append(_Stage(len(ranks), counts, dense, sum(br[r]["routed_experts"] for r in ranks),
                                      counts["mla"] * lat, counts["kda"] * kda_layer))
        self.latent_layer = lat
        self.kda_layer = kda_layer

    # ---- core FLOPs per layer ----
    def kda_core_decode(self) -> float:
        H, d = self.la.num_heads, self.la.head_dim
        return H * 7.0 * d * d  # (K5): decay d², S'ᵀk 2d², k·uᵀ 2d², S_tᵀq 2d² per head

    def kda_core_prefill_per_token(self) -> float:
        H, d, C = self.la.num_heads, self.la.head_dim, CHUNK
        return H * (10.0 * C * d + 6.0 * d * d + C * C / 3.0)

    def mla_decode(self, context: int) -> float:
        t = self.t
        return t.num_attention_heads * 2.0 * (2 * t.kv_lora_rank + t.qk_rope_head_dim) * context

    def mla_prefill(self, context: int) -> float:
        t = self.t
        return t.num_attention_heads * 2.0 * (t.qk_nope_head_dim + t.qk_rope_head_dim + t.v_head_dim) \
            * context * (context + 1) / 2

    def dp_active(self, batch: int) -> int:
        """Attention-DP replicas that serve at least one of ``batch`` requests."""
        return min(batch, self.dp)

    def touched(self, tokens: int) -> float:
        return 1.0 - (1.0 - self.k / self.E) ** tokens


def _core_formula(m: _Model, row: str, phase: str, batch: int, context: int, n: int) -> str:
    la, t = m.la, m.t
    H, d = la.num_heads, la.head_dim
    Hm = t.num_attention_heads
    if row == "kda_core" and phase == "decode":
        return (f"batch × n_kda × H × 7·d² = {batch} × {n} × {H} × 7 × {d}² "
                "(K5 recurrence: decay, S'ᵀk, k·uᵀ, Sᵀq)")
    if row == "kda_core":
        return (f"batch × context × n_kda × H × (10·C·d + 6·d² + C²/3) = {batch} × {context:,} × {n} × "
                f"{H} × (10·{CHUNK}·{d} + 6·{d}² + {CHUNK}²/3) (chunked form, chunk C = {CHUNK})")
    if phase == "decode":
        return (f"batch × n_mla × H × 2·(2·kv_lora + rope) × context = {batch} × {n} × {Hm} × "
                f"2·(2·{t.kv_lora_rank} + {t.qk_rope_head_dim}) × {context:,} "
                "(absorbed: scores on the latent, values in it)")
    d_qk = t.qk_nope_head_dim + t.qk_rope_head_dim
    return (f"batch × n_mla × H × 2·(d_qk + d_v) × N(N+1)/2 = {batch} × {n} × {Hm} × "
            f"2·({d_qk} + {t.v_head_dim}) × {context:,}·{context + 1:,}/2 (causal)")


def _stage_step(m: _Model, st: _Stage, decode: bool, batch: int, context: int) -> dict:
    """Bytes, FLOPs and times of one stage for one step of ``batch`` requests."""
    tokens = batch if decode else batch * context  # tokens through the GEMMs
    rw = 2 if decode else 1  # decode reads and writes the KDA state; prefill writes it
    # attention-DP replicas without a request read nothing; the others read all their weights
    b = {"weights": sum(w for dp_rank, w in st.dense if dp_rank < m.dp_active(batch)),
         "experts": round(st.expert_bytes * m.touched(tokens)),  # expected bytes, whole
         "latent": batch * context * st.latent_per_token * m.tp,
         "state": rw * batch * st.state_per_request}
    nbytes = sum(b.values())
    # the busiest rank alone: all its weights and its replica's share of the batch's cache
    share = -(-batch // m.dp)
    busiest = (max(w for _, w in st.dense) + share * context * st.latent_per_token
               + rw * share * st.state_per_request // m.tp)
    fl: dict[str, dict[str, float]] = {}
    for row, _, kind in ROWS:
        n = st.counts[kind]
        if not n:
            continue
        if row == "kda_core":
            per = m.kda_core_decode() * batch if decode else m.kda_core_prefill_per_token() * tokens
            fl[row] = {"bf16": n * per}
        elif row == "mla_attn":
            fl[row] = {"bf16": n * batch * (m.mla_decode(context) if decode else m.mla_prefill(context))}
        else:
            toks = batch if row == "lm_head" else tokens  # prefill: logits of the last token only
            fl[row] = {bk: n * toks * f for bk, f in m.gemm[row].items()}
    peaks = m.card.peak_flops
    tc = sum(f / (st.ranks * peak(peaks, bk)[1]) for pb in fl.values() for bk, f in pb.items())
    tm = max(nbytes / st.ranks, busiest) / float(m.card.hbm_bandwidth_bytes_per_s)
    return {"bytes_by_kind": b, "bytes": nbytes, "busiest_rank_bytes": busiest, "flops_by_row": fl,
            "flops": sum(f for pb in fl.values() for f in pb.values()), "ranks": st.ranks,
            "t_memory_s": tm, "t_compute_s": tc, "bound_s": max(tm, tc)}


def _phase(m: _Model, name: str, batch: int, context: int) -> Phase:
    decode = name == "decode"
    tokens = batch if decode else batch * context
    bw = float(m.card.hbm_bandwidth_bytes_per_s)
    peaks = m.card.peak_flops
    steps = [_stage_step(m, st, decode, batch, context) for st in m.stages]
    totals = {k: sum(x["bytes_by_kind"][k] for x in steps) for k in ("weights", "experts", "latent", "state")}
    total_flops: dict[str, dict[str, float]] = {r: {} for r, _, _ in ROWS}
    for x in steps:
        for row, pb in x["flops_by_row"].items():
            for bk, f in pb.items():
                total_flops[row][bk] = total_flops[row].get(bk, 0.0) + f
    byte_q = _byte_quantities(m, name, batch, context, tokens, totals)
    flop_q = _flop_quantities(m, name, batch, context, tokens, total_flops)
    all_bytes = sum(totals.values())
    stage_rows = [{"stage": s, **{k: v for k, v in x.items() if k not in ("bytes_by_kind", "flops_by_row")}}
                  for s, x in enumerate(steps)]
    worst = max(steps, key=lambda x: x["bound_s"])
    by = "memory" if worst["t_memory_s"] >= worst["t_compute_s"] else "compute"
    if len(steps) == 1:
        x = steps[0]
        t_mem, t_comp, bound = x["t_memory_s"], x["t_compute_s"], x["bound_s"]
        R = x["ranks"]
        mem_f = (f"max(bytes / ranks, busiest rank's bytes) / HBM bandwidth = max({all_bytes:,.0f} / {R}, "
                 f"{x['busiest_rank_bytes']:,.0f}) / {bw:,.0f} B/s")
        used = sorted({bk for pb in total_flops.values() for bk in pb})
        parts = [f"{flops(sum(pb.get(bk, 0.0) for pb in total_flops.values()))} / ({R} × {peak(peaks, bk)[0]} "
                 f"{peak(peaks, bk)[1]:,.0f} FLOP/s)" for bk in used]
        comp_f = "Σ_p FLOPs_p / (ranks × peak_p) = " + " + ".join(parts)
        bound_f = "max(t_memory, t_compute)"
    else:
        # Every stage does its whole share of the step: t ≥ the slowest stage. A decode token also
        # crosses the stages one after another, and no stage is faster than with one request.
        t_mem = max(x["t_memory_s"] for x in steps)
        t_comp = max(x["t_compute_s"] for x in steps)
        slowest = max(x["bound_s"] for x in steps)
        mem_f = ("slowest stage: max over stages of max(bytes_s / ranks_s, busiest rank's bytes_s) / HBM bandwidth "
                 "(per-stage table below)")
        comp_f = "slowest stage: max over stages of Σ_p FLOPs_s,p / (ranks_s × peak_p)"
        if decode:
            single = [_stage_step(m, st, True, 1, context)["bound_s"] for st in m.stages]
            bound = max(slowest, sum(single))
            bound_f = (f"max(slowest stage at batch {batch} = {slowest * 1e3:.3f} ms, Σ over stages at batch 1 = "
                       + " + ".join(f"{t * 1e3:.3f}" for t in single) + " ms)")
        else:
            bound = slowest
            per_stage = ", ".join(f"{x['bound_s'] * 1e3:.3f}" for x in steps)
            bound_f = f"slowest stage = max({per_stage}) ms (chunked prefill keeps every stage busy at once)"
    label = "time per output token (TPOT)" if decode else "time to first token (TTFT)"
    ph = Phase(name, batch, context, byte_q, flop_q,
               Quantity(f"{name}_t_memory", "memory time", t_mem, "s", mem_f),
               Quantity(f"{name}_t_compute", "compute time", t_comp, "s", comp_f),
               Quantity(f"{name}_bound", f"{label} ≥", bound, "s", bound_f), by, stages=stage_rows)
    if decode:
        ph.extra = [
            Quantity("decode_bytes_per_output_token", "bytes per output token", all_bytes / batch, "B",
                     f"bytes per step / batch = {all_bytes:,.0f} / {batch}"),
            Quantity("decode_throughput_upper_bound", "decode throughput ≤", batch / bound, "token/s",
                     f"batch / TPOT = {batch} / {bound:.6g} s"),
        ]
    return ph


def _byte_quantities(m: _Model, name: str, batch: int, context: int, tokens: int, tot: dict) -> list[Quantity]:
    decode = name == "decode"
    k, E = m.k, m.E
    exp_all = sum(st.expert_bytes for st in m.stages)
    lat = sum(st.latent_per_token for st in m.stages)
    state = sum(st.state_per_request for st in m.stages)
    total = tot["weights"] + tot["experts"] + tot["latent"] + tot["state"]
    return [
        Quantity(f"{name}_bytes_weights", "weights read every step", tot["weights"], "B",
                 "Σ ranks of the attention-DP replicas serving a request (min(batch, attention_dp) = "
                 f"{m.dp_active(batch)} of {m.dp}): stored weights − routed experts − vision tower − embedding "
                 f"table (plan) = {tot['weights']:,}"),
        Quantity(f"{name}_bytes_experts", f"routed experts touched ({m.expert_format})", tot["experts"], "B",
                 f"Σ ranks expert bytes × (1 − (1 − k/E)^n) = {exp_all:,} × (1 − (1 − {k}/{E})^{tokens:,}); "
                 "n tokens, uniform routing"),
        Quantity(f"{name}_bytes_latent", "MLA latent read" if decode else "MLA latent written", tot["latent"], "B",
                 f"batch × context × latent/token × tp = {batch} × {context:,} × {lat:,} × {m.tp}"),
        Quantity(f"{name}_bytes_state", "KDA state read + write" if decode else "KDA state written", tot["state"], "B",
                 (f"2 × batch × state/request = 2 × {batch} × {state:,}" if decode
                  else f"batch × state/request = {batch} × {state:,}")),
        Quantity(f"{name}_bytes_total", "bytes per step", total, "B", "weights + experts + latent + state"),
    ]


def _flop_quantities(m: _Model, name: str, batch: int, context: int, tokens: int,
                     tot: dict[str, dict[str, float]]) -> list[Quantity]:
    decode = name == "decode"
    out = []
    peaks = m.card.peak_flops
    counts = {kind: sum(st.counts[kind] for st in m.stages) for kind in ("kda", "mla", "dense", "moe", "head")}
    for row, label, kind in ROWS:
        n = counts[kind]
        value = sum(tot[row].values())
        if not n:
            continue
        buckets = sorted(tot[row]) or ["bf16"]
        at = ", ".join(f"{peak(peaks, b)[0]}" for b in buckets)
        if row in ("kda_core", "mla_attn"):
            f = _core_formula(m, row, name, batch, context, n)
        else:
            per = sum(m.gemm[row].values())
            toks = batch if row == "lm_head" else tokens
            what = "batch" if (decode or row == "lm_head") else "batch × context"
            mult = f"k = {m.k} × " if row == "routed" else ""
            f = (f"{what} × n × 2·Σ out·in = {toks:,} × {n} × {per:,.0f} ({mult}{'; '.join(m.roles[row])})")
        out.append(Quantity(f"{name}_flops_{row}", f"{label} [{at}]", value, "FLOP", f))
    total = sum(q.value for q in out)
    out.append(Quantity(f"{name}_flops_total", "FLOPs per step", total, "FLOP", "sum of the rows above"))
    return out


@dataclass
class Roofline:
    decode: Phase
    prefill: Phase
    gemm_flops_per_token: float  # decode GEMMs, one token, whole model (≈ 2 × active parameters)
    active_params: int

    def to_dict(self) -> dict:
        return {"decode": self.decode.to_dict(), "prefill": self.prefill.to_dict(),
                "gemm_flops_per_token": self.gemm_flops_per_token, "active_params": self.active_params}


def roofline(plan: Plan, manifest: dict, context: int, batch: int) -> Roofline:
    """Decode and prefill lower bounds for ``batch`` requests at ``context`` tokens.

    Args:
        plan (`Plan`): the target's plan.
        manifest (`dict`): its ``graph_manifest`` (cache bytes per layer).
        context (`int`): cached tokens a decode step attends to; prompt length of a prefill.
        batch (`int`): concurrent requests over the whole deployment.
    """
    m = _Model(plan, manifest)
    counts = {kind: sum(st.counts[kind] for st in m.stages) for kind in ("kda", "mla", "dense", "moe", "head")}
    per_token = sum(counts[kind] * sum(m.gemm[row].values()) for row, _, kind in ROWS
                    if row not in ("kda_core", "mla_attn"))
    return Roofline(_phase(m, "decode", batch, context), _phase(m, "prefill", batch, context), per_token,
                    plan.schema.totals.active_params)


__all__ = ["PEAK_CHAINS", "Phase", "Roofline", "peak", "roofline"]
