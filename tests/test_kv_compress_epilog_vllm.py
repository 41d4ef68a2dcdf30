"""vLLM-Ascend's kv_compress_epilog (torch.ops._C_ascend.kv_compress_epilog, MXFP8): hand-worked bytes.

Every expected byte below is worked out by hand in the comments; none is computed by the code under test.
"""

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa import layouts
from qsfa.reference import kv_compress_epilog_vllm as ref

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2


def _x(rows):
    """bf16 x [T, 192] (n = 128 NoPE, 64 RoPE) from {column: value} dicts."""
    x = np.zeros((len(rows), 192), np.float32)
    for t, r in enumerate(rows):
        for c, v in r.items():
            x[t, c] = v
    return x.astype(BF16)


TOKEN0 = {0: 1.0, 1: -2.0, 2: 3.0, 64: 448.0, 65: 3.0, 66: -0.0625, 128: 1.0, 191: -2.0}


def _cache(n_slots, width, fill=0x11, dtype=E4M3):
    return np.full((n_slots, 1, width), fill, np.uint8).view(dtype)


def test_row_sizes():
    assert ref.kv_cache_col(512, 64) == 640  # 448 + 128 + 7 = 583 -> 640
    assert ref.kv_cache_col(512, 128) == 640  # 448 + 128 + 4 = 580 -> 640
    assert ref.kv_cache_col(192, 64) == 384  # 128 + 128 + 2 = 258 -> 384
    assert ref.kv_cache_col(576, 128) == 768  # 512 + 128 + 4 = 644 -> 768
    assert ref.value_per_token(512) == 576 and ref.scale_per_token(512, 64) == 8  # FlashMLA MODEL1
    assert ref.scale_per_token(208, 64) == 8 and ref.scale_per_token(1088, 64) == 16


def test_layout1_round_scale_hand_worked_row():
    # token 0, group 0: amax 3 -> s = 3 * fp32(1/448) = 0.0067 in [2^-8, 2^-7) -> 2^-7, byte 127 - 7 = 0x78;
    #   1 / 2^-7 = 128 -> E4M3 0x70; -256 -> 0xF8; 384 = 1.5 * 2^8 -> 0x7C
    # token 0, group 1: amax 448 -> s = 448 * fp32(1/448) = 1.00000004 -> fp32 1.0 exactly, a power of two,
    #   which the kernel doubles: 2.0, byte 0x80; 448 / 2 = 224 = 1.75 * 2^7 -> 0x76; 3 / 2 = 1.5 -> 0x3C;
    #   -0.0625 / 2 = -2^-5 -> 0x90
    # token 1: zero NoPE -> s = fp32(1e-4) * fp32(1/448) = 2.23e-7 in [2^-23, 2^-22) -> 2^-22, byte 0x69
    # RoPE: bf16 1.0 = 0x3F80, -2.0 = 0xC000 (little-endian, bytes [0, 128))
    x = _x([TOKEN0, {}])
    cache = _cache(4, 400)
    out = qsfa.kv_compress_epilog_vllm(cache, x, np.array([2, 0], np.int64))
    assert out is cache
    b = cache.view(np.uint8)
    row = np.zeros(384, np.uint8)
    row[0:2], row[126:128] = [0x80, 0x3F], [0x00, 0xC0]
    row[128:131] = [0x70, 0xF8, 0x7C]
    row[192:195] = [0x76, 0x3C, 0x90]
    row[256:258] = [0x78, 0x80]
    np.testing.assert_array_equal(b[2, 0, :384], row)
    zero_row = np.zeros(384, np.uint8)
    zero_row[256:258] = [0x69, 0x69]
    np.testing.assert_array_equal(b[0, 0, :384], zero_row)
    assert (b[:, 0, 384:] == 0x11).all() and (b[1] == 0x11).all() and (b[3] == 0x11).all()


def test_layout1_without_round_scale_divides_by_the_unrounded_scale():
    # s = fp32(3 * 0x3B124925): 0x924925 * 3 = 0x1B6DB6F, a tie at 24 bits -> even 0xDB6DB8, s = 0xDB6DB8 * 2^-31;
    # byte = floor exponent -8 + 127 = 0x77; 1 / s = 149.33 -> 144 = 1.125 * 2^7: 0x71; -2 / s = -298.7 -> -288:
    # 0xF9; 3 / s = 447.99995 -> 448: 0x7E
    cache = _cache(1, 384, 0)
    qsfa.kv_compress_epilog_vllm(cache, _x([{0: 1.0, 1: -2.0, 2: 3.0}]), np.array([0], np.int32),
                                 round_scale_flag=False)
    b = cache.view(np.uint8)[0, 0]
    assert b[128:131].tolist() == [0x71, 0xF9, 0x7E]
    # group 1 is zero: s = fp32(1e-4) * fp32(1/448) = 2.23e-7, floor exponent -23: byte 0x68
    assert b[256:258].tolist() == [0x77, 0x68]


