"""Per-chip numerics (qsfa.chips, docs/numerics/chips.md): one hand-built tie case per table cell.

Each case makes the exact value at a rounding point a midpoint of the target format, so the two rounding
modes give different results, and asserts every chip's result. Expected values are written out by hand
(derivations in the comments), never computed by the code under test.
"""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa import chips
from qsfa._errors import InvalidArgument
from qsfa.reference import attention as ref
from qsfa.reference import formats as F
from qsfa.reference.packing import pack_rows

BF16 = np.dtype(ml_dtypes.bfloat16)
QDT = {"bfloat16": BF16, "float16": np.dtype(np.float16)}
ALL = (None, "A2", "A3", "950")

# fp32 x with RN32(exp(x)) a midpoint of the query dtype (found by search; checked in test_tie_inputs):
X_BF16_TIE = -0.8793826  # exp -> 0x3ED48000 = 0.4150390625, halfway between bf16 0x3ED4 and 0x3ED5
X_FP16_TIE = -0.28735662  # exp -> 0x3F401000 = 0.750244140625, halfway between fp16 0x3A00 and 0x3A01


def test_tie_inputs():
    e = ref.exp_f32(np.array([X_BF16_TIE, X_FP16_TIE], np.float32)).view(np.uint32)
    assert e.tolist() == [0x3ED48000, 0x3F401000]


def _qsfa_args(qdtype, codes, scales, q_lane0, scale_value):
    """One query row (BSND, Q_N 1) selecting two packed tokens; codes int8 [2, 512], scales fp32 [2, 4]."""
    q = np.zeros((1, 1, 1, 576), QDT[qdtype])
    q[..., 0] = q_lane0
    rows = pack_rows(np.asarray(codes, np.int8).reshape(1, 2, 1, 512), np.zeros((1, 2, 1, 64), QDT[qdtype]),
                     np.asarray(scales, np.float32).reshape(1, 2, 1, 4)).view(np.int8)
    idx = np.array([0, 1], np.int32).reshape(1, 1, 1, 2)
    return dict(query=q, key=rows, value=rows, sparse_indices=idx, scale_value=float(scale_value))


def _qsfa_lane(args, lane, **kw):
    out = qsfa.kv_quant_sparse_flash_attention(**args, **kw)[0]
    return float(np.asarray(out, np.float32)[0, 0, 0, lane])


def _ties_p(qdtype):
    """Token 0: K = 0 (score 0 = the max); token 1: K lane 0 = 1 (score = scale_value = x), V lane 1 = 100.
    e = (1, RN32(exp x)) with exp x at a midpoint of the query dtype; out lane 1 = RN32(P_1 * 100) / (1 + e_1)."""
    codes = np.zeros((2, 512), np.int8)
    codes[1, 0], codes[1, 1] = 1, 100
    scales = np.ones((2, 4), np.float32)
    x = X_BF16_TIE if qdtype == "bfloat16" else X_FP16_TIE
    return _qsfa_args(qdtype, codes, scales, 1.0, x)


# P: A2/A3 CAST_ROUND, 950 CAST_ROUND (both dtypes).
#   bf16: P_1 = 0x3ED5 = 0.416015625 (ROUND; RINT: 0x3ED4 = 0.4140625); 41.6015625 / 1.4150390625 = 29.3996 -> 29.375
#         (RINT: 41.40625 / 1.4150390625 = 29.2616 -> 29.25).
#   fp16: P_1 = 0.75048828125 (ROUND; RINT 0.75); 75.048828125 / 1.750244140625 = 42.8797 -> 42.875 (fp16 ulp 1/32)
#         (RINT: 75 / 1.750244140625 = 42.8512 -> 42.84375).
P_EXPECT = {"bfloat16": (29.375, 29.25), "float16": (42.875, 42.84375)}


@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("chip", ALL)
def test_qsfa_probability_rounding(qdtype, chip):
    args = _ties_p(qdtype)
    want_round, want_rint = P_EXPECT[qdtype]
    assert _qsfa_lane(args, 1, chip=chip) == want_round
    assert ref.kv_quant_sparse_flash_attention(**args, p_rounding="rint")[0].astype(np.float32)[0, 0, 0, 1] == want_rint


# K dequantised to the query dtype: one token, code 1 x tile scale s, P = 1, out = K exactly.
#   fp16: s = 2049 (midpoint of fp16 2048 / 2050): A2/A3 CAST_ROUND -> 2050, 950 CAST_RINT -> 2048.
#   bf16: s = 257 (midpoint of bf16 256 / 258): every chip CAST_RINT -> 256 (ROUND would give 258).
K_EXPECT = {"float16": (2049.0, {"A2": 2050.0, "A3": 2050.0, "950": 2048.0, None: 2050.0}),
            "bfloat16": (257.0, {"A2": 256.0, "A3": 256.0, "950": 256.0, None: 256.0})}


def _ties_k(qdtype):
    """Token 0 alone (index -1 ends the row): code 1 at lane 5 x tile scale s; q = 0, so P = 1 and out = K."""
    codes = np.zeros((2, 512), np.int8)
    codes[0, 5] = 1
    scales = np.ones((2, 4), np.float32)
    scales[0, 0] = K_EXPECT[qdtype][0]
    args = _qsfa_args(qdtype, codes, scales, 0.0, 1.0)
    args["sparse_indices"] = np.array([0, -1], np.int32).reshape(1, 1, 1, 2)
    return args


