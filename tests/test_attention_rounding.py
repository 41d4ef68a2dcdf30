"""The faithful oracles' fp32 model: every fp32 accumulation, exp and log is the correctly rounded (round to nearest
even) fp32 value of the exact result. Checked here against exact rational arithmetic written in this file
(``fractions.Fraction`` sums, ``decimal`` exp / ln at 80 digits, an independent RNE rounding to fp32), on random
data, on exact fp32 ties (sums of 16-bit products are often exactly midway between two fp32 values), on heavy
cancellation and on the few fp32 arguments whose exp lies within 2^-50 of an fp32 rounding boundary (found by an
exhaustive scan of [-104, 88.8]; any float64 exp may round those either way).
"""

from __future__ import annotations

import decimal
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.reference import attention as A
from qsfa.reference import formats
from qsfa.reference import indexer as I

BF16 = np.dtype(ml_dtypes.bfloat16)
F32_MAX = Fraction(float(np.finfo(np.float32).max))
decimal.getcontext().prec = 80


def rn32(x) -> np.float32:
    """Round-to-nearest-even fp32 value of a rational (0 -> +0; overflow -> inf), written independently."""
    x = Fraction(x)
    if x == 0:
        return np.float32(0.0)
    sign = -1.0 if x < 0 else 1.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (max(e, -126) - 23)  # fp32 spacing at a (2^-149 in the subnormal range)
    n = a / quantum
    fl = n.numerator // n.denominator
    rest = n - fl
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    v = fl * quantum
    if v > F32_MAX:
        return np.float32(sign * np.inf)
    return np.float32(sign * float(v))


def rn32_sum(terms) -> np.float32:
    return rn32(sum((Fraction(float(t)) for t in terms), Fraction(0)))


def bits(x):
    return np.asarray(x, np.float32).view(np.int32)


# ---------------------------------------------------------------------------------------------------
# sums


def _rows(rows):
    width = max(len(r) for r in rows)
    return np.array([list(r) + [0.0] * (width - len(r)) for r in rows], np.float64)


HARD_SUMS = [
    [1.0, 2.0 ** -24],  # exact tie -> even (1)
    [1 + 2.0 ** -23, 2.0 ** -24],  # exact tie -> even (up)
    [1.0, 2.0 ** -24, 2.0 ** -90],  # just above a tie
    [1.0, 2.0 ** -24, -(2.0 ** -90)],  # just below a tie
    [2.0 ** 80, 1.0, 2.0 ** -24, -(2.0 ** 80)],  # a tie only visible after cancellation (needs math.fsum)
    [2.0 ** 70, 3.0, -(2.0 ** 70)],
    [1e300, 1.0, -1e300, 2.0 ** -1074],
    [5.0, -5.0],  # exact zero -> +0
    [-0.0, -0.0],  # -> +0 (an accumulator that starts at +0)
    [-(2.0 ** -151)],  # a negative value that rounds to zero keeps its sign
    [1.5 * 2.0 ** -149],  # subnormal tie -> even (2^-148)
    [3.4e38, 3.4e38],  # overflow -> inf
    [-3.4e38, -3.4e38, 1.0],
]


def test_exact_sum_matches_rational_rounding(monkeypatch):
    rng = np.random.default_rng(0)
    rand = [list(rng.standard_normal(int(rng.integers(1, 40))) * 2.0 ** rng.integers(-60, 60, 1)) for _ in range(40)]
    wide = [list(rng.standard_normal(30) * 2.0 ** rng.integers(-80, 80, 30)) for _ in range(40)]
    rows = HARD_SUMS + rand + wide
    calls = []
    orig = A._fsum_f32
    monkeypatch.setattr(A, "_fsum_f32", lambda r: calls.append(1) or orig(r))
    with np.errstate(over="ignore"):
        got = A.exact_sum_f32(_rows(rows))
    want = np.array([rn32_sum(r) for r in rows], np.float32)
    assert np.array_equal(bits(got), bits(want)), [(r, g, w) for r, g, w in zip(rows, got, want) if bits(g) != bits(w)]
    assert calls  # the math.fsum tier ran (the tie behind the cancellation)


def test_certified_rounding_consults_the_exact_values_only_where_undecided():
    mids = np.array([1 + 2.0 ** -24, 3.0, -0.0, 0.0, 2.5], np.float64)  # a tie, exact, -0, +0, exact
    bound = np.array([2.0 ** -50, 2.0 ** -40, 0.0, 0.0, 0.0])  # a non-zero bound >= 2^-52 |approx| (documented)
    asked = []

    def exact(idx):
        asked.extend(idx.tolist())
        return np.full(idx.size, 7.0, np.float32)

    got = A.certified_f32(mids, bound, exact)
    assert asked == [0, 2]  # the interval around the tie holds a boundary; -0 +- 0 straddles the sign
    assert got.tolist() == [7.0, 3.0, 7.0, 0.0, 2.5] and bits(got[3]) == 0


