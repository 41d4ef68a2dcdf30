"""vllm_compressor (docs/numerics/compressor.md#vllm_compressor): vLLM-Ascend's compressor = the compressor, then
RMSNorm and RoPE of each compressed row, one RINT cast.

``_norm_rope`` below is an independent per-row model written from the kernel's steps (vllm-project/vllm-ascend@182b75e
csrc/attention/compressor/op_kernel/arch32/rms_norm.h, rope.h; arch35/vf/vf_rms_norm.h, vf_rope.h): Python loops
over fp32 scalars, every fp32 operation as a float64 operation rounded once (exact for + - * / sqrt of fp32
operands), the 64-lane sum exact with fractions, the cast with ml_dtypes. Its input rows come from the compressor's
own independent model (tests/test_compressor.py ``_model`` with ``raw=True``), so nothing here is computed by
qsfa.reference.
"""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import qsfa
from test_compressor import _fold, _inputs, _model

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def _rn32(frac):
    """Round-to-nearest-even fp32 of an exact fraction."""
    f = F32(float(frac))
    cands = sorted({f, np.nextafter(f, F32(np.inf)), np.nextafter(f, F32(-np.inf))}, key=float)
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - frac), int(np.array(c).view(np.uint32)) & 1))
    return F32(best)


def _norm_rope(c, gamma, sin, cos, eps, mode, order, dtype):
    """One compressed fp32 row -> x's dtype (module docstring)."""
    d = len(c)
    sq = [F32(float(v) * float(v)) for v in c]
    lanes = [_fold([sq[b * 64 + j] for b in range(d // 64)], order) for j in range(64)]
    ss = _rn32(sum(Fraction(float(v)) for v in lanes))
    ms = F32(float(ss) * float(F32(1.0 / d)))
    rms = F32(np.sqrt(float(F32(float(ms) + float(F32(eps))))))
    y = [F32(float(F32(float(v) / float(rms))) * float(F32(g))) for v, g in zip(c, gamma)]
    base, rd = d - 64, 64
    r = y[base:]
    if mode == 1:
        rot = [-r[i + rd // 2] if i < rd // 2 else r[i - rd // 2] for i in range(rd)]
    else:
        rot = [-r[i + 1] if i % 2 == 0 else r[i - 1] for i in range(rd)]
    out = y[:base] + [F32(float(F32(float(r[i]) * float(F32(cos[i])))) + float(F32(float(rot[i]) * float(F32(sin[i])))))
                      for i in range(rd)]
    return np.array(out, F32).astype(dtype)


def _tables(rng, rows, dtype=F32):
    ang = rng.uniform(-3.0, 3.0, (rows, 64))
    return np.sin(ang).astype(dtype), np.cos(ang).astype(dtype)


def _args(a, rng, rows, *, chip, mode, rope_dtype=F32, eps=1e-6):
    d = a["wkv"].shape[0] // a["coff"]
    sin, cos = _tables(rng, rows, rope_dtype)
    gamma = (1.0 + 0.1 * rng.standard_normal(d)).astype(F32 if chip == "950" else BF16)
    return dict(a, norm_weight=gamma, rope_sin=sin, rope_cos=cos, seqused=None, rope_head_dim=64, norm_eps=eps,
                rotary_mode=mode, cache_mode=1)


CASES = [  # chip, sum order, (D, r, coff), rotary_mode, rope dtype
    ("A3", "tree", (128, 4, 2), 2, F32),
    ("A3", "tree", (512, 4, 2), 1, BF16),
    ("A2", "tree", (512, 128, 1), 2, BF16),
    ("950", "sequential", (128, 4, 2), 1, F32),
    ("950", "sequential", (512, 4, 2), 2, F32),
    ("950", "sequential", (512, 128, 1), 1, F32),
]


@pytest.mark.parametrize("chip,order,geom,mode,rope_dtype", CASES)
def test_matches_the_independent_per_row_model(chip, order, geom, mode, rope_dtype):
    d, r, cf = geom
    rng = np.random.default_rng(d + r + mode)
    if r == 4:
        lens, starts = (6, 3), (3, 5)
        a = _inputs(rng, d=d, r=r, cf=cf, t=lens, starts=starts)
    else:
        lens, starts = (4,), (126,)
        a = _inputs(rng, d=d, r=r, cf=cf, t=lens, starts=starts, bs=64)
    t = sum(lens)
    rows_n = min(t, t // r + len(lens))
    args = _args(a, rng, rows_n, chip=chip, mode=mode, rope_dtype=rope_dtype)
    st0 = a["state_cache"].copy()
    out, state = qsfa.vllm_compressor(**dict(args, state_cache=st0.copy()), chip=chip)
    base = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
    raw, st_model = _model(a["x"], a["wkv"], a["wgate"], st0, a["ape"], a["state_block_table"], list(lens),
                           list(starts), base, r, cf, order, raw=True)
    flat = [row for rb in raw for row in rb]
    want = np.stack([_norm_rope(c, args["norm_weight"], args["rope_sin"][i], args["rope_cos"][i], 1e-6, mode, order,
                                BF16) for i, c in enumerate(flat)])
    assert out.dtype == BF16 and out.shape == (rows_n, d)
    assert np.array_equal(out[:len(flat)].view(np.uint16), want.view(np.uint16))
    assert not out[len(flat):].view(np.uint16).any()  # padding rows
    assert np.array_equal(state.view(np.uint32), st_model.view(np.uint32))


def test_rotary_modes_differ_and_only_the_last_64_lanes_rotate():
    rng = np.random.default_rng(20)
    a = _inputs(rng, d=128, t=(8,), starts=(0,))
    args = _args(a, rng, 3, chip="A3", mode=1)
    half, _ = qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy()), chip="A3")
    inter, _ = qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy(), rotary_mode=2), chip="A3")
    none, _ = qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy(), rotary_mode=2,
                                          rope_sin=np.zeros_like(args["rope_sin"]),
                                          rope_cos=np.ones_like(args["rope_cos"])), chip="A3")
    assert np.array_equal(half[:2, :64].view(np.uint16), inter[:2, :64].view(np.uint16))
    assert not np.array_equal(half[:2, 64:].view(np.uint16), inter[:2, 64:].view(np.uint16))
    assert np.array_equal(none[:2, :64].view(np.uint16), half[:2, :64].view(np.uint16))  # cos 1, sin 0: no turn


def test_exact_is_float64_and_close_to_faithful():
    rng = np.random.default_rng(21)
    a = _inputs(rng, d=512, t=(9,), starts=(0,))
    args = _args(a, rng, 3, chip="950", mode=2)
    f, _ = qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy()), chip="950")
    e, _ = qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy()), chip="950", precision="exact")
    assert e.dtype == np.float64 and f.dtype == BF16
    assert np.abs(e[:2] - f[:2].astype(np.float64)).max() <= 2.0 ** -7 * np.abs(e[:2]).max()