def test_group_128_takes_one_scale_over_both_halves():
    # one group of 128: amax 448 -> s 1.0 -> doubled 2.0 (0x80); 1 -> 0.5 = 0x30, -2 -> -1 = 0xB8,
    # 3 -> 1.5 = 0x3C, 448 -> 224 = 0x76
    cache = _cache(1, 384, 0)
    qsfa.kv_compress_epilog_vllm(cache, _x([TOKEN0]), np.array([0]), quant_group_size=128)
    b = cache.view(np.uint8)[0, 0]
    assert b[128:131].tolist() == [0x30, 0xB8, 0x3C] and b[192:194].tolist() == [0x76, 0x3C]
    assert b[256:258].tolist() == [0x80, 0x00]  # one scale, then padding


def test_e5m2_cache():
    # FMAX 57344: s = 1 * fp32(1/57344) = 1.74e-5 in [2^-16, 2^-15) -> 2^-15, byte 0x70;
    # 1 / 2^-15 = 2^15 -> E5M2 exponent field 30: 0x78
    cache = _cache(1, 384, 0, E5M2)
    qsfa.kv_compress_epilog_vllm(cache, _x([{0: 1.0}]), np.array([0]))
    b = cache.view(np.uint8)[0, 0]
    assert b[128] == 0x78 and b[256] == 0x70


def test_partial_last_group():
    # d = 208: n = 144 -> groups 64, 64, 16 (G 64) or 128, 16 (G 128); the last group's amax is its own
    x = np.zeros((1, 208), np.float32)
    x[0, 130] = 3.0  # only in the 16-wide group: s 2^-7 (0x78), code 0x7C; other groups zero (0x69)
    cache = _cache(1, 384, 0)
    qsfa.kv_compress_epilog_vllm(cache, x.astype(BF16), np.array([0]))
    b = cache.view(np.uint8)[0, 0]
    assert ref.kv_cache_col(208, 64) == 384
    assert b[128 + 130] == 0x7C and b[128 + 144:128 + 147].tolist() == [0x69, 0x69, 0x78]
    cache = _cache(1, 384, 0)
    qsfa.kv_compress_epilog_vllm(cache, x.astype(BF16), np.array([0]), quant_group_size=128)
    b = cache.view(np.uint8)[0, 0]
    assert b[128 + 144:128 + 147].tolist() == [0x69, 0x78, 0x00]


def test_layout2_blocks_hand_worked():
    # d 192: vpt = 128 codes + 128 RoPE = 256, spt = roundup(2, 8) = 8; block_size 2 -> block bytes
    # [0, 512) values of positions 0, 1; [512, 520) scales of position 0, [520, 528) of position 1
    cache = np.full((2, 2, 1, 264), 0x11, np.uint8).view(E4M3)
    qsfa.kv_compress_epilog_vllm(cache, _x([TOKEN0, {5: 1.0}, {}]), np.array([3, -1, 0]), layout=2)
    blk = cache.view(np.uint8).reshape(2, 528)
    # token 0 -> slot 3 = block 1, position 1: codes at [256, 384), RoPE at [384, 512), scales at [520, 528)
    assert blk[1, 256:259].tolist() == [0x70, 0xF8, 0x7C] and blk[1, 320:323].tolist() == [0x76, 0x3C, 0x90]
    assert blk[1, 384:386].tolist() == [0x80, 0x3F] and blk[1, 510:512].tolist() == [0x00, 0xC0]
    assert blk[1, 520:528].tolist() == [0x78, 0x80, 0, 0, 0, 0, 0, 0]
    # token 2 -> slot 0 = block 0, position 0: zero codes, zero RoPE, scales 0x69 0x69 then pad
    assert not blk[0, 0:256].any() and blk[0, 512:520].tolist() == [0x69, 0x69, 0, 0, 0, 0, 0, 0]
    # untouched: block 1 position 0, block 0 position 1 (values and scales)
    assert (blk[1, 0:256] == 0x11).all() and (blk[1, 512:520] == 0x11).all()
    assert (blk[0, 256:512] == 0x11).all() and (blk[0, 520:528] == 0x11).all()


