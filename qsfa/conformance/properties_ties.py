"""Rounding-direction properties of the non-attention and V4 cells of docs/numerics/chips.md, hit exactly on a tie.

:mod:`qsfa.conformance.properties_chips` covers the QSFA / SFA attention cells; this module the rest of the table:
the KvRmsNormRopeCache cache casts, the dynamic_block_quant order and casts, and the DeepSeek-V4 shared-KV
attention (P, output, and the OPEN mixed-quant K rounding). Each ``<op>.rounding_ties`` property draws examples
around a construction whose exact value at one rounding point is a midpoint of the target format (or, for the
dynamic_block_quant order, a value the two orders put on either side of a midpoint) and asserts the output bytes
against values written out by hand for each mode. The chip's mode comes from the chips.md table as data
(``qsfa.chips``); a cell the chip does not have is left out, and a property with no cell on the chip is not
applicable there (decided before drawing).

Cells (the ``edge`` pin names; each runs in the edge phase):

* kv_rmsnorm_rope_cache - RoPE with cos = 1 and sin = 0 is the interleave permutation (exact), so the K path
  carries the input to the cache cast unchanged; V2 (A2/A3) takes v raw into ckv_cache, and RMSNorm of a row of
  +-256 is +-1 exactly (mean 2^16: the epsilon is below half an fp32 ulp).

  - ``int8:<chip>``: y = x * 2 = +-2.5, +-3.5: RINT (both chips) -2/2, +-4; ROUND would give +-3 (and TRUNC 3 for
    3.5). 950: V1, k_cache; A2/A3: V2, ckv_cache (v path).
  - ``float8_e4m3fn:950`` / ``float8_e5m2:950``: x = +-1.0625, 1.1875 (E4M3) / +-1.125, 1.375 (E5M2), scale 1:
    RINT 1.0, 1.25 / 1.0, 1.5; ROUND moves the odd midpoints up.
  - ``hifloat8:950``: +-1.0625 (the midpoint of 1.0 and 1.125): ROUND 1.125 (0x09 / 0x89), RINT 1.0; and
    1.25 * 32768 = 40960: NO_SAT +Inf (0x6F), the saturating cast 32768 (0x6E).
  - ``bfloat16:<chip>`` / ``float16:<chip>``: one RoPE lane = 1 + 1 * e with e = 2^-8 (bf16) / 2^-11 (fp16):
    the midpoint of 1 and the next value; RINT 1.0 in k_cache. 950: V1 on the raw input;
    A2/A3: V2 on the RMSNorm result.

* dynamic_block_quant (row block 1, column block 128; the chip's scale order):

  - ``order:int8``: a block of amax 7.46875 holding amax / 2: the exact quotient is 63.5. The 950 divides (63.5,
    RINT 64, scale 0x3D70E1C4); A2/A3 multiply by fp32(fp32(1/amax) * 127) < 127 / amax (63.499996 -> 63, scale
    amax * fp32(1/127) = 0x3D70E1C3).
  - ``rint:int8``: amax 127 (scale 1 on both chips: fp32(fp32(1/127) * 127) = 1), x = +-62.5, 126.5: RINT 62,
    126 (ROUND 63, 127).
  - ``rint:float8_e4m3fn`` / ``rint:float8_e5m2`` (950): amax = TYPE_MAX (448 / 57344), scale 1, x as for
    KvRmsNormRopeCache.
  - ``round:hifloat8`` (950, round_mode "round"): amax 32768, x = +-1.0625: ROUND 0x09 / 0x89.

* V4 attention (sparse_flash_mla on A2/A3 and the 950, sparse_attn_sharedkv on A3, mixed_quant_sparse_flash_mla
  and kv_quant_sparse_attn_sharedkv on the 950): K = V, one query row, sinks -inf, heads as the chip allows.

  - ``p:<dtype>``: the QSFA P construction (qsfa.conformance.properties_chips.EXPECT): token 0 scores 0, token 1
    scores x with exp(x) a midpoint; P is ROUND on every chip.
  - ``out:<dtype>``: q = 0, two tokens whose lane holds 256 / 258 (bf16) or 2048 / 2050 (fp16): the mean is a
    midpoint; A2/A3 bf16 RINT 256, otherwise ROUND 258 / 2050.
  - ``k:bfloat16`` (mixed_quant_sparse_flash_mla): one token, quant_mode 1, code 1.5 times the tile's bf16 scale
    1.0234375 = 196.5 / 128: RINT 196 / 128 (qsfa's default, OPEN for the kernel:
    docs/numerics/open-facts.md#mixed-quant-k-rounding), ROUND 197 / 128.

  - ``s2_tile:float16`` (sparse_flash_mla): CSA, 128 window tokens and compressed tokens 0..127 scoring x
    (exp(x) = 3073 / 4096, an fp16 midpoint), compressed token 128 scoring 0; V lane +4096 at compressed token 0,
    -3072 at token 128. A 128-token tile (950) gives P = 1 to token 0 and rescales it by exp(x) exactly: out =
    1 / l; a 512-token tile (A2/A3) rounds its P against the final max, ROUND(exp(x)) = 0.75048828125: out = 2 / l
    (l = 256 exp(x) + 1). Checked to 2^-9 relative (the two differ by a factor 2).

  The quantised operators keep V lanes in the RoPE part (bf16 values, copied raw), where 100 and 258 are exact.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from ._support import call, current_chip, fail

__all__ = ["tie_properties", "CELLS"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_QDT = {"bfloat16": _BF16, "float16": np.dtype(np.float16)}
_A2A3 = ("A2", "A3")


class Cell(NamedTuple):
    """One construction: ``build(draw, chip) -> (args, param)``; ``expect(args, param, chip) -> [(output, index,
    want, other, what)]`` - the value the chip's mode gives, the value the other mode gives, and the point."""

    edge: str
    chips: tuple
    build: Callable
    expect: Callable


