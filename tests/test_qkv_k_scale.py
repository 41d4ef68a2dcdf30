"""qkv_rms_norm_rope_cache_with_k_scale (Ascend 950, RoPE scenario) against a plain per-element model written here
from the kernel's rounding points (cannmirror/ops-transformer@c4f5cf7 op_kernel/arch35/..._vf.h)."""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa._errors import InvalidArgument, InvalidDtype
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
    assert not man["skipped"] and len(man["cases"]) == 7
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
        if case["name"] == "qkvs-mx-16-t11":
            args = {n: v for (role, n), v in arr.items() if role == "input"}
            args.update(head_nums=p["head_nums"], mrope_section=p["mrope_section"], epsilon=1e-6,
                        mx_aiv_num=p["mx_aiv_num"])
            want = _plain_mx(args, 9)
            for name, w in zip(("q_out", "q_scale", "k_cache", "v_cache", "k_scale_cache"), want):
                assert arr[("output", name)].view(np.uint8).tobytes() == w.tobytes(), name
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


# --- M-RoPE MX scenario (recursion-ascend/ops-transformer@a093e95 op_kernel/arch35/..._mrope_mx_vf.h, _vec.h,
# _controller.h, _layout.h; op_host/op_tiling/arch35/..._base_tiling.cpp) -------------------------------------------
from qsfa.ops.qkv_k_scale import mx_case  # noqa: E402
from qsfa.reference.qkv_k_scale import mx_token_tile  # noqa: E402

_E8M0 = ml_dtypes.float8_e8m0fnu
_EDGE = float(np.array([0x04600001], np.uint32).view(np.float32)[0])


def _e8m0_byte(amax):
    """The smallest k with amax <= 448 x 2^k, as a biased byte (k + 127); 0 at or below the kernel's locked edge
    (amax bits 0x04600001), 0xFF for Inf / NaN. Written from the definition, not from the bits."""
    a = float(amax)
    if not math.isfinite(a):
        return 0xFF
    if a <= _EDGE:
        return 0
    k = math.ceil(math.log2(a / 448.0))
    while a > 448.0 * 2.0 ** k:
        k += 1
    while a <= 448.0 * 2.0 ** (k - 1):
        k -= 1
    return k + 127


def _inv_scale(b):
    return 1.0 / float(np.array([b], np.uint8).view(_E8M0).astype(np.float64)[0])  # 2^(127 - b), exact


def _mx_row(xs, gamma, c, s, eps, batch):
    """One Q / K head of the MX kernel: (128 codes, 4 scale bytes). Row path: normalise, rotate with gamma x cos /
    gamma x sin premultiplied, codes fp8(y x 2^-e). Batch path: rotate the raw x, scale byte from amax / rms,
    codes fp8(z x RN32(2^-e / rms))."""
    x = np.asarray(xs, np.float32)
    sq = x * x
    ss = _rn32([float(F32(sq[d] + sq[d + 64])) for d in range(64)])
    rms = np.sqrt(F32(F32(ss * F32(1 / 128)) + eps))
    g = np.asarray(gamma, np.float32)
    c, s = np.asarray(c, np.float32), np.asarray(s, np.float32)
    v = x if batch else x / rms
    y = np.concatenate([v[:64] * (g[:64] * c) - v[64:] * (g[64:] * s), v[64:] * (g[64:] * c) + v[:64] * (g[:64] * s)])
    codes, scales = [], []
    for gi in range(4):
        grp = y[32 * gi:32 * gi + 32]
        amax = F32(np.abs(grp).max())
        b = _e8m0_byte(F32(amax / rms) if batch else amax)
        mult = F32(F32(_inv_scale(b)) / rms) if batch else F32(_inv_scale(b))
        scales.append(b)
        codes += [_fp8(F32(val * mult)) for val in grp]
    return codes, scales


