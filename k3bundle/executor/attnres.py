"""Block Attention Residuals: the residual stream of Kimi K3 (docs/kimi-k3.md §3.2, A1-A2).

There is no ``x + sublayer(x)`` anywhere. Each layer mixes, over depth, a list of candidate
hidden states: the token embedding, the sums of finished blocks and the running partial sum
of the current block. AttnRes runs twice per layer (before the mixer, before the FFN) and
once at the output (``output_attn_res_*``, no fused norm).

(A1) for candidates V = [v_1 … v_n], in FP32:
     key_i = v_i · rsqrt(mean(v_i²) + ε);  s_i = Σ_c key_i[c]·w[c]·q[c];  p = softmax_i(s);
     AttnRes(V) = Σ_i p_i · v_i   (raw, un-normalised values), cast back to the activation dtype.
(A2) B = [], S = h⁰; per layer ℓ: x = AttnRes(B ++ [S]) if B else S; if ℓ mod block == 0:
     B.append(S) (the layer "opens" a block); S = a if opening else S + a after the mixer;
     y = AttnRes(B ++ [S]); S = S + f after the FFN. Output: h_final = AttnRes_out(B ++ [S]).

The partial sum S and the stored blocks stay in the activation dtype (BF16 in the bfloat16
policy, like a serving engine's residual buffers); only the mixing is FP32.

Legend: N candidates, T tokens, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3bundle.executor.norms import compute_dtype, rms_normalise


def attn_res(cands: list[torch.Tensor], w_D: torch.Tensor, q_1D: torch.Tensor, eps: float) -> torch.Tensor:
    """(A1) depth-softmax mixing of raw candidate values; returns the activation dtype."""
    act = cands[0].dtype
    c = compute_dtype(cands[0])
    # A1 is specified in FP32 end to end (keys, scores, softmax and the weighted sum)
    v_NTD, w_D, q_D = torch.stack(cands).to(c), w_D.to(c), q_1D[0].to(c)
    key_NTD = rms_normalise(v_NTD, eps)  # (A1) key_i = v_i · rsqrt(mean(v_i²) + ε)
    s_NT = (key_NTD * (w_D * q_D)).sum(-1)  # (A1) s_i = Σ_c key_i[c]·w[c]·q[c]
    p_NT = torch.softmax(s_NT, dim=0)  # (A1) softmax over candidates (depth)
    h_TD = (p_NT[..., None] * v_NTD).sum(0)  # (A1) Σ_i p_i · v_i, raw values
    # cast back: the mixer / FFN input lives in the activation dtype
    return h_TD.to(act)


class BlockResidual:
    """(A2) state for one forward pass over T tokens: stored blocks B and partial sum S."""

    def __init__(self, h0_TD: torch.Tensor, block_size: int, eps: float):
        self.blocks: list[torch.Tensor] = []  # B
        self.partial = h0_TD  # S = h⁰
        self.block_size = block_size
        self.eps = eps
        self.opening = False
        self.candidates: list[tuple[int, str, int]] = []  # (layer, site, n) for schedule checks

    def _mix(self, layer: int, site: str, w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        cands = self.blocks + [self.partial]
        self.candidates.append((layer, site, len(cands)))
        return attn_res(cands, w, q, self.eps)

    def mixer_input(self, layer: int, w_D: torch.Tensor, q_1D: torch.Tensor) -> torch.Tensor:
        """A2 steps 1-2; layer 0 (B empty) takes S itself, so its attn_res pair is unused."""
        x = self._mix(layer, "mixer", w_D, q_1D) if self.blocks else self.partial  # (A2.1)
        self.opening = layer % self.block_size == 0  # (A2.2) block opens at ℓ mod size == 0
        if self.opening:
            self.blocks.append(self.partial)  # (A2.2) the finished block (or h⁰) is stored
        return x

    def add_mixer(self, a_TD: torch.Tensor) -> None:
        self.partial = a_TD if self.opening else self.partial + a_TD  # (A2.4)

    def ffn_input(self, layer: int, w_D: torch.Tensor, q_1D: torch.Tensor) -> torch.Tensor:
        return self._mix(layer, "ffn", w_D, q_1D)  # (A2.5)

    def add_ffn(self, f_TD: torch.Tensor) -> None:
        self.partial = self.partial + f_TD  # (A2.7)

    def output(self, w_D: torch.Tensor, q_1D: torch.Tensor) -> torch.Tensor:
        return self._mix(-1, "output", w_D, q_1D)  # h_final = AttnRes_out(B ++ [S])


@dataclass(frozen=True)
class Schedule:
    """Candidate counts of the AttnRes sites for a layer count and block size."""

    mixer: list[int]  # per layer; 1 means "no mixing" (layer 0 reads S directly)
    ffn: list[int]
    stored_blocks: int  # |B| after the last layer
    output: int  # candidates of the output site

    @property
    def openings(self) -> list[int]:
        return [l for l in range(len(self.ffn)) if l == 0 or self.ffn[l] > self.ffn[l - 1]]


def schedule(num_layers: int, block_size: int) -> Schedule:
    """Run the real ``BlockResidual`` on 1-wide dummy tensors to read off the schedule."""
    one = torch.ones(1, 1)
    r = BlockResidual(one, block_size, eps=1e-5)
    for layer in range(num_layers):
        r.mixer_input(layer, one[0], one)
        r.add_mixer(one)
        r.ffn_input(layer, one[0], one)
        r.add_ffn(one)
    r.output(one[0], one)
    mixer = {l: n for l, s, n in r.candidates if s == "mixer"}
    ffn = [n for _, s, n in r.candidates if s == "ffn"]
    return Schedule([mixer.get(l, 1) for l in range(num_layers)], ffn, len(r.blocks),
                    r.candidates[-1][2])
