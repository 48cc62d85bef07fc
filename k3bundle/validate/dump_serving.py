"""A dump's own serving paths (docs/dump-format.md "Serving paths"): optional ``serving.PATH.TAP``
entries of ``DIR/CASE.safetensors``, each judged against the same dump's uninterrupted ``TAP``.

An external runtime that resumes a prefix cache, hands a prefill to a decoder or batches requests
submits what that path computed for the case's request, under the tap names of the dump itself:

- ``serving.resume_chunk.*`` / ``serving.resume_turn.*``: ``at`` (int64 [1], the prompt tokens
  restored), the prompt taps at the tapped positions from ``at`` on, decode taps, ``step_logits``;
- ``serving.handoff.*``: what the decoding side computed (decode taps, ``step_logits``);
- ``serving.batching.*``: the case's request run in a batch with others: prompt taps, decode taps,
  ``step_logits``, states, and optionally ``lengths`` (int64 [B], every prompt length of the batch).

Judged as ``validate --serving`` judges the built-in device's paths: in the order a fault
propagates (prompt taps and states by layer, then decode taps by layer, then ``step_logits``),
tensors by the ``inherited`` limits of their kind, logits by the logits limits; the first failure
names the path, layer and tap. A path with no entries is reported "not submitted", never passed.
"""

from __future__ import annotations

import numpy as np
import torch

from k3bundle.executor.taps import forward_key, spec_of
from k3bundle.file_names import (
    DUMP_BATCH_LENGTHS, DUMP_SERVING_AT, DUMP_SERVING_PATHS, DUMP_SERVING_PREFIX, DUMP_SERVING_RESUMES,
)
from k3bundle.golden.tolerances import Tolerances
from k3bundle.validate.compare import TapResult, compare_logits, compare_tensor
from k3bundle.validate.serving import PathResult

META = (DUMP_SERVING_AT, DUMP_BATCH_LENGTHS)


def split(name: str) -> tuple[str, str] | None:
    """``serving.PATH.TAP`` -> (PATH, TAP); None for any other name."""
    head, _, rest = name.partition(".")
    if head != DUMP_SERVING_PREFIX:
        return None
    path, _, tap = rest.partition(".")
    return path, tap


def _prompt_rows(tap: str) -> bool:
    """A tap with one row per tapped prompt position (a resume submits only those from ``at`` on)."""
    spec = spec_of(tap)
    return not tap.startswith(("decode.", "decode_states.")) and tap != "step_logits" and spec is not None \
        and not spec.state


