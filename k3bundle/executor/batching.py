"""Batched requests on the built-in executor: B prompts of different lengths in one forward, then
their decode steps together (docs/executor.md "Batching").

Layout: **right padding with a per-request length**. One prefill call holds the B prompts in a
[B, T] grid (T the longest); row b's first n_b positions are its tokens, the rest padding (any
token id). Every row-wise step (embedding, norms, AttnRes, projections, router, experts, head)
runs on all B·T rows at once, and a row never reads another. Only the sequence mixers see the
grid, and they keep padding out of every request:

- KDA conv (K1): a token's window holds only earlier inputs, so a valid token's never holds
  padding; the conv state kept is the last W inputs at the request's own end, ext[b, n_b : n_b + W].
- KDA delta rule (K5): at a padded position q = k = v = 0, g = 0 (α = 1) and β = 0, so S' = S and
  u = 0: the state passes it unchanged, exactly. The B requests fold into the head axis
  ([T, B·H, K]), since heads never mix in K5; each keeps its own state.
- MLA (M4): each request attends to its own cache, padded to the longest as [B, S, C]; key s is
  visible to query t of request b iff s ≤ o_b + t (causal) and s < o_b + n_b (its own length;
  o_b the tokens it had cached). Only the n_b valid latents enter its cache.

Decode at batch N: one token per active request (T = 1, no padding in the grid), each at its own
cache length; the padded latent caches keep the same key mask. A request leaves the batch after
its last step. Each request gets the equations it gets alone (``Executor``); only the products'
shapes differ, so the results agree to rounding (tests/test_batching.py).

``Leak`` plants the fault of a batch that lets padding in, for one request in one layer
(``validate --serving`` must locate it).

Legend: B requests, T grid length, D model width, H heads, K key dim, V value dim, P = H·K,
W conv state rows, S padded cache length, C latent width, N nope dim, L kv_lora rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from k3bundle.config import TextConfig
from k3bundle.executor import head, latent_moe, situ_glu
from k3bundle.executor.attnres import BlockResidual
from k3bundle.executor.cache import KDAState, MLAState, ModelCache
from k3bundle.executor.errors import ExecutorError
from k3bundle.executor.kda import CHUNK, CONV_ROLES, chunked_batched, gates, recurrent
from k3bundle.executor.mla import expand, output_gate, project, softmax_scale
from k3bundle.executor.model import Executor
from k3bundle.executor.norms import compute_dtype, linear, rms_norm
from k3bundle.executor.taps import TapRecorder

#: the per-position taps a batched run keeps per request (the AttnRes outputs, mixer and FFN outputs)
ROW_TAPS = ("attn_res_out", "mixer_out", "ffn_res_out", "ffn_out")
LEAKS = ("kda_conv", "kda_state", "mla_keys")
QUERY_BLOCK = 256  # queries per MLA score block: bounds memory at [B, H, 256, S]


@dataclass(frozen=True)
class Request:
    ids: list[int]  # the prompt
    tokens: list[int]  # decode: step i > 0 feeds tokens[i − 1]; len(tokens) steps (as ``serving.uninterrupted``)
    routes: dict[str, torch.Tensor] | None = None  # {"layers.{l}.router_ids": ids [positions, K]} from position 0


@dataclass(frozen=True)
class Leak:
    """A planted fault: padding enters ``request``'s state at ``layer``.
    ``kda_conv``: its conv state taken at the padded row's end, ext[b, T : T + W];
    ``kda_state``: its padded positions left unmasked in the delta rule;
    ``mla_keys``: its queries placed at the padded row's end (o_b = S − n_b), so they see padded keys."""

    request: int
    layer: int
    where: str

    def __post_init__(self):
        if self.where not in LEAKS:
            raise ExecutorError(f"a leak is one of {', '.join(LEAKS)}, not {self.where!r}")


@dataclass
class RequestRun:
    """One request's outputs, batched or alone."""

    logits: torch.Tensor  # [n, V] its prompt rows
    step_logits: torch.Tensor  # [steps, V]: row 0 the prompt's last, row i after decoding tokens[i − 1]
    taps: dict[str, torch.Tensor]  # layers.{l}.{ROW_TAPS} [n, D]; decode.layers.{l}.… [steps − 1, D]
    prefilled: ModelCache  # its cache after the prompt
    final: ModelCache  # its cache after the last step
    grid: int = 0  # the batch's prefill grid length T (0: run alone)


