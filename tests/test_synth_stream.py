"""The portable random stream behind synthetic weights (k3bundle/synth/stream.py) and the one
rounding to BF16 (k3bundle/synth/weights.round_bf16).

Oracles: PCG64 written here from O'Neill's definition (128-bit LCG, XSL-RR output) in Python
integers; the ziggurat's layers checked against the normal density with ``math`` and
``math.erfc``; draws against ``statistics.NormalDist`` (Kolmogorov-Smirnov, tail mass); exp/log
against ``math``; BF16 rounding against exact rational arithmetic (``fractions``). The
known-answer values pin the stream itself: on a platform where any of them differs, synthetic
checkpoints are not the same bytes as everywhere else.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from fractions import Fraction

import numpy as np
import pytest
import torch

from k3bundle.synth import stream
from k3bundle.synth.weights import round_bf16

MULT = 0x2360ED051FC65DA44385DF649FCCF645  # PCG's default 128-bit multiplier
M128 = (1 << 128) - 1


def pcg64_words(seed: int, name: str, n: int) -> list[int]:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    state, inc = int.from_bytes(digest[:16], "little"), int.from_bytes(digest[16:], "little") | 1
    out = []
    for _ in range(n):
        state = (state * MULT + inc) & M128  # step, then output the new state
        x, rot = ((state >> 64) ^ state) & (2**64 - 1), state >> 122
        out.append(((x >> rot) | (x << (64 - rot))) & (2**64 - 1))
    return out


def test_words_are_pcg64_of_the_name():
    s = stream.Stream(7, "language_model.model.embed_tokens.weight")
    assert s.words(300).tolist() == pcg64_words(7, "language_model.model.embed_tokens.weight", 300)
    assert stream.Stream(8, "x").words(4).tolist() != stream.Stream(7, "x").words(4).tolist()


def test_known_answers():
    """The first draws of one stream bit for bit (hex floats), and the digest of 200,000 normals
    (about 2,000 of them decided outside their layer's core, some 50 in the tail): the
    cross-machine pin of the stream, recorded once."""
    s = stream.Stream(0, "k3bundle")
    assert [float.hex(float(v)) for v in s.normal(6)] == [
        "-0x1.db0764bcedf81p-1", "0x1.5b92573d4d475p+0", "0x1.a5d58633e6d00p+0",
        "-0x1.5e248d7aba0d7p-2", "0x1.3da3b391f8c24p-1", "-0x1.065a273db97a6p+0"]
    assert [float.hex(float(v)) for v in s.uniform(3)] == [
        "0x1.00bfddf8f0e4cp-3", "0x1.e37e34d28cfc9p-1", "0x1.fdfce75565aa8p-2"]
    s = stream.Stream(0, "k3bundle-slow-path")
    assert hashlib.sha256(s.normal(200_000).astype("<f8").tobytes()).hexdigest() == \
        "30908a7e04a2ff1268169707d91cc989f4c45de7ef7f805bd3f2ac46bad62f2b"
    assert hashlib.sha256(s.uniform(1000).astype("<f8").tobytes()).hexdigest() == \
        "81dfacbf45285030a06706a591752b571e60bd34b78ec98782a7ac5113ffae9a"


def test_uniforms_are_53_bit_fractions_of_the_words():
    words = stream.Stream(1, "u").words(1000)
    u = stream.Stream(1, "u").uniform(1000)
    assert [Fraction(float(v)) for v in u] == [Fraction(int(w) >> 11, 2**53) for w in words]


def test_ziggurat_layers_have_equal_area_under_the_normal_density():
    ki, wi, fi, df = stream.ziggurat()
    x = [float(w) * 2.0**52 for w in wi] + [0.0]
    f = [math.exp(-v * v / 2) for v in x]
    r, v = 3.6541528853610088, 0.00492867323399
    assert x[1] == r and x[0] * math.exp(-r * r / 2) == pytest.approx(v, rel=1e-14)
    tail = math.sqrt(math.pi / 2) * math.erfc(r / math.sqrt(2))  # the density's mass beyond r
    assert v - r * f[1] == pytest.approx(tail, rel=1e-9)  # the base strip's excess is the tail
    for i in range(1, 256):  # every layer above the base: width x_i, from f(x_i) to f(x_{i+1})
        assert x[i] * (f[i + 1] - f[i]) == pytest.approx(v, rel=1e-8), i
        assert fi[i] == pytest.approx(f[i], rel=1e-15) and fi[i] + df[i] == pytest.approx(f[i + 1], rel=1e-15)
        assert abs(int(ki[i]) - x[i + 1] / x[i] * 2**52) <= 4  # the core: x < x_{i+1} (float64 ratio)
    assert abs(int(ki[0]) - r / x[0] * 2**52) <= 4  # the base strip's core ends at r
    assert x[255] > 0 and ki[255] == 0  # the top layer has no core: all wedge


def test_a_draw_in_its_layers_core_is_the_product_of_its_bits():
    ki, wi, _, _ = stream.ziggurat()
    words = stream.Stream(3, "core").words(2000)
    z = stream.Stream(3, "core").normal(2000)
    checked = 0
    for w, v in zip(words.tolist(), z.tolist()):
        layer, whole = w & 0xFF, w >> 12
        if whole >= int(ki[layer]):
            break  # from here on the stream also feeds the rejected draws' extra words
        assert v == (-1 if w & 0x100 else 1) * (whole * float(wi[layer])), w
        checked += 1
    assert checked > 20


def test_normals_are_standard_normal():
    n = 1_000_000
    z = stream.Stream(0, "normal").normal(n)
    nd = statistics.NormalDist()
    zs = np.sort(z)
    cdf = np.array([nd.cdf(v) for v in zs[::10]])  # KS on every 10th order statistic
    emp_hi = (np.arange(0, n, 10) + 1) / n
    assert np.max(np.maximum(np.abs(cdf - emp_hi), np.abs(cdf - emp_hi + 1 / n))) < 1.95 / math.sqrt(n)
    r = 3.6541528853610088
    p_tail = 2 * (1 - nd.cdf(r))  # beyond the ziggurat's tail edge: drawn by the slow path
    k = int(np.sum(np.abs(z) > r))
    assert abs(k - n * p_tail) < 5 * math.sqrt(n * p_tail), (k, n * p_tail)
    p_wedge = 2 * (1 - nd.cdf(2.0))
    k2 = int(np.sum(np.abs(z) > 2.0))
    assert abs(k2 - n * p_wedge) < 5 * math.sqrt(n * p_wedge * (1 - p_wedge))
    assert abs(z.mean()) < 5 / math.sqrt(n) and abs(z.var() - 1) < 5 * math.sqrt(2 / n)
    assert abs(np.sum(z < 0) - n / 2) < 5 * math.sqrt(n / 4)


@pytest.mark.parametrize("lo,hi", [(-7.0, 0.0), (-700.0, 700.0)])
def test_exp_is_within_two_ulps(lo, hi):
    y = np.linspace(lo, hi, 20001)
    got = stream.exp(y)
    want = np.array([math.exp(v) for v in y])
    assert np.all(np.abs(got - want) <= 2 * np.spacing(want))


@pytest.mark.parametrize("lo,hi", [(2.0**-53, 1.0), (1.0, 16.0), (1e-300, 1e300)])
def test_log_is_within_two_ulps(lo, hi):
    x = np.geomspace(lo, hi, 20001)
    got = stream.log(x)
    want = np.array([math.log(v) for v in x])
    assert np.all(np.abs(got - want) <= 2 * np.spacing(np.abs(want)) + (want == 0))
    assert stream.log(np.array([1.0]))[0] == 0.0


def _bf16_exact(x: float) -> float:
    """Nearest BF16 (8 significant bits), ties to even, by exact rational arithmetic."""
    if x == 0:
        return x
    q = Fraction(abs(x))
    e = math.floor(math.log2(abs(x)))
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    ulp = Fraction(2) ** (e - 7)
    lo = (q // ulp) * ulp
    hi = lo + ulp
    pick = lo if q - lo < hi - q else hi if q - lo > hi - q else (lo if (lo / ulp) % 2 == 0 else hi)
    return math.copysign(float(pick), x)


def test_round_bf16_rounds_once():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(3000) * 10.0 ** rng.integers(-30, 30, 3000),
                        [1 + 2**-8 + 2**-40, -(1 + 2**-8 + 2**-40), 1 + 2**-8, 1 + 3 * 2**-8, 0.0, -0.0,
                         float.fromhex("0x1.ff8p0"), 2.0**-126]])
    got = round_bf16(torch.from_numpy(x)).float().double().numpy()
    want = np.array([_bf16_exact(float(v)) for v in x])
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
    assert got[-8] == 1 + 2**-7  # above the midpoint: a rounding through float32 would give 1
    f32 = torch.from_numpy(x.astype(np.float32))
    assert torch.equal(round_bf16(f32), f32.to(torch.bfloat16))  # float32 is rounded once by torch
