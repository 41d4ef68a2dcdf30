"""lightning_indexer / quant_lightning_indexer (docs/numerics/indexer.md#lightning_indexer) against a dense top-k written plainly here.

Integer-valued inputs make every fp32 score exact (|q.k| <= 128 * 16, ReLU, small integer weights, < 2^24),
so the fp32 operator and the float64 golden must pick exactly the same tokens in exactly the same order,
including the OPEN tie rule (equal scores: lower token index first), which integer data exercises a lot.
"""

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.reference import formats
from qsfa.reference import indexer as ref_indexer
from test_attention_support import BF16, golden_exact, layout_args, random_case, to_logical

LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("BSND", "PA_BSND"), ("TND", "PA_BSND")]


def visible(i, act_q, act_kv, mode):
    thr = act_kv - act_q + i + 1 if mode == 3 else act_kv
    return max(0, min(act_kv, thr))


def dense_topk(q, k, w, act_q, act_kv, k_count, mode, qs=None, ks=None):
    """q [B, S, N, D], k [B, KV, D], w [B, S, N] (float64; qs [B, S, N], ks [B, KV] for the quantised form)."""
    b_, s_ = q.shape[:2]
    idx = np.full((b_, s_, k_count), -1, np.int64)
    val = np.full((b_, s_, k_count), -np.inf)
    for b in range(b_):
        for i in range(act_q[b]):
            n = visible(i, act_q[b], act_kv[b], mode)
            dots = q[b, i] @ k[b, :n].T  # [N, n]
            if qs is not None:
                dots = (qs[b, i][:, None] * ks[b, :n][None, :]) * dots
            score = (w[b, i][:, None] * np.maximum(dots, 0)).sum(axis=0)
            order = sorted(range(n), key=lambda j: (-score[j], j))[:k_count]
            idx[b, i, :len(order)] = order
            val[b, i, :len(order)] = score[order]
    return idx, val


def store(x, layout, lengths):
    """[B, S, ...] -> TND rows of the actual lengths, or unchanged for BSND."""
    if layout == "BSND":
        return x
    return np.concatenate([x[b, :n] for b, n in enumerate(lengths)])


def kv_store(k, layout, act_kv, block_size=16):
    """k [B, KV, ...] -> key tensor, block_table, lengths for layout (PA pages reversed)."""
    b_, kv = k.shape[:2]
    if layout == "BSND":
        return k[:, :, None], None, np.asarray(act_kv, np.int32)
    if layout == "TND":
        return np.concatenate([k[b, :n] for b, n in enumerate(act_kv)])[:, None], None, np.cumsum(act_kv).astype(np.int32)
    pages = -(-kv // block_size)
    total = b_ * pages
    cache = np.zeros((total, block_size, 1) + k.shape[2:], k.dtype)
    bt = np.zeros((b_, pages), np.int32)
    for b in range(b_):
        for j in range(pages):
            phys = total - 1 - (b * pages + j)
            bt[b, j] = phys
            seg = k[b, j * block_size:(j + 1) * block_size]
            cache[phys, :seg.shape[0], 0] = seg
    return cache, bt, np.asarray(act_kv, np.int32)


def int_inputs(rng, batch=2, q_s=3, heads=8, kv=50, qdtype=BF16):
    q = rng.integers(-3, 4, (batch, q_s, heads, 128)).astype(qdtype)
    k = rng.integers(-3, 4, (batch, kv, 128)).astype(qdtype)
    w = rng.integers(-2, 3, (batch, q_s, heads)).astype(qdtype)
    return q, k, w


def call_indexer(q, k, w, act_q, act_kv, layouts, **kw):
    lq, lk = layouts
    key, bt, lens_k = kv_store(k, lk, act_kv)
    lens_q = np.asarray(act_q, np.int32) if lq == "BSND" else np.cumsum(act_q).astype(np.int32)
    return qsfa.lightning_indexer(store(q, lq, act_q), key, store(w, lq, act_q), actual_seq_lengths_query=lens_q,
                                  actual_seq_lengths_key=lens_k, block_table=bt, layout_query=lq, layout_key=lk, **kw)


def logical(x, layout, act_q, q_s):
    """Indexer output [B, S, 1, K] / [T, 1, K] -> [B, S, K] (padding rows -1)."""
    x = x[..., 0, :]
    if layout == "BSND":
        return x
    out = np.full((len(act_q), q_s) + x.shape[1:], -1, x.dtype)
    t = 0
    for b, n in enumerate(act_q):
        out[b, :n] = x[t:t + n]
        t += n
    return out


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x))
@pytest.mark.parametrize("mode", [3, 0])
@pytest.mark.parametrize("k_count", [1, 7, 64])
def test_indices_equal_dense_topk(layouts, mode, k_count):
    rng = np.random.default_rng(k_count + mode)
    act_q, act_kv = [3, 2], [50, 33]
    q, k, w = int_inputs(rng)
    idx, _ = call_indexer(q, k, w, act_q, act_kv, layouts, sparse_count=k_count, sparse_mode=mode)
    assert idx.dtype == np.int32 and idx.shape[-1] == k_count
    want, _ = dense_topk(q.astype(np.float64), k.astype(np.float64), w.astype(np.float64), act_q, act_kv, k_count, mode)
    got = logical(idx, layouts[0], act_q, 3)
    if layouts[0] == "BSND":
        got = np.where((np.arange(3)[None, :] < np.asarray(act_q)[:, None])[..., None], got, -1)
    assert np.array_equal(got, want)