def alone(weights, req: Request) -> RequestRun:
    """The request on the single-request path (``Executor``): the batch's reference."""
    rec = TapRecorder([f"layers.*.{k}" for k in ROW_TAPS])
    ex = Executor(weights, taps=rec, forced_routes=req.routes)
    logits, cache = ex.prefill(list(req.ids))
    prefilled = cache.clone()
    _, steps = ex.decode_steps(logits[-1:], cache, len(req.tokens), tokens=req.tokens)
    n, taps = len(req.ids), {}
    for name in rec.names():
        rows = rec[name]
        taps[name], taps["decode." + name] = rows[:n], rows[n:]
    return RequestRun(logits.detach().cpu(), steps.detach().cpu(), taps, prefilled, cache)


def batched(weights, reqs: Sequence[Request], pad_id: int = 0, leak: Leak | None = None) -> list[RequestRun]:
    """The requests as one batch: one prefill of the padded grid (``pad_id`` at the padded
    positions), then every decode step of the requests still running, together."""
    if any(r.routes is None for r in reqs) and any(r.routes is not None for r in reqs):
        raise ExecutorError("forced routes must be given for every request of a batch or for none")
    b = Batch(weights, leak)
    caches = [b.ex.new_cache() for _ in reqs]
    logits, taps = b.forward(list(range(len(reqs))), [list(r.ids) for r in reqs], caches, pad_id,
                             [r.routes for r in reqs], decode=False)
    prefilled = [c.clone() for c in caches]
    rows = [[lg[-1]] for lg in logits]
    dec: list[dict[str, list]] = [{} for _ in reqs]
    for i in range(1, max(len(r.tokens) for r in reqs)):
        active = [j for j, r in enumerate(reqs) if i < len(r.tokens)]
        step, st = b.forward(active, [[reqs[j].tokens[i - 1]] for j in active], [caches[j] for j in active], pad_id,
                             [reqs[j].routes for j in active], decode=True)
        for k, j in enumerate(active):
            rows[j].append(step[k][0])
            for name, v in st[k].items():
                dec[j].setdefault("decode." + name, []).append(v)
    for j, tp in enumerate(taps):  # a request with one step decoded nothing: its decode taps have no rows
        dec[j].update({"decode." + k: [v[:0]] for k, v in tp.items() if "decode." + k not in dec[j]})
    grid = max(len(r.ids) for r in reqs)
    return [RequestRun(logits[j].detach().cpu(), torch.stack(rows[j])[:len(reqs[j].tokens)].detach().cpu(),
                       {**taps[j], **{k: torch.cat(v) for k, v in dec[j].items()}}, prefilled[j], caches[j], grid)
            for j in range(len(reqs))]


def _grid(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, list[int]]:
    """The B rows right-padded to the longest: ids [B, T] and each row's length n_b."""
    T = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad_id] * (T - len(r)) for r in rows], dtype=torch.long), [len(r) for r in rows]


def valid_mask(lengths: Sequence[int], T: int, device) -> torch.Tensor:
    """[B, T]: position t of row b holds one of its tokens (t < n_b), not padding."""
    return torch.arange(T, device=device)[None, :] < torch.tensor(list(lengths), device=device)[:, None]


