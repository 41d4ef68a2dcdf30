"""A KV cache that is a strided or broadcast view of a bigger tensor is read row by row, never copied whole
(hostile review M3: a 400 MiB reversed view made every QSFA call allocate 400 MiB, a broadcast cache of 1e6 blocks
took 12 s). Bytes equal those of the contiguous cache; traced peaks stay far below the cache's size."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.reference.attn_layout import flat_rows

BF16 = np.dtype(ml_dtypes.bfloat16)
T, BS, HEADS = 64, 16, 8
BIG_BLOCKS = 6000  # a 63 MB cache (int8 rows of 656 bytes)


def _small_cache(rng):
    k_nope = rng.standard_normal((T, 512)).astype(BF16)
    k_rope = rng.standard_normal((T, 64)).astype(BF16)
    cache = np.zeros((T // BS, BS, 1, 656), np.int8)
    qsfa.c8_cache_write(k_nope, k_rope, np.arange(T), cache)
    return cache


def _call(op, cache, rng, **extra):
    query = rng.standard_normal((1, 1, HEADS, 576)).astype(BF16)
    idx = rng.permutation(T)[:32].astype(np.int32).reshape(1, 1, 1, 32)
    kw = dict(block_table=np.arange(T // BS, dtype=np.int32)[None], actual_seq_lengths_kv=np.array([T], np.int32),
              layout_kv="PA_BSND", **extra)
    return lambda c: op(query, c, c, idx, 576 ** -0.5, **kw)[0]


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("make_view", ["reversed", "every_other_block", "broadcast"])
def test_qsfa_reads_a_view_of_a_big_cache_without_copying_it(make_view):
    rng = np.random.default_rng(0)
    small = _small_cache(rng)
    if make_view == "reversed":
        big = np.zeros((BIG_BLOCKS, BS, 1, 656), np.int8)
        view = big[::-1]
        view[:T // BS] = small
    elif make_view == "every_other_block":
        big = np.zeros((2 * BIG_BLOCKS, BS, 1, 656), np.int8)
        view = big[::2]
        view[:T // BS] = small
    else:  # every block is the same memory: a read-only broadcast of 1e6 blocks
        view = np.broadcast_to(small[:1], (10 ** 6, BS, 1, 656))
        small = np.broadcast_to(small[:1], small.shape).copy()
    assert not view.flags.c_contiguous
    call = _call(qsfa.kv_quant_sparse_flash_attention, None, np.random.default_rng(1))
    want = call(small)
    got, peak = _peak(lambda: call(view))
    assert got.tobytes() == want.tobytes()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB traced for a call on a view (cache {view.nbytes / 2**20:.0f} MiB)"


def test_flat_rows_is_a_view_when_the_strides_merge():
    a = np.zeros((4, 16, 1, 656), np.uint8)
    v = flat_rows(a)
    assert isinstance(v, np.ndarray) and np.shares_memory(v, a) and v.shape == (64, 656)
    cols = a[..., 10:20]  # row-strided but mergeable: still a view
    assert np.shares_memory(flat_rows(cols), a)
    g = flat_rows(a[::-1])
    assert not isinstance(g, np.ndarray)
    ids = np.array([[0, 63], [17, 5]])
    a.reshape(64, 656)[:, 0] = np.arange(64)
    assert np.array_equal(g[ids][..., 0], a[::-1].reshape(64, 656)[ids][..., 0])
