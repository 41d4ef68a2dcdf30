"""attention_out= buffers (np.memmap included) on the attention operators: the same bytes as the returned output,
the caller's own buffer back, rows without a selected token zeroed, and a bad buffer rejected before anything is
written (issue 15)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.ops.attention import qsfa_case, sfa_case

BF16 = np.dtype(ml_dtypes.bfloat16)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("layout_query", ["BSND", "TND"])
@pytest.mark.parametrize("precision", ["faithful", "exact"])
def test_qsfa_memmap_gets_the_output_bytes(tmp_path, layout_query, precision):
    args = {**qsfa_case(layout_query=layout_query, layout_kv="PA_BSND", n_heads=4, sparse=3),
            "precision": precision, "return_softmax_lse": True}
    want = qsfa.kv_quant_sparse_flash_attention(**args)
    mm = np.memmap(tmp_path / "out.bin", dtype=want[0].dtype, mode="w+", shape=want[0].shape)
    mm[...] = 7  # garbage: every row must be overwritten (rows without a selected token by zeros)
    got = qsfa.kv_quant_sparse_flash_attention(**args, attention_out=mm)
    assert got[0] is mm
    assert _same(np.asarray(mm), want[0])
    for a, b in zip(got[1:], want[1:]):
        assert _same(a, b)


def test_rows_without_selected_tokens_are_zeroed(tmp_path):
    args = qsfa_case(layout_query="BSND")
    idx = args["sparse_indices"].copy()
    idx[0, 0] = -1  # the first query row of batch 0 selects nothing
    args["sparse_indices"] = idx
    want = qsfa.kv_quant_sparse_flash_attention(**args)[0]
    assert not want[0, 0].astype(np.float32).any()
    buf = np.full(want.shape, 3, want.dtype)
    qsfa.kv_quant_sparse_flash_attention(**args, attention_out=buf)
    assert _same(buf, want)


def test_sfa_and_the_front_door(tmp_path):
    args = sfa_case()
    want = qsfa.sparse_flash_attention(**args)[0]
    buf = np.empty_like(want)
    assert qsfa.sparse_flash_attention(**args, attention_out=buf)[0] is buf and _same(buf, want)
    q = qsfa_case()
    want = qsfa.attention(q["query"], q["key"], sparse_indices=q["sparse_indices"], scale_value=q["scale_value"],
                          actual_seq_lengths_kv=q.get("actual_seq_lengths_kv"))[0]
    buf = np.empty_like(want)
    got = qsfa.attention(q["query"], q["key"], sparse_indices=q["sparse_indices"], scale_value=q["scale_value"],
                         actual_seq_lengths_kv=q.get("actual_seq_lengths_kv"), attention_out=buf)[0]
    assert got is buf and _same(buf, want)


def test_bad_buffers_are_rejected_before_anything_is_written():
    args = qsfa_case()
    want = qsfa.kv_quant_sparse_flash_attention(**args)[0]
    ro = np.full(want.shape, 5, want.dtype)
    ro.flags.writeable = False
    cases = [
        (np.full(want.shape[:-1] + (511,), 5, want.dtype), "attention_out_shape"),
        (np.full(want.shape, 5, np.float32), "attention_out_dtype"),
        (np.full(want.shape[:-1] + (1024,), 5, want.dtype)[..., ::2], "attention_out_contiguous"),
        (ro, "attention_out_writable"),
    ]
    for buf, cid in cases:
        before = np.array(buf, copy=True).tobytes()
        with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype)) as e:
            qsfa.kv_quant_sparse_flash_attention(**args, attention_out=buf)
        assert e.value.constraint_id.endswith(cid), (cid, str(e.value))
        assert np.asarray(buf).tobytes() == before
    # sharing memory with the query
    q = args["query"]
    whole = np.zeros(max(q.size, want.size), q.dtype)
    query = whole[:q.size].reshape(q.shape)
    query[...] = q
    with pytest.raises(qsfa.InvalidArgument, match="shares memory with query"):
        qsfa.kv_quant_sparse_flash_attention(**{**args, "query": query}, attention_out=whole[:want.size].reshape(want.shape))


# ---- softmax_max_out= / softmax_sum_out= -------------------------------------------------------------------------

def _lse_buffers(want, fill=9.0):
    return [np.full(w.shape, fill, w.dtype) for w in want[1:]]


@pytest.mark.parametrize("layout_query", ["BSND", "TND"])
@pytest.mark.parametrize("precision", ["faithful", "exact"])
def test_lse_memmaps_get_the_returned_bytes(tmp_path, layout_query, precision):
    args = {**qsfa_case(layout_query=layout_query, layout_kv="PA_BSND", n_heads=4, sparse=3),
            "precision": precision, "return_softmax_lse": True}
    idx = args["sparse_indices"].copy()
    idx.reshape(-1, idx.shape[-1])[0] = -1  # the first row selects nothing: its statistics must be zeroed
    args["sparse_indices"] = idx
    want = qsfa.kv_quant_sparse_flash_attention(**args)
    assert not np.asarray(want[1]).reshape(-1, 4)[0].any()
    mms = [np.memmap(tmp_path / f"{k}.bin", dtype=w.dtype, mode="w+", shape=w.shape)
           for k, w in zip(("out", "max", "sum"), want)]
    for m in mms:
        m[...] = 7  # garbage: every element must be overwritten
    got = qsfa.kv_quant_sparse_flash_attention(**args, attention_out=mms[0], softmax_max_out=mms[1],
                                               softmax_sum_out=mms[2])
    for g, m, w in zip(got, mms, want):
        assert g is m
        assert _same(np.asarray(m), w)
    # one buffer alone: the others are allocated as usual
    buf = np.full(want[2].shape, 7, want[2].dtype)
    got = qsfa.kv_quant_sparse_flash_attention(**args, softmax_sum_out=buf)
    assert got[2] is buf and _same(buf, want[2]) and _same(got[0], want[0]) and _same(got[1], want[1])


def test_lse_buffers_on_sfa_and_the_front_door():
    args = {**sfa_case(layout_query="TND", layout_kv="TND", n_heads=2), "return_softmax_lse": True,
            "sinks": np.array([0.5, -1], np.float32), "lse_includes_sink": True}
    want = qsfa.sparse_flash_attention(**args)
    mx, sm = _lse_buffers(want)
    got = qsfa.sparse_flash_attention(**args, softmax_max_out=mx, softmax_sum_out=sm)
    assert got[1] is mx and got[2] is sm and _same(mx, want[1]) and _same(sm, want[2]) and _same(got[0], want[0])
    q = qsfa_case()
    kw = dict(sparse_indices=q["sparse_indices"], scale_value=q["scale_value"], return_softmax_lse=True,
              actual_seq_lengths_kv=q.get("actual_seq_lengths_kv"))
    want = qsfa.attention(q["query"], q["key"], **kw)
    mx, sm = _lse_buffers(want)
    got = qsfa.attention(q["query"], q["key"], **kw, softmax_max_out=mx, softmax_sum_out=sm)
    assert got[1] is mx and got[2] is sm and _same(mx, want[1]) and _same(sm, want[2])


def _bad_lse_cases(want):
    """(keyword arguments, constraint id suffix, what the message names) for invalid LSE buffers."""
    shape, dt = want[1].shape, want[1].dtype
    ro = np.zeros(shape, dt)
    ro.flags.writeable = False
    shared = np.zeros(2 * want[1].size, dt)
    return [
        ({"softmax_max_out": [0.0]}, "softmax_max_out_is_array", "must be a NumPy array"),
        ({"softmax_sum_out": np.zeros(shape[:-1] + (shape[-1] + 1,), dt)}, "softmax_sum_out_shape", "shape"),
        ({"softmax_max_out": np.zeros(shape, np.float64)}, "softmax_max_out_dtype", "float32"),
        ({"softmax_sum_out": np.zeros(shape[:-1] + (2 * shape[-1],), dt)[..., ::2]}, "softmax_sum_out_contiguous",
         "C-contiguous"),
        ({"softmax_max_out": ro}, "softmax_max_out_writable", "writable"),
        ({"softmax_max_out": shared[:want[1].size].reshape(shape),
          "softmax_sum_out": shared[1:want[1].size + 1].reshape(shape)},
         "softmax_max_out_aliasing", "shares memory with softmax_sum_out"),
    ]


def test_bad_lse_buffers_are_rejected_and_nothing_is_written():
    args = {**qsfa_case(n_heads=2), "return_softmax_lse": True}
    want = qsfa.kv_quant_sparse_flash_attention(**args)
    for kw, cid, words in _bad_lse_cases(want):
        # every other buffer valid: a rejected call writes none of them (all or nothing)
        full = {"attention_out": np.full(want[0].shape, 5, want[0].dtype),
                "softmax_max_out": np.full(want[1].shape, 5, want[1].dtype),
                "softmax_sum_out": np.full(want[2].shape, 5, want[2].dtype), **kw}
        before = {k: bytes(np.asarray(v).tobytes()) for k, v in full.items() if isinstance(v, np.ndarray)}
        with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype)) as e:
            qsfa.kv_quant_sparse_flash_attention(**args, **full)
        assert e.value.constraint_id.endswith(cid), (cid, str(e.value))
        assert words in str(e.value) and f"for {e.value.param}, actual:" in str(e.value)
        for k, v in full.items():
            if isinstance(v, np.ndarray):
                assert np.asarray(v).tobytes() == before[k], (cid, k)
    # a buffer without return_softmax_lse: rejected, not silently left unwritten
    buf = np.full(want[1].shape, 5, want[1].dtype)
    with pytest.raises(qsfa.InvalidArgument, match="return_softmax_lse=True") as e:
        qsfa.kv_quant_sparse_flash_attention(**{**args, "return_softmax_lse": False}, softmax_max_out=buf)
    assert e.value.param == "softmax_max_out" and not (buf != 5).any()
    # the LSE buffer sharing memory with the output buffer
    whole = np.zeros(want[0].nbytes + want[1].nbytes, np.uint8)
    out = whole[:want[0].nbytes].view(want[0].dtype).reshape(want[0].shape)
    sm = whole[:want[1].nbytes].view(want[1].dtype).reshape(want[1].shape)
    with pytest.raises(qsfa.InvalidArgument, match="for attention_out, actual: shares memory with softmax_sum_out"):
        qsfa.kv_quant_sparse_flash_attention(**args, attention_out=out, softmax_sum_out=sm)
    # exact precision: the statistics are float64, a float32 buffer is rejected
    with pytest.raises(qsfa.InvalidDtype, match="float64 with precision='exact'"):
        qsfa.kv_quant_sparse_flash_attention(**{**args, "precision": "exact"},
                                             softmax_max_out=np.zeros(want[1].shape, np.float32))


def test_output_buffers_are_rejected_on_a_device_backend():
    class Elsewhere(qsfa.Backend):
        name = "test-out-buffers-elsewhere"
        description = "a backend that is not the reference"

    qsfa.register_backend(Elsewhere(), replace=True)
    try:
        args = {**qsfa_case(), "return_softmax_lse": True}
        want = qsfa.kv_quant_sparse_flash_attention(**args)
        for k, w in zip(("attention_out", "softmax_max_out", "softmax_sum_out"), want):
            with pytest.raises(qsfa.InvalidArgument, match="reference backend only") as e:
                qsfa.kv_quant_sparse_flash_attention(**args, backend=Elsewhere.name, **{k: np.zeros_like(w)})
            assert e.value.param == k
    finally:
        qsfa.unregister_backend(Elsewhere.name)


def test_row_ranges_fill_one_shared_set_of_buffers(tmp_path):
    """Under ``only_rows`` (qsfa.distributed's row tasks) a call writes only the rows of its range into the caller's
    buffers - output and statistics - and leaves the other rows' bytes alone, so ranges run one after another (or
    in separate processes) into shared memmaps give the bytes of one whole call; rows of the range that select
    nothing are zeroed."""
    from qsfa.reference.attention import only_rows

    args = {**qsfa_case(layout_query="TND", layout_kv="PA_BSND", n_heads=4, sparse=3), "return_softmax_lse": True}
    idx = args["sparse_indices"].copy()
    idx.reshape(-1, idx.shape[-1])[2] = -1  # row 2 selects nothing
    args["sparse_indices"] = idx
    want = qsfa.kv_quant_sparse_flash_attention(**args)
    rows = want[0].shape[0]
    assert rows >= 4 and not np.asarray(want[0])[2].astype(np.float32).any()
    mms = [np.memmap(tmp_path / f"{k}.bin", dtype=w.dtype, mode="w+", shape=w.shape)
           for k, w in zip(("out", "max", "sum"), want)]
    for m in mms:
        m[...] = 7
    for lo in range(0, rows, 3):
        with only_rows(lo, lo + 3):
            qsfa.kv_quant_sparse_flash_attention(**args, attention_out=mms[0], softmax_max_out=mms[1],
                                                 softmax_sum_out=mms[2])
        for m in mms:  # the rows after the range: untouched so far
            rest = np.asarray(m).reshape(rows, -1)[lo + 3:]
            assert (rest.astype(np.float64) == 7).all()
    for m, w in zip(mms, want):
        assert _same(np.asarray(m), w)