# ---------------------------------------------------------------------------------------------------
# exp / log

#: fp32 arguments whose e^x lies within 2^-50 (relative) of an fp32 rounding boundary (exhaustive float64 scan of
#: [-104, 88.8], distances confirmed with 80-digit decimal): a float64 exp may round them either way
HARD_EXP = np.array([0xC16912CD, 0xBBF0EDF1, 0xBAE0E25C, 0xB3000000, 0x377EFF81, 0x40315B33, 0x4001B249],
                    np.uint32).view(np.float32)


def exp_oracle(x):
    return np.array([rn32(Fraction(decimal.Decimal(float(v)).exp())) for v in x], np.float32)


def test_exp_is_correctly_rounded(monkeypatch):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-110, 0, 1500), rng.uniform(-1, 0, 500) * 2.0 ** -rng.integers(0, 30, 500),
                        rng.uniform(0, 90, 300), HARD_EXP, [0.0, -0.0, -2e38, -104.5, -87.5, 88.72, 88.73]])
    x = x.astype(np.float32)
    seen = []
    orig = A._decimal_f32
    monkeypatch.setattr(A, "_decimal_f32", lambda v, fn: seen.extend(np.asarray(v).tolist()) or orig(v, fn))
    with np.errstate(over="ignore"):
        got = A.exp_f32(x.reshape(2, -1))
    assert np.array_equal(bits(got.reshape(-1)), bits(exp_oracle(x)))
    assert set(HARD_EXP.tolist()) <= set(seen)  # every hard argument went through the exact evaluation


def test_log_is_correctly_rounded():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(1, 4096, 2000), 2.0 ** rng.integers(0, 20, 20), [1.0, np.nextafter(1, 2)]])
    x = x.astype(np.float32)
    want = np.array([rn32(Fraction(decimal.Decimal(float(v)).ln())) for v in x], np.float32)
    assert np.array_equal(bits(A.log_f32(x)), bits(want))


# ---------------------------------------------------------------------------------------------------
# dot products and the facts that prove float64 sums exact


def exact_lowest_bit(v: float) -> int:
    f = Fraction(v)
    k = 0
    while (f / Fraction(2) ** k).denominator == 1:
        k += 1
    while (f / Fraction(2) ** k).denominator != 1:
        k -= 1
    return k


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_min_lq_bounds_every_16_bit_value(name):
    dt = BF16 if name == "bfloat16" else np.dtype(np.float16)
    pats = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        vals = pats.view(dt).astype(np.float64)
    fin = np.isfinite(vals)
    got = A.min_lq(pats[fin].reshape(-1, 1), name)
    sub = np.flatnonzero(vals[fin] != 0)[:: 97]  # a spread of non-zero values (every binade, subnormals)
    for i in sub:
        assert got[i] <= exact_lowest_bit(float(vals[fin][i]))
    assert np.all(got[vals[fin] == 0] == A._NO_LQ)
    # tight for values without trailing zero bits: at most p - 1 below the exact bound
    for i in sub[:50]:
        assert got[i] >= exact_lowest_bit(float(vals[fin][i])) - (8 if name == "bfloat16" else 11)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "hifloat8"])
