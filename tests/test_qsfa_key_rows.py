"""QSFA refuses a packed cache row it reads (a token its sparse indices select) whose tile scale, RoPE value or NoPE
code is not finite, naming the batch, the token and the field; rows nothing selects may hold anything (a paged
cache's free slots, tokens the top-k left out). Without the rule such a row turned whole attention rows into NaN."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa._errors import InvalidArgument
from qsfa.ops.attention import qsfa_case
from qsfa.reference import formats

NAN32 = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
INF32 = np.frombuffer(np.float32(np.inf).tobytes(), np.uint8)


def _pa_call(key_fmt="int8", qdtype="bfloat16", kv_len=48, width=8, seed=1, contiguous=True):
    """A paged decode: batch 2, 48 tokens each, blocks of 16 stored out of order, 8 selected tokens per row."""
    a = qsfa_case(layout_kv="PA_BSND", block_size=16, kv_s=kv_len, sparse=width, key_fmt=key_fmt, qdtype=qdtype,
                  q_s=1, seed=seed)
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(kv_len)[:width] for _ in range(2)]).astype(np.int32).reshape(2, 1, 1, width)
    a["sparse_indices"] = idx
    if not contiguous:  # the same cache as a view of a bigger one (every other row of a doubled block axis)
        k = a["key"]
        big = np.zeros((k.shape[0], 2 * k.shape[1]) + k.shape[2:], k.dtype)
        big[:, ::2] = k
        a["key"] = a["value"] = big[:, ::2]
        assert not a["key"].flags.c_contiguous
    return a


def _row(a, batch, token):
    """The storage row (a writable uint8 view of ``a["key"]``) of ``token`` of ``batch``."""
    bs = a["key"].shape[1]
    blk = a["block_table"][batch, token // bs]
    return a["key"].view(np.uint8)[blk, token % bs, 0]


def _selected(a, batch):
    return [int(t) for t in a["sparse_indices"][batch].reshape(-1)]


def _unselected(a, batch, kv_len=48):
    return sorted(set(range(kv_len)) - set(_selected(a, batch)))


def _fails(a, *needles):
    with pytest.raises(InvalidArgument) as e:
        qsfa.kv_quant_sparse_flash_attention(**a)
    msg = str(e.value)
    assert "Invalid value for key" in msg and "sparse indices select" in msg, msg
    for s in needles:
        assert s in msg, msg
    return msg


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("tile,value", [(0, NAN32), (3, INF32)])
def test_a_selected_row_with_a_non_finite_scale_is_refused(contiguous, tile, value):
    a = _pa_call(contiguous=contiguous)
    tok = _selected(a, 1)[5]
    _row(a, 1, tok)[640 + 4 * tile:644 + 4 * tile] = value
    before = a["key"].tobytes()
    _fails(a, f"the scale of NoPE tile {tile}", f"batch 1, token {tok}")
    assert a["key"].tobytes() == before


@pytest.mark.parametrize("qdtype,bits", [("bfloat16", 0x7FC0), ("bfloat16", 0xFF80), ("float16", 0x7C00),
                                         ("float16", 0xFE00)])
def test_a_selected_row_with_a_non_finite_rope_value_is_refused(qdtype, bits):
    a = _pa_call(qdtype=qdtype)
    tok = _selected(a, 0)[2]
    _row(a, 0, tok)[512 + 2 * 37:512 + 2 * 38] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    _fails(a, "RoPE element 37", f"batch 0, token {tok}")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "hifloat8"])
def test_a_selected_row_with_a_non_finite_nope_code_is_refused(fmt):
    codes = np.arange(256, dtype=np.uint8)
    bad = codes[~np.isfinite(np.asarray(formats.decode(codes, fmt), np.float64))]
    assert bad.size  # both formats have NaN (HiFloat8 also inf) codes
    for code in bad:
        a = _pa_call(key_fmt=fmt) if fmt != "hifloat8" else _hif8_call()
        tok = _selected(a, 1)[0]
        _row(a, 1, tok)[300] = code
        _fails(a, f"code 0x{int(code):02X} (NoPE element 300", f"batch 1, token {tok}")


def _hif8_call():
    a = _pa_call(key_fmt="hifloat8", kv_len=48, width=8)
    idx = np.full((2, 1, 1, 2048), -1, np.int32)  # HiFloat8 needs sparse_size 2048 (-1 padded)
    idx[..., :8] = a["sparse_indices"]
    a["sparse_indices"] = idx
    return a


@pytest.mark.parametrize("contiguous", [True, False])
def test_rows_nothing_selects_may_hold_anything(contiguous):
    """NaN scales / RoPE in every row no index selects (within the KV lengths too) and in the free slots past
    them: the call runs, and gives the bytes of the clean cache."""
    a = _pa_call(contiguous=contiguous)
    want = qsfa.kv_quant_sparse_flash_attention(**a)[0]
    for b in range(2):
        for tok in _unselected(a, b):
            _row(a, b, tok)[640:644] = NAN32
            _row(a, b, tok)[512:514] = np.frombuffer(np.uint16(0x7FC0).tobytes(), np.uint8)
    (spare,) = sorted(set(range(a["key"].shape[0])) - set(a["block_table"].reshape(-1).tolist()))
    a["key"].view(np.uint8)[spare, :, 0, 640:656] = 0xFF  # the block no batch maps (qsfa_case keeps one)
    got = qsfa.kv_quant_sparse_flash_attention(**a)[0]
    assert np.isfinite(got.astype(np.float32)).all()
    assert got.tobytes() == want.tobytes()


def test_a_causally_masked_index_does_not_count_as_read():
    """Prefill (sparse_mode 3): an index entry at or past a row's causal threshold selects nothing, so a NaN in
    the row it names is not read by that query row; the first query row that does read it is named."""
    a = qsfa_case(layout_query="BSND", layout_kv="BSND", kv_s=6, q_s=3, sparse=6, batch=1)
    a["sparse_indices"] = np.arange(6, dtype=np.int32)[None, None, None, :].repeat(3, axis=1)
    k = a["key"].copy()
    k.view(np.uint8)[0, 5, 0, 640:644] = NAN32  # token 5: past every row's threshold (4, 5, 6): rows 0, 1 skip it
    a["key"] = a["value"] = k
    _fails(a, "batch 0, token 5")  # the last row (threshold 6) reads it
    a["actual_seq_lengths_query"] = np.array([2], np.int32)  # rows 0-1 only: thresholds 5, 6 -> row 1 reads it
    _fails(a, "batch 0, token 5")
    a["actual_seq_lengths_query"] = np.array([3], np.int32)
    a["actual_seq_lengths_kv"] = np.array([5], np.int32)  # token 5 past the KV length: read by nobody
    out = qsfa.kv_quant_sparse_flash_attention(**a)[0]
    assert np.isfinite(out.astype(np.float32)).all()


def test_a_large_cache_read_sparsely_is_checked_without_scanning_it_all():
    """A cache far larger than what the call selects goes through the gathered path; the verdict is the same."""
    a = _pa_call(kv_len=48)
    k = a["key"]
    big = np.zeros((k.shape[0] + 400,) + k.shape[1:], k.dtype)
    big[:k.shape[0]] = k
    big.view(np.uint8)[k.shape[0]:, :, 0, 640:656] = 0xFF  # 400 unused blocks of NaN scales
    a["key"] = a["value"] = big
    assert np.isfinite(qsfa.kv_quant_sparse_flash_attention(**a)[0].astype(np.float32)).all()
    tok = _selected(a, 0)[1]
    _row(a, 0, tok)[648:652] = NAN32
    _fails(a, "the scale of NoPE tile 2", f"batch 0, token {tok}")


def test_int8_codes_are_never_the_problem():
    """Every int8 code is finite: a cache of every code value with finite scales passes."""
    a = _pa_call()
    k = a["key"].view(np.uint8)
    k[..., :512] = np.arange(512, dtype=np.int64).astype(np.uint8)
    out = qsfa.kv_quant_sparse_flash_attention(**a)[0]
    assert np.isfinite(out.astype(np.float32)).all()


def test_fp8_typed_cache_array():
    a = _pa_call(key_fmt="float8_e4m3fn")
    assert a["key"].dtype == ml_dtypes.float8_e4m3fn
    tok = _selected(a, 0)[0]
    _row(a, 0, tok)[10] = 0xFF  # -NaN
    _fails(a, "code 0xFF (NoPE element 10", f"batch 0, token {tok}")
