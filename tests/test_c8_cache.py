"""The QSFA C8 cache writer (docs/numerics/cache-writers.md#c8_cache_write): c8_cache_write (quant + pack + scatter) and c8_rmsnorm_rope_cache.

Expectations come from hand-worked bytes, a slow per-token loop written here (numpy scalars, ml_dtypes for
FP8), the scale module of the formats engineer, and metamorphic properties (rope 0 vs rope 64, permutations).
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import qsfa
from qsfa import layouts

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def _cache(bn=3, bs=4, w=656, fill=17, dtype=np.uint8):
    return np.full((bn, bs, 1, w), fill, dtype)


def _le32(v):
    return list(np.array([v], "<f4").view(np.uint8))


def test_hand_worked_row_bytes():
    k_nope = np.zeros((1, 512), BF16)
    k_nope[0, 0], k_nope[0, 1], k_nope[0, 2], k_nope[0, 3] = 127.0, -63.5, 0.5, 2.5  # tile 0: amax 127 -> s = 1
    k_nope[0, 256] = -254.0  # tile 2: s = 2; tile 1 and tile 3 all zero
    k_nope[0, 257] = 3.0
    k_rope = np.zeros((1, 64), BF16)
    k_rope[0, 0], k_rope[0, 63] = 1.0, -2.0
    cache = _cache()
    qsfa.c8_cache_write(k_nope, k_rope, np.array([6]), cache)
    row = cache[1, 2, 0].tolist()  # slot 6 = block 1, row 2
    assert row[0:4] == [127, 0xC0, 0, 2]  # 127, -64 (RINT), 0 (0.5 -> 0), 2 (2.5 -> 2)
    assert row[256:258] == [0x81, 2]  # -127, 3/2 = 1.5 -> 2
    assert sum(1 for b in row[:512] if b) == 5
    assert row[512:514] == [0x80, 0x3F] and row[638:640] == [0x00, 0xC0] and not any(row[514:638])
    assert row[640:644] == _le32(1.0) == [0, 0, 0x80, 0x3F]
    assert row[644:648] == [0, 0, 0, 0]  # all-zero tile: scale 0 (docs/numerics/open-facts.md#zero-tile)
    assert row[648:652] == _le32(2.0) and row[652:656] == [0, 0, 0, 0]
    untouched = np.ones((3, 4), bool)
    untouched[1, 2] = False
    assert np.all(cache[untouched] == 17)


def test_slot_minus_one_keeps_sentinel_pipeline_case():
    # docs/numerics/attention.md#scenarios pipeline case: slots [0..4, -1], cache prefilled with 17
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((6, 512)).astype(np.float16)
    gamma = np.ones(512, np.float16)
    cache = _cache(bn=2, bs=4, w=528)
    qsfa.c8_rmsnorm_rope_cache(kv, gamma, None, None, np.array([0, 1, 2, 3, 4, -1]), cache, rope_head_dim=0)
    flat = cache.reshape(8, 528)
    assert not np.all(flat[:5] == 17)
    assert np.all(flat[5:] == 17)  # slots 5..7 were never written (token 5 had slot -1)
    k_nope, _ = layouts.dequant_rows(flat[:5], rope_head_dim=0)
    assert k_nope.shape == (5, 512)


def _slow_rows(k_nope, k_rope, fmt="int8", order="divide"):
    """One packed row per token, built element by element the obvious way."""
    rows = []
    tmax = F32(127.0) if fmt == "int8" else F32(448.0)
    for t in range(k_nope.shape[0]):
        codes, scales = [], []
        for j in range(4):
            tile = k_nope[t, j * 128:(j + 1) * 128].astype(np.float32)
            amax = F32(np.max(np.abs(tile)))
            s = F32(amax / tmax)
            scales.append(s)
            for v in tile:
                if amax == 0:
                    y = F32(0)
                elif order == "divide":
                    y = F32(v / s)
                else:
                    y = F32(v * F32(tmax / amax))
                if fmt == "int8":
                    codes.append(int(np.clip(np.rint(y), -127, 127)) & 0xFF)
                else:
                    y = np.clip(y, -tmax, tmax)
                    codes.append(int(np.array([y], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0]))
        rope = [] if k_rope is None else list(np.ascontiguousarray(k_rope[t]).view(np.uint8))
        sc = list(np.array(scales, "<f4").view(np.uint8))
        rows.append(codes + rope + sc)
    return np.array(rows, np.uint8).reshape(k_nope.shape[0], -1)


@st.composite
def _c8_case(draw):
    bn, bs = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 16]))
    t = draw(st.integers(1, min(6, bn * bs)))
    slots = draw(st.permutations(list(range(bn * bs))))[:t]
    skips = draw(st.lists(st.booleans(), min_size=t, max_size=t))
    slots = np.array([-1 if k else s for s, k in zip(slots, skips)], np.int64)
    return (bn, bs, slots, draw(st.sampled_from([0, 64])), draw(st.sampled_from([np.float16, BF16])),
            draw(st.sampled_from(["int8", "float8_e4m3fn"])), draw(st.sampled_from(["divide", "multiply"])),
            draw(st.integers(0, 2**32 - 1)))


@given(_c8_case())
def test_random_against_slow_loop_and_permutation(case):
    bn, bs, slots, rope, dt, fmt, order, seed = case
    rng = np.random.default_rng(seed)
    t = slots.size
    k_nope = (rng.standard_normal((t, 512)) * rng.choice([1e-3, 1.0, 100.0])).astype(dt)
    k_nope[0, 128:256] = 0  # one all-zero tile
    k_rope = rng.standard_normal((t, 64)).astype(dt) if rope else None
    w = 656 if rope else 528
    got = qsfa.c8_cache_write(k_nope, k_rope, slots, _cache(bn, bs, w), key_dtype=fmt, scale_order=order)
    expect = _cache(bn, bs, w)
    rows = _slow_rows(k_nope, k_rope, fmt, order)
    for i, s in enumerate(slots):
        if s != -1:
            expect[s // bs, s % bs, 0] = rows[i]
    assert got.tobytes() == expect.tobytes()
    perm = rng.permutation(t)
    again = qsfa.c8_cache_write(k_nope[perm], None if k_rope is None else k_rope[perm], slots[perm],
                                _cache(bn, bs, w), key_dtype=fmt, scale_order=order)
    assert again.tobytes() == got.tobytes()
    # dequant(quant(x)) is within half a quantisation step of x (int8: s / 2 per tile)
    if fmt == "int8" and order == "divide":
        valid = slots != -1
        deq, _ = layouts.dequant_rows(got[slots[valid] // bs, slots[valid] % bs, 0], rope_head_dim=rope)
        _, _, sc = layouts.unpack_rows(got[slots[valid] // bs, slots[valid] % bs, 0], rope_head_dim=rope)
        step = np.repeat(sc, 128, axis=1).astype(np.float64)
        err = np.abs(deq.astype(np.float64) - k_nope[valid].astype(np.float64))
        assert np.all(err <= step * (0.5 + 2.0**-16))  # half a step, + fp32 rounding of x / s and q * s


def test_matches_scales_module_int8_rule():
    from qsfa.reference.scales import int8_dynamic_quant

    rng = np.random.default_rng(5)
    k_nope = (rng.standard_normal((8, 512)) * 7).astype(BF16)
    for order in ("divide", "multiply"):
        q, s = int8_dynamic_quant(k_nope, group=128, order=order)
        cache = _cache(bn=1, bs=8, w=528)
        qsfa.c8_cache_write(k_nope, None, np.arange(8), cache, scale_order=order)
        nope, _, sc = layouts.unpack_rows(cache[0, :, 0], rope_head_dim=0)
        assert nope.view(np.int8).tobytes() == q.tobytes() and sc.tobytes() == s.tobytes()


def test_rope0_rows_equal_rope64_rows_without_zero_rope():
    rng = np.random.default_rng(1)
    k_nope = rng.standard_normal((5, 512)).astype(BF16)
    slots = np.array([3, -1, 0, 7, 5])
    c64 = qsfa.c8_cache_write(k_nope, np.zeros((5, 64), BF16), slots, _cache(2, 4, 656))
    c0 = qsfa.c8_cache_write(k_nope, None, slots, _cache(2, 4, 528))
    r64, r0 = c64.reshape(8, 656), c0.reshape(8, 528)
    written = [0, 3, 5, 7]
    assert np.all(r64[written, 512:640] == 0)
    assert np.concatenate([r64[:, :512], r64[:, 640:]], axis=1)[written].tobytes() == r0[written].tobytes()


def test_fp8_e4m3fn_nope_dequant_cross_check():
    rng = np.random.default_rng(2)
    k_nope = (rng.standard_normal((3, 512)) * 40).astype(BF16)
    cache = _cache(1, 4, 656, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    qsfa.c8_cache_write(k_nope, rng.standard_normal((3, 64)).astype(BF16), np.array([0, 1, 2]), cache,
                        key_dtype="float8_e4m3fn")
    rows = cache[0, :3, 0].view(np.uint8)
    nope, _, sc = layouts.unpack_rows(rows)
    tiles = k_nope.astype(np.float32).reshape(3, 4, 128)
    assert np.array_equal(sc, np.max(np.abs(tiles), axis=2) / F32(448.0))
    deq = nope.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(3, 4, 128) * sc[..., None]
    rel = np.abs(deq - tiles) / np.max(np.abs(tiles), axis=2, keepdims=True)
    assert rel.max() <= 16 / 448 * (1 + 1e-6)  # half the top binade's spacing (32 in [256, 448]) over 448


def test_torch_cache_strided_along_blocks_updated_in_place():
    torch = pytest.importorskip("torch")
    parent = torch.full((6, 4, 1, 528), 17, dtype=torch.int8)
    view = parent[::2]
    k_nope = torch.randn(2, 512, dtype=torch.bfloat16)
    out = qsfa.c8_cache_write(k_nope, None, torch.tensor([1, 9]), view)
    assert out is view
    ref = qsfa.c8_cache_write(k_nope.float().numpy().astype(BF16), None, np.array([1, 9]), _cache(3, 4, 528))
    assert parent[::2].view(torch.uint8).numpy().tobytes() == ref.tobytes()
    assert bool((parent[1::2] == 17).all())


@pytest.mark.parametrize("kw,cid", [
    (dict(slot_mapping=np.array([0, 0])), "c8_cache_write.slot_mapping_unique"),
    (dict(slot_mapping=np.array([0, 12])), "c8_cache_write.slot_mapping_range"),
    (dict(k_rope=None), "c8_cache_write.kv_cache_shape"),  # a 656-byte cache needs the RoPE
    (dict(key_dtype="int4"), "c8_cache_write.key_dtype_value"),
    (dict(dst_type_max=15.0), "c8_cache_write.dst_type_max_value"),
    (dict(key_dtype="hifloat8", dst_type_max=40000.0), "c8_cache_write.dst_type_max_value"),
])
def test_rejections_write_nothing(kw, cid):
    args = dict(k_nope=np.ones((2, 512), BF16), k_rope=np.ones((2, 64), BF16), slot_mapping=np.array([0, 1]),
                kv_cache=_cache())
    args.update(kw)
    with pytest.raises(qsfa.InvalidArgument) as ei:
        qsfa.c8_cache_write(**args)
    assert ei.value.constraint_id == cid
    assert np.all(args["kv_cache"] == 17)


# ------------------------------------------------------------------------------ c8_rmsnorm_rope_cache


def _slow_rms_rope(kv, gamma, cos, sin, eps, rope):
    """RMSNorm / interleave RoPE per token with numpy float32 scalars (the documented op order)."""
    t = kv.shape[0]
    nope = np.zeros((t, 512), kv.dtype)
    ropev = np.zeros((t, rope), kv.dtype) if rope else None
    for i in range(t):
        x = kv[i, :512].astype(np.float32)
        ss = F32(np.sum((x * x).astype(np.float64)))  # exact sum, one rounding (reference's definition)
        rms = np.sqrt(F32(ss * F32(1.0 / 512)) + F32(eps), dtype=np.float32)
        nope[i] = (gamma.astype(np.float32) * (x / rms)).astype(kv.dtype)
        if rope:
            r = kv[i, 512:].astype(np.float32)
            c, s = cos[i].astype(np.float32), sin[i].astype(np.float32)
            out = np.zeros(rope, np.float32)
            h = rope // 2
            for k in range(h):
                out[k] = F32(r[2 * k] * c[k]) + F32(-r[2 * k + 1] * s[k])
                out[h + k] = F32(r[2 * k + 1] * c[h + k]) + F32(r[2 * k] * s[h + k])
            ropev[i] = out.astype(kv.dtype)
    return nope, ropev


@pytest.mark.parametrize("rope,dt", [(64, BF16), (64, np.float16), (0, BF16)])
def test_rmsnorm_rope_writer_is_norm_rope_round_then_c8(rope, dt):
    rng = np.random.default_rng(3)
    t = 5
    kv = (rng.standard_normal((t, 512 + rope)) * 3).astype(dt)
    gamma = (1 + 0.2 * rng.standard_normal(512)).astype(dt)
    ang = rng.random((t, 32)) * 6.28
    cos = np.concatenate([np.cos(ang)] * 2, axis=1).astype(dt) if rope else None
    sin = np.concatenate([np.sin(ang)] * 2, axis=1).astype(dt) if rope else None
    slots = np.array([2, -1, 9, 4, 0])
    w = 656 if rope else 528
    got = qsfa.c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, _cache(3, 4, w), epsilon=1e-6, rope_head_dim=rope)
    nope, ropev = _slow_rms_rope(kv, gamma, cos, sin, 1e-6, rope)
    expect = qsfa.c8_cache_write(nope, ropev, slots, _cache(3, 4, w))
    assert got.tobytes() == expect.tobytes()


def test_interleave_rope_hand_worked():
    # cos = 1, sin = 0: the output is the half-split reorder (evens then odds), rounded to bf16
    kv = np.zeros((1, 576), BF16)
    kv[0, 512:] = np.arange(64)
    ones, zeros = np.ones((1, 64), BF16), np.zeros((1, 64), BF16)
    c = qsfa.c8_rmsnorm_rope_cache(kv, np.ones(512, BF16), ones, zeros, np.array([0]), _cache(1, 1, 656))
    rope = c[0, 0, 0, 512:640].view(BF16).astype(np.float32)
    assert rope.tolist() == list(range(0, 64, 2)) + list(range(1, 64, 2))
    # cos = 0, sin = 1: cat(-x_odd, x_even)
    c = qsfa.c8_rmsnorm_rope_cache(kv, np.ones(512, BF16), zeros, ones, np.array([0]), _cache(1, 1, 656))
    rope = c[0, 0, 0, 512:640].view(BF16).astype(np.float32)
    assert rope.tolist() == [-v for v in range(1, 64, 2)] + list(range(0, 64, 2))
    # an all-zero NoPE (RMSNorm of zeros = 0) stores four zero scales
    assert c[0, 0, 0, 640:656].tolist() == [0] * 16


def test_rmsnorm_writer_rejects_cos_at_rope0():
    with pytest.raises(qsfa.InvalidArgument) as ei:
        qsfa.c8_rmsnorm_rope_cache(np.ones((1, 512), BF16), np.ones(512, BF16), np.ones((1, 64), BF16),
                                   None, np.array([0]), _cache(1, 1, 528), rope_head_dim=0)
    assert ei.value.constraint_id == "c8_rmsnorm_rope_cache.cos_shape"


@pytest.mark.parametrize("op", ["c8_cache_write", "c8_rmsnorm_rope_cache"])
def test_a_float8_cache_array_takes_fp8_codes_only(op):
    """A float8_e4m3fn cache array is read as FP8 codes by attention (its key_dtype rule): writing int8 codes into
    one is refused before anything is written, naming key_dtype; FP8 codes are written, and read back finite."""
    rng = np.random.default_rng(4)
    kv = rng.standard_normal((6, 576)).astype(BF16)
    cache = np.full((2, 4, 1, 656), 0x11, np.uint8).view(ml_dtypes.float8_e4m3fn)
    before = cache.tobytes()
    ang = rng.uniform(0, 2 * np.pi, (6, 32))
    cos = np.concatenate([np.cos(ang)] * 2, axis=1).astype(BF16)
    sin = np.concatenate([np.sin(ang)] * 2, axis=1).astype(BF16)

    def write(**kw):
        if op == "c8_cache_write":
            return qsfa.c8_cache_write(kv[:, :512], kv[:, 512:], np.arange(6), cache, **kw)
        return qsfa.c8_rmsnorm_rope_cache(kv, np.ones(512, BF16), cos, sin, np.arange(6), cache, **kw)

    with pytest.raises(qsfa.InvalidArgument) as ei:
        write()  # key_dtype defaults to int8
    assert ei.value.constraint_id == f"{op}.key_dtype_matches_kv_cache" and "'int8'" in str(ei.value)
    assert cache.tobytes() == before
    write(key_dtype="float8_e4m3fn")
    codes = cache.reshape(-1, 656)[:6, :512].astype(np.float32)
    assert np.isfinite(codes).all() and cache.tobytes() != before
