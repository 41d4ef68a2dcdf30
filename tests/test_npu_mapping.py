"""qsfa.npu.mapping against the recorded torch_npu / vLLM-Ascend signatures, on CPU tensors.

For every operator the npu backend maps, hypothesis draws the parameters that change the call (layouts,
rope 0/64, LSE on/off, cache modes, dtypes, optional tensors present/absent, chip, custom op loaded) with
small local strategies (a later engineer swaps in qsfa.strategies), and each produced call must

* bind to the recorded signature of the callable it names, with every value of the schema's type;
* name the callable the routing rules choose (the expected target is worked out independently here);
* reinterpret byte tensors as views of the caller's memory (in-place caches stay the caller's buffers);
* agree with qsfa.npu.device.backend_limits: a combination the limits reject is exactly one the mapping
  cannot call;
* unpack a result shaped like the recorded return tuple into the operator's outputs.

The shapes here are small and only as consistent as the mapping needs; the operators' own contracts are
exercised in test_npu_backend.py with the real example argument sets.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qsfa._contract import Args
from qsfa.npu import device, mapping, signatures
from qsfa.npu.mapping import NpuContext

torch = pytest.importorskip("torch")

CHIPS = st.sampled_from([None, "A2", "A3", "950"])
QSFA = "kv_quant_sparse_flash_attention"


def _fake_result(target, like):
    """A return value shaped like the recorded return types (tensors on CPU)."""
    rets = signatures.record(target)["returns"]
    outs = tuple(torch.zeros(2, dtype=torch.float32) + i for i in range(len(rets)))
    return outs[0] if len(rets) == 1 else outs


def _same_memory(a, b):
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _assert_binds(call):
    assert signatures.type_problems(call.target, call.args, call.kwargs) == []
    tgt, args, kwargs = call  # an NpuCall unpacks as the (target, args, kwargs) triple
    assert (tgt, args, kwargs) == (call.target, call.args, call.kwargs)


def _limits_fire(op, a, ctx):
    return [c.id for c in device.backend_limits(op, chip=ctx.chip, custom_ops=ctx.custom_ops)
            if c.check(Args(a)) is not None]


def _ctx(chip, custom):
    return NpuContext(chip=chip, custom_ops=frozenset({mapping.QSFA_CUSTOM_NAME}) if custom else frozenset())


# ----------------------------------------------------------------------------------- QSFA


@st.composite
def qsfa_args(draw):
    layout_q = draw(st.sampled_from(["BSND", "TND"]))
    layout_kv = draw(st.sampled_from(["PA_BSND", layout_q]))
    rope = draw(st.sampled_from([0, 64]))
    fmt = draw(st.sampled_from(["int8", "float8_e4m3fn", "hifloat8"]))
    storage = draw(st.sampled_from(["uint8", "int8", "native"]))
    qdt = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    n = draw(st.sampled_from([1, 2, 4]))
    b, s, k = 2, draw(st.integers(1, 2)), draw(st.sampled_from([1, 3]))
    row = 512 + 2 * rope + 16
    query = torch.zeros((b, s, n, 512 + rope) if layout_q == "BSND" else (b * s, n, 512 + rope), dtype=qdt)
    kv_shape = {"PA_BSND": (3, 16, 1, row), "BSND": (b, 5, 1, row), "TND": (b * 5, 1, row)}[layout_kv]
    byte_dt = {"uint8": torch.uint8, "int8": torch.int8,
               "native": {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "hifloat8": torch.uint8}[fmt]}
    key = torch.zeros(kv_shape, dtype=byte_dt[storage])
    value = draw(st.sampled_from(["same", "copy"]))
    value = key if value == "same" else key.clone()
    idx_shape = (b, s, 1, k) if layout_q == "BSND" else (b * s, 1, k)
    lens_dt = draw(st.sampled_from([torch.int32, torch.int64]))
    with_lens = draw(st.booleans()) or layout_q == "TND" or layout_kv != "BSND"
    a = dict(
        query=query, key=key, value=value,
        sparse_indices=torch.zeros(idx_shape, dtype=torch.int32),
        scale_value=draw(st.sampled_from([0.0416, 1.0])),
        key_quant_mode=2, value_quant_mode=2, key_dequant_scale=None, value_dequant_scale=None,
        block_table=torch.zeros((b, 2), dtype=lens_dt) if layout_kv == "PA_BSND" else None,
        actual_seq_lengths_query=torch.ones(b, dtype=lens_dt) if with_lens else None,
        actual_seq_lengths_kv=torch.ones(b, dtype=lens_dt) if with_lens else None,
        sparse_block_size=draw(st.sampled_from([1, 2, 16])), layout_query=layout_q, layout_kv=layout_kv,
        sparse_mode=draw(st.sampled_from([0, 3])), pre_tokens=2**63 - 1, next_tokens=2**63 - 1,
        attention_mode=2, quant_scale_repo_mode=1, tile_size=128, rope_head_dim=rope,
        return_softmax_lse=draw(st.booleans()), key_dtype=fmt, precision="faithful",
    )
    if draw(st.booleans()):
        a["chunk_size"] = 64  # a reference-only knob the mapping must ignore
    return a


def _expected_qsfa_target(a, ctx):
    """The routing table, written out independently of qsfa.npu.mapping (None = no callable)."""
    custom = mapping.QSFA_CUSTOM_NAME in ctx.custom_ops
    needs_custom = a["rope_head_dim"] == 0 or a["return_softmax_lse"]
    hif8 = a["key_dtype"] == "hifloat8"
    if hif8:
        return None if needs_custom else mapping.QSFA_TORCH_NPU
    if needs_custom:
        return mapping.QSFA_CUSTOM_OP if custom else None
    if custom and ctx.chip in ("A2", "A3"):  # vLLM-Ascend BaseDeviceAdaptor
        return mapping.QSFA_CUSTOM_OP
    return mapping.QSFA_TORCH_NPU  # vLLM-Ascend A5DeviceAdaptor, or no custom op


@given(a=qsfa_args(), chip=CHIPS, custom=st.booleans())
def test_qsfa_mapping_routes_binds_and_views(a, chip, custom):
    ctx = _ctx(chip, custom)
    expected = _expected_qsfa_target(a, ctx)
    fired = _limits_fire(QSFA, a, ctx)
    if expected is None:
        assert fired, "the limits must reject a combination without a callable"
        with pytest.raises(ValueError):
            mapping.map_call(QSFA, a, ctx)
        return
    assert fired == []
    call = mapping.map_call(QSFA, a, ctx)
    assert call.target == expected
    _assert_binds(call)
    q, key, value, idx, scale = call.args
    assert q is a["query"] and idx is a["sparse_indices"] and scale == a["scale_value"]
    want_dt = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "hifloat8": torch.uint8}[a["key_dtype"]]
    if a["key"].dtype == torch.float8_e4m3fn:
        want_dt = torch.float8_e4m3fn
    assert key.dtype == want_dt and _same_memory(key, a["key"])
    assert value.dtype == want_dt and _same_memory(value, a["value"])
    kw = call.kwargs
    for p in ("rope_head_dim", "layout_query", "layout_kv", "sparse_mode", "sparse_block_size", "tile_size",
              "attention_mode", "quant_scale_repo_mode", "key_quant_mode", "value_quant_mode", "pre_tokens"):
        assert kw[p] == a[p], p  # passed explicitly: the two callables' defaults differ
    for p in ("actual_seq_lengths_query", "actual_seq_lengths_kv", "block_table"):
        if a[p] is None:
            assert kw[p] is None
        else:
            assert kw[p].dtype == torch.int32 and torch.equal(kw[p].to(a[p].dtype), a[p])
    if expected == mapping.QSFA_CUSTOM_OP:
        assert kw["return_softmax_lse"] == a["return_softmax_lse"] and "key_dtype" not in kw
        result = _fake_result(expected, q)
        out = call.unpack(result)
        assert len(out) == 3 and all(o is r for o, r in zip(out, result))
    else:
        assert "return_softmax_lse" not in kw
        code = mapping.HIFLOAT8_CODE if a["key_dtype"] == "hifloat8" else None
        assert kw.get("key_dtype") == code and kw.get("value_dtype") == code
        result = _fake_result(expected, q)
        out = call.unpack(result)
        assert len(out) == 3 and out[0] is result
        for empty in out[1:]:
            assert empty.dtype == torch.float32 and tuple(empty.shape) == (0,)


def test_qsfa_custom_op_absent_message_names_the_op_and_how_to_load():
    lim = {c.id: c for c in device.backend_limits(QSFA, chip="A3", custom_ops=frozenset())}
    c = lim[f"npu.{QSFA}.rope0_needs_custom_op"]
    assert mapping.QSFA_CUSTOM_OP in c.reason and "vllm_ascend" in c.reason
    assert c.check(Args(rope_head_dim=0, key_dtype="int8")) == 0
    assert c.check(Args(rope_head_dim=64, key_dtype="int8")) is None
    loaded = {c.id: c for c in device.backend_limits(QSFA, chip="A3",
                                                     custom_ops=frozenset({mapping.QSFA_CUSTOM_NAME}))}
    assert loaded[f"npu.{QSFA}.rope0_needs_custom_op"].check(Args(rope_head_dim=0, key_dtype="int8")) is None
    msg = str(lim[f"npu.{QSFA}.lse_needs_custom_op"].error(True))
    assert msg.startswith("Invalid value for return_softmax_lse, actual: True, reason: softmax_max/softmax_sum")
    prec = lim[f"npu.{QSFA}.precision"]
    assert prec.check(Args(precision="exact")) == "exact" and prec.check(Args(precision="faithful")) is None


# ----------------------------------------------------------------------------------- SFA


@st.composite
def sfa_args(draw):
    layout_q = draw(st.sampled_from(["BSND", "TND"]))
    layout_kv = draw(st.sampled_from(["PA_BSND", layout_q]))
    dt = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    rope_sep = draw(st.booleans())
    q = torch.zeros((2, 1, 4, 512) if layout_q == "BSND" else (2, 4, 512), dtype=dt)
    kv = torch.zeros((3, 16, 1, 512) if layout_kv == "PA_BSND" else
                     ((2, 5, 1, 512) if layout_kv == "BSND" else (10, 1, 512)), dtype=dt)
    opt = lambda t: t if draw(st.booleans()) else None  # noqa: E731
    return dict(
        query=q, key=kv, value=draw(st.sampled_from([kv, None])),
        sparse_indices=torch.zeros((2, 1, 1, 3) if layout_q == "BSND" else (2, 1, 3), dtype=torch.int32),
        scale_value=0.04, block_table=torch.zeros((2, 2), dtype=torch.int32) if layout_kv == "PA_BSND" else None,
        actual_seq_lengths_query=opt(torch.ones(2, dtype=torch.int64)),
        actual_seq_lengths_kv=opt(torch.ones(2, dtype=torch.int32)),
        query_rope=torch.zeros(q.shape[:-1] + (64,), dtype=dt) if rope_sep else None,
        key_rope=torch.zeros(kv.shape[:-1] + (64,), dtype=dt) if rope_sep else None,
        sparse_block_size=1, layout_query=layout_q, layout_kv=layout_kv, sparse_mode=draw(st.sampled_from([0, 3])),
        pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=2,
        return_softmax_lse=draw(st.booleans()), sinks=opt(torch.zeros(4, dtype=torch.float32)),
        precision="faithful",
    )


@given(a=sfa_args(), chip=CHIPS)
def test_sfa_mapping_binds(a, chip):
    call = mapping.map_call("sparse_flash_attention", a, NpuContext(chip=chip))
    assert call.target == "torch_npu.npu_sparse_flash_attention"
    _assert_binds(call)
    assert call.args[2] is a["value"]
    for p in ("query_rope", "key_rope", "sinks"):
        assert call.kwargs[p] is a[p]
    assert call.kwargs["return_softmax_lse"] is a["return_softmax_lse"]
    assert call.kwargs["attention_mode"] == 2  # torch_npu's default is 0: passed explicitly
    assert len(call.unpack(_fake_result(call.target, a["query"]))) == 3


# ------------------------------------------------------------------------------ lightning indexers


@st.composite
def li_args(draw, quant=False):
    layout_q = draw(st.sampled_from(["BSND", "TND"]))
    layout_k = draw(st.sampled_from(["PA_BSND", layout_q]))
    opt = lambda t: t if draw(st.booleans()) else None  # noqa: E731
    if quant:
        fmt = draw(st.sampled_from(["int8", "float8_e4m3fn", "hifloat8"]))
        dt = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "hifloat8": torch.uint8}[fmt]
        as_bytes = draw(st.booleans())  # the codes arrive as uint8 bytes, the format named by query/key_dtype
        if as_bytes:
            dt = torch.uint8
    else:
        dt = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    q = torch.zeros((2, 1, 8, 128) if layout_q == "BSND" else (2, 8, 128), dtype=dt)
    k = torch.zeros((3, 16, 1, 128) if layout_k == "PA_BSND" else
                    ((2, 5, 1, 128) if layout_k == "BSND" else (10, 1, 128)), dtype=dt)
    a = dict(query=q, key=k, weights=torch.zeros((2, 1, 8) if layout_q == "BSND" else (2, 8), dtype=torch.float32),
             actual_seq_lengths_query=opt(torch.ones(2, dtype=torch.int64)),
             actual_seq_lengths_key=opt(torch.ones(2, dtype=torch.int32)),
             block_table=torch.zeros((2, 2), dtype=torch.int32) if layout_k == "PA_BSND" else None,
             layout_query=layout_q, layout_key=layout_k, sparse_count=draw(st.sampled_from([1, 2048, 4096])),
             sparse_mode=draw(st.sampled_from([0, 3])), pre_tokens=2**63 - 1, next_tokens=2**63 - 1)
    if quant:
        a.update(query_dequant_scale=torch.ones(q.shape[:-1], dtype=torch.float32),
                 key_dequant_scale=torch.ones(k.shape[:-1], dtype=torch.float32),
                 query_quant_mode=0, key_quant_mode=0, query_dtype=draw(st.sampled_from([None, fmt])),
                 key_dtype=draw(st.sampled_from([None, fmt])))
        if fmt == "hifloat8" or as_bytes:
            a["query_dtype"] = a["key_dtype"] = fmt
        a["_fmt"] = fmt
    else:
        a["return_value"] = draw(st.booleans())
    return a


@given(a=li_args(), chip=CHIPS)
def test_lightning_indexer_mapping_binds(a, chip):
    call = mapping.map_call("lightning_indexer", a, NpuContext(chip=chip))
    assert call.target == "torch_npu.npu_lightning_indexer"
    _assert_binds(call)
    assert call.kwargs["return_value"] is a["return_value"]
    assert call.kwargs["sparse_count"] == a["sparse_count"]
    if a["actual_seq_lengths_query"] is not None:
        assert call.kwargs["actual_seq_lengths_query"].dtype == torch.int32
    assert len(call.unpack(_fake_result(call.target, a["query"]))) == 2


@given(a=li_args(quant=True), chip=CHIPS)
def test_quant_lightning_indexer_mapping_binds(a, chip):
    fmt = a.pop("_fmt")
    call = mapping.map_call("quant_lightning_indexer", a, NpuContext(chip=chip))
    assert call.target == "torch_npu.npu_quant_lightning_indexer"
    _assert_binds(call)
    hif8 = a["query_dtype"] == "hifloat8"
    assert call.kwargs["query_dtype"] == (mapping.HIFLOAT8_CODE if hif8 else None)
    assert call.kwargs["key_dtype"] == (mapping.HIFLOAT8_CODE if a["key_dtype"] == "hifloat8" else None)
    assert _same_memory(call.args[0], a["query"]) and _same_memory(call.args[1], a["key"])
    want = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "hifloat8": torch.uint8}[fmt]
    assert call.args[0].dtype == want and call.args[1].dtype == want
    out = call.unpack(_fake_result(call.target, a["query"]))
    assert len(out) == 1


# ------------------------------------------------------------------------------ dynamic_block_quant

_DST_CODES = {"int8": 1, "hifloat8": 290, "float8_e5m2": 291, "float8_e4m3fn": 292}  # the op-plugin docs' codes


@given(dst=st.sampled_from(["int8", "hifloat8", "float8_e5m2", "float8_e4m3fn", 1, 23, 24, 290, 291, 292]),
       ndim=st.sampled_from([2, 3]), chip=CHIPS, rb=st.sampled_from([1, 128]), cb=st.sampled_from([64, 128]),
       order=st.sampled_from(["divide", "multiply"]))
def test_dynamic_block_quant_mapping_binds(dst, ndim, chip, rb, cb, order):
    x = torch.zeros((2, 3, 130)[-ndim:], dtype=torch.bfloat16)
    a = dict(x=x, min_scale=0.0, round_mode="round" if dst == "hifloat8" else "rint", dst_type=dst,
             row_block_size=rb, col_block_size=cb, dst_type_max=0.0, scale_order=order)
    call = mapping.map_call("dynamic_block_quant", a, NpuContext(chip=chip))
    assert call.target == "torch_npu.npu_dynamic_block_quant"
    _assert_binds(call)
    assert call.args == (x,)
    assert call.kwargs["dst_type"] == (_DST_CODES[dst] if isinstance(dst, str) else dst)
    assert (call.kwargs["row_block_size"], call.kwargs["col_block_size"]) == (rb, cb)
    assert len(call.unpack(_fake_result(call.target, x))) == 2


def test_dynamic_block_quant_unknown_dst_type_is_a_type_error():
    with pytest.raises(TypeError, match="no torch_npu dtype code for 'float4_e2m1'"):
        mapping.map_call("dynamic_block_quant", dict(x=torch.zeros(2, 2), dst_type="float4_e2m1"), NpuContext())


# ------------------------------------------------------------------------------ kv_rmsnorm_rope_cache

CACHE_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")
_CACHE_FMT = {  # our cache format -> (storage dtypes the caller may use, torch dtype torch_npu wants)
    None: ((torch.bfloat16,), torch.bfloat16),
    "int8": ((torch.int8, torch.uint8), torch.int8),
    "float8_e4m3fn": ((torch.float8_e4m3fn, torch.uint8), torch.float8_e4m3fn),
    "float8_e5m2": ((torch.float8_e5m2, torch.uint8), torch.float8_e5m2),
    "hifloat8": ((torch.uint8,), torch.uint8),
}


@st.composite
def krrc_args(draw):
    mode = draw(st.sampled_from(CACHE_MODES))
    k_fmt, c_fmt = draw(st.sampled_from(list(_CACHE_FMT))), draw(st.sampled_from(list(_CACHE_FMT)))
    k_store = draw(st.sampled_from(_CACHE_FMT[k_fmt][0]))
    c_store = draw(st.sampled_from(_CACHE_FMT[c_fmt][0]))
    with_v = draw(st.booleans())
    kv = torch.zeros((2, 1, 1, 576), dtype=torch.bfloat16)
    shape = (2, 1, 4, 64) if mode == "Norm" else (3, 16, 1, 64)
    k_cache = torch.zeros(shape, dtype=k_store)
    ckv_cache = torch.zeros(shape[:-1] + (512,), dtype=c_store)
    quant_k = k_fmt is not None
    opt = lambda t: t if draw(st.booleans()) else None  # noqa: E731
    return dict(
        kv=kv, gamma=torch.ones(576 if with_v else 512, dtype=torch.bfloat16),
        cos=torch.zeros((2, 1, 1, 64), dtype=torch.bfloat16), sin=torch.zeros((2, 1, 1, 64), dtype=torch.bfloat16),
        index=torch.zeros((2, 1) if mode == "Norm" else (2,), dtype=torch.int64),
        k_cache=k_cache, ckv_cache=ckv_cache,
        k_rope_scale=torch.ones(64) if quant_k else None, c_kv_scale=torch.ones(512) if c_fmt else None,
        k_rope_offset=opt(torch.zeros(64)) if quant_k else None, c_kv_offset=opt(torch.zeros(512)) if c_fmt else None,
        v=torch.zeros((2, 1, 1, 512), dtype=torch.bfloat16) if with_v else None,
        epsilon=1e-5, cache_mode=mode, is_output_kv=draw(st.booleans()),
        k_cache_dtype=k_fmt if (k_fmt and (k_store == torch.uint8 or draw(st.booleans()))) else None,
        ckv_cache_dtype=c_fmt if (c_fmt and (c_store == torch.uint8 or draw(st.booleans()))) else None,
    ), (k_fmt, c_fmt)


@given(drawn=krrc_args(), chip=CHIPS)
def test_kv_rmsnorm_rope_cache_mapping_binds_and_keeps_caches_in_place(drawn, chip):
    a, (k_fmt, c_fmt) = drawn
    ctx = NpuContext(chip=chip)
    hif8 = "hifloat8" in (a["k_cache_dtype"], a["ckv_cache_dtype"])
    fired = _limits_fire("kv_rmsnorm_rope_cache", a, ctx)
    if hif8 and chip != "950":
        assert fired == ["npu.kv_rmsnorm_rope_cache.hifloat8_needs_v2"]
        with pytest.raises(ValueError):
            mapping.map_call("kv_rmsnorm_rope_cache", a, ctx)
        return
    assert fired == []
    call = mapping.map_call("kv_rmsnorm_rope_cache", a, ctx)
    v2 = chip == "950"
    assert call.target == ("torch_npu.npu_kv_rmsnorm_rope_cache_v2" if v2 else "torch_npu.npu_kv_rmsnorm_rope_cache")
    _assert_binds(call)
    k_cache, ckv_cache = call.args[5], call.args[6]
    for ours, theirs, fmt in ((a["k_cache"], k_cache, k_fmt), (a["ckv_cache"], ckv_cache, c_fmt)):
        assert _same_memory(ours, theirs)
        assert theirs.dtype == _CACHE_FMT[fmt][1]
    if v2:
        assert call.kwargs["k_cache_dtype"] == (mapping.HIFLOAT8_CODE if a["k_cache_dtype"] == "hifloat8" else None)
        assert call.kwargs["ckv_cache_dtype"] == (mapping.HIFLOAT8_CODE if a["ckv_cache_dtype"] == "hifloat8" else None)
        assert call.writeback == ()
    else:
        assert "k_cache_dtype" not in call.kwargs
        assert [i for i, _ in call.writeback] == [0, 1] and call.writeback[0][1] is k_cache
    out = call.unpack(_fake_result(call.target, a["kv"]))
    assert len(out) == 4 and out[0] is a["k_cache"] and out[1] is a["ckv_cache"]
    quantised = k_fmt is not None or c_fmt is not None
    effective = a["is_output_kv"] and (a["cache_mode"] != "Norm" or (a["v"] is not None and quantised))
    assert (out[2] is not None) == effective and (out[3] is not None) == effective


# ------------------------------------------------------------------------------------ scatter_by_slot


def _emulate_scatter_nd_update_(var, indices, updates):
    """torch_npu.npu_scatter_nd_update_'s documented semantics on CPU: var[tuple(index)] = update."""
    for i in range(indices.shape[0]):
        var[tuple(int(v) for v in indices[i])] = updates[i]
    return var