@pytest.mark.parametrize("chip", ["A3", "950"])
def test_a_request_alone_equals_the_same_request_inside_an_uneven_batch(chip):
    # vLLM-Ascend #9496: cu_seqlens [0, 12, 23]; request 1's rows are 3, 4 of the batch and 0, 1 alone
    rng = np.random.default_rng(22)
    a = _inputs(rng, t=(12, 11), starts=(0, 0), bs=8)
    args = _args(a, rng, min(23, 23 // 4 + 2), chip=chip, mode=2)
    both, st_both = qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy()), chip=chip)
    sin1, cos1 = np.zeros((3, 64), F32), np.zeros((3, 64), F32)
    sin1[:2], cos1[:2] = args["rope_sin"][3:5], args["rope_cos"][3:5]
    alone = dict(args, x=a["x"][12:], cu_seqlens=np.array([0, 11], np.int32), start_pos=np.array([0], np.int32),
                 state_block_table=a["state_block_table"][1:], rope_sin=sin1, rope_cos=cos1,
                 state_cache=a["state_cache"].copy())
    one, st_one = qsfa.vllm_compressor(**alone, chip=chip)
    assert np.array_equal(one[:2].view(np.uint16), both[3:5].view(np.uint16))
    blocks = a["state_block_table"][1]
    assert np.array_equal(st_one[blocks].view(np.uint32), st_both[blocks].view(np.uint32))


@pytest.mark.parametrize("chip,r,cf,d", [("A3", 4, 2, 128), ("950", 4, 2, 512), ("950", 128, 1, 512)])
def test_k_tokens_at_once_equal_k_serial_one_token_calls(chip, r, cf, d):
    # vLLM-Ascend #9111: batched speculative verification carries the same state as serial decoding; a one-token
    # call has one cmp_kv row (min(1, 0 + 1)), holding the group that token completes
    rng = np.random.default_rng(23)
    k, p0 = (5, 6) if r == 4 else (3, 126)
    a = _inputs(rng, d=d, r=r, cf=cf, t=(k,), starts=(p0,), bs=8 if r == 4 else 128)
    n_rows = min(k, k // r + 1)
    args = _args(a, rng, n_rows, chip=chip, mode=1)
    at_once, st_once = qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy()), chip=chip)
    state, rows, done = a["state_cache"].copy(), [], 0
    for i in range(k):
        one = dict(args, x=a["x"][i:i + 1], cu_seqlens=np.array([0, 1], np.int32),
                   start_pos=np.array([p0 + i], np.int32), state_cache=state,
                   rope_sin=args["rope_sin"][[min(done, n_rows - 1)]], rope_cos=args["rope_cos"][[min(done, n_rows - 1)]])
        out, state = qsfa.vllm_compressor(**one, chip=chip)
        if (p0 + i + 1) % r == 0:
            rows.append(out[0])
            done += 1
    assert len(rows) >= 1
    assert np.array_equal(np.stack(rows).view(np.uint16), at_once[:len(rows)].view(np.uint16))
    assert np.array_equal(state.view(np.uint32), st_once.view(np.uint32))