@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("chip", ALL)
def test_qsfa_k_dequant_rounding(qdtype, chip):
    assert _qsfa_lane(_ties_k(qdtype), 5, chip=chip) == K_EXPECT[qdtype][1][chip]


# Output: two tokens with equal scores (q = 0): o = (v0 + v1) / 2, v exactly representable, o a midpoint.
#   bf16: v = 256, 258 -> 257: A2/A3 CAST_RINT -> 256, 950 CAST_ROUND -> 258.
#   fp16: v = 2048, 2050 -> 2049: A2/A3 CAST_ROUND -> 2050, 950 CAST_ROUND -> 2050 (RINT would give 2048).
OUT_EXPECT = {"bfloat16": ((256.0, 258.0), {"A2": 256.0, "A3": 256.0, "950": 258.0, None: 256.0}),
              "float16": ((2048.0, 2050.0), {"A2": 2050.0, "A3": 2050.0, "950": 2050.0, None: 2050.0})}


def _ties_out(qdtype):
    """Both tokens: code 1 at lane 7 x tile scales v0 / v1; q = 0 (equal scores), so out lane 7 = (v0 + v1) / 2."""
    codes = np.zeros((2, 512), np.int8)
    codes[:, 7] = 1
    scales = np.ones((2, 4), np.float32)
    scales[:, 0] = OUT_EXPECT[qdtype][0]
    return _qsfa_args(qdtype, codes, scales, 0.0, 1.0)


@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("chip", ALL)
def test_qsfa_output_rounding(qdtype, chip):
    assert _qsfa_lane(_ties_out(qdtype), 7, chip=chip) == OUT_EXPECT[qdtype][1][chip]


def _sfa_args(qdtype, k_lane0, v_rows, scale_value):
    """SFA: one query row (lane 0 = 1), two float KV tokens (K lane 0 given, V rows given), Q_N 1."""
    q = np.zeros((1, 1, 1, 512), QDT[qdtype])
    q[..., 0] = 1
    k = np.zeros((1, 2, 1, 512), QDT[qdtype])
    k[0, :, 0, 0] = k_lane0
    v = np.zeros((1, 2, 1, 512), QDT[qdtype])
    v[0, :, 0, :len(v_rows[0])] = np.asarray(v_rows)
    idx = np.array([0, 1], np.int32).reshape(1, 1, 1, 2)
    return dict(query=q, key=k, value=v, sparse_indices=idx, scale_value=float(scale_value))


@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("chip", ALL)
def test_sfa_probability_and_output_rounding(qdtype, chip):
    # P: the QSFA construction with float K/V (token 1: K lane 0 = 1, V lane 1 = 100).
    x = X_BF16_TIE if qdtype == "bfloat16" else X_FP16_TIE
    args = _sfa_args(qdtype, (0, 1), [[0, 0], [0, 100]], x)
    out = np.asarray(qsfa.sparse_flash_attention(**args, chip=chip)[0], np.float32)
    assert out[0, 0, 0, 1] == P_EXPECT[qdtype][0]
    # output: equal scores (K = 0), V lane 0 = v0 / v1.
    (v0, v1), want = OUT_EXPECT[qdtype]
    args = _sfa_args(qdtype, (0, 0), [[v0], [v1]], 1.0)
    out = np.asarray(qsfa.sparse_flash_attention(**args, chip=chip)[0], np.float32)
    assert out[0, 0, 0, 0] == want[chip]


# KvRmsNormRopeCache HiFloat8 cache (950 only; A2/A3 reject it): y = v * c_kv_scale = 1.25 * 32768 = 40960, the
# first value past HiFloat8's range under its ties-away rounding (the largest finite value is 32768 with step
# 8192 below it; qsfa.formats rounds [36864, 40960) to 32768 and 40960 up to the next step, out of range).
#   950 (SatMode::NO_SAT): +Inf (code 0x6F); the saturating cast: 32768 (code 0x6E).
def test_krr_hifloat8_overflow():
    from qsfa.reference.kv_rmsnorm_rope_cache import static_quant

    y = np.array([1.25], np.float32).reshape(1, 1, 1, 1)
    sat = static_quant(y, "hifloat8", np.float32([32768.0]))
    inf = static_quant(y, "hifloat8", np.float32([32768.0]), hifloat8_overflow="inf")
    assert sat.tolist() == [[[[0x6E]]]] and inf.tolist() == [[[[0x6F]]]]
    assert F.decode(sat.reshape(-1), "hifloat8")[0] == 32768.0 and F.decode(inf.reshape(-1), "hifloat8")[0] == np.inf
    # just below the midpoint both casts give the largest finite value
    below = np.nextafter(np.float32(40960.0), np.float32(0)).reshape(1, 1, 1, 1)
    assert static_quant(below, "hifloat8", np.float32([1.0]), hifloat8_overflow="inf").item() == 0x6E
    assert chips.KRR_HIFLOAT8_OVERFLOW == {"A2": "saturate", "A3": "saturate", "950": "inf"}


