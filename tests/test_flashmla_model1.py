"""FlashMLA's MODEL1 FP8 sparse cache (deepseek-ai/FlashMLA tests/quant.py, MODEL1_FP8Sparse).

The expected bytes and values below are worked out by hand (comments give the arithmetic); the code under
test computes none of them.
"""

import importlib.util

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa import layouts

BF16 = ml_dtypes.bfloat16


def test_block_bytes():
    # 584 bytes per token, blocks padded to a multiple of 576
    assert layouts.flashmla_model1_block_bytes(1) == 1152  # 584 -> 2 * 576
    assert layouts.flashmla_model1_block_bytes(2) == 1728  # 1168 -> 3 * 576
    assert layouts.flashmla_model1_block_bytes(64) == 37440  # 37376 -> 65 * 576
    assert layouts.flashmla_model1_block_bytes(72) == 42048  # 72 * 584 = 73 * 576 exactly: no padding


def _hand_k():
    """k [1, 2, 1, 512]: token 0 exercises one rule per tile, token 1 is zero NoPE with one RoPE value."""
    k = np.zeros((1, 2, 1, 512), np.float32)
    t0 = k[0, 0, 0]
    t0[0:3] = [1.0, -2.0, 3.0]  # tile 0: amax 3
    # tile 1 (64..127): all zero
    t0[128], t0[129] = 448.0, 0.3  # tile 2: amax 448; bf16(0.3) = 0.30078125
    t0[192] = 0.01  # tile 3: bf16(0.01) = 0.010009765625, below the 1e-4 floor
    t0[256:260] = [448.0, 1.0625, 1.1875, 300.0]  # tile 4: scale 1, two E4M3 ties and a plain rounding
    t0[320] = 500.0  # tile 5
    t0[384] = -65536.0  # tile 6
    t0[448], t0[449], t0[511] = 1.0, -0.5, 2.0  # RoPE
    k[0, 1, 0, 448 + 5] = 3.0
    return k.astype(BF16)


# Hand-worked bytes of _hand_k() (block_size 2: 1728 bytes)
#   tile 0: 3 / 448 = 0.0067 -> s = 2^-7 (byte 127 - 7 = 0x78); 1/s = 128 = 2^7 -> E4M3 exponent field
#           7 + 7 = 14: 0x70; -2/s = -256 = -2^8: 0x80 | 0x78 = 0xF8; 3/s = 384 = 1.5 * 2^8: 0x7C
#   tile 1: zero -> v = max(0, 1e-4) -> s = 2^-13 (0.000122 >= 1e-4 > 2^-14): byte 127 - 13 = 0x72
#   tile 2: 448 / 448 = 1 -> s = 1 (0x7F); 448 = 1.75 * 2^8: 0x7E; 0.30078125 = 1.203 * 2^-2 -> nearest
#           1.25 * 2^-2 (mantissa 010): 0x28 | 0x02 = 0x2A
#   tile 3: 0.01 / 448 < 1e-4 -> s = 2^-13 (0x72); 0.010009765625 * 2^13 = 82 -> between 80 (1.25 * 2^6) and
#           88 (1.375 * 2^6), nearer 80: exponent 13, mantissa 010: 0x6A
#   tile 4: s = 1 (0x7F); 448: 0x7E; 1.0625 ties 1.0 / 1.125 -> even 1.0: 0x38; 1.1875 ties 1.125 / 1.25
#           -> even 1.25: 0x3A; 300 between 288 and 320 -> 288 = 1.125 * 2^8: 0x79
#   tile 5: 500 / 448 = 1.116 -> s = 2 (0x80); 250 between 240 and 256 -> 256: 0x78
#   tile 6: 65536 / 448 = 146.3 -> s = 256 (0x87); -65536 / 256 = -256: 0xF8
#   RoPE: bf16 1.0 = 0x3F80, -0.5 = 0xBF00, 2.0 = 0x4000, 3.0 = 0x4040 (little-endian in the cache)
def _hand_cache():
    c = np.zeros(1728, np.uint8)
    c[0:3] = [0x70, 0xF8, 0x7C]
    c[128:130] = [0x7E, 0x2A]
    c[192] = 0x6A
    c[256:260] = [0x7E, 0x38, 0x3A, 0x79]
    c[320] = 0x78
    c[384] = 0xF8
    c[448:452] = [0x80, 0x3F, 0x00, 0xBF]  # token 0 RoPE[0], RoPE[1]
    c[574:576] = [0x00, 0x40]  # token 0 RoPE[63]
    c[576 + 448 + 10:576 + 448 + 12] = [0x40, 0x40]  # token 1 RoPE[5]
    c[1152:1160] = [0x78, 0x72, 0x7F, 0x72, 0x7F, 0x80, 0x87, 0x00]  # token 0: 7 scales + pad
    c[1160:1168] = [0x72] * 7 + [0x00]  # token 1: all-zero NoPE tiles
    # [1168, 1728): block padding, zero
    return c[None]