def check_entries(get, keys: set[str], golden: dict[str, np.ndarray], extra: tuple[str, ...]) -> tuple[list[str], dict]:
    """Every ``serving.…`` tensor of a dump (``get(name)``) checked: a known path, a counterpart
    ``TAP`` in the dump, the golden's shape (a resume's prompt taps: its rows from ``at`` on), ids
    in range. Returns (problems, one line each naming the tensor; the tensors that passed)."""
    problems, out = [], {}
    if not any(split(k) is not None for k in keys):
        return problems, out  # no serving entries: nothing to check (goldens need no positions then)
    positions = golden["positions"]
    prompt = int(positions.max()) + 1 if positions.size else 0
    ats = {}
    for name in sorted(k for k in keys if split(k) is not None):
        path, tap = split(name)
        if path not in DUMP_SERVING_PATHS:
            problems.append(f"tensor {name!r}: {path!r} is not a serving path ({', '.join(DUMP_SERVING_PATHS)})")
            continue
        t = get(name)
        if tap in META:
            if (tap == DUMP_SERVING_AT) != (path in DUMP_SERVING_RESUMES) or (tap == DUMP_BATCH_LENGTHS
                                                                           and path != "batching"):
                problems.append(f"tensor {name!r}: {path} has no {tap!r} entry")
            elif t.dtype.is_floating_point or t.dim() != 1 or not t.numel() or int(t.min()) < 1:
                problems.append(f"tensor {name!r} must be positive integers [n], got {str(t.dtype)[6:]} {list(t.shape)}")
            elif tap == DUMP_SERVING_AT and not (t.numel() == 1 and int(t[0]) < prompt):
                problems.append(f"tensor {name!r} must be one position inside the prompt (1..{prompt - 1})")
            else:
                out[name] = t
                ats[path] = int(t[0])
            continue
        if tap not in golden and tap not in extra:
            problems.append(f"tensor {name!r}: {tap!r} is not a golden tap of the case")
            continue
        if tap not in keys:
            problems.append(f"tensor {name!r} has no {tap!r} in the dump to be judged against "
                            "(a serving path is held to the dump's own uninterrupted run)")
            continue
        out[name] = t
    for name in list(out):
        path, tap = split(name)
        if tap in META:
            continue
        t, want = out[name], golden.get(tap)
        shape = None if want is None else list(want.shape)
        if path in DUMP_SERVING_RESUMES and _prompt_rows(tap):
            if path not in ats:
                problems.append(f"tensor {name!r} needs {DUMP_SERVING_PREFIX}.{path}.{DUMP_SERVING_AT}")
                del out[name]
                continue
            shape[0] = int((positions >= ats[path]).sum())
        if shape is not None and list(t.shape) != shape:
            problems.append(f"tensor {name!r} has shape {list(t.shape)}, expected {shape}")
            del out[name]
        elif t.dtype.is_floating_point == (want is not None and want.dtype.kind in "iub"):
            kind = "integer ids" if t.dtype.is_floating_point else "floats"
            problems.append(f"tensor {name!r} has dtype {str(t.dtype)[6:]}; this entry holds {kind}")
            del out[name]
        elif t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            problems.append(f"tensor {name!r} has {int((~torch.isfinite(t)).sum())} NaN/Inf value(s)")
            del out[name]
    return problems, out


def _order(tap: str) -> tuple:
    return (True, 10**9 + 1, 0, tap) if tap == "step_logits" else forward_key(tap)


class DumpServing:
    """The serving entries of one case's dump, judged when the case is (``judge``)."""

    def __init__(self, cand: dict[str, torch.Tensor], positions: np.ndarray):
        self.cand, self.positions = cand, torch.as_tensor(positions)

    def judge(self, case: str, tol: Tolerances) -> list[PathResult]:
        return [self._path(case, path, tol) for path in DUMP_SERVING_PATHS]

    def _path(self, case: str, path: str, tol: Tolerances) -> PathResult:
        p = f"{DUMP_SERVING_PREFIX}.{path}."
        mine = {k[len(p):]: v for k, v in self.cand.items() if k.startswith(p)}
        judged = {k: v for k, v in mine.items() if k not in META and self._how(k)}
        at = int(mine[DUMP_SERVING_AT][0]) if DUMP_SERVING_AT in mine else None
        if not judged:
            return PathResult(path, "not submitted", at, reason=f"the dump has no {p}… taps (docs/dump-format.md)")
        res = []
        for tap in sorted(judged, key=_order):
            ref, x = self.cand[tap], judged[tap]
            if at is not None and _prompt_rows(tap):
                ref = ref[self.positions >= at]
            res.append(self._compare(case, p + tap, tap, ref, x, tol))
        bad = [r for r in res if not r.passed]
        lengths = mine.get(DUMP_BATCH_LENGTHS)
        reason = "" if lengths is None else "batch of prompts " + ", ".join(str(int(n)) for n in lengths)
        return PathResult(path, "fail" if bad else "pass", at, reason=reason, results=res,
                          first_failure=bad[0] if bad else None)

    @staticmethod
    def _how(tap: str) -> str | None:
        if tap == "step_logits":
            return "logits"
        spec = spec_of(tap)
        return spec.judged if spec is not None and spec.judged in ("tensor", "logits") else None

    def _compare(self, case: str, name: str, tap: str, ref, x, tol: Tolerances) -> TapResult:
        ref, x = ref.double(), x.double()
        if self._how(tap) == "logits":
            return compare_logits(case, name, ref, x, tol)
        return compare_tensor(case, name, ref, x, tol, "inherited", limits=tol.limits("inherited", tap))
