"""What of a golden run is the same on every machine, and how to state it.

The content hash (``store.content_hash``) covers every bit of every array, and float32 or float64
arrays end in bits that follow the CPU's GEMM kernel (its summation order): the same code and
weights give another content hash on another class of machine. Two things do not:

- the **decisions**: every integer array (the prompt ids, the greedy tokens, the routed experts
  at every position, the tapped positions). Each is a comparison of floats; unless one lies
  within rounding of a tie, it comes out the same everywhere. ``decisions_hash`` is their sha256.
- a **float64 fingerprint**: per case, a fixed signed sum of every float array's values and their
  Euclidean norm. A float64 run differs between machines by rounding (about 1e-16 relative,
  amplified by the model), far below what any change of the computation moves, so the
  fingerprint agrees to a relative 1e-9 everywhere (``fingerprint_matches``).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from k3bundle.golden.store import META_KEY, content_hash

FINGERPRINT_RTOL = 1e-9
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Weyl step: an integer hash of the element index


def decisions_hash(inputs: dict[str, np.ndarray], intermediates: dict[str, np.ndarray]) -> str:
    """sha256 over the goldens' integer arrays: the inputs file's and the intermediates'."""
    ints = {f"{part}:{k}": v for part, arrays in (("inputs", inputs), ("intermediates", intermediates))
            for k, v in arrays.items() if k != META_KEY and v.dtype.kind in "iub"}
    return content_hash(ints)


def _weights(n: int) -> np.ndarray:
    """n fixed weights in [-1, 1), from the element index by integer arithmetic only."""
    with np.errstate(over="ignore"):
        h = np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -52 - 1.0


def fingerprint(intermediates: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """{case: [signed sum, Euclidean norm, values]} over every float array of the case, in name
    order; the sum weighs each value by a fixed weight in [-1, 1)."""
    out: dict[str, list[float]] = {}
    for name in sorted(intermediates):
        a = intermediates[name]
        if name == META_KEY or a.dtype.kind != "f":
            continue
        case = name.split("/", 1)[0]
        x = np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
        s, sq, n = out.setdefault(case, [0.0, 0.0, 0])
        out[case] = [s + float(x @ _weights(x.size)), sq + float(x @ x), n + x.size]
    return {case: [s, math.sqrt(sq), n] for case, (s, sq, n) in out.items()}


def fingerprint_matches(got: dict[str, list[float]], want: dict[str, list[float]]) -> list[str]:
    """The cases whose fingerprints differ beyond float64 rounding (empty: they match): the sum
    and the norm each within ``FINGERPRINT_RTOL`` of the pinned norm. Rounding moves the values by
    a relative ~1e-13 (1e-16 amplified by the model), so the signed sum by about that times the
    norm (at most times sqrt(n) ~ 1e3, were every error aligned with the weights)."""
    bad = [c for c in sorted(set(got) | set(want)) if c not in got or c not in want]
    for case in sorted(set(got) & set(want)):
        (s, norm, n), (s0, norm0, n0) = got[case], want[case]
        if n != n0 or abs(norm - norm0) > FINGERPRINT_RTOL * norm0 \
                or abs(s - s0) > FINGERPRINT_RTOL * norm0:
            bad.append(case)
    return bad
