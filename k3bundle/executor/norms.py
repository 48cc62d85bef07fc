"""RMSNorm and the compute-dtype rule shared by every block (docs/kimi-k3.md §3.0, N1).

(N1) RMSNorm_w(x) = w ⊙ round_to_input_dtype( x · rsqrt(mean(x²) + ε) ), statistics in FP32.

The normalised activation is rounded back to the input dtype *before* the gain multiply
(RTP-REF ``common.py``): in bfloat16 this rounding is observable at expert boundaries, so it
is reproduced exactly. The gain may be BF16 (most norms) or F32 (KDA ``o_norm``); the product
is formed in the compute dtype and rounded once to the input dtype, which for a BF16 gain is
bit-identical to a BF16 multiply.

Blocks never take a dtype argument: the activation dtype is the input's dtype and the
compute dtype follows from it (``compute_dtype``): float64 stays float64 (tests), anything
else computes in float32.

Legend: T tokens, D model width, ... any leading dims.
"""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype for statistics, softmax and gates: float32, or float64 for float64 input."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def linear(x: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """"Linear W x" of the spec: x · Wᵀ with W stored [out, in]; bias-free everywhere."""
    return x @ w_OI.mT  # mT: a stack of weights [G, out, in] runs as one batched GEMM


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(N1) over the last dim; returns the input dtype."""
    c = compute_dtype(x)
    # statistics in FP32 (FP64 in the float64 policy) whatever the activation dtype
    x_c = x.to(c)
    n = x_c * torch.rsqrt(x_c.pow(2).mean(-1, keepdim=True) + eps)  # (N1) normalise
    # round to the input dtype *before* the gain (N1): the step that bf16 makes visible
    n = n.to(x.dtype)
    return (w.to(c) * n.to(c)).to(x.dtype)  # (N1) gain, one rounding to the input dtype


def rms_normalise(x_c: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + ε) in the dtype of ``x_c``, no gain, no rounding (AttnRes keys, A1)."""
    return x_c * torch.rsqrt(x_c.pow(2).mean(-1, keepdim=True) + eps)