@given(dt=st.sampled_from([torch.uint8, torch.int8, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                           torch.int32, torch.int16]),
       slots=st.lists(st.integers(-1, 23), min_size=1, max_size=8).map(
           lambda xs: [x for i, x in enumerate(xs) if x == -1 or x not in xs[:i]]),
       row_shape=st.sampled_from([(1, 6), (3,), ()]), strided=st.booleans(),
       slot_dt=st.sampled_from([torch.int32, torch.int64]))
def test_scatter_by_slot_mapping_writes_what_the_reference_writes(dt, slots, row_shape, strided, slot_dt):
    block_num, block_size = 3, 8
    gen = torch.Generator().manual_seed(len(slots))
    raw = torch.randint(0, 127, (block_num * (2 if strided else 1), block_size) + row_shape, generator=gen,
                        dtype=torch.int16)
    cache = raw.to(dt) if not dt.is_floating_point or dt in (torch.bfloat16, torch.float32) else \
        raw.to(torch.uint8).view(dt)
    if strided:
        cache = cache[::2]  # non-contiguous along block_num, as a real cache view may be
    rows = torch.randint(0, 127, (len(slots),) + row_shape, generator=gen, dtype=torch.int16)
    rows = rows.to(dt) if not dt.is_floating_point or dt in (torch.bfloat16, torch.float32) else \
        rows.to(torch.uint8).view(dt)
    slot_mapping = torch.tensor(slots, dtype=slot_dt)
    a = dict(cache=cache, rows=rows, slot_mapping=slot_mapping)
    expected = cache.clone()
    for t, s in enumerate(slots):  # the obvious per-token loop, independent of the mapping
        if s >= 0:
            expected[s // block_size, s % block_size] = rows[t]
    call = mapping.map_call("scatter_by_slot", a, NpuContext(chip="A3"))
    assert call.target == "torch_npu.npu_scatter_nd_update_"
    _assert_binds(call)
    var, indices, updates = call.args
    assert var.data_ptr() == cache.data_ptr()  # a view of the caller's cache, never a copy
    assert indices.shape == (sum(s >= 0 for s in slots), 2) and (indices >= 0).all()
    assert var.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.int8)
    _emulate_scatter_nd_update_(var, indices, updates)
    assert torch.equal(cache.view(torch.uint8) if cache.element_size() == 1 else cache.unsqueeze(-1).view(torch.uint8),
                       expected.view(torch.uint8) if cache.element_size() == 1 else
                       expected.unsqueeze(-1).view(torch.uint8))
    assert call.unpack(var) == (cache,)