def test_krr_front_door_chip_numerics():
    """V1 with a HiFloat8 k cache (950 only): the front door with chip None resolves to 950 (the call breaks the
    A2/A3 int8-only rule) and writes +Inf for the boundary value; chip="A2" is rejected by that rule."""
    assert qsfa.resolve_chip("kv_rmsnorm_rope_cache", **_krr_v1_hif8()) == "950"
    for chip in (None, "950"):
        a = _krr_v1_hif8()
        qsfa.kv_rmsnorm_rope_cache(**a, chip=chip)
        assert a["k_cache"][0, 0, 0, 0] == 0x6F  # 40960 -> +Inf (NO_SAT)
        assert a["k_cache"][0, 0, 0, 1] == 0x6E  # 32768 stays the largest finite value
    with pytest.raises(qsfa.InvalidDtype, match="A2/A3 quantise to int8 only"):
        qsfa.kv_rmsnorm_rope_cache(**_krr_v1_hif8(), chip="A2")


def _krr_v1_hif8():
    """KvRmsNormRopeCache V1, Norm mode, Bkv = N = Skv = 1, Dv = Dk = 64. RoPE with cos = 1, sin = 0 is the
    interleave permutation cat(x[0::2], x[1::2]) (exact), so k_rope lanes 0 and 1 are kv rope lanes 0 and 2;
    times k_rope_scale 32768 they are 1.25 * 32768 = 40960 and 32768."""
    dv = dk = 64
    kv = np.ones((1, 1, 1, dv + dk), BF16)
    kv[..., dv], kv[..., dv + 2] = 1.25, 1.0
    return dict(kv=kv, gamma=np.ones(dv, BF16), cos=np.ones((1, 1, 1, dk), BF16), sin=np.zeros((1, 1, 1, dk), BF16),
                index=np.zeros((1, 1), np.int64), k_cache=np.zeros((1, 1, 2, dk), np.uint8),
                ckv_cache=np.zeros((1, 1, 2, dv), BF16), k_rope_scale=np.float32([32768.0]),
                k_cache_dtype="hifloat8")


# ------------------------------------------------------------------------------------------------------------
# the chip parameter itself


def test_every_front_door_takes_chip():
    for name, op in qsfa.operators().items():
        sig = inspect.signature(chips.front_door(name))
        p = sig.parameters.get("chip")
        assert p is not None and p.default is None and p.kind == p.KEYWORD_ONLY, name
    assert "chip" in inspect.signature(qsfa.attention).parameters


def test_bad_chip_is_rejected():
    args = _ties_p("bfloat16")
    with pytest.raises(InvalidArgument, match="chip"):
        qsfa.kv_quant_sparse_flash_attention(**args, chip="910B")


def test_explicit_chip_selects_its_constraints():
    from qsfa.ops.attention import qsfa_case

    a = qsfa_case(n_heads=48)  # Q_N = 48: Ascend 950 only
    assert qsfa.resolve_chip("kv_quant_sparse_flash_attention", **a) == "950"
    qsfa.kv_quant_sparse_flash_attention(**a, chip="950")
    qsfa.kv_quant_sparse_flash_attention(**a)  # the reference accepts the union
    for chip in ("A2", "A3"):
        with pytest.raises(InvalidArgument, match="do not support Q_N = 48") as e:
            qsfa.kv_quant_sparse_flash_attention(**a, chip=chip)
        assert e.value.constraint_id == "kv_quant_sparse_flash_attention.a2a3_query_heads"
    b = qsfa_case(sparse_block_size=2)  # A2/A3 only
    assert qsfa.resolve_chip("kv_quant_sparse_flash_attention", **b) == "A2"
    assert qsfa.resolve_chip("kv_quant_sparse_flash_attention", **b, chip="A3") == "A3"
    with pytest.raises(InvalidArgument, match="supports only sparse_block_size 1") as e:
        qsfa.kv_quant_sparse_flash_attention(**b, chip="950")
    assert e.value.constraint_id == "kv_quant_sparse_flash_attention.950_sparse_block_size"


def test_chip_none_follows_the_resolved_chip():
    """A 950-only call (FP8 KV) without a chip gets the 950's numerics: the output tie rounds up (ROUND)."""
    args = _ties_out("bfloat16")
    fp8 = args["key"].view(np.uint8).copy()
    one = np.float32(1).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    fp8[..., 7] = one  # code 1.0 in FP8 E4M3FN
    args.update(key=fp8.view(ml_dtypes.float8_e4m3fn), value=fp8.view(ml_dtypes.float8_e4m3fn))
    assert qsfa.resolve_chip("kv_quant_sparse_flash_attention", **args, key_dtype="float8_e4m3fn") == "950"
    assert _qsfa_lane(args, 7, key_dtype="float8_e4m3fn") == 258.0
    assert _qsfa_lane(args, 7, key_dtype="float8_e4m3fn", chip="950") == 258.0


def test_reference_defaults_are_the_a2a3_modes():
    for qd in ("bfloat16", "float16"):
        assert chips.attention_rounding("A2", qd) == {f"{p}_rounding": ref.DEFAULT_ROUNDING[p][qd]
                                                     for p in ("k", "p", "out")}
        assert chips.ATTENTION_ROUNDING["A3"] == chips.ATTENTION_ROUNDING["A2"]


