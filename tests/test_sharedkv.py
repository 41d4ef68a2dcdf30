"""DeepSeek-V4 shared-KV attention: sparse_flash_mla / sparse_attn_sharedkv (docs/numerics/attention-v4.md).

Exact mode against a straightforward float64 loop written here; faithful mode against a straightforward fp32
online-softmax loop written here (math.fsum dot products, so every fp32 value is the correctly rounded one) and
against exact within the float criterion; hand-worked window / bound / sink cases; metamorphic checks (layouts,
top-k permutation, -inf sinks, split and merge by LSE, the two front doors). The contracts are covered by
tests/test_contracts.py and tests/test_hostile_inputs.py.
"""

import math

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.compare import compare_float
from qsfa.ops.sharedkv import sas_case, sfm_case
from qsfa.reference.formats import round_to

BF16 = np.dtype(ml_dtypes.bfloat16)
D = 512


def _front(args):
    a = dict(args)
    return qsfa.sparse_flash_mla(a.pop("q"), **a)


# --------------------------------------------------------------------------------------------------
# the independent loops (one query row at a time, BSND arguments)


def _selected(b, i, s1, s2, s3, *, mode_o, mode_c, wl, wr, ratio, residual, idx):
    """(ori tokens, cmp tokens) of row i, read off the definition in docs/numerics/attention-v4.md."""
    thr = s2 - s1 + i + 1
    if mode_o in (3, 4) and thr <= 0:
        return None, None
    if mode_o == 0:
        lo, hi = 0, s2
    else:
        lo = 0 if (mode_o == 3 or wl == -1) else max(thr - wl - 1, 0)
        hi = s2 if wr == -1 else thr + wr
    ori = list(range(max(lo, 0), min(hi, s2)))
    if s3 is None:
        return ori, []
    big = s3 * ratio + residual if residual is not None else s2
    bound = (big - s1 + i + 1) // ratio if mode_c == 3 else big // ratio
    bound = min(max(bound, 0), s3)
    if idx is None:
        return ori, list(range(bound))
    cmp = []
    for p, e in enumerate(idx):
        if p >= min(len(idx), bound) or e == -1:
            break
        if 0 <= e < bound:
            cmp.append(int(e))
    return ori, cmp


def _loop_exact(q, ori, cmp, idx, sinks, scale, **sel):
    bsz, s1, n, _ = q.shape
    out = np.zeros(q.shape)
    lse = np.zeros((bsz, s1, n))
    for b in range(bsz):
        for i in range(s1):
            o_t, c_t = _selected(b, i, s1, ori.shape[1], None if cmp is None else cmp.shape[1],
                                 idx=None if idx is None else idx[b, i, 0], **sel)
            if o_t is None:
                continue
            rows = [ori[b, j, 0] for j in o_t] + [cmp[b, j, 0] for j in c_t]
            k = np.array(rows, np.float64).reshape(-1, D)
            for h in range(n):
                s = [math.fsum(q[b, i, h].astype(np.float64) * kr) * scale for kr in k]
                sink = -math.inf if sinks is None else float(sinks[h])
                m = max(s + [sink])
                e = [math.exp(v - m) for v in s]
                den = math.fsum(e) + math.exp(sink - m)
                out[b, i, h] = [math.fsum(ej * kr[c] for ej, kr in zip(e, k)) / den for c in range(D)]
                lse[b, i, h] = m + math.log(den)
    return out, lse


def _rn32(x):
    return np.float32(x)


def _round16(x, qdt, mode):
    return round_to(np.asarray(x, np.float32), "bfloat16" if qdt == BF16 else "float16",
                    rounding=mode).astype(qdt)


def _loop_faithful(q, ori, cmp, idx, sinks, scale, chip="A2", **sel):
    """The documented recipe, one row and head at a time, every fp32 value correctly rounded (fsum / float64);
    S2 tile and rounding modes of ``chip`` (docs/numerics/chips.md#deepseek-v4-shared-kv-attention)."""
    tile = 512 if chip in ("A2", "A3") else 128
    p_mode = "round"
    out_mode = "rint" if chip in ("A2", "A3") and q.dtype == BF16 else "round"
    bsz, s1, n, _ = q.shape
    out = np.zeros(q.shape, q.dtype)
    sc = np.float32(scale)
    for b in range(bsz):
        for i in range(s1):
            o_t, c_t = _selected(b, i, s1, ori.shape[1], None if cmp is None else cmp.shape[1],
                                 idx=None if idx is None else idx[b, i, 0], **sel)
            if o_t is None:
                continue
            tiles = [o_t[t:t + tile] for t in range(0, len(o_t), tile)]
            tiles = [[("o", j) for j in t] for t in tiles] + \
                [[("c", j) for j in c_t[t:t + tile]] for t in range(0, len(c_t), tile)]
            for h in range(n):
                qh = q[b, i, h].astype(np.float64)
                m = np.float32(-np.inf if sinks is None else sinks[h])
                l_, acc = np.float32(1), np.zeros(D, np.float32)
                for t in tiles:
                    k = np.array([(ori if w == "o" else cmp)[b, j, 0] for w, j in t], np.float64)
                    s = np.array([_rn32(math.fsum(qh * kr)) for kr in k], np.float32) * sc
                    m_new = max(m, s.max())
                    a = np.float32(0) if m == -np.inf else _rn32(math.exp(float(np.float32(m - m_new))))
                    e = np.array([_rn32(math.exp(float(np.float32(v - m_new)))) for v in s], np.float32)
                    l_ = np.float32(a * l_) + _rn32(math.fsum(e.astype(np.float64)))
                    p = _round16(e, q.dtype, p_mode).astype(np.float64)
                    pv = np.array([_rn32(math.fsum(p * k[:, c])) for c in range(D)], np.float32)
                    acc = (a * acc).astype(np.float32) + pv
                    m = m_new
                out[b, i, h] = _round16(acc / l_, q.dtype, out_mode)
    return out


def _sel(args):
    return dict(mode_o=args["ori_mask_mode"], mode_c=args["cmp_mask_mode"], wl=args["ori_win_left"],
                wr=args["ori_win_right"], ratio=args["cmp_ratio"],
                residual=None if args["cmp_residual_kv"] is None else int(args["cmp_residual_kv"][0]))


