"""Serving paths judged on the built-in device (``validate --serving``; docs/validation.md
"Serving paths").

For every case, the device's uninterrupted run (golden routes replayed, decode fed the golden
tokens) is the reference the first three paths must equal (the batch holds each request to itself alone):

- ``resume_chunk``: the prefix cache taken at the prompt's last chunk boundary, restored from
  its bytes, the rest of the prompt prefilled, then decode;
- ``resume_turn``: the prefix cache at the last turn boundary (after an ``<|end_of_msg|>``) that
  is off the chunk grid: the snapshot at the chunk boundary before it restored and the tail
  *recomputed* up to the turn boundary (a KDA state is kept only at chunk boundaries), then the
  next turn prefilled, then decode;
- ``handoff``: the prefill's whole cache serialised (``executor.cache_handoff``), restored in
  another process (``python -m k3bundle.validate.serving``), decoded there; its size is reported;
- ``batching``: the prompt in one batch with other requests of different lengths, each against
  itself run alone (``validate.serving_batch``, its checks listed there).

Checks, in the order a fault propagates (the first failure locates it):

1. ``restore.layers.{l}.{kda_state|kda_conv|mla_latent}``: the restored cache against the cache
   that was saved, **exactly** (bytes in, bytes out: no arithmetic lies between them);
2. ``next_turn.logits`` (resumes): the prompt rows after the resume point, and ``step_logits``:
   every decode step, by the tolerance file's logits limits;
3. ``final.layers.{l}.…``: every layer's cache after the last step, by the ``inherited`` limits of
   its state kind. Recomputing a tail, or prefilling a turn in a call of its own, cuts the
   chunked KDA form and the batched products at other places, so BF16 rounds differently: the
   same limits a free-running decode state is held to, never exact equality.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from k3bundle.executor.cache import ModelCache, cache_arrays
from k3bundle.executor.cache_handoff import from_bytes, to_bytes
from k3bundle.executor.case import golden_routes
from k3bundle.executor.serving import CacheIO, PathRun, chunk_grid, decode_from, resume, uninterrupted
from k3bundle.golden.tolerances import Tolerances
from k3bundle.tokenizer_specials import END_OF_MSG, named_special_ids
from k3bundle.validate.compare import TapResult, compare_logits, compare_tensor
from k3bundle.validate.serving_batch import BatchPair, batch_checks, describe, run_batch

PATHS = ("resume_chunk", "resume_turn", "handoff", "batching")
HANDOFF_TIMEOUT_S = 600


class HandoffError(RuntimeError):
    """The decoding process failed or gave no answer: the handoff path fails with this line."""


@dataclass
class PathPair:
    """One serving path of one case as the device ran it, beside the uninterrupted run."""

    path: str
    at: int | None = None  # resume position (prompt tokens restored)
    cand: PathRun | None = None
    reason: str = ""  # why it did not run
    error: str = ""  # why it failed before anything could be compared (the decoding process died)


@dataclass
class PathResult:
    path: str
    status: str  # "pass" / "fail" / "not run"
    at: int | None = None
    nbytes: int = 0
    reason: str = ""
    results: list[TapResult] = field(default_factory=list)
    first_failure: TapResult | None = None

    def as_dict(self) -> dict:
        ff = self.first_failure
        return {"path": self.path, "status": self.status, "at": self.at, "bytes": self.nbytes, "reason": self.reason,
                "checks": len(self.results), "failed": sum(not r.passed for r in self.results),
                "first_failure": None if ff is None else {"tap": ff.tap, "layer": ff.layer, "line": ff.line()}}


SECTION_HEAD = ("case", "path", "at token", "bytes per request", "status", "checks failed", "first failure")
SECTION_NOTE = ("Each path must equal the device's uninterrupted run: the restored cache exactly, then the next "
                "turn's logits, every decode step and the final cache within the tolerance file's limits "
                "(docs/validation.md \"Serving paths\").")
NOT_RUN = "not run (`validate --serving` runs them on the built-in device)"


def section_rows(rep) -> list[tuple[str, ...]]:
    """The sign-off's serving-paths table (``SECTION_HEAD``), one row per case and path, as text."""
    rows = []
    for c in rep.cases:
        for p in c.serving:
            ff = p.first_failure
            where = (f"{ff.tap} " + ", ".join(f"{k} {v:.3g}" for k, v in ff.values.items())
                     if ff is not None else (p.reason or "–"))
            rows.append((c.name, p.path, "–" if p.at is None else str(p.at), f"{p.nbytes:,}" if p.nbytes else "–",
                         p.status.upper(), f"{sum(not r.passed for r in p.results)}/{len(p.results)}", where))
    return rows