@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["rint", "round"])
def test_round_q16_matches_formats(qdtype, mode):
    """Both modes of both dtypes against formats.round_to on every midpoint of a range and random values."""
    rng = np.random.default_rng(0)
    rand = rng.standard_normal(20000).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, 20000)
    grid = np.arange(1, 5000, dtype=np.float32)
    base = np.asarray(F.round_to(rand, qdtype), np.float32)
    mids = np.concatenate([(grid[:-1] + grid[1:]) / 2, base * (1 + np.float32(2.0) ** (-9 if qdtype == "bfloat16"
                                                                                      else -12))])
    x = np.concatenate([rand, mids, -mids, np.float32([0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38])])
    got = ref.round_q16(x, qdtype, mode).astype(np.float32)
    want = np.asarray(F.round_to(x, qdtype, rounding=mode), np.float32)
    assert got.tobytes() == want.tobytes()


class _FakeDevice(qsfa.Backend):
    """A backend standing for hardware of one chip (as the npu backend is): it rounds by itself."""

    name = "fake_chip_device"
    array_kind = "numpy"
    models_numerics = False

    def __init__(self, chip):
        self._chip = chip

    def chip(self):
        return self._chip


class _FakeSoftware(_FakeDevice):
    name = "fake_chip_software"
    models_numerics = True


@pytest.fixture
def fake_backends():
    seen = {}

    def impl(name):
        def f(**kw):
            seen[name] = kw
            seen.setdefault(name + "_all", []).append(kw)
            return ref.kv_quant_sparse_flash_attention(**kw)
        return f

    qsfa.register_backend(_FakeDevice("950"))
    qsfa.register_backend(_FakeSoftware(None))
    qsfa.register_impl("fake_chip_device", "kv_quant_sparse_flash_attention", impl("device"))
    qsfa.register_impl("fake_chip_software", "kv_quant_sparse_flash_attention", impl("software"))
    yield seen
    qsfa.unregister_backend("fake_chip_device")
    qsfa.unregister_backend("fake_chip_software")


def test_device_backend_uses_its_chip(fake_backends):
    args = _ties_out("bfloat16")
    qsfa.kv_quant_sparse_flash_attention(**args, backend="fake_chip_device")
    qsfa.kv_quant_sparse_flash_attention(**args, backend="fake_chip_device", chip="950")
    assert not {"k_rounding", "p_rounding", "out_rounding"} & set(fake_backends["device"])  # hardware rounds
    with pytest.raises(InvalidArgument, match="runs on its device's chip '950'"):
        qsfa.kv_quant_sparse_flash_attention(**args, backend="fake_chip_device", chip="A2")
    assert qsfa.resolve_chip("kv_quant_sparse_flash_attention", **args, backend="fake_chip_device") == "950"
    # the device's chip selects its constraints: sparse_block_size 2 is not a 950 value
    with pytest.raises(InvalidArgument, match="supports only sparse_block_size 1"):
        qsfa.kv_quant_sparse_flash_attention(**args, sparse_block_size=2, backend="fake_chip_device")


def test_software_backend_gets_the_chips_modes(fake_backends):
    args = _ties_out("float16")
    for chip, k in ((None, "round"), ("A3", "round"), ("950", "rint")):
        qsfa.kv_quant_sparse_flash_attention(**args, backend="fake_chip_software", chip=chip)
        got = fake_backends["software"]
        assert (got["k_rounding"], got["p_rounding"], got["out_rounding"]) == (k, "round", "round")


# ------------------------------------------------------------------------------------------------------------
# dynamic_block_quant: A2/A3 "reciprocal" (x * fp32(fp32(1/amax) * 127), scale amax * fp32(1/127)), 950 "divide"

def test_dynamic_block_quant_order_tie():
    """amax = 7.46875, x = amax / 2: the exact x * 127 / amax is 63.5, a tie. The 950 divides: x / fp32(amax / 127)
    = 63.5 exactly -> RINT 64. A2/A3 multiply by fp32(fp32(1/amax) * 127), which is below 127/amax: 63.499996 -> 63.
    Scales: fp32(amax / 127) = 0x3D70E1C4, fp32(amax * fp32(1/127)) = 0x3D70E1C3 (one ulp below)."""
    x = np.array([[7.46875, 3.734375]], BF16)
    want = {"A2": ([127, 63], 0x3D70E1C3), "A3": ([127, 63], 0x3D70E1C3), "950": ([127, 64], 0x3D70E1C4),
            None: ([127, 63], 0x3D70E1C3)}
    for chip, (codes, scale_bits) in want.items():
        y, s = qsfa.dynamic_block_quant(x, chip=chip)
        assert y.tolist() == [codes] and s.view(np.uint32).tolist() == [[scale_bits]], chip
    # an explicit order overrides the chip's
    y, s = qsfa.dynamic_block_quant(x, chip="A2", scale_order="divide")
    assert y.tolist() == [[127, 64]] and s.view(np.uint32).tolist() == [[0x3D70E1C4]]
    y, s = qsfa.dynamic_block_quant(x, chip="950", scale_order="reciprocal_multiply")
    assert y.tolist() == [[127, 63]] and s.view(np.uint32).tolist() == [[0x3D70E1C4]]