# ------------------------------------------------------------------------------ coverage and rules


def test_every_recorded_signature_is_a_mapping_target():
    """Each recorded callable is produced by some mapping (a fixed example per target)."""
    hit = set()
    q = torch.zeros((1, 1, 1, 576), dtype=torch.bfloat16)
    key = torch.zeros((1, 16, 1, 656), dtype=torch.int8)
    base = dict(query=q, key=key, value=key, sparse_indices=torch.zeros((1, 1, 1, 1), dtype=torch.int32),
                scale_value=1.0, rope_head_dim=64, return_softmax_lse=False, key_dtype="int8")
    hit.add(mapping.map_call(QSFA, base, NpuContext(chip="950")).target)
    hit.add(mapping.map_call(QSFA, {**base, "return_softmax_lse": True}, _ctx("A2", True)).target)
    hit.add(mapping.map_call("sparse_flash_attention", dict(query=q, key=q, value=q, sparse_indices=base[
        "sparse_indices"], scale_value=1.0), NpuContext()).target)
    hit.add(mapping.map_call("lightning_indexer", dict(query=q, key=q, weights=q), NpuContext()).target)
    hit.add(mapping.map_call("quant_lightning_indexer", dict(query=q, key=q, weights=q, query_dequant_scale=q,
                                                             key_dequant_scale=q), NpuContext()).target)
    hit.add(mapping.map_call("dynamic_block_quant", dict(x=q), NpuContext()).target)
    cache = dict(kv=q, gamma=q, cos=q, sin=q, index=q, k_cache=key, ckv_cache=key)
    hit.add(mapping.map_call("kv_rmsnorm_rope_cache", cache, NpuContext(chip="A2")).target)
    hit.add(mapping.map_call("kv_rmsnorm_rope_cache", cache, NpuContext(chip="950")).target)
    hit.add(mapping.map_call("scatter_by_slot", dict(cache=key, rows=key[0], slot_mapping=torch.arange(16)),
                             NpuContext()).target)
    hit.add(mapping.map_call("kv_compress_epilog_vllm", dict(
        kv_compress_cache=torch.zeros((4, 1, 640), dtype=torch.float8_e4m3fn), x=q[0, 0, :, :512],
        slot_mapping=torch.zeros(1, dtype=torch.int64), quant_group_size=64, quant_mode=2, round_scale_flag=True,
        layout=1), NpuContext(chip="950", custom_ops=frozenset({mapping.KCE_VLLM_CUSTOM_NAME}))).target)
    hit.add(mapping.map_call("indexer_compress_epilog_v2", dict(
        indexer_compress_cache=torch.zeros((2, 4, 1, 132), dtype=torch.uint8), x=q[0, 0, :, :128],
        slot_mapping=torch.zeros(1, dtype=torch.int32), layout=2),
        NpuContext(chip="950", custom_ops=frozenset({mapping.ICE2_CUSTOM_NAME}))).target)
    vqli = mapping.map_call("vllm_quant_lightning_indexer", _vqli_torch_args(), NpuContext(
        chip="A3", custom_ops=frozenset({mapping.VQLI_CUSTOM_NAME})))
    hit.update({vqli.target, vqli.kwargs["metadata"].target})
    for op in V4_ATTENTION:
        call = mapping.map_call(op, _v4_args(op), _V4_CTX)
        hit.update({call.target, call.kwargs["metadata"].target})
    for op in ("indexer_quant_cache", "scatter_pa_kv_cache_with_k_scale", "qkv_rms_norm_rope_cache_with_k_scale",
               "compressor", "quant_compressor"):
        hit.add(mapping.map_call(op, _torch_example(op), NpuContext(chip="950")).target)
    qli2 = mapping.map_call("quant_lightning_indexer_v2", _qli2_args(), NpuContext(chip="950"))
    hit.update({qli2.target, qli2.kwargs["metadata"].target})
    hit.add(mapping.map_call("vllm_compressor", _torch_example("vllm_compressor"), _VCMP_CTX).target)
    assert hit == set(signatures.targets())


