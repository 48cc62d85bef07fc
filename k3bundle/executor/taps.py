"""Taps: named intermediates, and the one grammar every other module derives them from.

Tap names are a **stable contract**: goldens, device dumps, tolerances and the comparator key
on them (docs/dump-format.md lists them). ``TAPS`` below is the only list: forward order, where a
tap occurs, whether it has a position axis, how validate judges it and whether a dump must
carry it. ``{l}`` is the 0-based decoder layer.

Each tap's value and shape are in the table too; ``tap_table_markdown`` renders it into
docs/dump-format.md ("Taps"), and a test keeps that page equal to it. Per-position taps have one
row per recorded position (leading axis P); state taps hold the value after the last call that
touched the layer (no position axis).

Values are detached CPU copies in the dtype they had (bf16 taps stay bf16; ``numpy()``
upcasts them to float32 because numpy has no bfloat16).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TapSpec:
    kind: str  # the last part of the name; tolerances are keyed by it
    where: str  # "model" (once), "layer" (every layer), "moe", "kda", "mla" (layers of that kind)
    state: bool  # no position axis: the value after the last call (mla_latent: rows by position)
    judged: str  # "tensor" (distance metrics), "logits" (distribution), "router" (as sets), "evidence"
    in_dump: bool  # a device dump must carry it (docs/dump-format.md)
    shape: str = ""  # in a golden file or a dump (docs/dump-format.md "Taps" has the legend)
    value: str = ""  # what it is, with its equation numbers (docs/kimi-k3.md)

    def name(self, layer: int | None = None) -> str:
        return self.kind if self.where == "model" else f"layers.{layer}.{self.kind}"


# Forward order: the order a layer produces them (mixer states belong to the mixer step but are
# read after the layer, as the executor records them).
_PD = "[P, D]"  # one row of the hidden size per tapped position
TAPS: tuple[TapSpec, ...] = (
    TapSpec("embed", "model", False, "tensor", False, _PD, "h⁰, the token embedding (E0)"),
    TapSpec("attn_res_out", "layer", False, "tensor", False, _PD, "AttnRes output before the mixer (A2 step 1, x)"),
    TapSpec("mixer_out", "layer", False, "tensor", True, _PD, "the KDA or MLA output a (K7 / M5)"),
    TapSpec("ffn_res_out", "layer", False, "tensor", False, _PD, "AttnRes output before the FFN (A2 step 5, y)"),
    TapSpec("router_ids", "moe", False, "router", False, "[P, K] int64",
            "chosen experts, torch.topk order (R2); judged as sets; replayed by the emulation (\"Expert choices\")"),
    TapSpec("router_weights", "moe", False, "tensor", False, "[P, K]", "their renormalised weights (R3)"),
    TapSpec("router_margin", "moe", False, "evidence", False, "[P]", "k-th minus (k+1)-th biased score (R2), unjudged"),
    TapSpec("ffn_out", "layer", False, "tensor", True, _PD, "the FFN output f (dense D1 or MoE R7)"),
    TapSpec("kda_state", "kda", True, "tensor", False, "[H, dk, dv]", "recurrent state S after the prompt (K5)"),
    TapSpec("kda_conv", "kda", True, "tensor", False, "[3, W-1, Pc]", "conv state: last W-1 inputs of q, k, v (K1)"),
    TapSpec("mla_latent", "mla", True, "tensor", False, "[P, kv_lora_rank + qk_rope_head_dim]",
            "latent cache rows [ĉ_kv ‖ k_pe] (M2/M3) at the tapped positions"),
    TapSpec("final_hidden", "model", False, "tensor", True, _PD, "h_final, the output AttnRes (before the final norm)"),
    TapSpec("logits", "model", False, "logits", True, "[P, V]", "F1, judged as distributions (KL, top-1)"),
)

#: the vision tower's taps (docs/kimi-k3.md §3.9): whole tensors, one row per patch or merged
#: token of every image in order (no token-position axis); ``vision_tap`` names them
VISION_TAPS: tuple[TapSpec, ...] = (
    TapSpec("patch_embed", "vision", True, "tensor", False, "[N, Dv]",
            "patch embedding plus position terms (V1), N patches of all images"),
    TapSpec("block_out", "vit_block", True, "tensor", False, "[N, Dv]", "encoder block b's output (V2)"),
    TapSpec("merger", "vision", True, "tensor", False, "[M, kh·kw, Dv]",
            "after the final norm (V3) and the sd2_tpool merge (V4), M merged tokens"),
    TapSpec("projector", "vision", True, "tensor", False, "[M, D]",
            "projector output (V5): the rows that replace <|media_pad|> embeddings"),
)
VISION_SPEC: dict[str, TapSpec] = {s.kind: s for s in VISION_TAPS}
#: every tap kind, text and vision (their kinds are distinct)
SPEC: dict[str, TapSpec] = {s.kind: s for s in TAPS} | VISION_SPEC
LAYER_TAPS = tuple(s for s in TAPS if s.where != "model")
#: kinds a tolerance file may give limits to (router ids are judged as sets, margins not at all)
JUDGED_KINDS = tuple(s.kind for s in (*TAPS, *VISION_TAPS) if s.judged in ("tensor", "logits"))


def vision_tap(kind: str, block: int | None = None) -> str:
    """``vision.patch_embed``, ``vision.blocks.3.block_out``, ``vision.merger``, ``vision.projector``."""
    spec = VISION_SPEC[kind]
    return f"vision.blocks.{block}.{kind}" if spec.where == "vit_block" else f"vision.{kind}"


def vision_tap_names(vision) -> list[str]:
    """Every vision tap of a model with this ``VisionConfig``, in forward order."""
    names = [vision_tap("patch_embed")]
    names += [vision_tap("block_out", b) for b in range(vision.vt_num_hidden_layers)]
    return names + [vision_tap("merger"), vision_tap("projector")]


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def tap_kind(name: str) -> str:
    """``layers.3.mixer_out`` -> ``mixer_out``; ``decode.logits`` -> ``logits``; ``case/x`` -> ``x``."""
    return name.rsplit(".", 1)[-1].rsplit("/", 1)[-1]


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def spec_of(name: str) -> TapSpec | None:
    return SPEC.get(tap_kind(name))


def _occurs(spec: TapSpec, text, layer: int) -> bool:
    return {"layer": True, "moe": text.is_moe(layer), "kda": not text.is_mla(layer),
            "mla": text.is_mla(layer)}[spec.where]


def tap_names(text, kinds: Iterable[TapSpec] = TAPS) -> list[str]:
    """Every tap name a model of this shape produces (``kinds`` of them), in forward order."""
    kinds = tuple(kinds)
    names = [s.name() for s in kinds if s.where == "model" and s.kind == "embed"]
    for l in range(text.num_hidden_layers):
        names += [s.name(l) for s in kinds if s.where != "model" and _occurs(s, text, l)]
    return names + [s.name() for s in kinds if s.where == "model" and s.kind != "embed"]


def dump_required(num_layers: int) -> list[str]:
    """The taps a device dump of one case must carry, in forward order (every one of them occurs
    in every layer or once per model, so the layer count is all it takes)."""
    need = [s for s in TAPS if s.in_dump]
    assert all(s.where in ("layer", "model") for s in need)
    names = [s.name(l) for l in range(num_layers) for s in need if s.where == "layer"]
    return names + [s.name() for s in need if s.where == "model"]


_WHERE = {"model": "once", "layer": "every layer", "moe": "MoE layers", "kda": "KDA layers",
          "mla": "MLA layers"}


def tap_table_markdown() -> str:
    """``TAPS`` as the Markdown table of docs/dump-format.md ("Taps"), in forward order."""
    rows = ["| tensor | layers | shape | required | value |", "|---|---|---|---|---|"]
    for s in TAPS:
        rows.append(f"| `{s.name('{l}')}` | {_WHERE[s.where]} | {s.shape} | {'yes' if s.in_dump else 'no'} "
                    f"| {s.value} |")
    return "\n".join(rows) + "\n"


_VISION_BLOCK = re.compile(r"^vision\.blocks\.(\d+)\.")


def vision_block_of(name: str) -> int | None:
    """``vision.blocks.3.block_out`` -> 3; None for any other tap."""
    m = _VISION_BLOCK.match(name)
    return int(m.group(1)) if m else None


def forward_key(name: str) -> tuple:
    """Sort key: the vision taps (an image case's tower runs before the embedding), embed, then
    layers in order (taps in forward order), then final taps; decode taps and states
    (``decode.…``, ``decode_states.…``) after prompt taps."""
    l, kind = layer_of(name), tap_kind(name)
    decode = name.startswith(("decode.", "decode_states."))
    if name.startswith("vision.") and kind in VISION_SPEC:
        b = vision_block_of(name)
        at = -3 if kind == "patch_embed" else -1 if b is None else -2
        return (decode, at, 0 if b is None else b, name)
    order = next((i for i, s in enumerate(TAPS) if s.kind == kind), len(TAPS))
    if l is None:
        return (decode, 0 if kind == "embed" else 10**9, order, name)
    return (decode, l + 1, order, name)


class TapRecorder:
    """Records the taps whose name matches one of ``names`` (fnmatch patterns; None = all)
    at absolute token positions ``positions`` (None = every position)."""

    def __init__(self, names: Iterable[str] | None = None, positions: Iterable[int] | None = None):
        self.patterns = None if names is None else list(names)
        self.positions = None if positions is None else set(int(p) for p in positions)
        self._rows: dict[str, dict[int, torch.Tensor]] = {}
        self._states: dict[str, torch.Tensor] = {}
        self._pending: list = []  # CUDA events of copies still in flight to pinned host memory

    def wants(self, name: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def record(self, name: str, value: torch.Tensor, start: int, positions: Iterable[int] | None = None) -> None:
        """``value`` has one row per token, tokens at positions start, start+1, ... (or at
        ``positions``, one per row). The wanted rows leave the device in one copy."""
        if not self.wants(name):
            return
        at = list(range(start, start + value.shape[0])) if positions is None else [int(p) for p in positions]
        keep = [i for i, p in enumerate(at) if self.positions is None or p in self.positions]
        if not keep:
            return
        rows = value.detach()
        if len(keep) < rows.shape[0]:
            rows = rows[torch.tensor(keep, device=rows.device)]
        host = self._to_host(rows)
        mine = self._rows.setdefault(name, {})
        for j, i in enumerate(keep):
            mine[at[i]] = host[j]

    def record_state(self, name: str, value: torch.Tensor) -> None:
        if self.wants(name):
            self._states[name] = self._to_host(value.detach())

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        """A host copy of ``x``; from a CUDA device, into pinned memory without waiting for it
        (the device runs on; reading a tap waits for the copies in flight)."""
        if not x.is_cuda:
            return x.to("cpu", copy=True)
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(x.device))
        self._pending.append(done)
        return host

    def _settle(self) -> None:
        for done in self._pending:
            done.synchronize()
        self._pending.clear()

    # ---- reading ----
    def names(self) -> list[str]:
        self._settle()
        return list(self._rows) + list(self._states)

    def positions_of(self, name: str) -> list[int]:
        self._settle()
        return sorted(self._rows[name])

    def __contains__(self, name: str) -> bool:
        return name in self._rows or name in self._states

    def __getitem__(self, name: str) -> torch.Tensor:
        """Per-position taps stacked in position order [P, ...]; state taps as recorded."""
        self._settle()
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