def test_bsh_rows_take_their_own_table_rows():
    rng = np.random.default_rng(24)
    a = _inputs(rng, t=(8, 8), starts=(0, 2))
    args = _args(a, rng, min(16, 16 // 4 + 2), chip="A3", mode=2)
    th, _ = qsfa.vllm_compressor(**dict(args, seqused=np.array([8, 5], np.int32), state_cache=a["state_cache"].copy()),
                                 chip="A3")
    bsh = dict(args, x=a["x"].reshape(2, 8, -1), cu_seqlens=None, seqused=np.array([8, 5], np.int32),
               rope_sin=np.stack([args["rope_sin"][:2], args["rope_sin"][2:4]]),
               rope_cos=np.stack([args["rope_cos"][:2], args["rope_cos"][2:4]]), state_cache=a["state_cache"].copy())
    out, _ = qsfa.vllm_compressor(**bsh, chip="A3")
    assert out.shape == (2, 2, 128)
    # batch 0: groups 0, 1 (TH rows 0, 1); batch 1 (positions 2..6): group 0 (TH row 2, table row [1, 0])
    assert np.array_equal(out[0].view(np.uint16), th[:2].view(np.uint16))
    assert np.array_equal(out[1, 0].view(np.uint16), th[2].view(np.uint16))
    assert not out[1, 1].view(np.uint16).any()


def test_per_chip_rules():
    rng = np.random.default_rng(25)
    a = _inputs(rng, t=(8,), starts=(0,))
    args = _args(a, rng, 3, chip="A3", mode=2)
    qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy()), chip="A2")  # built for ascend910b too
    with pytest.raises(qsfa.InvalidDtype, match="norm_weight.*float32 on Ascend 950"):
        qsfa.vllm_compressor(**dict(args, state_cache=a["state_cache"].copy()), chip="950")
    f32 = dict(args, norm_weight=args["norm_weight"].astype(F32))
    with pytest.raises(qsfa.InvalidDtype, match="norm_weight.*x's dtype on Atlas A2 / A3"):
        qsfa.vllm_compressor(**dict(f32, state_cache=a["state_cache"].copy()), chip="A3")
    bf16_tables = dict(rope_sin=args["rope_sin"].astype(BF16), rope_cos=args["rope_cos"].astype(BF16))
    with pytest.raises(qsfa.InvalidDtype, match="rope_sin.*float32 on Ascend 950"):
        qsfa.vllm_compressor(**dict(args, **bf16_tables, state_cache=a["state_cache"].copy()), chip="950")
    # valid on no chip: a float32 norm_weight (950) with bf16 tables (A2 / A3 only), or a norm in a third dtype
    with pytest.raises(qsfa.InvalidDtype, match="rope_sin.*float32 norm_weight is the Ascend 950's form"):
        qsfa.vllm_compressor(**dict(f32, **bf16_tables, state_cache=a["state_cache"].copy()))
    with pytest.raises(qsfa.InvalidDtype, match="norm_weight, actual: float16 with x bfloat16"):
        qsfa.vllm_compressor(**dict(args, norm_weight=args["norm_weight"].astype(np.float16),
                                    state_cache=a["state_cache"].copy()))
    before = a["state_cache"].copy()
    with pytest.raises(qsfa.InvalidArgument, match=r"rope_sin, actual: \(2, 64\), expected \(3, 64\)"):
        qsfa.vllm_compressor(**dict(args, rope_sin=args["rope_sin"][:2], state_cache=before))
    assert np.array_equal(before, a["state_cache"])
    # the host code does not restrict (cmp_ratio, coff, D) to the three V4 scenarios (DAY0_SCOPE is off)
    b = _inputs(np.random.default_rng(26), d=128, r=8, cf=1, t=(16,), starts=(0,))
    out, _ = qsfa.vllm_compressor(**_args(b, rng, 3, chip="A3", mode=1), chip="A3")
    assert out.shape == (3, 128) and out[:2].view(np.uint16).any() and not out[2].view(np.uint16).any()


def test_golden_set_decode_case_holds_one_row_and_zero_padding(tmp_path):
    """Set vllm-compressor, case vcmp-c4li-decode-950: three one-token requests at positions 3, 5, 0 - only the first
    completes a group (0..3), so cmp_kv [min(3, 3 // 4 + 3), 128] holds one row, then two zero padding rows."""
    from qsfa.cli import main
    from qsfa.golden import load_manifest

    out = tmp_path / "g"
    assert main(["golden", "generate", "--set", "vllm-compressor", "--only", "vcmp-c4li-decode-950", "--out",
                 str(out), "-q"]) == 0
    case = {c["name"]: c for c in load_manifest(out)["cases"]}["vcmp-c4li-decode-950"]
    e = next(e for e in case["arrays"] if e["name"] == "cmp_kv" and e["role"] == "output")
    raw = np.fromfile(out / e["file"], np.uint16).reshape(e["shape"])
    assert raw.shape == (3, 128)
    assert raw[0].any() and not raw[1:].any()
    assert main(["golden", "verify", str(out), "-q"]) == 0
