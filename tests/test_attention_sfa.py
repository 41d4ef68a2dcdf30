"""SFA (float KV), sinks, the ``qsfa.attention`` front door and the QSFA argument errors."""

import math

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa._errors import InvalidArgument, InvalidDtype
from qsfa.ops.attention import QSFA_CONTRACT, qsfa_case
from test_attention_support import BF16, SCALE, golden_exact, layout_args, random_case, selected_tokens


def sfa_from_case(case, *, exact_k=True):
    """SFA arguments holding the case's K NoPE as a bf16 key (exact when the scales make it representable)."""
    kn = case.codes.astype(np.float64) * np.repeat(case.scales.astype(np.float64), 128, axis=-1)
    key = kn.astype(case.q.dtype)
    if exact_k:
        assert np.array_equal(key.astype(np.float64), kn)
    return dict(query=np.ascontiguousarray(case.q[..., :512]), key=key[:, :, None, :], value=None,
                sparse_indices=case.idx[:, :, None, :], scale_value=SCALE,
                query_rope=np.ascontiguousarray(case.q[..., 512:]) if case.rope is not None else None,
                key_rope=case.rope[:, :, None, :] if case.rope is not None else None,
                actual_seq_lengths_query=np.asarray(case.act_q, np.int32),
                actual_seq_lengths_kv=np.asarray(case.act_kv, np.int32))


def pow2_case(seed, **kw):
    rng = np.random.default_rng(seed)
    case = random_case(rng, **kw)
    case.scales[:] = 2.0 ** rng.integers(-6, -2, case.scales.shape)  # code * 2^e is exact in bf16
    return case