def _op_plugin_calc_base(torch, x):
    """The op-plugin test golden (Ascend/op-plugin test/test_custom_ops/test_npu_dynamic_block_quant.py
    ``calc_base``), the same torch operations, written out for a 2-D input."""
    m, n = x.shape
    pad = (128 - n % 128) % 128
    xp = torch.nn.functional.pad(x, (0, pad), value=0) if pad else x
    xv = xp.view(m, -1, 128)
    amax = xv.abs().float().amax(dim=2).view(m, -1)
    y = (xv * (127.0 / amax.unsqueeze(2))).round()
    y = torch.clamp(y, -127, 127).to(torch.int8).view(m, n + pad)[:, :n]
    return y, amax / 127.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reciprocal_multiply_is_the_op_plugin_golden_bit_for_bit(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 300)) * rng.uniform(0.01, 100, (64, 1))).astype(QDT[dtype])
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)
    gy, gs = _op_plugin_calc_base(torch, tx)
    y, s = qsfa.dynamic_block_quant(x, scale_order="reciprocal_multiply", row_block_size=1, col_block_size=128)
    assert y.tobytes() == gy.numpy().tobytes()
    assert s.tobytes() == gs.numpy().tobytes()
    # the one-rounding "multiply" order misses the golden somewhere on this input (the case is not vacuous)
    y1, _ = qsfa.dynamic_block_quant(x, scale_order="multiply", row_block_size=1, col_block_size=128)
    assert y1.tobytes() != gy.numpy().tobytes()


def test_torch_rtruediv_is_reciprocal_times():
    """The arithmetic the "reciprocal_multiply" order emulates: torch's ``127.0 / t`` = fp32(fp32(1/t) * 127), not
    the correctly rounded quotient (checked on 200k values; about a quarter differ from the quotient)."""
    torch = pytest.importorskip("torch")
    a = np.random.default_rng(1).uniform(1e-3, 1e3, 200000).astype(np.float32)
    got = (127.0 / torch.from_numpy(a)).numpy()
    assert got.tobytes() == ((np.float32(1) / a) * np.float32(127)).astype(np.float32).tobytes()
    assert (got != np.float32(127) / a).mean() > 0.1


def test_conformance_runs_model_the_requested_chip(fake_backends):
    """qsfa conformance --chip: every call (backend and reference) models that chip; a device backend of another
    chip is an error; without --chip a device backend's own chip is used."""
    pytest.importorskip("hypothesis")
    from qsfa.conformance.properties import get
    from qsfa.conformance.runner import run_property

    prop = get("kv_quant_sparse_flash_attention.vs_reference")
    r = run_property(prop, "fake_chip_device", chip="A2", max_examples=2, seed=1)
    assert r.status == "error" and "runs on chip '950'" in r.message
    r = run_property(prop, "fake_chip_software", chip="950", max_examples=3, seed=1)
    assert r.status == "passed" and r.chip == "950", r.message
    calls = fake_backends["software_all"]
    assert calls and all(c["k_rounding"] == "rint" and c["out_rounding"] == "round" for c in calls)
    r = run_property(prop, "fake_chip_device", max_examples=2, seed=1)
    assert r.chip == "950" and r.status == "passed", r.message


# ------------------------------------------------------------------------------------------------------------
# the per-row loop golden of tests/test_attention_support.py (its own table of each chip's modes), for every chip

@pytest.mark.parametrize("chip", ["A2", "A3", "950"])
@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
def test_faithful_matches_the_per_row_golden_of_each_chip(chip, qdtype):
    from test_attention_support import golden_faithful, layout_args, random_case

    case = random_case(np.random.default_rng(11), kv=200, act_kv=[200, 150], act_q=[2, 3], sparse=96, heads=4,
                       qdtype=qdtype, key_fmt="int8")
    args = layout_args(case, "BSND", "PA_BSND", block_size=64)
    out = qsfa.kv_quant_sparse_flash_attention(**args, chip=chip)[0]
    g_out, _, _ = golden_faithful(case, accumulate="float64", chip=chip)
    res = qsfa.compare.assert_close(out.astype(np.float32), g_out.astype(QDT[qdtype]).astype(np.float32),
                                    dtype=qdtype)
    assert res.max_ulp is not None and res.max_ulp <= 2