class _Near(NamedTuple):
    """An expected value known to a relative bound (the S2 tile cell: the two tile sizes differ by a factor 2)."""

    value: float
    rtol: float


def _chip_of(op, args, backend) -> str:
    from .. import chips as C
    from .._dispatch import get_backend, operator

    return current_chip() or get_backend(backend).chip() or C.chip_for_args(operator(op).contract, args)


# ---------------------------------------------------------------------------------------------------------------
# kv_rmsnorm_rope_cache

KRR = "kv_rmsnorm_rope_cache"
#: 8-bit cache format -> (input values, scale, {mode: stored values}) for a positive sign; the stored values are
#: decoded (int8 as integers), negative sign: every value negated
_KRR8 = {
    "int8": ((1.25, 1.75), 2.0, {"rint": (2.0, 4.0), "round": (3.0, 4.0)}),
    "float8_e4m3fn": ((1.0625, 1.1875), 1.0, {"rint": (1.0, 1.25), "round": (1.125, 1.25)}),
    "float8_e5m2": ((1.125, 1.375), 1.0, {"rint": (1.0, 1.5), "round": (1.25, 1.5)}),
}
#: HiFloat8 codes (qsfa.formats; docs/numerics/formats.md): 1.0 = 0x08, 1.125 = 0x09, 32768 = 0x6E, +Inf = 0x6F
_HIF8 = {"round": (0x09, 0x6F), "rint": (0x08, 0x6E)}
_EPS16 = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
_DK = 32  # K (RoPE) width of the constructions


def _krr_base(version, k_fmt, ckv_fmt, dtype):
    from ..ops.kv_rmsnorm_rope_cache import kv_rmsnorm_rope_cache_example

    return kv_rmsnorm_rope_cache_example(np.random.default_rng(0), version=version, cache_mode="Norm", dtype=dtype,
                                         k_fmt=k_fmt, ckv_fmt=ckv_fmt, batch=1, heads=1, seq=1, dv=64, dk=_DK,
                                         rope=_DK, param_shape="ND", skip=False, is_output_kv=False)


def _krr_identity_rope(a, dtype):
    dt = _QDT[dtype]
    a["cos"] = np.ones(a["cos"].shape, dt)
    a["sin"] = np.zeros(a["sin"].shape, dt)
    a["index"] = np.zeros(a["index"].shape, a["index"].dtype)