@pytest.mark.parametrize("precision", ["faithful", "exact"])
@pytest.mark.parametrize("lse", [False, True])
def test_sfa_equals_qsfa_when_dequantisation_is_exact(precision, lse):
    """Same math, two entry points: QSFA's K = decode * scale is exactly a bf16 value here, so SFA over that
    bf16 K (value = key) must give the same bits."""
    case = pow2_case(1, kv=60, sparse=30, act_kv=[60, 41])
    q_out = qsfa.kv_quant_sparse_flash_attention(**layout_args(case), precision=precision, return_softmax_lse=lse)
    s_out = qsfa.sparse_flash_attention(**sfa_from_case(case), precision=precision, return_softmax_lse=lse)
    for a, b in zip(q_out, s_out):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_sfa_exact_is_dense_float64_and_value_is_used():
    case = pow2_case(2, kv=50, sparse=20)
    args = sfa_from_case(case)
    e = qsfa.sparse_flash_attention(**args, precision="exact", return_softmax_lse=True)
    g_out, g_max, g_sum = golden_exact(case)
    np.testing.assert_allclose(e[0], g_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(e[1][:, 0], g_max, rtol=1e-13, atol=1e-13)
    # a separate value tensor is what the output averages
    rng = np.random.default_rng(3)
    value = rng.uniform(-1, 1, args["key"].shape).astype(BF16)
    ev = qsfa.sparse_flash_attention(**{**args, "value": value}, precision="exact")[0]
    v64 = value[:, :, 0].astype(np.float64)
    k64 = np.concatenate([args["key"][:, :, 0], args["key_rope"][:, :, 0]], axis=-1).astype(np.float64)
    for b in range(2):
        for i in range(case.act_q[b]):
            toks = selected_tokens(case.idx[b, i], 1, 3, i, case.act_q[b], case.act_kv[b])
            s = SCALE * (case.q[b, i].astype(np.float64) @ k64[b, toks].T)
            p = np.exp(s - s.max(-1, keepdims=True))
            np.testing.assert_allclose(ev[b, i], (p / p.sum(-1, keepdims=True)) @ v64[b, toks], rtol=1e-12, atol=1e-13)


def test_sfa_without_rope_and_attention_mode_0():
    case = pow2_case(4, kv=30, sparse=10, rope=0)
    args = sfa_from_case(case)
    args.update(query_rope=None, key_rope=None)
    a = qsfa.sparse_flash_attention(**args)[0]
    b = qsfa.sparse_flash_attention(**args, attention_mode=0)[0]
    assert a.tobytes() == b.tobytes()
    q = qsfa.kv_quant_sparse_flash_attention(**layout_args(case))[0]
    # QSFA rope 0 computes over an internal zero-padded 576-wide K, SFA without rope over 512 columns: the
    # same sums, possibly accumulated in another BLAS order
    qsfa.compare.assert_close(a.astype(np.float32), q.astype(np.float32), dtype="bfloat16")


@pytest.mark.parametrize("includes", [False, True])
def test_sinks(includes):
    case = pow2_case(5, kv=40, sparse=16, heads=4)
    args = sfa_from_case(case)
    sinks = np.float32([-1.0, 0.5, 3.0, 40.0])
    e = qsfa.sparse_flash_attention(**args, precision="exact", return_softmax_lse=True)
    es = qsfa.sparse_flash_attention(**args, precision="exact", return_softmax_lse=True, sinks=sinks,
                                     lse_includes_sink=includes)
    lse = e[1][:, 0] + np.log(e[2][:, 0])  # [B, S, N]
    factor = 1 / (1 + np.exp(sinks.astype(np.float64)[None, None, :] - lse))
    np.testing.assert_allclose(es[0], e[0] * factor[..., None], rtol=1e-12, atol=1e-15)
    assert np.array_equal(es[1], e[1])
    if includes:  # the sink joins the denominator: sum gains exp(sink - max)
        np.testing.assert_allclose(es[2][:, 0], e[2][:, 0] + np.exp(sinks[None, None, :] - e[1][:, 0]), rtol=1e-13)
    else:
        assert np.array_equal(es[2], e[2])
    # a huge sink leaves (almost) nothing; faithful agrees with exact within tolerance
    f = qsfa.sparse_flash_attention(**args, sinks=sinks)[0]
    qsfa.compare.assert_close(f.astype(np.float32), es[0].astype(BF16).astype(np.float32), dtype="bfloat16")
    assert np.abs(f[..., 3, :].astype(np.float32)).max() < 1e-10


def test_sinks_rejected_on_a2_a3():
    args = {**qsfa.ops.attention.sfa_case(), "sinks": np.zeros((1,), np.float32)}
    with pytest.raises(InvalidArgument, match="sinks are supported on Ascend 950 only"):
        qsfa.ops.attention.SFA_CONTRACT.validate(args, chip="A3")
    qsfa.ops.attention.SFA_CONTRACT.validate(args, chip="950")


# ---------------------------------------------------------------------------------------------------
# front door


def test_front_door_routes_by_key_dtype():
    case = pow2_case(7, kv=40, sparse=12)
    qargs = layout_args(case, "TND", "PA_BSND")
    q_only = qargs["query"][..., :512]
    q_rope = qargs["query"][..., 512:]
    common = dict(block_table=qargs["block_table"], actual_seq_lengths_query=qargs["actual_seq_lengths_query"],
                  actual_seq_lengths_kv=qargs["actual_seq_lengths_kv"], layout_query="TND", layout_kv="PA_BSND",
                  return_softmax_lse=True)
    want = qsfa.kv_quant_sparse_flash_attention(**qargs, return_softmax_lse=True)
    got = qsfa.attention(np.ascontiguousarray(q_only), qargs["key"], None, qargs["sparse_indices"], SCALE,
                         query_rope=np.ascontiguousarray(q_rope), **common)
    for a, b in zip(want, got):
        assert a.tobytes() == b.tobytes()
    # an FP8-typed key array goes to QSFA with key_dtype inferred
    fp8 = random_case(np.random.default_rng(8), kv=20, sparse=8, key_fmt="float8_e4m3fn")
    fargs = layout_args(fp8)
    fkey = fargs["key"].view(ml_dtypes.float8_e4m3fn)
    want = qsfa.kv_quant_sparse_flash_attention(**{**fargs, "key": fkey, "value": fkey})[0]
    got = qsfa.attention(fargs["query"], fkey, None, fargs["sparse_indices"], SCALE,
                         actual_seq_lengths_query=fargs["actual_seq_lengths_query"],
                         actual_seq_lengths_kv=fargs["actual_seq_lengths_kv"])[0]
    assert want.tobytes() == got.tobytes()
    # a float key goes to SFA (value None -> V = key)
    sargs = sfa_from_case(case)
    want = qsfa.sparse_flash_attention(**sargs)[0]
    got = qsfa.attention(sargs["query"], sargs["key"], None, sargs["sparse_indices"], SCALE,
                         query_rope=sargs["query_rope"], key_rope=sargs["key_rope"],
                         actual_seq_lengths_query=sargs["actual_seq_lengths_query"],
                         actual_seq_lengths_kv=sargs["actual_seq_lengths_kv"])[0]
    assert want.tobytes() == got.tobytes()


def test_front_door_infers_rope0_and_rejects_misuse():
    case = pow2_case(9, kv=20, sparse=8, rope=0)
    args = layout_args(case)
    assert args["key"].shape[-1] == 528
    want = qsfa.kv_quant_sparse_flash_attention(**args)[0]
    got = qsfa.attention(args["query"], args["key"], None, args["sparse_indices"], SCALE,
                         actual_seq_lengths_query=args["actual_seq_lengths_query"],
                         actual_seq_lengths_kv=args["actual_seq_lengths_kv"])[0]
    assert want.tobytes() == got.tobytes()
    with pytest.raises(InvalidArgument, match="key_rope"):
        qsfa.attention(args["query"], args["key"], None, args["sparse_indices"], SCALE,
                       key_rope=np.zeros((2, 20, 1, 64), BF16))
    with pytest.raises(InvalidDtype, match="Invalid dtype for key"):  # E5M2 is routed to QSFA and rejected
        qsfa.attention(args["query"], args["key"].view(ml_dtypes.float8_e5m2), None, args["sparse_indices"], SCALE)


def test_error_budget_for_sfa_routes_too():
    case = pow2_case(10, kv=30, sparse=10)
    s = sfa_from_case(case)
    d = qsfa.attention_error_budget(s["query"], s["key"], None, s["sparse_indices"], SCALE, query_rope=s["query_rope"],
                                    key_rope=s["key_rope"], actual_seq_lengths_query=s["actual_seq_lengths_query"],
                                    actual_seq_lengths_kv=s["actual_seq_lengths_kv"])
    f = qsfa.sparse_flash_attention(**s)[0].astype(np.float64)
    e = qsfa.sparse_flash_attention(**s, precision="exact")[0]
    assert np.array_equal(d, f - e) and np.abs(d).max() > 0


# ---------------------------------------------------------------------------------------------------
# argument errors


@pytest.mark.parametrize("rope,q_d,kv_d,cid", [
    (-1, 512, 528, "rope_head_dim_value"), (32, 544, 592, "rope_head_dim_value"),
    (128, 640, 784, "rope_head_dim_value"), (0, 576, 528, "query_head_dim"), (0, 512, 656, "key_head_dim"),
    (64, 512, 656, "query_head_dim"), (64, 576, 528, "key_head_dim")])
def test_invalid_rope_query_key_triples(rope, q_d, kv_d, cid):
    """The seven invalid (rope_head_dim, Q_D, KV_D) triples of vllm-ascend's rope0 tests."""
    a = qsfa_case()
    a["query"] = np.zeros(a["query"].shape[:-1] + (q_d,), BF16)
    a["key"] = np.zeros(a["key"].shape[:-1] + (kv_d,), np.int8)
    a["value"] = a["key"]
    a["rope_head_dim"] = rope
    with pytest.raises(InvalidArgument) as ei:
        qsfa.kv_quant_sparse_flash_attention(**a)
    assert ei.value.constraint_id == f"kv_quant_sparse_flash_attention.{cid}"
    assert str(ei.value).startswith("Invalid ") and ", actual: " in str(ei.value) and ", reason: " in str(ei.value)


def test_error_message_wording():
    a = qsfa_case()
    a["rope_head_dim"] = 32
    with pytest.raises(InvalidArgument) as ei:
        qsfa.kv_quant_sparse_flash_attention(**a)
    assert str(ei.value) == "Invalid value for rope_head_dim, actual: 32, reason: must be one of {0, 64}."


@pytest.mark.parametrize("chip,change,cid", [
    ("A2", dict(key_fmt="float8_e4m3fn"), "a2a3_key_dtype"),
    ("A3", dict(n_heads=48), "a2a3_query_heads"),
    ("950", dict(sparse_block_size=2), "950_sparse_block_size"),
])
def test_chip_limits(chip, change, cid):
    a = qsfa_case(**change)
    QSFA_CONTRACT.validate(a)  # the operator itself accepts it (the reference takes the union)
    with pytest.raises(InvalidArgument) as ei:
        QSFA_CONTRACT.validate(a, chip=chip)
    assert ei.value.constraint_id == f"kv_quant_sparse_flash_attention.{cid}"


def test_hifloat8_needs_sparse_size_2048_and_rope_64():
    a = qsfa_case(key_fmt="hifloat8", sparse=2048)
    QSFA_CONTRACT.validate(a, chip="950")
    with pytest.raises(InvalidArgument, match="sparse_size 2048"):
        qsfa.kv_quant_sparse_flash_attention(**qsfa_case(key_fmt="hifloat8"))
    assert math.isfinite(float(qsfa.kv_quant_sparse_flash_attention(**a)[0].astype(np.float32).sum()))


def test_reference_front_door_matches_public():
    """qsfa.reference.attention.attention / attention_error_budget (no validation) route and infer like the
    public front door."""
    from qsfa.reference import attention as ref

    case = pow2_case(11, kv=30, sparse=10)
    a = layout_args(case)
    q, qr = np.ascontiguousarray(a["query"][..., :512]), np.ascontiguousarray(a["query"][..., 512:])
    kw = dict(query_rope=qr, actual_seq_lengths_query=a["actual_seq_lengths_query"],
              actual_seq_lengths_kv=a["actual_seq_lengths_kv"])
    want = qsfa.attention(q, a["key"], None, a["sparse_indices"], SCALE, **kw)[0]
    got = ref.attention(q, a["key"], None, a["sparse_indices"], SCALE, **kw)[0]
    assert want.tobytes() == got.tobytes()
    d_pub = qsfa.attention_error_budget(q, a["key"], None, a["sparse_indices"], SCALE, **kw)
    d_ref = ref.attention_error_budget(q, a["key"], None, a["sparse_indices"], SCALE, **kw)
    assert np.array_equal(d_pub, d_ref) and np.abs(d_pub).max() > 0