def _k_batch_model(t, nk, tile, aiv):
    """K tokens on the batch path: T split over min(T, aiv) cores (the first T % n take one more), 1024-token
    windows, tiles of tile; Nk = 2 / 4 batch the first floor(count / (16 / Nk)) x (16 / Nk) tokens of a tile."""
    out = np.zeros(t, bool)
    if nk not in (2, 4):
        return out
    per = 16 // nk
    for part in np.array_split(np.arange(t), min(t, aiv)):
        for w in range(0, part.size, 1024):
            win = part[w:w + 1024]
            for j in range(0, win.size, tile):
                tl = win[j:j + tile]
                out[tl[:tl.size // per * per]] = True
    return out


def _plain_mx(a, tile):
    nq, nk, nv = a["head_nums"]
    x = a["qkv"].astype(np.float32)
    t = x.shape[0]
    eps = F32(a["epsilon"])
    sec = a["mrope_section"]
    kb = _k_batch_model(t, nk, tile, a["mx_aiv_num"])
    q = np.zeros((t, nq, 128), np.uint8)
    qs = np.zeros((t, nq, 4), np.uint8)
    k_cache = a["k_cache"].view(np.uint8).copy()
    v_cache = a["v_cache"].view(np.uint8).copy()
    ks_cache = a["k_scale_cache"].view(np.uint8).copy()
    bs = k_cache.shape[2]
    for u in range(t):
        rows = [int(a["mrope_position"][u, 1 if (l % 3 == 1 and l // 3 < sec[1]) else
                                        2 if (l % 3 == 2 and l // 3 < sec[2]) else 0]) for l in range(64)]
        c = [a["cos_sin"][rows[l], l] for l in range(64)]
        s = [a["cos_sin"][rows[l], 64 + l] for l in range(64)]
        for h in range(nq):
            q[u, h], qs[u, h] = _mx_row(x[u, h], a["q_gamma"], c, s, eps, h < nq // 16 * 16)
        blk, off = divmod(int(a["slot_mapping"][u]), bs)
        for h in range(nk):
            k_cache[blk, h, off], ks_cache[blk, h, off] = _mx_row(x[u, nq + h], a["k_gamma"], c, s, eps, kb[u])
            v_cache[blk, h, off] = [_fp8(F32(x[u, nq + nk + h, d]) * a["v_scale"][h, d]) for d in range(128)]
    return q, qs, k_cache, v_cache, ks_cache


MX_CASES = [dict(nq=16, nk=2, t=11, aiv=1), dict(nq=24, nk=3, t=5, aiv=64), dict(nq=32, nk=4, t=7, aiv=2),
            dict(nq=8, nk=1, t=3, aiv=1), dict(nq=64, nk=8, t=3, aiv=1)]


@pytest.mark.parametrize("case", MX_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_mx_matches_plain_model(case):
    """Byte for byte, caches included, against the per-element model above (ml_dtypes E4M3FN / E8M0 casts, the
    scale byte from its definition, the path from a separate walk over cores and tiles)."""
    a = mx_case(t=case["t"], nq=case["nq"], nk=case["nk"], block_num=1, seed=case["t"])
    a["mx_aiv_num"] = case["aiv"]
    want = _plain_mx(a, mx_token_tile(case["t"], case["nq"], case["nk"]))
    got = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
    assert got[0].dtype == ml_dtypes.float8_e4m3fn and got[1].dtype == _E8M0 and got[4].dtype == _E8M0
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w)


def test_mx_token_tile_hand_worked():
    """Nq 16, Nk 2: the layout is 14592 + 24928 c + 2 x align32(4 c) bytes for a tile of c tokens (gammas, v_scale,
    gather index and the 1024-token position window; two input slots of qkv / cos-sin rows / slots; V, K, K-scale,
    Q and Q-scale staging; c RowBatch16 records of 8960 bytes): c = 9 takes 239072 bytes, c = 10 takes 264000."""
    assert mx_token_tile(1000, 16, 2, 262144) == 9
    assert mx_token_tile(1000, 16, 2, 239072) == 9 and mx_token_tile(1000, 16, 2, 239071) == 8
    assert mx_token_tile(5, 16, 2, 262144) == 5
    assert mx_token_tile(1000, 16, 2, 14592 + 24928 + 63) is None


# A K row (bf16 bits) found by search whose lane 121 rounds differently on the two paths: with gamma 1, cos 1 and
# sin 0, the row path rounds x / rms and then scales exactly, the batch path multiplies x by RN32(2^-e / rms).
PATH_ROW = [
    16270, 16292, 16142, 15852, 16418, 49079, 16011, 16182, 15919, 15760, 48805, 16276, 49116, 49033, 49066,
    48932, 48895, 16077, 16259, 48968, 15781, 16391, 16211, 49092, 16202, 15888, 15832, 16080, 16228, 16050,
    16263, 16084, 16243, 16159, 48974, 49078, 16375, 48973, 49027, 16267, 16277, 48642, 16299, 48885, 48808,
    49064, 16390, 15920, 16199, 49092, 16141, 49117, 48922, 16190, 16321, 16343, 15668, 49052, 16107, 48825,
    16208, 16146, 16363, 16188, 48437, 16143, 48719, 48828, 48890, 48663, 48903, 15873, 49075, 48838, 16170,
    48947, 49010, 16366, 48870, 16360, 48037, 16145, 16242, 48914, 48952, 15897, 15261, 16210, 48849, 48920,
    16024, 48942, 48987, 16051, 48814, 49059, 16234, 48694, 49164, 48952, 16261, 15662, 48931, 16001, 48931,
    48805, 16081, 49005, 16363, 49188, 49091, 16234, 16056, 16371, 16174, 16276, 16183, 48667, 49120, 48762,
    16114, 16022, 48993, 16254, 48833, 49010, 15847, 48292]


def _path_case():
    a = mx_case(t=8, nq=16, nk=2, block_num=1, seed=3)
    qkv = a["qkv"].copy()
    qkv[0, 16] = np.array(PATH_ROW, np.uint16).view(ml_dtypes.bfloat16)
    cs = a["cos_sin"].copy()
    cs[0, :64], cs[0, 64:] = 1.0, 0.0
    pos = a["mrope_position"].copy()
    pos[0] = 0
    a.update(qkv=qkv, cos_sin=cs, mrope_position=pos, k_gamma=np.ones(128, np.float32))
    return a


def test_mx_path_follows_the_core_count():
    """Eight tokens, Nk = 2: on one core they fill one 16-row batch; on 64 cores each core has one token and goes
    row by row. The same K row then writes a different code (lane 121: 98 batched, 97 row by row)."""
    slot = None
    out = {}
    for aiv in (1, 64):
        a = _path_case()
        a["mx_aiv_num"] = aiv
        slot = divmod(int(a["slot_mapping"][0]), a["k_cache"].shape[2])
        k = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)[2].view(np.uint8)
        out[aiv] = k[slot[0], 0, slot[1]]
        assert list(out[aiv]) == _mx_row(np.asarray(a["qkv"][0, 16], np.float32), a["k_gamma"], [1.0] * 64,
                                         [0.0] * 64, F32(a["epsilon"]), aiv == 1)[0]
    assert out[1][121] == 98 and out[64][121] == 97
    assert (out[1] != out[64]).sum() == 1


def test_mx_zero_heads():
    """All-zero K heads: row by row every value is +-0 and the scale byte 0; batched, z = 0 meets 1 / (rms x
    2^-127) = Inf (rms = sqrt(eps) < 1) and 0 x Inf is NaN, written as zero_head says (OPEN). (A zero gamma with a
    non-zero x and rms >= 1 gives a finite reciprocal and codes +-0 on both paths.)"""
    for aiv, batched in ((1, True), (64, False)):
        for zh, code in (("zero", 0x00), ("nan", 0x7F)):
            a = mx_case(t=8, nq=16, nk=2, block_num=1, seed=5)
            qkv = a["qkv"].copy()
            qkv[:, 16:18] = 0
            a.update(mx_aiv_num=aiv, zero_head=zh, qkv=qkv)
            _, _, k, _, ks = qsfa.qkv_rms_norm_rope_cache_with_k_scale(**a)
            b, o = divmod(int(a["slot_mapping"][2]), 16)
            assert (ks.view(np.uint8)[b, :, o] == 0).all()
            codes = k.view(np.uint8)[b, :, o]
            if batched:
                assert (codes == code).all()
            else:
                assert np.isin(codes, (0x00, 0x80)).all()


def test_mx_refusals_name_the_rule():
    a = mx_case()
    for change, cid in ((dict(k_quant_mode="PerTokenPerHead"), "k_quant_mode_by_scenario"),
                        (dict(q_out_dtype="bfloat16"), "q_out_dtype_by_scenario"),
                        (dict(rotation=np.eye(128, dtype=ml_dtypes.bfloat16)), "rotation_absent_mx"),
                        (dict(k_scale_cache=np.zeros((2, 2, 16, 4), np.float32)), "k_scale_cache_dtype_by_scenario"),
                        (dict(k_scale_cache=np.zeros((2, 2, 16, 1), np.uint8).view(_E8M0)), "k_scale_cache_shape"),
                        (dict(mx_ub_bytes=4096), "mx_ub_tile"), (dict(mx_aiv_num=0), "mx_aiv_num_value")):
        b = dict(a, **change)
        before = b["k_cache"].view(np.uint8).copy()
        with pytest.raises((InvalidArgument, InvalidDtype)) as e:
            qsfa.qkv_rms_norm_rope_cache_with_k_scale(**b)
        assert e.value.constraint_id.endswith(cid), (cid, str(e.value))
        np.testing.assert_array_equal(b["k_cache"].view(np.uint8), before)
