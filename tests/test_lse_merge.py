"""merge_attention_lse: splitting each row's selected tokens into disjoint shards and merging the partial
results through (softmax_max, softmax_sum) gives the unsplit result (docs/numerics/attention.md#merge_attention_lse context-parallel merge)."""

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qsfa
from test_attention_support import BF16, layout_args, random_case


def shard_cases(case, parts, rng, *, sbs=1, mode=3, empty_shard=False):
    """``parts`` cases whose rows hold disjoint subsets of each row's contributing index entries."""
    shards = []
    k = case.idx.shape[-1]
    assign = {}
    for b in range(case.idx.shape[0]):
        for i in range(case.idx.shape[1]):
            if i >= case.act_q[b]:
                continue
            entries = case.idx[b, i].tolist()
            # entries actually read: up to min(K, ceil(thr / sbs)), stopping at the first -1
            thr = case.act_kv[b] - case.act_q[b] + i + 1 if mode == 3 else case.act_kv[b]
            n = min(k, -(-thr // sbs)) if thr > 0 else 0
            read = []
            for e in entries[:n]:
                if e == -1:
                    break
                read.append(e)
            hi = parts - 1 if empty_shard else parts  # the last shard stays empty when asked
            assign[b, i] = (read, rng.integers(0, max(hi, 1), len(read)))
    for p in range(parts):
        idx = np.full_like(case.idx, -1)
        for (b, i), (read, who) in assign.items():
            mine = [e for e, w in zip(read, who) if w == p]
            idx[b, i, :len(mine)] = mine
        c = copy.copy(case)
        c.idx = idx
        shards.append(c)
    return shards


def run(case, layouts, **kw):
    args = layout_args(case, *layouts)
    args.update(return_softmax_lse=True, **kw)
    return qsfa.kv_quant_sparse_flash_attention(**args)


@pytest.mark.parametrize("layouts", [("BSND", "PA_BSND"), ("TND", "TND")], ids=lambda x: "+".join(x))
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("sbs", [1, 4])
def test_shards_merge_to_the_unsplit_result(layouts, parts, sbs):
    rng = np.random.default_rng(parts * 10 + sbs)
    case = random_case(rng, kv=90, act_kv=[90, 47], act_q=[3, 2], sparse=20, heads=4, sbs=sbs)
    shards = shard_cases(case, parts, rng, sbs=sbs, empty_shard=parts == 4)
    lay = layouts[0]
    # exact: merged == unsplit to float64 round-off
    full = run(case, layouts, precision="exact", sparse_block_size=sbs)
    pieces = [run(s, layouts, precision="exact", sparse_block_size=sbs) for s in shards]
    merged = qsfa.merge_attention_lse([p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces],
                                      layout_query=lay)
    assert merged[0].dtype == np.float64 and merged[0].shape == full[0].shape
    np.testing.assert_allclose(merged[0], full[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(merged[1], full[1], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(merged[2], full[2], rtol=1e-12, atol=0)
    # faithful: within the docs/numerics/comparison.md#float-criterion tolerances (each shard was rounded to bf16 before the merge)
    full = run(case, layouts, sparse_block_size=sbs)
    pieces = [run(s, layouts, sparse_block_size=sbs) for s in shards]
    merged = qsfa.merge_attention_lse(np.stack([p[0] for p in pieces]), np.stack([p[1] for p in pieces]),
                                      np.stack([p[2] for p in pieces]), layout_query=lay)
    assert merged[0].dtype == BF16
    qsfa.compare.assert_close(merged[0].astype(np.float32), full[0].astype(np.float32), dtype="bfloat16")
    qsfa.compare.assert_close(merged[1], full[1], dtype="float32")
    qsfa.compare.assert_close(merged[2], full[2], dtype="float32")


def test_empty_shards_carry_no_weight_even_with_negative_maxima():
    out = np.array([[[[[1.0, 2.0]]]], [[[[0.0, 0.0]]]], [[[[5.0, 6.0]]]]])  # [P=3, B=1, S=1, N=1, D=2]
    m = np.array([-1000.0, 0.0, -1001.0]).reshape(3, 1, 1, 1, 1)
    l = np.array([2.0, 0.0, 0.0]).reshape(3, 1, 1, 1, 1)  # shards 1 and 2 are empty
    o, mm, ll = qsfa.merge_attention_lse(out, m, l)
    assert np.array_equal(o[0, 0, 0], [1.0, 2.0]) and mm.item() == -1000.0 and ll.item() == 2.0
    # by hand: two non-empty shards
    l2 = np.array([2.0, 0.0, 1.0]).reshape(3, 1, 1, 1, 1)
    o, mm, ll = qsfa.merge_attention_lse(out, m, l2)
    w0, w2 = 2.0, np.exp(-1.0)
    np.testing.assert_allclose(o[0, 0, 0], (w0 * np.array([1.0, 2.0]) + w2 * np.array([5.0, 6.0])) / (w0 + w2),
                               rtol=1e-15)
    assert mm.item() == -1000.0 and np.isclose(ll.item(), w0 + w2, rtol=1e-15)


def test_all_empty_rows_merge_to_zero():
    out = np.ones((2, 3, 2, 4), np.float32)  # TND: [P, T, N, D]
    m = np.zeros((2, 1, 3, 2), np.float32)
    l = np.zeros((2, 1, 3, 2), np.float32)
    l[0, 0, 1] = 1.0  # only token row 1 has a non-empty shard
    o, mm, ll = qsfa.merge_attention_lse(out, m, l, layout_query="TND")
    assert o.dtype == np.float32 and not o[0].any() and not o[2].any() and np.all(o[1] == 1.0)
    assert mm.shape == (1, 3, 2) and np.array_equal(ll[0, 1], [1.0, 1.0]) and not ll[0, 0].any()


def test_torch_partials_merge():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    out = rng.uniform(-1, 1, (2, 1, 2, 2, 8)).astype(np.float32)
    m = rng.uniform(-1, 1, (2, 1, 1, 2, 2)).astype(np.float32)
    l = rng.uniform(1, 2, (2, 1, 1, 2, 2)).astype(np.float32)
    ref = qsfa.merge_attention_lse(out, m, l)
    got = qsfa.merge_attention_lse([torch.from_numpy(x) for x in out], [torch.from_numpy(x) for x in m],
                                   [torch.from_numpy(x) for x in l])
    assert isinstance(got[0], torch.Tensor)
    for a, b in zip(ref, got):
        assert np.array_equal(a, b.numpy())


@given(st.integers(0, 2**31 - 1), st.integers(2, 4))
def test_random_shards_exact_merge(seed, parts):
    rng = np.random.default_rng(seed)
    case = random_case(rng, batch=2, q_s=2, heads=2, kv=int(rng.integers(1, 40)), sparse=int(rng.integers(1, 12)))
    shards = shard_cases(case, parts, rng)
    full = run(case, ("BSND", "BSND"), precision="exact")
    pieces = [run(s, ("BSND", "BSND"), precision="exact") for s in shards]
    merged = qsfa.merge_attention_lse([p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces])
    np.testing.assert_allclose(merged[0], full[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(merged[2], full[2], rtol=1e-12, atol=0)
