"""A random stream whose every bit is defined on every platform: PCG64 words, uniforms, normals.

Synthetic checkpoints are products of hashes, so ``synth --preset P --seed S`` must write the
same bytes on any machine. ``torch.randn`` does not: its Box-Muller transform runs libm-style
``log``/``cos`` in float32, whose last bit differs between CPU builds, and a last bit now and
then survives the BF16 rounding. numpy's ``Generator.standard_normal`` is no better: its
ziggurat decides a rejected draw with libm ``exp`` (and the tail with ``log1p``), compilers may
fuse its multiply-add into an FMA on one platform and not another, and numpy does not promise
that a ``Generator`` method's stream stays the same between versions.

What is defined here, and why each step is the same everywhere:

- **Words**: PCG64 (O'Neill's 128-bit LCG with the XSL-RR output, as ``numpy.random.PCG64``
  implements it; numpy keeps a bit generator's raw stream fixed across versions), its 128-bit
  state and odd increment taken straight from ``sha256(f"{seed}:{name}")`` (no seeding
  algorithm in between). Integer arithmetic only; ``tests/test_synth_stream.py`` checks the words
  against a pure-Python PCG64.
- **Uniforms**: ``(word >> 11) * 2**-53``, exact in float64.
- **Normals**: a 256-layer ziggurat (Marsaglia and Tsang, r = 3.6541528853610088,
  v = 0.00492867323399, the layout numpy uses). Its tables are computed at 60 digits with
  ``decimal`` (software arithmetic, correctly rounded, the same on every machine) and rounded
  once to float64. A word gives the layer (8 bits), the sign (1 bit) and a 52-bit integer;
  99% of draws are accepted by an integer comparison and are one correctly rounded product of
  that integer and a table entry. The rest (a wedge or the tail beyond r) take two more words
  each and are decided with ``exp`` and ``log`` written here from IEEE-754 operations that are
  correctly rounded by the standard (+, -, *, /, and exact scaling by powers of two) in a fixed
  order, never libm's and never fused. A position still rejected draws a fresh word, in
  position order, until every position is accepted.

So a stream is a function of (seed, name) alone on any IEEE-754 machine with numpy, whatever
its CPU, SIMD width, libm or compiler.
"""

from __future__ import annotations

import functools
import hashlib
import math
from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext

import numpy as np

LAYERS = 256
_R = Decimal("3.6541528853610088")  # the ziggurat's tail edge for 256 layers
_V = Decimal("0.00492867323399")  # the area of each layer
_U52 = np.uint64(12)  # a word's top 52 bits: the place inside a layer
_U53 = np.uint64(11)
_LAYER_BITS = np.uint64(0xFF)
_SIGN_BIT = np.uint64(0x100)
_CHUNK = 1 << 15  # words per piece of the first pass: the piece stays in cache

# ln 2 split so that k * LN2_HI is exact for |k| < 2**11 (fdlibm's constants)
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
_SQRT_HALF = 0.7071067811865476


@functools.cache
def ziggurat() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(KI, WI, FI, DF): per layer i, accept integer i < KI[i]; x = i * WI[i]; the wedge runs
    from FI[i] up by DF[i]. Layer 0 is the base strip (its excess is the tail beyond r).
    Every operation runs in one 60-digit context, whatever the thread's own decimal context."""
    with localcontext(Context(prec=60, rounding=ROUND_HALF_EVEN, Emin=-999999, Emax=999999)):
        def f(x: Decimal) -> Decimal:  # the unnormalised density exp(-x^2 / 2)
            return (-(x * x) / 2).exp()

        x = [_V / f(_R), _R]  # right edges: x[0] is the base strip's width, x[1] = r
        for i in range(1, LAYERS - 1):
            x.append((-2 * (f(x[i]) + _V / x[i]).ln()).sqrt())
        x.append(Decimal(0))  # the top layer's core edge
        scale = Decimal(2) ** 52
        fx = [f(v) for v in x]
        ki = np.array([int(x[i + 1] / x[i] * scale) for i in range(LAYERS)], dtype=np.uint64)
        wi = np.array([float(x[i] / scale) for i in range(LAYERS)])
        fi = np.array([float(fx[i]) for i in range(LAYERS)])
        df = np.array([float(fx[i + 1] - fx[i]) for i in range(LAYERS)])
    return ki, wi, fi, df


def _horner(coefficients: tuple[float, ...], x: np.ndarray) -> np.ndarray:
    acc = np.full_like(x, coefficients[-1])
    for c in coefficients[-2::-1]:
        acc *= x
        acc += c
    return acc


