"""Run the built-in executor as the device under test, and the teacher-forced layer checks.

``device_case``: the device's free-running view of one golden case — a prefill over the golden
ids with the golden expert choices replayed (forced routing, so near-tie routing flips do not
swamp the numerics; routing itself is judged separately), then decode steps fed the golden
greedy tokens, recording the taps at the golden positions, the step logits and per-step states.

``layer_checks``: teacher forcing per layer. Each layer's AttnRes, mixer and FFN run on inputs
taken from ``feed`` (the goldens, or a dump's own outputs) and are compared with ``feed``'s
outputs, so the error a layer *adds* is separated from the error it *inherits*. The router runs
unforced here and its expert sets are compared with a near-tie exemption.

Legend: T tokens, D model width, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from k3bundle.executor import Executor, TapRecorder
from k3bundle.executor import head, kda, latent_moe, mla, situ_glu
from k3bundle.executor.attnres import BlockResidual
from k3bundle.executor.cache import KDAState
from k3bundle.executor.norms import rms_norm
from k3bundle.golden.tolerances import Tolerances
from k3bundle.validate.compare import TapResult, compare_logits, compare_router, compare_tensor

SKIP = ("router_ids", "router_margin")  # compared as sets, not as values


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a


def forced_routes(golden: dict, text) -> dict[str, torch.Tensor]:
    return {f"layers.{l}.router_ids": _t(golden[f"routes.layers.{l}.router_ids"])
            for l in text.moe_layers if f"routes.layers.{l}.router_ids" in golden}


def device_case(weights, golden: dict, ids: np.ndarray) -> dict[str, torch.Tensor]:
    """The device's arrays for one case, named like the golden's."""
    text = weights.config.text
    positions = golden["positions"].tolist()
    tokens = golden["greedy_tokens"].tolist()
    decode_pos = list(range(len(ids), len(ids) + max(len(tokens) - 1, 0)))
    rec = TapRecorder(positions=positions + decode_pos)
    ex = Executor(weights, taps=rec, forced_routes=forced_routes(golden, text))
    logits_TV, cache = ex.prefill(ids.tolist())
    out: dict[str, torch.Tensor] = {}
    for name in rec.names():
        v = rec[name]
        if name.endswith(("kda_state", "kda_conv")):
            out[name] = v
        elif name.endswith("mla_latent"):
            out[name] = v[positions]
        else:
            out[name] = v[: len(positions)]
    rows, states = [logits_TV[-1]], {}
    for i, tok in enumerate(tokens[:-1]):  # teacher-forced decode on the golden greedy tokens
        rows.append(ex.decode(tok, cache))
        for l, s in enumerate(cache.layers):
            kind = "kda_state" if isinstance(s, KDAState) else "mla_latent"
            states.setdefault(f"decode_states.layers.{l}.{kind}", []).append(
                s.recurrent_HKV.cpu() if kind == "kda_state" else s.latent_SC[-1].cpu())
    out["step_logits"] = torch.stack(rows[: len(tokens)]) if tokens else logits_TV[:0]
    out["greedy_tokens"] = out["step_logits"].argmax(-1)
    for k, v in states.items():
        out[k] = torch.stack(v)
    for name in rec.names():
        if not name.endswith(("kda_state", "kda_conv", "mla_latent")) and decode_pos:
            out[f"decode.{name}"] = rec[name][len(positions):]
    return out


def layer_outputs(weights, feed: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Teacher-forced outputs of every layer, computed on ``feed``'s inputs.

    ``feed(name)`` returns a full-sequence tap ([T, ...], all positions) or None when absent.
    Layer inputs are ``feed``'s AttnRes outputs when given, else recomputed from ``feed``'s
    embedding and layer outputs (a dump needs only its mixer and FFN outputs). Each layer
    continues from ``feed``'s outputs, never its own, so errors do not carry over. Keys are
    tap names; ``own.layers.{l}.router_ids`` is the layer's unforced expert choice.
    """
    text, act, eps = weights.config.text, weights.policy.act, weights.config.text.rms_norm_eps
    dev = weights.device

    def get(name):
        v = feed(name)
        return None if v is None else _t(v).to(dev)

    out: dict[str, torch.Tensor] = {}
    stream = BlockResidual(get("embed").to(act), text.attn_res_block_size, eps)
    cache = Executor(weights).new_cache()
    for l in range(text.num_hidden_layers):
        W = weights.layer(l)
        x = stream.mixer_input(l, W["attn_res.norm"], W["attn_res.proj"])  # (A2.1) from fed outputs
        if l > 0:
            out[f"layers.{l}.attn_res_out"] = x
        fed_x = get(f"layers.{l}.attn_res_out")
        n = rms_norm((x if fed_x is None else fed_x).to(act), W["input_norm"], eps)
        if text.is_mla(l):
            out[f"layers.{l}.mixer_out"], _ = mla.forward(n, W, cache.layers[l], text)
        else:
            out[f"layers.{l}.mixer_out"], _, _ = kda.forward(n, W, cache.layers[l], text, decode=False)
        stream.add_mixer(get(f"layers.{l}.mixer_out").to(act))  # continue from the fed output
        y = stream.ffn_input(l, W["ffn_res.norm"], W["ffn_res.proj"])
        out[f"layers.{l}.ffn_res_out"] = y
        fed_y = get(f"layers.{l}.ffn_res_out")
        m = rms_norm((y if fed_y is None else fed_y).to(act), W["post_attn_norm"], eps)
        if text.is_moe(l):
            ids = get(f"layers.{l}.router_ids")
            out[f"layers.{l}.ffn_out"], own, _, _ = latent_moe.forward(m, W, text, ids)
            if ids is not None:  # the layer's own choice, judged as a set against the fed one
                own, _ = latent_moe.route(m, W["moe.router"], W["moe.router_bias"], text)
            out[f"own.layers.{l}.router_ids"] = own
        else:
            out[f"layers.{l}.ffn_out"] = situ_glu.dense(m, W, text)
        stream.add_ffn(get(f"layers.{l}.ffn_out").to(act))
        del W
    g = weights.global_tensor
    out["final_hidden"] = stream.output(g("out_res.norm"), g("out_res.proj"))
    fed_h = get("final_hidden")
    h = out["final_hidden"] if fed_h is None else fed_h
    out["logits"] = weights.gather_vocab(head.logits(h.to(act), g("final_norm"), g("lm_head"), eps))
    return {k: v.detach().cpu() for k, v in out.items()}