# float64 BLAS sums of D = 512 products against math.fsum: error below 512 * 2^-53 of the magnitudes (~1e-13)
_F64 = dict(rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("scenario,wl,mode_o,sinks", [
    ("SWA", 3, 4, True), ("CSA", 2, 4, True), ("HCA", -1, 4, False), ("CSA", 1, 3, True), ("HCA", 0, 0, True),
])
def test_exact_matches_the_loop(scenario, wl, mode_o, sinks):
    a = sfm_case(scenario=scenario, s1=3, s2=13, n1=2, k=6, ratio={"SWA": 1, "CSA": 4, "HCA": 4}[scenario])
    a.update(ori_win_left=wl, ori_mask_mode=mode_o, precision="exact", return_softmax_lse=True)
    if not sinks:
        a["sinks"] = None
    if scenario == "CSA":  # a -1 in the middle stops the reading; an entry past the bound is skipped
        a["cmp_sparse_indices"][0, 2, 0, :4] = [1, 2, -1, 0]
        a["cmp_sparse_indices"][1, 1, 0, :3] = [2, 0, 1]
    o, lse = _front(a)
    eo, el = _loop_exact(a["q"], a["ori_kv"], a["cmp_kv"], a["cmp_sparse_indices"], a["sinks"], a["softmax_scale"],
                         **_sel(a))
    assert o.dtype == np.float64 and lse.shape == (2, 1, 3, 2)
    np.testing.assert_allclose(o, eo, **_F64)
    np.testing.assert_allclose(lse[:, 0], el, **_F64)


@pytest.mark.parametrize("scenario", ["SWA", "CSA", "HCA"])
def test_faithful_matches_the_fp32_loop_bytes(scenario):
    a = sfm_case(scenario=scenario, batch=1, s1=2, s2=13, n1=2, k=6, ratio={"SWA": 1, "CSA": 4, "HCA": 4}[scenario])
    chip = qsfa.resolve_chip("sparse_flash_mla", **a)
    # the chip the call models (HCA with cmp_ratio 4 breaks an A2/A3 limit only: the 950, 128-token tiles)
    assert chip == {"SWA": "A2", "CSA": "A2", "HCA": "950"}[scenario]
    o, _ = _front(a)
    want = _loop_faithful(a["q"], a["ori_kv"], a["cmp_kv"], a["cmp_sparse_indices"], a["sinks"],
                          a["softmax_scale"], chip=chip, **_sel(a))
    assert o.dtype == BF16
    assert o.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


@pytest.mark.parametrize("chip,qdtype", [("A2", "bfloat16"), ("A3", "float16"), ("950", "bfloat16")])
def test_faithful_several_tiles_match_the_fp32_loop_bytes(chip, qdtype):
    """Several S2 tiles: A2/A3 the 128-token window, then the 4 compressed tokens in a tile of their own; 950 a
    600-token window (4 x 128 + 88) and the compressed tile. Tokens 550+ are scaled up so a later tile raises the
    running max and rescales O and l; the chip's P and output modes."""
    a = sfm_case(scenario="HCA", batch=1, s1=1, s2=600, n1=2, ratio=128, qdtype=qdtype)
    a.update(ori_win_left=127 if chip != "950" else -1, chip=chip)  # A2/A3 allow only the 128-token window
    a["ori_kv"][0, 550:, 0] = (a["ori_kv"][0, 550:, 0].astype(np.float32) * 3).astype(a["q"].dtype)
    o, _ = _front(a)
    want = _loop_faithful(a["q"], a["ori_kv"], a["cmp_kv"], None, a["sinks"], a["softmax_scale"], chip=chip,
                          **_sel(a))
    assert o.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


@pytest.mark.parametrize("chip", ["A2", "950"])
def test_faithful_scores_certified_across_tiles_match_the_fp32_loop_bytes(chip, monkeypatch):
    """K rows holding +2^60 and -2^60 against equal query entries (the pair cancels exactly) in every tile: a
    float64 matmul of such a row loses the rest of the sum to rounding, so the chunk's one Q.K product over all
    tiles must certify (and sum exactly) pairs of several tiles together; the scores (and so the output) stay
    those of the one-row-at-a-time loop."""
    import qsfa.reference.attention as att

    certified = []
    real = att.certified_f32
    monkeypatch.setattr(att, "certified_f32", lambda approx, *a, **k: (
        certified.append(np.ndim(approx) == 1), real(approx, *a, **k))[1])
    a = sfm_case(scenario="HCA", batch=1, s1=1, s2=300, n1=2, ratio=128)
    a.update(ori_win_left=127 if chip != "950" else -1, chip=chip)
    a["q"][..., 300] = a["q"][..., 0]
    for kv, rows in (("ori_kv", slice(None, None, 7)), ("cmp_kv", slice(None))):
        a[kv][0, rows, 0, 0] = 2.0 ** 60
        a[kv][0, rows, 0, 300] = -2.0 ** 60
    o, _ = _front(a)
    assert any(certified)  # the candidate pairs of the Q.K product were certified
    want = _loop_faithful(a["q"], a["ori_kv"], a["cmp_kv"], None, a["sinks"], a["softmax_scale"], chip=chip,
                          **_sel(a))
    assert o.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("where", ["q", "ori_kv"])
def test_an_inf_in_another_row_leaves_a_rows_bytes(where):
    """An inf in batch 1's query or K (the core's; the front doors refuse it) sends the chunk's Q.K product through
    one call per S2 tile (other K facts); batch 0 computed alone takes the one call over all tiles: its bytes are
    the same, with K rows (+-2^60 pairs that cancel) whose Q.K sums must be certified and summed exactly."""
    from qsfa.reference.sharedkv import sharedkv_attention

    c = sfm_case(scenario="HCA", batch=2, s1=1, s2=300, n1=2, ratio=128)
    a = {k: c[k] for k in ("q", "ori_kv", "cmp_kv", "cmp_residual_kv", "sinks", "softmax_scale", "cmp_ratio",
                           "ori_mask_mode", "cmp_mask_mode", "ori_win_right")}
    a.update(ori_win_left=-1, s2_tile=128, return_softmax_lse=True)
    a["q"][..., 300] = a["q"][..., 0]
    for kv, rows in (("ori_kv", slice(None, None, 7)), ("cmp_kv", slice(None))):
        a[kv][:, rows, 0, 0] = 2.0 ** 60
        a[kv][:, rows, 0, 300] = -2.0 ** 60
    a[where][1, 0, 0, 7] = np.inf
    alone = {**a, **{k: a[k][:1] for k in ("q", "ori_kv", "cmp_kv", "cmp_residual_kv")}}
    o, lse = sharedkv_attention(**a)
    o0, lse0 = sharedkv_attention(**alone)
    assert np.isneginf(lse[1]).any()  # the inf reached batch 1 (a NaN l: output 0, LSE -inf)
    assert o[:1].view(np.uint16).tobytes() == o0.view(np.uint16).tobytes()
    assert lse[:1].view(np.uint32).tobytes() == lse0.view(np.uint32).tobytes()


@pytest.mark.parametrize("scenario", ["SWA", "CSA", "HCA"])
@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
def test_faithful_within_its_error_bound_of_exact(scenario, qdtype):
    """|faithful - exact| within the bound of qsfa.reference.attention.attention_error_budget (K is already in the
    query dtype here, so delta has no K-rounding term) with W bounded by the largest |K| of the batch; bf16 outputs
    also pass the float criterion of docs/numerics/comparison.md (fp16's atol 2.5e-5 is below what rounding P to
    fp16 costs on outputs of magnitude ~0.1, so the bound is the check there)."""
    a = sfm_case(scenario=scenario, s1=3, s2=40, n1=4, qdtype=qdtype, ratio={"SWA": 1, "CSA": 4, "HCA": 4}[scenario])
    a["return_softmax_lse"] = True
    f, fl = _front(a)
    e, el = _front({**a, "precision": "exact"})
    u = 2.0 ** (-8 if qdtype == "bfloat16" else -11)

    def gamma(n):
        return n * 2.0 ** -24 / (1 - n * 2.0 ** -24)

    kv = [np.abs(a["ori_kv"].astype(np.float64))] + ([] if a["cmp_kv"] is None else [np.abs(a["cmp_kv"].astype(np.float64))])
    kmax = max(x.max() for x in kv)
    w_tok = 40 + 16
    qk = np.abs(a["q"].astype(np.float64)).sum(-1).max() * kmax * a["softmax_scale"]
    delta = qk * gamma(D)
    big_a = math.exp(2 * delta) * (1 + u) * (1 + gamma(w_tok + 8)) - 1
    big_e = kmax * ((1 + big_a) * (1 + u) * (1 + gamma(w_tok)) - 1)
    err = np.abs(f.astype(np.float64) - e)
    assert (err <= big_e + u * (np.abs(e) + big_e)).all(), float(err.max())
    if qdtype == "bfloat16":
        r = compare_float(f, e, dtype=qdtype)
        assert r.passed, r.message
    assert compare_float(fl, el, dtype="float32").passed


# --------------------------------------------------------------------------------------------------
# hand-worked cases: q = 0 makes every score 0, so out = (sum of the selected K) / (count + exp(sink))


def _hand(s1, s2, s3=None, ratio=1, **kw):
    q = np.zeros((1, s1, 1, D), BF16)
    ori = np.zeros((1, s2, 1, D), BF16)
    ori[0, :, 0, 0] = np.arange(s2)  # token j carries j in column 0
    a = dict(q=q, ori_kv=ori, sinks=np.array([-np.inf], np.float32), softmax_scale=1.0, cmp_ratio=ratio,
             ori_mask_mode=4, cmp_mask_mode=3, ori_win_right=0, precision="exact", return_softmax_lse=True)
    if s3 is not None:
        cmp = np.zeros((1, s3, 1, D), BF16)
        cmp[0, :, 0, 0] = 100 * (np.arange(s3) + 1)  # compressed token c carries 100 (c + 1)
        a["cmp_kv"] = cmp
    a.update(kw)
    return a


def test_hand_window_band():
    # S1 = 3, S2 = 10: thresholds 8, 9, 10; ori_win_left 2 -> windows [5, 8), [6, 9), [7, 10)
    o, lse = _front(_hand(3, 10, ori_win_left=2, ori_win_right=0))
    assert o[0, :, 0, 0].tolist() == [6.0, 7.0, 8.0]
    assert np.allclose(lse[0, 0, :, 0], math.log(3))
    # ori_win_right 1 reaches one token past the diagonal (clipped at S2): [5, 9), [6, 10), [7, 10)
    o, _ = _front(_hand(3, 10, ori_win_left=2, ori_win_right=1))
    assert o[0, :, 0, 0].tolist() == [6.5, 7.5, 8.0]


def test_hand_rows_before_the_first_kv_are_zero():
    # S1 = 4 > S2 = 2: rows 0 and 1 (i < S1 - S2) are zero with LSE 0; row 2 sees [0, 1), row 3 [0, 2); with the
    # sink logit 0 the denominators are 1 + 1 and 2 + 1
    o, lse = _front(_hand(4, 2, ori_win_left=127, ori_win_right=0, sinks=np.array([0.0], np.float32)))
    assert o[0, :, 0, 0].tolist() == [0.0, 0.0, 0.0, 1 / 3]
    assert lse[0, 0, :2, 0].tolist() == [0.0, 0.0]
    assert np.allclose(lse[0, 0, 2:, 0], [math.log(2), math.log(3)])


def test_hand_sink_in_the_denominator_only():
    # one token (value 0 in column 0, value 1 in column 1), score 0, sink 0: out = 1 / 2, lse = log 2
    a = _hand(1, 1, ori_win_left=0, sinks=np.array([0.0], np.float32))
    a["ori_kv"][0, 0, 0, 1] = 1
    o, lse = _front(a)
    assert o[0, 0, 0, 1] == 0.5 and lse[0, 0, 0, 0] == pytest.approx(math.log(2))


def test_hand_compressed_bound_uses_cmp_residual_kv():
    # S1 = 2, S2 = 10, window [thr - 1, thr); cmp_ratio 4, S3 = 2. With residual 1 the pre-compression length is
    # 2 * 4 + 1 = 9: bounds floor((9 - 2 + 0 + 1) / 4) = 2 and floor(9 / 4) = 2 -> row 0 sees both compressed
    # tokens. With residual 0 (length 8): floor(7 / 4) = 1 and floor(8 / 4) = 2.
    def run(res):
        a = _hand(2, 10, s3=2, ratio=4, ori_win_left=0, cmp_residual_kv=np.array([res], np.int32))
        return _front(a)[0][0, :, 0, 0].tolist()

    assert run(1) == [(8 + 100 + 200) / 3, (9 + 100 + 200) / 3]
    assert run(0) == [(8 + 100) / 2, (9 + 100 + 200) / 3]


def test_hand_topk_drops_minus1_and_entries_at_the_bound():
    # S1 = 2, S2 = 10, S3 = 3, residual 1: length 3 * 4 + 1 = 13 -> bounds floor(12 / 4) = 3, floor(13 / 4) = 3;
    # with S3 = 3 every index 0..2 is below the bound, so use residual 1 and S3 = 2 + an index 2 past the cache
    a = _hand(2, 10, s3=2, ratio=4, ori_win_left=0, cmp_residual_kv=np.array([1], np.int32))  # bounds 2 and 2
    idx = np.full((1, 2, 1, 4), -1, np.int32)
    idx[0, 0, 0, :3] = [2, 1, 0]  # 2 is at the bound (skipped); only positions < min(K, 2) = 2 are read: 1 kept
    idx[0, 1, 0, :3] = [0, -1, 1]  # reading stops at the first -1: 0 kept
    a["cmp_sparse_indices"] = idx
    assert _front(a)[0][0, :, 0, 0].tolist() == [(8 + 200) / 2, (9 + 100) / 2]
    idx[0, 0, 0, :3] = [-1, 0, 1]  # -1 first: no compressed token
    assert _front(a)[0][0, 0, 0, 0] == 8.0


# --------------------------------------------------------------------------------------------------
# metamorphic


def test_layouts_give_the_same_bytes():
    base = sfm_case(scenario="CSA", s2=20, layout_q="BSND", layout_kv="BSND")
    want = _front(base)[0]
    for lq, lk in (("TND", "TND"), ("BSND", "PA_BBND"), ("TND", "PA_BBND")):
        o = _front(sfm_case(scenario="CSA", s2=20, layout_q=lq, layout_kv=lk))[0]
        assert o.reshape(want.shape).view(np.uint16).tobytes() == want.view(np.uint16).tobytes(), (lq, lk)


def test_block_size_1024_and_table_order():
    want = _front(sfm_case(scenario="HCA", s2=300, ratio=128))[0]
    o = _front(sfm_case(scenario="HCA", s2=300, ratio=128, layout_kv="PA_BBND", block_size=1024))[0]
    assert o.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def test_topk_permutation_changes_nothing():
    a = sfm_case(scenario="CSA", s2=40, k=16)
    want = _front(a)[0]
    rng = np.random.default_rng(1)
    idx = a["cmp_sparse_indices"].copy()
    for b in range(idx.shape[0]):
        for i in range(idx.shape[1]):
            n = int((idx[b, i, 0] != -1).sum())
            idx[b, i, 0, :n] = rng.permutation(idx[b, i, 0, :n])
    assert _front({**a, "cmp_sparse_indices": idx})[0].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def test_minus_inf_sinks_equal_no_sinks():
    a = sfm_case(scenario="CSA", s2=20)
    a["return_softmax_lse"] = True
    inf = {**a, "sinks": np.full(a["q"].shape[-2], -np.inf, np.float32)}
    none = {**a, "sinks": None}
    for p in ("faithful", "exact"):
        x, y = _front({**inf, "precision": p}), _front({**none, "precision": p})
        assert x[0].tobytes() == y[0].tobytes() and x[1].tobytes() == y[1].tobytes()


def test_huge_sink_takes_all_the_weight():
    a = sfm_case(scenario="SWA", s2=20)
    a["sinks"] = np.full(a["q"].shape[-2], 1e30, np.float32)
    o, _ = _front(a)
    assert not o.astype(np.float32).any()


def test_split_ori_and_cmp_merge_by_lse_to_the_whole():
    """The window part (with the sink) and the compressed part (no sink) merged by their LSE equal the whole."""
    a = sfm_case(scenario="CSA", s2=24, s1=3, k=8)
    a.update(precision="exact", return_softmax_lse=True)
    whole, lw = _front(a)
    ori_only, lo = _front({**a, "cmp_kv": None, "cmp_sparse_indices": None, "cmp_residual_kv": None,
                           "cmp_mask_mode": 0})
    # the compressed part alone: no window (ori_mask_mode 0 over zero ori tokens), same bound (residual given)
    cmp_only, lc = _front({**a, "ori_mask_mode": 0, "seqused_ori_kv": np.zeros(2, np.int32), "sinks": None})
    lse = np.logaddexp(lo, lc)
    wo, wc = np.exp(lo - lse), np.exp(lc - lse)  # [B, 1, S1, N]
    merged = ori_only * wo[:, 0, :, :, None] + cmp_only * wc[:, 0, :, :, None]
    np.testing.assert_allclose(merged, whole, **_F64)
    np.testing.assert_allclose(lse, lw, **_F64)


def test_sharedkv_front_door_equals_sparse_flash_mla():
    """npu_sparse_attn_sharedkv's conventions (seqused_kv, no residual) map onto the same core."""
    for scenario in ("SWA", "CSA", "HCA"):
        s = sas_case(scenario=scenario, s2=40, n1=2, ratio={"SWA": 1, "CSA": 4, "HCA": 4}[scenario])
        m = sfm_case(scenario=scenario, s2=40, n1=2, layout_kv="PA_BBND", ratio={"SWA": 1, "CSA": 4, "HCA": 4}[scenario])
        a = dict(s)
        got = qsfa.sparse_attn_sharedkv(a.pop("q"), **a)[0]
        assert got.view(np.uint16).tobytes() == _front(m)[0].view(np.uint16).tobytes(), scenario


def test_metadata_is_ignored():
    a = sfm_case(scenario="CSA")
    want = _front(a)[0]
    assert _front({**a, "metadata": np.arange(1024, dtype=np.int32)})[0].tobytes() == want.tobytes()
    assert _front({**a, "metadata": None})[0].tobytes() == want.tobytes()


def test_one_token_decode():
    a = sfm_case(scenario="SWA", batch=1, s1=1, s2=1)
    o, _ = _front({**a, "sinks": None})
    assert o.tobytes() == a["ori_kv"][0, 0, 0][None, None, None].repeat(2, axis=2).tobytes()


def test_chip_limits():
    a = sfm_case(scenario="CSA", k=8)
    _front(a)  # the reference accepts K = 8
    with pytest.raises(qsfa.InvalidArgument, match="cmp_sparse_indices"):
        _front({**a, "chip": "A3"})
    b = sas_case(scenario="SWA")
    with pytest.raises(qsfa.InvalidArgument, match="A3 only"):
        qsfa.sparse_attn_sharedkv(b.pop("q"), chip="950", **b)


# --------------------------------------------------------------------------------------------------
# mixed_quant_sparse_flash_mla: dequantisation in front of the same core


def test_mode1_dequantisation_is_code_times_scale_rounded_half_even():
    """Every E4M3FN code (NaN codes aside) times bf16 scales around 1: decode * scale in fp32, rounded half to even
    to bf16 - computed here with ml_dtypes' casts, independently of qsfa.reference.formats."""
    from qsfa.reference.sharedkv import dequant_mode1

    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    scales = np.array([1.0, 1.0078125, 1.0234375, 1.5, 0.0078125, 3.0], np.float32).astype(BF16)
    rows = np.zeros((scales.size, codes.size // 448 + 1, 608), np.uint8)
    vals = np.resize(codes, (scales.size, rows.shape[1], 448))
    rows[..., 128:576] = vals
    rows[..., 576:590] = np.repeat(scales[:, None, None], 7, axis=2).view(np.uint8).reshape(scales.size, 1, 14)
    got = dequant_mode1(rows)
    want = (vals.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            * scales.astype(np.float32)[:, None, None]).astype(BF16)
    assert got[..., :448].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    assert not got[..., 448:].astype(np.float32).any()  # the RoPE bytes (zero here) copied


@pytest.mark.parametrize("quant_mode,layout_kv", [(1, "BSND"), (1, "PA_BBND"), (2, "PA_BBND")])
def test_mixed_quant_equals_sparse_flash_mla_on_the_dequantised_rows(quant_mode, layout_kv):
    from qsfa.ops.sharedkv import mq_case
    from qsfa.reference.sharedkv import dequant_mode1, dequant_mode2

    a = mq_case(scenario="CSA", s2=40, n1=64, quant_mode=quant_mode, layout_kv=layout_kv)
    q = a.pop("q")
    got = qsfa.mixed_quant_sparse_flash_mla(q, **a)[0]
    deq = dequant_mode1 if quant_mode == 1 else dequant_mode2
    b = {k: v for k, v in a.items() if k not in ("quant_mode", "rope_head_dim")}
    b.update(ori_kv=deq(a["ori_kv"]), cmp_kv=deq(a["cmp_kv"]))
    if layout_kv != "PA_BBND":
        b["seqused_ori_kv"] = b["seqused_cmp_kv"] = None
    want = qsfa.sparse_flash_mla(q, chip="950", **b)[0]
    assert got.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def test_mixed_quant_mode2_is_the_model1_layout():
    """A MODEL1 cache written by qsfa.layouts.flashmla_model1_quantize, cut to its unpadded blocks, is a valid
    quant_mode 2 cache holding the same values."""
    from qsfa.reference.sharedkv import dequant_mode2

    rng = np.random.default_rng(3)
    k = rng.uniform(-1, 1, (2, 16, 1, 512)).astype(BF16)
    cache = qsfa.layouts.flashmla_model1_quantize(k)
    blocks = np.ascontiguousarray(cache[:, : 16 * 584]).reshape(2, 16, 1, 584)
    back = qsfa.layouts.flashmla_model1_dequantize(cache, block_size=16)
    assert dequant_mode2(blocks).view(np.uint16).tobytes() == back.view(np.uint16).tobytes()


# --------------------------------------------------------------------------------------------------
# kv_quant_sparse_attn_sharedkv: 640-byte rows


def test_640_rows_dequantise_exactly():
    """Every E4M3FN code (NaN codes aside) times 2^(byte - 127) for a few scale bytes: exact in bf16 (ml_dtypes'
    casts computed here), RoPE bytes copied, pad bytes never read."""
    from qsfa.reference.sharedkv import dequant_640

    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    rows = np.zeros((4, 2, 640), np.uint8)
    rows[..., 128:576] = np.resize(codes, (4, 2, 448))
    for i, e in enumerate((127, 120, 130, 100)):
        rows[i, :, 576:583] = e
    rows[..., 583:] = 0xFF  # pad: junk
    rows[..., :128] = np.arange(128, dtype=np.uint8)  # RoPE bytes
    got = dequant_640(rows)
    want = (rows[..., 128:576].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            * np.exp2(rows[..., 576:577].astype(np.float64) - 127)).astype(BF16)
    assert got[..., :448].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    assert got[..., 448:].view(np.uint8).tobytes() == rows[..., :128].tobytes()


@pytest.mark.parametrize("scenario", ["SWA", "CSA", "HCA"])
def test_kv_quant_sharedkv_equals_sharedkv_on_the_dequantised_rows(scenario):
    from qsfa.ops.sharedkv import kqs_case
    from qsfa.reference.sharedkv import dequant_640

    ratio = {"SWA": 1, "CSA": 4, "HCA": 128}[scenario]
    a = kqs_case(scenario=scenario, s2=300, ratio=ratio)
    q, mode = a.pop("q"), a.pop("kv_quant_mode")
    got = qsfa.kv_quant_sparse_attn_sharedkv(q, mode, chip="950", **a)[0]
    b = {k: v for k, v in a.items() if k not in ("tile_size", "rope_head_dim")}
    b.update(ori_kv=dequant_640(a["ori_kv"]), cmp_kv=None if a["cmp_kv"] is None else dequant_640(a["cmp_kv"]))
    want = qsfa.sparse_attn_sharedkv(q, **b)[0]  # resolves to A3 (the sharedkv kernel's chip)
    assert got.dtype == BF16 and got.shape == q.shape
    from qsfa.chips import sharedkv_numerics
    from qsfa.reference.sharedkv import sharedkv_attention

    # the same core on the dequantised rows with the 950 numerics gives the same bytes

    num = sharedkv_numerics("950", {"q": q})
    cmp_len = None if scenario == "SWA" else np.asarray(a["seqused_kv"], np.int64) // ratio
    res = None if scenario == "SWA" else np.asarray(a["seqused_kv"], np.int64) % ratio
    ref = sharedkv_attention(q, b["ori_kv"], b["cmp_kv"], a["cmp_sparse_indices"], ori_block_table=a["ori_block_table"],
                  cmp_block_table=a["cmp_block_table"], seqused_ori_kv=a["seqused_kv"], seqused_cmp_kv=cmp_len,
                  cmp_residual_kv=res, sinks=a["sinks"], softmax_scale=a["softmax_scale"], cmp_ratio=ratio,
                  ori_mask_mode=4, cmp_mask_mode=a["cmp_mask_mode"], ori_win_left=127, ori_win_right=0,
                  layout_kv="PA_ND", **num)[0]
    assert got.view(np.uint16).tobytes() == ref.view(np.uint16).tobytes()
    assert compare_float(got, want, dtype="bfloat16").passed  # A3 tiles / rounding: within the criterion


def test_only_rows_and_attention_out_assemble_to_the_serial_bytes(tmp_path):
    """A call split into row ranges (qsfa.reference.attention.only_rows, as qsfa.distributed's row tasks run it),
    each streamed into an attention_out= memmap, gives per range the bytes of one in-memory call; the buffer's
    rows outside the range keep their bytes (the returned LSE is zero there), so the ranges, run one after another
    into one shared memmap, fill it with the bytes of the whole call."""
    from qsfa.reference.attention import only_rows
    from qsfa.reference.sharedkv import sharedkv_attention

    a = sfm_case(scenario="CSA", layout_q="TND", batch=2, s1=9, s2=700, n1=4, k=512, seed=5)
    for p in ("ori_sparse_indices", "metadata", "ori_topk_length", "cmp_topk_length", "topk_value_mode"):
        a.pop(p)
    a["return_softmax_lse"] = True
    q, ori, cmp, idx = (a.pop(k) for k in ("q", "ori_kv", "cmp_kv", "cmp_sparse_indices"))
    want, want_lse = sharedkv_attention(q, ori, cmp, idx, **a)
    want, want_lse = want.reshape(q.shape[0], -1), want_lse.reshape(q.shape[0], -1)
    assert np.abs(want.astype(np.float32)).min(axis=1).max() > 0
    buf = np.lib.format.open_memmap(tmp_path / "out.npy", mode="w+", dtype=q.dtype, shape=q.shape)
    shared = np.lib.format.open_memmap(tmp_path / "shared.npy", mode="w+", dtype=q.dtype, shape=q.shape)
    shared[:] = np.ones((), q.dtype)  # garbage the ranges together must overwrite
    for lo in range(0, q.shape[0], 5):
        buf[:] = np.ones((), q.dtype)  # garbage the call must overwrite in its range, and keep elsewhere
        with only_rows(lo, lo + 5):
            got, lse = sharedkv_attention(q, ori, cmp, idx, attention_out=buf, **a)
            sharedkv_attention(q, ori, cmp, idx, attention_out=shared, **a)
        assert got is buf
        got, lse = np.asarray(got).reshape(q.shape[0], -1), lse.reshape(q.shape[0], -1)
        inside = np.zeros(q.shape[0], bool)
        inside[lo:lo + 5] = True
        assert got[inside].tobytes() == want[inside].tobytes()
        assert lse[inside].tobytes() == want_lse[inside].tobytes()
        assert (got[~inside] == np.ones((), q.dtype)).all() and not lse[~inside].any()
    assert np.asarray(shared).reshape(q.shape[0], -1).tobytes() == want.tobytes()


def test_rows_that_select_no_token_give_zero_and_the_sink_as_lse():
    """Every row of the call selects nothing (an empty window cache, no compressed part): out = 0 and
    lse = log(exp(sink)) = sink, in both precisions (no S2 tile to run)."""
    from qsfa.reference.sharedkv import sharedkv_attention

    a = sfm_case(scenario="SWA", layout_kv="PA_BBND", batch=2, s1=2, s2=40, n1=2, block_size=16, seed=1)
    for p in ("ori_sparse_indices", "metadata", "ori_topk_length", "cmp_topk_length", "topk_value_mode"):
        a.pop(p)
    a.update(seqused_ori_kv=np.zeros(2, np.int32), ori_mask_mode=0, return_softmax_lse=True)
    q, ori, cmp, idx = (a.pop(k) for k in ("q", "ori_kv", "cmp_kv", "cmp_sparse_indices"))
    for prec in ("faithful", "exact"):
        out, lse = sharedkv_attention(q, ori, cmp, idx, **{**a, "precision": prec})
        assert not out.astype(np.float64).any()
        np.testing.assert_array_equal(lse.reshape(-1, 2), np.broadcast_to(a["sinks"].astype(lse.dtype), (4, 2)))


# ------------------------------------------------------------------------------------------------------------
# quant_sparse_flash_mla (HiFloat8 Q / K / V, per-tensor descales; docs/numerics/attention-v4.md)


def _qs_call(a, **over):
    a = {**a, **over}
    q, mode = a.pop("q"), a.pop("quant_mode")
    return qsfa.quant_sparse_flash_mla(q, mode, chip="950", **a)


def _hif8(x):
    from qsfa.reference.formats import decode

    return decode(np.asarray(x, np.uint8), "hifloat8").astype(np.float64)


def test_qs_exact_is_the_float64_definition():
    """SWA, BSND, 3 query rows over 9 tokens (window 127 covers all): exact equals softmax written here in float64
    over the decoded codes times their descales, the sink in the denominator only."""
    from qsfa.ops.sharedkv import qs_case

    a = qs_case(scenario="SWA", layout_kv="BSND", batch=1, s1=3, s2=9, n1=4)
    out, lse = _qs_call(a, precision="exact", return_softmax_lse=True)
    q = _hif8(a["q"])[0] * float(a["q_descale"][0])  # [S1, N1, D]
    k = _hif8(a["ori_kv"])[0, :, 0] * float(a["ori_kv_descale"][0])  # [S2, D]
    sink = a["sinks"].astype(np.float64)
    for i in range(3):
        n = 9 - 3 + i + 1  # the causal diagonal: tokens [0, n)
        s = q[i] @ k[:n].T * a["softmax_scale"]  # [N1, n]
        m = np.maximum(s.max(axis=1), sink)
        e = np.exp(s - m[:, None])
        den = e.sum(axis=1) + np.exp(sink - m)
        np.testing.assert_allclose(out[0, i], (e @ k[:n]) / den[:, None], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(lse[0, 0, i], m + np.log(den), rtol=1e-12)


def test_qs_descales_at_the_kernel_points():
    """q = 0: every score 0, E = 1, P = HiFloat8(16) = 16. HCA over 4 window tokens (V lane 0 = 1) and 1 compressed
    token (V lane 0 = 1): tile 0 keeps O = 4 * 16 = 64 un-descaled, tile 1 gives O = RN(64 * 1.25) + RN(16 * 0.5)
    = 88, l = 4 + 1 = 5, out = bf16(88 / 5 / 16) = bf16(1.1); exact: (4 * 1.25 + 0.5) / 5 = 1.1."""
    from qsfa.reference.formats import encode

    q = np.zeros((1, 1, 2, 512), np.uint8)
    ori = np.zeros((1, 4, 1, 512), np.float32)
    ori[..., 0] = 1.0
    cmp = np.zeros((1, 1, 1, 512), np.float32)
    cmp[..., 0] = 1.0
    kw = dict(ori_kv=encode(ori, "hifloat8"), cmp_kv=encode(cmp, "hifloat8"), q_descale=np.array([3.0], np.float32),
              ori_kv_descale=np.array([1.25], np.float32), cmp_kv_descale=np.array([0.5], np.float32),
              cmp_residual_kv=np.zeros(1, np.int32), sinks=None, metadata=np.zeros(1024, np.int32), cmp_ratio=4,
              ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127, ori_win_right=0)
    out = qsfa.quant_sparse_flash_mla(q, 1, **kw)[0]
    want = np.float32(np.float32(np.float32(88.0) / np.float32(5.0)) * np.float32(1 / 16)).astype(BF16)
    assert out.dtype == BF16 and out.view(np.uint16)[0, 0, 0, 0] == np.asarray(want).view(np.uint16)
    assert float(out[0, 0, 1, 1]) == 0.0
    ex = qsfa.quant_sparse_flash_mla(q, 1, precision="exact", **kw)[0]
    assert ex[0, 0, 0, 0] == pytest.approx(1.1, rel=1e-15)
    # swapping the two KV descales moves the result: (4 * 0.5 + 1.25) / 5 = 0.65
    swapped = qsfa.quant_sparse_flash_mla(q, 1, precision="exact", **{**kw, "ori_kv_descale": kw["cmp_kv_descale"],
                                                                        "cmp_kv_descale": kw["ori_kv_descale"]})[0]
    assert swapped[0, 0, 0, 0] == pytest.approx(0.65, rel=1e-15)


@pytest.mark.parametrize("scenario", ["SWA", "CSA", "HCA"])
def test_qs_faithful_lies_near_exact(scenario):
    """P carries HiFloat8's 3-bit significand (relative step 2^-3 near 1, so at most 2^-4 away after rounding):
    faithful stays within 2^-4 of the largest |exact| entry per row - and is not exact itself."""
    from qsfa.ops.sharedkv import qs_case

    a = qs_case(scenario=scenario, s1=2, s2=200, n1=16)
    fa = _qs_call(a)[0].astype(np.float64)
    ex = _qs_call(a, precision="exact")[0]
    scale = np.abs(ex).max(axis=-1, keepdims=True)
    assert (np.abs(fa - ex) <= 2.0 ** -4 * scale + 2.0 ** -20).all()
    assert np.abs(fa - ex).max() > 0


def test_qs_rejects_bad_input_before_running():
    from qsfa import InvalidArgument
    from qsfa.ops.sharedkv import qs_case

    a = qs_case(scenario="CSA")
    with pytest.raises(InvalidArgument, match="Invalid value for cmp_kv_descale, actual: None"):
        _qs_call(a, cmp_kv_descale=None)
    with pytest.raises(InvalidArgument, match="Invalid value for quant_mode, actual: 2"):
        _qs_call(a, quant_mode=2)
    with pytest.raises(InvalidArgument, match="quant_sparse_flash_mla runs on Ascend 950 only"):
        q, mode = a.pop("q"), a.pop("quant_mode")
        qsfa.quant_sparse_flash_mla(q, mode, chip="A3", **a)


def test_qs_descale_order_matters_only_off_powers_of_two():
    """The OPEN descale order (docs/numerics/open-facts.md#quant-sparse-flash-mla-descale-order): with descales
    2.0 (the public golden's draws) the kernel's and the golden's orders give the same bytes; with 1.1 / 0.9 / 1.3
    a few differ (3 of 32768 here: fp32 last-bit differences rarely survive the bf16 output)."""
    from qsfa.ops.sharedkv import qs_case
    from qsfa.reference.sharedkv_hif8 import hif8_sharedkv_attention

    a = qs_case(scenario="CSA", s1=2, s2=400, n1=16, seed=2)
    keep = ("cmp_sparse_indices", "ori_block_table", "cmp_block_table", "seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv", "sinks",
            "softmax_scale", "cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right",
            "layout_q", "layout_kv")
    kw = {k: a[k] for k in keep}

    def run(d, order):
        ds = [np.array([v], np.float32) for v in d]
        return hif8_sharedkv_attention(a["q"], a["ori_kv"], a["cmp_kv"], q_descale=ds[0], ori_kv_descale=ds[1],
                                       cmp_kv_descale=ds[2], descale_order=order, **kw)[0].view(np.uint16)

    assert run((2.0, 2.0, 2.0), "kernel").tobytes() == run((2.0, 2.0, 2.0), "golden").tobytes()
    assert (run((1.1, 0.9, 1.3), "kernel") != run((1.1, 0.9, 1.3), "golden")).sum() == 3


def test_block_table_padding_past_a_batch_is_not_read():
    """Batches of 20 and 40 tokens in blocks of 16: batch 0 owns 2 table entries, batch 1 owns 3. A -1 in batch 0's
    third column (the public goldens' padding) is accepted and gives the bytes of any valid entry there."""
    a = sfm_case(scenario="SWA", layout_kv="PA_BBND", batch=2, s1=1, s2=40)
    a["seqused_ori_kv"] = np.array([20, 40], np.int32)
    assert a["ori_block_table"].shape[1] == 3
    q = a.pop("q")
    pad = {**a, "ori_block_table": a["ori_block_table"].copy()}
    pad["ori_block_table"][0, 2] = -1
    assert qsfa.sparse_flash_mla(q, **pad)[0].tobytes() == qsfa.sparse_flash_mla(q, **a)[0].tobytes()
    bad = {**a, "ori_block_table": a["ori_block_table"].copy()}
    bad["ori_block_table"][0, 1] = -1  # batch 0's own second block
    with pytest.raises(qsfa.InvalidArgument, match="Invalid shape for ori_block_table"):
        qsfa.sparse_flash_mla(q, **bad)


def test_quant_sparse_flash_mla_refuses_none_for_its_defaulted_attributes():
    """softmax_scale / cmp_ratio default to 1.0 / 1 (cann_ops_transformer's signature); None was declared allowed,
    so softmax_scale=None passed every rule and returned an all-zero output, cmp_ratio=None a TypeError."""
    from qsfa.ops.sharedkv import qs_case

    for name in ("softmax_scale", "cmp_ratio"):
        kw = qs_case()
        q, quant_mode = kw.pop("q"), kw.pop("quant_mode")
        kw[name] = None
        with pytest.raises(qsfa.InvalidDtype, match=f"^Invalid type for {name}, actual: None, reason: "):
            qsfa.quant_sparse_flash_mla(q, quant_mode, **kw)


def test_a_chip_the_v4_entry_point_does_not_run_on_is_named_in_the_message():
    """The chip rules said 'actual: this chip'; the message names the chips refused, as qkv_rms_norm_rope_cache_with_k_scale
    and quant_compressor do ('Atlas A2/A3')."""
    from qsfa.ops.sharedkv import qs_case

    kw = qs_case()
    q, quant_mode = kw.pop("q"), kw.pop("quant_mode")
    with pytest.raises(qsfa.InvalidArgument, match="^Invalid value for q, actual: 'Atlas A2/A3', reason: "):
        qsfa.quant_sparse_flash_mla(q, quant_mode, chip="A3", **kw)
    with pytest.raises(qsfa.InvalidArgument, match="^Invalid value for q, actual: 'Atlas A2 or Ascend 950', reason: "):
        qsfa.sparse_attn_sharedkv(**sas_case(), chip="950")


@pytest.mark.parametrize("mode", ["round", "rint"])
def test_p_rounded_on_the_fp32_bits_equals_the_bf16_cast(mode):
    """The faithful path rounds P on e's fp32 bits in place (no NaN): the same P values and the same per-tile
    minimum magnitude (the lq fact the P @ V exactness test reads) as the bf16 array, tiles of zeros included."""
    from qsfa.reference.sharedkv import _round_p

    rng = np.random.default_rng(4)
    for _ in range(50):
        e = np.exp(-rng.exponential(rng.choice([1.0, 10.0, 60.0, 100.0]), (3, 5, 40))).astype(np.float32)
        e[rng.random(e.shape) < rng.choice([0.0, 0.3, 0.95])] = 0
        e[0, 0, :] = 0
        e[1, 1, :3] = np.float32(1.0)
        e[2, 2, 5] = np.float32(2.0 ** -133)  # a bf16 subnormal
        lo_t = np.array(sorted({0, *rng.choice(np.arange(1, 40), 3, replace=False).tolist()}))
        want64, got64 = np.empty(e.shape), np.empty(e.shape)
        want = _round_p(e.copy(), lo_t, "bfloat16", mode, False, want64)
        got = _round_p(e.copy(), lo_t, "bfloat16", mode, True, got64)
        assert want64.tobytes() == got64.tobytes()
        assert np.array_equal(np.asarray(want, np.int64), np.asarray(got, np.int64))
        assert (np.asarray(want) == 0xFFFF).any()  # a tile of zeros


@pytest.mark.parametrize("tiny", [False, True])
def test_v_facts_from_the_row_facts_or_the_columns_give_the_same_bytes(monkeypatch, tiny):
    """P @ V's exactness facts come from the tile's row facts when those fit the P rows' room, from a reduction of
    V's columns otherwise (qsfa.reference.sharedkv._k_facts): both give the bytes of a call that always reduces
    the columns. ``tiny``: a 2^-100 value in one K row makes the tile-wide span too wide, so the columns are
    reduced (and some products certified)."""
    from qsfa.reference import sharedkv as S

    a = sfm_case(scenario="CSA", layout_q="TND", batch=2, s1=3, s2=700, n1=4, k=512, seed=9)
    for p in ("ori_sparse_indices", "metadata", "ori_topk_length", "cmp_topk_length", "topk_value_mode"):
        a.pop(p)
    a["return_softmax_lse"] = True
    q, ori, cmp, idx = (a.pop(k) for k in ("q", "ori_kv", "cmp_kv", "cmp_sparse_indices"))
    if tiny:
        cmp = cmp.copy()
        cmp.reshape(-1, cmp.shape[-1])[:, 7] = np.asarray(2.0 ** -100, cmp.dtype)
    real = S._k_facts
    used = []

    def spy(*args):
        kf, vf, finite = real(*args)

        def vf_spy(t, room=None):
            got = vf(t, room)
            used.append(got[0].strides[-1] == 0)  # a broadcast: the tile-wide facts
            return got

        return kf, vf_spy, finite

    monkeypatch.setattr(S, "_k_facts", spy)
    got = S.sharedkv_attention(q, ori, cmp, idx, **a)
    fast = list(used)

    def columns_only(*args):
        kf, vf, finite = real(*args)
        return kf, (lambda t, room=None: vf(t)), finite

    monkeypatch.setattr(S, "_k_facts", columns_only)
    want = S.sharedkv_attention(q, ori, cmp, idx, **a)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
    assert fast and (not all(fast) if tiny else all(fast))  # (tiny: the window tile, from ori_kv, stays fast)