def test_unknown_parameters_are_refused_not_dropped():
    with pytest.raises(TypeError, match=r"does not know the parameter\(s\) \['mystery'\]"):
        mapping.map_call("dynamic_block_quant", dict(x=torch.zeros(2, 2), mystery=1), NpuContext())


def test_not_mapped_operators_say_why():
    with pytest.raises(KeyError, match="no npu mapping for kv_compress_epilog: torch_npu 2.14.0 exposes no"):
        mapping.map_call("kv_compress_epilog", {}, NpuContext())
    assert set(mapping.NOT_MAPPED).isdisjoint(mapping.MAPPINGS)
    for op, why in mapping.NOT_MAPPED.items():
        assert len(why) > 20, op


def test_chip_of_a_context_never_changes_a_torch_npu_only_mapping():
    x = torch.zeros((2, 128), dtype=torch.float16)
    calls = [mapping.map_call("dynamic_block_quant", dict(x=x), NpuContext(chip=c)) for c in (None, "A2", "A3", "950")]
    assert len({(c.target, tuple(sorted(c.kwargs.items()))) for c in calls}) == 1
    assert np.all([c.args[0] is x for c in calls])


def test_kv_compress_epilog_vllm_mapping_is_the_custom_ops_positional_call():
    cache = torch.zeros((4, 1, 640), dtype=torch.float8_e5m2)
    a = dict(kv_compress_cache=cache, x=torch.zeros((2, 512), dtype=torch.bfloat16),
             slot_mapping=torch.tensor([1, -1], dtype=torch.int32), quant_group_size=128, quant_mode=2,
             round_scale_flag=False, layout=2)
    call = mapping.map_call("kv_compress_epilog_vllm", a, NpuContext(
        chip="950", custom_ops=frozenset({mapping.KCE_VLLM_CUSTOM_NAME})))
    assert call.target == "torch.ops._C_ascend.kv_compress_epilog"
    _assert_binds(call)
    assert call.args[0] is cache and call.args[3:] == (128, 2, False, 2) and call.kwargs == {}
    assert call.unpack(None) == (cache,)
    with pytest.raises(ValueError, match="not loaded"):
        mapping.map_call("kv_compress_epilog_vllm", a, NpuContext(chip="950"))
    lim = {c.id: c for c in device.backend_limits("kv_compress_epilog_vllm", chip="950", custom_ops=frozenset())}
    assert "vllm_ascend" in lim["npu.kv_compress_epilog_vllm.needs_custom_op"].reason
    assert not device.backend_limits("kv_compress_epilog_vllm", chip="950",
                                     custom_ops=frozenset({"kv_compress_epilog"}))[0].check(a)


def test_indexer_compress_epilog_v2_mapping_is_the_custom_ops_positional_call():
    a = dict(indexer_compress_cache=torch.zeros((2, 4, 1, 132), dtype=torch.uint8),
             x=torch.zeros((3, 128), dtype=torch.bfloat16), slot_mapping=torch.zeros(3, dtype=torch.int32), layout=2)
    call = mapping.map_call("indexer_compress_epilog_v2", a, NpuContext(
        chip="950", custom_ops=frozenset({mapping.ICE2_CUSTOM_NAME})))
    assert call.target == mapping.ICE2_CUSTOM_OP and call.kwargs == {}
    assert call.args[0] is a["indexer_compress_cache"] and call.args[3] == 2
    _assert_binds(call)
    assert call.unpack(None)[0] is a["indexer_compress_cache"]  # written in place, returns nothing
    with pytest.raises(ValueError, match="not loaded"):
        mapping.map_call("indexer_compress_epilog_v2", a, NpuContext(chip="950"))
    lim = {c.id: c for c in device.backend_limits("indexer_compress_epilog_v2", chip="950", custom_ops=frozenset())}
    assert "vllm_ascend" in lim["npu.indexer_compress_epilog_v2.needs_custom_op"].reason


def _vqli_torch_args(**kw):
    from qsfa.ops.indexer_v4 import vqli_case

    a = vqli_case(**kw)
    return {k: torch.from_numpy(np.ascontiguousarray(v).view(np.int8) if v.dtype.itemsize == 1 else v)
            if isinstance(v, np.ndarray) else v for k, v in a.items()}


def test_vllm_quant_lightning_indexer_mapping_calls_the_metadata_operator_when_none_is_given():
    a = _vqli_torch_args(cmp_ratio=4, layout_query="TND")
    ctx = NpuContext(chip="A3", custom_ops=frozenset({mapping.VQLI_CUSTOM_NAME}))
    call = mapping.map_call("vllm_quant_lightning_indexer", a, ctx)
    assert call.target == mapping.VQLI_CUSTOM_OP
    meta = call.kwargs["metadata"]
    assert isinstance(meta, mapping.NpuCall) and meta.target == mapping.VQLI_META_CUSTOM_OP
    _assert_binds(meta)
    assert meta.args == (64, 1, 128, 0, 0)
    assert meta.kwargs["cmp_ratio"] == 4 and meta.kwargs["batch_size"] == 2 and meta.kwargs["max_seqlen_q"] == 2
    assert meta.kwargs["max_seqlen_k"] == 24 and meta.kwargs["layout_key"] == "PA_BSND"
    given = torch.zeros(1024, dtype=torch.int32)
    call2 = mapping.map_call("vllm_quant_lightning_indexer", {**a, "metadata": given}, ctx)
    assert call2.kwargs["metadata"] is given
    _assert_binds(call2)
    assert call2.kwargs["cmp_ratio"] == 4 and call2.kwargs["return_value"] is False
    assert call2.unpack((1, 2)) == (1, 2)
    with pytest.raises(ValueError, match="not loaded"):
        mapping.map_call("vllm_quant_lightning_indexer", a, NpuContext(chip="A3"))


# ------------------------------------------------------------------------ DeepSeek-V4 operators

V4_ATTENTION = ("sparse_attn_sharedkv", "kv_quant_sparse_attn_sharedkv", "sparse_flash_mla",
                "mixed_quant_sparse_flash_mla", "quant_sparse_flash_mla")
_V4_CTX = NpuContext(chip="950", custom_ops=frozenset({mapping.SAS_CUSTOM_NAME, mapping.KQS_CUSTOM_NAME}))
_V4_TARGETS = {"sparse_attn_sharedkv": (mapping.SAS_CUSTOM_OP, mapping.SAS_META_CUSTOM_OP),
               "kv_quant_sparse_attn_sharedkv": (mapping.KQS_CUSTOM_OP, mapping.KQS_META_CUSTOM_OP),
               "sparse_flash_mla": (mapping.SFM_OP, mapping.SFM_META_OP),
               "mixed_quant_sparse_flash_mla": (mapping.MQ_OP, mapping.MQ_META_OP),
               "quant_sparse_flash_mla": (mapping.QS_OP, mapping.QS_META_OP)}


def _torch_args(a):
    """Normalised operator arguments with torch tensors (1-byte arrays as int8 bytes, as a caller may hold them)."""
    from qsfa._arrays import to_torch

    return {k: (torch.from_numpy(np.ascontiguousarray(v).view(np.int8)) if v.dtype.itemsize == 1 else
                to_torch(np.ascontiguousarray(v))) if isinstance(v, np.ndarray) else v for k, v in a.items()}


def _torch_example(op):
    from qsfa._dispatch import operators

    c = operators()[op].contract
    return _torch_args(dict(c.validate(c.example(np.random.default_rng(0)))))


def _v4_args(op, **kw):
    from qsfa._dispatch import operators
    from qsfa.ops import sharedkv

    build = {"sparse_attn_sharedkv": sharedkv.sas_case, "kv_quant_sparse_attn_sharedkv": sharedkv.kqs_case,
             "sparse_flash_mla": sharedkv.sfm_case, "mixed_quant_sparse_flash_mla": sharedkv.mq_case,
             "quant_sparse_flash_mla": sharedkv.qs_case}[op]
    a = dict(operators()[op].contract.validate(build(**kw)))
    a["metadata"] = None
    return _torch_args(a)


_V4_PA = {"sparse_attn_sharedkv": "PA_ND", "kv_quant_sparse_attn_sharedkv": "PA_ND", "sparse_flash_mla": "PA_BBND",
          "mixed_quant_sparse_flash_mla": "PA_BBND", "quant_sparse_flash_mla": "PA_BBND"}
