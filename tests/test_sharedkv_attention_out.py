"""attention_out= on the five DeepSeek-V4 shared-KV front doors (sparse_flash_mla, sparse_attn_sharedkv,
mixed_quant_sparse_flash_mla, kv_quant_sparse_attn_sharedkv, quant_sparse_flash_mla): the buffer gets the bytes of
the call without it and is the returned output (an np.memmap included, rows that select nothing zeroed), every bad
buffer is refused by name before anything is written, and a call with the buffer allocates no full-size output
(the rows are written chunk by chunk). The npu side: tests/test_npu_mapping.py, tests/test_npu_backend.py."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.ops import sharedkv as S
from qsfa.ops._out_buffers import _aliased_with

BF16 = np.dtype(ml_dtypes.bfloat16)
BUILD = {"sparse_flash_mla": S.sfm_case, "sparse_attn_sharedkv": S.sas_case,
         "mixed_quant_sparse_flash_mla": S.mq_case, "kv_quant_sparse_attn_sharedkv": S.kqs_case,
         "quant_sparse_flash_mla": S.qs_case}
OPS = tuple(BUILD)


def _call(op, **a):
    return getattr(qsfa, op)(**a)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _args(op, precision="faithful", **kw):
    kw.setdefault("n1", 4)  # small: the reference accepts any head count (the 64-head rules are chip limits)
    return {**BUILD[op](**kw), "precision": precision}


@pytest.mark.parametrize("precision", ["faithful", "exact"])
@pytest.mark.parametrize("scenario,layout_q,paged", [("SWA", "BSND", False), ("CSA", "TND", True), ("HCA", "BSND", True)])
@pytest.mark.parametrize("op", OPS)
def test_the_buffer_gets_the_bytes_of_the_call_without_it(op, scenario, layout_q, paged, precision):
    kw = dict(layout_kv=S._PA[op], block_size=16) if paged else {}
    a = _args(op, precision, scenario=scenario, layout_q=layout_q, s1=3, s2=140, seed=7, **kw)
    want = _call(op, **a)
    out_dt = np.dtype(np.float64) if precision == "exact" else (BF16 if op == "quant_sparse_flash_mla" else a["q"].dtype)
    assert want[0].dtype == out_dt and np.abs(want[0].astype(np.float64)).sum() > 0
    buf = np.full(want[0].shape, 7, want[0].dtype)  # garbage: every element must be overwritten
    got = _call(op, **a, attention_out=buf)
    assert got[0] is buf
    assert _same(buf, want[0]) and _same(got[1], want[1])


@pytest.mark.parametrize("op", OPS)
def test_a_memmap_streams_and_rows_that_see_nothing_are_zeroed(op, tmp_path):
    """S1 > S2 (BSND): the first S1 - S2 query rows are before the causal diagonal and are zero; a memmap full of
    garbage ends with the in-memory call's bytes, those rows zeroed."""
    a = _args(op, scenario="CSA", s1=6, s2=4, seed=3)
    want = _call(op, **a)[0]
    assert not want[:, :2].astype(np.float64).any() and want[:, 2:].astype(np.float64).any()
    mm = np.memmap(tmp_path / "out.bin", dtype=want.dtype, mode="w+", shape=want.shape)
    mm[...] = 7
    got = _call(op, **a, attention_out=mm)
    assert got[0] is mm
    mm.flush()
    back = np.memmap(tmp_path / "out.bin", dtype=want.dtype, mode="r", shape=want.shape)
    assert _same(back, want)


@pytest.mark.parametrize("op", OPS)
def test_only_rows_computes_its_range_into_the_buffer_and_keeps_the_rest(op):
    """Under ``only_rows`` (qsfa.distributed's row tasks) every door computes the rows of the range only: with a
    garbage buffer those rows get the bytes of the whole call, the buffer's other rows keep their bytes and the
    returned LSE is zero there; the ranges together fill one shared buffer with the whole call's bytes."""
    from qsfa.reference.attention import only_rows

    a = {**_args(op, scenario="CSA", layout_q="TND", s1=5, s2=140, seed=11, layout_kv=S._PA[op], block_size=16),
         "return_softmax_lse": True}
    want, want_lse = _call(op, **a)
    rows = want.shape[0]
    want2, lse2 = want.reshape(rows, -1), want_lse.reshape(rows, -1)
    assert np.abs(want2.astype(np.float64)).min(axis=1).max() > 0 and rows >= 6
    shared = np.full(want.shape, 7, want.dtype)
    for lo, hi in ((0, 3), (3, 7), (7, rows)):
        buf = np.full(want.shape, 7, want.dtype)
        with only_rows(lo, hi):
            got, lse = _call(op, **a, attention_out=buf)
            _call(op, **a, attention_out=shared)
        assert got is buf
        g, l_ = buf.reshape(rows, -1), lse.reshape(rows, -1)
        inside = np.zeros(rows, bool)
        inside[lo:hi] = True
        assert g[inside].tobytes() == want2[inside].tobytes() and l_[inside].tobytes() == lse2[inside].tobytes()
        assert (g[~inside].astype(np.float64) == 7).all() and not l_[~inside].any()
    assert _same(shared, want)


def test_the_lse_is_unchanged_by_the_buffer():
    a = {**_args("sparse_flash_mla", scenario="CSA", layout_q="TND", layout_kv="TND", s1=3, s2=140, seed=2),
         "return_softmax_lse": True}
    want = qsfa.sparse_flash_mla(**a)
    assert want[1].size
    buf = np.empty_like(want[0])
    got = qsfa.sparse_flash_mla(**a, attention_out=buf)
    assert got[0] is buf and _same(buf, want[0]) and _same(got[1], want[1])


