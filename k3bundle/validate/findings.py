"""What a sign-off leads with: the order failures are listed in, and how a failure's place reads.

A teacher-forced check (*added*, *emulation*, *exact*, *exact_gpu*, a layer's own expert choice)
judges each layer on golden inputs, or on the device's own, so its first failure is the faulty
layer. A free-running check (*inherited*, the logits' *distribution*, a decode *state*) carries the
error of every layer before it: it fails at the fault and everywhere after, and locates nothing
by itself. Every report therefore lists a case's failures in ``failure_order`` — teacher-forced
first, each group in the tap grammar's forward order — the terminal's first-failure line,
``signoff.md``'s per-case list and the HTML page alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from k3bundle.executor.taps import forward_key, layer_of, tap_kind

TEACHER_FORCED = frozenset({"added", "emulation", "exact", "exact_gpu", "router"})
#: what a tap that belongs to no layer is, in words (any other: the model's output)
MODEL_PLACES = {"embed": "model input", "final_hidden": "after the last layer"}


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
    layer = layer_of(tap)
    where = f"layer {layer}" if layer is not None else MODEL_PLACES.get(tap_kind(tap), "model output")
    return f"{where}, {code(tap)}"
