"""The shortcuts that make a conformance example cheaper (issue 15) keep every verdict."""

import numpy as np
from hypothesis import given, settings

from qsfa.conformance._support import compare_outputs
from qsfa.conformance.properties import Example
from qsfa.strategies._common import sampled


def test_sampled_keeps_equal_but_distinct_options_apart():
    # (False, True) == (0, 1) and 0.0 == -0.0: a cache keyed by value alone would hand out the wrong strategy
    assert sampled((False, True)) is sampled((False, True))
    assert sampled((0, 1)) is not sampled((False, True))
    assert sampled((0.0,)) is not sampled((-0.0,))
    seen = []

    @settings(max_examples=20, database=None, derandomize=True)
    @given(sampled((0, 1)), sampled((False, True)), sampled((-0.0,)))
    def draw(i, b, z):
        seen.append((type(i), type(b), str(z)))

    draw()
    assert {s for s in seen} <= {(int, bool, "-0.0")} and seen


def test_sampled_unhashable_options_are_not_cached():
    a, b = sampled(([1], [2])), sampled(([1], [2]))
    assert a is not b


def test_example_repr_is_a_summary():
    ex = Example({"key": np.zeros((4, 16, 1, 656), np.uint8), "idx": np.arange(3, dtype=np.int32), "scale": 0.5},
                 7)
    r = repr(ex)
    assert "'shape': [4, 16, 1, 656]" in r and "'values': [0, 1, 2]" in r and "seed=7" in r and len(r) < 300


def test_identical_outputs_pass_and_differences_still_fail():
    f = {"attention_out": "float"}
    x = np.array([np.nan, 1.0, -0.0], np.float32)
    assert compare_outputs({"attention_out": x.copy()}, {"attention_out": x}, f) == []
    # a NaN where the other side is finite fails the float criterion; a byte difference fails "bytes"
    y = x.copy()
    y[0] = 1.0
    assert compare_outputs({"attention_out": y}, {"attention_out": x}, f)
    z = x.copy()
    z[2] = 0.0
    assert compare_outputs({"attention_out": z}, {"attention_out": x}, f) == []  # -0 == +0 under the criterion
    assert compare_outputs({"attention_out": z}, {"attention_out": x})  # ... but not byte for byte
    assert compare_outputs({"o": x.astype(np.float64)}, {"o": x})  # same values, another dtype: not identical


def test_cached_integer_strategies_draw_what_they_say():
    from qsfa.strategies._common import int_lists, ints

    assert ints(0, 9) is ints(0, 9) and ints(0, 9) is not ints(0, 8)
    assert int_lists(2, 5, 3) is int_lists(2, 5, 3)
    seen = []

    @settings(max_examples=30, database=None, derandomize=True)
    @given(ints(-3, 4), int_lists(2, 5, 3))
    def draw(i, xs):
        seen.append((i, xs))

    draw()
    assert seen and all(-3 <= i <= 4 and len(xs) == 3 and all(2 <= x <= 5 for x in xs) for i, xs in seen)
    assert {i for i, _ in seen} >= {-3, 4} or len({i for i, _ in seen}) > 2  # not stuck on one value


def test_model_decode_matches_the_reference_decode_for_every_code():
    from qsfa.conformance._support import decode
    from qsfa.reference import formats as F

    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8", "float8_e8m0"):
        codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
        assert decode(codes, fmt).tobytes() == F.decode(codes, fmt).tobytes(), fmt
    h = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    for fmt in ("float16", "bfloat16"):
        assert decode(h, fmt).tobytes() == F.decode(h, fmt).tobytes(), fmt


def test_fast_float16_rounding_matches_the_reference_encode_bit_for_bit():
    """Every float16 value, every tie between neighbours, one float32 ulp either side of each tie, the overflow
    boundary, the subnormal range and random float32 bit patterns (NaN excluded: those take the reference path)."""
    from qsfa.conformance._support import _round_f16, round_to
    from qsfa.reference import formats as F

    rng = np.random.default_rng(15)
    h = np.arange(65536, dtype=np.uint16).view(np.float16)
    h64 = np.unique(h[np.isfinite(h)].astype(np.float64))
    ties = ((h64[1:] + h64[:-1]) / 2).astype(np.float32)
    assert np.array_equal(ties.astype(np.float64), (h64[1:] + h64[:-1]) / 2)  # exact ties
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    edge = np.array([65504, 65519.996, 65520, 65536, 1e30, np.inf, 0.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25,
                     2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 1e-30, 1e-45], np.float32)
    bits = rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([h64.astype(np.float32), ties, near, edge, -edge, bits[~np.isnan(bits)]])
    for rounding in ("rint", "round"):
        want = F.decode(F.encode(x, "float16", saturate=False, rounding=rounding), "float16")
        got = _round_f16(x, rounding)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), rounding
        assert round_to(x, "float16", rounding=rounding).tobytes() == want.tobytes()
    with_nan = np.array([1.0, np.nan, 2.0 ** -20], np.float32)  # the reference path, NaN kept
    assert np.isnan(round_to(with_nan, "float16", rounding="round")[1])


def test_folded_flags_reach_every_option_honour_pins_and_start_from_the_first():
    from hypothesis import strategies as st
    from hypothesis.control import BuildContext
    from hypothesis.internal.conjecture.data import ConjectureData

    from qsfa.strategies._common import FOLD_MAX, draw_flags

    specs = [("a", (0, 1)), ("b", ("x", "y", "z")), ("c", (False, True)), ("d", tuple(range(10))),
             ("e", (0.0, 0.5, 1.0)), ("f", (3, 0), "pinned_f"), ("g", ("only",))]
    assert 2 * 3 * 2 * 10 * 3 * 2 > FOLD_MAX  # needs more than one folded draw

    def draws(pins, n=300):
        out = []
        for i in range(n):
            data = ConjectureData(random=__import__("random").Random(i))
            with BuildContext(data, is_final=False, wrapped_test=draws):
                out.append((data.draw(st.composite(lambda draw: draw_flags(draw, pins, specs))()), len(data.choices)))
        return out

    got = draws({})
    for name, opts in ((s[0], s[1]) for s in specs):
        assert {d[name] for d, _ in got} == set(opts), name  # every option reachable
    assert all(1 < n <= 3 for _, n in got)  # a few folded integer draws instead of six
    counts = {v: sum(d["d"] == v for d, _ in got) for v in range(10)}
    assert min(counts.values()) > 10  # roughly uniform, not stuck on low digits
    pinned = draws({"pinned_f": 0, "b": ("y", "z")}, n=60)
    assert {d["f"] for d, _ in pinned} == {0} and {d["b"] for d, _ in pinned} == {"y", "z"}
    # the simplest draw (every choice 0: what an edge example is drawn from) gives every first option
    data = ConjectureData.for_choices([0] * 8)
    with BuildContext(data, is_final=False, wrapped_test=draws):
        simplest = data.draw(st.composite(lambda draw: draw_flags(draw, {}, specs))())
    assert simplest == {"a": 0, "b": "x", "c": False, "d": 0, "e": 0.0, "f": 3, "g": "only"}
