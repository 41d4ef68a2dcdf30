"""``qkv_rms_norm_rope_cache_with_k_scale`` (Ascend 950), its RoPE scenario: RMSNorm + half-split RoPE of the Q and
K heads of a fused QKV row, a bf16 rotation GEMM, per-token-head FP8 E4M3FN quantisation, V scaled per head to
FP8, and the K / V / K-scale caches written by slot. Documented in
``docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale``.

Source: cannmirror/ops-transformer@c4f5cf7 ``posembedding/qkv_rms_norm_rope_cache_with_k_scale/`` - the kernel
``op_kernel/arch35/qkv_rms_norm_rope_cache_with_k_scale_vf.h`` fixes every rounding point of the vector side:

    x      = fp32(bf16 qkv)                                         exact
    ss     = RN32(sum_{d<64} RN32(x_d^2 + x_{d+64}^2))              Mul, Add of the halves, Reduce SUM
    rms    = sqrt(RN32(ss * fp32(1/128)) + fp32(eps))               Muls, Adds, Sqrt
    y      = RN32(RN32(x / rms) * gamma)                            Div, Mul
    lo, hi = RN32(RN32(y_lo c) - RN32(y_hi s)), RN32(RN32(y_hi c) + RN32(y_lo s))   c, s = cos_sin[pos, :64 / 64:]
    a      = bf16_RINT(lo, hi)                                      CAST_RINT, the cube's A operand (bf16, L1)
    r      = a @ rotation                                           cube: bf16 x bf16, fp32 out
    scale  = RN32(max_d |r_d| / 448),  code = fp8_RINT_SAT(RN32(r / scale))   Div, Div, CAST_RINT with SAT
    v      = fp8_RINT_SAT(RN32(fp32(bf16 v) * v_scale[head]))

The M-RoPE scenario (``mrope_position`` given; hicann/ops-transformer@6c2c05f ``op_kernel/arch35/..._vf.h``,
``tests/assets/..._kernel_golden.py``; recursion-ascend/ops-transformer@a093e95 ``op_kernel/arch35/..._cube.h``)
changes three things. Each token has three positions (T, H, W) and every RoPE lane ``l < 64`` takes its cos / sin
column ``l`` from one of them: H where ``l % 3 == 1 and l // 3 < h``, W where ``l % 3 == 2 and l // 3 < w``, T
otherwise (``mrope_section = [t, h, w]``; the kernel gathers from the three raw rows). Q is not quantised: the cube's
fp32 result leaves through the fixpipe as bf16 (``F322BF16``, to nearest even). K is quantised to INT8 per token and
head:

    scale  = RN32(max_d |r_d| / 127),  y = RN32(r / scale)          Div, Div
    code   = int8_RINT_SAT(fp16_RINT(y))                            CAST_F32_TO_FP16 (NO_SAT), CAST_FP16_TO_INT8 (SAT)

(two roundings: a ``y`` just below a half, such as 3.4995, becomes 3.5 in fp16 and then 4). V is scaled per head and
lane (``v_scale [Nv, 128]``).

The M-RoPE MX scenario (``q_quant_mode = k_quant_mode = "Mx"``; recursion-ascend/ops-transformer@a093e95
``op_kernel/arch35/..._mrope_mx_*.h``, ``op_host/op_tiling/arch35/..._base_tiling.cpp``) has no rotation: MXFP8 Q and
K with an E8M0 byte per 32 lanes built from the amax's bits, on a row path (normalise first) or a 16-row batch path
(normalise late through ``RN32(2^-e / rms)``) that the host tiling picks (:func:`mx_heads`, :func:`mx_k_batch_tokens`,
docs/numerics/cache-writers.md#m-rope-mx-scenario).

The rotation GEMM's fp32 accumulation order inside the cube is not published: each output is modelled as the
correctly rounded sum of its 128 exact bf16 x bf16 products (docs/numerics/open-facts.md#qkv-rotation-sum), as
the indexers' cube sums are. The Reduce SUM of RMSNorm is modelled the same way. Positions: token ``i`` of batch
``b`` is at ``seq_lens[b] - (query_start_loc[b + 1] - query_start_loc[b]) + i`` (0 + i when seq_lens is the
smaller, the kernel's ``CopyCosSinTile``). An all-zero Q / K head gives ``scale = 0`` and ``0 / 0``:
``zero_head`` (docs/numerics/open-facts.md#qkv-zero-head) says what its codes are.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .attention import certified_f32, exact_sum_f32, sum_error_bound
from .k_scale_cache import scatter_pa_kv_cache_with_k_scale, valid_slots
from .rmsnorm_rope import interleave_rope_f32, rms_norm_f32

__all__ = ["qkv_rms_norm_rope_cache_with_k_scale", "positions", "rope_half_split_f32", "rotate_bf16",
           "quant_per_head_fp8", "ZERO_HEAD", "FP8_MAX", "INT8_MAX", "mrope_lane_axes", "mrope_cos_sin",
           "quant_per_head_int8", "mx_scale_bytes", "mx_reciprocal", "mx_token_tile", "mx_k_batch_tokens",
           "mx_q_batch_heads", "mx_heads", "MX_AIV_NUM", "MX_UB_BYTES"]

FP8_MAX = np.float32(448.0)
#: what an all-zero head's codes are (0 / 0 in the kernel): "zero" (qsfa's default) or "nan" (the E4M3FN NaN 0x7F)
ZERO_HEAD = ("zero", "nan")
D = 128
INT8_MAX = np.float32(127.0)


def mrope_lane_axes(mrope_section) -> np.ndarray:
    """Which position stream (0 = T, 1 = H, 2 = W) each of the 64 RoPE lanes reads (int64 [64])."""
    _, h, w = (int(v) for v in mrope_section)
    lane = np.arange(D // 2)
    axes = np.zeros(D // 2, np.int64)
    axes[(lane % 3 == 1) & (lane // 3 < h)] = 1
    axes[(lane % 3 == 2) & (lane // 3 < w)] = 2
    return axes


def mrope_cos_sin(cos_sin, mrope_position, mrope_section):
    """``(cos, sin)`` float32 ``[T, 64]`` of the M-RoPE scenario: lane ``l`` of token ``u`` reads row
    ``mrope_position[u, axis(l)]`` of ``cos_sin`` at columns ``l`` (cos) and ``64 + l`` (sin)."""
    table = np.asarray(cos_sin, np.float32)
    pos = np.asarray(mrope_position, np.int64).reshape(-1, 3)
    rows = pos[:, mrope_lane_axes(mrope_section)]  # [T, 64]
    lane = np.arange(D // 2)[None, :]
    return table[rows, lane], table[rows, D // 2 + lane]


def positions(query_start_loc, seq_lens, n_tokens: int) -> np.ndarray:
    """RoPE position of every token (int64 [T])."""
    qsl = np.asarray(query_start_loc, np.int64).reshape(-1)
    sl = np.asarray(seq_lens, np.int64).reshape(-1)
    t = np.arange(n_tokens, dtype=np.int64)
    b = np.clip(np.searchsorted(qsl, t, side="right") - 1, 0, max(sl.size - 1, 0))
    local = qsl[b + 1] - qsl[b]
    hist = np.where(sl[b] > local, sl[b] - local, 0)
    return hist + t - qsl[b]


def rope_half_split_f32(y: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split RoPE in fp32: ``[y_lo c - y_hi s, y_hi c + y_lo s]`` (two products and one add / subtract, no
    FMA). ``cos`` / ``sin`` ``[..., D/2]`` broadcast against ``y [..., D]``. Written through
    :func:`interleave_rope_f32` (the same three fp32 operations per element) on the halves interleaved."""
    h = y.shape[-1] // 2
    il = np.empty(y.shape, np.float32)
    il[..., 0::2], il[..., 1::2] = y[..., :h], y[..., h:]
    c2 = np.concatenate([cos, cos], axis=-1)
    s2 = np.concatenate([sin, sin], axis=-1)
    return interleave_rope_f32(il, c2, s2)


