"""The conformance inputs of each op: seeded random tensors at a layout's per-rank shapes.

``golden/kernel_cases.yaml`` names the cases and what is special about each; ``make_case`` turns
one entry into the op's arguments. Inputs are drawn once in the activation dtype (so the backend
and the float64 reference see the same values) and handed to the reference upcast. A case may
say where NaN is allowed to appear (``nan_region``: per output, a boolean mask), and carries the
bytes and FLOPs the call must at least move and do (the roofline bound of ``conformance``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3bundle.data_dirs import data_dirs
from k3bundle.errors import K3Error
from k3bundle.executor.kda import CHUNK
from k3bundle.io.strict_yaml import read_yaml
from k3bundle.ops.expert_weight import ExpertWeight
from k3bundle.formats import mxfp4

CASES_FILE = "kernel_cases.yaml"


def load_cases() -> dict[str, dict[str, dict]]:
    for d in data_dirs("golden"):
        p = d / CASES_FILE
        if p.is_file():
            doc = read_yaml(p)
            return {k: v for k, v in doc.items() if k != "schema_version"}
    raise K3Error(f"no golden/{CASES_FILE} found beside the package")


@dataclass(frozen=True)
class Sizes:
    """The options that scale the cases (``kernels --tokens/--batch/--context``)."""

    prefill: int = 512
    decode_batch: int = 8
    context: int = 1024


@dataclass
class Case:
    op: str
    name: str
    args: tuple
    kwargs: dict
    #: output index -> (where NaN must be: what depends on the NaN input, where it may be: its head/request)
    nan_region: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    bytes: int = 0
    flops: int = 0
    timed: bool = False
    tie_mask: torch.Tensor | None = None  # router: tokens whose selection is a tie (either set is right)


def _n(v, sizes: Sizes, kind: str) -> int:
    if v == "prefill":
        return sizes.prefill
    if v == "decode":
        return sizes.decode_batch if kind == "batch" else sizes.context
    return int(v)


def _state(spec: dict, shape, gen, dev) -> torch.Tensor:
    if spec.get("state", "zeros") == "zeros":
        return torch.zeros(shape, dtype=torch.float32, device=dev)
    return (0.1 * torch.randn(shape, generator=gen, dtype=torch.float32)).to(dev)


def _randn(shape, gen, act, dev, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float32)).to(act).to(dev)


def _kda(op: str, spec: dict, x: dict, sizes: Sizes, gen, act, dev) -> Case:
    H, K = x["H"], x["d"]
    V = K
    decode = op == "kda_recurrent_decode"
    if decode:
        lengths = [1] * _n(spec["batch"], sizes, "batch")
    else:
        lengths = [int(n) for n in spec["lengths"]] if "lengths" in spec else [_n(spec["tokens"], sizes, "tokens")]
    T, N = sum(lengths), len(lengths)
    q, k = _randn((T, H, K), gen, act, dev), _randn((T, H, K), gen, act, dev)
    v = _randn((T, H, V), gen, act, dev)
    gate = spec.get("gate", "random")
    g = _randn((T, H, K), gen, act, dev) if gate == "random" else \
        torch.full((T, H, K), 30.0 if gate == "lower" else -30.0, dtype=act, device=dev)  # sigmoid -> 1 / -> 0
    beta = _randn((T, H), gen, act, dev)
    A_log = (torch.rand(H, generator=gen) * 2 - 1).to(dev)
    dt_bias = (0.5 * torch.randn(H, K, generator=gen)).to(dev)
    state = _state(spec, (N, H, K, V), gen, dev)
    region = {}
    if spec.get("nan") == "v":
        t0, h0 = min(T - 1, 10), H // 2
        ends = torch.tensor(lengths).cumsum(0).tolist()
        n0 = next(n for n, e in enumerate(ends) if t0 < e)  # the request holding the NaN token
        a, b = ends[n0] - lengths[n0], ends[n0]
        v[t0, h0, 0] = float("nan")
        o_may = torch.zeros(T, H, V, dtype=torch.bool, device=dev)
        o_may[a:b, h0] = True  # that request's head h0
        o_must = torch.zeros_like(o_may)
        o_must[t0:b, h0, 0] = True  # value channel 0 from the NaN token on (K5: o_t = S_tᵀ q_t)
        s_may = torch.zeros(N, H, K, V, dtype=torch.bool, device=dev)
        s_may[n0, h0] = True
        s_must = torch.zeros_like(s_may)
        s_must[n0, h0, :, 0] = True  # the state's value column 0
        region = {0: (o_must, o_may), 1: (s_must, s_may)}
    act_b = torch.empty(0, dtype=act).element_size()
    nbytes = 4 * T * H * K * act_b + T * H * act_b + T * H * V * act_b + 2 * N * H * K * V * 4
    if decode:
        flops = 6 * T * H * K * V
        args, kw = (q, k, v, g, beta, A_log, dt_bias, state), {"lower_bound": -5.0}
    else:
        flops = 2 * T * H * (2 * CHUNK * K + 2 * CHUNK * V + 3 * K * V)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long, device=dev)
        args, kw = (q, k, v, g, beta, A_log, dt_bias, state, cu), {"lower_bound": -5.0, "chunk": CHUNK}
    return Case(op, "", args, kw, region, nbytes, flops)


def _conv(spec: dict, x: dict, sizes: Sizes, gen, act, dev) -> Case:
    T, P, W = _n(spec["tokens"], sizes, "tokens"), x["H"] * x["d"], x["kc"]  # one of the q/k/v convs
    u = _randn((T, P), gen, act, dev)
    w = (0.3 * torch.randn(P, 1, W, generator=gen)).to(dev)
    state = _randn((W - 1, P), gen, act, dev)
    eb = torch.empty(0, dtype=act).element_size()
    return Case("causal_short_conv1d_with_state", "", (u, w, state), {}, {}, 2 * T * P * eb, 2 * T * P * W)


def _mla_prefill(spec: dict, x: dict, sizes: Sizes, gen, act, dev) -> Case:
    H, E, V = x["Hm"], x["qk"], x["dv"]
    T, off = _n(spec["tokens"], sizes, "tokens"), int(spec.get("prefix", 0))
    S = off + T
    q, k, v = _randn((T, H, E), gen, act, dev), _randn((S, H, E), gen, act, dev), _randn((S, H, V), gen, act, dev)
    gate = _randn((T, H * V), gen, act, dev)
    region = {}
    if spec.get("nan") == "k":
        s0, h0 = min(S - 1, 5), H // 2
        k[s0, h0, 0] = float("nan")
        may = torch.zeros(T, H, V, dtype=torch.bool, device=dev)
        may[:, h0] = True
        must = may.clone()
        must[: max(0, s0 - off)] = False  # queries before key s0 never see it (causal)
        region = {0: (must.reshape(T, H * V), may.reshape(T, H * V))}
    eb = torch.empty(0, dtype=act).element_size()
    keys = off + (T + 1) / 2  # keys a query sees on average (causal)
    return Case("gated_mla_prefill", "", (q, k, v, gate), {"offset": off, "scale": E ** -0.5}, region,
                (T * H * E + S * H * (E + V) + 2 * T * H * V) * eb, int(2 * T * H * keys * (E + V)))


def _mla_decode(spec: dict, x: dict, sizes: Sizes, gen, act, dev) -> Case:
    H, E, V, L = x["Hm"], x["qk"], x["dv"], x["kv"]
    C, R = x["lat"], x["lat"] - x["kv"]
    N = E - R
    if "lengths" in spec:
        lengths = [int(n) for n in spec["lengths"]]
    else:
        lengths = [_n(spec["context"], sizes, "context")] * _n(spec["batch"], sizes, "batch")
    B, S = len(lengths), max(lengths)
    q_nope, q_pe = _randn((B, H, N), gen, act, dev), _randn((B, H, R), gen, act, dev)
    latent = _randn((B, S, C), gen, act, dev)
    w = _randn((H, N + V, L), gen, act, dev, scale=L ** -0.5)
    gate = _randn((B, H * V), gen, act, dev)
    region = {}
    if spec.get("nan") == "latent":
        latent[0, 3, 0] = float("nan")  # request 0's cached token 3: all of request 0 (every head reads it)
        r = torch.zeros(B, H * V, dtype=torch.bool, device=dev)
        r[0] = True
        region = {0: (r, r)}
    eb = torch.empty(0, dtype=act).element_size()
    ctx = sum(lengths)
    return Case("gated_mla_decode_latent_cache", "",
                (q_nope, q_pe, latent, torch.tensor(lengths, device=dev), w, gate), {"scale": E ** -0.5}, region,
                (ctx * C + H * (N + V) * L + B * H * (E + 2 * V)) * eb,
                2 * H * (ctx * (L + R + L) + B * (N * L + L * V)))


def _router(spec: dict, x: dict, sizes: Sizes, gen, act, dev) -> Case:
    T, D, E, k = _n(spec["tokens"], sizes, "tokens"), x["D"], x["E"], x["k"]
    xs = _randn((T, D), gen, act, dev)
    w = _randn((E, D), gen, act, dev, scale=D ** -0.5)
    bias = (0.05 * torch.randn(E, generator=gen)).to(dev)
    kw = {"top_k": k, "scaling": x["scaling"]}
    if spec.get("tie"):  # experts 3j+1, 3j+2 copies of 3j: triples score equal, so top-k splits ties
        for i in (1, 2):
            w[i::3] = w[0::3][: w[i::3].shape[0]]
            bias[i::3] = bias[0::3][: bias[i::3].shape[0]]
    if spec.get("forced"):
        kw["forced_ids"] = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
    eb = torch.empty(0, dtype=act).element_size()
    return Case("sigmoid_biased_topk_router", "", (xs, w, bias), kw, {}, (E * D + T * D) * eb, 2 * T * E * D)


def _scale_bytes(kind: str, shape, gen) -> torch.Tensor:
    if kind == "extreme":
        return torch.randint(100, 155, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    if kind == "zero":
        return torch.where(torch.rand(shape, generator=gen) < 0.5, 0, 127).to(torch.uint8)
    return torch.randint(118, 124, shape, generator=gen, dtype=torch.int32).to(torch.uint8)  # 2^-9..2^-4


def _experts(spec: dict, x: dict, sizes: Sizes, gen, act, dev) -> Case:
    T = _n(spec["tokens"], sizes, "batch" if spec["tokens"] == "decode" else "tokens")
    Lr, Ie, Er, k = x["Lr"], x["Ie"], x["Er"], x["k"]
    kind = spec.get("scales", "random")
    weights = {}
    for e in range(Er):
        w = {}
        for role, (r, c) in (("moe.expert.w1", (Ie, Lr)), ("moe.expert.w3", (Ie, Lr)), ("moe.expert.w2", (Lr, Ie))):
            packed = torch.randint(0, 256, (r, c // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
            scale = _scale_bytes(kind, (r, c // 32), gen)
            if kind == "nan" and e == 0 and role == "moe.expert.w2":
                scale[0, 0] = 0xFF
            w[role] = (packed.to(dev), scale.to(dev))
        weights[e] = w
    kk = min(k, Er)
    ids = torch.stack([torch.randperm(Er, generator=gen)[:kk] for _ in range(T)]).to(dev)
    wts = torch.rand(T, kk, generator=gen, dtype=torch.float32).to(dev)
    z = _randn((T, Lr), gen, act, dev)

    def experts(e: int, dtype=act):
        w = weights.get(e)
        if w is None:
            return None
        # the logical value by k3bundle's codec: a backend that decodes the packed form is judged against it
        return {role: ExpertWeight(lambda p=p, s=s: mxfp4.dequantize(p, s, dtype), (p, s)) for role, (p, s) in w.items()}

    region = {}
    if kind == "nan":
        may = (ids == 0).any(-1)[:, None].expand(T, Lr).clone()  # the tokens routed to expert 0
        must = torch.zeros_like(may)
        must[:, 0] = may[:, 0]  # its w2 row 0, block 0 is NaN: output column 0 of those tokens
        region = {0: (must, may)}
    touched = len(torch.unique(ids))
    eb = torch.empty(0, dtype=act).element_size()
    case = Case("mxfp4_weight_gemm_grouped", "", (z, ids, wts, experts),
                {"situ_beta": x["situ_beta"], "situ_cap": x["situ_cap"]}, region,
                touched * 3 * Ie * Lr * (0.5 + 1 / 32) + 2 * T * Lr * eb, 2 * T * kk * 3 * Ie * Lr)
    case.bytes = int(case.bytes)
    return case


BUILDERS = {
    "kda_chunked_prefill": lambda s, x, z, g, a, d: _kda("kda_chunked_prefill", s, x, z, g, a, d),
    "kda_recurrent_decode": lambda s, x, z, g, a, d: _kda("kda_recurrent_decode", s, x, z, g, a, d),
    "causal_short_conv1d_with_state": _conv,
    "gated_mla_prefill": _mla_prefill,
    "gated_mla_decode_latent_cache": _mla_decode,
    "sigmoid_biased_topk_router": _router,
    "mxfp4_weight_gemm_grouped": _experts,
}


def make_case(op: str, name: str, spec: dict, dims: dict, sizes: Sizes, seed: int, act: torch.dtype,
              device: torch.device) -> Case:
    """One case's inputs, drawn from ``seed`` (the same for every backend and device)."""
    gen = torch.Generator().manual_seed(seed)
    case = BUILDERS[op](spec, dims, sizes, gen, act, device)
    case.name, case.timed = name, bool(spec.get("timed"))
    return case


def upcast(args: tuple, kwargs: dict, dtype: torch.dtype = torch.float64):
    """The reference's copy of a case's arguments: floating tensors in ``dtype``; the experts
    callable decoding into ``dtype``."""
    def up(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.to(dtype)
        if callable(a) and not isinstance(a, torch.Tensor):
            return lambda e, f=a: f(e, dtype)
        return a

    return tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}