@dataclass
class Batch:
    """The batched forward on one weight source (the layer loop of ``Executor``, on a grid)."""

    weights: object
    leak: Leak | None = None
    ex: Executor = field(init=False)

    def __post_init__(self):
        self.ex = Executor(self.weights)  # id checks, new caches and the chunk length, as alone
        self.text: TextConfig = self.weights.config.text

    def forward(self, who: list[int], rows, caches: list[ModelCache], pad_id: int, routes, decode: bool):
        """One call over the rows (the new tokens of requests ``who``) on their caches; returns per
        request (logits [n_b, V], {tap name: [n_b, D]})."""
        leak = self.leak if self.leak is not None and self.leak.request in who else None
        leak = None if leak is None else replace(leak, request=who.index(leak.request))  # its row in this grid
        for r in rows:
            self.ex._check_ids(r)
        ids_BT, lengths = _grid(rows, pad_id)
        B, T = ids_BT.shape
        dev, t, eps = self.weights.device, self.text, self.text.rms_norm_eps
        ids_BT = ids_BT.to(dev)
        valid_BT = valid_mask(lengths, T, dev)
        starts = [c.length for c in caches]
        stream = BlockResidual(head.embed(ids_BT.reshape(-1), self.weights), t.attn_res_block_size, eps)  # (E0, A2)
        taps: dict[str, torch.Tensor] = {}
        for l in range(t.num_hidden_layers):
            W = self.weights.layer(l, decode)
            x = stream.mixer_input(l, W["attn_res.norm"], W["attn_res.proj"])  # (A2.1-2)
            n_BTD = rms_norm(x, W["input_norm"], eps).view(B, T, -1)
            here = leak if leak is not None and leak.layer == l else None
            states = [c.layers[l] for c in caches]
            if t.is_mla(l):
                a = mla_batched(n_BTD, W, states, lengths, t, decode, here)  # (M1-M5)
            else:
                a = kda_batched(n_BTD, W, states, lengths, t, decode, here)  # (K1-K7)
                for c, s in zip(caches, states):
                    c.layers[l] = s
            stream.add_mixer(a)  # (A2.4)
            y = stream.ffn_input(l, W["ffn_res.norm"], W["ffn_res.proj"])  # (A2.5)
            m = rms_norm(y, W["post_attn_norm"], eps)
            if t.is_moe(l):
                forced = _forced(routes, f"layers.{l}.router_ids", starts, lengths, T, dev)
                f = latent_moe.forward(m, W, t, forced).out_TD  # (R1-R7)
            else:
                f = situ_glu.dense(m, W, t)  # (D1)
            stream.add_ffn(f)  # (A2.7)
            for k, v in zip(ROW_TAPS, (x, a, y, f)):
                taps[f"layers.{l}.{k}"] = v.view(B, T, -1)
            del W
        g = self.weights.global_tensor
        h = stream.output(g("out_res.norm"), g("out_res.proj"))  # h_final = AttnRes_out(B ++ [S])
        logits = self.weights.gather_vocab(head.logits(h, g("final_norm"), g("lm_head"), eps)).view(B, T, -1)  # (F1)
        for c, n in zip(caches, lengths):
            c.length += n
        return ([logits[b, :n] for b, n in enumerate(lengths)],
                [{k: v[b, :n].detach().cpu() for k, v in taps.items()} for b, n in enumerate(lengths)])


def _forced(routes, name: str, starts, lengths, T: int, dev) -> torch.Tensor | None:
    """Each request's forced expert ids at its positions, a padded row repeating its last one."""
    if routes[0] is None:
        return None
    out = []
    for r, s, n in zip(routes, starts, lengths):
        ids = torch.as_tensor(r[name])[s:s + n]
        out.append(torch.cat([ids, ids[-1:].expand(T - n, -1)]))
    return torch.stack(out).reshape(-1, out[0].shape[-1]).to(dev)


def conv_batched(u_BTP: torch.Tensor, w_P1K: torch.Tensor, state_BWP: torch.Tensor, lengths, c: torch.dtype,
                 leak: int | None = None):
    """(K1) every request's depthwise causal conv + SiLU; returns (c̃ [B, T, P], new state [B, W, P])."""
    W = state_BWP.shape[1]
    ext_BSP = torch.cat([state_BWP.to(u_BTP.dtype), u_BTP], dim=1)  # rows t..t+W of ext are u_{t-W}..u_t
    win_BTPK = ext_BSP.unfold(1, w_P1K.shape[-1], 1)  # [B, T, P, kernel]: only earlier inputs, never padding
    out_BTP = torch.nn.functional.silu((win_BTPK.to(c) * w_P1K[:, 0].to(c)).sum(-1))  # (K1)
    T = u_BTP.shape[1]
    ends = [T if b == leak else n for b, n in enumerate(lengths)]  # the fault: the padded row's end
    new_BWP = torch.stack([ext_BSP[b, e:e + W] for b, e in enumerate(ends)])  # (K1) last W inputs at n_b
    return out_BTP.to(u_BTP.dtype), new_BWP


