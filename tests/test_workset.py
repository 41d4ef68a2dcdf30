"""The attention oracle's working-set budget (issue 15): a knob (qsfa.set_workset_mib / QSFA_WORKSET_MIB) that sizes
the chunks of query rows, shared by the threads; measured peaks (tracemalloc traces NumPy's allocations) within the
model the chunks are sized from, a peak that does not grow with the number of query tokens when the outputs are
the caller's buffers, and the same bytes whatever the budget."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.reference import _workspace
from qsfa.reference import attention as ref
from qsfa.reference import parallel

BF16 = np.dtype(ml_dtypes.bfloat16)
MIB = 1 << 20
#: allocations of a call besides its chunks (block scratch of the dequantisation and softmax, lookup tables)
SLACK = 2 * MIB


@pytest.fixture(autouse=True)
def knobs(monkeypatch):
    monkeypatch.delenv("QSFA_WORKSET_MIB", raising=False)
    yield
    qsfa.set_workset_mib(None)
    qsfa.set_num_threads(None)


def _qsfa(rng, tokens, heads, sparse, cached):
    """A TND prefill over a PA int8 cache: ``tokens`` query rows, each selecting ``sparse`` of the tokens it sees."""
    kv_len = cached + tokens
    nblk = -(-kv_len // 16)
    rows = np.empty((nblk * 16, 656), np.uint8)
    rows[:, :512] = rng.integers(-127, 128, (rows.shape[0], 512), dtype=np.int8).view(np.uint8)
    rows[:, 512:640] = (rng.standard_normal((rows.shape[0], 64)) * 0.5).astype(BF16).view(np.uint8)
    rows[:, 640:] = rng.uniform(0.005, 0.02, (rows.shape[0], 4)).astype("<f4").view(np.uint8)
    thr = cached + np.arange(tokens) + 1
    idx = np.stack([rng.permutation(t)[:sparse] for t in thr]).astype(np.int32)
    key = rows.reshape(nblk, 16, 1, 656).view(np.int8)
    return dict(query=(rng.standard_normal((tokens, heads, 576)) * 0.5).astype(BF16), key=key, value=key,
                sparse_indices=idx.reshape(tokens, 1, sparse), scale_value=576 ** -0.5,
                block_table=np.arange(nblk, dtype=np.int32)[None],
                actual_seq_lengths_query=np.array([tokens], np.int32),
                actual_seq_lengths_kv=np.array([kv_len], np.int32), layout_query="TND", layout_kv="PA_BSND",
                return_softmax_lse=True)


def _sfa(rng, tokens, heads, sparse, kv):
    return dict(query=(rng.standard_normal((tokens, heads, 512)) * 0.5).astype(BF16),
                key=(rng.standard_normal((kv, 1, 512)) * 0.5).astype(BF16),
                value=(rng.standard_normal((kv, 1, 512)) * 0.5).astype(BF16),
                query_rope=(rng.standard_normal((tokens, heads, 64)) * 0.5).astype(BF16),
                key_rope=(rng.standard_normal((kv, 1, 64)) * 0.5).astype(BF16),
                sparse_indices=np.stack([rng.permutation(kv)[:sparse] for _ in range(tokens)]).astype(np.int32)[:, None],
                scale_value=0.04, layout_query="TND", layout_kv="TND", sparse_mode=0,
                actual_seq_lengths_query=np.array([tokens], np.int32), actual_seq_lengths_kv=np.array([kv], np.int32),
                return_softmax_lse=True)


def _traced_peak(fn):
    """Bytes NumPy / Python allocate at the peak of ``fn()`` beyond what was allocated before, from an empty
    per-thread workspace. ``fn`` runs twice under tracemalloc and the second run is measured: the first builds
    the lazily made tables and fills NumPy's cache of small blocks (whose blocks would otherwise show up as
    retained, one per chunk, until the cache is full)."""
    tracemalloc.start()
    try:
        fn()
        _workspace.release()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        return tracemalloc.get_traced_memory()[1] - before, result
    finally:
        tracemalloc.stop()
        _workspace.release()


def test_the_knob():
    assert qsfa.get_workset_mib() == parallel.DEFAULT_WORKSET_MIB == 256
    qsfa.set_workset_mib(64)
    assert qsfa.get_workset_mib() == 64
    assert parallel.workset_bytes_per_thread(1) == 64 * MIB and parallel.workset_bytes_per_thread(4) == 16 * MIB
    qsfa.set_workset_mib(None)
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(qsfa.InvalidArgument, match="mib"):
            qsfa.set_workset_mib(bad)
    assert qsfa.get_workset_mib() == 256


@pytest.mark.parametrize("env,want", [("100", 100), ("0", None), ("x", None), ("", 256)])
def test_environment_variable(monkeypatch, env, want):
    monkeypatch.setenv("QSFA_WORKSET_MIB", env)
    if want is None:  # not a positive integer: refused by name (tests/test_parallel.py has more values)
        with pytest.raises(qsfa.InvalidArgument, match="QSFA_WORKSET_MIB"):
            qsfa.get_workset_mib()
    else:
        assert qsfa.get_workset_mib() == want
    qsfa.set_workset_mib(8)  # the explicit setting wins
    assert qsfa.get_workset_mib() == 8


def test_rows_per_chunk_follow_the_budget():
    per_row = ref.row_workset_bytes(128, 2048)
    # the prefill case of the benchmark: about 30 MiB a row, dominated by the two float64 K arrays
    assert per_row == 2048 * (2 * 8 * 576 + 1024) + 32 * 128 * 2048 + 128 * (8 * 576 + 16 * 512)
    assert ref._rows_per_chunk(2048, 128, 2048) == 8  # chunk_size alone
    assert ref._rows_per_chunk(2048, 128, 2048, budget=128 * MIB) == 128 * MIB // per_row == 4
    assert ref._rows_per_chunk(2048, 128, 2048, budget=10 * per_row) == 8  # chunk_size still caps it
    assert ref._rows_per_chunk(2048, 128, 2048, budget=1) == 1  # never fewer than one row
    assert ref.row_workset_bytes(64, 512, kv_rows=4) > ref.row_workset_bytes(64, 512)


CASES = [  # (operator, heads, sparse, cached / kv, precision)
    ("qsfa", 64, 512, 4096, "faithful"),  # few rows share cache rows: gather the packed rows, dequantise
    ("qsfa", 64, 512, 512, "faithful"),  # rows share most cache rows: dequantise each once, gather floats
    ("qsfa", 32, 512, 4096, "exact"),
    ("sfa", 64, 512, 4096, "faithful"),
]


@pytest.mark.parametrize("op,heads,sparse,cached,precision", CASES)
def test_a_chunk_stays_within_its_modelled_working_set(op, heads, sparse, cached, precision):
    """Three rows a chunk: the traced peak of a whole call is at most three modelled rows (plus the call's fixed
    allocations) - the model the chunks are sized from does not under-count."""
    rng = np.random.default_rng(0)
    args = _qsfa(rng, 24, heads, sparse, cached) if op == "qsfa" else _sfa(rng, 24, heads, sparse, cached)
    kv_rows = 2 if op == "qsfa" else 4
    fn = ref.kv_quant_sparse_flash_attention if op == "qsfa" else ref.sparse_flash_attention
    budget = 3 * ref.row_workset_bytes(heads, sparse, kv_rows=kv_rows)
    qsfa.set_num_threads(1)
    qsfa.set_workset_mib(-(-budget // MIB))
    assert ref._rows_per_chunk(2048, heads, sparse, budget=qsfa.get_workset_mib() * MIB, kv_rows=kv_rows) == 3
    outs = [np.zeros(w.shape, w.dtype) for w in fn(**args, precision=precision)]
    peak, _ = _traced_peak(lambda: fn(**args, precision=precision, attention_out=outs[0], softmax_max_out=outs[1],
                                      softmax_sum_out=outs[2]))
    assert peak <= qsfa.get_workset_mib() * MIB + SLACK, (peak / MIB, qsfa.get_workset_mib())
    # and the model is not vacuous: a chunk of three rows really uses more than one modelled row
    assert peak > budget // 3


def test_the_budget_is_shared_by_the_threads():
    """20 MiB: two rows a chunk on one thread, one row a chunk on each of two threads; the traced peak of the
    call (all threads) stays within the budget either way."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    args = _qsfa(np.random.default_rng(1), 32, 64, 512, 4096)
    out = np.zeros(ref.kv_quant_sparse_flash_attention(**args)[0].shape, BF16)
    qsfa.set_workset_mib(20)
    assert 2 * ref.row_workset_bytes(64, 512) <= 20 * MIB < 3 * ref.row_workset_bytes(64, 512)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):  # BLAS would otherwise cap the count
        for threads in (1, 2):
            qsfa.set_num_threads(threads)
            n = qsfa.get_num_threads()
            assert ref._rows_per_chunk(2048, 64, 512, budget=parallel.workset_bytes_per_thread(n)) == 3 - n
            peak, _ = _traced_peak(lambda: ref.kv_quant_sparse_flash_attention(**args, attention_out=out))
            assert peak <= 20 * MIB + n * SLACK, (n, peak / MIB)


