"""What a sign-off leads with: the order failures are listed in, and how a failure's place reads.

A teacher-forced check (*added*, *emulation*, *exact*, *exact_gpu*, a layer's own expert choice)
judges each layer on golden inputs, or on the device's own, so its first failure is the faulty
layer. A free-running check (*inherited*, the logits' *distribution*, a decode *state*) carries the
error of every layer before it: it fails at the fault and everywhere after, and locates nothing
by itself. Every report therefore lists a case's failures in ``failure_order`` — teacher-forced
first, each group in the tap grammar's forward order — the terminal's first-failure line,
``signoff.md``'s per-case list and the HTML page alike.

Where a backend's kernels ran (``validate --backend``), a failure also names the backend's ops
that ran where it failed (``ops_behind``) and the module they come from (``finding``): a kernel
bug is then read as an op, not only as a layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from k3bundle.executor.taps import forward_key, layer_of, tap_kind, vision_block_of
from k3bundle.kernels.backend import OP_CONTRACTS, OPS

TEACHER_FORCED = frozenset({"added", "emulation", "exact", "exact_gpu", "router"})
#: what a tap that belongs to no layer is, in words (any other: the model's output)
MODEL_PLACES = {"embed": "model input", "final_hidden": "after the last layer"}
#: the part of a layer a tap's value comes from: its mixer (KDA or MLA) or its FFN (the routed
#: experts in a MoE layer); the AttnRes taps come from neither (no op of a backend computes them)
MIXER_TAPS = frozenset({"mixer_out", "kda_state", "kda_conv", "mla_latent"})
FFN_TAPS = frozenset({"router_ids", "router_weights", "ffn_out"})
#: checks whose run keeps the reference's ops: the exact check (float32 on the goldens' weights)
REFERENCE_MODES = frozenset({"exact", "exact_gpu"})


def failure_order(r) -> tuple:
    """Sort key of a check (``compare.TapResult``): teacher-forced before free-running, then the
    forward order of its tap (prompt before decode steps; layer, then the tap's place in it)."""
    return (r.mode not in TEACHER_FORCED, forward_key(r.tap))


def failures(results: Iterable) -> list:
    """The failing checks of ``results`` in ``failure_order`` (a stable sort: checks of one tap
    keep the order they were judged in)."""
    return sorted((r for r in results if not r.passed), key=failure_order)


def first_failure(results: Iterable):
    """The check a case's failure is named by (``failures``' first), or None."""
    bad = failures(results)
    return bad[0] if bad else None


def place(tap: str, code: Callable[[str], str] = str) -> str:
    """Where a tap is, then the tap: ``layer 5, layers.5.mixer_out``; for a tap of no layer
    ``model output, step_logits``. ``code`` marks up the tap name (Markdown, HTML)."""
    layer, block = layer_of(tap), vision_block_of(tap)
    if block is not None:
        where = f"vision block {block}"
    elif tap.startswith("vision."):
        where = "vision tower"
    else:
        where = f"layer {layer}" if layer is not None else MODEL_PLACES.get(tap_kind(tap), "model output")
    return f"{where}, {code(tap)}"


def ops_behind(tap: str, mode: str, text, ops) -> list[str]:
    """The ops among ``ops`` (a backend's) that ran where ``tap`` failed, in contract order: the
    layer's mixer ops (KDA or MLA) for a mixer tap, its MoE ops for an FFN tap of a MoE layer
    (``text``: the model's ``TextConfig``). At the prompt, the ops that run there; at a decode
    step every op of that part of the layer, since a step reads the state its prefill left. None
    for a tap of no layer, an AttnRes tap or a check that ran on the reference (``REFERENCE_MODES``)."""
    layer, kind = layer_of(tap), tap_kind(tap)
    if layer is None or mode in REFERENCE_MODES:
        return []
    if kind in MIXER_TAPS:
        block = "mla" if text.is_mla(layer) else "kda"
    elif kind in FFN_TAPS and text.is_moe(layer):
        block = "moe"
    else:
        return []
    decode = tap.startswith(("decode.", "decode_states."))
    return [op for op in OPS if op in ops and OP_CONTRACTS[op].block == block
            and (decode or OP_CONTRACTS[op].runs != "decode")]


def kernels_of(backend) -> dict | None:
    """What a report says of the backend a device ran (``ops.contract.Backend``): its name, its
    module and the ops it brought; None for the reference."""
    if backend is None:
        return None
    return {"backend": backend.name, "module": backend.module, "ops": [op for op in OPS if op in backend.ops]}


def finding(ff, ops: list[str], kernels: dict | None, code: Callable[[str], str] = str,
            text: Callable[[str], str] = str) -> str:
    """A case's first failure in one line: ``layer 3, layers.3.mixer_out (added)``, and where a
    backend ran, ``; op gated_mla_prefill of backend 'NAME' (module M)`` (or that none of its ops ran
    there). ``code`` marks up tap and op names, ``text`` escapes the rest (Markdown, HTML)."""
    out = f"{place(ff.tap, code)} ({text(ff.mode)})"
    if kernels is None:
        return out
    who = text(f"backend {kernels['backend']!r} (module {kernels['module'] or 'none'})")
    if not ops:
        return f"{out}; no op of {who} ran there"
    return f"{out}; op{'s' if len(ops) > 1 else ''} {', '.join(map(code, ops))} of {who}"