def _bad_buffers(op, a, want):
    """(buffer or None, changes to the arguments, constraint id suffix, words of the message)."""
    shape, dt = want.shape, want.dtype
    ro = np.full(shape, 5, dt)
    ro.flags.writeable = False
    out = [
        (np.full(shape[:-1] + (shape[-1] - 1,), 5, dt), {}, "attention_out_shape", "shape"),
        (np.full(shape, 5, np.float32), {}, "attention_out_dtype", "dtype"),
        (np.full(shape, 5, dt), {"precision": "exact"}, "attention_out_dtype", "float64 with precision='exact'"),
        (np.full(shape[:-1] + (2 * shape[-1],), 5, dt)[..., ::2], {}, "attention_out_contiguous", "C-contiguous"),
        (ro, {}, "attention_out_writable", "writable"),
        ([0.0] * 4, {}, "attention_out_is_array", "array"),
    ]
    if op == "quant_sparse_flash_mla":  # the output is bfloat16, not the uint8 of q's HiFloat8 codes
        out.append((np.full(shape, 5, np.uint8), {}, "attention_out_dtype", "bfloat16"))
    for p in ("q", "ori_kv", "cmp_kv"):
        out.append((None, p, "attention_out_aliasing", f"shares memory with {p}"))
    return out


@pytest.mark.parametrize("op", OPS)
def test_bad_buffers_are_refused_by_name_before_anything_is_written(op):
    base = _args(op, scenario="CSA", s1=2, s2=20, seed=1)
    want = _call(op, **base)[0]
    for buf, change, cid, words in _bad_buffers(op, base, want):
        a = dict(base)
        if isinstance(change, str):  # the buffer shares its bytes with that input
            buf = _aliased_with(change)(a, want.shape, want.dtype)  # the contract's own overlap maker
        else:
            a.update(change)
        before = {k: np.asarray(v).tobytes() for k, v in a.items() if isinstance(v, np.ndarray)}
        held = np.asarray(buf).tobytes() if isinstance(buf, np.ndarray) else None
        with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype)) as e:
            _call(op, **a, attention_out=buf)
        assert e.value.constraint_id == f"{op}.{cid}", (cid, str(e.value))
        assert words in str(e.value) and "for attention_out, actual:" in str(e.value), str(e.value)
        if held is not None:
            assert np.asarray(buf).tobytes() == held, cid
        assert {k: np.asarray(v).tobytes() for k, v in a.items() if isinstance(v, np.ndarray)} == before, cid


def test_torch_buffers_as_the_v32_doors_take_them():
    """A CPU tensor is written through its NumPy view and is the returned output (NumPy or torch inputs); one that
    requires grad is refused before anything is written (autograd would not see the write)."""
    torch = pytest.importorskip("torch")
    from qsfa._arrays import to_torch

    a = _args("quant_sparse_flash_mla", scenario="CSA", s1=2, s2=20)
    want = qsfa.quant_sparse_flash_mla(**a)[0]
    for inputs in (a, {k: to_torch(v) if isinstance(v, np.ndarray) else v for k, v in a.items()}):
        buf = torch.full(want.shape, 7, dtype=torch.bfloat16)
        got = qsfa.quant_sparse_flash_mla(**inputs, attention_out=buf)
        assert got[0] is buf and buf.view(torch.int16).numpy().tobytes() == want.view(np.int16).tobytes()
    buf = torch.zeros(want.shape, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(qsfa.InvalidArgument, match="for attention_out, actual: a tensor with requires_grad=True"):
        qsfa.quant_sparse_flash_mla(**a, attention_out=buf)
    assert not buf.detach().any()


@pytest.mark.parametrize("op", ["sparse_flash_mla", "quant_sparse_flash_mla"])
def test_the_peak_with_a_buffer_does_not_grow_with_the_output(op, monkeypatch):
    """The traced peak of the reference writing into a buffer stays flat when the batch (and so the output) triples,
    while without a buffer it grows by the output's growth: the shared core (behind sparse_flash_mla and three other
    doors) and the HiFloat8 reference both stream. Chunks of one row (each reference's working-set constant
    shrunk), so every chunk of the larger call has a twin in the smaller one (the batches select alike); the
    references are called as the dispatch layer calls them (the front door's validation reads q whole, which is
    the caller's memory anyway)."""
    from qsfa._dispatch import operators
    from qsfa.reference import sharedkv, sharedkv_hif8

    monkeypatch.setattr(sharedkv, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(sharedkv_hif8, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(sharedkv_hif8, "_SELECT_ROWS", 4)
    reference = S._sfm_reference if op == "sparse_flash_mla" else S._qs_reference

    def peak(fn):
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def case(batch):
        a = _args(op, scenario="CSA", layout_kv=S._PA[op], batch=batch, s1=4, s2=40, n1=16, seed=4)
        return dict(operators()[op].contract.validate(a))

    reference(**case(3))  # warm: the kept scratch buffers at their largest, lookup tables
    peaks = []
    for batch in (1, 3):
        a, got = case(batch), {}
        without = peak(lambda: got.update(want=reference(**a)[0]))
        want = got["want"]
        assert want.nbytes == batch * 4 * 16 * 512 * 2
        buf = np.full(want.shape, 7, want.dtype)
        peaks.append((want.nbytes, without, peak(lambda: reference(**a, attention_out=buf))))
        assert _same(buf, want)
    grown = peaks[1][0] - peaks[0][0]  # 128 KiB more output
    assert peaks[1][1] - peaks[0][1] >= 0.9 * grown, peaks  # without a buffer: the output is allocated whole
    assert peaks[1][2] - peaks[0][2] < 0.1 * grown, peaks  # with one: per-row facts only (LSE, window bounds)