def kda_batched(x_BTD, W, states: list[KDAState], lengths, text: TextConfig, decode: bool,
                leak: Leak | None = None) -> torch.Tensor:
    """KDA(x) (K1-K7) for every request's new tokens; replaces ``states[b]`` by its state after them.
    Returns [B·T, D] (padded rows included, never read)."""
    B, T, _ = x_BTD.shape
    act, c = x_BTD.dtype, states[0].recurrent_HKV.dtype
    H = W["kda.b_proj"].shape[0]
    K = W["kda.q_proj"].shape[0] // H
    V = W["kda.o_norm"].shape[0]
    conv, conv_state = [], []
    for i, (proj, kernel) in enumerate(CONV_ROLES):
        u_BTP = linear(x_BTD, W[proj])  # (K1) u_c = W_c x
        state_BWP = torch.stack([s.conv_3WP[i] for s in states])
        bad = leak.request if leak is not None and leak.where == "kda_conv" else None
        out, new = conv_batched(u_BTP, W[kernel], state_BWP, lengths, compute_dtype(u_BTP), bad)  # (K1)
        conv.append(out)
        conv_state.append(new)
    z_BTP = linear(linear(x_BTD, W["kda.f_a_proj"]), W["kda.f_b_proj"])  # (K3) z = W_fb W_fa x
    b_BTH = linear(x_BTD, W["kda.b_proj"])
    g_BTP = linear(x_BTD, W["kda.g_proj"])
    q, k, v, z = (x.view(B, T, H, -1) for x in (*conv, z_BTP))
    lower = text.linear_attn_config.gate_lower_bound
    q, k, v, g, beta = gates(q, k, v, z, b_BTH, W["kda.A_log"][:H], W["kda.dt_bias"].view(H, K), lower, c)  # (K2-K4)
    keep_BT = valid_mask(lengths, T, x_BTD.device)
    if leak is not None and leak.where == "kda_state":
        keep_BT[leak.request] = True  # the fault: this request's padding enters its delta rule
    q, k, v, g = (x * keep_BT[..., None, None] for x in (q, k, v, g))  # (K5) padding: q = k = v = 0, α = 1
    beta = beta * keep_BT[..., None]  # (K5) and β = 0: S' = S, u = 0
    fold = lambda x: x.transpose(0, 1).reshape(T, B * H, x.shape[-1])  # noqa: E731  [B, T, H, *] -> [T, B·H, *]
    S_NKV = torch.stack([s.recurrent_HKV for s in states]).reshape(B * H, K, V)
    if decode:  # (K5) the recurrence
        o_TNV, S_NKV = recurrent(fold(q), fold(k), fold(v), fold(g), beta.transpose(0, 1).reshape(T, B * H), S_NKV)
    else:  # (K5) the chunked form, requests as heads
        o_TNV, S_NKV, _ = chunked_batched(fold(q), fold(k), fold(v), fold(g), beta.transpose(0, 1).reshape(T, B * H),
                                          S_NKV, CHUNK, lower)
    S_BHKV = S_NKV.view(B, H, K, V)
    for b in range(B):
        states[b] = KDAState(S_BHKV[b], torch.stack([cs[b] for cs in conv_state]).to(states[b].conv_3WP.dtype))
    o_BTHV = o_TNV.view(T, B, H, V).transpose(0, 1).to(act)  # the kernel hands o back in the activation dtype
    n_BTHV = rms_norm(o_BTHV, W["kda.o_norm"], text.rms_norm_eps).to(c)  # (K6) N1
    y_BTHV = (n_BTHV * torch.sigmoid(g_BTP.view(B, T, H, V).to(c))).to(act)  # (K6) ⊙ σ(W_g x)
    return W.reduce(linear(y_BTHV.reshape(B * T, H * V), W["kda.o_proj"]))  # (K7)


