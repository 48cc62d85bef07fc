"""A third-party backend as a user writes one: a module with one op, its own code (the other
ops fall back to the reference). The signature is docs/kernels.md's contract of the op."""

import torch

NAME = "one-op example"


def gated_mla_prefill(q, k, v, gate, *, offset, scale):
    """q [T, H, Q], k [S, H, Q], v [S, H, V], gate [T, H·V] (all act) -> y [T, H·V] act:
    causal softmax attention (query t at position offset + t sees keys 0..offset+t), then
    ⊙ sigmoid(gate). Computed in float32 (float64 for float64 inputs), rounded once."""
    T, S = q.shape[0], k.shape[0]
    c = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("the,she->hts", q.to(c), k.to(c)) * scale  # [H, T, S]
    visible = torch.arange(S, device=q.device)[None, :] <= torch.arange(T, device=q.device)[:, None] + offset
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    o = torch.einsum("hts,shv->thv", probs, v.to(c)).reshape(T, -1)  # [T, H·V]
    return (o * torch.sigmoid(gate.to(c))).to(q.dtype)
