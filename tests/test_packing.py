"""Packed QSFA rows, FlashMLA V32 rows and NZ storage (docs/numerics/layouts.md#packed-qsfa-row, #flashmla-v32, #nz): hand-worked bytes and round trips."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import qsfa
from qsfa import layouts

BF16 = ml_dtypes.bfloat16


def _le32(v: float) -> list[int]:
    return list(np.array([v], "<f4").view(np.uint8))


def test_packed_head_dim_rule():
    assert layouts.packed_head_dim() == 656
    assert layouts.packed_head_dim(rope_head_dim=0) == 528
    assert layouts.packed_head_dim(256, 32, 64) == 256 + 64 + 16
    assert layouts.packed_head_dim(512, 64, 128, rope_itemsize=4) == 512 + 256 + 16
    with pytest.raises(qsfa.InvalidArgument, match=r"Invalid value for kv_lora_rank, actual: 500, reason: must be "
                                                   r"divisible by tile_size \(128\)\."):
        layouts.packed_head_dim(500)
    with pytest.raises(qsfa.InvalidArgument):
        layouts.packed_head_dim(512, -1)


def test_row_offsets():
    assert layouts.row_offsets() == {"nope": (0, 512), "rope": (512, 640), "scales": (640, 656), "width": 656}
    assert layouts.row_offsets(rope_head_dim=0) == {"nope": (0, 512), "rope": (512, 512), "scales": (512, 528),
                                                    "width": 528}


def test_hand_worked_656_row():
    # NoPE codes: q[j] = j - 256 wrapped to int8 (so byte j holds (j - 256) mod 256 = j mod 256)
    q = (np.arange(512) % 256).astype(np.uint8).view(np.int8)[None]
    rope = np.zeros((1, 64), BF16)
    rope[0, 0], rope[0, 1], rope[0, 63] = 1.0, -2.0, 0.5
    scales = np.array([[0.5, 1.0, 2.0, 0.25]], np.float32)
    row = layouts.pack_rows(q, rope, scales)
    assert row.dtype == np.uint8 and row.shape == (1, 656)
    r = row[0].tolist()
    assert r[0] == 0 and r[1] == 1 and r[255] == 255 and r[256] == 0 and r[511] == 255
    # bf16 1.0 = 0x3F80 little-endian, -2.0 = 0xC000, 0.5 = 0x3F00
    assert r[512:516] == [0x80, 0x3F, 0x00, 0xC0]
    assert r[516:638] == [0] * 122
    assert r[638:640] == [0x00, 0x3F]
    # fp32 0.5 = 0x3F000000, 1.0 = 0x3F800000, 2.0 = 0x40000000, 0.25 = 0x3E800000
    assert r[640:656] == [0, 0, 0, 0x3F, 0, 0, 0x80, 0x3F, 0, 0, 0, 0x40, 0, 0, 0x80, 0x3E]
    assert _le32(0.25) == [0, 0, 0x80, 0x3E]


def test_hand_worked_528_row_zero_tile():
    # A rope-0 row: scales start at byte 512; a zero tile stores scale 0.0 (four zero bytes)
    q = np.zeros((1, 512), np.int8)
    q[0, 128] = -127
    scales = np.array([[0.0, 3.0, 0.0, 0.0]], np.float32)
    row = layouts.pack_rows(q, None, scales)[0].tolist()
    assert len(row) == 528
    assert row[128] == 0x81 and sum(row[:512]) == 0x81
    assert row[512:528] == [0, 0, 0, 0, 0, 0, 0x40, 0x40, 0, 0, 0, 0, 0, 0, 0, 0]


@given(st.integers(1, 6), st.sampled_from([0, 64]), st.integers(0, 2**32 - 1))
def test_unpack_pack_identity_on_bytes(t, rope, seed):
    rng = np.random.default_rng(seed)
    w = layouts.packed_head_dim(rope_head_dim=rope)
    rows = rng.integers(0, 256, (t, w), dtype=np.uint8)
    nope, r, s = layouts.unpack_rows(rows, rope_head_dim=rope)
    assert nope.shape == (t, 512) and s.shape == (t, 4) and s.dtype == np.float32
    assert (r is None) == (rope == 0)
    again = layouts.pack_rows(nope, r, s)
    assert again.tobytes() == rows.tobytes()  # NaN scales/RoPE bit patterns survive too


def test_pack_unpack_fields_back():
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (3, 512)).astype(np.int8)
    rope = rng.standard_normal((3, 64)).astype(np.float16)
    s = rng.random((3, 4)).astype(np.float32)
    nope, r2, s2 = layouts.unpack_rows(layouts.pack_rows(q, rope, s), rope_dtype="float16")
    assert nope.view(np.int8).tobytes() == q.tobytes()
    assert r2.dtype == np.float16 and r2.tobytes() == rope.tobytes()
    assert s2.tobytes() == s.tobytes()


def test_unpack_wrong_width():
    with pytest.raises(qsfa.InvalidArgument, match="656 bytes"):
        layouts.unpack_rows(np.zeros((1, 528), np.uint8))


def test_dequant_int8_rows():
    q = np.zeros((1, 512), np.int8)
    q[0, 0], q[0, 127], q[0, 128], q[0, 511] = 127, -3, 5, -127
    rope = np.full((1, 64), 1.5, BF16)
    s = np.array([[0.5, 0.25, 1.0, 2.0]], np.float32)
    k_nope, k_rope = layouts.dequant_rows(layouts.pack_rows(q, rope, s))
    assert k_nope.dtype == np.float32
    assert k_nope[0, 0] == 63.5 and k_nope[0, 127] == -1.5 and k_nope[0, 128] == 1.25 and k_nope[0, 511] == -254.0
    assert np.count_nonzero(k_nope) == 4
    assert k_rope.dtype == np.float32 and np.all(k_rope == 1.5)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "hifloat8"])
def test_dequant_8bit_float_rows_cross_checked(fmt):
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 256, (4, 512), dtype=np.uint8)
    if fmt == "float8_e4m3fn":
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes
        ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        en = pytest.importorskip("en_dtypes")
        codes[codes == 0x80] = 0
        codes[(codes == 0x6F) | (codes == 0xEF)] = 0  # Inf codes
        ref = codes.view(en.hifloat8).astype(np.float32)
    s = rng.random((4, 4)).astype(np.float32)
    k_nope, _ = layouts.dequant_rows(layouts.pack_rows(codes, None, s), nope_format=fmt, rope_head_dim=0)
    expect = ref * np.repeat(s, 128, axis=1)
    assert k_nope.tobytes() == expect.astype(np.float32).tobytes()


def test_flashmla_v32_hand_worked_and_round_trip():
    rng = np.random.default_rng(3)
    q = rng.integers(0, 256, (2, 512), dtype=np.uint8)
    rope = rng.standard_normal((2, 64)).astype(BF16)
    s = np.array([[1.0, 2.0, 4.0, 8.0], [0.5, 0.5, 0.5, 0.5]], np.float32)
    qs = layouts.pack_rows(q, rope, s)
    v32 = layouts.qsfa_to_flashmla_v32(qs)
    assert v32.shape == (2, 656)
    assert v32[:, :512].tobytes() == q.tobytes()
    assert v32[:, 512:528].tobytes() == s.astype("<f4").tobytes()  # FlashMLA: scales right after NoPE
    assert v32[:, 528:656].tobytes() == rope.tobytes()  # then the bf16 RoPE
    assert np.array_equal(v32[0, 512:528].view("<f4"), [1.0, 2.0, 4.0, 8.0])
    back = layouts.flashmla_v32_to_qsfa(v32)
    assert back.tobytes() == qs.tobytes()


@given(st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_v32_round_trip_random_bytes(t, seed):
    rows = np.random.default_rng(seed).integers(0, 256, (t, 1, 656), dtype=np.uint8)
    assert layouts.qsfa_to_flashmla_v32(layouts.flashmla_v32_to_qsfa(rows)).tobytes() == rows.tobytes()
    assert layouts.flashmla_v32_to_qsfa(layouts.qsfa_to_flashmla_v32(rows)).tobytes() == rows.tobytes()
    fp8 = rows.view(ml_dtypes.float8_e4m3fn)
    assert layouts.qsfa_to_flashmla_v32(fp8).dtype == fp8.dtype


def test_v32_rejects_528_rows():
    with pytest.raises(qsfa.InvalidArgument):
        layouts.qsfa_to_flashmla_v32(np.zeros((1, 528), np.uint8))


# ---------------------------------------------------------------------------------------------- NZ


def test_nz_columns():
    assert layouts.nz_columns(np.int8) == 32 and layouts.nz_columns(np.uint8) == 32
    assert layouts.nz_columns(np.float16) == 16 and layouts.nz_columns(BF16) == 16


@pytest.mark.parametrize("dtype,c", [(np.uint8, 32), (np.float16, 16)])
def test_nz_flat_offset_formula(dtype, c):
    """Element (blk, pos, d) of an N = 1 NZ cache lives at blk*bs*D + (d//c)*bs*c + pos*c + d%c."""
    bn, bs, d = 3, 4, 2 * c
    nd = (np.arange(bn * bs * d) % 251).astype(dtype).reshape(bn, bs, 1, d)
    nz = layouts.nd_to_nz(nd)
    assert nz.shape == (bn, d // c, bs, 1, c)
    flat = nz.reshape(-1)
    blk, pos, dd = np.meshgrid(np.arange(bn), np.arange(bs), np.arange(d), indexing="ij")
    off = blk * bs * d + (dd // c) * bs * c + pos * c + dd % c
    assert np.array_equal(flat[off], nd[:, :, 0, :])
    assert layouts.nz_to_nd(nz).tobytes() == nd.tobytes()


def test_nz_multi_head_layout():
    bn, bs, n, d, c = 2, 16, 4, 64, 16
    nd = np.random.default_rng(4).standard_normal((bn, bs, n, d)).astype(np.float16)
    nz = layouts.nd_to_nz(nd)
    assert nz.shape == (bn, n, d // c, bs, c)
    # [block, head, d // c, pos, d % c]
    assert nz[1, 2, 3, 5, 7] == nd[1, 5, 2, 3 * c + 7]
    assert layouts.nz_to_nd(nz).tobytes() == nd.tobytes()


def test_nz_view_writes_in_place():
    nz = np.zeros((2, 2, 32, 1, 32), np.uint8)  # bn 2, D 64, bs 32, N 1
    view = layouts.nz_view(nz)
    assert view.shape == (2, 32, 1, 2, 32) and np.shares_memory(view, nz)
    view[1, 5, 0] = np.arange(64, dtype=np.uint8).reshape(2, 32)
    nd = layouts.nz_to_nd(nz)
    assert np.array_equal(nd[1, 5, 0], np.arange(64))
    assert np.count_nonzero(nd) == 63


def test_nd_to_nz_rejects_misaligned():
    with pytest.raises(qsfa.InvalidArgument):
        layouts.nd_to_nz(np.zeros((1, 16, 1, 40), np.float16))


def _valid_rows():
    rng = np.random.default_rng(5)
    codes = rng.integers(-128, 128, (3, 512)).astype(np.int8)
    rope = rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16)
    scales = rng.random((3, 4)).astype(np.float32)
    return codes, rope, scales


_NAN_SCALE_ROWS = "nan-scale rows"


@pytest.mark.parametrize("call,param", [
    (lambda c, r, s: layouts.pack_rows(c.astype(np.int16), r, s), "nope_codes"),
    (lambda c, r, s: layouts.pack_rows(c > 0, r, s), "nope_codes"),
    (lambda c, r, s: layouts.pack_rows(None, r, s), "nope_codes"),
    (lambda c, r, s: layouts.pack_rows(c[:, :500], r, s), "nope_codes"),
    (lambda c, r, s: layouts.pack_rows(c, r, s[:, :3]), "scales"),
    (lambda c, r, s: layouts.pack_rows(c, r, s.astype(np.float64)), "scales"),
    (lambda c, r, s: layouts.pack_rows(c, r[:2], s), "rope"),
    (lambda c, r, s: layouts.pack_rows(c, r.astype(np.float32), s), "rope"),
    (lambda c, r, s: layouts.pack_rows(c, r, s, tile_size=0), "tile_size"),
    (lambda c, r, s: layouts.unpack_rows(layouts.pack_rows(c, r, s).astype(np.float32)), "rows"),
    (lambda c, r, s: layouts.unpack_rows(layouts.pack_rows(c, r, s)[:, :-1]), "rows"),
    (lambda c, r, s: layouts.unpack_rows(layouts.pack_rows(c, r, s), rope_dtype="fp8"), "rope_dtype"),
    (lambda c, r, s: layouts.dequant_rows(layouts.pack_rows(c, r, s), nope_format="int4"), "nope_format"),
    (_NAN_SCALE_ROWS, "rows"),
    (lambda c, r, s: layouts.slot_positions(np.arange(4), 0), "block_size"),
    (lambda c, r, s: layouts.slot_positions(None, 16), "slot_mapping"),
    (lambda c, r, s: layouts.slot_positions(np.array([0.5]), 16), "slot_mapping"),
    (lambda c, r, s: layouts.slot_positions(np.array([3, -2]), 16), "slot_mapping"),
])
def test_layout_helpers_refuse_bad_input_by_name(call, param):
    """The byte-layout helpers check their inputs (no assert, no raw NumPy error, no garbage out)."""
    c, r, s = _valid_rows()
    if call is _NAN_SCALE_ROWS:
        rows = layouts.pack_rows(c, r, s)
        rows[1, 644:648] = 0xFF
        call = lambda c, r, s: layouts.dequant_rows(rows)  # noqa: E731
    with pytest.raises(qsfa.InvalidArgument) as e:
        call(c, r, s)
    assert e.value.param == param, str(e.value)


def test_dequant_rows_nonfinite_only_on_request():
    c, r, s = _valid_rows()
    rows = layouts.pack_rows(c, r, s)
    rows[1, 644:648] = 0xFF  # NaN scale of tile 1, token 1
    with pytest.raises(qsfa.InvalidArgument, match=r"nan in the scales at \(1, 1\)"):
        layouts.dequant_rows(rows)
    nope, rope = layouts.dequant_rows(rows, allow_nonfinite=True)
    assert np.isnan(nope[1, 128:256]).all() and np.isfinite(np.delete(nope, 1, axis=0)).all()
    assert np.isfinite(rope).all()