_V4_VARIANTS = [(op, dict(scenario=sc, layout_q=lq, layout_kv=lkv or _V4_PA[op]), lse)
                for op in V4_ATTENTION for sc in ("SWA", "CSA", "HCA") for lq, lkv in
                (("BSND", None), ("TND", None), ("TND", "TND"), ("BSND", "BSND"))
                for lse in (False, True)]


@pytest.mark.parametrize("op,kw,lse", _V4_VARIANTS,
                         ids=[f"{op}-{kw['scenario']}-{kw['layout_q']}-{kw['layout_kv']}-lse{int(lse)}"
                              for op, kw, lse in _V4_VARIANTS])
def test_v4_attention_mapping_binds_passes_every_value_and_builds_the_metadata(op, kw, lse):
    kw = dict(kw, quant_mode=1) if op == "mixed_quant_sparse_flash_mla" and kw["layout_kv"] != "PA_BBND" else kw
    a = _v4_args(op, **kw)
    a["return_softmax_lse"] = lse
    target, meta_target = _V4_TARGETS[op]
    call = mapping.map_call(op, a, _V4_CTX)
    assert call.target == target
    meta = call.kwargs["metadata"]
    assert isinstance(meta, mapping.NpuCall) and meta.target == meta_target
    _assert_binds(meta)
    given = torch.zeros(1024, dtype=torch.int32)
    call = mapping.map_call(op, {**a, "metadata": given}, _V4_CTX)
    _assert_binds(call)
    assert call.kwargs["metadata"] is given
    # every parameter of the schema is passed: no registered default is relied on (they differ from the docs)
    bound = signatures.signature(target).bind(*call.args, **call.kwargs).arguments
    assert set(bound) == {p["name"] for p in signatures.record(target)["params"]}
    for p in ("softmax_scale", "cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right",
              "layout_q", "layout_kv", "return_softmax_lse"):
        assert bound[p] == a[p], p
    assert bound["ori_win_left"] == 127 and bound["softmax_scale"] == pytest.approx(512 ** -0.5)
    for p in ("kv_quant_mode", "tile_size", "rope_head_dim", "quant_mode", "topk_value_mode"):
        if p in a:
            assert bound[p] == a[p], p
    if op in ("kv_quant_sparse_attn_sharedkv", "mixed_quant_sparse_flash_mla"):
        for p in ("ori_kv", "cmp_kv"):  # float8_e4m3fn views of the caller's bytes
            assert bound[p] is None if a[p] is None else (bound[p].dtype == torch.float8_e4m3fn
                                                          and bound[p].data_ptr() == a[p].data_ptr()), p
    if op == "quant_sparse_flash_mla":
        for p in ("q", "ori_kv", "cmp_kv"):  # uint8 views of the caller's HiFloat8 bytes (held as int8 here)
            assert bound[p] is None if a[p] is None else (bound[p].dtype == torch.uint8
                                                          and _same_memory(bound[p], a[p])), p
        for p in ("q_descale", "ori_kv_descale", "cmp_kv_descale"):
            assert bound[p] is a[p], p
    # the metadata operator gets the same shape facts the attention call implies
    m = signatures.signature(meta_target).bind(*meta.args, **meta.kwargs).arguments
    q = a["q"]
    assert (m["num_heads_q"], m["num_heads_kv"], m["head_dim"]) == (q.shape[-2], 1, 512)
    batch = q.shape[0] if a["layout_q"] == "BSND" else a["cu_seqlens_q"].numel() - 1
    s1 = q.shape[1] if a["layout_q"] == "BSND" else int((a["cu_seqlens_q"][1:] - a["cu_seqlens_q"][:-1]).max())
    assert (m["batch_size"], m["max_seqlen_q"]) == (batch, s1)
    assert m["has_ori_kv"] is True and m["has_cmp_kv"] is (a["cmp_kv"] is not None)
    idx = a["cmp_sparse_indices"]
    assert m["ori_topk"] == 0 and m["cmp_topk"] == (0 if idx is None else idx.shape[-1])
    for p in ("cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right", "layout_q", "layout_kv"):
        assert m[p] == a[p], p
    s2 = max(int(v) for v in (a.get("seqused_kv", a.get("seqused_ori_kv")) if a.get(
        "seqused_kv", a.get("seqused_ori_kv")) is not None else [a["ori_kv"].shape[1]])) \
        if a["layout_kv"] != "TND" else int((a["cu_seqlens_ori_kv"][1:] - a["cu_seqlens_ori_kv"][:-1]).max())
    assert m.get("max_seqlen_kv", m.get("max_seqlen_ori_kv")) == s2
    for p in ("kv_quant_mode", "tile_size", "rope_head_dim", "quant_mode"):
        if p in a:
            assert m[p] == a[p], p
    # outputs: (attention_out, softmax_lse); the LSE is qsfa's empty [0] float32 when it was not asked for
    out, lse_out = torch.zeros(2, 3), torch.ones(4)
    got = call.unpack((out, lse_out))
    assert got[0] is out and (got[1] is lse_out if lse else (tuple(got[1].shape), got[1].dtype) == ((0,), torch.float32))


def _v4_out_buffer(a):
    """An attention_out= buffer for the V4 arguments ``a`` (q's shape; bfloat16 for quant_sparse_flash_mla's
    HiFloat8 codes, else q's dtype)."""
    q = a["q"]
    return torch.zeros(q.shape, dtype=torch.bfloat16 if q.element_size() == 1 else q.dtype)


@pytest.mark.parametrize("op", V4_ATTENTION)
@pytest.mark.parametrize("lse", [False, True])
def test_v4_attention_out_is_filled_after_the_call_and_returned(op, lse):
    """No V4 schema takes an output tensor: a caller's attention_out= buffer gets the call's output copied into it
    (writeback of result item 0) and is the returned output; the call itself is the one without the buffer."""
    a = {**_v4_args(op), "return_softmax_lse": lse, "metadata": torch.zeros(1024, dtype=torch.int32)}
    target = _V4_TARGETS[op][0]
    assert "out" not in {p["name"] for p in signatures.record(target)["params"]}
    assert signatures.record(target)["returns"] == ["Tensor", "Tensor"]
    plain = mapping.map_call(op, a, _V4_CTX)
    assert plain.writeback == ()
    buf = _v4_out_buffer(a)
    call = mapping.map_call(op, {**a, "attention_out": buf}, _V4_CTX)
    _assert_binds(call)
    assert call.target == plain.target and len(call.args) == len(plain.args)
    assert all(_same_memory(x, y) if torch.is_tensor(x) else x == y for x, y in zip(call.args, plain.args))
    assert set(call.kwargs) == set(plain.kwargs) and "attention_out" not in call.kwargs
    assert len(call.writeback) == 1 and call.writeback[0][0] == 0 and call.writeback[0][1] is buf
    out, lse_out = torch.ones(buf.shape, dtype=buf.dtype), torch.ones(4)
    got = call.unpack((out, lse_out))
    assert got[0] is buf and (got[1] is lse_out if lse else tuple(got[1].shape) == (0,))


@pytest.mark.parametrize("op", V4_ATTENTION + ("indexer_quant_cache", "scatter_pa_kv_cache_with_k_scale",
                                "quant_lightning_indexer_v2", "qkv_rms_norm_rope_cache_with_k_scale",
                                "compressor", "quant_compressor"))
def test_v4_mappings_consume_every_operator_parameter(op):
    """Each parameter of the operator's contract reaches the call or is listed in IGNORED (reference-only)."""
    from qsfa._dispatch import operators

    declared = set(operators()[op].contract.params)
    assert declared - set(mapping.IGNORED) - {"metadata"}  # the operator has parameters to map
    a = _v4_args(op) if op in V4_ATTENTION else _torch_example(op)
    if op in V4_ATTENTION:  # the output buffer: absent from the cases (an absent buffer is no parameter of a call)
        a["attention_out"] = _v4_out_buffer(a)
    assert set(a) == declared
    ctx = _V4_CTX
    mapping.map_call(op, a, ctx)  # raises TypeError for a parameter neither mapped nor ignored
    with pytest.raises(TypeError, match=r"does not know the parameter\(s\) \['mystery'\]"):
        mapping.map_call(op, {**a, "mystery": 1}, ctx)


def test_recorded_defaults_differ_from_the_docs_and_the_mapping_does_not_use_them():
    """vLLM-Ascend registers softmax_scale=0, cmp_ratio=0, ori_win_left=128 for npu_sparse_attn_sharedkv (the
    ops-transformer README: None / None / 127); mixed_quant_sparse_flash_mla declares int quant_mode=None."""
    sas = {p["name"]: p.get("default") for p in signatures.record(mapping.SAS_CUSTOM_OP)["params"]}
    assert (sas["softmax_scale"], sas["cmp_ratio"], sas["ori_win_left"]) == (0, 0, 128)
    kqs = {p["name"]: p.get("default") for p in signatures.record(mapping.KQS_CUSTOM_OP)["params"]}
    assert (kqs["tile_size"], kqs["rope_head_dim"], kqs["ori_win_left"]) == (0, 0, 127)
    mq = {p["name"]: p for p in signatures.record(mapping.MQ_OP)["params"]}
    assert mq["quant_mode"]["type"] == "int" and mq["quant_mode"]["default"] is None
    a = _v4_args("sparse_attn_sharedkv")
    kw = mapping.map_call("sparse_attn_sharedkv", a, _V4_CTX).kwargs
    assert (kw["softmax_scale"], kw["cmp_ratio"], kw["ori_win_left"]) == (a["softmax_scale"], 4, 127)