def test_ties_keep_lower_token_first():
    q = np.zeros((1, 1, 8, 128), BF16)
    k = np.zeros((1, 10, 128), BF16)
    k[0, [2, 5, 7], 0] = 1  # tokens 2, 5, 7 score w; every other token 0
    q[..., 0] = 1
    w = np.ones((1, 1, 8), BF16)
    idx, val = call_indexer(q, k, w, [1], [10], ("BSND", "BSND"), sparse_count=6, return_value=True)
    assert idx[0, 0, 0].tolist() == [2, 5, 7, 0, 1, 3]
    assert val[0, 0, 0].astype(np.float32).tolist() == [8, 8, 8, 0, 0, 0]


def test_values_and_padding():
    rng = np.random.default_rng(3)
    q, k, w = int_inputs(rng, batch=1, q_s=2, kv=5)
    idx, val = call_indexer(q, k, w, [2], [5], ("BSND", "BSND"), sparse_count=8, return_value=True)
    assert val.dtype == BF16 and val.shape == idx.shape
    want_i, want_v = dense_topk(q.astype(np.float64), k.astype(np.float64), w.astype(np.float64), [2], [5], 8, 3)
    assert np.array_equal(idx[:, :, 0], want_i)
    # row 0 sees 4 tokens, row 1 sees 5: the rest is -1 with value -inf
    assert (idx[0, 0, 0, 4:] == -1).all() and (idx[0, 1, 0, 5:] == -1).all()
    fin = want_i >= 0
    expect = formats.round_to(want_v[fin].astype(np.float32), "bfloat16", rounding="rint")
    assert np.array_equal(val[:, :, 0][fin].astype(np.float32), expect)
    assert np.all(np.isneginf(val[:, :, 0][~fin].astype(np.float32)))


def test_empty_rows_are_all_minus_one():
    rng = np.random.default_rng(4)
    q, k, w = int_inputs(rng, batch=2, q_s=3, kv=4)
    idx, _ = call_indexer(q, k, w, [3, 1], [1, 4], ("BSND", "BSND"), sparse_count=4)
    assert (idx[0, :2] == -1).all()  # actQ 3 > actKV 1: threshold <= 0 for rows 0, 1
    assert idx[0, 2, 0, 0] == 0 and (idx[0, 2, 0, 1:] == -1).all()
    assert (idx[1, 1:] == -1).all()  # BSND padding rows


def test_random_float_scores_are_ordered():
    """Non-integer data: the chosen tokens' float64 scores are (up to fp32 rounding) the largest, in order."""
    rng = np.random.default_rng(5)
    q = rng.uniform(-1, 1, (1, 4, 16, 128)).astype(BF16)
    k = rng.uniform(-1, 1, (1, 300, 128)).astype(BF16)
    w = rng.uniform(-1, 1, (1, 4, 16)).astype(np.float32)
    idx, _ = call_indexer(q, k, w, [4], [300], ("BSND", "BSND"), sparse_count=32)
    for i in range(4):
        n = visible(i, 4, 300, 3)
        s = (w[0, i].astype(np.float64)[:, None] * np.maximum(q[0, i].astype(np.float64) @ k[0, :n].astype(np.float64).T,
                                                               0)).sum(0)
        chosen = idx[0, i, 0]
        tol = 1e-4 * np.abs(s).max()
        assert np.all(np.diff(s[chosen]) <= tol)  # descending
        rest = np.setdiff1d(np.arange(n), chosen)
        assert s[chosen].min() >= s[rest].max() - tol


