"""Token selection of QSFA on tiny hand-computed cases (docs/numerics/attention.md#token-selection).

The KV tokens carry one-hot values: token j has NoPE code 1 at column 1 + j (scale 1.0), so V_j = e_{1+j}.
With a zero query every selected token scores 0, the attention is uniform and the output row is
``(1/n) * indicator(selected tokens)``: the non-zero columns name exactly the selected tokens, softmax_max
is 0 and softmax_sum is the number of selected tokens (exactly, with multiplicity).
"""

import math

import numpy as np
import pytest

import qsfa
from test_attention_support import BF16, Case, layout_args, lse_to_logical, to_logical

LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("BSND", "PA_BSND"), ("TND", "PA_BSND")]


def one_hot_case(idx, act_q, act_kv, *, kv=None, rope=64, q_first=None):
    """idx: [B, S, K] lists; token j of every batch has V = e_{1+j}; q = 0 (or q[..., 0] = q_first)."""
    idx = np.asarray(idx, np.int32)
    b, s, _ = idx.shape
    kv = kv or max(act_kv)
    codes = np.zeros((b, kv, 512), np.int8)
    codes[:, np.arange(kv), 1 + np.arange(kv)] = 1
    q = np.zeros((b, s, 2, 512 + rope), BF16)
    if q_first is not None:
        q[..., 0] = q_first
    rp = np.zeros((b, kv, rope), BF16) if rope else None
    scales = np.ones((b, kv, 4), np.float32)
    return Case(q, codes, rp, scales, idx, act_q, act_kv)


def run(case, layouts=("BSND", "BSND"), **kw):
    args = layout_args(case, *layouts)
    args.update(return_softmax_lse=True, **kw)
    out, mx, sm = qsfa.kv_quant_sparse_flash_attention(**args)
    lq = layouts[0]
    return (to_logical(out, case, lq).astype(np.float32), lse_to_logical(mx, case, lq),
            lse_to_logical(sm, case, lq))


def selected(row):
    """Tokens whose one-hot column is non-zero in an output row [heads, 512] (all heads agree)."""
    cols = np.nonzero(row[0, 1:])[0]
    assert np.array_equal(row[0], row[1])
    return cols.tolist()


def check_uniform(out, mx, sm, b, i, tokens):
    """Row (b, i) attended uniformly over the distinct ``tokens``: each gets bf16(1/n), max 0, sum n."""
    assert selected(out[b, i]) == sorted(tokens)
    n = len(tokens)
    assert np.all(sm[b, i] == n)
    assert np.all(mx[b, i] == 0)
    if n:
        want = np.float32(np.asarray(np.float32(1) / np.float32(n)).astype(BF16))
        assert np.all(out[b, i, :, [1 + t for t in tokens]] == want)
    else:
        assert not out[b, i].any()


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x))
@pytest.mark.parametrize("rope", [0, 64])
def test_causal_threshold(layouts, rope):
    # actQ = 3, actKV = 5: row i sees tokens < 5 - 3 + i + 1 = 3 + i
    case = one_hot_case([[[0, 1, 2, 3, 4]] * 3], [3], [5], rope=rope)
    out, mx, sm = run(case, layouts)
    for i, toks in enumerate([[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]):
        check_uniform(out, mx, sm, 0, i, toks)


def test_only_first_ceil_threshold_entries_are_read():
    # row 0: threshold 3 -> entries [4, 3, 2] read, 4 and 3 are past the threshold -> only token 2;
    # row 1: threshold 4 -> [4, 3, 2, 1] -> {3, 2, 1}; row 2: threshold 5 -> every entry
    case = one_hot_case([[[4, 3, 2, 1, 0]] * 3], [3], [5])
    out, mx, sm = run(case)
    check_uniform(out, mx, sm, 0, 0, [2])
    check_uniform(out, mx, sm, 0, 1, [3, 2, 1])
    check_uniform(out, mx, sm, 0, 2, [4, 3, 2, 1, 0])


def test_sparse_mode_0_sees_every_selected_token():
    case = one_hot_case([[[4, 3, 2, 1, 0]] * 3], [3], [5])
    out, mx, sm = run(case, sparse_mode=0)
    for i in range(3):
        check_uniform(out, mx, sm, 0, i, [0, 1, 2, 3, 4])


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x))
def test_block_sparse_selection(layouts):
    # sbs 4, actKV 10: entry 2 -> tokens 8, 9 (10, 11 clipped by actKV), entry 0 -> 0..3
    case = one_hot_case([[[2, 0, -1]] * 2], [2], [10], kv=12)
    out, mx, sm = run(case, layouts, sparse_block_size=4)
    check_uniform(out, mx, sm, 0, 0, [8, 0, 1, 2, 3])  # threshold 9 clips token 9
    check_uniform(out, mx, sm, 0, 1, [8, 9, 0, 1, 2, 3])
    out, mx, sm = run(case, layouts, sparse_block_size=4, sparse_mode=0)
    check_uniform(out, mx, sm, 0, 0, [8, 9, 0, 1, 2, 3])