@pytest.mark.parametrize("op", ["sparse_attn_sharedkv", "kv_quant_sparse_attn_sharedkv"])
def test_sharedkv_custom_op_absent_is_refused_by_the_limits_and_the_mapping(op):
    a = _v4_args(op)
    with pytest.raises(ValueError, match="not loaded"):
        mapping.map_call(op, a, NpuContext(chip="950"))
    lim = {c.id: c for c in device.backend_limits(op, chip="950", custom_ops=frozenset())}
    c = lim[f"npu.{op}.needs_custom_op"]
    assert c.param == "q" and "vllm_ascend" in c.reason and c.check(Args(a)) is not None
    loaded = {mapping.SAS_CUSTOM_NAME, mapping.KQS_CUSTOM_NAME}
    assert [c.id for c in device.backend_limits(op, chip="950", custom_ops=loaded) if c.check(Args(a))] == []
    exact = {**a, "precision": "exact"}
    assert [c.id for c in device.backend_limits(op, chip="950", custom_ops=loaded) if c.check(Args(exact))] == \
        [f"npu.{op}.precision"]


@pytest.mark.parametrize("mode", ["fp8", "MXFP8", "hifloat8", "mxfp4"])
def test_indexer_quant_cache_mapping_is_the_packages_in_place_call(mode):
    from qsfa.ops.indexer_cache import IQC_CONTRACT

    a = _torch_example("indexer_quant_cache")
    a["quant_mode"] = mode
    call = mapping.map_call("indexer_quant_cache", a, NpuContext(chip="950"))
    assert call.target == mapping.IQC_OP
    _assert_binds(call)
    cache, scale, x, slots = call.args
    assert cache is a["cache"] and x is a["x"] and slots.dtype == torch.int32
    assert scale.data_ptr() == a["cache_scale"].data_ptr()
    mx = mode.lower() in ("mxfp8", "mxfp4")
    assert scale.dtype == (torch.float8_e8m0fnu if mx and a["cache_scale"].element_size() == 1
                           else a["cache_scale"].dtype)
    assert call.kwargs == dict(quant_mode=mode.lower(), round_scale=a["round_scale"], x_scale=float(a["x_scale"]))
    got = call.unpack(None)  # the op returns nothing; the caches were written in place
    assert got[0] is a["cache"] and got[1] is a["cache_scale"]
    assert IQC_CONTRACT.inplace == ("cache", "cache_scale")


def test_scatter_pa_kv_cache_with_k_scale_mapping_is_the_packages_positional_call():
    a = _torch_example("scatter_pa_kv_cache_with_k_scale")
    call = mapping.map_call("scatter_pa_kv_cache_with_k_scale", a, NpuContext(chip="950"))
    assert call.target == mapping.SPKS_OP
    _assert_binds(call)
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping", "key_scale", "key_scale_cache")
    assert all(v is a[n] for v, n in zip(call.args, names)) and call.kwargs == {"cache_layout": a["cache_layout"]}
    got = call.unpack(tuple(t.clone() for t in call.args[2:4] + call.args[6:7]))
    assert got == (a["key_cache"], a["value_cache"], a["key_scale_cache"])  # the caller's tensors, not the aliases
    assert got[0] is a["key_cache"]


# ------------------------------------------------------- cann_ops_transformer QLI v2 and the QKV cache writer


def _qli2_args(**kw):
    from qsfa._dispatch import operators
    from qsfa.ops.quant_lightning_indexer_v2 import qli2_case

    return _torch_args(dict(operators()["quant_lightning_indexer_v2"].contract.validate(qli2_case(**kw))))


_QLI2_VARIANTS = [dict(fmt=f, layout_q=lq, layout_k=lk, mask_mode=m, cmp_ratio=r)
                  for f in ("int8", "float8_e4m3fn", "hifloat8") for lq in ("BSND", "TND")
                  for lk in ("PA_BBND", lq) for m, r in ((3, 4), (0, 1))]


@pytest.mark.parametrize("kw", _QLI2_VARIANTS, ids=["-".join(str(v) for v in kw.values()) for kw in _QLI2_VARIANTS])
def test_qli2_mapping_binds_passes_every_value_and_builds_the_metadata(kw):
    a = _qli2_args(**kw)
    call = mapping.map_call("quant_lightning_indexer_v2", a, NpuContext(chip="950"))
    assert call.target == mapping.QLI2_OP
    meta = call.kwargs["metadata"]
    assert isinstance(meta, mapping.NpuCall) and meta.target == mapping.QLI2_META_OP
    _assert_binds(meta)
    given = torch.zeros(1024, dtype=torch.int32)
    call = mapping.map_call("quant_lightning_indexer_v2", {**a, "metadata": given}, NpuContext(chip="950"))
    _assert_binds(call)
    # every schema parameter is passed, none left to a registered default
    bound = signatures.signature(mapping.QLI2_OP).bind(*call.args, **call.kwargs).arguments
    assert set(bound) == {p["name"] for p in signatures.record(mapping.QLI2_OP)["params"]}
    assert bound["metadata"] is given
    for p in ("weights", "query_dequant_scale", "key_dequant_scale"):
        assert bound[p] is a[p], p
    want = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "hifloat8": torch.uint8}[kw["fmt"]]
    for p in ("query", "key"):  # a view of the caller's bytes (held as int8 here) in the format's dtype
        assert bound[p].dtype == want and bound[p].data_ptr() == a[p].data_ptr() and a[p].dtype == torch.int8, p
    for p in ("topk", "quant_mode", "max_seqlen_q", "layout_q", "layout_k", "mask_mode", "cmp_ratio", "return_value"):
        assert bound[p] == a[p], p
    for p in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "cmp_residual_k", "block_table"):
        assert (bound[p] is None) is (a[p] is None), p
        if a[p] is not None:
            assert bound[p].dtype == torch.int32 and torch.equal(bound[p].long(), a[p].long()), p
    assert bound["quant_mode"] == {"int8": 2, "float8_e4m3fn": 1, "hifloat8": 4}[kw["fmt"]]
    # the metadata operator: shapes, batch, the largest per-batch query / compressed key length, every value given
    m = signatures.signature(mapping.QLI2_META_OP).bind(*meta.args, **meta.kwargs).arguments
    assert set(m) == {p["name"] for p in signatures.record(mapping.QLI2_META_OP)["params"]}
    assert (m["num_heads_q"], m["num_heads_k"], m["head_dim"], m["topk"]) == (64, 1, 128, a["topk"])
    assert (m["batch_size"], m["max_seqlen_q"], m["max_seqlen_k"]) == (2, 2, 6)  # qli2_case: B 2, S1 2, S2 6
    for p in ("quant_mode", "layout_q", "layout_k", "mask_mode", "cmp_ratio"):
        assert m[p] == a[p], p
    assert (m["cmp_residual_k"] is None) is (a["cmp_residual_k"] is None)
    idx, vals = torch.zeros(2, dtype=torch.int32), torch.zeros(0, dtype=torch.bfloat16)
    got = call.unpack((idx, vals))
    assert got[0] is idx and got[1] is vals


def test_qkv_mapping_is_the_packages_in_place_call_on_the_callers_caches():
    a = _torch_example("qkv_rms_norm_rope_cache_with_k_scale")  # 1-byte caches as int8 bytes (_torch_args)
    for layout_qkv, layout_q_out in (("TND", "NTD"), ("NTD", "NTD"), ("TND", "TND")):
        b = {**a, "layout_qkv": layout_qkv, "layout_q_out": layout_q_out, "epsilon": 1e-5}
        call = mapping.map_call("qkv_rms_norm_rope_cache_with_k_scale", b, NpuContext(chip="950"))
        assert call.target == mapping.QKV_OP
        _assert_binds(call)
        bound = signatures.signature(mapping.QKV_OP).bind(*call.args, **call.kwargs).arguments
        assert set(bound) == {p["name"] for p in signatures.record(mapping.QKV_OP)["params"]}
        for p in ("qkv", "q_gamma", "k_gamma", "cos_sin", "k_scale_cache", "rotation", "v_scale"):
            assert bound[p] is b[p], p
        for p in ("k_cache", "v_cache"):  # float8_e4m3fn views of the caller's bytes: written in place
            assert bound[p].dtype == torch.float8_e4m3fn and bound[p].data_ptr() == b[p].data_ptr(), p
        for p in ("slot_mapping", "query_start_loc", "seq_lens"):
            assert bound[p].dtype == torch.int32 and torch.equal(bound[p].long(), b[p].long()), p
        assert bound["head_nums"] == [int(n) for n in b["head_nums"]]
        assert (bound["layout_qkv"], bound["layout_q_out"]) == (layout_qkv, layout_q_out)
        assert bound["epsilon"] == pytest.approx(1e-5)
        q_out, q_scale = torch.zeros(1), torch.ones(1)
        got = call.unpack((q_out, q_scale))
        assert got[0] is q_out and got[1] is q_scale
        assert got[2] is b["k_cache"] and got[3] is b["v_cache"] and got[4] is b["k_scale_cache"]
    rec = {p["name"]: p for p in signatures.record(mapping.QKV_OP)["params"]}
    assert [rec[n]["type"] for n in ("k_cache", "v_cache", "k_scale_cache")] == ["Tensor(a!)", "Tensor(b!)",
                                                                                 "Tensor(c!)"]


