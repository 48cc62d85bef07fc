"""Serving paths on the built-in executor: a prefix cache resumed, a prefill handed to a decoder.

A serving engine does not run a request as one prefill and a decode loop. It keeps a prefix's
cache (KDA states are valid only where they were taken, so at chunk boundaries: docs/kimi-k3.md
§5.3), restores it for the next turn, and may prefill on one machine and decode on another,
moving the cache as bytes (``cache_handoff``). Each path here runs the same model on the same
tokens and expert choices as the uninterrupted run, so it must give the same outputs:

- ``uninterrupted``: prefill the whole prompt (snapshots at chunk boundaries), decode the
  teacher-forced tokens; the reference the other paths are held to.
- ``resume``: take the uninterrupted run's snapshot at the nearest chunk boundary at or before
  ``at``, pass it through bytes (``CacheIO``: what a prefix cache stores), recompute the tail up
  to ``at`` if ``at`` is off the chunk grid (a turn boundary: the state there was never kept),
  then prefill the rest of the prompt as the next turn and decode.
- ``decode_from``: the decoding side of a prefill/decode handoff: restore the bytes, decode.

``CacheIO`` is the engine's save and load; a planted fault replaces one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from k3bundle.executor.cache import ModelCache
from k3bundle.executor.cache_handoff import from_bytes, to_bytes
from k3bundle.executor.model import Executor


@dataclass(frozen=True)
class CacheIO:
    """How a cache leaves the engine and comes back (module-level functions: a spawned process
    receives them by name)."""

    save: Callable[[ModelCache], bytes] = to_bytes
    load: Callable[[bytes], ModelCache] = from_bytes


@dataclass
class PathRun:
    """One run of a prompt and its decode steps along a serving path."""

    logits: torch.Tensor  # [rows, V]: the prompt rows this path computed (after the resume point)
    step_logits: torch.Tensor  # [steps, V]: logits of each decode step (row 0: the prompt's last row)
    final: ModelCache  # the cache after the last step
    saved: ModelCache | None = None  # what was saved (resume: the snapshot; uninterrupted: after the prefill)
    restored: ModelCache | None = None  # what the engine restored from the saved bytes
    nbytes: int = 0  # size of the saved bytes
    snapshots: dict[int, ModelCache] = field(default_factory=dict, repr=False)


def chunk_grid(T: int, chunk: int) -> list[int]:
    """Every chunk boundary inside a T-token prompt (where a prefix cache keeps snapshots)."""
    return list(range(chunk, T, chunk))


def _steps(ex: Executor, last_V: torch.Tensor, cache: ModelCache, tokens: Sequence[int]) -> torch.Tensor:
    return ex.decode_steps(last_V[None], cache, len(tokens), tokens=tokens)[1].detach().cpu()


def uninterrupted(weights, ids: Sequence[int], tokens: Sequence[int],
                  forced_routes: dict[str, torch.Tensor] | None = None, chunk: int | None = None) -> PathRun:
    """The whole prompt in one prefill (snapshots at every chunk boundary), then the decode steps."""
    ex = Executor(weights, forced_routes=forced_routes, **({} if chunk is None else {"chunk": chunk}))
    logits, cache = ex.prefill(list(ids), snapshot_at=chunk_grid(len(ids), ex.chunk))
    saved = cache.clone()
    steps = _steps(ex, logits[-1], cache, tokens)
    return PathRun(logits.detach().cpu(), steps, cache, saved=saved, snapshots=cache.snapshots)


def resume(weights, ids: Sequence[int], tokens: Sequence[int], at: int, snapshots: dict[int, ModelCache],
           forced_routes: dict[str, torch.Tensor] | None = None, io: CacheIO = CacheIO(),
           chunk: int | None = None) -> PathRun:
    """The prompt resumed from a prefix cache at ``at`` (0 < at < len(ids)): the snapshot at the
    chunk boundary at or before ``at`` (``snapshots``: the uninterrupted run's) saved and
    loaded through ``io``, the tail up to ``at`` recomputed (none when ``at`` is on the grid), the
    rest of the prompt prefilled as the next turn, then the decode steps. ``logits`` are the
    rows from ``at`` on."""
    ex = Executor(weights, forced_routes=forced_routes, **({} if chunk is None else {"chunk": chunk}))
    base = at // ex.chunk * ex.chunk
    saved = snapshots[base] if base else ex.new_cache()
    data = io.save(saved)
    restored = io.load(data)
    cache = restored.clone()
    if at > cache.length:  # recompute the tail from the chunk snapshot to the turn boundary
        ex.prefill(list(ids[cache.length:at]), cache=cache)
    logits, cache = ex.prefill(list(ids[cache.length:]), cache=cache)
    steps = _steps(ex, logits[-1], cache, tokens)
    return PathRun(logits.detach().cpu(), steps, cache, saved=saved, restored=restored, nbytes=len(data))


def decode_from(weights, data: bytes, last_V: torch.Tensor, tokens: Sequence[int],
                forced_routes: dict[str, torch.Tensor] | None = None, io: CacheIO = CacheIO()) -> PathRun:
    """The decoding side of a handoff: the prefill's cache restored from ``data`` through
    ``io.load``, then the decode steps (``last_V``: the prefill's last logits row, which chose the
    first token)."""
    ex = Executor(weights, forced_routes=forced_routes)
    restored = io.load(data)
    cache = restored.clone()
    steps = _steps(ex, torch.as_tensor(last_V), cache, tokens)
    return PathRun(torch.as_tensor(last_V)[None], steps, cache, restored=restored, nbytes=len(data))