def test_layout2_matches_flashmla_model1_away_from_the_two_differences():
    """d 512, G 64, layout 2 is FlashMLA's MODEL1 layout. The scale rules agree except for a tile whose amax
    is below 448e-4 (the 1e-4 floor applies to amax here, to amax / 448 there) or is 448 * 2^k (a power-of-two
    scale, doubled here): the bytes of every other tile are the same."""
    rng = np.random.default_rng(5)
    bs = 4
    k = (rng.standard_normal((2, bs, 1, 512)) * np.exp2(rng.integers(-3, 8, (2, bs, 1, 1)))).astype(BF16)
    model1 = layouts.flashmla_model1_quantize(k)  # [2, 2 * 576 + ...] padded blocks
    buf = np.full((2, layouts.flashmla_model1_block_bytes(bs)), 0x11, np.uint8)
    view = np.lib.stride_tricks.as_strided(buf, (2, bs, 1, 584), (buf.shape[1], 584, 584, 1))
    cache = view.view(E4M3)
    qsfa.kv_compress_epilog_vllm(cache, k.reshape(-1, 512), np.arange(2 * bs), layout=2)
    amax = np.abs(k[..., :448].astype(np.float32)).reshape(2, bs, 7, 64).max(-1)
    m, _ = np.frexp(amax / 7)
    ok = (amax >= 0.0448) & (m != 0.5)  # 448 * 2^k = 7 * 2^(k + 6): amax / 7 a power of two
    assert ok.sum() > 40
    got_scale = buf[:, 576 * bs:584 * bs].reshape(2, bs, 8)[..., :7]
    want_scale = model1[:, 576 * bs:584 * bs].reshape(2, bs, 8)[..., :7]
    assert np.array_equal(got_scale[ok], want_scale[ok])
    got_codes = buf[:, :576 * bs].reshape(2, bs, 576)[..., :448].reshape(2, bs, 7, 64)
    want_codes = model1[:, :576 * bs].reshape(2, bs, 576)[..., :448].reshape(2, bs, 7, 64)
    assert np.array_equal(got_codes[ok], want_codes[ok])
    assert np.array_equal(buf[:, :576 * bs].reshape(2, bs, 576)[..., 448:],
                          model1[:, :576 * bs].reshape(2, bs, 576)[..., 448:])  # RoPE bytes
    assert (buf[:, 584 * bs:] == 0x11).all()  # block padding untouched


def test_strided_cache_is_written_in_place():
    big = np.full((3, 1, 1024), 0x11, np.uint8)
    cache = big[:, :, :384].view(E4M3)  # stride(0) 1024 > head_dim 384
    qsfa.kv_compress_epilog_vllm(cache, _x([TOKEN0]), np.array([1]))
    assert big[1, 0, 128:131].tolist() == [0x70, 0xF8, 0x7C] and (big[1, 0, 384:] == 0x11).all()
    assert (big[0] == 0x11).all() and (big[2] == 0x11).all()


@pytest.mark.parametrize("kw,match", [
    (dict(quant_mode=1), r"Invalid value for quant_mode, actual: 1, reason: must be 2 \(MXFP8\)"),
    (dict(quant_group_size=32), r"Invalid value for quant_group_size, actual: 32"),
    (dict(layout=2), r"Invalid shape for kv_compress_cache, actual: '\(2, 1, 384\) with layout 2'"),
    (dict(slot_mapping=np.array([2])), r"Invalid value for slot_mapping, actual: '2 at position 0 \(valid: -1 or \[0, 2\)\)'"),
    (dict(cache=np.zeros((2, 1, 300), np.uint8).view(E4M3)),
     r"Invalid shape for kv_compress_cache, actual: head_dim 300 < row bytes 384"),
    (dict(cache=np.zeros((2, 1, 384), np.uint8)), r"Invalid dtype for kv_compress_cache, actual: 'uint8'"),
])
def test_errors_before_any_write(kw, match):
    cache = kw.pop("cache", _cache(2, 384))
    before = cache.view(np.uint8).copy()
    args = dict(slot_mapping=kw.pop("slot_mapping", np.array([1])))
    with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype), match=match):
        qsfa.kv_compress_epilog_vllm(cache, _x([TOKEN0]), args["slot_mapping"], **kw)
    assert np.array_equal(cache.view(np.uint8), before)


def test_a2a3_rule():
    from qsfa._dispatch import operators

    c = operators()["kv_compress_epilog_vllm"].contract
    a = c.example(np.random.default_rng(0))
    assert c.first_violation(a, chip="950") is None
    assert c.first_violation(a, chip="A2")[0].id == "kv_compress_epilog_vllm.a2a3_unsupported"


def test_golden_set_vllm_call(tmp_path):
    from qsfa.cli import main
    from qsfa.golden import load_manifest

    out = tmp_path / "kcev"
    assert main(["golden", "generate", "--set", "kv-compress-epilog-vllm", "--out", str(out), "-q",
                 "--only", "kcev-vllm-call"]) == 0
    case = load_manifest(out)["cases"][0]

    def arr(name, role):
        e = next(e for e in case["arrays"] if e["name"] == name and e["role"] == role)
        return np.fromfile(out / e["file"], dtype=e["storage"]).reshape(e["shape"])

    before, after = arr("kv_compress_cache", "input"), arr("kv_compress_cache", "output")
    slots = arr("slot_mapping", "input")
    assert (before == 0x11).all() and after.shape == (12, 1, 640 + 32)
    written = np.zeros(12, bool)
    written[slots[slots >= 0]] = True
    assert (after[~written] == 0x11).all() and (after[written, :, 640:] == 0x11).all()
    # token 0 (slot 2 with this case's seed) holds 448 at NoPE column 447, group 6: s = 448 * fp32(1/448) = 1.0,
    # doubled to 2 (byte 0x80), code 448 / 2 = 224 -> 0x76; its group 0 is zero: codes 0, scale byte 0x69
    assert slots[0] >= 0
    row = after[slots[0], 0]
    assert row[128 + 447] == 0x76 and row[128 + 448 + 6] == 0x80
    assert not row[128:192].any() and row[128 + 448] == 0x69
