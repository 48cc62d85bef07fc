"""Taps: named intermediates recorded at chosen token positions.

Tap names are a **stable contract**: goldens, device dumps and the comparator key on them
(docs/executor.md lists them). ``{l}`` is the 0-based decoder layer.

Per-position taps (one row per recorded position, leading axis = position):

| name | value | shape |
|---|---|---|
| ``embed`` | h⁰, the token embedding (E0) | [D] |
| ``layers.{l}.attn_res_out`` | AttnRes output before the mixer, x of A2 step 1 (pre input_layernorm) | [D] |
| ``layers.{l}.mixer_out`` | the KDA / MLA output a (K7 / M5) | [D] |
| ``layers.{l}.ffn_res_out`` | AttnRes output before the FFN, y of A2 step 5 (pre post_attention_layernorm) | [D] |
| ``layers.{l}.router_ids`` | selected experts, torch.topk order (R2); MoE layers | [K] int64 |
| ``layers.{l}.router_weights`` | their renormalised weights (R3), compute dtype | [K] |
| ``layers.{l}.router_margin`` | biased score of the k-th minus the (k+1)-th expert (R2): near-tie measure | [] |
| ``layers.{l}.ffn_out`` | the FFN output f (D1 / R7) | [D] |
| ``final_hidden`` | h_final, the output AttnRes (before the final norm) | [D] |
| ``logits`` | F1, compute dtype | [V] |

State taps (the value after the last call that touched the layer; no position axis):

| name | value | shape |
|---|---|---|
| ``layers.{l}.kda_state`` | recurrent state S (K5), key channels on rows | [H, dk, dv] |
| ``layers.{l}.kda_conv`` | conv state, last 3 pre-conv inputs of q, k, v (K1) | [3, 3, P] |
| ``layers.{l}.mla_latent`` | latent cache [ĉ_kv ‖ k_pe] (M2/M3) | [S, kv_lora + rope] |

Values are detached CPU copies in the dtype they had (bf16 taps stay bf16; ``numpy()``
upcasts them to float32 because numpy has no bfloat16).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import numpy as np
import torch

PER_POSITION = ("embed", "layers.{l}.attn_res_out", "layers.{l}.mixer_out", "layers.{l}.ffn_res_out",
                "layers.{l}.router_ids", "layers.{l}.router_weights", "layers.{l}.router_margin",
                "layers.{l}.ffn_out",
                "final_hidden", "logits")
STATES = ("layers.{l}.kda_state", "layers.{l}.kda_conv", "layers.{l}.mla_latent")


def tap_names(num_layers: int, is_mla, is_moe) -> list[str]:
    """Every tap name a model of this shape can produce, in forward order."""
    names = ["embed"]
    for l in range(num_layers):
        names += [f"layers.{l}.attn_res_out", f"layers.{l}.mixer_out", f"layers.{l}.ffn_res_out"]
        if is_moe(l):
            names += [f"layers.{l}.router_ids", f"layers.{l}.router_weights", f"layers.{l}.router_margin"]
        names.append(f"layers.{l}.ffn_out")
        names += [f"layers.{l}.mla_latent"] if is_mla(l) else [f"layers.{l}.kda_state", f"layers.{l}.kda_conv"]
    return names + ["final_hidden", "logits"]


class TapRecorder:
    """Records the taps whose name matches one of ``names`` (fnmatch patterns; None = all)
    at absolute token positions ``positions`` (None = every position)."""

    def __init__(self, names: Iterable[str] | None = None, positions: Iterable[int] | None = None):
        self.patterns = None if names is None else list(names)
        self.positions = None if positions is None else set(int(p) for p in positions)
        self._rows: dict[str, dict[int, torch.Tensor]] = {}
        self._states: dict[str, torch.Tensor] = {}

    def wants(self, name: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def record(self, name: str, value: torch.Tensor, start: int) -> None:
        """``value`` has one row per token, tokens at positions start, start+1, ..."""
        if not self.wants(name):
            return
        rows = self._rows.setdefault(name, {})
        for i in range(value.shape[0]):
            if self.positions is None or start + i in self.positions:
                rows[start + i] = value[i].detach().to("cpu", copy=True)

    def record_state(self, name: str, value: torch.Tensor) -> None:
        if self.wants(name):
            self._states[name] = value.detach().to("cpu", copy=True)

    # ---- reading ----
    def names(self) -> list[str]:
        return list(self._rows) + list(self._states)

    def positions_of(self, name: str) -> list[int]:
        return sorted(self._rows[name])

    def __contains__(self, name: str) -> bool:
        return name in self._rows or name in self._states

    def __getitem__(self, name: str) -> torch.Tensor:
        """Per-position taps stacked in position order [P, ...]; state taps as recorded."""
        if name in self._states:
            return self._states[name]
        rows = self._rows[name]
        return torch.stack([rows[p] for p in sorted(rows)])

    def numpy(self) -> dict[str, np.ndarray]:
        """{name: array} plus ``positions`` (numpy has no bfloat16: those become float32)."""
        out = {}
        for name in self.names():
            t = self[name]
            out[name] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        some = next(iter(self._rows), None)
        if some is not None:
            out["positions"] = np.asarray(self.positions_of(some), dtype=np.int64)
        return out
