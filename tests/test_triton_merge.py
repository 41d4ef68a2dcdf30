"""merge_attention_lse on the "triton" backend (qsfa.kernels.lse_merge) against the reference
(qsfa/reference/lse.py), byte for byte: the kernel computes in float64 in the reference's operation order and
rounds once, so in the interpreter (the same NumPy float64 ``exp`` as the reference) every byte must agree. On
a GPU, libdevice's float64 ``exp`` may differ by an ulp, so there a result is accepted by
docs/numerics/comparison.md#float-criterion when its bytes differ (the documented caveat of kernels/lse_merge.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from _triton_env import prepare

_, INTERPRETED = prepare(__name__)  # before triton is imported: tests/_triton_env.py
import torch  # noqa: E402

import ml_dtypes  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import qsfa  # noqa: E402
from qsfa.kernels.lse_merge import f64_to_f32_odd  # noqa: E402
from qsfa.compare import assert_bytes_equal, compare_float  # noqa: E402
from qsfa.reference.lse import merge_attention_lse as ref_merge  # noqa: E402

pytestmark = pytest.mark.triton
BF16 = np.dtype(ml_dtypes.bfloat16)
OUT_DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
              "float64": np.dtype(np.float64)}


def check_merge(args):
    """The triton merge equals the reference merge (bytes; on a GPU the float criterion where bytes differ)."""
    got = qsfa.merge_attention_lse(**args, backend="triton")
    want = ref_merge(args["attention_out"], args["softmax_max"], args["softmax_sum"],
                     layout_query=args["layout_query"])
    for name, g, w in zip(("attention_out", "softmax_max", "softmax_sum"), got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if INTERPRETED or g.tobytes() == w.tobytes():
            assert_bytes_equal(g.view(np.uint8), w.view(np.uint8), name=name)
        else:
            dt = {BF16: "bfloat16", np.dtype(np.float16): "float16"}.get(g.dtype, "float32")
            r = compare_float(g, w, dtype=dt, name=name)
            assert r.passed, str(r)
    return got


def make_merge(rng, *, layout="BSND", parts=2, out_dtype="bfloat16", stat_dtype="float32", empty=0.2,
               lead=(2, 3, 4), d=40):
    """Partial results with a spread of maxima (some shards' weights underflow), empty shards (m = l = 0,
    a row with only empty shards included) and signed zeros in the outputs."""
    if layout == "BSND":
        b, s, n = lead
        out_shape, stat_shape = (parts, b, s, n, d), (parts, b, 1, s, n)
    else:
        t, n = lead[0] * lead[1], lead[2]
        out_shape, stat_shape = (parts, t, n, d), (parts, 1, t, n)
    out = (rng.standard_normal(out_shape) * 2.0 ** rng.integers(-8, 4, out_shape[:-1] + (1,)))
    out[rng.random(out_shape) < 0.05] = -0.0
    out = out.astype(OUT_DTYPES[out_dtype])
    m = rng.uniform(-30, 30, stat_shape)
    m[rng.random(stat_shape) < 0.3] *= 40  # weights exp(m_p - m) down to 0
    s = rng.uniform(0.5, 200, stat_shape)
    gone = rng.random(stat_shape) < empty
    flat_gone = gone.reshape(parts, -1)
    flat_gone[:, 0] = True  # the first row has only empty shards
    m[gone] = 0.0
    s[gone] = 0.0
    return dict(attention_out=out, softmax_max=m.astype(stat_dtype), softmax_sum=s.astype(stat_dtype),
                layout_query=layout)


@pytest.mark.parametrize("out_dtype", list(OUT_DTYPES))
@pytest.mark.parametrize("stat_dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_merge_bytes_match_reference(out_dtype, stat_dtype, layout):
    seed = list(OUT_DTYPES).index(out_dtype) + 4 * (stat_dtype == "float64") + 8 * (layout == "TND")
    args = make_merge(np.random.default_rng(seed), layout=layout, parts=3, out_dtype=out_dtype,
                      stat_dtype=stat_dtype)
    got = check_merge(args)
    flat = np.asarray(got[0]).reshape(-1, args["attention_out"].shape[-1])
    assert not flat[0].any()  # the row with only empty shards merges to 0
    assert np.asarray(got[2]).reshape(-1)[0] == 0


@pytest.mark.parametrize("qdtype,second,want", [
    ("bfloat16", 1 + 2.0**-7, 1.0),            # mean 1 + 2^-8: a bf16 tie, RINT keeps the even 1.0
    ("float16", 1 + 2.0**-10, 1 + 2.0**-10),   # mean 1 + 2^-11: an fp16 tie, ROUND goes away from zero
])
def test_merge_rounds_ties_as_the_reference(qdtype, second, want):
    """Two equal-weight shards whose mean is an exact tie of the output dtype: one rounding from float64 with
    the query-dtype rule (a double rounding through float32 RNE would not show here; the tie decides)."""
    dt = OUT_DTYPES[qdtype]
    out = np.array([1.0, second], np.float64).astype(dt).reshape(2, 1, 1, 1, 1)
    stat = np.zeros((2, 1, 1, 1, 1), np.float32)
    args = dict(attention_out=out, softmax_max=stat, softmax_sum=stat + 1, layout_query="BSND")
    got = check_merge(args)
    assert float(np.asarray(got[0]).reshape(-1)[0]) == want
    assert float(np.asarray(got[2]).reshape(-1)[0]) == 2.0


def test_merge_near_tie_needs_round_to_odd():
    """bf16 partials 1 and 1 + 2^-7 with weights 1 and 1 + 2^-20 merge to 1 + 2^-8 + ~2^-29: just above a bf16
    tie, but within half a float32 ulp of it, so narrowing through float32 RNE would land on the tie and round
    to the even 1.0. One rounding from float64 (the reference's rule, the kernel's round-to-odd) gives 1 + 2^-7."""
    out = np.array([1.0, 1 + 2.0**-7]).astype(BF16).reshape(2, 1, 1, 1, 1)
    m = np.zeros((2, 1, 1, 1, 1), np.float32)
    s = np.array([1.0, 1 + 2.0**-20], np.float32).reshape(2, 1, 1, 1, 1)
    got = check_merge(dict(attention_out=out, softmax_max=m, softmax_sum=s, layout_query="BSND"))
    assert float(np.asarray(got[0]).reshape(-1)[0]) == 1 + 2.0**-7
    exact = (1 + (1 + 2.0**-20) * (1 + 2.0**-7)) / (2 + 2.0**-20)
    assert np.float32(exact) == np.float32(1 + 2.0**-8)  # the float32 RNE trap is real


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), parts=st.integers(1, 4), out_dtype=st.sampled_from(list(OUT_DTYPES)),
       stat_dtype=st.sampled_from(["float32", "float64"]), layout=st.sampled_from(["BSND", "TND"]),
       d=st.sampled_from([1, 8, 33]), empty=st.sampled_from([0.0, 0.3, 1.0]))
def test_merge_matches_reference(seed, parts, out_dtype, stat_dtype, layout, d, empty):
    check_merge(make_merge(np.random.default_rng(seed), layout=layout, parts=parts, out_dtype=out_dtype,
                           stat_dtype=stat_dtype, empty=empty, lead=(1, 2, 2), d=d))


def test_merge_torch_caller_and_registration():
    assert "merge_attention_lse" in qsfa.backends()["triton"].operators
    args = make_merge(np.random.default_rng(5), out_dtype="float16")
    from qsfa._arrays import to_torch

    t = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    got = qsfa.merge_attention_lse(**t, backend="triton")
    assert all(isinstance(x, torch.Tensor) for x in got)
    want = check_merge(args)
    for g, w in zip(got, want):
        assert_bytes_equal(g.cpu().numpy().view(np.uint8), np.asarray(w).view(np.uint8))


@triton.jit
def _odd_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    mask = i < n
    tl.store(o_ptr + i, f64_to_f32_odd(tl.load(x_ptr + i, mask=mask, other=0.0)), mask=mask)


def test_f64_to_f32_odd_helper():
    """The round-to-odd narrowing against an independent float64 construction (nextafter), incl. subnormals."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-40, 30, 500),
                        np.float32(rng.standard_normal(50)).astype(np.float64),  # exact
                        rng.standard_normal(50) * 2.0**-140, [0.0, -0.0, 2.0**-160, -(2.0**-160)]])
    out = torch.empty(x.size, dtype=torch.float32)
    dev = "cpu" if INTERPRETED else "cuda"
    xt, out = torch.from_numpy(x).to(dev), out.to(dev)
    _odd_kernel[(1,)](xt, out, x.size, BLOCK=1024)
    got = out.cpu().numpy()
    r = x.astype(np.float32)
    toward0 = np.where(np.abs(r.astype(np.float64)) > np.abs(x), np.nextafter(r, np.float32(0)), r)
    odd = (toward0.view(np.uint32) | np.uint32(1)).view(np.float32)
    want = np.where(r.astype(np.float64) == x, r, odd)
    assert_bytes_equal(got, want, name="f64_to_f32_odd")
