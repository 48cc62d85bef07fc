"""One case run: the only place a prompt is prefilled with taps and continued step by step.

``golden`` (greedy, high precision, with chunk snapshots and every expert choice recorded),
validate's built-in device (teacher-forced on the golden tokens, golden routes replayed; merged
and every distributed rank) and ``run`` all call ``run_case``, so the ground truth and its
judge cannot drift apart.

The arrays are named as in the golden files (docs/golden.md), keys relative to the case:

- ``positions``: the tapped prompt positions;
- every tap (``taps.TAPS``) at those positions: per-position taps [P, ...]; KDA states after
  the prefill; MLA latent rows at the tapped positions;
- ``chunk_positions``, ``chunk_states.layers.{l}.kda_state`` [n, H, dk, dv]: KDA states at
  chunk boundaries (when ``snapshot_at`` is given, even empty);
- ``routes.layers.{l}.router_ids``: every position's expert choice (``record_routes``), so a
  device can replay them;
- ``greedy_tokens`` (the run's own argmax per step), ``step_logits`` [steps, V];
- ``decode_states.layers.{l}.kda_state|mla_latent``: per decode step, the KDA state or the
  newest MLA latent row (state drift);
- ``decode.{tap}``: per-position taps at the decode positions;
- an image case: ``media.patches`` [N, 3, P, P] and ``media.grid_thws`` [images, 3] (the vision
  tower's input, so a replay runs it on the same patches) and the vision taps
  (``taps.VISION_TAPS``: ``vision.patch_embed``, ``vision.blocks.{b}.block_out``,
  ``vision.merger``, ``vision.projector``); its ``embed`` holds the projector's rows at the
  ``<|media_pad|>`` positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k3bundle.executor.cache import KDAState, ModelCache
from k3bundle.executor.errors import ExecutorError
from k3bundle.executor.model import Executor, drive, drive_lockstep
from k3bundle.executor.taps import SPEC, TapRecorder, layer_of, tap_kind
from k3bundle.executor.vision import encode_images


@dataclass
class CaseRun:
    arrays: dict[str, torch.Tensor]  # see the module docstring; CPU tensors
    prefill_logits: torch.Tensor  # [T, V]
    cache: ModelCache


def _state_row(s) -> torch.Tensor:
    """What drift is measured on after a decode step: the KDA state or the newest MLA latent row."""
    return s.recurrent_HKV if isinstance(s, KDAState) else s.latent_SC[-1]


def _state_kind(s) -> str:
    return "kda_state" if isinstance(s, KDAState) else "mla_latent"


def run_case(weights, ids: Sequence[int], positions: Sequence[int], steps: int = 0, **kw) -> CaseRun:
    """One case on ``weights`` (``case_steps``'s arguments; they are documented there)."""
    return drive(case_steps(weights, ids, positions, steps, **kw), weights)


def run_cases(weights, cases: Sequence[dict]) -> list[CaseRun]:
    """Several cases together, layer-major (``model.drive_lockstep``): each layer is read once
    per pass for all of them; each case's arrays are exactly what ``run_case`` gives it.
    ``cases``: one dict of ``case_steps`` arguments (without ``weights``) per case."""
    return drive_lockstep([case_steps(weights, **c) for c in cases], weights)


def case_steps(weights, ids: Sequence[int], positions: Sequence[int], steps: int = 0,
             tokens: Sequence[int] | None = None, forced_routes: dict[str, torch.Tensor] | None = None,
             snapshot_at: Sequence[int] | None = None, record_routes: bool = False,
             after_step: Callable[[int, ModelCache], None] | None = None, forms: str = "fast",
             recorders: Sequence = (), images: tuple[torch.Tensor, Sequence] | None = None) -> CaseRun:
    """Prefill ``ids`` recording every tap at ``positions``, then decode; a generator of layer
    requests (``model.drive``), so that several cases can share each layer's read.

    Args:
        weights: the ``WeightSource``.
        positions: prompt positions to tap (sorted).
        steps: greedy steps (ignored when ``tokens`` is given: one step per token).
        tokens: teacher-forced decode on these tokens (a reference's greedy continuation).
        forced_routes: ``{"layers.{l}.router_ids": ids [positions, K]}`` to replay.
        snapshot_at: chunk-boundary positions at which to keep the KDA states (None: no snapshots).
        record_routes: record every position's expert choice (``routes.…``).
        after_step: ``after_step(i, cache)`` after decode step i's states are kept: a serving
            engine's cache handling between steps (calibration plants serving-path faults here).
        forms: the executor's "fast" (batched) or "readable" forms of the same equations.
        recorders: more recorders of every tap (``taps.TapRecorder``'s interface): a run in
            lockstep that reads this one's taps as they are made (``validate.recompute``).
        images: (patches [N, 3, P, P], grid_thws [(t, h, w), ...]) of the prompt's images: the
            vision tower runs first (``vision.encode_images``, its taps recorded) and its rows
            take the ``<|media_pad|>`` positions (E0).
    """
    positions = [int(p) for p in positions]
    steps = len(tokens) if tokens is not None else steps
    decode_positions = list(range(len(ids), len(ids) + max(steps - 1, 0)))
    rec = TapRecorder(positions=positions + decode_positions)
    recorders = [rec, *recorders]
    if record_routes:
        routes = TapRecorder(names=["layers.*.router_ids"])
        recorders.append(routes)
    ex = Executor(weights, taps=recorders, forced_routes=forced_routes, forms=forms, all_logits=False)
    out: dict[str, torch.Tensor] = {"positions": torch.tensor(positions, dtype=torch.long)}
    media = None
    if images is not None:
        patches, grids = torch.as_tensor(images[0]), [tuple(int(a) for a in g) for g in images[1]]
        vision: dict[str, torch.Tensor] = {}
        media = encode_images(weights, weights.config.vision, patches, grids, vision)
        out |= {"media.patches": patches.cpu(), "media.grid_thws": torch.tensor(grids, dtype=torch.long), **vision}
    logits_TV, cache = yield from ex.prefill_steps(list(ids), snapshot_at=snapshot_at or (), media=media)

    for name in rec.names():  # prompt positions, and the states after the prefill
        spec, value = SPEC[tap_kind(name)], rec[name]
        if not spec.state:
            out[name] = value[: len(positions)]
        elif spec.kind == "mla_latent":
            out[name] = value[positions]  # latent rows at the tapped positions only
        else:
            out[name] = value
    if snapshot_at is not None:
        out["chunk_positions"] = torch.tensor(list(snapshot_at), dtype=torch.long)
        for l in weights.config.text.kda_layers if snapshot_at else ():
            out[f"chunk_states.layers.{l}.kda_state"] = torch.stack(
                [cache.snapshots[b].layers[l].recurrent_HKV.cpu() for b in snapshot_at])

    per_step: dict[str, list[torch.Tensor]] = {}

    def keep_states(c: ModelCache) -> None:
        for l, s in enumerate(c.layers):
            # a copy: the cache's tensors may be views the next step (or the engine) changes
            per_step.setdefault(f"decode_states.layers.{l}.{_state_kind(s)}", []).append(
                _state_row(s).to("cpu", copy=True))
        if after_step is not None:
            after_step(c.length - len(ids) - 1, c)  # the step just decoded, from 0

    chosen, step_logits = yield from ex.decode_loop_steps(logits_TV, cache, steps, tokens, keep_states)
    out["greedy_tokens"] = torch.tensor(chosen, dtype=torch.long)
    out["step_logits"] = step_logits.detach().cpu()
    if record_routes:
        for name in routes.names():  # prompt + decode positions, in position order
            out[f"routes.{name}"] = routes[name]
    out.update({k: torch.stack(v) for k, v in per_step.items()})
    if decode_positions:
        for name in rec.names():  # per-position taps at decode positions (the device's decode path)
            if not SPEC[tap_kind(name)].state:
                out[f"decode.{name}"] = rec[name][len(positions):]
    return CaseRun(out, logits_TV, cache)


def golden_routes(golden) -> dict[str, torch.Tensor]:
    """``{"layers.{l}.router_ids": ids}`` from a golden case's ``routes.…`` arrays."""
    p = "routes."
    return {k[len(p):]: torch.as_tensor(v) for k, v in golden.items() if k.startswith(p)}


def replay_case(weights, golden, ids: Sequence[int],
                after_step: Callable[[int, ModelCache], None] | None = None, forms: str = "fast",
             recorders: Sequence = ()) -> CaseRun:
    """A golden case run again: the golden routes replayed and decode fed the golden tokens, so
    every array stays comparable with the golden one after a near tie (validate's built-in
    device, and the goldens' own BF16 noise)."""
    return run_case(weights, **replay_args(golden, ids, after_step, forms))


def golden_images(golden) -> tuple[torch.Tensor, list] | None:
    """The vision tower's input a golden case ran on (``media.…``), or None for a text case."""
    if "media.patches" not in golden:
        return None
    return torch.as_tensor(golden["media.patches"]), torch.as_tensor(golden["media.grid_thws"]).tolist()


def replay_args(golden, ids: Sequence[int], after_step=None, forms: str = "fast") -> dict:
    """``case_steps`` arguments of ``replay_case`` (for ``run_cases``)."""
    return dict(ids=[int(i) for i in ids], positions=[int(p) for p in golden["positions"]],
                tokens=[int(t) for t in golden["greedy_tokens"]], forced_routes=golden_routes(golden),
                after_step=after_step, forms=forms, images=golden_images(golden))


class LayerWindow:
    """A recorder (``taps.TapRecorder``'s interface) of one prefill's full-sequence taps that
    keeps only the newest layer's: a tap of layer l drops every tap of another layer (the
    embedding goes with layer 0's first tap; ``final_hidden`` joins the last layer's). Read as a
    teacher-forcing feed; a tap it does not hold is an error, never a silent fallback to the
    fed run's own value."""

    positions = None  # the executor asks every recorder which positions it taps

    def __init__(self):
        self._taps: dict[str, torch.Tensor] = {}
        self._layer: int | None = None

    def wants(self, name: str) -> bool:
        return tap_kind(name) != "logits"  # the fed run computes its own logits from the fed final_hidden

    def record(self, name: str, value: torch.Tensor, start: int, positions=None) -> None:
        if start != 0 or positions is not None or not self.wants(name):
            return  # decode steps (their feed is the goldens' own) and logit rows
        layer = layer_of(name)
        if layer is not None and layer != self._layer:
            self._taps.clear()
            self._layer = layer
        self._taps[name] = value.detach()

    def record_state(self, name: str, value: torch.Tensor) -> None:
        pass

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._taps:
            raise ExecutorError(f"lockstep feed: {name!r} is not the reference's newest layer "
                                f"(it holds {sorted(self._taps)})")
        return self._taps[name]


def teacher_forced_on_replay(weights, reference_weights, golden, ids: Sequence[int],
                             after_step: Callable[[int, ModelCache], None] | None = None
                             ) -> tuple[CaseRun, dict[str, torch.Tensor]]:
    """A teacher-forced pass on ``weights`` of a golden case that taps a sample of positions:
    its prompt layers are fed every position of a replay of the case on ``reference_weights``
    (``replay_case``: golden routes, decode fed the golden tokens), made layer by layer in
    lockstep with it, its decode steps the goldens' ``decode.…`` taps (every step is tapped).

    At each layer the replay runs first (``model.drive_lockstep`` keeps the runs' order) and the
    fed pass reads that layer's outputs just made (``LayerWindow``), so memory holds the two
    AttnRes streams and one layer's outputs, never every layer's. Returns the replay (its arrays
    at the goldens' positions) and the fed pass's outputs, kept at the goldens' positions
    (``Executor.teacher_forced``'s ``rows``). ``after_step``: a serving engine's cache handling,
    in both runs."""
    replay, fed = teacher_forced_on_replay_steps(weights, reference_weights, golden, ids, after_step)
    run, outputs = drive_lockstep([replay, fed], [reference_weights, weights])
    return run, outputs


def teacher_forced_on_replay_steps(weights, reference_weights, golden, ids: Sequence[int],
                                   after_step: Callable[[int, ModelCache], None] | None = None) -> tuple:
    """``teacher_forced_on_replay`` as its two generators of layer requests, (replay, fed pass):
    ``model.drive_lockstep`` runs them on ``reference_weights`` and ``weights``, the replay
    before the fed pass in its run list (beside other runs, if any)."""
    window = LayerWindow()
    replay = case_steps(reference_weights, **replay_args(golden, ids, after_step), recorders=[window])

    def feed(name: str):
        if name.startswith("decode."):
            return torch.as_tensor(golden[name]) if name in golden else None
        return window(name)

    fed = Executor(weights).teacher_forced_steps(feed, decode=True, after_step=after_step,
                                                 rows=[int(p) for p in golden["positions"]])
    return replay, fed
