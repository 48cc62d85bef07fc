"""Per-sequence state carried between executor calls (docs/kimi-k3.md §3.3 K1/K5, §3.4, §5.3).

- KDA layer: recurrent state S [H, dk, dv] (FP32; FP64 in the float64 policy), zero at the
  start of a sequence, read as S_tᵀ q (K5); conv state = the last (kernel - 1) = 3 *pre-conv*
  inputs of q, k and v (K1), in the activation dtype (BF16 in serving, docs/kimi-k3.md §5.3).
- MLA layer: the latent cache, per token [ĉ_kv (kv_lora) ‖ k_pe (rope)] = 512 + 64 values in
  the activation dtype (M2/M3; the absorbed decode form reads only this).
- AttnRes keeps no state across tokens: its blocks run over depth, within one token.

``ModelCache.clone()`` is a snapshot: prefill can return clones taken at chunk boundaries,
and restoring one and continuing gives the uninterrupted run (tests/test_executor_model.py).

Legend: H heads, K key dim (dk), V value dim (dv), W conv window (kernel - 1),
P = H·dk channels, C latent width (kv_lora + rope), S cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3bundle.config import TextConfig


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class KDAState:
    recurrent_HKV: torch.Tensor  # (K5) S, key channels on rows
    conv_3WP: torch.Tensor  # (K1) last W pre-conv inputs of q, k, v (in that order)

    @classmethod
    def zeros(cls, heads: int, dk: int, dv: int, kernel: int, state_dtype, act_dtype, device) -> "KDAState":
        return cls(torch.zeros(heads, dk, dv, dtype=state_dtype, device=device),
                   torch.zeros(3, kernel - 1, heads * dk, dtype=act_dtype, device=device))

    def clone(self) -> "KDAState":
        return KDAState(self.recurrent_HKV.clone(), self.conv_3WP.clone())

    @property
    def nbytes(self) -> int:
        return _nbytes(self.recurrent_HKV) + _nbytes(self.conv_3WP)


@dataclass
class MLAState:
    """Latent cache with amortised growth; ``latent_SC`` is the filled part."""

    buffer_SC: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, width: int, dtype, device, capacity: int = 64) -> "MLAState":
        return cls(torch.zeros(capacity, width, dtype=dtype, device=device), 0)

    @property
    def latent_SC(self) -> torch.Tensor:
        return self.buffer_SC[: self.length]

    def append(self, new_TC: torch.Tensor) -> torch.Tensor:
        """Append rows; returns the whole filled cache [S, C]."""
        need = self.length + new_TC.shape[0]
        if need > self.buffer_SC.shape[0]:
            grown = torch.zeros(max(need, 2 * self.buffer_SC.shape[0]), self.buffer_SC.shape[1],
                                dtype=self.buffer_SC.dtype, device=self.buffer_SC.device)
            grown[: self.length] = self.latent_SC
            self.buffer_SC = grown
        self.buffer_SC[self.length: need] = new_TC.to(self.buffer_SC.dtype)
        self.length = need
        return self.latent_SC

    def truncated(self, length: int) -> "MLAState":
        return MLAState(self.buffer_SC[:length].clone(), length)

    def clone(self) -> "MLAState":
        return self.truncated(self.length)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.latent_SC)


@dataclass
class ModelCache:
    """All layers' state for one sequence; ``length`` tokens consumed so far."""

    layers: list[KDAState | MLAState]
    length: int = 0
    snapshots: dict[int, "ModelCache"] = field(default_factory=dict, repr=False)

    def clone(self) -> "ModelCache":
        return ModelCache([s.clone() for s in self.layers], self.length)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


def new_cache(text: TextConfig, act_dtype, state_dtype, device, kda_heads: int | None = None) -> ModelCache:
    """Empty state; ``kda_heads`` is the number of KDA heads this process holds (a TP rank's share)."""
    la = text.linear_attn_config
    width = text.kv_lora_rank + text.qk_rope_head_dim
    heads = la.num_heads if kda_heads is None else kda_heads
    layers = [MLAState.empty(width, act_dtype, device) if text.is_mla(l) else
              KDAState.zeros(heads, la.head_dim, la.head_dim, la.short_conv_kernel_size,
                             state_dtype, act_dtype, device)
              for l in range(text.num_hidden_layers)]
    return ModelCache(layers, 0)


@dataclass(frozen=True)
class CacheBytes:
    """Bytes of state per request / per token, from the config alone (docs/kimi-k3.md §5.3)."""

    kda_recurrent_per_layer: int
    kda_conv_per_layer: int
    kda_layers: int
    mla_latent_per_token_per_layer: int
    mla_layers: int

    @property
    def kda_per_request(self) -> int:
        return self.kda_layers * (self.kda_recurrent_per_layer + self.kda_conv_per_layer)

    @property
    def mla_per_token(self) -> int:
        return self.mla_layers * self.mla_latent_per_token_per_layer


def cache_bytes(text: TextConfig, act_bytes: int = 2, state_bytes: int = 4) -> CacheBytes:
    """Defaults: BF16 conv state and latent cache, FP32 recurrent state (vLLM, docs/kimi-k3.md §5.3)."""
    la = text.linear_attn_config
    return CacheBytes(
        kda_recurrent_per_layer=la.num_heads * la.head_dim * la.head_dim * state_bytes,
        kda_conv_per_layer=3 * (la.short_conv_kernel_size - 1) * la.num_heads * la.head_dim * act_bytes,
        kda_layers=len(text.kda_layers),
        mla_latent_per_token_per_layer=(text.kv_lora_rank + text.qk_rope_head_dim) * act_bytes,
        mla_layers=len(text.mla_layers),
    )


def cache_arrays(c: ModelCache) -> list[tuple[str, torch.Tensor]]:
    """Every layer's cache arrays by name: a KDA layer's recurrent and conv states, an MLA layer's latent."""
    out = []
    for l, s in enumerate(c.layers):
        if isinstance(s, KDAState):
            out += [(f"layers.{l}.kda_state", s.recurrent_HKV), (f"layers.{l}.kda_conv", s.conv_3WP)]
        else:
            out.append((f"layers.{l}.mla_latent", s.latent_SC))
    return out
