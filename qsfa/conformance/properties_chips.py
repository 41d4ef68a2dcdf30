"""Rounding-direction properties: every attention cell of docs/numerics/chips.md, hit exactly on a tie.

The two 16-bit casts of the kernels (RINT: ties to even, ROUND: ties away from zero) differ only on exact
midpoints of the target format - about 2^-13 of random products, one ulp, far inside the attention tolerance -
so a random example almost never tells them apart. ``<op>.rounding_ties`` builds examples whose exact value at
one rounding point is a midpoint of the query dtype and asserts the output lane bit for bit: the expected value
is written out by hand for each mode (derivations below, the constructions of tests/test_chips.py), and the
chip's mode of that point comes from the chips.md table as data (``qsfa.chips.ATTENTION_ROUNDING``). Only the
attention output is read: the property runs on the 950 too (no LSE needed).

Points (``edge`` pins ``<point>:<dtype>``; every one runs in the edge phase):

* ``k`` (QSFA only): one token, code +-1 at lane L times a tile scale on a midpoint (fp16 2049: ROUND 2050, RINT
  2048; bf16 257: ROUND 258, RINT 256); q = 0, so P = 1 and the output lane is K as rounded.
* ``p``: token 0 scores 0 (the max), token 1 scores x with fp32 exp(x) a midpoint of the query dtype (bf16:
  exp -> 0x3ED48000, fp16: exp -> 0x3F401000); V lane L of token 1 = +-100. Output lane L =
  RN32(P_1 * 100) / (1 + e_1), not a tie after that: bf16 29.375 (ROUND) / 29.25 (RINT), fp16 42.875 / 42.84375.
* ``out``: two tokens with equal scores (q = 0, or K = 0), V lane L = v0 / v1 (bf16 256 / 258, fp16 2048 / 2050),
  so the output is their mean, a midpoint: bf16 ROUND 258 / RINT 256, fp16 ROUND 2050 / RINT 2048.

Drawn around each construction: the lane, the sign, the number of query rows (BSND) and heads, sparse_mode 0 / 3
with every row seeing both tokens.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from ._support import call, current_chip, fail

__all__ = ["rounding_properties", "TIE_X", "EXPECT"]

QSFA = "kv_quant_sparse_flash_attention"
SFA = "sparse_flash_attention"
_QDT = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}

#: fp32 scores x whose RN32(exp(x)) is a midpoint of the query dtype (tests/test_chips.py::test_tie_inputs)
TIE_X = {"bfloat16": -0.8793826, "float16": -0.28735662}
#: point -> query dtype -> (construction values, {mode: output lane value}) for a positive sign
EXPECT = {
    "k": {"float16": (2049.0, {"round": 2050.0, "rint": 2048.0}),
          "bfloat16": (257.0, {"round": 258.0, "rint": 256.0})},
    "p": {"bfloat16": (100.0, {"round": 29.375, "rint": 29.25}),
          "float16": (100.0, {"round": 42.875, "rint": 42.84375})},
    "out": {"bfloat16": ((256.0, 258.0), {"round": 258.0, "rint": 256.0}),
            "float16": ((2048.0, 2050.0), {"round": 2050.0, "rint": 2048.0})},
}
_POINTS = {QSFA: ("k", "p", "out"), SFA: ("p", "out")}
_INT64_MAX = 2**63 - 1


def _edges(op: str) -> tuple:
    return tuple(f"{p}:{d}" for p in _POINTS[op] for d in ("bfloat16", "float16"))


def _qsfa_args(point, qdt, lane, sign, rows, heads, mode):
    from ..reference.packing import pack_rows

    codes = np.zeros((2, 512), np.int8)
    scales = np.ones((2, 4), np.float32)
    q = np.zeros((1, rows, heads, 576), _QDT[qdt])
    scale_value = 1.0
    idx = np.array([0, 1], np.int32)
    tile = lane // 128
    if point == "k":
        codes[0, lane] = sign
        scales[0, tile] = EXPECT["k"][qdt][0]
        idx = np.array([0, -1], np.int32)
    elif point == "p":
        codes[1, 0] = 1
        codes[1, lane] = sign * 100
        q[..., 0] = 1
        scale_value = TIE_X[qdt]
    else:
        codes[:, lane] = sign
        scales[:, tile] = EXPECT["out"][qdt][0]
    key = pack_rows(codes.reshape(1, 2, 1, 512), np.zeros((1, 2, 1, 64), _QDT[qdt]),
                    scales.reshape(1, 2, 1, 4)).view(np.int8)
    return dict(query=q, key=key, value=key, sparse_indices=np.broadcast_to(idx, (1, rows, 1, 2)).copy(),
                scale_value=float(scale_value), key_quant_mode=2, value_quant_mode=2, key_dequant_scale=None,
                value_dequant_scale=None, block_table=None, actual_seq_lengths_query=None,
                actual_seq_lengths_kv=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                sparse_mode=mode, pre_tokens=_INT64_MAX, next_tokens=_INT64_MAX, attention_mode=2,
                quant_scale_repo_mode=1, tile_size=128, rope_head_dim=64, return_softmax_lse=False, key_dtype="int8",
                precision="faithful", probability_rounding="unnormalised")


def _sfa_args(point, qdt, lane, sign, rows, heads, mode):
    dt = _QDT[qdt]
    q = np.zeros((1, rows, heads, 512), dt)
    k = np.zeros((1, 2, 1, 512), dt)
    v = np.zeros((1, 2, 1, 512), dt)
    scale_value = 1.0
    if point == "p":
        q[..., 0] = 1
        k[0, 1, 0, 0] = 1
        v[0, 1, 0, lane] = sign * 100
        scale_value = TIE_X[qdt]
    else:
        v0, v1 = EXPECT["out"][qdt][0]
        v[0, :, 0, lane] = (sign * v0, sign * v1)
    idx = np.broadcast_to(np.array([0, 1], np.int32), (1, rows, 1, 2)).copy()
    return dict(query=q, key=k, value=v, sparse_indices=idx, scale_value=float(scale_value), block_table=None,
                actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None, key_rope=None,
                sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=mode,
                pre_tokens=_INT64_MAX, next_tokens=_INT64_MAX, attention_mode=2, return_softmax_lse=False,
                sinks=None, lse_includes_sink=False, precision="faithful", probability_rounding="unnormalised")


def _strategy(op: str, Example):
    from ..strategies._common import sampled

    build = _qsfa_args if op == QSFA else _sfa_args
    edges = _edges(op)

    def make(bounds, chip=None, pins=None):
        e = (pins or {}).get("edge")  # every chip runs these (int8 keys, no LSE, sparse_block_size 1, no sinks)
        pick = sampled(edges if e is None else ((e,) if isinstance(e, str) else tuple(e)))
        heads = tuple(h for h in (1, 2, 4, 8) if h <= max(1, bounds.max_heads if bounds else 8))

        @st.composite
        def draw_example(draw):
            point, qdt = draw(pick).split(":")
            lo = 1 if point == "p" else 0  # lane 0 of token 1 carries the score in the P construction
            lane = draw(st.integers(lo, 511))
            sign = draw(sampled((1, -1)))
            rows = draw(st.integers(1, 3))
            n = draw(sampled(heads))
            mode = draw(sampled((0, 3)))
            args = build(point, qdt, lane, sign, rows, n, mode)
            if mode == 3 and rows > 1:  # causal: every row must see both tokens (threshold 2 - rows + i + 1)
                args["sparse_mode"] = 0
            return Example(args, (lane << 8) | (["k", "p", "out"].index(point) << 4) | (sign < 0))

        return draw_example()

    return make, edges


def _lane_point(ex) -> tuple[int, str]:
    return ex.seed >> 8, ["k", "p", "out"][(ex.seed >> 4) & 3]


def _rounding_ties(op: str, P, Example):
    from .. import chips as C
    from .._arrays import dtype_name
    from .._dispatch import get_backend, operator

    def check(ex, backend: str):
        a = ex.args
        lane, point = _lane_point(ex)
        qdt = dtype_name(a["query"])
        chip = current_chip() or get_backend(backend).chip() or C.chip_for_args(operator(op).contract, a)
        mode = C.ATTENTION_ROUNDING[chip][point][qdt]
        want = EXPECT[point][qdt][1][mode] * (-1.0 if ex.seed & 1 else 1.0)
        other = EXPECT[point][qdt][1]["rint" if mode == "round" else "round"] * (-1.0 if ex.seed & 1 else 1.0)
        out = np.asarray(call(op, a, backend)["attention_out"], np.float32)
        got = out[..., lane]
        if not (got == np.float32(want)).all():
            bad = got[got != np.float32(want)].reshape(-1)[0]
            hint = f" (the other rounding mode gives {other!r})" if float(bad) == other else ""
            fail(f"{chip} rounds the {point} point of {qdt} {mode.upper()} (docs/numerics/chips.md): output lane "
                 f"{lane} must be {want!r}, got {float(bad)!r}{hint}")

    make, edges = _strategy(op, Example)
    what = {QSFA: "the dequantised K, P and the output", SFA: "P and the output"}[op]
    return P(f"{op}.rounding_ties", (op,), "metamorphic",
             f"Examples built to land exactly on a tie of the query dtype at each rounding point ({what}) give the "
             "output lane bit for bit as the chip's mode of that point rounds it (docs/numerics/chips.md; RINT and "
             "ROUND differ only there); reads only attention_out, so it runs on every chip.",
             make, check, edges=edges)


def rounding_properties(have: set, P, Example) -> list:
    return [_rounding_ties(op, P, Example) for op in (QSFA, SFA) if op in have]