def _krr_q8(fmt):
    def build(draw, chip):
        dtype = draw(st.sampled_from(("bfloat16", "float16")))
        lane = draw(st.integers(0, _DK // 2 - 2))  # where the two values start (RoPE output lanes)
        sign = draw(st.sampled_from((1, -1)))
        vals, scale, _ = _KRR8[fmt]
        if chip in _A2A3:  # V2: v -> ckv_cache, raw times c_kv_scale
            a = _krr_base(2, dtype, fmt, dtype)
            v = np.zeros(a["v"].shape, np.float32)
            v[..., lane:lane + 2] = np.float32(vals) * sign
            a["v"] = v.astype(_QDT[dtype])
            a["c_kv_scale"] = np.full(a["c_kv_scale"].shape, scale, np.float32)
        else:  # V1: kv rope lanes 2j -> k lanes j (cos 1, sin 0), times k_rope_scale
            a = _krr_base(1, fmt, dtype, dtype)
            kv = np.zeros(a["kv"].shape, np.float32)
            dv = a["gamma"].shape[-1]
            for i, x in enumerate(vals):
                kv[..., dv + 2 * (lane + i)] = x * sign
            a["kv"] = kv.astype(_QDT[dtype])
            a["k_rope_scale"] = np.full(a["k_rope_scale"].shape, scale, np.float32)
        _krr_identity_rope(a, dtype)
        return a, lane * 2 + (sign < 0)

    def expect(a, param, chip):
        lane, sign = param >> 1, (-1.0 if param & 1 else 1.0)
        out, name = ("ckv_cache", "ckv_cache (v path)") if a.get("v") is not None else ("k_cache", "k_cache")
        want, other = _KRR8[fmt][2]["rint"], _KRR8[fmt][2]["round"]
        return [(out, (0, 0, 0, lane + i), sign * w, sign * o, f"{name} {fmt} cast (RINT)")
                for i, (w, o) in enumerate(zip(want, other))]

    cells = [Cell(f"{fmt}:950", ("950",), build, expect)]
    if fmt == "int8":  # A2/A3 quantise to int8 only
        cells.insert(0, Cell(f"{fmt}:A2", _A2A3, build, expect))
    return cells


def _krr_hif8():
    def build(draw, chip):
        dtype = draw(st.sampled_from(("bfloat16", "float16")))
        lane = draw(st.integers(0, _DK // 2 - 2))
        sign = draw(st.sampled_from((1, -1)))
        a = _krr_base(1, "hifloat8", dtype, dtype)
        kv = np.zeros(a["kv"].shape, np.float32)
        dv = a["gamma"].shape[-1]
        kv[..., dv + 2 * lane] = 1.0625 * sign
        kv[..., dv + 2 * (lane + 1)] = 1.25 * sign
        a["kv"] = kv.astype(_QDT[dtype])
        s = np.ones(a["k_rope_scale"].shape, np.float32)
        s[..., lane + 1] = 32768.0
        a["k_rope_scale"] = s
        _krr_identity_rope(a, dtype)
        return a, lane * 2 + (sign < 0)

    def expect(a, param, chip):
        lane, neg = param >> 1, (0x80 if param & 1 else 0)
        return [("k_cache", (0, 0, 0, lane), _HIF8["round"][0] | neg, _HIF8["rint"][0] | neg,
                 "k_cache HiFloat8 cast (ROUND)"),
                ("k_cache", (0, 0, 0, lane + 1), _HIF8["round"][1] | neg, _HIF8["rint"][1] | neg,
                 "k_cache HiFloat8 overflow (NO_SAT: Inf)")]

    return [Cell("hifloat8:950", ("950",), build, expect)]


def _krr_16():
    def build_for(dtype):
        def build(draw, chip):
            lane = draw(st.integers(0, _DK // 2 - 1))  # the RoPE pair (2 lane, 2 lane + 1) -> output lane half + lane
            sign = draw(st.sampled_from((1, -1)))
            e = _EPS16[dtype]
            if chip in _A2A3:  # V2: RMSNorm(+-256 everywhere) = +-1 exactly, gamma 1
                a = _krr_base(2, dtype, dtype, dtype)
                a["kv"] = np.full(a["kv"].shape, 256.0 * sign, _QDT[dtype])
                a["gamma"] = np.ones(a["gamma"].shape, _QDT[dtype])
            else:
                a = _krr_base(1, dtype, dtype, dtype)
                kv = np.zeros(a["kv"].shape, np.float32)
                dv = a["gamma"].shape[-1]
                kv[..., dv + 2 * lane: dv + 2 * lane + 2] = sign
                a["kv"] = kv.astype(_QDT[dtype])
            _krr_identity_rope(a, dtype)
            sin = np.zeros(a["sin"].shape, np.float32)
            sin[..., _DK // 2 + lane] = e
            a["sin"] = sin.astype(_QDT[dtype])
            return a, lane * 2 + (sign < 0)

        return build

    def expect(a, param, chip):
        lane, sign = param >> 1, (-1.0 if param & 1 else 1.0)
        e = _EPS16["bfloat16" if a["kv"].dtype == _BF16 else "float16"]
        i = _DK // 2 + lane
        return [("k_cache", (0, 0, 0, i), sign * 1.0, sign * (1.0 + 2 * e), "k_cache 16-bit cast (RINT)")]

    return [Cell(f"{d}:{c}", chips, build_for(d), expect)
            for d in ("bfloat16", "float16") for c, chips in (("A2", _A2A3), ("950", ("950",)))]


def _krr_cells():
    return _krr_q8("int8") + _krr_q8("float8_e4m3fn") + _krr_q8("float8_e5m2") + _krr_hif8() + _krr_16()


# ---------------------------------------------------------------------------------------------------------------
# dynamic_block_quant

DBQ = "dynamic_block_quant"
#: (dst_type, round_mode, amax, values) ; expected codes per mode for a positive sign (int8: integers; one-byte
#: formats: the code bytes)
_DBQ = {
    "rint:int8": ("int8", "rint", 127.0, (62.5, 126.5), {"rint": (62, 126), "round": (63, 127)}),
    "rint:float8_e4m3fn": ("float8_e4m3fn", "rint", 448.0, (1.0625, 1.1875),
                           {"rint": (0x38, 0x3A), "round": (0x39, 0x3A)}),
    "rint:float8_e5m2": ("float8_e5m2", "rint", 57344.0, (1.125, 1.375), {"rint": (0x3C, 0x3E), "round": (0x3D, 0x3E)}),
    "round:hifloat8": ("hifloat8", "round", 32768.0, (1.0625,), {"round": (0x09,), "rint": (0x08,)}),
}
#: the order tie: amax 7.46875, x = amax / 2 -> (code, scale bits) per order
_ORDER = {"reciprocal": (63, 0x3D70E1C3), "divide": (64, 0x3D70E1C4)}


def _dbq_build(edge):
    def build(draw, chip):
        dtype = draw(st.sampled_from(("bfloat16", "float16")))
        rows = draw(st.integers(1, 3))
        row = draw(st.integers(0, rows - 1))
        cols = draw(st.sampled_from((8, 128, 200)))
        if edge == "order:int8":
            dst, mode, amax, vals = "int8", "rint", 7.46875, (3.734375,)
        else:
            dst, mode, amax, vals, _ = _DBQ[edge]
        n = len(vals) + 2  # amax, the values, one negated first value
        col = draw(st.integers(0, min(cols, 128) - n))
        sign = draw(st.sampled_from((1, -1)))
        x = np.zeros((rows, cols), np.float32)
        x[row, col:col + n] = np.float32((amax,) + vals + (-vals[0],)) * sign
        a = dict(x=x.astype(_QDT[dtype]), min_scale=0.0, round_mode=mode, dst_type=dst, row_block_size=1,
                 col_block_size=128, dst_type_max=0.0, scale_order=None)
        return a, (row << 16) | (col << 1) | (sign < 0)

    return build


def _dbq_expect(edge):
    from .. import chips as C

    def expect(a, param, chip):
        row, col, neg = param >> 16, (param >> 1) & 0x7FFF, param & 1
        if edge == "order:int8":
            order = C.DYNAMIC_BLOCK_QUANT_ORDER[chip]
            code, bits = _ORDER[order]
            ocode, obits = _ORDER["divide" if order == "reciprocal" else "reciprocal"]
            s = -1 if neg else 1
            return [("y", (row, col + 1), s * code, s * ocode, f"{order} quantised value"),
                    ("y", (row, col + 2), -s * code, -s * ocode, f"{order} quantised value"),
                    ("scale", (row, 0), np.uint32(bits), np.uint32(obits), f"{order} scale (bits)")]
        dst, mode, _, vals, codes = _DBQ[edge]
        other = "round" if mode == "rint" else "rint"
        out = []
        for i, (w, o) in enumerate(zip(codes[mode], codes[other])):
            out.append(("y", (row, col + 1 + i), _signed(dst, w, neg), _signed(dst, o, neg), f"{dst} cast ({mode.upper()})"))
        out.append(("y", (row, col + 1 + len(vals)), _signed(dst, codes[mode][0], not neg),
                    _signed(dst, codes[other][0], not neg), f"{dst} cast ({mode.upper()})"))
        out.append(("scale", (row, 0), np.uint32(0x3F800000), None, "scale amax / TYPE_MAX = 1"))
        return out

    return expect


def _signed(dst, code, neg):
    if dst == "int8":
        return -code if neg else code
    return code | 0x80 if neg else code


def _dbq_cells():
    cells = [Cell("order:int8", ("A2", "A3", "950"), _dbq_build("order:int8"), _dbq_expect("order:int8")),
             Cell("rint:int8", ("A2", "A3", "950"), _dbq_build("rint:int8"), _dbq_expect("rint:int8"))]
    cells += [Cell(e, ("950",), _dbq_build(e), _dbq_expect(e)) for e in _DBQ if e != "rint:int8"]
    return cells


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4 shared-KV attention

SFM, SAS, MQ, KQS = ("sparse_flash_mla", "sparse_attn_sharedkv", "mixed_quant_sparse_flash_mla",
                     "kv_quant_sparse_attn_sharedkv")
_V4_CHIPS = {SFM: ("A2", "A3", "950"), SAS: ("A3",), MQ: ("950",), KQS: ("950",)}
_QUANT = (MQ, KQS)
#: mixed_quant K: E4M3 code 1.5 (0x3C) times the bf16 scale 1.0234375 = 196.5 / 128
_MQ_K = (0x3C, 1.0234375, {"rint": 196 / 128, "round": 197 / 128})


def _v4_rows(op, k_rows, qdt, nope_tie=None):
    """K rows (float [S, 512], [NoPE 448, RoPE 64]) in ``op``'s KV format; quantised NoPE: lane 0 of each row is 0
    or 1 (code 1.0, scale 1), or ``nope_tie = (lane, sign)``: the mixed-quant K tie at that lane of row 0."""
    if op in (SFM, SAS):
        return k_rows.astype(_QDT[qdt])
    s = k_rows.shape[0]
    if op == MQ:
        from ..reference.sharedkv import MODE1_BYTES

        out = np.zeros((s, MODE1_BYTES), np.uint8)
        out[:, :128] = np.ascontiguousarray(k_rows[:, 448:].astype(_BF16)).view(np.uint8)
        out[:, 128] = np.where(k_rows[:, 0] == 1, 0x38, 0)  # E4M3 1.0
        scales = np.ones((s, 7), _BF16)
        if nope_tie is not None:
            lane, sign = nope_tie
            out[0, 128 + lane] = _MQ_K[0] | (0x80 if sign < 0 else 0)
            scales[0, lane // 64] = _MQ_K[1]
        out[:, 576:590] = scales.view(np.uint8)
        return out.view(ml_dtypes.float8_e4m3fn)
    from ..reference.sharedkv import KVQ_BYTES

    out = np.zeros((s, KVQ_BYTES), np.uint8)
    out[:, :128] = np.ascontiguousarray(k_rows[:, 448:].astype(_BF16)).view(np.uint8)
    out[:, 128] = np.where(k_rows[:, 0] == 1, 0x38, 0)
    out[:, 576:583] = 127  # E8M0 2^0
    return out.view(ml_dtypes.float8_e4m3fn)


def _v4_args(op, chip, k_rows, qdt, q_lane0, scale, heads, nope_tie=None):
    from ..chips import _bind

    s = k_rows.shape[0]
    q = np.zeros((1, 1, heads, 512), np.float32)
    q[..., 0] = q_lane0
    rows = _v4_rows(op, k_rows, qdt, nope_tie)
    kw = dict(q=q.astype(_QDT[qdt]), sinks=np.full(heads, -np.inf, np.float32), softmax_scale=float(scale),
              cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=0, ori_win_left=127, ori_win_right=0)
    if op in (SAS, KQS):  # PA_ND, one block of 16
        blk = np.zeros((1, 16) + rows.shape[1:], rows.dtype)
        blk[0, :s] = rows
        kw.update(ori_kv=blk[:, :, None, :], ori_block_table=np.zeros((1, 1), np.int32),
                  seqused_kv=np.array([s], np.int32), layout_kv="PA_ND")
    else:
        kw.update(ori_kv=rows.reshape(1, s, 1, -1))
    if op == MQ:
        kw.update(quant_mode=1, rope_head_dim=64)
    if op == KQS:
        kw.update(kv_quant_mode=1, tile_size=64, rope_head_dim=64)
    a = _bind(op, (kw.pop("q"),), kw)
    a.pop("chip", None)
    a.pop("backend", None)
    return a


def _v4_heads(op, chip):
    return (64,) if op in (SAS, MQ, KQS) else ((2, 4, 8, 16, 64) if chip == "950" else (1, 2, 4, 8))


def _v4_cells(op):
    from .properties_chips import EXPECT, TIE_X

    dtypes = ("bfloat16",) if op in _QUANT + (SAS,) else ("bfloat16", "float16")
    lanes = (448, 511) if op in _QUANT else (1, 511)  # quantised: V lanes in the raw RoPE part

    def p_build(qdt):
        def build(draw, chip):
            lane = draw(st.integers(*lanes))
            sign = draw(st.sampled_from((1, -1)))
            heads = draw(st.sampled_from(_v4_heads(op, chip)))
            k = np.zeros((2, 512), np.float32)
            k[1, 0] = 1.0
            k[1, lane] = 100.0 * sign
            return _v4_args(op, chip, k, qdt, 1.0, TIE_X[qdt], heads), lane * 2 + (sign < 0)

        return build

    def out_build(qdt):
        def build(draw, chip):
            lane = draw(st.integers(lanes[0] - 1 if op not in _QUANT else lanes[0], 511))
            sign = draw(st.sampled_from((1, -1)))
            heads = draw(st.sampled_from(_v4_heads(op, chip)))
            k = np.zeros((2, 512), np.float32)
            k[:, lane] = np.float32(EXPECT["out"][qdt][0]) * sign
            return _v4_args(op, chip, k, qdt, 0.0, 1.0, heads), lane * 2 + (sign < 0)

        return build

    def expect_for(point):
        from .. import chips as C

        def expect(a, param, chip):
            from .._arrays import dtype_name

            lane, sign = param >> 1, (-1.0 if param & 1 else 1.0)
            qdt = dtype_name(a["q"])
            mode = C.SHAREDKV_NUMERICS[chip][point][qdt]
            vals = EXPECT[point][qdt][1]
            other = "rint" if mode == "round" else "round"
            return [("attention_out", (..., lane), sign * vals[mode], sign * vals[other],
                     f"{point.upper()} cast of {qdt} ({mode.upper()})")]

        return expect

    cells = []
    for qdt in dtypes:
        cells.append(Cell(f"p:{qdt}", _V4_CHIPS[op], p_build(qdt), expect_for("p")))
        cells.append(Cell(f"out:{qdt}", _V4_CHIPS[op], out_build(qdt), expect_for("out")))
    if op == SFM:
        cells.append(Cell("s2_tile:float16", _V4_CHIPS[op], _s2_build, _s2_expect))
    if op == MQ:
        def k_build(draw, chip):
            lane = draw(st.integers(0, 447))
            sign = draw(st.sampled_from((1, -1)))
            k = np.zeros((1, 512), np.float32)
            return (_v4_args(op, chip, k, "bfloat16", 0.0, 1.0, 64, nope_tie=(lane, sign)),
                    lane * 2 + (sign < 0))

        def k_expect(a, param, chip):
            lane, sign = param >> 1, (-1.0 if param & 1 else 1.0)
            v = _MQ_K[2]
            return [("attention_out", (..., lane), sign * v["rint"], sign * v["round"],
                     "quant_mode 1 K dequantisation cast (RINT, qsfa's default for an OPEN fact)")]

        cells.append(Cell("k:bfloat16", ("950",), k_build, k_expect))
    return cells


#: the S2 tile construction (fp16): scores TIE_X (window and compressed tokens 0..127) and 0 (compressed token
#: 128); V lane L: +4096 at compressed token 0, -3072 at token 128
_S2_V = (4096.0, -3072.0)
_S2_CMP = 129


def _s2_build(draw, chip):
    from .properties_chips import TIE_X

    from ..chips import _bind

    lane = draw(st.integers(1, 511))
    sign = draw(st.sampled_from((1, -1)))
    heads = draw(st.sampled_from(_v4_heads(SFM, chip)))
    s2 = _S2_CMP * 4  # CSA, cmp_ratio 4, residual 0: the compressed bound is S2 / 4 = 129 tokens
    ori = np.zeros((1, s2, 1, 512), np.float32)
    ori[0, s2 - 128:, 0, 0] = 1.0  # the band window: the last 128 tokens, score TIE_X
    cmp = np.zeros((1, _S2_CMP, 1, 512), np.float32)
    cmp[0, :128, 0, 0] = 1.0
    cmp[0, 0, 0, lane] = _S2_V[0] * sign
    cmp[0, 128, 0, lane] = _S2_V[1] * sign
    idx = np.full((1, 1, 1, 512), -1, np.int32)
    idx[..., :_S2_CMP] = np.arange(_S2_CMP)
    q = np.zeros((1, 1, heads, 512), np.float16)
    q[..., 0] = 1
    kw = dict(ori_kv=ori.astype(np.float16), cmp_kv=cmp.astype(np.float16), cmp_sparse_indices=idx,
              cmp_residual_kv=np.zeros(1, np.int32), sinks=np.full(heads, -np.inf, np.float32),
              softmax_scale=float(TIE_X["float16"]), cmp_ratio=4, ori_mask_mode=4, cmp_mask_mode=3,
              ori_win_left=127, ori_win_right=0)
    a = _bind(SFM, (q,), kw)
    a.pop("chip", None)
    a.pop("backend", None)
    return a, lane * 2 + (sign < 0)


def _s2_expect(a, param, chip):
    """e = RN32(exp(TIE_X)) = 0x3F401000 = 3073 / 4096, an fp16 midpoint; l = 256 e + 1 on every chip (128 window
    and 128 compressed tokens at e against the final max 0, one at 1). A 128-token tile (950) sees compressed
    tokens 0..127 alone: P = 1 there, rescaled by e when token 128 raises the max: O = 4096 e - 3072 = 1. A 512-token
    tile (A2/A3) rounds P of token 0 against the final max: ROUND(e) = 0.75048828125, O = 3074 - 3072 = 2."""
    from .. import chips as C

    lane, sign = param >> 1, (-1.0 if param & 1 else 1.0)
    e = 3073 / 4096
    l_ = 256 * e + 1
    tile = C.SHAREDKV_NUMERICS[chip]["s2_tile"]
    want, other = (1.0, 2.0) if tile == 128 else (2.0, 1.0)
    return [("attention_out", (..., lane), _Near(sign * want / l_, 2.0 ** -9), _Near(sign * other / l_, 0),
             f"S2 tile of {tile} tokens (P against the tile's running max)")]


# ---------------------------------------------------------------------------------------------------------------
# the properties


def _cells(op):
    if op == KRR:
        return _krr_cells()
    if op == DBQ:
        return _dbq_cells()
    return _v4_cells(op)


#: operator -> its cells (built once)
CELLS: dict = {}

_WHAT = {KRR: "the 8-bit and 16-bit cache casts, the HiFloat8 overflow",
         DBQ: "the scale order, the int8 / FP8 / HiFloat8 casts",
         SFM: "P and the output", SAS: "P and the output", KQS: "P and the output",
         MQ: "the quant_mode 1 K dequantisation, P and the output"}


def _fmt(v, code=False):
    if code:
        return f"0x{int(v):02X}"
    return repr(int(v)) if isinstance(v, (int, np.integer)) else repr(float(v))


def _property(op, P, Example):
    from ..strategies._common import sampled
    from ..strategies.chips import NotApplicable, merge_pins

    cells = CELLS.setdefault(op, _cells(op))
    edges = tuple(c.edge for c in cells)

    def make(bounds, chip=None, pins=None):
        merge_pins(op, chip, {}, bounds)  # an operator the chip does not have: its own rule's NotApplicable
        here = [(i, c) for i, c in enumerate(cells) if chip is None or chip in c.chips]
        if not here:
            raise NotApplicable(op, chip, "rounding_ties", f"no rounding cell of {op} in docs/numerics/chips.md "
                                "exists on this chip")
        e = (pins or {}).get("edge")
        if e is not None:
            want = {e} if isinstance(e, str) else set(e)
            here = [(i, c) for i, c in here if c.edge in want]
            if not here:
                return st.nothing()  # an edge of another chip

        @st.composite
        def draw_example(draw):
            i, c = draw(sampled(tuple(here)))
            # chip None: each call resolves its own chip; build for the first chip the cell exists on
            args, param = c.build(draw, chip or c.chips[0])
            return Example(args, (param << 8) | i)

        return draw_example()

    def check(ex, backend: str):
        cell = cells[ex.seed & 0xFF]
        chip = _chip_of(op, ex.args, backend)
        outs = call(op, ex.args, backend)
        for name, idx, want, other, what in cell.expect(ex.args, ex.seed >> 8, chip):
            arr = np.asarray(outs[name])
            code = isinstance(want, np.uint32) or (isinstance(want, (int, np.integer)) and arr.dtype.itemsize == 1
                                                    and arr.dtype != np.int8)
            if isinstance(want, _Near):
                got = np.asarray(arr[idx], np.float64)
                far = np.abs(got - want.value) > want.rtol * abs(want.value)
                if far.any():
                    fail(f"{chip}: {what} at {cell.edge} (docs/numerics/chips.md): {name}{_idx(idx)} must be "
                         f"{want.value!r} within {want.rtol:g} (relative), got {float(got[far].reshape(-1)[0])!r} "
                         f"(the other tile size gives about {other.value!r})")
                continue
            if isinstance(want, np.uint32):
                got = np.asarray(arr[idx], np.float32).view(np.uint32)
            elif code:
                got = np.asarray(arr).view(np.uint8)[idx]  # a code byte
            else:
                got = np.asarray(arr[idx], np.float64)
            bad = np.asarray(got).reshape(-1)[np.asarray(got != want).reshape(-1)]
            if bad.size:
                hint = f" (the other mode gives {_fmt(other, code)})" if other is not None and bad[0] == other else ""
                fail(f"{chip}: {what} at {cell.edge} (docs/numerics/chips.md): {name}{_idx(idx)} must be "
                     f"{_fmt(want, code)}, got {_fmt(bad[0], code)}{hint}")

    return P(f"{op}.rounding_ties", (op,), "metamorphic",
             f"Examples built to land exactly on a tie of the target format at each rounding point of {op} in "
             f"docs/numerics/chips.md ({_WHAT[op]}) give the output bytes as the chip's mode rounds them, bit for "
             "bit; a cell the chip does not have is not drawn.", make, check, edges=edges)


def _idx(idx):
    return "[" + ", ".join("..." if i is Ellipsis else str(i) for i in idx) + "]"


def tie_properties(have: set, P, Example) -> list:
    return [_property(op, P, Example) for op in (KRR, DBQ, SFM, SAS, MQ, KQS) if op in have]