def test_quantize_hand_worked_block():
    got = layouts.flashmla_model1_quantize(_hand_k())
    assert got.dtype == np.uint8 and got.shape == (1, 1728)
    want = _hand_cache()
    diff = np.flatnonzero(got[0] != want[0])
    assert diff.size == 0, f"bytes differ at {diff[:10].tolist()}: got {got[0, diff[:10]].tolist()}"


def test_dequantize_hand_worked_block():
    k = layouts.flashmla_model1_dequantize(_hand_cache(), block_size=2)
    assert k.dtype == BF16 and k.shape == (1, 2, 1, 512)
    want = np.zeros((2, 512), np.float32)
    want[0, 0:3] = [1.0, -2.0, 3.0]
    want[0, 128:130] = [448.0, 0.3125]
    want[0, 192] = 80 * 2.0**-13
    want[0, 256:260] = [448.0, 1.0, 1.25, 288.0]
    want[0, 320] = 512.0
    want[0, 384] = -65536.0
    want[0, 448], want[0, 449], want[0, 511] = 1.0, -0.5, 2.0
    want[1, 453] = 3.0
    np.testing.assert_array_equal(k[0, :, 0].astype(np.float32), want)


def test_dequantize_arbitrary_bytes_multiplies_in_bf16():
    c = np.zeros((1, 1152), np.uint8)  # block_size 1: scales at byte 576
    c[0, 0:4] = [0x7F, 0xFF, 0x7E, 0x01]  # tile 0: +NaN code, -NaN code, 448, 2^-9
    c[0, 64] = 0x7E  # tile 1: 448
    c[0, 128] = 0x38  # tile 2: 1.0
    c[0, 192] = 0x01  # tile 3: 2^-9
    c[0, 448:450] = [0xC1, 0xFF]  # RoPE[0] = bf16 0xFFC1, a NaN with a payload: copied as is
    c[0, 576:583] = [0x00, 0xFE, 0xFF, 0x7F - 9, 0, 0, 0]
    k = layouts.flashmla_model1_dequantize(c, block_size=1)
    bits = k.reshape(-1).view(np.uint16)
    # tile 0, scale 2^-127 (bf16 subnormal 0x0040): NaN * s -> qsfa's NaN 0x7FC0 (sign dropped);
    # 448 * 2^-127 = 1.75 * 2^-119 = 0x0460; 2^-9 * 2^-127 = 2^-136 rounds to 0 in bf16
    assert bits[0:4].tolist() == [0x7FC0, 0x7FC0, 0x0460, 0x0000]
    assert bits[64] == 0x7F80  # 448 * 2^127 overflows to +inf
    assert bits[128] == 0x7FC0  # scale byte 0xFF is NaN
    assert bits[192] == 0x3680  # 2^-9 * 2^(118 - 127) = 2^-18: exponent field 127 - 18 = 109, 109 << 7 = 0x3680
    assert bits[448] == 0xFFC1


