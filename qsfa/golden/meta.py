"""What each golden file means: its layout in words, the format of its codes, the byte fields of packed
rows, how outputs are compared, and which output elements are specified at all.

Per operator a *describer* ``fn(params, args, outputs) -> {(role, name): ArrayMeta}`` fills in what the
generic default (``<dtype> [dims] row-major``, bytes comparison) does not know. Outputs are compared
byte for byte unless the describer says ``compare="float"`` (attention outputs and LSE: docs/numerics/comparison.md#float-criterion
tolerances).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .._arrays import dtype_name

__all__ = ["ArrayMeta", "describe", "register_describer", "Segment"]


@dataclass
class ArrayMeta:
    """layout:   the file's layout in words (dims, byte fields).
    format:   the qsfa.formats name of 8-bit codes held in the array (uint8 HiFloat8 codes, int8 codes,
              fp8 codes) so a report can show decoded values; None for plain numbers.
    segments: byte fields of the last axis of a packed uint8 row: ``[start, end, kind, label]`` where
              kind is a dtype ("bfloat16", "float32") or a format ("float8_e4m3fn", "hifloat8",
              "float8_e8m0", "float4_e2m1x2" = two FP4 codes per byte, element 2i in the low nibble,
              "float4_e2m1x2_hi" = element 2i in the high nibble).
    compare:  "bytes" (bit-exact) or "float" (docs/numerics/comparison.md#float-criterion tolerance criterion); outputs only.
    mask:     bool array of the output's shape: True where the value is specified (compared); None = all.
    """

    layout: str = ""
    format: str | None = None
    segments: list | None = None
    compare: str = "bytes"
    mask: np.ndarray | None = None


Segment = list  # [start, end, kind, label]

Describer = Callable[[dict, dict, dict], dict]
_DESCRIBERS: dict[str, Describer] = {}


def register_describer(op: str, fn: Describer | None = None):
    def deco(f):
        _DESCRIBERS[op] = f
        return f

    return deco(fn) if fn is not None else deco


def _default_layout(a: np.ndarray) -> str:
    return f"{dtype_name(a)} {list(a.shape)}, row-major (C order)"


def describe(op: str, params: dict, args: dict, outputs: dict) -> dict:
    """``{(role, name): ArrayMeta}`` for every input array and output of one case."""
    metas = {}
    for name, a in args.items():
        if isinstance(a, np.ndarray):
            metas[("input", name)] = ArrayMeta(layout=_default_layout(a))
    for name, a in outputs.items():
        metas[("output", name)] = ArrayMeta(layout=_default_layout(a))
    fn = _DESCRIBERS.get(op)
    if fn is not None:
        for key, m in fn(params, args, outputs).items():
            if key not in metas:
                continue
            base = metas[key]
            metas[key] = ArrayMeta(
                layout=m.layout or base.layout, format=m.format, segments=m.segments,
                compare=m.compare, mask=m.mask,
            )
    return metas


# --------------------------------------------------------------------------------------------------
# number formats


@register_describer("formats.encode")
def _encode(params, args, outputs):
    fmt = params.get("fmt")
    out = {}
    if fmt in ("bfloat16", "float16"):
        layout = f"uint16 bit patterns of {fmt}, one per input element"
    elif fmt == "float4_e2m1":
        layout = "uint8, one float4_e2m1 code (0..15) per byte and input element"
    else:
        layout = f"uint8 {fmt} codes, one per input element" + (" (two's complement byte)" if fmt == "int8" else "")
    out[("output", "codes")] = ArrayMeta(layout=layout, format=fmt if fmt not in ("bfloat16", "float16") else None)
    return out


@register_describer("formats.decode")
def _decode(params, args, outputs):
    fmt = params.get("fmt")
    return {
        ("input", "codes"): ArrayMeta(layout=f"{fmt} codes in code order", format=fmt if fmt not in ("bfloat16", "float16") else None),
        ("output", "values"): ArrayMeta(layout="float32 value of each code (NaN codes give NaN)"),
    }


# --------------------------------------------------------------------------------------------------
# dynamic block quant


@register_describer("dynamic_block_quant")
def _dbq(params, args, outputs):
    dst = params.get("dst_type", "int8")
    rb, cb = params.get("row_block_size", 1), params.get("col_block_size", 128)
    x = args["x"]
    lead = "[B, M, N]" if x.ndim == 3 else "[M, N]"
    store = "uint8 HiFloat8 codes" if dst == "hifloat8" else f"{dst} codes"
    return {
        ("output", "y"): ArrayMeta(layout=f"{store} {lead} ({list(x.shape)}), row-major", format=dst),
        ("output", "scale"): ArrayMeta(
            layout=f"float32 dequant scale per {rb}x{cb} block, {list(outputs['scale'].shape)} = "
                   f"{'[B, ' if x.ndim == 3 else '['}ceil(M/{rb}), ceil(N/{cb})]; x ~= decode(y) * scale"),
    }


# --------------------------------------------------------------------------------------------------
# KvCompressEpilog


def kv_compress_epilog_segments(d: int, quant_mode: int, quant_group_size: int, head_dim: int, pad_to: int = 32,
                                nibble_order: str = "low_first") -> list:
    """The byte fields of one cache row (docs/numerics/layouts.md#kvcompressepilog-rows)."""
    from ..reference.kv_compress_epilog import kv_cache_col

    n = d - 64
    col = kv_cache_col(d, quant_mode, quant_group_size, pad_to)
    if quant_mode in (0, 1):
        g = -(-n // 64)
        seg = [[0, 128, "bfloat16", "RoPE (64 bf16, raw bits)"], [128, 128 + n, "float8_e4m3fn", "NoPE (FP8 E4M3FN)"]]
        if quant_mode == 0:
            seg.append([128 + n, 128 + n + 2 * g, "bfloat16", f"scales ({g} bf16, one per 64 NoPE columns)"])
            end = 128 + n + 2 * g
        else:
            seg.append([128 + n, 128 + n + g, "float8_e8m0", f"scales ({g} E8M0 bytes, one per 64 NoPE columns)"])
            end = 128 + n + g
    else:
        gs = quant_group_size
        seg = [[0, 64, "hifloat8", "RoPE (64 HiFloat8 codes)"],
               [64, 64 + n // 2, "float4_e2m1x2" if nibble_order == "low_first" else "float4_e2m1x2_hi",
                f"NoPE (FP4 E2M1, element 2i in the {'low' if nibble_order == 'low_first' else 'high'} nibble)"],
               [64 + n // 2, 64 + n // 2 + 2 * (n // gs), "bfloat16", f"scales ({n // gs} bf16, one per {gs} NoPE columns)"]]
        end = 64 + n // 2 + 2 * (n // gs)
    if end < col:
        seg.append([end, col, "uint8", "zero padding"])
    if col < head_dim:
        seg.append([col, head_dim, "uint8", "not written (keeps its previous bytes)"])
    return seg


@register_describer("kv_compress_epilog")
def _kvce(params, args, outputs):
    cache = args["cache"]
    d = args["x"].shape[-1]
    mode = params.get("quant_mode", 1)
    gs = params.get("quant_group_size", 64) if mode == 2 else 64
    seg = kv_compress_epilog_segments(d, mode, gs, cache.shape[-1], params.get("pad_to", 32),
                                      params.get("fp4_nibble_order", "low_first"))
    fields = "; ".join(f"[{a},{b}) {lbl}" for a, b, _, lbl in seg)
    layout = (f"uint8 [blockNum, blockSize, 1, headDim] = {list(cache.shape)}; token with slot s is row "
              f"s % blockSize of block s // blockSize (slot -1: nothing written); row bytes (quant_mode "
              f"{mode}): {fields}")
    m = ArrayMeta(layout=layout, segments=seg)
    return {("input", "cache"): m, ("output", "cache"): m,
            ("input", "x"): ArrayMeta(layout=f"bfloat16 {list(args['x'].shape)}: NoPE = first {d - 64} "
                                             f"columns, RoPE = last 64")}


# --------------------------------------------------------------------------------------------------
# packed QSFA rows (C8 writers, QSFA key)


def qsfa_row_segments(rope: int, nope_fmt: str, rope_dtype: str) -> list:
    """The byte fields of a packed QSFA row (docs/numerics/layouts.md#packed-qsfa-row)."""
    from ..reference.packing import row_offsets

    off = row_offsets(rope_head_dim=rope)
    seg = [[*off["nope"], nope_fmt, f"NoPE ({nope_fmt} codes)"]]
    if rope:
        seg.append([*off["rope"], rope_dtype, f"RoPE ({rope} {rope_dtype}, raw bits)"])
    seg.append([*off["scales"], "float32", "scales (4 fp32, one per 128 NoPE columns)"])
    return seg


def _fields(seg) -> str:
    return "; ".join(f"[{a},{b}) {lbl}" for a, b, _, lbl in seg)


def _c8(params, args, outputs, rope_dtype_of):
    cache = args["kv_cache"]
    rope = 64 if cache.shape[-1] == 656 else 0
    fmt = params.get("key_dtype", "int8")
    seg = qsfa_row_segments(rope, fmt, dtype_name(args[rope_dtype_of]))
    m = ArrayMeta(layout=f"packed QSFA rows {cache.dtype} [block_num, block_size, 1, {cache.shape[-1]}] = "
                         f"{list(cache.shape)}; token with slot s is row s % block_size of block s // block_size "
                         f"(-1: not written, bytes keep their value); row bytes: {_fields(seg)}", segments=seg)
    return {("input", "kv_cache"): m, ("output", "kv_cache"): m}


register_describer("c8_cache_write", lambda p, a, o: _c8(p, a, o, "k_nope"))
register_describer("c8_rmsnorm_rope_cache", lambda p, a, o: _c8(p, a, o, "kv"))


# --------------------------------------------------------------------------------------------------
# KvRmsNormRopeCache


@register_describer("kv_rmsnorm_rope_cache")
def _krr(params, args, outputs):
    mode = params.get("cache_mode", "Norm")
    nz = mode in ("PA_NZ", "PA_BLK_NZ")
    out = {}
    for cache, fmt_param, what in (("k_cache", "k_cache_dtype", "K (RoPE'd) rows"), ("ckv_cache", "ckv_cache_dtype", "CKV rows")):
        a = args[cache]
        fmt = params.get(fmt_param) or dtype_name(a)
        if mode == "Norm":
            lay = "[Bkv, N, Scache, D]: token (b, s) goes to [b, :, index[b, s]]"
        elif nz:
            lay = ("NZ [block_num, D//c, block_size, 1, c] (N = 1) or [block_num, N, D//c, block_size, c], "
                   f"c = {32 if a.dtype.itemsize == 1 else 16}: element (blk, pos, d) at blk*bs*D + (d//c)*bs*c + pos*c + d%c")
        else:
            lay = "[block_num, block_size, N, D]"
        if mode in ("PA_BLK_BNSD", "PA_BLK_NZ"):
            lay += "; index[i] is the start slot of chunk i (block_size tokens) of a batch row"
        elif mode != "Norm":
            lay += "; token with slot s goes to row s % block_size of block s // block_size"
        m = ArrayMeta(layout=f"{fmt} {what}, {lay} ({list(a.shape)}); index -1: not written",
                      format=fmt if a.dtype.itemsize == 1 else None)
        out[("input", cache)] = m
        out[("output", cache)] = m
    return out


# --------------------------------------------------------------------------------------------------
# QSFA attention


@register_describer("kv_quant_sparse_flash_attention")
def _qsfa(params, args, outputs):
    rope = params.get("rope_head_dim", 64)
    q = args["query"]
    lq, lkv = params.get("layout_query", "BSND"), params.get("layout_kv", "BSND")
    seg = qsfa_row_segments(rope, params.get("key_dtype", "int8"), dtype_name(q))
    kdims = {"PA_BSND": "[block_num, block_size, 1, W]", "TND": "[T_kv, 1, W]", "BSND": "[B, S_kv, 1, W]"}[lkv]
    out = {
        ("input", "key"): ArrayMeta(layout=f"packed QSFA rows {kdims} = {list(args['key'].shape)}; row bytes: "
                                           f"{_fields(seg)}; rows no selected token lives in are filled with 0x7F",
                                    segments=seg),
        ("input", "sparse_indices"): ArrayMeta(layout=(
            "int32 [B, Q_S, 1, K]" if lq == "BSND" else "int32 [Q_T, 1, K]") + f" = {list(args['sparse_indices'].shape)}: "
            f"block indices of sparse_block_size {params.get('sparse_block_size', 1)} tokens, -1 ends a row"),
        ("output", "attention_out"): ArrayMeta(
            layout=f"{dtype_name(q)} {'[B, Q_S, Q_N, 512]' if lq == 'BSND' else '[Q_T, Q_N, 512]'}",
            compare="float"),
    }
    lse_shape = "[B, 1, Q_S, Q_N]" if lq == "BSND" else "[1, Q_T, Q_N]"
    mask = None
    qlens = args.get("actual_seq_lengths_query")
    if lq == "BSND" and qlens is not None and outputs.get("softmax_max") is not None \
            and outputs["softmax_max"].size:
        # the LSE of padding query rows (i >= actual_seq_lengths_query[b]) is not specified
        s_q = q.shape[1]
        rows = np.arange(s_q)[None, :] < np.asarray(qlens)[:, None]
        mask = np.broadcast_to(rows[:, None, :, None], outputs["softmax_max"].shape).copy()
        if mask.all():
            mask = None
    for name, what in (("softmax_max", "row max of the scaled scores"),
                       ("softmax_sum", "sum of exp(score - max), unnormalised")):
        if name in outputs:
            out[("output", name)] = ArrayMeta(
                layout=f"float32 {lse_shape}: {what}" if outputs[name].size else "empty (return_softmax_lse off)",
                compare="float", mask=mask)
    return out


# --------------------------------------------------------------------------------------------------
# other attention-group operators: their floating outputs carry the kernels' accumulation order


def _float_outputs(params, args, outputs):
    return {("output", n): ArrayMeta(compare="float") for n, a in outputs.items()
            if dtype_name(a) in ("float16", "bfloat16", "float32")}


for _op in ("sparse_flash_attention", "merge_attention_lse", "lightning_indexer", "quant_lightning_indexer"):
    register_describer(_op, _float_outputs)
# the DeepSeek-V4 shared-KV attention: its output and LSE carry the kernel's accumulation order too (a V4 layer
# chain's attention link, compared from an NPU dump, is judged by the float criterion, not by bytes)
for _op in ("sparse_flash_mla", "sparse_attn_sharedkv", "mixed_quant_sparse_flash_mla", "kv_quant_sparse_attn_sharedkv",
            "quant_sparse_flash_mla"):
    register_describer(_op, _float_outputs)


# --------------------------------------------------------------------------------------------------
# outputs with bytes their layout leaves unspecified (qsfa.layouts.unspecified_bytes): masked, so `golden compare`
# and `golden verify` ignore exactly those bytes (the reference writes 0 there)


def _unspecified(op):
    def describer(params, args, outputs):
        from ..layouts import unspecified_bytes

        return {("output", n): ArrayMeta(mask=~m) for n, m in unspecified_bytes(op, args).items()
                if n in outputs and np.shape(outputs[n]) == m.shape}

    return describer


for _op in ("layouts.flashmla_model1_quantize", "kv_compress_epilog_vllm"):
    register_describer(_op, _unspecified(_op))