@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
def test_qsfa_row_facts_bound_the_dequantised_values(fmt, qdtype):
    rng = np.random.default_rng(3)
    n = 64
    if fmt == "int8":
        codes = rng.integers(-128, 128, (n, 512)).astype(np.int8).view(np.uint8)
    elif fmt == "float8_e4m3fn":
        codes = rng.integers(0, 256, (n, 512)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    else:
        vals = rng.standard_normal((n, 512)) * 2.0 ** rng.integers(-10, 10, (n, 512))
        codes = formats.encode(vals, "hifloat8")
    codes[:4] = 0  # all-zero rows
    codes[4, :128] = 0  # an all-zero tile
    scales = (rng.uniform(1, 2, (n, 4)) * 2.0 ** rng.integers(-140, 2, (n, 4))).astype(np.float32)  # no overflow
    scales[5] = 0
    qdt = BF16 if qdtype == "bfloat16" else np.dtype(np.float16)
    rope = (rng.standard_normal((n, 64)) * 2.0 ** rng.integers(-20, 3, (n, 64))).astype(qdt)
    k_norm, k_lq, vmax, vlq = A.qsfa_row_facts(codes, scales, fmt, qdtype, rope.view(np.uint16),
                                               rope.astype(np.float64))
    prod = (formats.decode(codes, fmt).astype(np.float32) * np.repeat(scales, 128, axis=1)).astype(np.float32)
    with np.errstate(over="ignore"):
        nope = formats.round_to(prod, qdtype, rounding="rint" if qdtype == "bfloat16" else "round").astype(np.float64)
    k = np.concatenate([nope, rope.astype(np.float64)], axis=1)
    assert np.all(np.sqrt((k * k).sum(axis=1)) <= k_norm)
    tiles = nope.reshape(n, 4, 128)
    assert np.all(np.abs(tiles).max(axis=-1) <= vmax)
    assert np.any(np.abs(tiles[tiles != 0]) < 2.0 ** (-126 if qdtype == "bfloat16" else -14))  # subnormals seen
    # every entry is a multiple of 2^lq (scaling by a power of two is exact in float64)
    on_grid = (lambda x, lq: np.all(np.floor(np.ldexp(x, -lq)) == np.ldexp(x, -lq)))
    assert on_grid(tiles, np.minimum(vlq, 1000).astype(np.int64)[..., None])
    assert on_grid(k, np.minimum(k_lq, 1000).astype(np.int64)[:, None])
    if fmt != "int8":  # int8 assumes |code| >= 1 without looking: a valid, cruder bound for an all-zero tile
        assert np.all(vlq[:4] == A._NO_LQ) and vlq[4, 0] == A._NO_LQ  # all-zero rows and tiles


def _facts(x16):
    x64 = x16.astype(np.float64)
    return x64, A.row_facts(x64, x16.view(np.uint16), "bfloat16" if x16.dtype == BF16 else "float16")


@pytest.mark.parametrize("kind", ["normal-bf16", "wide-fp16", "ties-bf16"])
def test_dot_products_are_correctly_rounded_and_order_free(kind, monkeypatch):
    certified = []
    orig = A.certified_f32
    monkeypatch.setattr(A, "certified_f32", lambda *a, **k: certified.append(a[0].size) or orig(*a, **k))
    rng = np.random.default_rng(4)
    c, m, kk, n = 2, 6, 96, 10
    if kind == "normal-bf16":  # float64 sums provably exact
        a16, b16 = (rng.standard_normal((c, m, kk)).astype(BF16), rng.standard_normal((c, n, kk)).astype(BF16))
    elif kind == "wide-fp16":  # exponent spans too wide to prove exactness: certified rounding
        a16 = (rng.standard_normal((c, m, kk)) * 2.0 ** rng.integers(-14, 10, (c, m, kk))).astype(np.float16)
        b16 = (rng.standard_normal((c, n, kk)) * 2.0 ** rng.integers(-14, 4, (c, n, kk))).astype(np.float16)
    else:  # integer data with sums beyond 2^24: inexact fp32 values and exact fp32 ties
        a16 = (rng.integers(-255, 256, (c, m, kk)) * 2.0 ** rng.choice([0, 14], (c, m, kk))).astype(BF16)
        b16 = rng.integers(-255, 256, (c, n, kk)).astype(BF16)
        a16[0, 0], b16[0, 0] = 0, 0
        a16[0, 0, :2], b16[0, 0, :2] = [2.0 ** 24, 1], [1, 1]  # 2^24 + 1: a tie, rounds to even 2^24
        a16[0, 1, :3], b16[0, 0, 2] = [2.0 ** 24, 1, 2.0 ** -20], 1  # just above the tie: rounds up
    a, fa = _facts(a16)
    b, fb = _facts(b16)
    got = A._dot_f32(a, b.transpose(0, 2, 1), fa, fb)
    want = np.array([[[rn32_sum(a[i, j] * b[i, l]) for l in range(n)] for j in range(m)] for i in range(c)],
                    np.float32)
    assert np.array_equal(bits(got), bits(want))
    perm = rng.permutation(kk)  # the same sums in another order (another "BLAS")
    got2 = A._dot_f32(np.ascontiguousarray(a[..., perm]), np.ascontiguousarray(b[..., perm]).transpose(0, 2, 1),
                      fa, fb)
    assert np.array_equal(bits(got2), bits(want))
    # normal bf16 rows and columns are proven exact (one rounding, no certification); wide spans are certified
    assert (not certified) if kind == "normal-bf16" else certified
    if kind == "ties-bf16":
        exact = np.einsum("cmk,cnk->cmn", a, b)
        assert np.any(exact != exact.astype(np.float32))  # inexact fp32 values are exercised
        assert got[0, 0, 0] == 2.0 ** 24 and got[0, 1, 0] == 2.0 ** 24 + 2


# ---------------------------------------------------------------------------------------------------
# the whole faithful pipeline against a rational golden


def _golden_qsfa(q, k, kn, sel, scale, qdtype, normalised):
    """Rational golden of the faithful QSFA pipeline for one query row: q [N, 576], k [T, 576] / kn [T, 512] float64
    holding query-dtype values of the selected tokens (all of them)."""
    rq = (lambda x: formats.round_to(np.asarray(x, np.float32), qdtype,
                                     rounding="rint" if qdtype == "bfloat16" else "round"))
    heads = q.shape[0]
    out = np.zeros((heads, 512), np.float32)
    mx = np.zeros(heads, np.float32)
    sm = np.zeros(heads, np.float32)
    for h in range(heads):
        s = np.array([rn32_sum(q[h] * k[t]) for t in sel], np.float32) * np.float32(scale)
        m = s.max()
        e = exp_oracle(s - m)
        l = rn32_sum(e)
        p = rq(e / l) if normalised else rq(e)
        o = np.array([rn32_sum(p.astype(np.float64) * kn[sel, d]) for d in range(512)], np.float32)
        if not normalised:
            o = o / l
        out[h], mx[h], sm[h] = rq(o), m, l
    return out, mx, sm


@pytest.mark.parametrize("qdtype,normalised,integer", [("bfloat16", False, False), ("float16", True, False),
                                                       ("bfloat16", False, True)])
def test_faithful_qsfa_equals_the_rational_golden(qdtype, normalised, integer):
    from test_attention_support import Case, layout_args

    rng = np.random.default_rng(5)
    qdt = BF16 if qdtype == "bfloat16" else np.dtype(np.float16)
    heads, kv, n_sel = 2, 24, 12
    if integer:  # integer q / K, power-of-two scales: exact fp32 ties in q . k
        q = (rng.integers(-255, 256, (1, 1, heads, 576)) * 2.0 ** 4).astype(qdt)
        scales = np.full((1, kv, 4), 2.0 ** 6, np.float32)
        scale = 2.0 ** -26
    else:
        q = (rng.standard_normal((1, 1, heads, 576)) * np.exp(rng.uniform(-4, 1, (1, 1, heads, 576)))).astype(qdt)
        scales = rng.uniform(0.001, 0.05, (1, kv, 4)).astype(np.float32)
        scale = 576 ** -0.5
    codes = rng.integers(-127, 128, (1, kv, 512)).astype(np.int8)
    rope = (rng.standard_normal((1, kv, 64)) * 4).astype(qdt)
    idx = rng.permutation(kv)[:n_sel].astype(np.int32).reshape(1, 1, n_sel)
    case = Case(q, codes, rope, scales, idx, [1], [kv])
    args = layout_args(case)
    args.update(scale_value=scale, return_softmax_lse=True,
                probability_rounding="normalised" if normalised else "unnormalised")
    out, mx, sm = qsfa.kv_quant_sparse_flash_attention(**args)
    prod = (codes[0].astype(np.float32) * np.repeat(scales[0], 128, axis=1)).astype(np.float32)
    kn = formats.round_to(prod, qdtype, rounding="rint" if qdtype == "bfloat16" else "round").astype(np.float64)
    k = np.concatenate([kn, rope[0].astype(np.float64)], axis=1)
    g_out, g_mx, g_sm = _golden_qsfa(q[0, 0].astype(np.float64), k, kn, idx[0, 0], scale, qdtype, normalised)
    assert out[0, 0].astype(np.float32).tobytes() == g_out.tobytes()
    assert mx.reshape(-1).tobytes() == g_mx.tobytes()
    assert sm.reshape(-1).tobytes() == g_sm.tobytes()


def test_indexer_scores_are_correctly_rounded():
    """Near-twin keys: exact scores a fraction of an fp32 ulp apart. The indices follow the correctly rounded fp32
    scores (equal ones: lower token first), as the rational golden says."""
    rng = np.random.default_rng(6)
    heads, kv, d = 4, 40, 128
    q = (rng.standard_normal((1, 1, heads, d))).astype(BF16)
    q[..., 0] = (rng.standard_normal(heads) * 2.0 ** -20).astype(BF16)
    k = rng.standard_normal((1, kv, 1, d)).astype(BF16)
    k[:, 1::2] = k[:, 0::2]
    k[:, 1::2, 0, 0] = (k[:, 1::2, 0, 0].astype(np.float32) * np.float32(1.5)).astype(BF16)
    w = rng.uniform(-1, 1, (1, 1, heads)).astype(BF16)
    idx, val = I.lightning_indexer(q, k, w, sparse_count=kv, return_value=True)
    q64, k64 = q[0, 0].astype(np.float64), k[0, :, 0].astype(np.float64)
    score = []
    for j in range(kv):
        terms = [np.float32(max(rn32_sum(q64[h] * k64[j]), np.float32(0))) * np.float32(w[0, 0, h]) for h in range(heads)]
        score.append(rn32_sum(terms) + np.float32(0))
    order = sorted(range(kv), key=lambda j: (-score[j], j))
    assert idx.reshape(-1).tolist() == order
    assert np.array_equal(val.reshape(-1), np.array([score[j] for j in order], np.float32).astype(BF16))
