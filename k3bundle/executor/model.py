"""The Kimi K3 text model, layer by layer (docs/kimi-k3.md §3.1-§3.8).

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

This file holds the only single-request layer loop (``_forward``) and layer step (``layer``);
``batching`` runs the same steps for many requests on a padded grid. Everything that runs
the model goes through them: ``prefill``/``decode``/``decode_steps`` (stateful serving-style calls), ``teacher_forced`` (every layer fed golden inputs, so each
layer's output carries only the error it adds), and ``k3bundle.executor.case.run_case`` (one
golden case: prefill with taps and snapshots, then greedy or teacher-forced decode), which
``golden``, ``validate`` (in-process and every distributed rank) and ``run`` share.

Stateful API: ``prefill(ids, cache=None, snapshot_at=())`` → (logits [T, V], cache);
``decode(token, cache)`` → logits [V]. ``snapshot_at`` takes absolute positions on the
prefill's chunk grid; ``cache.snapshots[p]`` is then the whole cache after p tokens (KDA
states at that chunk boundary, MLA latents truncated), and prefilling the rest from a clone
of it reproduces the uninterrupted run.

Legend: T tokens, D model width, V vocabulary, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k3bundle.executor import head, kda, latent_moe, mla, situ_glu
from k3bundle.executor.attnres import BlockResidual
from k3bundle.executor.cache import ModelCache, new_cache
from k3bundle.executor.errors import ExecutorError
from k3bundle.executor.norms import rms_norm
from k3bundle.executor.taps import TapRecorder
from k3bundle.executor.weights import WeightSource
from k3bundle.ops.contract import REFERENCE, Backend

#: the executor's two forms of the same equations: batched for speed, as written for reading
FORMS = ("fast", "readable")

#: teacher forcing: full-sequence tap by name ([T, ...]), or None where the feed has none
Feed = Callable[[str], "torch.Tensor | None"]


def _row(v, i: int):
    """Row i of a fed [steps, ...] tap, kept as [1, ...] (one decode token), or None."""
    return None if v is None else torch.as_tensor(v)[i:i + 1]


@dataclass
class Generation:
    prefill_logits: torch.Tensor  # [T, V]
    tokens: list[int]  # greedy continuation, one per step
    step_logits: torch.Tensor  # [steps, V]: logits that chose each token (row 0 = prefill's last)
    cache: ModelCache


@dataclass(slots=True)
class LayerOut:
    """What one decoder layer produced (the per-position taps of ``taps.TAPS``)."""

    attn_res_out: torch.Tensor  # x (A2.1)
    mixer_out: torch.Tensor  # a (K7 / M5)
    ffn_res_out: torch.Tensor  # y (A2.5)
    ffn_out: torch.Tensor  # f (D1 / R7)
    route: latent_moe.Route | None  # MoE layers
    snapshots: dict  # {tokens n: this layer's state after n tokens} at requested chunk boundaries


class Executor:
    """Runs the model over a ``WeightSource``; optional ``TapRecorder``(s) for intermediates."""

    def __init__(self, weights: WeightSource, taps: TapRecorder | Sequence[TapRecorder] | None = None,
                 chunk: int = kda.CHUNK, forced_routes: dict[str, torch.Tensor] | None = None,
                 ops: Backend | None = None, forms: str = "fast", all_logits: bool = True):
        if forms not in FORMS:
            raise ExecutorError(f"forms must be one of {', '.join(FORMS)}, not {forms!r}")
        self.w = weights
        # "fast": the batched exact forms (kda.chunked_batched, latent_moe.routed_grouped);
        # "readable": the equations as written. Same function; docs/executor.md "Forms".
        self.forms = forms
        # False: a prefill's logits only at the rows a recorder taps and the last one (what
        # greedy decode reads): a 131,072-token prompt's full logits would be 86 GB in FP32
        self.all_logits = all_logits
        # the device's kernels: given, else the weight source's (``WeightSource.backend``), else the reference
        self.ops = ops or getattr(weights, "backend", None) or REFERENCE
        self.text = weights.config.text
        self.recorders = [] if taps is None else [taps] if isinstance(taps, TapRecorder) else list(taps)
        self.chunk = chunk
        # {"layers.{l}.router_ids": ids [positions, K] from position 0}: replay a reference's
        # expert choice (teacher-forced routing) so near-tie flips drop out of a comparison
        self.forced_routes = forced_routes or {}

    def new_cache(self) -> ModelCache:
        p = self.w.policy
        return new_cache(self.text, p.act, p.state, self.w.device, getattr(self.w, "kda_heads", None))

    # ---- public API ----
    def prefill(self, ids: Sequence[int] | torch.Tensor, cache: ModelCache | None = None,
                snapshot_at: Sequence[int] = (), media: torch.Tensor | None = None) -> tuple[torch.Tensor, ModelCache]:
        return drive(self.prefill_steps(ids, cache, snapshot_at, media), self.w)

    def prefill_steps(self, ids, cache: ModelCache | None = None, snapshot_at: Sequence[int] = (),
                      media: torch.Tensor | None = None):
        """``prefill`` as a generator that yields (layer, decode) for each layer's weights and is
        sent them (``drive`` / ``drive_lockstep`` run it). ``media``: the images' rows [M, D]
        (``vision.encode_images``) for the prompt's M ``<|media_pad|>`` positions (E0)."""
        cache = self.new_cache() if cache is None else cache
        ids_T = self._check_ids(ids)
        rel = self._boundaries(snapshot_at, cache.length, ids_T.shape[0])
        return (yield from self._forward_steps(ids_T, cache, decode=False, boundaries=rel, media=media)), cache

    def decode(self, token: int, cache: ModelCache) -> torch.Tensor:
        return self._forward(self._check_ids([token]), cache, decode=True, boundaries=())[0]

    def decode_steps(self, last_TV: torch.Tensor, cache: ModelCache, steps: int,
                     tokens: Sequence[int] | None = None,
                     after_step: Callable[[ModelCache], None] | None = None) -> tuple[list[int], torch.Tensor]:
        """The only decode loop: ``steps`` tokens after a prefill whose logits end in ``last_TV``.

        Step i's choice is the argmax of the logits before it (row 0 = the prefill's last row).
        Greedy (``tokens`` None) decodes each choice; teacher-forced decodes ``tokens[i]``
        instead, so the steps stay comparable with a reference after a divergence.
        ``after_step(cache)`` runs after each decode. Returns (choices, step logits [steps, V]).
        """
        return drive(self.decode_loop_steps(last_TV, cache, steps, tokens, after_step), self.w)

    def decode_loop_steps(self, last_TV, cache, steps, tokens=None, after_step=None):
        """``decode_steps`` as a generator of layer requests (see ``prefill_steps``)."""
        rows, chosen = [last_TV[-1]], []
        for i in range(steps):
            chosen.append(int(torch.argmax(rows[-1])))
            if i + 1 < steps:
                token = chosen[-1] if tokens is None else int(tokens[i])
                logits = yield from self._forward_steps(self._check_ids([token]), cache, decode=True, boundaries=())
                rows.append(logits[0])
                if after_step is not None:
                    after_step(cache)
        return chosen, (torch.stack(rows[:steps]) if steps else last_TV[:0])

    def generate(self, ids: Sequence[int], steps: int) -> Generation:
        """Greedy: prefill, then ``steps`` tokens (each chosen by argmax, then decoded)."""
        logits_TV, cache = self.prefill(ids)
        tokens, step_logits = self.decode_steps(logits_TV, cache, steps)
        return Generation(logits_TV, tokens, step_logits, cache)

    def teacher_forced(self, feed: Feed, decode: bool = False,
                       after_step: Callable[[int, ModelCache], None] | None = None,
                       rows: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """``teacher_forced_steps`` run to its end on this executor's weights."""
        return drive(self.teacher_forced_steps(feed, decode, after_step, rows), self.w)

    def teacher_forced_steps(self, feed: Feed, decode: bool = False,
                             after_step: Callable[[int, ModelCache], None] | None = None,
                             rows: Sequence[int] | None = None):
        """Every layer's outputs computed on ``feed``'s inputs (one prefill, fresh cache), as a
        generator of layer requests (``drive``; ``drive_lockstep`` shares each layer's read with
        other runs).

        ``feed(name)`` returns a full-sequence tap ([T, ...], every position) or None. The
        stream starts from the fed ``embed``; each layer reads the fed AttnRes outputs where
        given (else recomputes them from the fed stream: a dump needs only mixer and FFN
        outputs), replays the fed expert ids, and continues from the fed mixer and FFN outputs,
        never its own, so errors do not carry over. Keys are tap names (layer 0's AttnRes
        output is the embedding itself and is left out); ``own.layers.{l}.router_ids`` is the
        layer's own, unforced expert choice and ``noise.layers.{l}.router_margin`` how far its
        selection margin can move from the rounding of its input (``latent_moe.margin_noise``).

        ``decode``: then continue with one decode step per row of the fed ``decode.embed``, each
        fed row i of the ``decode.…`` taps, on the cache the fed prefill built; the outputs are
        named ``decode.…`` (``own.decode.…``). So the decode path — the KDA recurrence, the
        absorbed MLA form, and the cache between steps (``after_step(i, cache)`` after step i,
        as in ``case.run_case``) — is judged layer by layer too. Values are CPU tensors.

        ``rows``: keep only these prompt rows of every output (the positions a long case's
        goldens tap), logits computed for them alone: every layer still runs on every position,
        but what is kept does not grow with the prompt (decode steps are kept whole).
        """
        out: dict[str, torch.Tensor] = {}
        cache = self.new_cache()
        yield from self._forward_steps(None, cache, decode=False, boundaries=[], feed=feed, collect=out, rows=rows)
        steps = feed("decode.embed") if decode else None
        per_step: dict[str, list[torch.Tensor]] = {}
        for i in range(0 if steps is None else len(steps)):
            row = lambda n, i=i: _row(feed("decode." + n), i)  # noqa: E731
            step: dict[str, torch.Tensor] = {}
            yield from self._forward_steps(None, cache, decode=True, boundaries=[], feed=row, collect=step)
            if after_step is not None:
                after_step(i, cache)
            for k, v in step.items():  # layers.… -> decode.layers.…, own.layers.… -> own.decode.layers.…
                name = k.replace("layers.", "decode.layers.", 1) if k.startswith(("own.", "noise.")) else "decode." + k
                per_step.setdefault(name, []).append(v)
        out.update({k: torch.cat(v) for k, v in per_step.items()})
        return {k: v.detach().cpu() for k, v in out.items()}

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

    def _logit_rows(self, start: int, T: int) -> list[int] | None:
        """Rows of this forward whose logits anyone reads (None: all of them)."""
        if self.all_logits or T == 1:
            return None
        wanted = set()
        for r in self.recorders:
            if r.wants("logits"):
                if r.positions is None:
                    return None
                wanted |= {p - start for p in r.positions if start <= p < start + T}
        return sorted(wanted - {T - 1}) + [T - 1]

    def _tap(self, name: str, value: torch.Tensor, start: int) -> None:
        for r in self.recorders:
            r.record(name, value, start)

    def _tap_state(self, name: str, value: torch.Tensor) -> None:
        for r in self.recorders:
            r.record_state(name, value)

    def _fed(self, feed: Feed | None, name: str, own: torch.Tensor | None, cast: bool = True):
        """Teacher forcing: the fed value of ``name`` (on this device, activation dtype) or ``own``."""
        v = None if feed is None else feed(name)
        if v is None:
            return own
        v = torch.as_tensor(v).to(self.w.device)
        return v.to(self.w.policy.act) if cast else v

    # ---- one decoder layer ----
    def layer(self, l: int, W, stream: BlockResidual, cache: ModelCache, start: int, decode: bool = False,
              boundaries: Sequence[int] = (), feed: Feed | None = None) -> LayerOut:
        """Layer ``l`` (A2.1-A2.7) on the residual ``stream`` for the T tokens after ``start``;
        updates ``cache.layers[l]``. With ``feed``, see ``teacher_forced``."""
        t, eps = self.text, self.text.rms_norm_eps
        fed = lambda kind, own, cast=True: self._fed(feed, f"layers.{l}.{kind}", own, cast)  # noqa: E731
        x_TD = stream.mixer_input(l, W["attn_res.norm"], W["attn_res.proj"])  # (A2.1-2)
        n_TD = rms_norm(fed("attn_res_out", x_TD), W["input_norm"], eps)
        state, ops = cache.layers[l], self.ops.for_layer(l)
        if t.is_mla(l):
            a_TD = mla.forward(n_TD, W, state, t, absorbed=decode, ops=ops, fast=self.forms == "fast").out_TD  # (M1-M5)
            snaps = {n: state.truncated(start + n) for n in boundaries}
        else:
            mixer = kda.forward(n_TD, W, state, t, decode, self.chunk, boundaries, ops,
                                fast=self.forms == "fast")  # (K1-K7)
            cache.layers[l] = mixer.state
            a_TD, snaps = mixer.out_TD, mixer.snapshots
        stream.add_mixer(fed("mixer_out", a_TD))  # (A2.4)
        y_TD = stream.ffn_input(l, W["ffn_res.norm"], W["ffn_res.proj"])  # (A2.5)
        m_TD = rms_norm(fed("ffn_res_out", y_TD), W["post_attn_norm"], eps)
        route = None
        if t.is_moe(l):
            forced = self.forced_routes.get(f"layers.{l}.router_ids")
            forced = None if forced is None else forced[start:start + m_TD.shape[0]]
            moe = latent_moe.forward(m_TD, W, t, fed("router_ids", forced, cast=False), ops,
                                     fast=self.forms == "fast")  # (R1-R7)
            f_TD, route = moe.out_TD, moe.route
        else:
            f_TD = situ_glu.dense(m_TD, W, t)  # (D1)
        stream.add_ffn(fed("ffn_out", f_TD))  # (A2.7)
        return LayerOut(x_TD, a_TD, y_TD, f_TD, route, snaps)

    # ---- the layer loop ----
    def _forward(self, ids_T: torch.Tensor | None, cache: ModelCache, decode: bool, boundaries: list[int],
                 feed: Feed | None = None, collect: dict | None = None) -> torch.Tensor:
        return drive(self._forward_steps(ids_T, cache, decode, boundaries, feed, collect), self.w)

    def _forward_steps(self, ids_T: torch.Tensor | None, cache: ModelCache, decode: bool, boundaries: list[int],
                       feed: Feed | None = None, collect: dict | None = None, rows: Sequence[int] | None = None,
                       media: torch.Tensor | None = None):
        """The one forward, as a generator: yields (l, decode) before layer l and is sent its
        ``LayerWeights``; returns the logits. ``drive`` reads each layer for one forward,
        ``drive_lockstep`` once for every forward of many runs at that layer. ``rows``: the
        rows ``collect`` keeps, and the only ones whose logits are computed (``teacher_forced``)."""
        t, start, eps = self.text, cache.length, self.text.rms_norm_eps
        h0_TD = head.embed(ids_T, self.w) if ids_T is not None else None  # (E0)
        if media is not None:
            h0_TD = head.splice(h0_TD, ids_T, media, self.w.config.media_placeholder_token_id)  # (E0) image rows
        h0_TD = self._fed(feed, "embed", h0_TD)
        self._tap("embed", h0_TD, start)
        stream = BlockResidual(h0_TD, t.attn_res_block_size, eps)  # (A2) B = [], S = h⁰
        snaps = {n: [None] * t.num_hidden_layers for n in boundaries}
        keep = None if rows is None else torch.tensor([int(r) for r in rows], dtype=torch.long, device=h0_TD.device)
        for l in range(t.num_hidden_layers):
            W = yield l, decode  # this layer's weights: read now (by the driver), dropped below
            out = self.layer(l, W, stream, cache, start, decode, boundaries, feed)
            for n, s in out.snapshots.items():
                snaps[n][l] = s
            self._record_layer(l, out, cache, start, collect, keep)
            del W, out  # free the layer before reading the next
        g = self.w.global_tensor
        h_TD = stream.output(g("out_res.norm"), g("out_res.proj"))  # h_final = AttnRes_out(B ++ [S])
        self._tap("final_hidden", h_TD, start)
        h_in = self._fed(feed, "final_hidden", h_TD)
        if keep is not None:  # a teacher-forced pass that keeps some rows: logits for them alone
            h_TD, h_in = h_TD[keep], h_in[keep]
        else:
            rows = self._logit_rows(start, h_in.shape[0]) if feed is None and collect is None else None
            if rows is not None:
                h_in = h_in[torch.tensor(rows, device=h_in.device)]
        logits_TV = self.w.gather_vocab(head.logits(h_in, g("final_norm"), g("lm_head"), eps))  # (F1)
        if rows is None:
            self._tap("logits", logits_TV, start)
        else:  # the rows computed, in their order
            for r in self.recorders:
                r.record("logits", logits_TV, start, positions=[start + i for i in rows])
        if collect is not None:
            collect.update(final_hidden=h_TD, logits=logits_TV)
        cache.length = start + h0_TD.shape[0]
        for n, layers in snaps.items():
            cache.snapshots[start + n] = ModelCache(layers, start + n)
        return logits_TV

    def _record_layer(self, l: int, out: LayerOut, cache: ModelCache, start: int, collect: dict | None,
                      keep: torch.Tensor | None = None) -> None:
        p = f"layers.{l}."
        self._tap(p + "attn_res_out", out.attn_res_out, start)
        self._tap(p + "mixer_out", out.mixer_out, start)
        self._tap(p + "ffn_res_out", out.ffn_res_out, start)
        if out.route is not None:
            self._tap(p + "router_ids", out.route.ids_TK, start)
            self._tap(p + "router_weights", out.route.weights_TK, start)
            self._tap(p + "router_margin", out.route.margin_T, start)
        self._tap(p + "ffn_out", out.ffn_out, start)
        state = cache.layers[l]
        if self.text.is_mla(l):
            self._tap_state(p + "mla_latent", state.latent_SC)
        else:
            self._tap_state(p + "kda_state", state.recurrent_HKV)
            self._tap_state(p + "kda_conv", state.conv_3WP)
        if collect is not None:
            kept = {p + "mixer_out": out.mixer_out, p + "ffn_res_out": out.ffn_res_out, p + "ffn_out": out.ffn_out}
            if l > 0:  # layer 0's AttnRes output is the embedding itself
                kept[p + "attn_res_out"] = out.attn_res_out
            if out.route is not None:
                kept.update({"own." + p + "router_ids": out.route.own_ids_TK,
                             "noise." + p + "router_margin": out.route.noise_T})
            collect.update(kept if keep is None else {k: v[keep] for k, v in kept.items()})


def drive(steps, weights: WeightSource):
    """Run one generator of layer requests (``Executor.prefill_steps``, ``decode_loop_steps``,
    ``case.case_steps``): each request (l, decode) is answered with ``weights.layer(l, decode)``."""
    try:
        need = next(steps)
        while True:
            need = steps.send(weights.layer(*need))
    except StopIteration as done:
        return done.value


def drive_lockstep(runs: Sequence, weights: WeightSource | Sequence[WeightSource]) -> list:
    """Run many generators of layer requests together, layer-major: a pointer cycles over the
    layers, each layer is read once per cycle and handed to every run waiting for it (its routed
    experts fetched once for all of them), so N runs' forwards cost one pass over the weights
    instead of N. Each run computes exactly what it computes alone (the same operations on the
    same tensors, only interleaved with other runs'). Returns the runs' results in order.

    ``weights``: one source for every run, or one per run (a float32 reference beside a BF16
    device; each source's layer is read once per cycle). At each layer the runs waiting for it
    take it in their order in ``runs``, so a run may feed on what an earlier one has just
    computed at the same layer (``case.teacher_forced_on_replay``)."""
    sources = list(weights) if isinstance(weights, (list, tuple)) else [weights] * len(runs)
    results, waiting = [None] * len(runs), {}
    for i, run in enumerate(runs):
        try:
            waiting[i] = next(run)
        except StopIteration as done:
            results[i] = done.value
    n_layers, layer = sources[0].config.text.num_hidden_layers if sources else 0, 0
    while waiting:
        here = [i for i, (l, _) in waiting.items() if l == layer]
        decode = {id(sources[i]): all(waiting[j][1] for j in here if sources[j] is sources[i]) for i in here}
        read = {}  # id(source) -> its layer, read once for every run of that source waiting here
        for i in here:
            src = sources[i]
            if id(src) not in read:
                read[id(src)] = src.layer(layer, decode=decode[id(src)]).shared()
            try:
                waiting[i] = runs[i].send(read[id(src)])
            except StopIteration as done:
                results[i] = done.value
                del waiting[i]
        del read
        layer = (layer + 1) % n_layers
    return results