def test_qkv_mrope_mapping_passes_the_scenario_arguments():
    """The M-RoPE scenario through the recorded schema (hicann/ops-transformer@c0dda0b): the INT8 K cache as int8
    bytes of the caller's tensor, mrope_position int32, mrope_section a list, q_quant_mode "NoQuant", q_out_dtype
    torch.bfloat16, and None for query_start_loc / seq_lens as the package's document calls it - which the schema's
    plain ``Tensor`` types refuse: the two type problems below are that public contradiction, stated."""
    from qsfa._dispatch import operators
    from qsfa.ops.qkv_k_scale import mrope_case

    c = operators()["qkv_rms_norm_rope_cache_with_k_scale"].contract
    a = _torch_args(dict(c.validate(mrope_case())))
    call = mapping.map_call("qkv_rms_norm_rope_cache_with_k_scale", a, NpuContext(chip="950"))
    assert call.target == mapping.QKV_OP
    bound = signatures.signature(mapping.QKV_OP).bind(*call.args, **call.kwargs).arguments
    assert bound["k_cache"].dtype == torch.int8 and bound["k_cache"].data_ptr() == a["k_cache"].data_ptr()
    assert bound["v_cache"].dtype == torch.float8_e4m3fn
    assert bound["mrope_position"].dtype == torch.int32 and torch.equal(bound["mrope_position"], a["mrope_position"])
    assert bound["mrope_section"] == [22, 12, 10] and bound["q_quant_mode"] == "NoQuant"
    assert bound["q_out_dtype"] is torch.bfloat16 and bound["query_start_loc"] is None and bound["seq_lens"] is None
    assert bound["v_scale"] is a["v_scale"] and tuple(bound["v_scale"].shape) == (2, 128)
    assert signatures.type_problems(call.target, call.args, call.kwargs) == [
        f"{mapping.QKV_OP}: query_start_loc expects Tensor, got None", f"{mapping.QKV_OP}: seq_lens expects Tensor, got None"]
    rope = mapping.map_call("qkv_rms_norm_rope_cache_with_k_scale", _torch_example("qkv_rms_norm_rope_cache_with_k_scale"),
                            NpuContext(chip="950"))
    rb = signatures.signature(mapping.QKV_OP).bind(*rope.args, **rope.kwargs).arguments
    assert (rb["mrope_position"], rb["mrope_section"], rb["q_quant_mode"], rb["q_out_dtype"]) == (
        None, None, "PerTokenPerHead", torch.float8_e4m3fn)


def test_qkv_mx_is_refused_by_name_where_the_recorded_schema_has_no_k_quant_mode():
    """The recorded schema (hicann/ops-transformer@c0dda0b) has q_quant_mode but no k_quant_mode, so the M-RoPE MX
    scenario cannot reach the device through it: the mapping says so instead of calling with K's mode dropped."""
    from qsfa._dispatch import operators
    from qsfa.ops.qkv_k_scale import mx_case

    assert "k_quant_mode" not in signatures.signature(mapping.QKV_OP).parameters
    assert "q_quant_mode" in signatures.signature(mapping.QKV_OP).parameters
    a = _torch_args(dict(operators()["qkv_rms_norm_rope_cache_with_k_scale"].contract.validate(mx_case())))
    with pytest.raises(ValueError, match="k_quant_mode argument, which the recorded schema"):
        mapping.map_call("qkv_rms_norm_rope_cache_with_k_scale", a, NpuContext(chip="950"))


def test_qli2_exact_precision_is_refused_by_the_npu_limits():
    a = _qli2_args()
    lim = device.backend_limits("quant_lightning_indexer_v2", chip="A3", custom_ops=frozenset())
    assert [c.id for c in lim if c.check(Args(a))] == []
    assert [c.id for c in lim if c.check(Args({**a, "precision": "exact"}))] == ["npu.quant_lightning_indexer_v2.precision"]


# ------------------------------------------------------------------------- cann_ops_transformer compressor


def _cmp_args(quant=False, **kw):
    from qsfa._dispatch import operators
    from qsfa.formats import encode
    from qsfa.ops.compressor import compressor_case

    drop_start = kw.pop("no_start_pos", False)
    case = compressor_case(**kw)
    if quant:  # HiFloat8 codes of the same values, fp32 descales (quant_mode 1, the only mode)
        cd = case["wkv"].shape[0]
        case.update({n: encode(case[n].astype(np.float32), "hifloat8", saturate=True) for n in ("x", "wkv", "wgate")})
        case.update(x_descale=np.array([0.5], np.float32), wkv_descale=np.full(cd, 0.25, np.float32),
                    wgate_descale=np.full(cd, 0.125, np.float32), quant_mode=1)
    case.update(cmp_ratio=kw.get("scenario", (4, 2, 128))[0], coff=kw.get("scenario", (4, 2, 128))[1],
                cache_mode=kw.get("cache_mode", 1), precision="faithful")
    case.setdefault("cu_seqlens", None)
    case.setdefault("seqused", None)
    if drop_start:
        case["start_pos"] = None
    return _torch_args(dict(operators()["quant_compressor" if quant else "compressor"].contract.validate(case)))


_CMP_VARIANTS = [dict(scenario=sc, layout=lay, cache_mode=cm, seqused=su, no_start_pos=ns)
                 for sc in ((4, 2, 128), (128, 1, 512)) for lay in ("TH", "BSH") for cm in (1, 2)
                 for su, ns in ((None, False), ((4, 1), True))]


@pytest.mark.parametrize("kw", _CMP_VARIANTS, ids=["-".join(str(v) for v in kw.values()) for kw in _CMP_VARIANTS])
def test_compressor_mapping_binds_passes_every_value_and_hands_back_the_callers_state(kw):
    a = _cmp_args(**kw)
    call = mapping.map_call("compressor", a, NpuContext(chip="A3"))
    assert call.target == mapping.CMP_OP
    _assert_binds(call)
    # every schema parameter is passed, none left to a registered default (cmp_ratio=4, coff=1, cache_mode=1)
    bound = signatures.signature(mapping.CMP_OP).bind(*call.args, **call.kwargs).arguments
    assert set(bound) == {p["name"] for p in signatures.record(mapping.CMP_OP)["params"]}
    for p in ("x", "wkv", "wgate", "state_cache", "ape"):
        assert bound[p] is a[p], p
    assert (bound["cmp_ratio"], bound["coff"], bound["cache_mode"]) == kw["scenario"][:2] + (kw["cache_mode"],)
    for p in ("state_block_table", "cu_seqlens", "seqused", "start_pos"):
        assert (bound[p] is None) is (a[p] is None), p
        if a[p] is not None:
            assert bound[p].dtype == torch.int32 and torch.equal(bound[p].long(), a[p].long()), p
    assert (bound["cu_seqlens"] is None) is (kw["layout"] == "BSH")
    assert (bound["seqused"] is None) is (kw["seqused"] is None)
    assert (bound["start_pos"] is None) is kw["no_start_pos"]
    cmp_kv = torch.zeros(2, dtype=torch.bfloat16)
    got = call.unpack(cmp_kv)  # the op returns cmp_kv alone; the state was written in place
    assert got[0] is cmp_kv and got[1] is a["state_cache"]


def test_compressor_schema_declares_the_state_in_place():
    """Read by hand from cannmirror/ops-transformer@25fb6b9 torch_extension/cann_ops_transformer/ops/compressor.py."""
    rec = signatures.record(mapping.CMP_OP)
    assert rec["source"]["commit"].startswith("25fb6b9") and rec["returns"] == ["Tensor"]
    p = {q["name"]: q for q in rec["params"]}
    assert [n for n, q in p.items() if q["kind"] == "positional"] == ["x", "wkv", "wgate", "state_cache", "ape",
                                                                        "cmp_ratio"]
    assert p["state_cache"]["type"] == "Tensor(a!)"
    assert {n: p[n]["default"] for n in ("cmp_ratio", "coff", "cache_mode")} == dict(cmp_ratio=4, coff=1, cache_mode=1)


def test_compressor_exact_precision_is_refused_by_the_npu_limits():
    a = _cmp_args()
    lim = device.backend_limits("compressor", chip="A3", custom_ops=frozenset())
    assert [c.id for c in lim if c.check(Args(a))] == []
    assert [c.id for c in lim if c.check(Args({**a, "precision": "exact"}))] == ["npu.compressor.precision"]


@pytest.mark.parametrize("kw", _CMP_VARIANTS[::3], ids=["-".join(str(v) for v in kw.values()) for kw in _CMP_VARIANTS[::3]])
def test_quant_compressor_mapping_binds_passes_every_value_and_views_the_codes(kw):
    a = _cmp_args(quant=True, **kw)  # the HiFloat8 codes as int8 bytes (_torch_args), as a caller may hold them
    call = mapping.map_call("quant_compressor", a, NpuContext(chip="950"))
    assert call.target == mapping.QCMP_OP
    _assert_binds(call)
    bound = signatures.signature(mapping.QCMP_OP).bind(*call.args, **call.kwargs).arguments
    assert set(bound) == {p["name"] for p in signatures.record(mapping.QCMP_OP)["params"]}
    for p in ("x", "wkv", "wgate"):  # uint8 views of the caller's bytes
        assert bound[p].dtype == torch.uint8 and _same_memory(bound[p], a[p]), p
    for p in ("state_cache", "ape", "x_descale", "wkv_descale", "wgate_descale"):
        assert bound[p] is a[p], p
    assert (bound["quant_mode"], bound["cmp_ratio"], bound["coff"], bound["cache_mode"]) == \
        (1,) + kw["scenario"][:2] + (kw["cache_mode"],)
    for p in ("state_block_table", "cu_seqlens", "seqused", "start_pos"):
        assert (bound[p] is None) is (a[p] is None), p
        if a[p] is not None:
            assert bound[p].dtype == torch.int32 and torch.equal(bound[p].long(), a[p].long()), p
    cmp_kv = torch.zeros(2, dtype=torch.bfloat16)
    got = call.unpack(cmp_kv)
    assert got[0] is cmp_kv and got[1] is a["state_cache"]


