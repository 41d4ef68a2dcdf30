"""qkv_rms_norm_rope_cache_with_k_scale (Ascend 950, RoPE scenario) against a plain per-element model written here
from the kernel's rounding points (cannmirror/ops-transformer@c4f5cf7 op_kernel/arch35/..._vf.h)."""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa._errors import InvalidArgument
from qsfa.ops.qkv_k_scale import qkv_case

F32 = np.float32


def _rn32(terms):
    """Round-to-nearest-even fp32 of the exact sum of float64 ``terms`` (fsum, and an exact sum where the double
    lands on an fp32 midpoint)."""
    f = math.fsum(terms)
    c = F32(f)
    lo, hi = (np.nextafter(c, F32(-np.inf)), c) if float(c) > f else (c, np.nextafter(c, F32(np.inf)))
    if f not in (float(lo), float(hi)) and f - float(lo) == float(hi) - f:  # a midpoint: decide exactly
        s = sum(Fraction(x) for x in terms)
        d_lo, d_hi = s - Fraction(float(lo)), Fraction(float(hi)) - s
        if d_lo != d_hi:
            return lo if d_lo < d_hi else hi
        return lo if int(np.asarray(lo).view(np.uint32)) % 2 == 0 else hi
    return c


def _fp8(x):
    return int(np.asarray(F32(min(max(float(x), -448.0), 448.0))).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _rotated_row(xs, gamma, c, s, rot, eps):
    """One Q / K head through RMSNorm (halves added first), half-split RoPE with lane cosines ``c`` / sines ``s``,
    the bf16 cast and the rotation (each output the fp32 rounding of its exact sum)."""
    sq = [F32(v) * F32(v) for v in xs]
    pairs = [float(F32(sq[d] + sq[d + 64])) for d in range(64)]
    ss = _rn32(pairs)
    rms = np.sqrt(F32(F32(ss * F32(1 / 128)) + eps))
    y = [F32(F32(F32(v) / rms) * F32(g)) for v, g in zip(xs, gamma)]
    lo = [F32(F32(y[d] * c[d]) - F32(y[d + 64] * s[d])) for d in range(64)]
    hi = [F32(F32(y[d + 64] * c[d]) + F32(y[d] * s[d])) for d in range(64)]
    av = np.array(lo + hi, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.array([_rn32(list(av * rot[:, n])) for n in range(128)], np.float32) + F32(0)


def _plain(a):
    nq, nk, nv = a["head_nums"]
    x = a["qkv"].astype(np.float32)
    if a["layout_qkv"] == "NTD":
        x = x.transpose(1, 0, 2)
    t = x.shape[0]
    qsl, sl = [int(v) for v in a["query_start_loc"]], [int(v) for v in a["seq_lens"]]
    rot = a["rotation"].astype(np.float64)
    eps = F32(a["epsilon"])
    q_codes = np.zeros((t, nq, 128), np.uint8)
    q_scale = np.zeros((t, nq), np.float32)
    k_codes = np.zeros((t, nk, 128), np.uint8)
    k_scale = np.zeros((t, nk), np.float32)
    for tok in range(t):
        b = max(i for i in range(len(sl)) if qsl[i] <= tok)
        local = qsl[b + 1] - qsl[b]
        pos = (sl[b] - local if sl[b] > local else 0) + tok - qsl[b]
        c, s = a["cos_sin"][pos, :64], a["cos_sin"][pos, 64:]
        for head in range(nq + nk):
            gamma = a["q_gamma"] if head < nq else a["k_gamma"]
            r = _rotated_row(x[tok, head], gamma, c, s, rot, eps)
            scale = F32(np.abs(r).max() / F32(448))
            codes = [0] * 128 if scale == 0 else [_fp8(F32(v / scale)) for v in r]
            if head < nq:
                q_codes[tok, head], q_scale[tok, head] = codes, scale
            else:
                k_codes[tok, head - nq], k_scale[tok, head - nq] = codes, scale
    v = x[:, nq + nk:] * a["v_scale"][None, :, None]
    v_codes = np.vectorize(_fp8)(v).astype(np.uint8)
    kc, vc, ksc = (a[p].copy() for p in ("k_cache", "v_cache", "k_scale_cache"))
    bs = kc.shape[2]
    for tok, slot in enumerate(int(v) for v in a["slot_mapping"]):
        kc.view(np.uint8)[slot // bs, :, slot % bs] = k_codes[tok]
        vc.view(np.uint8)[slot // bs, :, slot % bs] = v_codes[tok]
        ksc[slot // bs, :, slot % bs, 0] = k_scale[tok]
    if a["layout_q_out"] == "NTD":
        q_codes, q_scale = q_codes.transpose(1, 0, 2), q_scale.T
    return q_codes, q_scale, kc, vc, ksc


CASES = [dict(t=3, nq=8, nk=1, batch=2), dict(t=3, nq=8, nk=1, batch=1, layout_q_out="TND"),
         dict(t=2, nq=8, nk=1, batch=2, layout_qkv="NTD", layout_q_out="NTD")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_plain_model(case):
    a = qkv_case(**case)
    want = _plain(a)
    before = a["k_cache"].view(np.uint8).copy()
    q_out, q_scale, kc, vc, ksc = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    assert q_out.dtype == ml_dtypes.float8_e4m3fn and q_scale.dtype == np.float32
    assert kc is a["k_cache"] and vc is a["v_cache"] and ksc is a["k_scale_cache"]  # written in place
    np.testing.assert_array_equal(q_out.view(np.uint8), want[0])
    np.testing.assert_array_equal(q_scale.view(np.uint32), want[1].view(np.uint32))
    for got, w in zip((kc, vc, ksc), want[2:]):
        assert got.tobytes() == np.ascontiguousarray(w).tobytes()
    untouched = np.ones(before.shape[:3], bool)
    bs = before.shape[2]
    for slot in a["slot_mapping"]:
        untouched[slot // bs, :, slot % bs] = False
    assert (kc.view(np.uint8)[untouched] == before[untouched]).all() and untouched.any()


def test_positions_follow_seq_lens_history():
    from qsfa.reference.qkv_k_scale import positions

    # two requests: 2 new tokens of a 7-token sequence, 3 new tokens of a 3-token one
    assert positions([0, 2, 5], [7, 3], 5).tolist() == [5, 6, 0, 1, 2]


def test_the_rotation_operand_is_rounded_to_bf16():
    """With the identity rotation q_out's values are the bf16 RoPE output requantised: rotating by I adds no
    rounding (the bf16 operand passes through the fp32 GEMM exactly)."""
    a = qkv_case(t=2, nq=8, nk=1, batch=1)
    a["rotation"] = np.eye(128, dtype=ml_dtypes.bfloat16)
    want = _plain(a)
    q_out, q_scale, *_ = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    np.testing.assert_array_equal(q_out.view(np.uint8), want[0])


def test_zero_head_codes_are_the_open_choice():
    a = qkv_case(t=2, nq=8, nk=1, batch=1)
    a["q_gamma"] = np.zeros(128, np.float32)  # every Q head normalises to 0: scale 0 and 0 / 0 in the kernel
    q_out, q_scale, *_ = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    assert (q_scale == 0).all() and (q_out.view(np.uint8) == 0).all()
    a = qkv_case(t=2, nq=8, nk=1, batch=1)
    a.update(q_gamma=np.zeros(128, np.float32), zero_head="nan")
    q_out, *_ = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    assert (q_out.view(np.uint8) == 0x7F).all()


def test_bad_input_is_named_and_writes_nothing():
    a = qkv_case()
    a["slot_mapping"] = a["slot_mapping"].copy()
    a["slot_mapping"][-1] = a["slot_mapping"][0]
    before = a["k_cache"].tobytes()
    with pytest.raises(InvalidArgument) as ei:
        qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    assert ei.value.constraint_id == "qkv_rms_norm_rope_cache_with_k_scale.slot_mapping_values"
    assert str(ei.value).startswith("Invalid value for slot_mapping, actual: slot ")
    assert a["k_cache"].tobytes() == before
    with pytest.raises(InvalidArgument) as ei:
        qsfa.qkv_rms_norm_rope_cache_with_k_scale(**qkv_case(), chip="A3")
    assert ei.value.constraint_id == "qkv_rms_norm_rope_cache_with_k_scale.a2a3_unsupported"


def test_golden_set_files_match_the_plain_model(tmp_path):
    """The catalogue's qkv-rms-norm-rope-cache-with-k-scale set read back with NumPy and the manifest only; its small
    NTD case is recomputed by the plain model, and every case wrote the K scale of exactly its slots."""
    import os

    from qsfa.cli import main
    from qsfa.golden import load_manifest

    out = tmp_path / "qkvs"
    assert main(["golden", "generate", "--set", "qkv-rms-norm-rope-cache-with-k-scale", "--out", str(out), "-q"]) == 0
    man = load_manifest(out)
    assert not man["skipped"] and len(man["cases"]) == 5
    for case in man["cases"]:
        arr = {}
        for e in case["arrays"]:
            a = np.fromfile(os.path.join(out, e["file"]), dtype=e["storage"]).reshape(e["shape"])
            arr[(e["role"], e["name"])] = a.view(ml_dtypes.float8_e4m3fn) if e["dtype"] == "float8_e4m3fn" else \
                a.view(ml_dtypes.bfloat16) if e["dtype"] == "bfloat16" else a.view(np.int8) if e["dtype"] == "int8" \
                else a
        ksc_in, ksc = arr[("input", "k_scale_cache")], arr[("output", "k_scale_cache")]
        bs = ksc.shape[2]
        written = np.zeros(ksc.shape[:3], bool)
        for s in arr[("input", "slot_mapping")]:
            written[s // bs, :, s % bs] = True
        assert (ksc[written] > 0).all() and (ksc[~written] == ksc_in[~written]).all(), case["name"]
        p = case["params"]
        if case["name"] == "qkvs-mrope-22-12-10":
            args = {n: v for (role, n), v in arr.items() if role == "input"}
            args.update(head_nums=p["head_nums"], mrope_section=p["mrope_section"], epsilon=1e-6)
            want = _plain_mrope(args)
            assert ("output", "q_scale") not in arr
            assert arr[("output", "q_out")].view(np.uint16).tobytes() == want[0].view(np.uint16).tobytes()
            for name, w in zip(("k_cache", "v_cache", "k_scale_cache"), want[1:]):
                assert arr[("output", name)].tobytes() == w.tobytes(), name
        if case["name"] != "qkvs-ntd-ntd":
            continue
        args = {n: v for (role, n), v in arr.items() if role == "input"}
        args.update(head_nums=p["head_nums"], layout_qkv=p["layout_qkv"], layout_q_out=p["layout_q_out"],
                    epsilon=1e-6)
        want = _plain(args)
        assert arr[("output", "q_out")].view(np.uint8).tobytes() == want[0].tobytes()
        for name, w in zip(("k_cache", "v_cache", "k_scale_cache"), want[2:]):
            assert arr[("output", name)].tobytes() == np.ascontiguousarray(w).tobytes(), name


# --------------------------------------------------------------------------------------------------
# M-RoPE scenario (hicann/ops-transformer@6c2c05f op_kernel/arch35/..._vf.h, @c0dda0b torch_extension doc)


def _int8(y):
    """INT8 code of fp32 ``y``: NumPy's IEEE half (round to nearest even), then Python's round (half to even)."""
    return max(-128, min(127, round(float(np.float16(y)))))


def _plain_mrope(a):
    nq, nk, _ = a["head_nums"]
    x = a["qkv"].astype(np.float32)
    t = x.shape[0]
    _, h, w = a["mrope_section"]
    rot = a["rotation"].astype(np.float64)
    eps = F32(a["epsilon"])
    q_out = np.zeros((t, nq, 128), np.float32)
    k_codes = np.zeros((t, nk, 128), np.int8)
    k_scale = np.zeros((t, nk), np.float32)
    for tok in range(t):
        c, s = np.zeros(64, np.float32), np.zeros(64, np.float32)
        for lane in range(64):
            group, phase = divmod(lane, 3)
            stream = 1 if phase == 1 and group < h else 2 if phase == 2 and group < w else 0  # H, W, else T
            row = a["cos_sin"][a["mrope_position"][tok, stream]]
            c[lane], s[lane] = row[lane], row[64 + lane]
        for head in range(nq + nk):
            gamma = a["q_gamma"] if head < nq else a["k_gamma"]
            r = _rotated_row(x[tok, head], gamma, c, s, rot, eps)
            if head < nq:
                q_out[tok, head] = r
                continue
            scale = F32(np.abs(r).max() / F32(127))
            k_codes[tok, head - nq] = [0] * 128 if scale == 0 else [_int8(F32(v / scale)) for v in r]
            k_scale[tok, head - nq] = scale
    v = x[:, nq + nk:] * a["v_scale"][None]
    v_codes = np.vectorize(_fp8)(v).astype(np.uint8)
    kc, vc, ksc = (a[p].copy() for p in ("k_cache", "v_cache", "k_scale_cache"))
    bs = kc.shape[2]
    for tok, slot in enumerate(int(v) for v in a["slot_mapping"]):
        kc[slot // bs, :, slot % bs] = k_codes[tok]
        vc.view(np.uint8)[slot // bs, :, slot % bs] = v_codes[tok]
        ksc[slot // bs, :, slot % bs, 0] = k_scale[tok]
    return q_out.astype(ml_dtypes.bfloat16), kc, vc, ksc


MROPE_CASES = [dict(t=3, nq=8, nk=1), dict(t=2, nq=16, nk=2, section=(0, 21, 21)), dict(t=2, nq=8, nk=1,
                                                                                          section=(64, 0, 0))]


@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_mrope_matches_plain_model(case):
    from qsfa.ops.qkv_k_scale import mrope_case

    a = mrope_case(**case)
    want = _plain_mrope(a)
    before = a["k_cache"].copy()
    q_out, q_scale, kc, vc, ksc = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    assert q_scale is None and q_out.dtype == ml_dtypes.bfloat16 and kc.dtype == np.int8
    assert kc is a["k_cache"] and vc is a["v_cache"] and ksc is a["k_scale_cache"]
    assert q_out.view(np.uint16).tobytes() == want[0].view(np.uint16).tobytes()
    for got, w in zip((kc, vc, ksc), want[1:]):
        assert got.tobytes() == w.tobytes()
    assert (kc != before).any()


def test_mrope_lanes_follow_the_section():
    """mrope_section [22, 12, 10]: lanes 1, 4, ..., 34 (l % 3 = 1, l // 3 < 12) read H, lanes 2, 5, ..., 29 read W,
    every other lane T (the torch_extension doc's sigma)."""
    from qsfa.reference.qkv_k_scale import mrope_lane_axes

    axes = mrope_lane_axes([22, 12, 10]).tolist()
    assert [i for i, v in enumerate(axes) if v == 1] == list(range(1, 35, 3))
    assert [i for i, v in enumerate(axes) if v == 2] == list(range(2, 30, 3))
    assert mrope_lane_axes([64, 0, 0]).tolist() == [0] * 64


def test_mrope_streams_reach_the_output():
    """Moving only the H positions changes q_out; moving the T positions of a [0, 21, 21] section changes it too
    (lanes l % 3 = 0 always read T: t takes no lane of its own); moving W changes nothing when w = 0."""
    from qsfa.ops.qkv_k_scale import mrope_case

    def q(section, col):
        a = mrope_case(t=2, nq=8, nk=1, section=section)
        base = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**mrope_case(t=2, nq=8, nk=1, section=section))[0]
        a["mrope_position"][:, col] = (a["mrope_position"][:, col] + 1) % 32
        return (qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)[0].view(np.uint16) != base.view(np.uint16)).any()

    assert q((22, 12, 10), 1) and q((0, 21, 21), 0) and not q((43, 21, 0), 2)


def test_mrope_int8_zero_head_and_refusals():
    from qsfa.ops.qkv_k_scale import mrope_case

    a = mrope_case(t=2, nq=8, nk=1)
    a["k_gamma"] = np.zeros(128, np.float32)  # every K head normalises to 0: scale 0, 0 / 0 in the kernel
    _, _, kc, _, ksc = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    bs = kc.shape[2]
    for slot in a["slot_mapping"]:
        assert (kc[slot // bs, :, slot % bs] == 0).all() and (ksc[slot // bs, :, slot % bs] == 0).all()
    for change, cid in ((dict(seq_lens=np.array([2], np.int32)), "rope_positions_by_scenario"),
                        (dict(q_quant_mode="PerTokenPerHead"), "q_quant_mode_by_scenario"),
                        (dict(mrope_section=[0, 22, 0]), "mrope_section_value"),
                        (dict(layout_q_out="NTD"), "mrope_layouts"),
                        (dict(zero_head="nan"), "zero_head_mrope")):
        b = mrope_case(t=2, nq=8, nk=1)
        before = b["k_cache"].tobytes()
        b.update(change)
        with pytest.raises(InvalidArgument) as ei:
            qsfa.qkv_rms_norm_rope_cache_with_k_scale(**b)
        assert ei.value.constraint_id == f"qkv_rms_norm_rope_cache_with_k_scale.{cid}"
        assert b["k_cache"].tobytes() == before


def test_mrope_int8_ties_through_the_front_door():
    """K rows of +1 (RMS exactly 1: epsilon 2^-149 vanishes in the sum), cos 1 / sin 0, the identity rotation: the
    rotated K row is k_gamma itself. With amax 127 x 4 the scale is exactly 4 and the codes of the midpoints are
    their even neighbours (written out by hand)."""
    from qsfa.ops.qkv_k_scale import mrope_case

    a = mrope_case(t=2, nq=8, nk=1)
    a["qkv"] = np.ones_like(a["qkv"])
    a["cos_sin"] = np.concatenate([np.ones((32, 64)), np.zeros((32, 64))], axis=1).astype(np.float32)
    a.update(rotation=np.eye(128, dtype=ml_dtypes.bfloat16), epsilon=float(np.float32(2.0 ** -149)))
    g = np.full(128, 0.25, np.float32)
    g[:8] = [127, 2.5, 1.5, 0.5, -2.5, 3.5, 126.5, -125.5]
    a["k_gamma"] = g * 4
    _, _, kc, _, ksc = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    s = int(a["slot_mapping"][0])
    assert ksc[s // 16, 0, s % 16, 0] == 4.0
    assert kc[s // 16, 0, s % 16, :8].tolist() == [127, 2, 2, 0, -2, 4, 126, -126]
    assert (kc[s // 16, 0, s % 16, 8:] == 0).all()  # 0.25 -> 0
