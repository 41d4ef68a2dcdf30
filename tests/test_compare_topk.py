"""qsfa.compare.compare_topk (docs/numerics/comparison.md#top-k-criterion): index sets judged fairly at ties, with
exact set equality reported apart. Every expected verdict is worked out from the small score rows below."""

import numpy as np
import pytest

from qsfa.compare import TOPK_RTOL, compare_topk

# one row of 6 candidates; top-3 of the golden: 0 (9.0), 2 (5.0), 4 (4.0); candidate 1 is 4.0002 / 4.0 away
SCORES = np.array([[9.0, 4.0, 5.0, 1.0, 4.0, 4.0004]])


def test_identical_sets_in_any_order_are_exact():
    r = compare_topk(np.array([[4, 0, 2]]), np.array([[0, 2, 4]]), SCORES)
    assert r.passed and r.topk == {"rows": 1, "exact_rows": 1, "tie_rows": 0, "failing_rows": 0, "rtol": TOPK_RTOL}
    assert r.message.startswith("PASS: 1 rows: 1 identical")


def test_a_tie_at_the_kth_score_passes_but_is_not_exact():
    # candidate 1 has the k-th score 4.0 exactly: swapping it for 4 is a tie
    r = compare_topk(np.array([[0, 2, 1]]), np.array([[0, 2, 4]]), SCORES)
    assert r.passed and r.topk["exact_rows"] == 0 and r.topk["tie_rows"] == 1


def test_within_and_beyond_the_relative_tolerance():
    # candidate 5: |4.0004 - 4| / 4 = 1e-4 -> passes at rtol 1e-4, fails at 5e-5
    assert compare_topk(np.array([[0, 2, 5]]), np.array([[0, 2, 4]]), SCORES).passed
    r = compare_topk(np.array([[0, 2, 5]]), np.array([[0, 2, 4]]), SCORES, rtol=5e-5)
    assert not r.passed and r.n_fail == 1
    w = r.worst[0]
    assert w["index"] == 4 or w["index"] == 5
    assert w["kth"] == 4.0 and w["reason"] == "score too far from the k-th"
    # candidate 3 (1.0) is far below the k-th score
    r = compare_topk(np.array([[0, 2, 3]]), np.array([[0, 2, 4]]), SCORES)
    assert not r.passed and "1 rows fail" in r.message


def test_padding_counts_repeats_and_range():
    g = np.array([[0, 2, -1]])
    assert compare_topk(np.array([[2, 0, -1]]), g, SCORES).passed
    assert "2 valid indices, golden 3" in compare_topk(np.array([[0, 2, -1]]), np.array([[0, 2, 4]]),
                                                       SCORES).worst[0]["reason"]
    assert compare_topk(np.array([[0, 0, 2]]), np.array([[0, 2, 4]]), SCORES).worst[0]["reason"] == "repeated index"
    assert "outside" in compare_topk(np.array([[0, 2, 6]]), np.array([[0, 2, 4]]), SCORES).worst[0]["reason"]


def test_zero_kth_score_needs_equal_scores():
    sc = np.array([[3.0, 0.0, 0.0, -0.0, 1e-30]])
    g = np.array([[0, 1]])
    assert compare_topk(np.array([[0, 2]]), g, sc).passed  # 0 vs 0
    assert compare_topk(np.array([[0, 3]]), g, sc).passed  # -0 == 0
    assert not compare_topk(np.array([[0, 4]]), g, sc).passed  # any distance from a zero k-th score fails


def test_rows_of_several_dimensions_and_shape_errors():
    rng = np.random.default_rng(0)
    sc = np.stack([rng.permutation(np.arange(50.0)) for _ in range(6)]).reshape(2, 3, 50)  # distinct scores
    g = np.argsort(-sc, axis=-1, kind="stable")[..., :8]
    outside = int(np.argsort(-sc[0, 1], kind="stable")[20])  # a candidate the golden did not take
    sc[0, 1, outside] = sc[0, 1, g[0, 1, 7]]  # now it ties with row (0, 1)'s k-th score
    a = g.copy()
    a[0, 1, 7] = outside
    a[1, 2] = a[1, 2][::-1]  # order alone does not matter
    r = compare_topk(a, g, sc)
    assert r.passed and r.topk["rows"] == 6 and r.topk["tie_rows"] == 1 and r.topk["exact_rows"] == 5
    bad = compare_topk(a[:, :2], g, sc)
    assert not bad.passed and "shape mismatch" in bad.message


def test_nan_scores_never_pass():
    sc = np.array([[2.0, 1.0, np.nan]])
    assert not compare_topk(np.array([[0, 2]]), np.array([[0, 1]]), sc).passed


@pytest.mark.parametrize("k", [1, 4])
def test_agrees_with_a_brute_force_statement(k):
    # brute force: a row passes iff some k-subset ordering by score puts every differing index within rtol of the
    # golden's k-th score; with distinct random scores and no near-ties only identical sets pass
    rng = np.random.default_rng(k)
    sc = rng.permutation(np.arange(20.0))[None, :]
    g = np.argsort(-sc, axis=-1, kind="stable")[:, :k]
    for other in range(20):
        a = g.copy()
        if other in g:
            continue
        a[0, -1] = other
        assert not compare_topk(a, g, sc).passed


GOLD = np.array([[0, 2, 4]])


@pytest.mark.parametrize("kw,param", [
    (dict(actual=np.array([[0.9, 2.0, 4.0]])), "actual"),  # a float index 0.9 was truncated to 0: a false PASS
    (dict(golden=np.array([[0.0, 2.0, 4.0]])), "golden"),
    (dict(actual=np.ma.masked_array([[0, 2, 4]], mask=[[0, 0, 1]])), "actual"),
    (dict(actual=None), "actual"),
    (dict(golden="0 2 4"), "golden"),
    (dict(scores=None), "scores"),
    (dict(rtol=float("nan")), "rtol"),
    (dict(rtol=float("inf")), "rtol"),
    (dict(rtol=-1e-4), "rtol"),
    (dict(golden=np.array([[0, 2, 6]])), "golden"),  # outside [0, 6)
    (dict(golden=np.array([[0, -2, 4]])), "golden"),
    (dict(max_report=-1), "max_report"),
])
def test_bad_arguments_are_refused_by_name(kw, param):
    from qsfa import InvalidArgument, InvalidDtype

    args = dict(actual=np.array([[0, 2, 4]]), golden=GOLD, scores=SCORES)
    args.update(kw)
    with pytest.raises((InvalidArgument, InvalidDtype)) as ei:
        compare_topk(args.pop("actual"), args.pop("golden"), args.pop("scores"), **args)
    assert f" for {param}, actual: " in str(ei.value), str(ei.value)


def test_padding_in_the_golden_is_accepted():
    assert compare_topk(np.array([[0, 2, -1]]), np.array([[2, 0, -1]]), SCORES).passed
