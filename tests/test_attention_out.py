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
