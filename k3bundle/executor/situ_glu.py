"""SiTU-GLU, the activation of every FFN: dense layer 0, shared and routed experts
(docs/kimi-k3.md §3.5 S1-S3, §3.6 D1).

(S1) situ(g) = β · tanh(g/β) · σ(g),  β = activation_situ_beta = 4   (a SiLU soft-capped at 4)
(S2) cap(u)  = L · tanh(u/L),          L = activation_situ_linear_beta = 25
(S3) GLU(x)  = W_down ( situ(W_gate x) ⊙ cap(W_up x) ), activation in FP32, cast back
(D1) FFN₀(x) = GLU with the dense ``mlp.gate_proj/up_proj/down_proj`` of layer 0

|situ · cap| < 100 and tends to 100 (tests/test_executor_blocks.py checks saturation).

Legend: T tokens, D input width, I intermediate width.
"""

from __future__ import annotations

import torch

from k3bundle.config import TextConfig
from k3bundle.executor.norms import compute_dtype, linear


def situ(g: torch.Tensor, beta: float) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)  # (S1)


def cap(u: torch.Tensor, limit: float) -> torch.Tensor:
    return limit * torch.tanh(u / limit)  # (S2)


#: tokens per block of a long prompt's FFN: a 131,072-token dense layer would otherwise hold three
#: [T, 33792] FP32 intermediates (53 GB); rows are independent, so blocks compute the same rows
ROW_BLOCK = 8192


def glu(x_TD: torch.Tensor, w_gate_ID, w_up_ID, w_down_DI, beta: float, limit: float, mm=linear,
        act=situ) -> torch.Tensor:
    """(S3) for any of the three FFN kinds; returns the activation dtype. ``mm(x, w)`` is the
    projection (``linear``; the fast MoE form passes one that reads MXFP4 weights directly);
    ``act(g, beta)`` the gate's activation (``situ``; a stand-in is a planted device fault)."""
    if x_TD.dim() == 2 and x_TD.shape[0] > ROW_BLOCK:
        return torch.cat([glu(x_TD[s:s + ROW_BLOCK], w_gate_ID, w_up_ID, w_down_DI, beta, limit, mm, act)
                          for s in range(0, x_TD.shape[0], ROW_BLOCK)])
    c = compute_dtype(x_TD)
    # the activation is computed in FP32 from the activation-dtype projections (S3)
    gate_TI = mm(x_TD, w_gate_ID).to(c)
    up_TI = mm(x_TD, w_up_ID).to(c)
    h_TI = act(gate_TI, beta) * cap(up_TI, limit)  # (S3)
    # cast back before the down projection, as a serving kernel's bf16 GEMM input
    h_TI = h_TI.to(x_TD.dtype)
    return mm(h_TI, w_down_DI)  # (S3)


def dense(x_TD: torch.Tensor, W, text: TextConfig) -> torch.Tensor:
    """(D1) layer 0's FFN; the down projection is row-parallel under TP (``W.reduce``)."""
    return W.reduce(glu(x_TD, W["dense.gate_proj"], W["dense.up_proj"], W["dense.down_proj"],
                        text.activation_situ_beta, text.activation_situ_linear_beta))  # (D1)
