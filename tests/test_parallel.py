"""The attention oracle's thread pool (qsfa.reference.parallel): the same bytes on any thread count, a knob that
honours QSFA_NUM_THREADS, the BLAS thread limit (threadpoolctl, OMP_NUM_THREADS) and set_num_threads."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.reference import attention as ref
from qsfa.reference import parallel

BF16 = np.dtype(ml_dtypes.bfloat16)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prefill(rng, q_tokens=48, heads=8, sparse=64, cached=64):
    kv_len = cached + q_tokens
    nblk = -(-kv_len // 16)
    rows = np.empty((nblk * 16, 656), np.uint8)
    rows[:, :512] = rng.integers(-127, 128, (rows.shape[0], 512), dtype=np.int8).view(np.uint8)
    rows[:, 512:640] = (rng.standard_normal((rows.shape[0], 64)) * 0.5).astype(BF16).view(np.uint8)
    rows[:, 640:] = rng.uniform(0.005, 0.02, (rows.shape[0], 4)).astype("<f4").view(np.uint8)
    q = (rng.standard_normal((q_tokens, heads, 576)) * np.exp(rng.uniform(-4, 2, (q_tokens, heads, 576)))).astype(BF16)
    thr = cached + np.arange(q_tokens) + 1
    idx = np.stack([rng.permutation(t)[:sparse] if t >= sparse else
                    np.concatenate([rng.permutation(t), -np.ones(sparse - t, np.int64)]) for t in thr]).astype(np.int32)
    return dict(query=q, key=rows.reshape(nblk, 16, 1, 656).view(np.int8), value=None,
                sparse_indices=idx.reshape(q_tokens, 1, sparse), scale_value=576 ** -0.5,
                block_table=np.arange(nblk, dtype=np.int32)[None], actual_seq_lengths_query=np.array([q_tokens], np.int32),
                actual_seq_lengths_kv=np.array([kv_len], np.int32), layout_query="TND", layout_kv="PA_BSND",
                return_softmax_lse=True)


@pytest.fixture
def threads():
    yield
    qsfa.set_num_threads(None)


@pytest.mark.parametrize("precision", ["faithful", "exact"])
def test_thread_count_does_not_change_a_byte(threads, precision):
    args = _prefill(np.random.default_rng(3))
    args["value"] = args["key"]
    outs = []
    threadpoolctl = pytest.importorskip("threadpoolctl")
    with threadpoolctl.threadpool_limits(limits=3, user_api="blas"):  # BLAS would otherwise cap the count
        for n in (1, 2, 3):
            qsfa.set_num_threads(n)
            assert parallel._blas() is None or qsfa.get_num_threads() == n
            # chunk_size 64: 4 rows per chunk, 12 chunks for the pool to share out
            outs.append(ref.kv_quant_sparse_flash_attention(**args, precision=precision, chunk_size=64))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_pool_runs_every_chunk_and_propagates_errors(threads):
    seen = []
    parallel.run_chunks(seen.append, range(0, 40, 4), n_threads=3)
    assert sorted(seen) == list(range(0, 40, 4))

    def boom(s):
        if s == 8:
            raise ValueError("chunk 8")

    with pytest.raises(ValueError, match="chunk 8"):
        parallel.run_chunks(boom, range(0, 40, 4), n_threads=2)


def test_set_num_threads_rejects_bad_counts(threads):
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(qsfa.InvalidArgument, match="Invalid value for n"):
            qsfa.set_num_threads(bad)


def test_blas_limit_caps_the_count(threads):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if parallel._blas() is None:
        pytest.skip("threadpoolctl finds no BLAS library in this NumPy")
    qsfa.set_num_threads(4)
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        assert qsfa.get_num_threads() == 1
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        assert qsfa.get_num_threads() == min(2, 4)


@pytest.mark.parametrize("env, want", [
    ({"QSFA_NUM_THREADS": "1"}, "1"),
    ({"QSFA_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}, "1"),
    ({"QSFA_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}, "2"),
])
def test_environment_variables(env, want):
    pytest.importorskip("threadpoolctl")
    full = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    full.update(env, PYTHONPATH=ROOT)
    code = ("import os, qsfa\n"
            "from qsfa.reference import parallel\n"
            "n = qsfa.get_num_threads()\n"
            "print(n if parallel._blas() is not None else 'no-blas')\n")
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = out.stdout.strip()
    if got == "no-blas":
        pytest.skip("threadpoolctl finds no BLAS library in this NumPy")
    # a count above the CPUs this process may use is capped by them
    assert got == str(min(int(want), len(os.sched_getaffinity(0)))) if hasattr(os, "sched_getaffinity") else want


def test_concurrent_calls_restore_the_blas_limit(threads):
    """Pools of calls from several threads share one BLAS limit; afterwards BLAS has its old thread count."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    blas = parallel._blas()
    if blas is None:
        pytest.skip("threadpoolctl finds no BLAS library in this NumPy")
    import threading
    import time

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        before = [lib.num_threads for lib in blas.lib_controllers]
        inside = []

        def slow(_):
            inside.append(min(lib.num_threads for lib in blas.lib_controllers))
            time.sleep(0.01)

        parallel.run_chunks(slow, range(8), 2)  # from this thread: the workers run BLAS on one thread
        assert inside and set(inside) == {1}
        callers = [threading.Thread(target=parallel.run_chunks, args=(slow, range(8), 2)) for _ in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert len(inside) == 32
        assert [lib.num_threads for lib in blas.lib_controllers] == before


def test_one_thread_means_one_blas_thread_too(threads):
    """set_num_threads(1): the chunks run on the caller's thread with BLAS at one thread (its pool would spin on
    the small per-chunk GEMMs), and the caller's BLAS limit is back afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    seen = []

    def fn(_):
        seen.append(min(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"))

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        qsfa.set_num_threads(1)
        parallel.run_chunks(fn, range(3))
        assert seen == [1, 1, 1]
        assert min(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas") == 2
        qsfa.set_num_threads(2)
        parallel.run_chunks(fn, range(1))  # one chunk, two threads allowed: BLAS keeps them
        assert seen[-1] == 2


@pytest.mark.parametrize("var", ["QSFA_NUM_THREADS", "QSFA_WORKSET_MIB"])
@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5"])
def test_a_bad_qsfa_environment_variable_is_refused_by_name(monkeypatch, var, value):
    """A typo in qsfa's own variables is an error naming it, not a silent default (other libraries' variables, such
    as OMP_NUM_THREADS, are only read as limits and ignored when unparsable)."""
    from qsfa.reference import parallel

    monkeypatch.setenv(var, value)
    with pytest.raises(qsfa.InvalidArgument) as e:
        parallel.get_num_threads() if var == "QSFA_NUM_THREADS" else parallel.get_workset_mib()
    assert e.value.param == var and repr(value) in str(e.value)
    monkeypatch.setenv(var, " ")  # empty: unset
    assert (parallel.get_num_threads() if var == "QSFA_NUM_THREADS" else parallel.get_workset_mib()) >= 1
    monkeypatch.setenv(var, "3")
    assert parallel.get_workset_mib() == 3 if var == "QSFA_WORKSET_MIB" else parallel.get_num_threads() >= 1