def rotate_bf16(a: np.ndarray, rotation: np.ndarray) -> np.ndarray:
    """``a [M, D]`` (bf16) @ ``rotation [D, D]`` (bf16): every output RN32 of the exact sum of its D products
    (float32 [M, D]); certified from a float64 product, exact sums where float64 cannot decide."""
    a64 = np.asarray(a).astype(np.float64)
    r64 = np.asarray(rotation).astype(np.float64)
    approx = a64 @ r64
    bound = sum_error_bound(a64.shape[1], np.abs(a64) @ np.abs(r64))
    n = r64.shape[1]

    def exact(i):
        return exact_sum_f32(a64[i // n, :] * r64[:, i % n].T)  # bf16 x bf16: exact in float64

    out = certified_f32(approx, bound, exact)
    return out + np.float32(0)  # -0 -> +0 (an accumulator starting at +0)


def quant_per_head_fp8(r: np.ndarray, zero_head: str = "zero"):
    """Per-row dynamic FP8 E4M3FN quantisation of ``r [..., D]`` (float32): ``(codes uint8 [..., D], scale float32
    [...])`` with ``scale = RN32(amax / 448)`` and ``code = fp8_RINT_SAT(RN32(r / scale))``."""
    amax = np.abs(r).max(axis=-1)
    scale = (amax / FP8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    y = np.clip(r / safe[..., None], -FP8_MAX, FP8_MAX)  # SAT: beyond +-448 (only NaN / inf reach it) -> +-448
    codes = y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    zero = scale == 0
    if zero.any():
        codes[zero] = 0x7F if zero_head == "nan" else 0x00
    return codes, scale


def quant_per_head_int8(r: np.ndarray):
    """Per-row dynamic INT8 quantisation of ``r [..., D]`` (float32), the M-RoPE scenario's K: ``(codes int8 [...,
    D], scale float32 [...])`` with ``scale = RN32(amax / 127)``, ``y = RN32(r / scale)``, ``code =
    int8_RINT_SAT(fp16_RINT(y))``. An all-zero row (0 / 0 in the kernel) gets codes 0: INT8 has no NaN code."""
    amax = np.abs(r).max(axis=-1)
    scale = (amax / INT8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    y = (r / safe[..., None]).astype(np.float32)
    h = y.astype(np.float16)  # CAST_RINT, NO_SAT (|y| <= 127 and a little)
    codes = np.clip(np.rint(h.astype(np.float32)), -128, 127).astype(np.int8)  # CAST_RINT with SAT
    codes[scale == 0] = 0
    return codes, scale


# --- the M-RoPE MX scenario -------------------------------------------------------------------------------------
#: the host's platform figures read by the MX tiling (aivNum, UB bytes): the 950 figures of the operator's own tiling
#: test (recursion-ascend/ops-transformer@a093e95 tests/ut/op_host/test_..._tiling.cpp: aicNum 32 x 2 AIV, UB 262144);
#: the platform's own figures are OPEN (docs/numerics/open-facts.md#qkv-mx-platform)
MX_AIV_NUM = 64
MX_UB_BYTES = 262144
_MX_WINDOW = 1024  # MROPE_MX_POSITION_WINDOW_TOKENS
_MX_BATCH = 16  # MROPE_MX_ROW_BATCH_ROWS
_MX_RECORD = 16 * D * 4 + 16 * 4 * 4 + 16 * 4 * 4 + 8 * 32  # one RowBatch16 scratch record (bytes)
_MX_EDGE = 0x04600001  # amax bits at or below: E8M0 byte 0
_MX_INF = 0x7F800000


def _al(v: int) -> int:
    return -(-v // 32) * 32


def _mx_layout_bytes(tile: int, nq: int, nk: int) -> int:
    """UB bytes of the MX kernel's per-AIV layout for a token tile (mrope_mx_layout.h, TryMakeMropeMxUbLayout and
    TryMakeMropeMxQGlobalTileWaveUbLayout: every region 32-byte aligned, in order)."""
    n = nq + 2 * nk
    b = 2 * _al(D * 4) + _al(nk * D * 4) + _al(D // 2 * 4) + _al(_MX_WINDOW * 3 * 4)
    b += 2 * (_al(tile * n * D * 2) + _al(tile * 3 * D * 4) + _al(tile * 4))
    b += 2 * _al(tile * nk * D) + _al(tile * _al(nk * 4))
    b += _al(tile * nq * D) + _al(tile * nq * 4)
    current = max(1, nq // _MX_BATCH)
    need = max(current, nq // _MX_BATCH * tile + ((tile + 1) // 2 if nq % _MX_BATCH == _MX_BATCH // 2 else 0))
    return b + need * _MX_RECORD


def mx_token_tile(t: int, nq: int, nk: int, ub_bytes: int = MX_UB_BYTES):
    """The host's MX token tile: the largest count <= min(T, 1024, 65535) whose UB layout fits ``ub_bytes``
    (op_host/op_tiling/arch35/..._base_tiling.cpp ``SelectMropeMxTokenTile``); None when not even 1 fits."""
    for c in range(min(t, _MX_WINDOW, 65535), 0, -1):
        if _mx_layout_bytes(c, nq, nk) <= ub_bytes:
            return c
    return None


def mx_k_batch_tokens(t: int, nq: int, nk: int, aiv_num: int = MX_AIV_NUM, ub_bytes: int = MX_UB_BYTES):
    """Which tokens' K rows take the 16-row batch path (bool [T]). The host splits T over min(T, aivNum) AIVs
    (``MakeCoreTokenRange``: the first T % n take one more), each range into tiles of tokenTile inside 1024-token
    position windows (``FillTile``); for Nk = 2 / 4 each tile's first floor(count / (16 / Nk)) * (16 / Nk) tokens
    are batched, the rest go row by row (``ProcessK``). Nk = 1, odd Nk and Nk = 8 go row by row."""
    out = np.zeros(t, bool)
    if nk % 2 or _MX_BATCH % nk or nk == 8 or t == 0:
        return out
    per = _MX_BATCH // nk
    tile = mx_token_tile(t, nq, nk, ub_bytes)
    n = min(t, aiv_num)
    base, rem = divmod(t, n)
    for i in range(n):
        begin = i * base + min(i, rem)
        end = begin + base + (1 if i < rem else 0)
        tb = begin
        while tb < end:
            wb = begin + (tb - begin) // _MX_WINDOW * _MX_WINDOW
            te = min(tb + tile, wb + _MX_WINDOW, end)
            out[tb:tb + (te - tb) // per * per] = True
            tb = te
    return out


def mx_q_batch_heads(nq: int) -> np.ndarray:
    """Which Q heads take the batch path (bool [Nq]): the full 16-head batches; an 8-head tail is normalised first
    (``QRmsNormMropeMxD128GlobalTileWaveVfImpl``), whatever the tiling."""
    return np.arange(nq) < nq // _MX_BATCH * _MX_BATCH


def mx_scale_bytes(amax: np.ndarray) -> np.ndarray:
    """E8M0 scale byte of each float32 group amax, from its bits (``MxQuantCublasScaleD32x4``): ``((bits +
    0x1FFFFF) >> 23) - 8`` above 0x04600001 (the smallest 2^k with amax / 2^k <= 448), 0 at or below, 0xFF for
    Inf / NaN."""
    bits = np.abs(np.asarray(amax, np.float32)).view(np.uint32).astype(np.int64)
    s = np.where(bits > _MX_EDGE, ((bits + 0x1FFFFF) >> 23) - 8, 0)
    return np.where(bits >= _MX_INF, 0xFF, s).astype(np.uint8)


def mx_reciprocal(s: np.ndarray) -> np.ndarray:
    """The float32 1 / scale the kernel builds from the byte's bits, ``s * 0xFF800000 + 0x7F000000`` (mod 2^32):
    2^(127 - s); the NaN 0x7F810000 for byte 0xFF."""
    si = np.asarray(s).astype(np.uint32)
    bits = (si * np.uint32(0xFF800000) + np.uint32(0x7F000000)).astype(np.uint32)
    return np.where(si == 0xFF, np.uint32(0x7F810000), bits).astype(np.uint32).view(np.float32)


def _mx_codes(v: np.ndarray, zero_head: str) -> np.ndarray:
    """fp8 E4M3FN with CAST_RINT and SAT of float32 ``v``; a NaN product (0 x Inf) is ``zero_head``'s code."""
    codes = np.clip(v, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    nan = np.isnan(v)
    if nan.any():
        codes[nan] = 0x7F if zero_head == "nan" else 0x00
    return codes


def mx_heads(x, gamma, cos, sin, epsilon, batch, zero_head="zero"):
    """RMSNorm + M-RoPE + MXFP8 of ``x`` bf16 ``[T, H, 128]`` with lane cosines / sines ``[T, 1, 64]`` (float32);
    ``batch`` bool broadcastable to ``[T, H]`` picks the batch path per row. Returns ``(codes uint8 [T, H, 128],
    scale bytes uint8 [T, H, 4])``.

    Both paths: ``ms = RN32(RN32(ss / 128) + eps)`` (ss as in the RoPE scenario), ``rms = sqrt(ms)``, ``gc = RN32(gamma
    x c)``, ``gs = RN32(gamma x s)`` per half. Row path: ``n = RN32(x / rms)``, ``y_lo = RN32(RN32(n_lo gc_lo) -
    RN32(n_hi gs_hi))``, ``y_hi = RN32(RN32(n_hi gc_hi) + RN32(n_lo gs_lo))``, byte from amax(|y|) per 32 lanes,
    ``code = fp8(RN32(y x 2^-e))``. Batch path: ``z`` as ``y`` with ``x`` for ``n``, byte from ``RN32(amax(|z|) /
    rms)``, ``code = fp8(RN32(z x RN32(2^-e / rms)))``."""
    xf = np.asarray(x).astype(np.float32)
    g = np.asarray(gamma, np.float32)
    h = D // 2
    with np.errstate(all="ignore"):
        sq = xf * xf
        ss = (sq[..., :h] + sq[..., h:]).astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32)
        rms = np.sqrt(ss * np.float32(1.0 / D) + np.float32(epsilon))
        gc_lo, gc_hi, gs_lo, gs_hi = g[:h] * cos, g[h:] * cos, g[:h] * sin, g[h:] * sin

        def rope(v):
            return np.concatenate([v[..., :h] * gc_lo - v[..., h:] * gs_hi,
                                   v[..., h:] * gc_hi + v[..., :h] * gs_lo], axis=-1)

        y = rope(xf / rms)
        z = rope(xf)
        grp = y.shape[:-1] + (4, 32)
        s_row = mx_scale_bytes(np.abs(y).reshape(grp).max(axis=-1))
        codes_row = _mx_codes((y.reshape(grp) * mx_reciprocal(s_row)[..., None]).reshape(y.shape), zero_head)
        s_bat = mx_scale_bytes(np.abs(z).reshape(grp).max(axis=-1) / rms)
        rec = mx_reciprocal(s_bat) / rms
        codes_bat = _mx_codes((z.reshape(grp) * rec[..., None]).reshape(z.shape), zero_head)
    b = np.broadcast_to(np.asarray(batch, bool), xf.shape[:-1])
    return np.where(b[..., None], codes_bat, codes_row), np.where(b[..., None], s_bat, s_row)


def qkv_rms_norm_rope_cache_with_k_scale(qkv, q_gamma, k_gamma, cos_sin, slot_mapping, k_cache, v_cache,
                                         k_scale_cache, query_start_loc, seq_lens, head_nums, *, rotation=None,
                                         v_scale=None, layout_qkv="TND", layout_q_out="NTD", epsilon=1e-6,
                                         mrope_position=None, mrope_section=None, q_quant_mode="PerTokenPerHead",
                                         q_out_dtype="float8_e4m3fn", k_quant_mode="PerTokenPerHead",
                                         zero_head="zero", mx_aiv_num=MX_AIV_NUM, mx_ub_bytes=MX_UB_BYTES):
    """The RoPE scenario, or the M-RoPE one when ``mrope_position`` is given (module docstring). ``qkv`` bf16
    ``[T, Nq+Nk+Nv, 128]`` (TND) or ``[N, T, 128]`` (NTD);
    writes ``k_cache`` / ``v_cache`` (float8_e4m3fn ``[BlockNum, Nk, BlockSize, 128]``) and ``k_scale_cache``
    (float32 ``[BlockNum, Nk, BlockSize, 1]``) in place; returns ``(q_out float8_e4m3fn, q_scale float32, k_cache,
    v_cache, k_scale_cache)`` with q_out ``[Nq, T, 128]`` / ``[T, Nq, 128]`` and q_scale ``[Nq, T]`` / ``[T, Nq]``
    by ``layout_q_out``. M-RoPE: q_out bfloat16 ``[T, Nq, 128]``, q_scale None, ``k_cache`` int8. M-RoPE MX
    (``q_quant_mode = k_quant_mode = "Mx"``): q_out float8_e4m3fn ``[T, Nq, 128]``, q_scale float8_e8m0fnu ``[T,
    Nq, 4]``, ``k_cache`` float8_e4m3fn, ``k_scale_cache`` float8_e8m0fnu ``[BlockNum, Nk, BlockSize, 4]``; no
    rotation; ``mx_aiv_num`` / ``mx_ub_bytes`` are the platform figures the host tiling reads."""
    mrope = mrope_position is not None
    mx = q_quant_mode == "Mx"
    assert k_quant_mode == ("Mx" if mx else "PerTokenPerHead") and zero_head in ZERO_HEAD
    assert q_quant_mode == (("Mx" if mx else "NoQuant") if mrope else "PerTokenPerHead")
    nq, nk, nv = (int(h) for h in head_nums)
    x = np.asarray(qkv)
    if layout_qkv == "NTD":
        x = x.transpose(1, 0, 2)
    t = x.shape[0]
    if mrope:
        cos, sin = mrope_cos_sin(cos_sin, mrope_position, mrope_section)
    else:
        cs = np.asarray(cos_sin, np.float32)[positions(query_start_loc, seq_lens, t)]  # [T, D]
        cos, sin = cs[:, :D // 2], cs[:, D // 2:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if mx:
        vs = np.asarray(v_scale, np.float32)
        v_codes = np.clip(x[:, nq + nk:].astype(np.float32) * vs[None], -FP8_MAX, FP8_MAX).astype(
            ml_dtypes.float8_e4m3fn)
        q_codes, q_scale = mx_heads(x[:, :nq], q_gamma, cos, sin, epsilon, mx_q_batch_heads(nq)[None, :], zero_head)
        k_codes, k_scale = mx_heads(x[:, nq:nq + nk], k_gamma, cos, sin, epsilon,
                                    mx_k_batch_tokens(t, nq, nk, int(mx_aiv_num), int(mx_ub_bytes))[:, None],
                                    zero_head)
        nb, _, bs, _ = k_cache.shape
        slots = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
        keep = valid_slots(slots, nb * bs)
        blk, off = slots[keep] // bs, slots[keep] % bs
        k_cache.view(np.uint8)[blk, :, off, :] = k_codes[keep]
        v_cache.view(np.uint8)[blk, :, off, :] = v_codes.view(np.uint8)[keep]
        k_scale_cache.view(np.uint8)[blk, :, off, :] = k_scale[keep]
        return (q_codes.view(ml_dtypes.float8_e4m3fn), q_scale.view(ml_dtypes.float8_e8m0fnu), k_cache, v_cache,
                k_scale_cache)
    rots = []
    for lo, hi, gamma in ((0, nq, q_gamma), (nq, nq + nk, k_gamma)):
        y = rms_norm_f32(x[:, lo:hi], gamma, epsilon, halves_first=True)
        a = rope_half_split_f32(y, cos, sin).astype(ml_dtypes.bfloat16)  # CAST_RINT
        rots.append(rotate_bf16(a.reshape(-1, D), rotation).reshape(t, hi - lo, D))
    vs = np.asarray(v_scale, np.float32)
    v = x[:, nq + nk:].astype(np.float32) * (vs[None] if mrope else vs[None, :, None])
    v_codes = np.clip(v, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    if mrope:
        k_codes, k_scale = quant_per_head_int8(rots[1])
        scatter_pa_kv_cache_with_k_scale(k_codes, v_codes, k_cache, v_cache, slot_mapping, k_scale, k_scale_cache)
        return rots[0].astype(ml_dtypes.bfloat16), None, k_cache, v_cache, k_scale_cache  # F322BF16; TND only
    (q_codes, q_scale), (k_codes, k_scale) = (quant_per_head_fp8(r, zero_head) for r in rots)
    scatter_pa_kv_cache_with_k_scale(k_codes.view(ml_dtypes.float8_e4m3fn), v_codes, k_cache, v_cache, slot_mapping,
                                     k_scale, k_scale_cache)
    q_out = q_codes.view(ml_dtypes.float8_e4m3fn)
    if layout_q_out == "NTD":
        q_out, q_scale = np.ascontiguousarray(q_out.transpose(1, 0, 2)), np.ascontiguousarray(q_scale.T)
    return q_out, q_scale, k_cache, v_cache, k_scale_cache