def test_chunking_does_not_change_results():
    rng = np.random.default_rng(6)
    q = rng.uniform(-1, 1, (2, 5, 8, 128)).astype(BF16)
    k = rng.uniform(-1, 1, (2, 70, 1, 128)).astype(BF16)
    w = rng.uniform(-1, 1, (2, 5, 8)).astype(BF16)
    a = ref_indexer.lightning_indexer(q, k, w, sparse_count=16, return_value=True)
    b = ref_indexer.lightning_indexer(q, k, w, sparse_count=16, return_value=True, chunk_size=1)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


# ---------------------------------------------------------------------------------------------------
# quantised indexer


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "hifloat8"])
@pytest.mark.parametrize("layouts", [("BSND", "BSND"), ("TND", "PA_BSND")], ids=lambda x: "+".join(x))
def test_quant_indexer_equals_dense_topk(fmt, layouts):
    rng = np.random.default_rng(7)
    act_q, act_kv = [3, 2], [40, 21]
    vals_q = rng.integers(-4, 5, (2, 3, 8, 128)).astype(np.float32)
    vals_k = rng.integers(-4, 5, (2, 40, 128)).astype(np.float32)
    enc = {"int8": lambda x: x.astype(np.int8),
           "float8_e4m3fn": lambda x: x.astype(ml_dtypes.float8_e4m3fn),
           "hifloat8": lambda x: formats.encode(x, "hifloat8")}[fmt]
    qc, kc = enc(vals_q), enc(vals_k)
    assert np.array_equal(formats.decode(qc.view(np.uint8), fmt), vals_q)  # integers are exact in every format
    qs = (2.0 ** rng.integers(-3, 2, (2, 3, 8))).astype(np.float16)
    ks = (2.0 ** rng.integers(-3, 2, (2, 40))).astype(np.float16)
    w = rng.integers(-2, 3, (2, 3, 8)).astype(np.float16)
    lq, lk = layouts
    key, bt, lens_k = kv_store(kc, lk, act_kv)
    kscale, _, _ = kv_store(ks[..., None], lk, act_kv)
    lens_q = np.asarray(act_q, np.int32) if lq == "BSND" else np.cumsum(act_q).astype(np.int32)
    named = fmt if fmt == "hifloat8" else None
    idx = qsfa.quant_lightning_indexer(store(qc, lq, act_q), key, store(w, lq, act_q), store(qs, lq, act_q),
                                       kscale[..., 0], 0, 0, actual_seq_lengths_query=lens_q,
                                       actual_seq_lengths_key=lens_k, block_table=bt, layout_query=lq, layout_key=lk,
                                       sparse_count=16, query_dtype=named, key_dtype=named)
    want, _ = dense_topk(vals_q.astype(np.float64), vals_k.astype(np.float64), w.astype(np.float64), act_q, act_kv, 16,
                         3, qs=qs.astype(np.float64), ks=ks.astype(np.float64))
    got = logical(idx, lq, act_q, 3)
    if lq == "BSND":
        got = np.where((np.arange(3)[None, :] < np.asarray(act_q)[:, None])[..., None], got, -1)
    assert np.array_equal(got, want)


# ---------------------------------------------------------------------------------------------------
# indexer -> QSFA


def test_indexer_indices_drive_qsfa_like_a_dense_topk():
    rng = np.random.default_rng(8)
    act_q, act_kv = [3, 2], [90, 61]
    iq, ik, iw = int_inputs(rng, kv=90, heads=8)
    idx, _ = call_indexer(iq, ik, iw, act_q, act_kv, ("TND", "PA_BSND"), sparse_count=24)
    want, _ = dense_topk(iq.astype(np.float64), ik.astype(np.float64), iw.astype(np.float64), act_q, act_kv, 24, 3)
    case = random_case(rng, kv=90, act_q=act_q, act_kv=act_kv, sparse=24, heads=4)
    case.idx = want.astype(np.int32)
    args = layout_args(case, "TND", "PA_BSND")
    ref = qsfa.kv_quant_sparse_flash_attention(**args, return_softmax_lse=True)
    got = qsfa.kv_quant_sparse_flash_attention(**{**args, "sparse_indices": idx}, return_softmax_lse=True)
    for a, b in zip(ref, got):
        assert a.tobytes() == b.tobytes()
    exact = qsfa.kv_quant_sparse_flash_attention(**{**args, "sparse_indices": idx, "precision": "exact"})[0]
    g_out, _, _ = golden_exact(case)
    np.testing.assert_allclose(to_logical(exact, case, "TND"), g_out, rtol=1e-12, atol=1e-13)