def test_round_trip_rope_exact_nope_within_half_a_code_step():
    rng = np.random.default_rng(7)
    k = (rng.standard_normal((3, 5, 1, 512)) * np.exp2(rng.integers(-12, 12, (3, 5, 1, 1)))).astype(BF16)
    k[0, 0, 0, 64:128] = 0
    cache = layouts.flashmla_model1_quantize(k)
    back = layouts.flashmla_model1_dequantize(cache, block_size=5)
    assert np.array_equal(back[..., 448:].view(np.uint16), k[..., 448:].view(np.uint16))
    x = k[..., :448].astype(np.float64).reshape(3, 5, 7, 64)
    y = back[..., :448].astype(np.float64).reshape(3, 5, 7, 64)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    s = np.exp2(np.ceil(np.log2(np.maximum(amax / 448, 1e-4))))  # float64: no bf16 amax sits near 2^k
    # E4M3 keeps 3 mantissa bits: error <= 2^-4 relative, or half the subnormal step 2^-9 * s
    assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10))
    # the stored scale bytes are log2(s) + 127
    sb = cache[:, 5 * 576:5 * 584].reshape(3, 5, 8)
    assert np.array_equal(sb[..., :7], (np.log2(s[..., 0]) + 127).astype(np.uint8))
    assert not sb[..., 7].any() and not cache[:, 5 * 584:].any()


def test_requantising_dequantised_values_keeps_them():
    rng = np.random.default_rng(3)
    k = (rng.standard_normal((2, 4, 1, 512)) * 30).astype(BF16)
    once = layouts.flashmla_model1_dequantize(layouts.flashmla_model1_quantize(k), block_size=4)
    twice = layouts.flashmla_model1_dequantize(layouts.flashmla_model1_quantize(once), block_size=4)
    assert np.array_equal(once.view(np.uint16), twice.view(np.uint16))


def _max_tile(bits: int):
    k = np.zeros((1, 1, 1, 512), np.uint16)
    k[0, 0, 0, 0] = bits
    k[0, 0, 0, 1] = 0x3F80  # 1.0 in the same tile
    return k.view(BF16)


@pytest.mark.parametrize("bits, code, scale, back", [
    (0x7F60, 0x7E, 0xF6, 0x7F60),  # amax 1.75 * 2^127 = 448 * 2^119: the last scale 2^119
    (0x7F61, 0x76, 0xF7, 0x7F60),  # scale 2^120: 225.x -> 224
    (0x7F77, 0x77, 0xF7, 0x7F70),  # 247.x -> 240 = 0x7F70: the largest input still a fixed point after one round
])
def test_requantising_holds_up_to_0x7f77(bits, code, scale, back):
    k = _max_tile(bits)
    cache = layouts.flashmla_model1_quantize(k)
    assert cache[0, 0] == code and cache[0, 576] == scale  # block_size 1: the scale bytes at 576
    once = layouts.flashmla_model1_dequantize(cache, block_size=1)
    assert once.view(np.uint16)[0, 0, 0, 0] == back
    twice = layouts.flashmla_model1_dequantize(layouts.flashmla_model1_quantize(once), block_size=1)
    assert np.array_equal(once.view(np.uint16), twice.view(np.uint16))


@pytest.mark.parametrize("bits", [0x7F78, 0x7F7F])  # 248 * 2^120 (a tie, to the even code 256) and bf16 max
def test_requantising_fails_from_0x7f78_on(bits):
    cache = layouts.flashmla_model1_quantize(_max_tile(bits))
    assert cache[0, 0] == 0x78 and cache[0, 576] == 0xF7  # code 256, scale 2^120: 2^128
    once = layouts.flashmla_model1_dequantize(cache, block_size=1)
    assert once.view(np.uint16)[0, 0, 0, 0] == 0x7F80  # +inf
    with pytest.raises(qsfa.InvalidArgument, match="must not contain inf or nan"):
        layouts.flashmla_model1_quantize(once)