def _exact(case: str, tap: str, ref: torch.Tensor, x: torch.Tensor) -> TapResult:
    if ref.shape != x.shape:
        return TapResult(case, tap, "exact", {"max_abs": float("inf"), "rows": float(x.shape[0]),
                                              "saved_rows": float(ref.shape[0])}, {"max_abs": 0.0}, False)
    d = float((x.double() - ref.double()).abs().max()) if x.numel() else 0.0
    return TapResult(case, tap, "exact", {"max_abs": d}, {"max_abs": 0.0}, d == 0.0)


def restore_checks(case: str, saved: ModelCache, restored: ModelCache) -> list[TapResult]:
    """The restored cache against the saved one, every layer's every array, exactly."""
    out = [TapResult(case, "restore.length", "exact", {"tokens": float(restored.length)},
                     {}, restored.length == saved.length, {"tokens": float(saved.length)})]
    out += [_exact(case, "restore." + n, a, b) for (n, a), (_, b) in zip(cache_arrays(saved), cache_arrays(restored))]
    return out


def judge_path(case: str, pair: PathPair, ref: PathRun, tol: Tolerances) -> PathResult:
    if pair.cand is None:
        return PathResult(pair.path, "fail" if pair.error else "not run", pair.at, reason=pair.error or pair.reason)
    cand, res = pair.cand, []
    saved = ref.saved if pair.path == "handoff" else cand.saved
    res += restore_checks(case, saved, cand.restored)
    if pair.at is not None:
        res.append(compare_logits(case, "next_turn.logits", ref.logits[pair.at:].double(), cand.logits.double(), tol))
    res.append(compare_logits(case, "step_logits", ref.step_logits.double(), cand.step_logits.double(), tol))
    for (n, a), (_, b) in zip(cache_arrays(ref.final), cache_arrays(cand.final)):
        if a.shape != b.shape:
            res.append(_exact(case, "final." + n, a, b))
        else:
            res.append(compare_tensor(case, "final." + n, a.double().cpu(), b.double().cpu(), tol, "inherited",
                                      limits=tol.limits("inherited", n)))
    bad = [r for r in res if not r.passed]
    # checks are in the order a fault propagates: the first one failed locates it
    return PathResult(pair.path, "fail" if bad else "pass", pair.at, cand.nbytes, results=res,
                      first_failure=bad[0] if bad else None)


def turn_boundary(ids: list[int], vocab_size: int, chunk: int) -> int | None:
    """The last position after an ``<|end_of_msg|>`` inside the prompt that is off the chunk grid."""
    eom = named_special_ids(vocab_size)[END_OF_MSG]
    ends = [i + 1 for i, t in enumerate(ids) if t == eom and 0 < i + 1 < len(ids) and (i + 1) % chunk]
    return ends[-1] if ends else None


@dataclass
class ServingRun:
    """Every path of one case, and the uninterrupted run they are held to."""

    ref: PathRun
    pairs: list[PathPair]
    batch: BatchPair | None = None  # None: the batching path was not asked for

    def judge(self, case: str, tol: Tolerances) -> list["PathResult"]:
        return judge_serving(case, self, tol)


def run_paths(weights, golden: dict, ids: list[int], handoff: "Handoff | None", io: CacheIO = CacheIO(),
              ref: PathRun | None = None, others=(), batching: bool = True, case: str = "case") -> ServingRun:
    """The uninterrupted run (``ref``, made here when not given) and the paths of one case on
    ``weights`` (the device policy); ``others``: (name, ids, golden arrays) of the other cases, whose
    prompts' prefixes join the batch (``serving_batch.batch_requests``)."""
    routes, tokens = golden_routes(golden), [int(t) for t in golden["greedy_tokens"]]
    ref = uninterrupted(weights, ids, tokens, routes) if ref is None else ref
    chunk = ref_chunk(weights)
    pairs = []
    grid = chunk_grid(len(ids), chunk)
    at = grid[-1] if grid else None
    pairs.append(PathPair("resume_chunk", at, None if at is None else resume(weights, ids, tokens, at, ref.snapshots,
                                                                             routes, io),
                          "" if at else f"the prompt ({len(ids)} tokens) has no chunk boundary (chunk {chunk})"))
    at = turn_boundary(ids, weights.config.text.vocab_size, chunk)
    pairs.append(PathPair("resume_turn", at, None if at is None else resume(weights, ids, tokens, at, ref.snapshots,
                                                                            routes, io),
                          "" if at else "the prompt has no turn boundary off the chunk grid"))
    if handoff is None:
        pairs.append(PathPair("handoff", reason="the device cannot start a decoding process (--backend)"))
    else:
        try:
            pairs.append(PathPair("handoff", None, handoff.decode(io.save(ref.saved), ref.logits[-1], tokens, routes)))
        except HandoffError as e:
            pairs.append(PathPair("handoff", error=str(e)))
    return ServingRun(ref, pairs, run_batch(weights, golden, ids, others, case=case) if batching else None)


