"""scatter_by_slot (docs/numerics/cache-writers.md#scatter_by_slot): hand-worked bytes, skip slots, strided caches, rejection before writes,
and random cases against a slow per-token loop."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

import qsfa
from qsfa.reference.scatter import scatter_by_slot as ref_scatter, slot_positions


def test_hand_worked_bytes():
    cache = np.full((2, 3, 2), 17, np.uint8)  # 2 blocks x 3 rows x 2 bytes
    rows = np.array([[1, 2], [3, 4], [5, 6]], np.uint8)
    out = qsfa.scatter_by_slot(cache, rows, np.array([4, -1, 0], np.int32))
    assert out is cache
    # slot 4 -> block 1, row 1; slot 0 -> block 0, row 0; the -1 row is dropped
    assert cache.tolist() == [[[5, 6], [17, 17], [17, 17]],
                              [[17, 17], [1, 2], [17, 17]]]


def test_slot_positions():
    valid, blocks, rows = slot_positions(np.array([7, -1, 0, 15]), 4)
    assert valid.tolist() == [True, False, True, True]
    assert blocks.tolist() == [1, 0, 3] and rows.tolist() == [3, 0, 3]


def test_all_skipped_leaves_cache_identical():
    cache = np.full((4, 8, 1, 16), 17, np.uint8)
    before = cache.tobytes()
    qsfa.scatter_by_slot(cache, np.zeros((3, 1, 16), np.uint8), np.full(3, -1, np.int64))
    assert cache.tobytes() == before


def test_strided_cache_view_writes_into_parent():
    parent = np.full((6, 4, 8), 17, np.uint8)
    view = parent[::2]  # non-contiguous along block_num
    rows = np.arange(16, dtype=np.uint8).reshape(2, 8)
    qsfa.scatter_by_slot(view, rows, np.array([5, 8], np.int64))  # block 1 row 1, block 2 row 0
    assert parent[2, 1].tolist() == list(range(8)) and parent[4, 0].tolist() == list(range(8, 16))
    assert np.count_nonzero(parent != 17) == 16  # nothing else changed


def test_partial_width_keeps_tail_bytes():
    cache = np.full((1, 2, 1, 6), 17, np.uint8)
    ref_scatter(cache, np.array([[[1, 2, 3]]], np.uint8), np.array([1]))
    assert cache[0, 1, 0].tolist() == [1, 2, 3, 17, 17, 17]
    assert cache[0, 0, 0].tolist() == [17] * 6


def test_torch_cpu_tensor_updated_in_place():
    torch = pytest.importorskip("torch")
    cache = torch.full((2, 4, 1, 8), 17, dtype=torch.uint8)
    rows = torch.arange(16, dtype=torch.uint8).reshape(2, 1, 8)
    out = qsfa.scatter_by_slot(cache, rows, torch.tensor([6, -1]))
    assert out is cache
    assert cache[1, 2, 0].tolist() == list(range(8))
    assert int((cache != 17).sum()) == 8


@pytest.mark.parametrize("slots,cid", [
    ([0, 0, 1], "scatter_by_slot.slot_mapping_unique"),
    ([0, 8, 1], "scatter_by_slot.slot_mapping_range"),
    ([0, -2, 1], "scatter_by_slot.slot_mapping_range"),
])
def test_bad_slots_rejected_before_any_write(slots, cid):
    cache = np.full((2, 4, 3), 17, np.uint8)
    with pytest.raises(qsfa.InvalidArgument) as ei:
        qsfa.scatter_by_slot(cache, np.zeros((3, 3), np.uint8), np.array(slots, np.int64))
    assert ei.value.constraint_id == cid
    assert str(ei.value).startswith("Invalid value for slot_mapping, actual: ")
    assert np.all(cache == 17)


def _slow_scatter(cache, rows, slots):
    bs = cache.shape[1]
    for t, s in enumerate(slots):
        if s == -1:
            continue
        cache[s // bs, s % bs] = rows[t]
    return cache


@st.composite
def _cases(draw):
    bn = draw(st.integers(1, 5))
    bs = draw(st.integers(1, 8))
    width = draw(st.integers(1, 6))
    t = draw(st.integers(0, bn * bs + 2))
    pool = draw(st.permutations(list(range(bn * bs))))
    slots = [pool[i] if i < len(pool) else -1 for i in range(t)]
    skip = draw(st.lists(st.booleans(), min_size=t, max_size=t))
    slots = [-1 if k else s for s, k in zip(slots, skip)]
    seed = draw(st.integers(0, 2**32 - 1))
    return bn, bs, width, np.array(slots, np.int64), seed


@given(_cases())
def test_random_against_slow_loop_and_permutation(case):
    bn, bs, width, slots, seed = case
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, (slots.size, 1, width), dtype=np.uint8)
    expect = _slow_scatter(np.full((bn, bs, 1, width), 17, np.uint8), rows, slots)
    got = qsfa.scatter_by_slot(np.full((bn, bs, 1, width), 17, np.uint8), rows, slots)
    assert got.tobytes() == expect.tobytes()
    perm = rng.permutation(slots.size)
    permuted = qsfa.scatter_by_slot(np.full((bn, bs, 1, width), 17, np.uint8), rows[perm], slots[perm])
    assert permuted.tobytes() == expect.tobytes()
    untouched = np.ones(bn * bs, bool)
    untouched[slots[slots != -1]] = False
    assert np.all(got.reshape(bn * bs, -1)[untouched] == 17)