def test_quant_compressor_schema_is_the_upstream_packages():
    """Read by hand from hicann/ops-transformer@3d7eca4 torch_extension/cann_ops_transformer/ops/quant_compressor.py
    (the file is not in the cannmirror snapshot the other package schemas come from)."""
    rec = signatures.record(mapping.QCMP_OP)
    assert rec["source"]["repo"] == "hicann/ops-transformer" and rec["source"]["commit"].startswith("3d7eca4")
    assert rec["source"]["line"] == 38 and rec["returns"] == ["Tensor"]
    p = {q["name"]: q for q in rec["params"]}
    assert [n for n, q in p.items() if q["kind"] == "positional"] == ["x", "wkv", "wgate", "state_cache", "ape",
                                                                        "quant_mode", "cmp_ratio"]
    assert "default" not in p["quant_mode"] and "default" not in p["cmp_ratio"]
    assert p["state_cache"]["type"] == "Tensor(a!)"
    assert [p[n]["type"] for n in ("x_descale", "wkv_descale", "wgate_descale")] == ["Tensor?"] * 3
    assert (p["coff"]["default"], p["cache_mode"]["default"]) == (1, 1)


def test_quant_compressor_exact_precision_is_refused_by_the_npu_limits():
    a = _cmp_args(quant=True)
    lim = device.backend_limits("quant_compressor", chip="950", custom_ops=frozenset())
    assert [c.id for c in lim if c.check(Args(a))] == []
    assert [c.id for c in lim if c.check(Args({**a, "precision": "exact"}))] == ["npu.quant_compressor.precision"]


def test_quant_sparse_flash_mla_schema_is_the_upstream_packages():
    """Read by hand from hicann/ops-transformer@2492330 torch_extension/cann_ops_transformer/ops/
    quant_sparse_flash_mla.py (the same schemas as at 97deb42; the file is not in the cannmirror snapshot)."""
    for t, line in ((mapping.QS_OP, 40), (mapping.QS_META_OP, 31)):
        src = signatures.record(t)["source"]
        assert (src["repo"], src["commit"][:7], src["line"]) == ("hicann/ops-transformer", "2492330", line)
    p = {q["name"]: q for q in signatures.record(mapping.QS_OP)["params"]}
    assert [n for n, q in p.items() if q["kind"] == "positional"] == ["q"]
    assert {n: p[n]["default"] for n in ("quant_mode", "softmax_scale", "cmp_ratio", "ori_win_left",
                                          "topk_value_mode")} == dict(quant_mode=None, softmax_scale=None,
                                                                      cmp_ratio=None, ori_win_left=-1,
                                                                      topk_value_mode=1)
    assert [p[n]["type"] for n in ("q_descale", "ori_kv_descale", "cmp_kv_descale")] == ["Tensor?"] * 3
    assert signatures.record(mapping.QS_OP)["returns"] == ["Tensor", "Tensor"]
    m = {q["name"]: q for q in signatures.record(mapping.QS_META_OP)["params"]}
    assert [n for n, q in m.items() if q["kind"] == "positional"] == ["num_heads_q", "num_heads_kv", "head_dim",
                                                                        "quant_mode"]
    assert "rope_head_dim" not in m and all(q["default"] is None for q in m.values() if q["kind"] == "keyword_only")


def test_quant_sparse_flash_mla_exact_precision_is_refused_by_the_npu_limits():
    a = _v4_args("quant_sparse_flash_mla")
    lim = device.backend_limits("quant_sparse_flash_mla", chip="950", custom_ops=frozenset())
    assert [c.id for c in lim if c.check(Args(a))] == []
    assert [c.id for c in lim if c.check(Args({**a, "precision": "exact"}))] == [
        "npu.quant_sparse_flash_mla.precision"]


# ------------------------------------------------------------------------------------------ vllm_compressor

_VCMP_CTX = NpuContext(chip="A3", custom_ops=frozenset({mapping.VCMP_CUSTOM_NAME}))


def _vcmp_args(**kw):
    from qsfa._dispatch import operators
    from qsfa.ops.vllm_compressor import vllm_compressor_case

    case = dict(vllm_compressor_case(**kw), precision="faithful")
    case.setdefault("cu_seqlens", None)
    case.setdefault("seqused", None)
    return _torch_args(dict(operators()["vllm_compressor"].contract.validate(case, chip=kw.get("chip", "A3"))))


_VCMP_VARIANTS = [dict(scenario=(4, 2, 128), layout="TH", chip="A3", rotary_mode=2),
                  dict(scenario=(128, 1, 512), layout="BSH", chip="950", rotary_mode=1, cache_mode=2),
                  dict(scenario=(4, 2, 512), layout="TH", chip="950", rotary_mode=1, seqused=(4, 1))]


@pytest.mark.parametrize("kw", _VCMP_VARIANTS, ids=["-".join(str(v) for v in kw.values()) for kw in _VCMP_VARIANTS])
def test_vllm_compressor_mapping_binds_every_value_in_the_schemas_order(kw):
    a = _vcmp_args(**kw)
    call = mapping.map_call("vllm_compressor", a, NpuContext(chip=kw["chip"],
                                                             custom_ops=frozenset({mapping.VCMP_CUSTOM_NAME})))
    assert call.target == mapping.VCMP_CUSTOM_OP == "torch.ops._C_ascend.compressor"
    _assert_binds(call)
    rec = signatures.record(mapping.VCMP_CUSTOM_OP)
    names = [p["name"] for p in rec["params"]]
    assert len(call.args) == len(names) and call.kwargs == {}  # all positional, none left to a default
    bound = dict(zip(names, call.args))
    for p in ("x", "wkv", "wgate", "state_cache", "ape", "norm_weight", "rope_sin", "rope_cos"):
        assert bound[p] is a[p], p
    for p in ("state_block_table", "cu_seqlens", "seqused", "start_pos"):
        assert (bound[p] is None) is (a[p] is None), p
        if a[p] is not None:
            assert bound[p].dtype == torch.int32 and torch.equal(bound[p].long(), a[p].long()), p
    assert [bound[p] for p in ("rope_head_dim", "cmp_ratio", "coff", "rotary_mode", "cache_mode")] == \
        [64, kw["scenario"][0], kw["scenario"][1], kw["rotary_mode"], kw.get("cache_mode", 1)]
    assert bound["norm_eps"] == pytest.approx(1e-6) and isinstance(bound["norm_eps"], float)
    # the op returns cmp_kv alone (state in place); the rows no group fills come back zero, as the reference's
    from qsfa.reference.vllm_compressor import real_rows
    host = {k: (None if a[k] is None else a[k].numpy()) for k in ("cu_seqlens", "seqused", "start_pos")}
    mask = real_rows(tuple(a["x"].shape), host["cu_seqlens"], host["seqused"], host["start_pos"], kw["scenario"][0])
    cmp_kv = torch.full(tuple(a["rope_sin"].shape[:-1]) + (a["norm_weight"].shape[0],), 7.0, dtype=torch.bfloat16)
    got = call.unpack(cmp_kv)
    assert got[0] is cmp_kv and got[1] is a["state_cache"]
    assert (~mask).any() and bool((cmp_kv[torch.from_numpy(~mask)] == 0).all())
    assert bool((cmp_kv[torch.from_numpy(mask)] == 7.0).all())


def test_vllm_compressor_schema_is_the_bindings():
    """Read by hand from vllm-project/vllm-ascend@182b75e csrc/torch_binding.cpp l.2226-2234."""
    rec = signatures.record(mapping.VCMP_CUSTOM_OP)
    assert (rec["source"]["repo"], rec["source"]["commit"][:7], rec["source"]["line"]) == \
        ("vllm-project/vllm-ascend", "182b75e", 2226)
    assert rec["returns"] == ["Tensor"]
    p = {q["name"]: q for q in rec["params"]}
    assert list(p) == ["x", "wkv", "wgate", "state_cache", "ape", "norm_weight", "rope_sin", "rope_cos",
                       "state_block_table", "cu_seqlens", "seqused", "start_pos", "rope_head_dim", "cmp_ratio", "coff",
                       "norm_eps", "rotary_mode", "cache_mode"]
    assert all(q["kind"] == "positional" and "default" not in q for q in p.values())
    assert p["state_cache"]["type"] == "Tensor(a!)" and p["norm_eps"]["type"] == "float"
    assert [p[n]["type"] for n in ("state_block_table", "cu_seqlens", "seqused", "start_pos")] == ["Tensor?"] * 4
    # the front door takes the same names in the same order
    import inspect

    import qsfa
    front = [n for n, q in inspect.signature(qsfa.vllm_compressor).parameters.items()
             if q.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert front == list(p)


def test_vllm_compressor_needs_the_custom_op_and_faithful_precision():
    a = _vcmp_args()
    with pytest.raises(ValueError, match="torch.ops._C_ascend.compressor, which is not loaded"):
        mapping.map_call("vllm_compressor", a, NpuContext(chip="A3"))
    assert _limits_fire("vllm_compressor", a, NpuContext(chip="A3")) == ["npu.vllm_compressor.needs_custom_op"]
    assert _limits_fire("vllm_compressor", a, _VCMP_CTX) == []
    assert _limits_fire("vllm_compressor", {**a, "precision": "exact"}, _VCMP_CTX) == ["npu.vllm_compressor.precision"]