def ref_chunk(weights) -> int:
    from k3bundle.executor import Executor

    return Executor(weights).chunk


def judge_serving(case: str, run: ServingRun, tol: Tolerances) -> list[PathResult]:
    out = [judge_path(case, p, run.ref, tol) for p in run.pairs]
    return out if run.batch is None else out + [judge_batch(case, run.batch, tol)]


def judge_batch(case: str, pair: BatchPair, tol: Tolerances) -> PathResult:
    if not pair.cands:
        return PathResult("batching", "not run", reason=pair.reason)
    res = batch_checks(case, pair, tol)
    bad = [r for r in res if not r.passed]
    return PathResult("batching", "fail" if bad else "pass", reason=describe(pair), results=res,
                      first_failure=bad[0] if bad else None)


def decode_child(workdir: str) -> None:
    """The decoding process (``python -m k3bundle.validate.serving DIR``): ``DIR/request.json``
    names the weights, the tokens and the engine's load (``module:function``); ``DIR/prefill.k3cache``
    holds the prefill's bytes, ``DIR/arrays.npz`` the prefill's last logits row and the routes.
    Writes ``DIR/steps.npy`` (decode step logits), ``DIR/restored.k3cache`` and ``DIR/final.k3cache``."""
    from k3bundle.bundle.open_weights import open_weights

    d = Path(workdir)
    req = json.loads((d / "request.json").read_text())
    torch.set_num_threads(int(req["threads"]))
    module, _, name = req["load"].partition(":")
    load = getattr(importlib.import_module(module), name)
    with np.load(d / "arrays.npz") as z:
        last_V = torch.from_numpy(z["last_logits"])
        routes = {k[len("routes/"):]: torch.from_numpy(z[k]) for k in z.files if k.startswith("routes/")}
    w = open_weights(req["source"], req["policy"], req["device"])
    run = decode_from(w, (d / "prefill.k3cache").read_bytes(), last_V, req["tokens"], routes, CacheIO(load=load))
    np.save(d / "steps.npy", run.step_logits.float().numpy())
    (d / "restored.k3cache").write_bytes(to_bytes(run.restored))
    (d / "final.k3cache").write_bytes(to_bytes(run.final))


@dataclass
class Handoff:
    """The decoding side of a handoff: another process (``decode_child``), fed the prefill's bytes."""

    source: str
    policy: str
    device: str
    load: str = "k3bundle.executor.cache_handoff:from_bytes"  # the decoding engine's load (a planted fault replaces it)

    def decode(self, data: bytes, last_V: torch.Tensor, tokens: list[int], routes: dict) -> PathRun:
        with tempfile.TemporaryDirectory(prefix="k3-handoff-") as tmp:
            d = Path(tmp)
            (d / "prefill.k3cache").write_bytes(data)
            np.savez(d / "arrays.npz", last_logits=last_V.float().cpu().numpy(),
                     **{f"routes/{k}": v.cpu().numpy() for k, v in routes.items()})
            (d / "request.json").write_text(json.dumps({
                "source": self.source, "policy": self.policy, "device": self.device, "tokens": list(tokens),
                "load": self.load, "threads": torch.get_num_threads()}))
            try:
                r = subprocess.run([sys.executable, "-m", "k3bundle.validate.serving", str(d)], capture_output=True,
                                   text=True, timeout=HANDOFF_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise HandoffError(f"the decoding process gave no answer in {HANDOFF_TIMEOUT_S} s") from None
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["no output"])[-1]
                raise HandoffError(f"the decoding process failed (exit {r.returncode}): {last}")
            steps = torch.from_numpy(np.load(d / "steps.npy"))
            return PathRun(last_V[None].cpu(), steps, from_bytes((d / "final.k3cache").read_bytes()),
                           restored=from_bytes((d / "restored.k3cache").read_bytes()), nbytes=len(data))


if __name__ == "__main__":
    decode_child(sys.argv[1])