def test_block_sparse_reads_ceil_threshold_over_sbs_entries():
    # threshold 5, sbs 4 -> ceil(5/4) = 2 entries read: [1, 2] -> tokens 4 (5..7 past the threshold); entry 0 unread
    case = one_hot_case([[[1, 2, 0]]], [1], [5], kv=12)
    out, mx, sm = run(case, sparse_block_size=4)
    check_uniform(out, mx, sm, 0, 0, [4])


def test_minus_one_in_the_middle_stops_reading():
    case = one_hot_case([[[1, -1, 3]]], [1], [5])
    out, mx, sm = run(case)
    check_uniform(out, mx, sm, 0, 0, [1])


def test_indices_past_threshold_or_length_are_ignored():
    # actQ 1, actKV 5: threshold 5; 7 and 5 are past it (and past actKV), 1 and 0 kept; reading continues
    case = one_hot_case([[[7, 1, 5, 0]]], [1], [5], kv=8)
    out, mx, sm = run(case)
    check_uniform(out, mx, sm, 0, 0, [1, 0])


def test_duplicate_indices_count_twice():
    # the kernel gathers what the indices say: a repeated token enters the softmax twice
    case = one_hot_case([[[1, 1, 2]]], [1], [5])
    out, mx, sm = run(case)
    assert sm[0, 0, 0] == 3 and mx[0, 0, 0] == 0
    assert out[0, 0, 0, 2] == np.float32(np.asarray(np.float32(2) / np.float32(3)).astype(BF16))
    assert out[0, 0, 0, 3] == np.float32(np.asarray(np.float32(1) / np.float32(3)).astype(BF16))


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x))
def test_empty_rows_give_zero_output_and_zero_statistics(layouts):
    # actQ 3 > actKV 1: rows 0, 1 have threshold <= 0; row 2 sees token 0
    case = one_hot_case([[[0, -1], [0, -1], [0, -1]], [[-1, -1], [3, 4], [0, 1]]], [3, 3], [1, 5])
    out, mx, sm = run(case, layouts)
    check_uniform(out, mx, sm, 0, 0, [])
    check_uniform(out, mx, sm, 0, 1, [])
    check_uniform(out, mx, sm, 0, 2, [0])
    check_uniform(out, mx, sm, 1, 0, [])  # first entry -1
    check_uniform(out, mx, sm, 1, 1, [3])  # threshold 4: entry 4 is past it
    check_uniform(out, mx, sm, 1, 2, [0, 1])


def test_empty_row_when_all_entries_past_threshold():
    case = one_hot_case([[[3, 4], [3, 4]]], [2], [4])  # row 0: threshold 3 -> entries 3, 4 both past it
    out, mx, sm = run(case)
    check_uniform(out, mx, sm, 0, 0, [])
    check_uniform(out, mx, sm, 0, 1, [3])


def test_bsnd_padding_rows_are_zero():
    case = one_hot_case([[[0, 1]] * 3, [[0, 1]] * 3], [1, 3], [4, 4])
    out, mx, sm = run(case)
    check_uniform(out, mx, sm, 0, 0, [0, 1])
    for i in (1, 2):  # rows past actQ of batch 0
        assert not out[0, i].any() and not mx[0, i].any() and not sm[0, i].any()
    check_uniform(out, mx, sm, 1, 2, [0, 1])


def test_tnd_rows_past_the_last_prefix_sum_are_zero():
    case = one_hot_case([[[0, 1]] * 2], [2], [4])
    args = layout_args(case, "TND", "TND")
    q = np.concatenate([args["query"], np.ones_like(args["query"][:1])])  # one trailing row
    idx = np.concatenate([args["sparse_indices"], args["sparse_indices"][:1]])
    args.update(query=q, sparse_indices=idx, return_softmax_lse=True)
    out, mx, sm = qsfa.kv_quant_sparse_flash_attention(**args)
    assert out.shape[0] == 3 and not out[2].any() and not mx[0, 2].any() and not sm[0, 2].any()
    assert out[1].astype(np.float32).any()


def test_scores_drive_the_softmax_by_hand():
    # q[0] = 1, K_j[0] = 2j, scale 0.5 -> scores j; tokens {0, 1}: p = (1, e) / (1 + e)
    case = one_hot_case([[[0, 1]]], [1], [2])
    case.codes[0, 1, 0] = 2
    case.q[..., 0] = 1
    out, mx, sm = run(case, scale_value=0.5)
    p1 = math.e / (1 + math.e)
    # column 0 = sum_j p_j K_j[0] = 2 p1; columns 1, 2 = p0, p1
    want = np.array([2 * p1, 1 - p1, p1])
    assert np.all(mx[0, 0] == 1.0)
    assert np.all(np.abs(sm[0, 0] - (1 + math.exp(-1))) <= 2 ** -23)
    assert np.max(np.abs(out[0, 0, :, :3] - want)) <= 2 ** -7  # bf16 rounding of P and of the output
    exact, mx_e, sm_e = qsfa.kv_quant_sparse_flash_attention(**{**layout_args(case), "scale_value": 0.5,
                                                                "precision": "exact", "return_softmax_lse": True})
    assert np.max(np.abs(exact[0, 0, :, :3] - want)) < 1e-15
    assert np.all(mx_e[0, 0] == 1.0) and np.all(np.abs(sm_e[0, 0] - (1 + math.exp(-1))) < 1e-15)