_EXP_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(14))  # |t| <= ln2/2: 4e-18


def exp(y: np.ndarray) -> np.ndarray:
    """exp(y) for float64 y in [-700, 700] from correctly rounded operations only (~1 ulp)."""
    k = np.rint(y * _INV_LN2)
    t = (y - k * _LN2_HI) - k * _LN2_LO
    return np.ldexp(_horner(_EXP_TAYLOR, t), k.astype(np.int32))


_ATANH_SERIES = tuple(1.0 / (2 * j + 1) for j in range(11))  # |s| <= 0.172: s^23/23 < 2e-19


def log(x: np.ndarray) -> np.ndarray:
    """ln(x) for positive, finite, normal float64 x from correctly rounded operations (~1 ulp):
    x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh((m - 1) / (m + 1))."""
    m, e = np.frexp(x)  # exact: m in [0.5, 1)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)
    e = (e - low).astype(np.float64)
    f = m - 1.0  # exact (Sterbenz)
    s = f / (2.0 + f)
    return e * _LN2_HI + (e * _LN2_LO + 2.0 * s * _horner(_ATANH_SERIES, s * s))


class Stream:
    """The words, uniforms and normals of one (seed, name), drawn in order."""

    def __init__(self, seed: int, name: str):
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        self._bits = np.random.PCG64()
        self._bits.state = {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0, "state": {
            "state": int.from_bytes(digest[:16], "little"),
            "inc": int.from_bytes(digest[16:], "little") | 1}}

    def words(self, n: int) -> np.ndarray:
        """The next ``n`` 64-bit words (uint64)."""
        return self._bits.random_raw(n)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` float64 uniforms in [0, 1), 53 bits each."""
        return (self.words(n) >> _U53).astype(np.float64) * 2.0 ** -53

    def normal(self, n: int) -> np.ndarray:
        """``n`` float64 standard normals."""
        out = np.empty(n)
        pos, words = [np.empty(0, np.intp)], [np.empty(0, np.uint64)]
        for start in range(0, n, _CHUNK):  # cache-sized pieces; the words stay in order
            piece = out[start:start + _CHUNK]
            w = self.words(piece.size)
            miss = np.flatnonzero(~_in_core(w, piece))
            pos.append(start + miss)
            words.append(w[miss])
        pos, words = np.concatenate(pos), np.concatenate(words)
        while pos.size:  # draws outside their layer's core, in position order
            accepted, value, tail = self._outside_core(words)
            out[pos[accepted]] = value[accepted]
            again = pos[~accepted & ~tail]  # a rejected wedge starts over with a new word
            w = self.words(again.size)
            x = np.empty(again.size)
            core = _in_core(w, x)
            out[again[core]] = x[core]
            keep = ~accepted & tail  # the tail is sampled until it gives a value
            pos = np.concatenate([pos[keep], again[~core]])
            words = np.concatenate([words[keep], w[~core]])
            order = np.argsort(pos, kind="stable")
            pos, words = pos[order], words[order]
        return out

    def _outside_core(self, words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decide draws outside their layer's core with two more words each:
        (accepted, value, in the tail)."""
        _, wi, fi, df = ziggurat()
        layer = (words & _LAYER_BITS).astype(np.intp)
        x = (words >> _U52).astype(np.float64) * wi[layer]
        u = self.uniform(2 * words.size).reshape(-1, 2)
        r = float(_R)
        # the tail beyond r (Marsaglia 1964): r + xx with xx = -ln(U1) / r, accepted when
        # -2 ln(U2) > xx^2; 1 - U lies in (0, 1], so log never sees 0
        xx = -log(1.0 - u[:, 0]) / r
        yy = -log(1.0 - u[:, 1])
        tail = layer == 0
        # a wedge: a uniform height between the layer's bottom and top, under the density
        wedge = fi[layer] + u[:, 0] * df[layer] < exp(-0.5 * (x * x))
        accepted = np.where(tail, yy + yy > xx * xx, wedge)
        value = np.where(tail, r + xx, x)
        return accepted, np.where(words & _SIGN_BIT, -value, value), tail


def _in_core(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write each word's draw into ``out`` (layer: 8 bits, sign: 1 bit, place: the top 52 bits)
    and return whether it lies in its layer's core, where it is accepted as it is."""
    ki, wi, _, _ = ziggurat()
    layer = (words & _LAYER_BITS).astype(np.intp)
    whole = words >> _U52
    np.multiply(whole.astype(np.float64), wi.take(layer), out=out)
    out.view(np.uint64)[...] |= (words & _SIGN_BIT) << np.uint64(55)  # exact negation
    return whole < ki.take(layer)