def key_mask(offsets, lengths, T: int, S: int, device) -> torch.Tensor:
    """(M4) [B, 1, T, S]: key s visible to query t of request b iff s ≤ o_b + t and s < o_b + n_b."""
    o = torch.tensor(list(offsets), device=device)[:, None, None]
    n = torch.tensor(list(lengths), device=device)[:, None, None]
    t = torch.arange(T, device=device)[None, :, None]
    s = torch.arange(S, device=device)[None, None, :]
    return ((s <= o + t) & (s < o + n))[:, None]


def mla_batched(x_BTD, W, states: list[MLAState], lengths, text: TextConfig, decode: bool,
                leak: Leak | None = None) -> torch.Tensor:
    """MLA(x) (M1-M5) for every request's new tokens, each over its own cache (appended in place,
    valid rows only). Returns [B·T, D]."""
    B, T, D = x_BTD.shape
    N, R, L, Vd = text.qk_nope_head_dim, text.qk_rope_head_dim, text.kv_lora_rank, text.v_head_dim
    x_ND = x_BTD.reshape(B * T, D)
    q_nope, q_pe, latent = project(x_ND, W, text)  # (M1-M3)
    H = q_nope.shape[1]
    offsets = [s.length for s in states]
    latent_BTC = latent.view(B, T, -1)
    for b, (s, n) in enumerate(zip(states, lengths)):
        s.append(latent_BTC[b, :n])  # (M2/M3) only a request's own tokens enter its cache
    S = max(s.length for s in states)
    cache_BSC = latent.new_zeros(B, S, latent.shape[-1])
    for b, s in enumerate(states):
        cache_BSC[b, :s.length] = s.latent_SC
    if leak is not None and leak.where == "mla_keys":  # the fault: o_b + n_b = S, the padded row's end
        offsets = [S - n if b == leak.request else o for b, (o, n) in enumerate(zip(offsets, lengths))]
    mask = key_mask(offsets, lengths, T, S, x_BTD.device)
    scale, act = softmax_scale(text), x_BTD.dtype
    c = compute_dtype(x_BTD)
    qn, qp = q_nope.view(B, T, H, N).to(c), q_pe.view(B, T, H, R).to(c)
    if decode:  # (M4) absorbed: W_UK into the query, W_UV after the weighted sum, reading only the latents
        w_HEL = W["mla.kv_b_proj"].view(H, N + Vd, L).to(c)
        ckv, kpe = cache_BSC[..., :L].to(c), cache_BSC[..., L:].to(c)
        q_lat = torch.einsum("bthn,hnl->bthl", qn, w_HEL[:, :N])  # (M4) W_UKᵀ q_nope
        sc = (torch.einsum("bthl,bsl->bhts", q_lat, ckv) + torch.einsum("bthr,bsr->bhts", qp, kpe)) * scale  # (M4)
        p = torch.softmax(sc.masked_fill(~mask, -torch.inf), dim=-1)  # (M4)
        o = torch.einsum("bthl,hvl->bthv", torch.einsum("bhts,bsl->bthl", p, ckv), w_HEL[:, N:])  # (M4) W_UV Σ p ĉ
    else:  # (M4) naive: K and V expanded from the cache
        k_SHE, v_SHV = expand(cache_BSC.reshape(B * S, -1), W, text)  # (M2-M3)
        k, v = k_SHE.view(B, S, H, -1).to(c), v_SHV.view(B, S, H, -1).to(c)
        q = torch.cat([qn, qp], -1)
        o = q.new_empty(B, T, H, Vd)
        for t0 in range(0, T, QUERY_BLOCK):
            t1 = min(t0 + QUERY_BLOCK, T)
            sc = torch.einsum("bthe,bshe->bhts", q[:, t0:t1], k) * scale  # (M4)
            p = torch.softmax(sc.masked_fill(~mask[:, :, t0:t1], -torch.inf), dim=-1)  # (M4)
            o[:, t0:t1] = torch.einsum("bhts,bshv->bthv", p, v)  # (M4) o_h = P V_h
    y = output_gate(o.to(act).reshape(B * T, H, Vd), linear(x_ND, W["mla.g_proj"]))  # (M5)
    return W.reduce(linear(y, W["mla.o_proj"]))  # (M5) W_o
