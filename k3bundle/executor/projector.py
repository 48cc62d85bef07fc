"""The `sd2_tpool` merger and the `patchmergerv2` projector (docs/kimi-k3.md §3.9, V4-V5).

(V4) per image: mean over frames, then each kh×kw patch group → one token [kh·kw, Dv], the
     group's patches in (kh, kw) row-major order; tokens row-major over the (h/kh, w/kw) grid.
(V5) e = RMSNorm_post_norm,ε( W_p2 · GELU_erf( W_p1 · flatten(m) ) ), no pre-norm (K2.5's
     projector had one; K3's has none), exact erf GELU (the tower's MLP uses the tanh form).

Legend: N patches, M merged tokens, K = kh·kw, Dv tower width, Dm = K·Dv, D text width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3bundle.executor.norms import compute_dtype, linear, rms_norm


def merge(x_NDv: torch.Tensor, grids: list[tuple[int, int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """(V4) [N, Dv] → [M, K, Dv]; the frame mean in FP32 (FP64)."""
    kh, kw = kernel
    c = compute_dtype(x_NDv)
    out, start = [], 0
    for t, h, w in grids:
        x_thwD = x_NDv[start:start + t * h * w].to(c).unflatten(0, (t, h // kh, kh, w // kw, kw))
        m_hwKD = x_thwD.permute(0, 1, 3, 2, 4, 5).mean(0)  # (V4) [h/kh, w/kw, kh, kw, Dv], frames averaged
        out.append(m_hwKD.reshape((h // kh) * (w // kw), kh * kw, -1))  # (V4) (kh, kw) row-major in a token
        start += t * h * w
    return torch.cat(out).to(x_NDv.dtype)


def project(m_MKDv: torch.Tensor, w_p1_DmDm: torch.Tensor, w_p2_DDm: torch.Tensor, w_post_D: torch.Tensor,
            eps: float) -> torch.Tensor:
    """(V5) merged tokens [M, K, Dv] → text-width embeddings [M, D]."""
    m_MDm = m_MKDv.flatten(1)  # (V5) [M, K·Dv]: the K patches side by side, no norm before
    h_MDm = F.gelu(linear(m_MDm, w_p1_DmDm))  # (V5) exact (erf) GELU
    return rms_norm(linear(h_MDm, w_p2_DDm), w_post_D, eps)  # (V5) post-norm, ε = projector_ln_eps
