"""Faults of the device side of a run: the bundle is clean, the serving engine is not.

Each takes the model's ``TextConfig`` and returns what the device does wrong (``DeviceSide``)
and where that enters the computation (``Planted``):

- cache handling between decode steps, through the device's ``after_step`` hook (a KDA state
  restored one step late, an MLA cache row lost);
- one layer's kernel wrong (``DeviceSide.kernels``: that layer runs these ops, every other layer
  the device's own): a stand-in activation in the routed experts, the KDA state carried wrongly
  across a chunk boundary, the conv state not advanced, the L2 norm of q and k missing in decode.

The layers are chosen from the model's own layer kinds, so a fault sits at the same kind of
place at any depth (docs/validation.md "The fault catalogue").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3bundle.calibrate.planted import DeviceSide, Planted
from k3bundle.config import TextConfig
from k3bundle.executor import kda, latent_moe
from k3bundle.kernels.planted import kda_ops
from k3bundle.ops.expert_weight import logical
from k3bundle.storage import STORAGE

SERVING_STEP = 4  # a cache fault is planted after this decode step (0-based); the greedy case decodes 16


def _kda_layer(text: TextConfig, at_least: int) -> int:
    return next(l for l in text.kda_layers if l >= at_least)


def _moe_layer(text: TextConfig, at_least: int) -> int:
    return next(l for l in range(at_least, text.num_hidden_layers) if text.is_moe(l))


# ---------------------------------------------------------------- cache handling between steps
def kda_state_late(text: TextConfig):
    """A KDA layer's state (recurrent and conv) restored one step late: after decode step
    SERVING_STEP the engine puts back the state it had saved one step earlier."""
    layer = _kda_layer(text, 4)
    saved = {}

    def after_step(step, cache):
        s = cache.layers[layer]
        if step == SERVING_STEP - 1:
            saved["s"] = s.clone()
        elif step == SERVING_STEP:
            s.recurrent_HKV.copy_(saved["s"].recurrent_HKV)
            s.conv_3WP.copy_(saved["s"].conv_3WP)
    return DeviceSide(after_step=after_step), Planted(layer, f"decode.layers.{layer}.mixer_out")


def mla_row_dropped(text: TextConfig):
    """One row of an MLA layer's latent cache lost (a page slot skipped): after decode step
    SERVING_STEP the row of the middle prompt token is gone and later steps attend without it."""
    layer = text.mla_layers[0]

    def after_step(step, cache):
        if step == SERVING_STEP:
            s = cache.layers[layer]
            j = s.length // 2
            kept = torch.cat([s.latent_SC[:j], s.latent_SC[j + 1:]]).clone()
            s.buffer_SC[: s.length - 1] = kept
            s.length -= 1
    return DeviceSide(after_step=after_step), Planted(layer, f"decode.layers.{layer}.mixer_out")


# ---------------------------------------------------------------- one layer's kernel wrong
def _silu(g: torch.Tensor, beta: float) -> torch.Tensor:
    return F.silu(g)  # BUG: SiLU where SiTU is β·tanh(g/β)·σ(g) (S1): no soft cap at β


def _silu_experts(z, ids, weights, experts, *, situ_beta, situ_cap):
    return latent_moe.routed(z, ids, weights, lambda e: logical(experts(e)), situ_beta, situ_cap, act=_silu)


def silu_experts(text: TextConfig):
    """A stand-in activation: SiLU in place of SiTU in one MoE layer's routed experts (the usual
    SwiGLU kernel run on a SiTU-GLU model; equal for small gates, unbounded above β = 4)."""
    layer = _moe_layer(text, 6)
    grouped = {(f.gemm_op or "bf16_gemm") + "_grouped" for f in STORAGE.values()}  # whatever the storage
    return (DeviceSide(kernels={layer: {op: _silu_experts for op in grouped}}),
            Planted(layer, f"layers.{layer}.ffn_out"))


def _stale_carry_prefill(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, *, lower_bound, chunk=kda.CHUNK):
    cu, outs, finals = [int(x) for x in cu_seqlens], [], []
    for n in range(len(cu) - 1):
        q_, k_, v_, g_, b_ = kda.gates(*(t[cu[n]:cu[n + 1]] for t in (q, k, v, g, beta)), A_log, dt_bias,
                                       lower_bound, state.dtype)  # (K2-K4)
        S_in = state[n]
        for s in range(0, q_.shape[0], chunk):
            p = slice(s, s + chunk)
            o, S_out, _ = kda.chunked(q_[p], k_[p], v_[p], g_[p], b_[p], S_in, chunk)  # (K5) one chunk
            outs.append(o)
            # BUG: the next chunk starts from the state this chunk started from (its update not carried)
        finals.append(S_out)
    return torch.cat(outs), torch.stack(finals)


def kda_chunk_carry(text: TextConfig):
    """The KDA state carried wrongly across a chunk boundary only: one KDA layer's chunked
    prefill starts every chunk from the state the chunk before it started from (the update is
    written where the next chunk does not read it). A prompt within one chunk (64 tokens) and
    every decode step are right; so is the state handed to decode after a one-chunk prompt."""
    layer = _kda_layer(text, 6)
    return DeviceSide(kernels={layer: {"kda_chunked_prefill": _stale_carry_prefill}}), \
        Planted(layer, f"layers.{layer}.mixer_out")


def _conv_not_advanced(u, weight, state):
    out, _ = kda.causal_short_conv1d_with_state(u, weight, state)
    return out, state  # BUG: the conv state handed back as it came: never advanced


def conv_state_stuck(text: TextConfig):
    """A conv state that is not advanced: one KDA layer's short convolution computes each call's
    outputs right but hands back the state it was given, so decode starts from the empty state
    (not the prompt's last inputs) and stays there."""
    layer = _kda_layer(text, 5)
    return DeviceSide(kernels={layer: {"causal_short_conv1d_with_state": _conv_not_advanced}}), \
        Planted(layer, f"decode.layers.{layer}.mixer_out")


def _gates_without_l2(q, k, v, g, beta, A_log, dt_bias, lower, c):
    _, _, v_, g_, b_ = kda.gates(q, k, v, g, beta, A_log, dt_bias, lower, c)
    return q.to(c) * q.shape[-1] ** -0.5, k.to(c), v_, g_, b_  # BUG: q and k not L2-normalised (K2)


def l2norm_missing_decode(text: TextConfig):
    """The L2 norm of q and k missing in decode only: one KDA layer's recurrent decode kernel
    skips K2's normalisation (the prefill kernel does it); the prompt is right, every decode
    step is not."""
    layer = _kda_layer(text, 1)
    return DeviceSide(kernels={layer: {"kda_recurrent_decode": kda_ops(_gates_without_l2)["kda_recurrent_decode"]}}), \
        Planted(layer, f"decode.layers.{layer}.mixer_out")
