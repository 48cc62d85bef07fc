"""The Kimi K3 text model, layer by layer (spec/kimi-k3.md §3.1-§3.8).

    ids ─ E0 embed ─ h⁰ ─┬─ for ℓ in 0..L−1 ───────────────────────────────────────────┐
                         │  x = AttnRes_attn(B ++ [S])   (A2.1; layer 0: x = S)          │
                         │  a = KDA | MLA ( RMSNorm_in(x) )   (K1-K7 | M1-M5)            │
                         │  S = a | S + a                 (A2.2-4, block opening)        │
                         │  y = AttnRes_mlp(B ++ [S])     (A2.5)                         │
                         │  f = Dense | LatentMoE ( RMSNorm_post(y) )   (D1 | R1-R7)     │
                         │  S = S + f                     (A2.7)                         │
                         └─ h_final = AttnRes_out(B ++ [S]) ─ F1 norm + lm_head ─ logits ┘

Each layer's weights are asked from the ``WeightSource`` when the loop reaches it and dropped
before the next layer is read, so peak memory is one layer plus activations [T, D] × (blocks
+ 2) (design.md "Executor"). The loop runs all T tokens of a call through one layer before the
next: prefill uses the chunked KDA form and the naive MLA form, decode (T = 1) the KDA
recurrence and the absorbed MLA form on the latent cache.

Stateful API: ``prefill(ids, cache=None, snapshot_at=())`` → (logits [T, V], cache);
``decode(token, cache)`` → logits [V]. ``snapshot_at`` takes absolute positions on the
prefill's chunk grid; ``cache.snapshots[p]`` is then the whole cache after p tokens (KDA
states at that chunk boundary, MLA latents truncated), and prefilling the rest from a clone
of it reproduces the uninterrupted run.

Legend: T tokens, D model width, V vocabulary, K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3bundle.executor import head, kda, latent_moe, mla, situ_glu
from k3bundle.executor.attnres import BlockResidual
from k3bundle.executor.cache import ModelCache, new_cache
from k3bundle.executor.norms import rms_norm
from k3bundle.executor.taps import TapRecorder
from k3bundle.executor.weights import ExecutorError, WeightSource


@dataclass
class Generation:
    prefill_logits: torch.Tensor  # [T, V]
    tokens: list[int]  # greedy continuation, one per step
    step_logits: torch.Tensor  # [steps, V]: logits that chose each token (row 0 = prefill's last)
    cache: ModelCache


class Executor:
    """Runs the model over a ``WeightSource``; optional ``TapRecorder`` for intermediates."""

    def __init__(self, weights: WeightSource, taps: TapRecorder | None = None, chunk: int = kda.CHUNK,
                 forced_routes: dict[str, torch.Tensor] | None = None):
        self.w = weights
        self.text = weights.config.text
        self.taps = taps
        self.chunk = chunk
        # {"layers.{l}.router_ids": ids [positions, K] from position 0}: replay a reference's
        # expert choice (teacher-forced routing) so near-tie flips drop out of a comparison
        self.forced_routes = forced_routes or {}

    def new_cache(self) -> ModelCache:
        p = self.w.policy
        return new_cache(self.text, p.act, p.state, self.w.device, getattr(self.w, "kda_heads", None))

    # ---- public API ----
    def prefill(self, ids: Sequence[int] | torch.Tensor, cache: ModelCache | None = None,
                snapshot_at: Sequence[int] = ()) -> tuple[torch.Tensor, ModelCache]:
        cache = self.new_cache() if cache is None else cache
        ids_T = self._check_ids(ids)
        rel = self._boundaries(snapshot_at, cache.length, ids_T.shape[0])
        return self._forward(ids_T, cache, decode=False, boundaries=rel), cache

    def decode(self, token: int, cache: ModelCache) -> torch.Tensor:
        return self._forward(self._check_ids([token]), cache, decode=True, boundaries=())[0]

    def generate(self, ids: Sequence[int], steps: int) -> Generation:
        """Greedy: prefill, then ``steps`` tokens (each chosen by argmax, then decoded)."""
        logits_TV, cache = self.prefill(ids)
        tokens, rows = [], [logits_TV[-1]]
        for i in range(steps):
            tokens.append(int(torch.argmax(rows[-1])))
            if i + 1 < steps:
                rows.append(self.decode(tokens[-1], cache))
        step_logits = torch.stack(rows[:steps]) if steps else logits_TV[:0]
        return Generation(logits_TV, tokens, step_logits, cache)

    # ---- checks ----
    def _check_ids(self, ids) -> torch.Tensor:
        ids_T = torch.as_tensor(ids).reshape(-1)
        if ids_T.numel() == 0:
            raise ExecutorError("no token ids given")
        if ids_T.dtype.is_floating_point or ids_T.dtype == torch.bool:
            raise ExecutorError(f"token ids must be integers, got {ids_T.dtype}")
        bad = ((ids_T < 0) | (ids_T >= self.text.vocab_size)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ExecutorError(f"token id {int(ids_T[i])} at index {i} is out of range "
                                f"0..{self.text.vocab_size - 1} (vocab_size {self.text.vocab_size})")
        return ids_T.to(torch.long)

    def _boundaries(self, positions: Sequence[int], start: int, T: int) -> list[int]:
        rel = []
        for p in positions:
            n = int(p) - start
            if not 0 < n <= T or (n % self.chunk and n != T):
                raise ExecutorError(f"snapshot position {p} is not a chunk boundary of this prefill "
                                    f"(tokens {start}..{start + T}, chunk {self.chunk})")
            rel.append(n)
        return rel

    def _tap(self, name: str, value: torch.Tensor, start: int) -> None:
        if self.taps is not None:
            self.taps.record(name, value, start)

    def _tap_state(self, name: str, value: torch.Tensor) -> None:
        if self.taps is not None:
            self.taps.record_state(name, value)

    # ---- the layer loop ----
    def _forward(self, ids_T: torch.Tensor, cache: ModelCache, decode: bool, boundaries: list[int]):
        t, start, eps = self.text, cache.length, self.text.rms_norm_eps
        h0_TD = head.embed(ids_T, self.w)  # (E0)
        self._tap("embed", h0_TD, start)
        stream = BlockResidual(h0_TD, t.attn_res_block_size, eps)  # (A2) B = [], S = h⁰
        snaps = {n: [None] * t.num_hidden_layers for n in boundaries}
        for l in range(t.num_hidden_layers):
            W = self.w.layer(l, decode=decode)  # this layer's weights: read now, dropped below
            x_TD = stream.mixer_input(l, W["attn_res.norm"], W["attn_res.proj"])  # (A2.1-2)
            self._tap(f"layers.{l}.attn_res_out", x_TD, start)
            n_TD = rms_norm(x_TD, W["input_norm"], eps)
            state = cache.layers[l]
            if t.is_mla(l):
                a_TD, _ = mla.forward(n_TD, W, state, t, absorbed=decode)  # (M1-M5)
                for n in boundaries:
                    snaps[n][l] = state.truncated(start + n)
                self._tap_state(f"layers.{l}.mla_latent", state.latent_SC)
            else:
                a_TD, new_state, at = kda.forward(n_TD, W, state, t, decode, self.chunk, boundaries)  # (K1-K7)
                cache.layers[l] = new_state
                for n, s in at.items():
                    snaps[n][l] = s
                self._tap_state(f"layers.{l}.kda_state", new_state.recurrent_HKV)
                self._tap_state(f"layers.{l}.kda_conv", new_state.conv_3WP)
            self._tap(f"layers.{l}.mixer_out", a_TD, start)
            stream.add_mixer(a_TD)  # (A2.4)
            y_TD = stream.ffn_input(l, W["ffn_res.norm"], W["ffn_res.proj"])  # (A2.5)
            self._tap(f"layers.{l}.ffn_res_out", y_TD, start)
            m_TD = rms_norm(y_TD, W["post_attn_norm"], eps)
            if t.is_moe(l):
                forced = self.forced_routes.get(f"layers.{l}.router_ids")
                forced = None if forced is None else forced[start:start + ids_T.shape[0]]
                f_TD, ids_TK, w_TK, margin_T = latent_moe.forward(m_TD, W, t, forced)  # (R1-R7)
                self._tap(f"layers.{l}.router_ids", ids_TK, start)
                self._tap(f"layers.{l}.router_weights", w_TK, start)
                self._tap(f"layers.{l}.router_margin", margin_T, start)
            else:
                f_TD = situ_glu.dense(m_TD, W, t)  # (D1)
            self._tap(f"layers.{l}.ffn_out", f_TD, start)
            stream.add_ffn(f_TD)  # (A2.7)
            del W, x_TD, n_TD, a_TD, y_TD, m_TD, f_TD  # free the layer before reading the next
        g = self.w.global_tensor
        h_TD = stream.output(g("out_res.norm"), g("out_res.proj"))  # h_final = AttnRes_out(B ++ [S])
        self._tap("final_hidden", h_TD, start)
        logits_TV = self.w.gather_vocab(head.logits(h_TD, g("final_norm"), g("lm_head"), eps))  # (F1)
        self._tap("logits", logits_TV, start)
        cache.length = start + ids_T.shape[0]
        for n, layers in snaps.items():
            cache.snapshots[start + n] = ModelCache(layers, start + n)
        return logits_TV
