"""MoonViT-V2, the vision tower (docs/kimi-k3.md §3.9, V1-V3), and ``encode_images``.

    patches [N, 3, P, P] ─ V1 patch embed + position ─┬─ for b in 0..27−1 ─────────────────────┐
                                                      │  x += W_o Attn(RoPE2D q, RoPE2D k, v)   │
                                                      │  x += fc1 gelu_tanh fc0 RMSNorm(x)  (V2)│
                                                      └─ V3 final RMSNorm ─ V4 merge ─ V5 proj ─┘

``encode_images`` is the one entry: image patches (row-major within each image, frames first;
docs/kimi-k3.md V0) and their grids (t, h, w) in, one row of the text width per merged token
out, images in order, (h/2)·(w/2) rows each. Weights are asked from the source by schema role
(``vision_tensor("vit.wqkv", b)``), never by name.

Quirks the released weights were trained with, each kept here on purpose (docs/kimi-k3.md §3.0,
§3.9):
- the block and final norms use ε = 2⁻⁷ (``VIT_EPS``), BF16's machine epsilon, not 1e-5 or 1e-6;
- the 2-D RoPE gives the **column** position to the even complex pairs and the **row** position
  to the odd ones (one implementation's docstring says the opposite; its code does this);
- the learned position table is resized **bilinearly** (half-pixel centres), and used as is
  when the grid is exactly its size;
- the sin-cos time term is added only when an image has more than one frame;
- attention is non-causal within an image and never crosses images.

Dtypes follow the executor's policy (docs/executor.md): activations in the policy's dtype,
norm statistics, softmax and the RoPE rotation in FP32 (FP64 under float64).

Legend: N patches (all images), Dv tower width, H heads, dh head dim, Iv MLP width, P patch side.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from k3bundle.config import VisionConfig
from k3bundle.executor.errors import ExecutorError
from k3bundle.executor.norms import compute_dtype, linear, rms_norm
from k3bundle.executor.projector import merge, project
from k3bundle.executor.taps import vision_tap

#: ε of the blocks' norm0/norm1 and the final norm: declared without one, so finfo(bf16).eps in
#: the dtype the model was trained in; pinned so float32 goldens compute that function (§3.0)
VIT_EPS = 2.0 ** -7
ROPE_THETA = 10000.0  # (V2)
TIME_THETA = 10000.0  # (V1) the sin-cos time table's base
MAX_GRID_SIDE = 512  # (V0, V2) the RoPE table's size: no image side has more patches
ATTN_QUERY_CHUNK = 1024  # queries per score block: [H, chunk, n] instead of [H, n, n]

#: the vision_config choices this math implements (docs/kimi-k3.md §1.3)
SUPPORTED = {"pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear", "norm_type": "rmsnorm",
             "activation_func": "gelu_pytorch_tanh", "mlp_type": "mlp2", "merge_type": "sd2_tpool",
             "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu",
             "patch_embed_proj_bias": False, "attn_bias": False, "linear_bias": False}


def check_config(v: VisionConfig) -> None:
    """One error line for a vision_config the executor does not compute."""
    for field, want in SUPPORTED.items():
        got = getattr(v, field)
        if got != want:
            raise ExecutorError(f"vision_config.{field} is {got!r}; the executor computes {want!r} only "
                                "(docs/kimi-k3.md §3.9)")
    if (v.qkv_hidden_size // v.vt_num_attention_heads) % 4:
        raise ExecutorError(f"vision_config: head dim {v.qkv_hidden_size // v.vt_num_attention_heads} is not a "
                            "multiple of 4, which the 2-D RoPE needs (V2)")


def check_grids(v: VisionConfig, patches: torch.Tensor, grid_thws: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """The grids as int triples, checked against the patches and the model's limits."""
    grids = [tuple(int(a) for a in g) for g in grid_thws]
    p = v.patch_size
    if patches.ndim != 4 or tuple(patches.shape[1:]) != (3, p, p):
        raise ExecutorError(f"image patches have shape {list(patches.shape)}; expected [N, 3, {p}, {p}]")
    kh, kw = v.merge_kernel_size
    for i, g in enumerate(grids):
        if len(g) != 3 or min(g) < 1:
            raise ExecutorError(f"image {i}: grid {list(g)} is not three positive sizes (t, h, w)")
        t, h, w = g
        if h % kh or w % kw:
            raise ExecutorError(f"image {i}: grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
        if max(h, w) > MAX_GRID_SIDE:
            raise ExecutorError(f"image {i}: grid {h}x{w} has a side over {MAX_GRID_SIDE} patches")
        if t > v.init_pos_emb_time:
            raise ExecutorError(f"image {i}: {t} frames, more than init_pos_emb_time ({v.init_pos_emb_time})")
    n = sum(t * h * w for t, h, w in grids)
    if n != patches.shape[0]:
        raise ExecutorError(f"image patches: {patches.shape[0]} rows, but the grids {[list(g) for g in grids]} "
                            f"hold {n}")
    return grids


# ---- V1: patch embedding and position terms ------------------------------------------------

def patch_embed(patches_N3PP: torch.Tensor, w_Dv3PP: torch.Tensor) -> torch.Tensor:
    """(V1) Conv2d P×P with stride P on one P×P patch is one matrix product per patch."""
    return linear(patches_N3PP.flatten(1), w_Dv3PP.flatten(1))  # (V1) [N, Dv]


def pos_grid(table_PhPwDv: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(V1) the learned table at an (h, w) grid, [h·w, Dv] row-major; the table itself at its size."""
    if (h, w) == tuple(table_PhPwDv.shape[:2]):
        return table_PhPwDv.flatten(0, 1)  # (V1) no resampling at exactly the table's size
    c = compute_dtype(table_PhPwDv)
    t_1DvPhPw = table_PhPwDv.to(c).permute(2, 0, 1).unsqueeze(0)
    # (V1) bilinear, half-pixel centres (align_corners=False), edges clamped: F.interpolate's rule
    r_1Dvhw = F.interpolate(t_1DvPhPw, size=(h, w), mode="bilinear", align_corners=False)
    return r_1Dvhw[0].permute(1, 2, 0).flatten(0, 1).to(table_PhPwDv.dtype)


def time_term(t: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """(V1) the fixed 1-D sin-cos table [t, Dv]: [sin(f·ω_i) ‖ cos(f·ω_i)], ω_i = 10000^(−i/(Dv/2))."""
    f_T1 = torch.arange(t, dtype=torch.float64)[:, None]
    omega = TIME_THETA ** (-torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))  # (V1)
    return torch.cat([torch.sin(f_T1 * omega), torch.cos(f_T1 * omega)], dim=1).to(dtype)  # (V1)


def position(table_PhPwDv: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """(V1) every patch's position term [N, Dv]: the resized table per frame, plus the time term if t > 1."""
    c = compute_dtype(table_PhPwDv)
    parts = []
    for t, h, w in grids:
        pos_hwDv = pos_grid(table_PhPwDv, h, w).to(c)
        pos_thwDv = pos_hwDv.unsqueeze(0).expand(t, -1, -1)
        if t > 1:  # (V1) images (t = 1) get no time term at all, not the term of frame 0
            pos_thwDv = pos_thwDv + time_term(t, pos_hwDv.shape[-1], c).to(pos_hwDv.device)[:, None, :]
        parts.append(pos_thwDv.reshape(t * h * w, -1))
    return torch.cat(parts)


# ---- V2: 2-D RoPE and the blocks ---------------------------------------------------------

def rope_angles(grids: list[tuple[int, int, int]], head_dim: int, device=None) -> torch.Tensor:
    """(V2) the angle of every complex pair of every patch, [N, dh/2], float64.

    Pair 2i turns by col·θ^(−4i/dh), pair 2i+1 by row·θ^(−4i/dh), i < dh/4: columns on the even
    pairs, rows on the odd ones, as the released code computes (not as its docstring says).
    """
    freq = ROPE_THETA ** (-4.0 * torch.arange(head_dim // 4, dtype=torch.float64) / head_dim)  # (V2)
    parts = []
    for t, h, w in grids:
        idx = torch.arange(h * w, dtype=torch.float64)
        row, col = torch.div(idx, w, rounding_mode="floor"), idx % w
        ang = torch.stack([col[:, None] * freq, row[:, None] * freq], dim=-1)  # (V2) [hw, dh/4, (col, row)]
        parts.append(ang.flatten(1).repeat(t, 1))  # every frame takes the same spatial positions
    return torch.cat(parts).to(device)


def rope2d(x_NHd: torch.Tensor, ang_Nd2: torch.Tensor) -> torch.Tensor:
    """(V2) rotate each complex pair (x[2j], x[2j+1]) by its angle; computed in FP32 (FP64)."""
    c = compute_dtype(x_NHd)
    a, b = x_NHd.to(c).unflatten(-1, (-1, 2)).unbind(-1)  # pairs are adjacent (complex-interleaved)
    cos, sin = torch.cos(ang_Nd2).to(c)[:, None, :], torch.sin(ang_Nd2).to(c)[:, None, :]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)  # (V2) (a + ib)·e^{iφ}
    return out.flatten(-2).to(x_NHd.dtype)


def attention(q_NHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(V2) softmax(q kᵀ / √dh) v, non-causal, within each image only; [N, H·dh]."""
    c = compute_dtype(q_NHd)
    scale = q_NHd.shape[-1] ** -0.5
    out, start = [], 0
    for n in lengths:
        k_HnD, v_HnD = k_NHd[start:start + n].transpose(0, 1), v_NHd[start:start + n].transpose(0, 1)
        for q0 in range(start, start + n, ATTN_QUERY_CHUNK):
            q_HcD = q_NHd[q0:min(q0 + ATTN_QUERY_CHUNK, start + n)].transpose(0, 1)
            p_Hcn = torch.softmax((q_HcD @ k_HnD.mT).to(c) * scale, dim=-1)  # (V2) scores and softmax in FP32
            out.append((p_Hcn.to(v_HnD.dtype) @ v_HnD).transpose(0, 1).flatten(1))  # (V2)
        start += n
    return torch.cat(out)


def block(x_NDv: torch.Tensor, w: dict[str, torch.Tensor], ang_Nd2: torch.Tensor, lengths: list[int],
          heads: int) -> torch.Tensor:
    """(V2) one pre-norm encoder block; ``w`` by role (vit.norm0, vit.wqkv, vit.wo, vit.norm1, vit.fc0, vit.fc1)."""
    qkv_N3Hd = linear(rms_norm(x_NDv, w["vit.norm0"], VIT_EPS), w["vit.wqkv"]).unflatten(-1, (3, heads, -1))  # (V2)
    q_NHd, k_NHd, v_NHd = qkv_N3Hd.unbind(1)  # rows of W_qkv: q, k, v, each head by head
    o_NQ = attention(rope2d(q_NHd, ang_Nd2), rope2d(k_NHd, ang_Nd2), v_NHd, lengths)  # (V2)
    x_NDv = x_NDv + linear(o_NQ, w["vit.wo"])  # (V2) residual 1
    h_NIv = F.gelu(linear(rms_norm(x_NDv, w["vit.norm1"], VIT_EPS), w["vit.fc0"]), approximate="tanh")  # (V2)
    return x_NDv + linear(h_NIv, w["vit.fc1"])  # (V2) residual 2


BLOCK_ROLES = ("vit.norm0", "vit.wqkv", "vit.wo", "vit.norm1", "vit.fc0", "vit.fc1")


def _record(taps, name: str, value: torch.Tensor) -> None:
    if taps is None:
        return
    if isinstance(taps, dict):
        taps[name] = value.detach().to("cpu", copy=True)
    else:
        taps.record_state(name, value)  # a TapRecorder: vision taps have no token-position axis


def tower(W, v: VisionConfig, patches_N3PP: torch.Tensor, grids: list[tuple[int, int, int]], taps=None) -> torch.Tensor:
    """(V1-V3) the tower's output [N, Dv] in the activation dtype of the patches."""
    x_NDv = patch_embed(patches_N3PP, W.vision_tensor("vit.patch_embed"))  # (V1)
    x_NDv = x_NDv + position(W.vision_tensor("vit.pos_emb"), grids).to(x_NDv.dtype)  # (V1)
    _record(taps, vision_tap("patch_embed"), x_NDv)
    heads = v.vt_num_attention_heads
    ang_Nd2 = rope_angles(grids, v.qkv_hidden_size // heads, x_NDv.device)
    lengths = [t * h * w for t, h, w in grids]  # one attention span per image, all its frames
    for b in range(v.vt_num_hidden_layers):
        w = {role: W.vision_tensor(role, b) for role in BLOCK_ROLES}
        x_NDv = block(x_NDv, w, ang_Nd2, lengths, heads)  # (V2)
        _record(taps, vision_tap("block_out", b), x_NDv)
    return rms_norm(x_NDv, W.vision_tensor("vit.final_norm"), VIT_EPS)  # (V3)


def encode_images(W, v: VisionConfig, patches_N3PP: torch.Tensor, grid_thws: Sequence[Sequence[int]],
                  taps=None) -> torch.Tensor:
    """Images to text-width embeddings (V1-V5): [Σ (h/kh)·(w/kw), D], images in order.

    Args:
        W: a weight source with ``vision_tensor(role, block=None)`` and a dtype ``policy``
            (``executor.weights.SourceWeights``, ``bundle.weights.BundleWeights``).
        v (`VisionConfig`): the checkpoint's vision_config.
        patches_N3PP: float patches [N, 3, P, P], each image's frames in order, each frame row-major.
        grid_thws: one (t, h, w) per image, in patches.
        taps: None, a dict, or a ``TapRecorder``: gets vision.patch_embed, vision.blocks.{b}.block_out,
            vision.merger and vision.projector (docs/executor.md "Vision").
    """
    check_config(v)
    grids = check_grids(v, patches_N3PP, grid_thws)
    act = W.policy.act
    x_NDv = tower(W, v, patches_N3PP.to(device=W.device, dtype=act), grids, taps)
    m_MKDv = merge(x_NDv, grids, tuple(v.merge_kernel_size))  # (V4)
    _record(taps, vision_tap("merger"), m_MKDv)
    e_MD = project(m_MKDv, W.vision_tensor("proj.fc1"), W.vision_tensor("proj.fc2"),
                   W.vision_tensor("proj.post_norm"), v.projector_ln_eps)  # (V5)
    _record(taps, vision_tap("projector"), e_MD)
    return e_MD


__all__ = ["encode_images", "tower", "block", "rope_angles", "rope2d", "attention", "position", "pos_grid",
           "time_term", "patch_embed", "check_config", "check_grids", "VIT_EPS"]
