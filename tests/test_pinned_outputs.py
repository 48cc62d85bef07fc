"""Behaviour pins: the bytes of the tiny checkpoint and of every shipped layout's tiny bundle, and
what of the tiny checkpoint's goldens is the same on every machine.

These pins were recorded with ``bench/pin_outputs.py`` and must not move when code is
reorganised. They are regression pins, not correctness oracles: correctness is proven elsewhere
(``verify --source`` reassembles every pass-through byte; the codecs match the OCP MX spec and
torchao; the executor matches float64 references). A change that *intends* to alter these outputs
must record them again and say why in its commit.

What is pinned, and why each pin is one value on every machine:

- **Checkpoint and bundles, exactly** (sha256 of every file): synthetic weights come from a
  stream defined bit for bit on every platform and are rounded once to their stored dtype
  (k3bundle/synth/stream.py, docs/synthetic-models.md); convert only moves and re-encodes bytes
  with integer and exact operations.
- **The goldens' decisions, exactly**: the hash of every integer array of the goldens (prompt ids,
  greedy tokens, routed experts at every position, tapped positions;
  ``k3bundle.golden.identity.decisions_hash``), at one thread. A decision is a comparison of
  floats; it is the same on every machine unless it lies within rounding of a tie. The test
  shows none does: a float64 run of the same goldens, whose values differ from float32's by far
  more than float32 runs on two machines differ from each other, makes every same decision.
- **The goldens' floats, through float64**: each float32 golden array agrees with the float64 run
  (NMSE at most 1e-6: float32 rounds to 6e-8, an NMSE of 3.6e-15, which the model amplifies; the
  worst measured is 3.5e-9, on the router margins, differences of near-equal scores), and
  the float64 run's per-case fingerprint (``identity.fingerprint``) agrees with its pin to a
  relative 1e-9 (float64 rounding is about 1e-16).

Not pinned: the last bits of the float32 goldens, hence their full content hash. Their summation
order follows the CPU's GEMM kernel, so the same code gives another content hash on another class
of machine (it reproduces on one machine, at one thread); the BF16-noise scalars
(``bf16_noise.*``), for the same reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from k3bundle.io.files import tree_digest
from tests._bundles import SHIPPED, bundles, one_torch_thread, single_threaded_torch  # noqa: F401

CHECKPOINT_DIGEST = "e238d79c3cd1de0a0fb32607f0d6229eb7a5ef066308eb905bb1f771c8470963"  # synth --preset tiny --seed 0
BUNDLE_DIGESTS = {
    "b200-tp8-pp2": "414ee55be50658c0fd7c8ce9ee027896560e98ae86b92ae4d39bd5560dafbf10",
    "b300-tp8": "92e97fb572fa72b7dfd2e106bb6f70c790a9a2e239a0881cb4bf27e73e29838b",
    "gb300-dep16": "62024c2e705ae36d8a3b2ca127643f9d4f6ef1ab5b168a0c057507ee9f237e2c",
    "h200-tp16-ep16": "962ef2369970212ab4a4f0ce401d481cf343519dcf3dcc19d7f337e5c1d2b633",
    "mi355x-tp8": "9cd6ca09f517afa68303f72a9e78ef1eef87b701d0f963430c0579026aeeb53f",
    "new-accelerator.example": "023366ac7c293b9735722900984e4cf911c6a5e91cdcf37c337c96746f732847",
}
GOLDEN_DECISIONS = "4fdc3c4584c45e38c55ba10cdc37a41f8c372bd9c962140356db7386e8640dda"  # with the image case (runs since the vision tower)
# per case: [signed sum, norm, values] of the float64 run (long-context case at 256 tokens)
GOLDEN_FLOAT64_FINGERPRINT = {
    "greedy": [-1425.143451865566, 688.6441428305798, 914464],
    "image": [-232.40070244879877, 861.9050831172136, 1043392],
    "long_context": [-758.4299441437253, 743.5957949026564, 906176],
    "multi_turn": [158.59773047525613, 2121.906969550214, 5658624],
    "thinking": [-1141.1320734481158, 1638.3687567276131, 3522528],
    "tool_call": [-2124.287765764117, 2667.7456491373164, 8705824],
}
NMSE_LIMIT = 1e-6


def test_every_shipped_layout_is_pinned():
    assert sorted(BUNDLE_DIGESTS) == sorted(SHIPPED)


def test_checkpoint_bytes_are_pinned(tiny_ckpt):
    assert tree_digest(tiny_ckpt) == CHECKPOINT_DIGEST


@pytest.mark.parametrize("layout", SHIPPED)
def test_bundle_bytes_are_pinned(bundles, layout):
    assert tree_digest(bundles[layout]) == BUNDLE_DIGESTS[layout]


@pytest.fixture(scope="module")
def goldens(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint's goldens at one thread in float32 (as shipped) and in float64, with
    the readable forms: the pins predate the fast ones, which are pinned to these by
    tests/test_executor_fast.py (same function, other summation order)."""
    from k3bundle.golden.generate import generate_goldens
    from k3bundle.golden.store import read_npz

    out = tmp_path_factory.mktemp("goldens")
    with one_torch_thread():
        generate_goldens(tiny_ckpt, out=out / "f32", long_tokens=256, forms="readable")
        generate_goldens(tiny_ckpt, out=out / "f64", long_tokens=256, forms="readable", dtype="float64", noise=False)
    return {d: (read_npz(out / d / "golden_inputs.npz"), read_npz(out / d / "golden_intermediates.npz"))
            for d in ("f32", "f64")}


def test_golden_decisions_are_pinned(goldens):
    from k3bundle.golden.identity import decisions_hash

    assert decisions_hash(*goldens["f32"]) == GOLDEN_DECISIONS
    assert any(".added." in k for k in goldens["f32"][1])  # the teacher-forced BF16 noise is there


def test_float64_makes_every_same_decision_and_agrees_with_float32(goldens):
    from k3bundle.golden.identity import decisions_hash

    (in32, g32), (in64, g64) = goldens["f32"], goldens["f64"]
    assert decisions_hash(in64, g64) == decisions_hash(in32, g32)
    compared = 0
    for name, want in g64.items():
        got = g32[name]
        if want.dtype.kind != "f" or name == "__meta__" or not want.size:
            continue
        err = float(((got.astype(np.float64) - want) ** 2).sum())
        assert err <= NMSE_LIMIT * float((want ** 2).sum()), name
        compared += 1
    assert compared > 600


def test_float64_fingerprint_is_pinned(goldens):
    from k3bundle.golden.identity import fingerprint, fingerprint_matches

    assert fingerprint_matches(fingerprint(goldens["f64"][1]), GOLDEN_FLOAT64_FINGERPRINT) == []


def test_fingerprint_holds_under_rounding_and_sees_one_value_move():
    from k3bundle.golden.identity import fingerprint, fingerprint_matches

    rng = np.random.default_rng(0)
    arrays = {"case/x": rng.standard_normal(10_000), "case/ids": np.arange(5)}
    pin = fingerprint(arrays)
    assert fingerprint_matches(fingerprint(arrays), pin) == []
    nudged = dict(arrays, **{"case/x": arrays["case/x"] * (1 + 1e-15)})  # float64 rounding: holds
    assert fingerprint_matches(fingerprint(nudged), pin) == []
    moved = arrays["case/x"].copy()
    moved[0] += 1e-5  # one value of 10,000 by 1e-5: far below what any fault moves
    assert fingerprint_matches(fingerprint({**arrays, "case/x": moved}), pin) == ["case"]