def test_nan_bits_are_qsfa_s_own_and_torch_s_vary_with_its_path():
    for n in (1, 7, 64, 4096):  # qsfa: 0x7FC0 at every NaN, whatever the size
        c = np.zeros((n, 1152), np.uint8)
        c[:, 0] = 0xFF  # -NaN code
        c[:, 576] = 0x7F
        bits = layouts.flashmla_model1_dequantize(c, block_size=1).view(np.uint16)[:, 0, 0, 0]
        assert (bits == 0x7FC0).all()
    torch = pytest.importorskip("torch")

    def torch_bits(n):
        code = torch.full((n,), 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
        return int(((code * torch.ones(n, dtype=torch.bfloat16)).view(torch.int16)[-1]).item()) & 0xFFFF

    assert torch_bits(7) == 0x7FC0  # its scalar loop
    assert torch_bits(4096) == 0xFFFF  # its vectorised loop: the NaN bits differ from qsfa's


def test_layout_positions_block_size_64():
    # a distinct marker per (block, token): NoPE[0] = token + 1 at byte 576 t, RoPE[63] at 576 t + 574
    nb, bs = 2, 64
    k = np.zeros((nb, bs, 1, 512), np.float32)
    k[:, :, 0, 0] = np.arange(1, bs + 1)[None] * np.array([1, -1])[:, None]
    k[:, :, 0, 511] = 1.0
    cache = layouts.flashmla_model1_quantize(k.astype(BF16))
    assert cache.shape == (2, 37440)
    t = np.arange(bs)
    # NoPE[0] = t + 1 is the tile amax: s = 2^ceil(log2((t + 1) / 448)); RoPE[63] = 1.0 = 0x3F80 -> 80 3F
    assert (cache[:, 576 * t + 574] == 0x80).all() and (cache[:, 576 * t + 575] == 0x3F).all()
    assert (cache[0, 576 * t] < 0x80).all() and (cache[1, 576 * t] >= 0x80).all()  # sign bit per block
    # tile-0 scale byte of token t sits at 576 * 64 + 8 t; tiles 1..6 are zero tiles (0x72)
    s0 = cache[:, 576 * bs + 8 * t]
    want = 127 + np.ceil(np.log2(np.maximum((t + 1) / 448, 1e-4))).astype(int)
    assert (s0 == want[None]).all()
    assert (cache[:, 576 * bs + 8 * t[:, None] + np.arange(1, 7)] == 0x72).all()


def test_float8_cache_dtype_is_accepted():
    cache = _hand_cache()
    a = layouts.flashmla_model1_dequantize(cache.view(ml_dtypes.float8_e4m3fn), block_size=2)
    b = layouts.flashmla_model1_dequantize(cache, block_size=2)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("call,match", [
    (lambda: layouts.flashmla_model1_quantize(np.zeros((1, 2, 1, 576), BF16)),
     r"Invalid shape for k, actual: \(1, 2, 1, 576\), reason: must be \[num_blocks, block_size, 1, 512\]"),
    (lambda: layouts.flashmla_model1_quantize(np.zeros((1, 2, 1, 512), np.float32)),
     r"Invalid dtype for k, actual: 'float32', reason: must be one of \{'bfloat16'\}"),
    (lambda: layouts.flashmla_model1_quantize(np.full((1, 2, 1, 512), np.inf, BF16)),
     r"Invalid value for k, actual: inf at index \(0, 0, 0, 0\), reason: must not contain inf or nan"),
    (lambda: layouts.flashmla_model1_dequantize(np.zeros((1, 1728), np.uint8), block_size=3),
     r"Invalid shape for cache, actual: 1728 bytes per block \(block_size 3 needs 2304\)"),
    (lambda: layouts.flashmla_model1_dequantize(np.zeros((1, 1728), np.uint8), block_size=0),
     r"Invalid value for block_size, actual: 0, reason: must be an integer >= 1"),
    (lambda: layouts.flashmla_model1_dequantize(np.zeros((1, 1728), np.int16), block_size=2),
     r"Invalid dtype for cache, actual: 'int16'"),
])
def test_errors(call, match):
    with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype), match=match):
        call()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_scale_ceiling_agrees_with_float32_log2_for_every_bf16_amax():
    """FlashMLA computes 2^ceil(log2(max(amax / 448, 1e-4))) with torch float32 log2; qsfa takes the exact
    power-of-two ceiling. They agree for every positive finite bf16 amax (the only amax a bf16 tile has):
    one tile per bf16 value, the stored scale bytes against torch's float32 formula."""
    import torch

    amax = np.arange(1, 0x7F80, dtype=np.uint16).view(BF16)  # every positive finite bf16, 32639 values
    n_tok = -(-amax.size // 7)
    first = np.zeros(n_tok * 7, BF16)
    first[:amax.size] = amax
    k = np.zeros((1, n_tok, 1, 8, 64), BF16)
    k[0, :, 0, :7, 0] = first.reshape(n_tok, 7)  # element 0 of each NoPE tile holds the tile's amax
    k = k.reshape(1, n_tok, 1, 512)
    cache = layouts.flashmla_model1_quantize(k)
    got = cache[0, 576 * n_tok:584 * n_tok].reshape(n_tok, 8)[:, :7].reshape(-1)[:amax.size]
    v = torch.clamp_min(torch.from_numpy(amax.astype(np.float32)) / 448.0, 1e-4)
    s = torch.pow(2, v.log2().ceil()).numpy().astype(np.float32)
    mant, ex = np.frexp(s)
    assert (mant == 0.5).all()
    np.testing.assert_array_equal(got, (ex - 1 + 127).astype(np.uint8))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_tensors_in_and_out():
    import torch

    k = torch.from_numpy(_hand_k().view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    cache = layouts.flashmla_model1_quantize(k)
    assert isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8
    assert np.array_equal(cache.numpy(), _hand_cache())
    back = layouts.flashmla_model1_dequantize(cache, block_size=2)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16 and tuple(back.shape) == (1, 2, 1, 512)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_codes_and_dequantised_values_agree_with_torch_casts():
    """The NoPE codes are torch's float32 -> float8_e4m3fn cast of x / s and the dequantised values torch's
    bf16 product of the two bf16 casts - the operations FlashMLA's tests/quant.py is written with."""
    import torch

    rng = np.random.default_rng(11)
    k = (rng.standard_normal((2, 6, 1, 512)) * np.exp2(rng.integers(-20, 20, (2, 6, 1, 7 * 64 + 64)))).astype(BF16)
    cache = layouts.flashmla_model1_quantize(k)
    x = torch.from_numpy(k[..., :448].astype(np.float32)).reshape(2, 6, 7, 64)
    sbytes = cache[:, 6 * 576:6 * 584].reshape(2, 6, 8)[..., :7]
    s = torch.from_numpy(sbytes.copy()).view(torch.float8_e8m0fnu)
    codes = (x / s.float()[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(2, 6, 448).numpy()
    assert np.array_equal(cache[:, :6 * 576].reshape(2, 6, 576)[..., :448], codes)
    want = (torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.bfloat16).reshape(2, 6, 7, 64)
            * s.to(torch.bfloat16)[..., None]).reshape(2, 6, 448)
    back = layouts.flashmla_model1_dequantize(cache, block_size=6)
    assert np.array_equal(back[:, :, 0, :448].view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))


def test_golden_set(tmp_path):
    from qsfa.cli import main
    from qsfa.golden import load_manifest

    out = tmp_path / "m1"
    assert main(["golden", "generate", "--set", "flashmla-model1", "--out", str(out), "-q",
                 "--only", "m1?-bs2", "--only", "m1q-bs72-spread"]) == 0
    cases = {c["name"]: c for c in load_manifest(out)["cases"]}

    def arr(case, name):
        e = next(e for e in cases[case]["arrays"] if e["name"] == name)
        return np.fromfile(out / e["file"], dtype=e["storage"]).reshape(e["shape"])

    # the dequantise case reads exactly the cache the quantise case wrote (shared seed)
    assert np.array_equal(arr("m1d-bs2", "cache"), arr("m1q-bs2", "cache"))
    assert arr("m1q-bs2", "cache").shape == (2, 1728)
    assert (arr("m1q-bs2", "cache")[:, 1152:1168].reshape(2, 2, 8)[..., 1] == 0x72).all()  # zero tile 1
    assert arr("m1q-bs72-spread", "cache").shape == (1, 72 * 584)
    k_in, k_out = arr("m1q-bs2", "k").view(np.uint16), arr("m1d-bs2", "k").view(np.uint16)
    assert np.array_equal(k_in[..., 448:], k_out[..., 448:])  # RoPE bits survive