def test_the_peak_does_not_grow_with_the_tokens(tmp_path):
    """With the outputs in np.memmap buffers, 8x the query tokens adds less than one float32 per token and head to
    the peak: no per-token array of the outputs' or the statistics' size (let alone a float64 temporary of the
    output) exists - only row bookkeeping (a few int64 per token). Every row is the same query row selecting the
    same tokens (broadcast views: the inputs cost no memory either), so every chunk allocates the same; a traced
    run of the larger call first fills Python's and NumPy's caches of small blocks (tens of KiB, that would look
    like growth)."""
    heads, sparse = 128, 64
    qsfa.set_num_threads(1)
    qsfa.set_workset_mib(8)
    base = _qsfa(np.random.default_rng(2), 1, heads, sparse, 64)
    calls = {}
    for tokens in (512, 64):
        nblk = -(-(64 + tokens) // 16)
        key = np.zeros((nblk, 16, 1, 656), np.int8)
        key.reshape(-1, 656)[:80] = base["key"].reshape(-1, 656)[:80]
        args = dict(base, query=np.broadcast_to(base["query"], (tokens, heads, 576)), key=key, value=key,
                    sparse_indices=np.broadcast_to(np.arange(sparse, dtype=np.int32), (tokens, 1, sparse)),
                    actual_seq_lengths_query=np.array([tokens], np.int32),
                    actual_seq_lengths_kv=np.array([64 + tokens], np.int32),
                    block_table=np.arange(nblk, dtype=np.int32)[None])
        shapes = [((tokens, heads, 512), BF16), ((1, tokens, heads), np.float32), ((1, tokens, heads), np.float32)]
        outs = [np.memmap(tmp_path / f"{tokens}_{i}.bin", dtype=d, mode="w+", shape=s)
                for i, (s, d) in enumerate(shapes)]
        calls[tokens] = (args, outs)

    def run(tokens, lse=True):
        args, outs = calls[tokens]
        if not lse:
            return ref.kv_quant_sparse_flash_attention(**{**args, "return_softmax_lse": False}, attention_out=outs[0])
        got = ref.kv_quant_sparse_flash_attention(**args, attention_out=outs[0], softmax_max_out=outs[1],
                                                  softmax_sum_out=outs[2])
        assert got[0] is outs[0] and got[1] is outs[1] and got[2] is outs[2]

    peaks = {}
    tracemalloc.start()
    try:
        run(512)
        run(512)
        for tokens, lse in ((64, True), (512, True), (512, False)):
            _workspace.release()
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            run(tokens, lse)
            peaks[tokens, lse] = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
        _workspace.release()
    out = calls[512][1][0]
    assert np.asarray(out[-1]).tobytes() == np.asarray(out[0]).tobytes()  # the same row everywhere
    grow = (peaks[512, True] - peaks[64, True]) / (512 - 64)
    assert grow < 4 * heads, f"{grow:.0f} bytes per query token ({peaks})"
    assert peaks[512, True] <= 8 * MIB + SLACK
    assert peaks[512, False] <= peaks[512, True] + 64 * 1024  # without the statistics none is allocated either


def test_the_budget_does_not_change_a_byte():
    args = _qsfa(np.random.default_rng(3), 24, 16, 128, 256)
    outs = []
    for mib in (1, 4, 1024):  # one row a chunk ... chunk_size's 64 rows
        qsfa.set_workset_mib(mib)
        outs.append(ref.kv_quant_sparse_flash_attention(**args))
    sfa = _sfa(np.random.default_rng(4), 24, 16, 128, 512)
    souts = []
    for mib in (1, 1024):
        qsfa.set_workset_mib(mib)
        souts.append(ref.sparse_flash_attention(**sfa))
    for group in (outs, souts):
        for other in group[1:]:
            for a, b in zip(group[0], other):
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