def compare_layer_outputs(outputs: dict[str, torch.Tensor], feed: Callable[[str], object], case: str,
                          tol: Tolerances, mode: str, margins: Callable[[str], object] | None = None) -> list[TapResult]:
    """``mode`` is "added" (fed the goldens) or "emulation" (fed a dump's own outputs)."""
    results = []
    for name, value in outputs.items():
        ref = feed(name[4:] if name.startswith("own.") else name)
        if ref is None:
            continue
        if name.startswith("own."):
            tap = name[4:]
            margin = margins(tap.replace("router_ids", "router_margin")) if margins else None
            results.append(compare_router(case, tap, _t(ref), value, None if margin is None else _t(margin), tol))
        else:
            results.append(compare_tensor(case, name, _t(ref), value, tol, mode))
    return results


def inherited_checks(golden: dict, cand: dict, case: str, tol: Tolerances, routers: bool = True) -> list[TapResult]:
    """Free-running comparisons of every tap the candidate has against the golden.

    ``routers=False`` when the candidate replayed the golden routing (nothing to judge there).
    """
    results = []
    for name in sorted(cand):
        if name not in golden or name.endswith(SKIP) or name in ("greedy_tokens", "positions"):
            continue
        ref, x = _t(golden[name]), cand[name]
        if name in ("logits", "step_logits", "decode.logits"):
            results.append(compare_logits(case, name, ref, x.to(ref.device), tol))
        elif name.startswith("decode_states."):
            continue  # judged as drift per step
        else:
            results.append(compare_tensor(case, name, ref, x, tol, "inherited"))
    for name in sorted(cand):
        if routers and name.endswith("router_ids") and name in golden and not name.startswith("decode."):
            margin = golden.get(name.replace("router_ids", "router_margin"))
            results.append(compare_router(case, name, _t(golden[name]), cand[name],
                                          None if margin is None else _t(margin), tol))
    return results


def state_drift(golden: dict, cand: dict) -> dict[str, list[float]]:
    """Per decode step NMSE of each layer's state (KDA recurrent state, newest MLA latent row)."""
    from k3bundle.validate.metrics import nmse

    out = {}
    for name in sorted(cand):
        if name.startswith("decode_states.") and name in golden:
            g, c = _t(golden[name]), cand[name]
            out[name] = [nmse(g[i], c[i]) for i in range(min(g.shape[0], c.shape[0]))]
    return out
