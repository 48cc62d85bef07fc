"""Corrupted cache pages and KDA snapshots, planted on the serving path and located (``faults BUNDLE``).

A server that resumes a request from a prefix cache restores bytes it saved: a page corrupted in
between, or a KDA snapshot written in the wrong layout, is served from silently unless something
compares. ``validate --serving`` holds the restored cache to the saved one exactly (check 1 of
``validate.serving``); here each planted fault goes through that same path — the prompt's last
chunk snapshot saved, loaded, the rest prefilled and decoded (``executor.serving.resume``) — and
the first restore check that fails names the array and layer. A clean save/load is run first: a
fault counts as detected only where the clean path passes the same checks.

The faults are module-level functions so a spawned decoding process can load them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from k3bundle.executor.cache import KDAState, ModelCache
from k3bundle.executor.cache_handoff import from_bytes, to_bytes
from k3bundle.executor.serving import CacheIO, chunk_grid, resume, uninterrupted
from k3bundle.validate.serving import restore_checks

CASE = "multi_turn"  # a conversation longer than a chunk: its last chunk boundary is a resume point
DECODE_STEPS = 2


def save_kda_transposed(cache: ModelCache) -> bytes:
    """A KDA snapshot saved transposed ([dv, dk] where the format says [dk, dv])."""
    c = cache.clone()
    for s in c.layers:
        if isinstance(s, KDAState):
            s.recurrent_HKV = s.recurrent_HKV.transpose(-1, -2).contiguous()
    return to_bytes(c)


def load_dropping_conv(data: bytes) -> ModelCache:
    """A conv-state page lost on restore (zeros, as a fresh request's)."""
    c = from_bytes(data)
    for s in c.layers:
        if isinstance(s, KDAState):
            s.conv_3WP = torch.zeros_like(s.conv_3WP)
    return c


#: name -> (what is planted, the cache's way out and back, the array it corrupts)
PLANTED = {
    "kda_snapshot_transposed": ("a KDA snapshot saved transposed", CacheIO(save=save_kda_transposed), "kda_state"),
    "conv_page_dropped": ("a KDA conv-state page dropped on restore", CacheIO(load=load_dropping_conv), "kda_conv"),
}


@dataclass
class Located:
    key: str
    title: str
    detected: bool  # a restore check failed, on the array this fault corrupts
    tap: str  # the first failing check ("" when none failed)
    layer: int | None
    line: str  # that check's line, or why nothing was detected
    clean_passed: bool  # the clean save/load passed every restore check (the control)
    moved: float  # max |logit difference| of the continuation against the uninterrupted run


def run_planted(weights, ids: list[int], names=tuple(PLANTED)) -> list[Located]:
    """The uninterrupted run, the clean resume at the last chunk boundary, and each planted fault there."""
    from k3bundle.executor import Executor

    chunk = Executor(weights).chunk
    grid = chunk_grid(len(ids), chunk)
    if not grid:
        raise ValueError(f"the prompt ({len(ids)} tokens) has no chunk boundary (chunk {chunk})")
    at = grid[-1]
    tokens = list(ids[:DECODE_STEPS])  # fed, not judged: the continuation only has to run
    ref = uninterrupted(weights, ids, tokens)
    clean = resume(weights, ids, tokens, at, ref.snapshots)
    clean_ok = all(r.passed for r in restore_checks(CASE, clean.saved, clean.restored))
    out = []
    for name in names:
        title, io, array = PLANTED[name]
        run = resume(weights, ids, tokens, at, ref.snapshots, io=io)
        bad = [r for r in restore_checks(CASE, run.saved, run.restored) if not r.passed]
        moved = float((run.step_logits.double() - ref.step_logits.double()).abs().max())
        if not bad:  # (a TapResult is falsy when it failed: test against the list, not the result)
            out.append(Located(name, title, False, "", None, "every restore check passed: the fault went unseen",
                               clean_ok, moved))
            continue
        ff = bad[0]
        detected = clean_ok and ff.tap.endswith("." + array)
        out.append(Located(name, title, detected, ff.tap, ff.layer, ff.line(), clean_ok, moved))
    return out


def case_ids(source, cases=None) -> list[int]:
    """Token ids of ``CASE`` rendered with ``source``'s tokenizer (a bundle keeps it in tokenizer/)."""
    from k3bundle.golden.cases import load_cases
    from k3bundle.golden.generate import source_encoding

    case = next((c for c in load_cases(cases) if c.name == CASE), None)
    if case is None:
        raise ValueError(f"the golden case {CASE!r} (a conversation past one chunk) is not in the cases folder")
    return case.build_ids(source_encoding(Path(source)))