def test_docs_table_says_what_the_code_does():
    """docs/numerics/chips.md's attention table and qsfa.chips.ATTENTION_ROUNDING agree cell by cell."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "numerics" / "chips.md").read_text()

    def modes(cell):
        m = re.match(r"\s*(bf16 (RINT|ROUND), fp16 (RINT|ROUND)|(RINT|ROUND) for both)", cell)
        assert m, cell
        if m.group(4):
            return {"bfloat16": m.group(4).lower(), "float16": m.group(4).lower()}
        return {"bfloat16": m.group(2).lower(), "float16": m.group(3).lower()}

    rows = {"QSFA K": "k", "QSFA P": "p", "QSFA output": "out", "SFA P": "p", "SFA output": "out"}
    seen = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3:
            key = next((k for k in rows if cells[0] == k or cells[0].startswith(k + ":")), None)
            if key is None:
                continue
            seen.add(key)
            point = rows[key]
            assert modes(cells[1]) == chips.ATTENTION_ROUNDING["A2"][point], key
            assert modes(cells[2]) == chips.ATTENTION_ROUNDING["950"][point], key
    assert seen == set(rows)


def test_attention_front_door_passes_the_chip():
    a = _ties_out("bfloat16")
    for chip, want in (("A2", 256.0), ("950", 258.0)):
        out = qsfa.attention(a["query"][..., :512], a["key"], None, a["sparse_indices"], 1.0,
                             query_rope=a["query"][..., 512:], chip=chip)[0]
        assert float(np.asarray(out, np.float32)[0, 0, 0, 7]) == want


# ------------------------------------------------------------------------------------------------------------
# C8 writers: the chip's npu_dynamic_block_quant order (docs/numerics/chips.md#c8-cache-writers)

def _c8_row(codes, scale_bytes):
    """A 528-byte packed row (rope 0): NoPE codes (tile 0 starts with ``codes``, everything else 0), then the
    four little-endian fp32 scales (tile 0 ``scale_bytes``, the all-zero tiles 1-3 scale 0)."""
    row = np.zeros(528, np.uint8)
    row[:len(codes)] = codes
    row[512:516] = scale_bytes
    return row


def _c8_write(key_dtype, first_two, **kw):
    k_nope = np.zeros((1, 512), BF16)
    k_nope[0, :2] = first_two
    cache = np.full((1, 1, 1, 528), 0x11, np.uint8)
    return qsfa.c8_cache_write(k_nope, None, np.array([0]), cache, key_dtype=key_dtype, **kw)[0, 0, 0]


# int8, amax = 7.46875 (tile 0 = 7.46875, 3.734375, zeros): x * 127 / amax = 63.5 exactly, a tie.
#   A2/A3 ("reciprocal"): multiplier fp32(fp32(1 / 7.46875) * 127) = 17.004183 < 127 / 7.46875 = 17.004184..., so
#   3.734375 * m = 63.499996 -> 63; amax * m = 126.99999 -> 127; scale amax * fp32(1/127) = 0x3D70E1C3.
#   950 ("divide"): s = fp32(7.46875 / 127) = 0x3D70E1C4; 3.734375 / s = 63.5 exactly -> RINT to even 64.
C8_INT8_A2 = _c8_row([127, 63], [0xC3, 0xE1, 0x70, 0x3D])
C8_INT8_950 = _c8_row([127, 64], [0xC4, 0xE1, 0x70, 0x3D])
# FP8 E4M3FN, amax = 1.5 (tile 0 = 1.5, 1.125): x * 448 / amax = 336 exactly, halfway between the codes 0x7A (320)
# and 0x7B (352).
#   950 ("divide"): s = fp32(1.5 / 448) = 0x3B5B6DB7; 1.125 / s = 336.0 -> RNE to the even mantissa 0x7A;
#   1.5 / s = 448 -> 0x7E.
#   "reciprocal": m = fp32(fp32(1 / 1.5) * 448) = 298.66669 > 448 / 1.5, so 1.125 * m = 336.00003 -> 0x7B;
#   1.5 * m = 448.00003, clamped to 448 -> 0x7E; scale 1.5 * fp32(1/448) = 0x3B5B6DB8.
C8_FP8_950 = _c8_row([0x7E, 0x7A], [0xB7, 0x6D, 0x5B, 0x3B])
C8_FP8_RECIPROCAL = _c8_row([0x7E, 0x7B], [0xB8, 0x6D, 0x5B, 0x3B])


def test_c8_cache_write_scale_order_tie_per_chip():
    for chip, want in ((None, C8_INT8_A2), ("A2", C8_INT8_A2), ("A3", C8_INT8_A2), ("950", C8_INT8_950)):
        got = _c8_write("int8", [7.46875, 3.734375], chip=chip)
        assert got.tolist() == want.tolist(), chip
    assert qsfa.resolve_chip("c8_cache_write", np.zeros((1, 512), BF16), None, np.array([0]),
                             np.zeros((1, 1, 1, 528), np.uint8)) == "A2"
    # an explicit order overrides the chip's
    assert _c8_write("int8", [7.46875, 3.734375], chip="A2", scale_order="divide").tolist() == C8_INT8_950.tolist()
    assert _c8_write("int8", [7.46875, 3.734375], chip="950", scale_order="reciprocal").tolist() == C8_INT8_A2.tolist()
    # FP8 is a 950 cache: without chip= the call models the 950 and divides
    for chip in (None, "950"):
        assert _c8_write("float8_e4m3fn", [1.5, 1.125], chip=chip).tolist() == C8_FP8_950.tolist(), chip
    got = _c8_write("float8_e4m3fn", [1.5, 1.125], chip="950", scale_order="reciprocal")
    assert got.tolist() == C8_FP8_RECIPROCAL.tolist()
    with pytest.raises(InvalidArgument, match="Atlas A2/A3 packed caches are int8 only"):
        _c8_write("float8_e4m3fn", [1.5, 1.125], chip="A2")


def test_c8_rmsnorm_rope_cache_takes_the_chips_order():
    """The whole writer passes the chip's order to its quantiser: its default equals the explicit order of the
    chip, on an input where the two orders give different bytes (so the comparison is not vacuous)."""
    rng = np.random.default_rng(3)
    t = 64
    kv = (rng.standard_normal((t, 512)) * 3).astype(BF16)
    gamma = np.ones(512, BF16)

    def write(**kw):
        cache = np.full((1, t, 1, 528), 0x11, np.uint8)
        return qsfa.c8_rmsnorm_rope_cache(kv, gamma, None, None, np.arange(t), cache, rope_head_dim=0, **kw)

    divide, reciprocal = write(scale_order="divide"), write(scale_order="reciprocal")
    assert divide.tobytes() != reciprocal.tobytes()
    for chip in (None, "A2", "A3"):
        assert write(chip=chip).tobytes() == reciprocal.tobytes(), chip
    assert write(chip="950").tobytes() == divide.tobytes()


# ------------------------------------------------------------------------------------------------------------
# DeepSeek-V4 shared-KV attention (docs/numerics/chips.md#deepseek-v4-shared-kv-attention)


def _v4_args(qdtype, k_rows, scale, q_lane0):
    """SWA over two tokens (K = V), two query heads, sinks -inf: valid on every chip."""
    from qsfa.reference.attention import _QDT

    qdt = _QDT[qdtype]
    q = np.zeros((1, 1, 2, 512), np.float32)
    q[..., 0] = q_lane0
    kv = np.zeros((1, 2, 1, 512), np.float32)
    for j, row in enumerate(k_rows):
        for lane, v in row.items():
            kv[0, j, 0, lane] = v
    return dict(ori_kv=kv.astype(qdt), sinks=np.full(2, -np.inf, np.float32), metadata=np.zeros(1024, np.int32),
                softmax_scale=scale, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=0, ori_win_left=127,
                ori_win_right=0), q.astype(qdt)


@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("chip", ["A2", "A3", "950"])
def test_sharedkv_probability_rounding(qdtype, chip):
    """Token 0: K = 0 (score 0, the max); token 1: K lane 0 = 1 (score = softmax_scale = x), lane 1 = 100: the
    QSFA tie with K = V - P_1 is a midpoint of the query dtype and CAST_ROUND rounds it up on every chip."""
    x = X_BF16_TIE if qdtype == "bfloat16" else X_FP16_TIE
    a, q = _v4_args(qdtype, [{}, {0: 1.0, 1: 100.0}], x, 1.0)
    out = qsfa.sparse_flash_mla(q, chip=chip, **a)[0]
    assert float(out.astype(np.float32)[0, 0, 0, 1]) == P_EXPECT[qdtype][0]
    from qsfa.reference.sharedkv import sharedkv_attention

    half_even = sharedkv_attention(q, a["ori_kv"], sinks=a["sinks"], softmax_scale=x, ori_mask_mode=4,
                                   ori_win_left=127, ori_win_right=0, p_rounding="rint")[0]
    assert float(half_even.astype(np.float32)[0, 0, 0, 1]) == P_EXPECT[qdtype][1]


@pytest.mark.parametrize("chip", ["A2", "A3", "950"])
def test_sharedkv_output_rounding(chip):
    """q = 0: P = (1, 1), l = 2, out = (K_0 + K_1) / 2 = 1.00390625 (bf16 midpoint of 1 and 1.0078125):
    A2/A3 bf16 RINT -> 1.0, 950 ROUND -> 1.0078125. fp16: (1 + (1 + 2^-10)) / 2 is the fp16 midpoint 1 + 2^-11:
    ROUND on every chip -> 1 + 2^-10."""
    a, q = _v4_args("bfloat16", [{0: 1.0}, {0: 1.0078125}], 1.0, 0.0)
    out = float(qsfa.sparse_flash_mla(q, chip=chip, **a)[0].astype(np.float32)[0, 0, 0, 0])
    assert out == (1.0078125 if chip == "950" else 1.0)
    a, q = _v4_args("float16", [{0: 1.0}, {0: 1.0 + 2.0 ** -10}], 1.0, 0.0)
    out = float(qsfa.sparse_flash_mla(q, chip=chip, **a)[0].astype(np.float32)[0, 0, 0, 0])
    assert out == 1.0 + 2.0 ** -10


def test_quant_sparse_flash_mla_probability_tie():
    """quant_sparse_flash_mla (950): P = HiFloat8(E * 16) with CAST_ROUND (ties away). q lane 0 = 1, token 0 K = 0
    (score 0, the max), token 1 K lanes 0 and 1 = 1, descales 1, softmax_scale x = fp32(-3.405111312866211):
    exp(x) is exactly 0.033203125, E * 16 = 0.53125, the midpoint of HiFloat8's 0.5 and 0.5625. Ties away: P = 0.5625,
    l = 1.033203125, out lane 1 = bf16(0.5625 / l / 16) = 0x3D0B; ties to even (or truncation) would give 0.5 and
    0x3CF8."""
    from qsfa.reference.formats import encode

    x = float(np.float32(-3.405111312866211))
    q = np.zeros((1, 1, 2, 512), np.float32)
    q[..., 0] = 1.0
    kv = np.zeros((1, 2, 1, 512), np.float32)
    kv[0, 1, 0, :2] = 1.0
    one = np.ones(1, np.float32)
    out = qsfa.quant_sparse_flash_mla(encode(q, "hifloat8"), 1, ori_kv=encode(kv, "hifloat8"), q_descale=one,
                                      ori_kv_descale=one, sinks=np.full(2, -np.inf, np.float32),
                                      metadata=np.zeros(1024, np.int32), softmax_scale=x, ori_mask_mode=4,
                                      ori_win_left=127, ori_win_right=0, chip="950")[0]
    assert out.view(np.uint16)[0, 0, 0, 1] == 0x3D0B
    half_even = np.float32(np.float32(np.float32(0.5) / np.float32(1.033203125)) * np.float32(1 / 16))
    assert (half_even.astype(ml_dtypes.bfloat16).view(np.uint16)) == 0x3CF8


def test_qkv_mrope_int8_k_rounds_twice():
    """qkv_rms_norm_rope_cache_with_k_scale, M-RoPE K (950; hicann/ops-transformer@6c2c05f
    op_kernel/arch35/qkv_rms_norm_rope_cache_with_k_scale_vf.h l.50-62, DynamicQuantD128): y = r / scale goes to
    fp16 with CAST_RINT, then to int8 with CAST_RINT and SAT. amax 127 makes scale exactly 1, so y = r. Ties go to
    even (2.5 -> 2, 1.5 -> 2, 0.5 -> 0, -2.5 -> -2); 3.4995 is 3.5 in fp16 (ulp 2^-9) and then 4, where one rounding
    gives 3; 126.53 is 126.5 in fp16 (ulp 2^-4) and then 126, where one rounding gives 127."""
    from qsfa.reference.qkv_k_scale import quant_per_head_int8

    r = np.zeros((1, 128), np.float32)
    r[0, :8] = [127, 3.4995, 2.5, 1.5, 0.5, -2.5, 126.53, -0.5]
    codes, scale = quant_per_head_int8(r)
    assert scale.tolist() == [1.0]
    assert codes[0, :8].tolist() == [127, 4, 2, 2, 0, -2, 126, 0] and not codes[0, 8:].any()
    assert np.rint(r[0, [1, 6]]).tolist() == [3.0, 127.0]  # what a single rounding would give


def test_qkv_mx_e8m0_scale_is_the_ceiling():
    """qkv_rms_norm_rope_cache_with_k_scale, M-RoPE MX (950; recursion-ascend/ops-transformer@a093e95
    op_kernel/arch35/qkv_rms_norm_rope_cache_with_k_scale_mrope_mx_vf.h, MxQuantCublasScaleD32x4): the E8M0 byte
    is built from amax's bits, ((bits + 0x1FFFFF) >> 23) - 8 above 0x04600001. The tie amax = 448 x 2^k keeps 2^k
    (byte k + 127: the group's amax lands exactly on 448); one ulp more takes 2^(k+1); 300 takes 2^0 where rounding
    log2(300 / 448) = -0.58 to nearest would take 2^-1 and saturate. At or below bits 0x04600001 the byte is 0
    (locked edge: 0x04600001 is one ulp above 448 x 2^-127, so its 2^-127 scale saturates the group's top code)."""
    from qsfa.reference.qkv_k_scale import mx_heads, mx_reciprocal, mx_scale_bytes

    f32 = np.float32
    amax = np.array([448.0, np.nextafter(f32(448), f32(1000)), 300.0, 224.0, 449.0, 448.0 * 2.0 ** -20,
                     0.0, np.inf], np.float32)
    edge = np.array([0x04600000, 0x04600001, 0x04600002], np.uint32).view(np.float32)
    assert mx_scale_bytes(amax).tolist() == [127, 128, 127, 126, 128, 107, 0, 255]
    assert mx_scale_bytes(edge).tolist() == [0, 0, 1]
    assert mx_reciprocal(np.array([127, 128, 0, 247], np.uint8)).tolist() == [1.0, 0.5, 2.0 ** 127, 2.0 ** -120]
    assert mx_scale_bytes(np.array([np.finfo(np.float32).max], np.float32)).tolist() == [247]  # the largest byte
    # through the row path: lanes 14, 8 x 28, 7, 3, 1 | 1 (squares add to 2048: rms exactly 4 with eps 0), gamma 1,
    # cos 1, sin 0; y = x / 4 puts amax 3.5 = 448 x 2^-7 on group 0 (the tie: byte 120, codes y x 2^7 with 3.5 -> 448)
    # and 0.25 on group 1 (2^-10 x 448 = 0.4375 >= 0.25 > 0.21875: byte 117, code 256)
    x = np.zeros((1, 1, 128), np.float32)
    x[0, 0, :33] = [14.0] + [8.0] * 28 + [7.0, 3.0, 1.0, 1.0]
    codes, scales = mx_heads(x.astype(ml_dtypes.bfloat16), np.ones(128, np.float32), np.ones((1, 1, 64), np.float32),
                             np.zeros((1, 1, 64), np.float32), 0.0, False)
    assert scales[0, 0].tolist() == [120, 117, 0, 0]
    vals = codes[0, 0].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert vals[[0, 1, 29, 30, 31, 32]].tolist() == [448.0, 256.0, 224.0, 96.0, 32.0, 256.0] and not vals[33:].any()
