"""Named golden case sets (``qsfa golden list``).

A set is a name, a description and a function that builds its cases (cheap: no arrays are made until a
case is generated). Seeds are derived from the case names (crc32), so a case keeps its inputs when the
set around it changes. Add sets with :func:`register_set`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

from .case import Case
from .io import GoldenInputError

__all__ = ["CaseSet", "register_set", "get_set", "case_sets", "seed_of"]


@dataclass(frozen=True)
class CaseSet:
    name: str
    description: str
    build: Callable[[], list]

    def cases(self) -> list[Case]:
        return list(self.build())


_SETS: dict[str, CaseSet] = {}


def register_set(name: str, description: str, build: Callable[[], list] | None = None, *, replace: bool = False):
    """Register a case set (usable as a decorator on its build function)."""

    def deco(fn):
        if name in _SETS and not replace:
            raise ValueError(f"case set {name!r} is already registered")
        _SETS[name] = CaseSet(name, description, fn)
        return fn

    return deco(build) if build is not None else deco


def unregister_set(name: str):
    _SETS.pop(name, None)


def get_set(name: str) -> CaseSet:
    try:
        return _SETS[name]
    except KeyError:
        raise GoldenInputError(f"unknown case set {name!r}; known sets: {', '.join(sorted(_SETS))}") from None


def case_sets() -> dict[str, CaseSet]:
    return dict(sorted(_SETS.items()))


def seed_of(name: str) -> int:
    """The seed of a catalogue case: crc32 of its name (stable across machines and set edits)."""
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def _case(name: str, op: str, generator: str, description: str = "", *, seed_name: str | None = None,
          **params) -> Case:
    """A catalogue case; cases meant to hold the same data share ``seed_name``."""
    return Case(name=name, op=op, params=params, seed=seed_of(seed_name or name), generator=generator,
                description=description)


# --------------------------------------------------------------------------------------------------
# number formats

_FORMATS_8BIT = ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8", "float8_e8m0")
_DEFAULT_ROUNDING = {"int8": "rint", "float8_e4m3fn": "rint", "float8_e5m2": "rint", "hifloat8": "round",
                     "float8_e8m0": "floor", "float4_e2m1": "rint"}
_OTHER_ROUNDINGS = {"int8": ("round",), "float8_e4m3fn": ("round",), "float8_e5m2": ("round",), "hifloat8": ("hybrid",),
                    "float8_e8m0": ("ceil", "rint", "round"), "float4_e2m1": ("round",)}


def format_cases(fmts=_FORMATS_8BIT + ("float4_e2m1",)) -> list[Case]:
    out = []
    for fmt in fmts:
        out.append(_case(f"decode-{fmt}", "formats.decode", "format_codes",
                         f"decode every {fmt} code", fmt=fmt))
        out.append(_case(f"encode-{fmt}", "formats.encode", "format_values",
                         f"encode every {fmt} value and midpoint (default rounding "
                         f"{_DEFAULT_ROUNDING[fmt]}, no saturation)", fmt=fmt, saturate=False, rounding=None))
        out.append(_case(f"encode-{fmt}-sat", "formats.encode", "format_values",
                         f"encode every {fmt} value and midpoint plus +-2*max and +-inf with saturation",
                         fmt=fmt, saturate=True, rounding=None, overflow=True))
        for r in _OTHER_ROUNDINGS[fmt]:
            out.append(_case(f"encode-{fmt}-{r}", "formats.encode", "format_values",
                             f"encode every {fmt} value and midpoint with rounding {r!r}",
                             fmt=fmt, saturate=False, rounding=r))
    return out


register_set("formats", "every code (decode) and every value and midpoint (encode) of each 8-bit format "
             "and FP4 E2M1, each rounding mode, with and without saturation", format_cases)


# --------------------------------------------------------------------------------------------------
# dynamic block quant (docs/numerics/quantisers.md#dynamic_block_quant)


def dynamic_block_quant_cases() -> list[Case]:
    out = []
    grid = [
        # name, dst, round, rb, cb, shape, x_dtype, extras
        ("int8-1x128-bf16", "int8", "rint", 1, 128, dict(M=16, N=384), "bfloat16", {}),
        ("int8-1x128-fp16-edge", "int8", "rint", 1, 128, dict(M=7, N=300), "float16", dict(zero_block=True)),
        ("int8-1x128-fp32-3d", "int8", "rint", 1, 128, dict(B=2, M=5, N=256), "float32", dict(outliers=True)),
        ("int8-128x64-minscale", "int8", "rint", 128, 64, dict(M=100, N=200), "bfloat16", dict(min_scale=2.0)),
        ("e4m3-128x128", "float8_e4m3fn", "rint", 128, 128, dict(M=130, N=256), "bfloat16", {}),
        ("e5m2-1x64", "float8_e5m2", "rint", 1, 64, dict(M=9, N=192), "float16", dict(outliers=True)),
        ("hif8-1x128", "hifloat8", "round", 1, 128, dict(M=12, N=256), "bfloat16", {}),
        ("hif8-256x192-max224", "hifloat8", "round", 256, 192, dict(M=260, N=384), "bfloat16",
         dict(dst_type_max=224.0, zero_block=True)),
    ]
    for name, dst, rm, rb, cb, shape, xdt, extra in grid:
        extra = dict(extra)
        min_scale = extra.pop("min_scale", 0.0)
        dmax = extra.pop("dst_type_max", 0.0)
        out.append(_case(f"dbq-{name}", "dynamic_block_quant", "dynamic_block_quant",
                         f"dynamic_block_quant to {dst}, {rb}x{cb} blocks, {xdt} input",
                         dst_type=dst, round_mode=rm, row_block_size=rb, col_block_size=cb, min_scale=min_scale,
                         dst_type_max=dmax, x_dtype=xdt, **shape, **extra))
    return out


register_set("dynamic-block-quant", "npu_dynamic_block_quant: INT8 / FP8 / HiFloat8 destinations, block "
             "shapes with partial edge blocks, min_scale, dst_type_max, zero blocks", dynamic_block_quant_cases)


# --------------------------------------------------------------------------------------------------
# KvCompressEpilog (docs/numerics/cache-writers.md#kv_compress_epilog)


def kv_compress_epilog_cases() -> list[Case]:
    out = []
    for mode in (0, 1):
        for rs in (True, False):
            tag = f"mode{mode}-{'rs' if rs else 'nors'}"
            out.append(_case(f"kvce-{tag}", "kv_compress_epilog", "kv_compress_epilog",
                             f"KvCompressEpilog quant_mode {mode}, round_scale {rs}, d 576, two -1 slots, "
                             "zero groups", d=576, bs=6, quant_mode=mode, round_scale=rs, skip=2,
                             zero_groups=True, block_size=16, block_num=2))
        out.append(_case(f"kvce-mode{mode}-d192-outliers", "kv_compress_epilog", "kv_compress_epilog",
                         f"KvCompressEpilog quant_mode {mode}, d 192 (n 128), outlier column, int32 slots",
                         d=192, bs=5, quant_mode=mode, round_scale=True, skip=1, outliers=True,
                         slot_dtype="int32", block_size=8, block_num=3))
    for gs in (16, 32, 64):
        out.append(_case(f"kvce-mode2-gs{gs}", "kv_compress_epilog", "kv_compress_epilog",
                         f"KvCompressEpilog quant_mode 2 (HiF8 RoPE + FP4 NoPE), group size {gs}, zero groups",
                         d=576, bs=5, quant_mode=2, quant_group_size=gs, round_scale=False, skip=1,
                         zero_groups=True, x_scale=1.0, block_size=16, block_num=1))
    # the OPEN facts of KvCompressEpilog (docs/numerics/open-facts.md) as their alternatives (the defaults are in the cases above)
    out.append(_case("kvce-mode0-pad128", "kv_compress_epilog", "kv_compress_epilog",
                     "KvCompressEpilog quant_mode 0 with the OPEN padding granularity 128 (default 32)",
                     d=576, bs=4, quant_mode=0, round_scale=True, skip=1, pad_to=128, block_size=16, block_num=1))
    out.append(_case("kvce-mode2-nibble-high", "kv_compress_epilog", "kv_compress_epilog",
                     "KvCompressEpilog quant_mode 2 with the OPEN FP4 nibble order high_first (default low_first)",
                     d=576, bs=4, quant_mode=2, quant_group_size=32, skip=1, fp4_nibble_order="high_first",
                     block_size=16, block_num=1))
    out.append(_case("kvce-mode2-xscale-lead", "kv_compress_epilog", "kv_compress_epilog",
                     "KvCompressEpilog quant_mode 2 with x_scale 0.5 and x of shape [2, 3, 576]",
                     d=576, lead=[2, 3], quant_mode=2, quant_group_size=32, x_scale=0.5, skip=1,
                     block_size=16, block_num=1))
    return out


register_set("kv-compress-epilog", "KvCompressEpilog (950): quant modes 0/1/2, round_scale on/off, FP4 "
             "group sizes 16/32/64, zero groups, -1 slots, untouched row tails", kv_compress_epilog_cases)


# --------------------------------------------------------------------------------------------------
# QSFA C8 cache writers (docs/numerics/cache-writers.md#c8_cache_write)


def c8_cases() -> list[Case]:
    out = []
    for dt in ("bfloat16", "float16"):
        for rope in (64, 0):
            out.append(_case(f"c8w-{dt}-rope{rope}", "c8_cache_write", "c8_cache_write",
                             f"C8 writer stage 2 (int8 1x128 quant + pack + scatter), {dt}, rope {rope}, "
                             "a zero tile, a -1 slot", T=7, rope=rope, dtype=dt, zero_tile=True, skip=1,
                             block_size=16, block_num=2))
    out.append(_case("c8w-e4m3-int32-slots", "c8_cache_write", "c8_cache_write",
                     "C8 writer with float8_e4m3fn NoPE (950), int32 slots", T=5, rope=64, dtype="bfloat16",
                     key_dtype="float8_e4m3fn", slot_dtype="int32", skip=2, block_size=16, block_num=1))
    for tmax in (0.0, 15.0):
        out.append(_case(f"c8w-hif8-max{int(tmax)}", "c8_cache_write", "c8_cache_write",
                         f"C8 writer with HiFloat8 NoPE (950; OPEN scale rule amax / TYPE_MAX, dst_type_max {tmax}), "
                         "a zero tile, a -1 slot", T=5, rope=64, dtype="bfloat16", key_dtype="hifloat8",
                         dst_type_max=tmax, zero_tile=True, skip=1, block_size=16, block_num=1))
    for dt in ("bfloat16", "float16"):
        for rope in (64, 0):
            out.append(_case(f"c8r-{dt}-rope{rope}", "c8_rmsnorm_rope_cache", "c8_rmsnorm_rope_cache",
                             f"C8 writer from the latent KV (RMSNorm + interleave RoPE + int8 quant + scatter), "
                             f"{dt}, rope {rope}", T=9, rope_head_dim=rope, dtype=dt, skip=2, block_size=16,
                             block_num=2))
    return out


register_set("c8-cache", "QSFA C8 cache writers: packed 656/528-byte rows from k_nope/k_rope or from the latent "
             "KV, bf16/fp16, rope 64/0, int8, FP8 and HiFloat8 NoPE, zero tiles, -1 slots", c8_cases)


# --------------------------------------------------------------------------------------------------
# FlashMLA MODEL1 FP8 sparse cache (docs/numerics/flashmla-model1.md)

M1Q, M1D = "layouts.flashmla_model1_quantize", "layouts.flashmla_model1_dequantize"


def flashmla_model1_cases() -> list[Case]:
    out = []
    for bs in (1, 2, 64):
        out.append(_case(f"m1q-bs{bs}", M1Q, "flashmla_model1",
                         f"MODEL1 quantise, block_size {bs} ({bs * 584} data bytes padded to a multiple of 576), "
                         "a zero tile and a 1e-4-floor tile per token", block_num=2, block_size=bs, zero_tiles=True,
                         tiny_tiles=True, seed_name=f"m1-bs{bs}"))
        out.append(_case(f"m1d-bs{bs}", M1D, "flashmla_model1",
                         f"MODEL1 dequantise of the m1q-bs{bs} cache (same k)", block_num=2, block_size=bs,
                         zero_tiles=True, tiny_tiles=True, for_dequantize=True, seed_name=f"m1-bs{bs}"))
    out.append(_case("m1q-bs72-spread", M1Q, "flashmla_model1",
                     "MODEL1 quantise, block_size 72 (no block padding: 72 * 584 = 73 * 576), tile magnitudes "
                     "2^-30..2^30", block_num=1, block_size=72, spread=True))
    out.append(_case("m1d-random-bytes", M1D, "flashmla_model1",
                     "MODEL1 dequantise of random bytes: NaN codes, the NaN scale byte 0xFF, bf16 overflow to inf, "
                     "subnormal products", block_num=3, block_size=3, random_bytes=True))
    return out


register_set("flashmla-model1", "FlashMLA MODEL1 FP8 sparse cache (DeepSeek V4): quantise and dequantise, block "
             "sizes 1/2/64/72, zero and 1e-4-floor tiles, tile magnitudes over 2^+-30, random cache bytes",
             flashmla_model1_cases)


# --------------------------------------------------------------------------------------------------
# vLLM-Ascend kv_compress_epilog (docs/numerics/cache-writers.md#kv_compress_epilog_vllm)

KCEV = "kv_compress_epilog_vllm"


def kv_compress_epilog_vllm_cases() -> list[Case]:
    out = [_case("kcev-vllm-call", KCEV, "kv_compress_epilog_vllm",
                 "vLLM-Ascend's own call (device_op.py): d 512, group 64, round_scale, layout 1, E4M3FN cache, "
                 "zero groups, a 448 group (doubled power-of-two scale), two -1 slots", d=512, bs=6, skip=2,
                 quant_group_size=64, round_scale_flag=True, layout=1, zero_groups=True, pow2_group=True)]
    for gs in (64, 128):
        for rs in (True, False):
            for fmt in ("float8_e4m3fn", "float8_e5m2"):
                tag = f"g{gs}-{'rs' if rs else 'nors'}-{'e4m3' if fmt == 'float8_e4m3fn' else 'e5m2'}"
                out.append(_case(f"kcev-l1-{tag}", KCEV, "kv_compress_epilog_vllm",
                                 f"layout 1, group {gs}, round_scale {rs}, {fmt} cache, d 576, a -1 slot",
                                 d=576, bs=5, skip=1, quant_group_size=gs, round_scale_flag=rs, layout=1,
                                 cache_dtype=fmt, zero_groups=True, seed_name=f"kcev-{tag}"))
                out.append(_case(f"kcev-l2-{tag}", KCEV, "kv_compress_epilog_vllm",
                                 f"layout 2 (blocks of values, then scales), group {gs}, round_scale {rs}, {fmt}, "
                                 "d 576, block_size 4", d=576, bs=5, skip=1, quant_group_size=gs, round_scale_flag=rs,
                                 layout=2, cache_dtype=fmt, block_size=4, block_num=2, zero_groups=True,
                                 seed_name=f"kcev-{tag}"))
    out.append(_case("kcev-l2-model1", KCEV, "kv_compress_epilog_vllm",
                     "layout 2 with d 512, group 64: FlashMLA's MODEL1 geometry (576 value + 8 scale bytes per "
                     "token), block_size 8", d=512, bs=8, quant_group_size=64, layout=2, block_size=8, block_num=2,
                     tail=0))
    out.append(_case("kcev-partial-group", KCEV, "kv_compress_epilog_vllm",
                     "d 208: 144 NoPE values, partial last group (64 + 64 + 16 / 128 + 16), int32 slots",
                     d=208, bs=3, quant_group_size=128, layout=1, slot_dtype="int32"))
    return out


register_set("kv-compress-epilog-vllm", "vLLM-Ascend's kv_compress_epilog (MXFP8, Ascend 950): its own call, "
             "layouts 1 and 2, groups 64/128, round_scale on/off, E4M3FN and E5M2 caches, partial groups",
             kv_compress_epilog_vllm_cases)


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4 indexer cache writers (docs/numerics/cache-writers.md#indexer_quant_cache, #indexer_compress_epilog_v2)

IQC, ICE2 = "indexer_quant_cache", "indexer_compress_epilog_v2"


def indexer_quant_cache_cases() -> list[Case]:
    out = []
    for mode in ("mxfp8", "fp8", "hifloat8", "mxfp4"):
        fmts = ("float8_e4m3fn", "float8_e5m2") if mode in ("mxfp8", "fp8") else (None,)
        for fmt in fmts:
            for xdt in ("bfloat16", "float16"):
                for rs in ((True, False) if mode == "fp8" else (True,)):
                    tag = "-".join(p for p in (mode, fmt and fmt[6:], xdt[:4], None if rs else "nors") if p)
                    out.append(_case(f"iqc-{tag}", IQC, IQC,
                                     f"quant_mode {mode!r}, {fmt or 'uint8'} cache, {xdt} x, round_scale {rs}: "
                                     "d 128, an all-zero MX group and an all-zero token, two -1 slots",
                                     d=128, bs=6, skip=2, quant_mode=mode, cache_dtype=fmt, x_dtype=xdt,
                                     round_scale=rs, x_scale=0.75, zero_groups=True, block_size=4, block_num=2,
                                     scale=float(2 ** ((len(out) % 7) - 3))))
    out.append(_case("iqc-mxfp4-d8192", IQC, IQC, "quant_mode 'mxfp4' at the largest d (8192), block_size 1",
                     d=8192, bs=2, quant_mode="mxfp4", block_size=1, block_num=3))
    return out


register_set("indexer-quant-cache", "cann_ops_transformer.indexer_quant_cache (Ascend 950): MX-FP8, FP8 with an "
             "fp32 scale per token (round_scale on/off), HiFloat8, MX-FP4; E4M3FN / E5M2 caches, bf16 / fp16 x",
             indexer_quant_cache_cases)


def indexer_compress_epilog_v2_cases() -> list[Case]:
    return [
        _case("ice2-vllm-call", ICE2, ICE2, "vLLM-Ascend's call: d 128 (132-byte rows), block_size 4, bf16, "
              "an all-zero token, a -1 slot", d=128, bs=7, skip=1, zero_groups=True, block_size=4, block_num=2),
        _case("ice2-partial-group", ICE2, ICE2, "d 200: groups of 128 and 72, float16 x, head_dim 8 bytes wider",
              d=200, bs=5, x_dtype="float16", block_size=2, block_num=3, tail=8),
        _case("ice2-small-values", ICE2, ICE2, "d 256, values around 2^-20 (scales far below 1)", d=256, bs=4,
              scale=2.0 ** -20, block_size=4, block_num=1),
    ]


register_set("indexer-compress-epilog-v2", "vLLM-Ascend indexer_compress_epilog_v2 (Ascend 950): FP8 E4M3FN with "
             "fp32 scales per 128 values in one uint8 block cache", indexer_compress_epilog_v2_cases)


SPKS = "scatter_pa_kv_cache_with_k_scale"


def scatter_pa_kv_cache_with_k_scale_cases() -> list[Case]:
    return [
        _case("spks-e4m3", SPKS, SPKS, "E4M3FN K / V (128 / 128), 2 heads, block_size 4, a -1 slot and a slot past the "
              "cache", bs=6, heads=2, skip=1, past_end=1, fmt="float8_e4m3fn"),
        _case("spks-e5m2-int64", SPKS, SPKS, "E5M2, K 64 / V 192, 1 head, block_size 16, int64 slots", bs=5, heads=1,
              dk=64, dv=192, block_size=16, block_num=1, fmt="float8_e5m2", slot_dtype="int64"),
    ]


register_set("scatter-pa-kv-cache-with-k-scale", "cann_ops_transformer.scatter_pa_kv_cache_with_k_scale (Ascend 950): "
             "FP8 K / V and per-head fp32 K scales into BNBD caches", scatter_pa_kv_cache_with_k_scale_cases)


VQLI = "vllm_quant_lightning_indexer"


def vllm_quant_lightning_indexer_cases() -> list[Case]:
    pa = dict(layout_key="PA_BSND")
    return [
        _case("vqli-a3-c4-decode", VQLI, VQLI, "A2/A3 int8, cmp_ratio 4, decode (B 4, one row), 40 compressed tokens, "
              "original lengths with remainders 0..3", fmt="int8", cmp_ratio=4, batch=4, q_s=1, kv_s=40,
              act_kv_orig=[160, 131, 97, 4], sparse_count=16, block_size=16, **pa),
        _case("vqli-a3-c4-mtp-tnd", VQLI, VQLI, "A2/A3 int8, cmp_ratio 4, TND with 3 rows per request (speculative "
              "decoding): the causal rule at 3 offsets", fmt="int8", cmp_ratio=4, batch=2, q_s=3, kv_s=24,
              act_kv_orig=[94, 61], sparse_count=12, layout_query="TND", **pa),
        _case("vqli-a3-c128", VQLI, VQLI, "A2/A3 int8, cmp_ratio 128 (HCA): a request below one compressed token",
              fmt="int8", cmp_ratio=128, batch=3, q_s=2, kv_s=6, act_kv_orig=[700, 127, 256], sparse_count=4,
              block_size=32, **pa),
        _case("vqli-950-c4", VQLI, VQLI, "Ascend 950 FP8 E4M3FN with float32 weights and scales, cmp_ratio 4: scores "
              "sorted as bfloat16 (CAST_ROUND)", fmt="float8_e4m3fn", cmp_ratio=4, batch=2, q_s=2, kv_s=32,
              act_kv_orig=[128, 77], sparse_count=16, **pa),
        _case("vqli-950-c128", VQLI, VQLI, "Ascend 950 FP8 E4M3FN, cmp_ratio 128", fmt="float8_e4m3fn", cmp_ratio=128,
              batch=2, q_s=1, kv_s=8, act_kv_orig=[1024, 300], sparse_count=8, **pa),
    ]


register_set("vllm-quant-lightning-indexer", "vLLM-Ascend npu_vllm_quant_lightning_indexer (DeepSeek-V4): int8 (A2/A3) "
             "and FP8 (950) indexers over a paged compressed key, cmp_ratio 4 and 128, decode, speculative rows, "
             "a request without a compressed token", vllm_quant_lightning_indexer_cases)


QLI2 = "quant_lightning_indexer_v2"


def quant_lightning_indexer_v2_cases() -> list[Case]:
    def c(name, description, fmt, **kw):
        qm = {"int8": 2, "float8_e4m3fn": 1, "hifloat8": 4}[fmt]
        return _case(name, QLI2, QLI2, description, fmt=fmt, quant_mode=qm, **kw)

    return [
        c("qli2-a3-c4-decode", "Atlas A2/A3 int8 (quant_mode 2), paged key, cmp_ratio 4, decode (B 4, one row), 40 "
          "compressed tokens and a residual of 3 original tokens", "int8", layout_q="BSND", layout_k="PA_BBND",
          cmp_ratio=4, mask_mode=3, batch=4, q_s=1, kv_s=40, residual=3, topk=16, block_size=16),
        c("qli2-a3-c128-mtp-tnd", "Atlas A2/A3 int8, cmp_ratio 128 (HCA), TND with 3 rows per request: the causal "
          "rule at 3 offsets with a residual of 127", "int8", layout_q="TND", layout_k="PA_BBND", cmp_ratio=128,
          mask_mode=3, batch=2, q_s=3, kv_s=6, residual=127, topk=4, block_size=32),
        c("qli2-950-fp8-c4-bsnd", "Ascend 950 FP8 E4M3FN (quant_mode 1), float32 weights and scales, BSND key, "
          "cmp_ratio 4: scores sorted as bfloat16 (CAST_ROUND)", "float8_e4m3fn", layout_q="BSND", layout_k="BSND",
          cmp_ratio=4, mask_mode=3, batch=2, q_s=2, kv_s=32, residual=1, topk=16),
        c("qli2-950-hif8-c128-tnd", "Ascend 950 HiFloat8 (quant_mode 4, one float32 scale each for query and key), "
          "TND query and key, cmp_ratio 128", "hifloat8", layout_q="TND", layout_k="TND", cmp_ratio=128, mask_mode=3,
          batch=2, q_s=2, kv_s=8, residual=5, topk=8),
        c("qli2-950-fp8-c1-mask0", "Ascend 950 FP8 E4M3FN, paged key, cmp_ratio 1, mask_mode 0 (every token "
          "visible, no cmp_residual_k)", "float8_e4m3fn", layout_q="BSND", layout_k="PA_BBND", cmp_ratio=1,
          mask_mode=0, batch=2, q_s=2, kv_s=20, topk=8),
    ]


register_set("quant-lightning-indexer-v2", "ops-transformer QuantLightningIndexerV2 (DeepSeek-V4, "
             "torch.ops.cann_ops_transformer.quant_lightning_indexer): int8 (A2/A3), FP8 E4M3FN and HiFloat8 (950), "
             "paged / BSND / TND keys, cmp_ratio 1, 4 and 128 with cmp_residual_k", quant_lightning_indexer_v2_cases)


QKVS = "qkv_rms_norm_rope_cache_with_k_scale"


def qkv_rms_norm_rope_cache_with_k_scale_cases() -> list[Case]:
    def c(name, description, nq, **kw):
        return _case(name, QKVS, QKVS, description, nq=nq, head_nums=[nq, nq // 8, nq // 8], **kw)

    return [
        c("qkvs-tnd-ntd-decode", "8 requests of one new token with history, Nq 64 / Nk 8, TND in, NTD q_out, slots over "
          "2 blocks of 16", 64, t=8, batch=8, layout_qkv="TND", layout_q_out="NTD", block_num=2, block_size=16,
          max_seq=96),
        c("qkvs-tnd-tnd-prefill", "2 requests over 10 tokens (cut at random, with history), Nq 16 / Nk 2, TND in "
          "and out, block size 32", 16,
          t=10, batch=2, layout_qkv="TND", layout_q_out="TND", block_num=1, block_size=32, max_seq=24),
        c("qkvs-ntd-ntd", "NTD in and out, Nq 8 / Nk 1, 3 requests", 8, t=5, batch=3, layout_qkv="NTD",
          layout_q_out="NTD", block_num=1, block_size=16, max_seq=40),
        *(c(f"qkvs-mrope-{tag}", f"M-RoPE: T / H / W positions, mrope_section {sec}, bf16 Q, INT8 K, per-lane "
            f"v_scale; Nq {nq} / Nk {nq // 8}, TND in and out", nq, t=t, layout_qkv="TND", layout_q_out="TND",
            block_num=2, block_size=16, max_seq=48, query_start_loc=None, seq_lens=None, mrope_section=sec,
            q_quant_mode="NoQuant", q_out_dtype="bfloat16")
          for tag, sec, nq, t in (("22-12-10", [22, 12, 10], 16, 6), ("0-21-21", [0, 21, 21], 8, 5))),
        *(c(f"qkvs-mx-{tag}", f"M-RoPE MX: MXFP8 Q and K with E8M0 scales per 32 lanes, no rotation; Nq {nq} / Nk "
            f"{nq // 8}, T {t}, mrope_section {sec}, mx_aiv_num {aiv} ({what})", nq, t=t, layout_qkv="TND",
            layout_q_out="TND", block_num=1, block_size=16, max_seq=48, query_start_loc=None, seq_lens=None,
            rotation=None, mrope_section=sec, q_quant_mode="Mx", k_quant_mode="Mx", q_out_dtype="float8_e4m3fn",
            mx_aiv_num=aiv)
          for tag, sec, nq, t, aiv, what in (
              ("16-t11", [22, 12, 10], 16, 11, 1, "one core: K tokens 0-7 fill a 16-row batch, 8-10 go row by row"),
              ("24-t5", [16, 21, 21], 24, 5, 64, "16 Q heads batched, the 8-head Q tail and every K row by row"))),
    ]


register_set("qkv-rms-norm-rope-cache-with-k-scale", "cann_ops_transformer.qkv_rms_norm_rope_cache_with_k_scale_ "
             "(Ascend 950, RoPE scenario): RMSNorm + RoPE + bf16 rotation + per-token-head FP8 Q / K, FP8 V, K-scale "
             "cache by slot; and the M-RoPE scenario (bf16 Q, INT8 K)", qkv_rms_norm_rope_cache_with_k_scale_cases)


# --------------------------------------------------------------------------------------------------
# KvRmsNormRopeCache V1 / V2 (docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache)

_KRR_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")


def _krr_case(name, description, *, cache_mode, k_fmt, ckv_fmt, **kw):
    return _case(name, "kv_rmsnorm_rope_cache", "kv_rmsnorm_rope_cache", description, cache_mode=cache_mode,
                 k_fmt=k_fmt, ckv_fmt=ckv_fmt, is_output_kv=True, epsilon=1e-5,
                 k_cache_dtype=k_fmt if k_fmt == "hifloat8" else None,
                 ckv_cache_dtype=ckv_fmt if ckv_fmt == "hifloat8" else None, **kw)


def kv_rmsnorm_rope_cache_cases() -> list[Case]:
    out = []
    v1 = dict(version=1, heads=1, dv=512, dk=64, batch=2, seq=37)
    v2 = dict(version=2, heads=2, dv=128, dk=192, rope=64, batch=2, seq=37)
    for mode in _KRR_MODES:
        for ver, shape in (("v1", v1), ("v2", v2)):
            for quant in (False, True):
                fmt = "int8" if quant else "bfloat16"
                tag = "int8" if quant else "bf16"
                extra = dict(offsets=True) if (quant and ver == "v2") else {}
                out.append(_krr_case(f"krr-{ver}-{mode}-{tag}",
                                     f"KvRmsNormRopeCache {ver.upper()}, cache_mode {mode}, "
                                     f"{'int8 static quant' + (' with offsets' if extra else '') if quant else 'bf16 caches'}",
                                     cache_mode=mode, k_fmt=fmt, ckv_fmt=fmt, dtype="bfloat16", **shape, **extra))
    # 950 formats (V1), fp16, broadcast cos/sin and quant parameter shapes
    out.append(_krr_case("krr-v1-PA_BNSD-hif8-e4m3", "V1 with a HiFloat8 K cache and FP8 E4M3FN CKV cache "
                         "(uint8 / float8 buffers), offsets", cache_mode="PA_BNSD", k_fmt="hifloat8",
                         ckv_fmt="float8_e4m3fn", offsets=True, dtype="bfloat16", **v1))
    out.append(_krr_case("krr-v1-PA_NZ-e5m2-fp16", "V1, NZ cache, FP8 E5M2 K and fp16 CKV, fp16 input",
                         cache_mode="PA_NZ", k_fmt="float8_e5m2", ckv_fmt="float16", dtype="float16", **v1))
    out.append(_krr_case("krr-v1-Norm-fp16-cos1", "V1 Norm, fp16, cos/sin broadcast over the sequence [B, N, 1, Dk]",
                         cache_mode="Norm", k_fmt="float16", ckv_fmt="float16", dtype="float16", cos_seq1=True, **v1))
    out.append(_krr_case("krr-v1-PA-int8-param1", "V1 PA (Ascend 950) with int8 caches and quant parameters of "
                         "shape [1]", cache_mode="PA", k_fmt="int8", ckv_fmt="int8", dtype="bfloat16", param_shape="1",
                         **v1))
    return out


register_set("kv-rmsnorm-rope-cache", "KvRmsNormRopeCache V1 and V2: every cache mode (Norm, PA, PA_BNSD, PA_NZ, "
             "PA_BLK_BNSD, PA_BLK_NZ), bf16 and int8 caches (V2 with offsets), FP8/HiFloat8 caches, fp16, "
             "broadcast cos/sin", kv_rmsnorm_rope_cache_cases)


# --------------------------------------------------------------------------------------------------
# docs/numerics/attention.md#scenarios scenarios

QSFA = "kv_quant_sparse_flash_attention"


def seed_decode_cases() -> list[Case]:
    out = []
    for dt in ("bfloat16", "float16"):
        out.append(_case(f"decode-{dt}", QSFA, "qsfa_attention",
                         f"docs/numerics/attention.md#scenarios decode: B=1, Q_S=1, Q_N=64, KV_N=1, rope 64, PA_BSND block_size 256 x 16 blocks, "
                         f"KV_S 4096, 2048 sparse indices, sparse_mode 3, scale (512+64)^-0.5, {dt} query",
                         q_lens=[1], kv_lens=[4096], heads=64, rope_head_dim=64, dtype=dt, layout_query="BSND",
                         layout_kv="PA_BSND", block_size=256, num_blocks=16, width=2048, sparse_block_size=1,
                         data="realistic", rope_fill="randn", scale_value=(512 + 64) ** -0.5, sparse_mode=3,
                         key_quant_mode=2, value_quant_mode=2, return_softmax_lse=True))
    return out


register_set("seed-decode", "docs/numerics/attention.md#scenarios decode scenario (vLLM-Ascend): one token, 64 heads, 2048 of 4096 "
             "paged int8 tokens (bf16 and fp16 query)", seed_decode_cases)

#: the three layout scenarios of vLLM-Ascend's rope0 suite (name, layout_query, layout_kv, heads,
#: sparse_block_size, q_lens, kv_lens); index width = 640 / sparse_block_size, PA page size 128
_ROPE0 = (
    ("bsnd-pa", "BSND", "PA_BSND", 4, 1, [1, 3], [249, 761]),
    ("tnd-pa", "TND", "PA_BSND", 8, 16, [2, 3], [505, 761]),
    ("tnd-tnd", "TND", "TND", 2, 2, [2, 3], [249, 505]),
)


def seed_rope0_cases() -> list[Case]:
    out = []
    for name, lq, lkv, heads, sbs, ql, kl in _ROPE0:
        common = dict(q_lens=ql, kv_lens=kl, heads=heads, layout_query=lq, layout_kv=lkv, sparse_block_size=sbs,
                      width=640 // sbs, block_size=128, scale_value=(512 + 64) ** -0.5, sparse_mode=3,
                      key_quant_mode=2, value_quant_mode=2)
        for dt in ("float16", "bfloat16"):
            for lse in (False, True):
                for rope in (0, 64):
                    out.append(_case(f"rope0-{name}-{dt}-lse{int(lse)}-rope{rope}", QSFA, "qsfa_attention",
                                     f"docs/numerics/attention.md#scenarios rope0 suite: {lq} query + {lkv} KV, {heads} heads, sparse block "
                                     f"{sbs}, {dt}, LSE {'on' if lse else 'off'}, rope {rope} (RoPE parts zero and "
                                     "the same data in all four: rope 0 and rope 64 give the same bits)",
                                     rope_head_dim=rope, dtype=dt, return_softmax_lse=lse, data="random",
                                     rope_fill="zeros", seed_name=f"rope0-{name}-{dt}", **common))
        for dt in ("float16", "bfloat16"):
            for rope in (0, 64):
                out.append(_case(f"rope0-{name}-{dt}-uniform-rope{rope}", QSFA, "qsfa_attention",
                                 f"docs/numerics/attention.md#scenarios uniform attention: every score 0, so out = mean of the selected V, "
                                 f"softmax_max = 0, softmax_sum = token count; {lq} + {lkv}, {dt}, rope {rope}",
                                 rope_head_dim=rope, dtype=dt, return_softmax_lse=True, data="uniform", **common))
    for dt in ("float16", "bfloat16"):
        for rope in (64, 0):
            out.append(_case(f"pipeline-c8-{dt}-rope{rope}", "c8_rmsnorm_rope_cache", "c8_rmsnorm_rope_cache",
                             "docs/numerics/attention.md#scenarios pipeline: RMSNorm + int8 quant + cache write, slots [0..4, -1], cache "
                             f"prefilled with 17 (unwritten bytes keep 17), {dt}, rope {rope}",
                             T=6, rope_head_dim=rope, dtype=dt, slots=[0, 1, 2, 3, 4, -1], block_size=16,
                             block_num=1))
    return out


register_set("seed-rope0", "docs/numerics/attention.md#scenarios rope0 suite (vLLM-Ascend): 3 layout scenarios x fp16/bf16 x LSE off/on "
             "x rope 0/64, uniform-attention cases, and the C8 pipeline cache-write case", seed_rope0_cases)


# --------------------------------------------------------------------------------------------------
# every operator's contract example


def example_case(op: str, name: str | None = None) -> Case:
    """A case of ``op`` built from its contract's example (arrays generated, scalars as params)."""
    import numpy as np

    from .._dispatch import operators

    name = name or f"example-{op.replace('.', '-')}"
    seed = seed_of(name)
    args = operators()[op].contract.example(np.random.default_rng(seed))
    params = {k: v for k, v in args.items() if not isinstance(v, np.ndarray)}
    return Case(name=name, op=op, params=dict(params, example_of=op), seed=seed, generator="example",
                description=f"the contract example of {op}")


def example_cases() -> list[Case]:
    from .._dispatch import operators

    return [example_case(op) for op in sorted(operators())]


register_set("examples", "one small case per operator of this build, from its contract's example argument set "
             "(every operator, including SFA, the lightning indexers and the LSE merge)", example_cases)


# --------------------------------------------------------------------------------------------------
# smoke


def smoke_cases() -> list[Case]:
    pick = {
        "formats": ("decode-hifloat8", "encode-float8_e4m3fn-sat"),
        "dynamic-block-quant": ("dbq-int8-1x128-bf16", "dbq-hif8-1x128"),
        "kv-compress-epilog": ("kvce-mode1-rs", "kvce-mode2-gs32"),
        "c8-cache": ("c8r-bfloat16-rope64",),
        "kv-rmsnorm-rope-cache": ("krr-v1-PA_BNSD-int8", "krr-v2-PA_NZ-bf16"),
        "seed-rope0": ("rope0-tnd-tnd-bfloat16-lse1-rope64", "rope0-bsnd-pa-float16-uniform-rope0"),
    }
    out = []
    for set_name, names in pick.items():
        by_name = {c.name: c for c in get_set(set_name).cases()}
        out += [by_name[n] for n in names]
    return out


register_set("smoke", "a handful of tiny cases over several operators: generated and verified in seconds",
             smoke_cases)


# --------------------------------------------------------------------------------------------------
# layer chains (qsfa.chain; docs/golden.md#chains): one case per link, every intermediate stored

_V32_CHIPS = (("a3-int8", {"chip": "A3", "key_dtype": "int8", "return_softmax_lse": True}),
              ("950-fp8", {"chip": "950", "key_dtype": "float8_e4m3fn", "return_softmax_lse": False}))


def _v32_layer_cases(set_name: str, steps) -> list[Case]:
    from .chain import chain_cases

    out = []
    for step, shape in steps:
        for tag, chip in _V32_CHIPS:
            inst = f"{step}-{tag}"
            params = {**shape, **chip, "heads": 4, "n1": 8, "block_size": 16, "scale_value": 576 ** -0.5}
            out += chain_cases("v32-mla-c8", inst, params, seed=seed_of(f"{set_name}.{inst}"),
                               description=f"v32-mla-c8 {step}, {chip['chip']} {chip['key_dtype']} cache")
    return out


register_set("v32-layer-decode", "DeepSeek-V3.2 MLA layer chain v32-mla-c8, decode (1 new token per request, "
             "uneven histories): every intermediate per link; A3 int8 and 950 FP8 caches",
             lambda: _v32_layer_cases("v32-layer-decode", (
                 ("decode", {"q_lens": [1, 1, 1], "kv_lens": [37, 20, 64], "sparse_count": 16}),)))
register_set("v32-layer-prefill", "DeepSeek-V3.2 MLA layer chain v32-mla-c8, prefill (a fresh request and a "
             "chunked one over a cached prefix): every intermediate per link; A3 int8 and 950 FP8 caches",
             lambda: _v32_layer_cases("v32-layer-prefill", (
                 ("prefill", {"q_lens": [20, 13], "kv_lens": [20, 29], "sparse_count": 8}),)))


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4 shared-KV attention (docs/numerics/attention-v4.md)

SFM = "sparse_flash_mla"
MQ = "mixed_quant_sparse_flash_mla"
KQS = "kv_quant_sparse_attn_sharedkv"
QSM = "quant_sparse_flash_mla"


def _v4_case(name, op, description, *, scenario, layout_q="BSND", layout_kv="BSND", qdtype="bfloat16", batch=2,
             s1=1, s2=300, n1=64, k=512, block_size=16, quant_mode=None, sinks_kind=None, lse=False):
    """A V4 case: the generator builds the arrays, the scalars (A2/A3's only values: window 127 / 0, band and
    causal masks, cmp_ratio 1 / 4 / 128) are params."""
    ratio = {"SWA": 1, "CSA": 4, "HCA": 128}[scenario]
    p = dict(v4_op=op, scenario=scenario, layout_q=layout_q, layout_kv=layout_kv, qdtype=qdtype, batch=batch, s1=s1,
             s2=s2, n1=n1, k=k, block_size=block_size, ratio=ratio, softmax_scale=512 ** -0.5, cmp_ratio=ratio,
             ori_mask_mode=4, cmp_mask_mode=0 if scenario == "SWA" else 3, ori_win_left=127, ori_win_right=0,
             return_softmax_lse=lse)
    if sinks_kind:
        p["sinks_kind"] = sinks_kind
    if op == MQ:
        p.update(quant_mode=quant_mode or (2 if layout_kv == "PA_BBND" else 1), rope_head_dim=64)
    if op == KQS:
        p.update(kv_quant_mode=1, tile_size=64, rope_head_dim=64)
    if op == QSM:
        p.update(quant_mode=1, topk_value_mode=1)
    return _case(name, op, "sharedkv", description, **p)


def _v4_cases(scenario) -> list[Case]:
    tag = scenario.lower()
    out = []
    for lq, lk, bs in (("BSND", "BSND", 16), ("TND", "TND", 16), ("BSND", "PA_BBND", 16), ("TND", "PA_BBND", 128),
                       ("BSND", "PA_BBND", 1024)):
        for s1, phase in ((1, "decode"), (5, "prefill")):
            for qd in ("bfloat16", "float16"):
                name = f"v4-{tag}-{phase}-{lq}-{lk}{'' if lk != 'PA_BBND' else f'-bs{bs}'}-{qd}"
                out.append(_v4_case(name, SFM, f"sparse_flash_mla {scenario}, {phase} (S1 {s1}), q {lq} / KV {lk}"
                                    f"{f' block {bs}' if lk == 'PA_BBND' else ''}, {qd}, 64 heads, 300 original tokens "
                                    "(two S2 tiles on A2/A3 with the compressed part)", scenario=scenario,
                                    layout_q=lq, layout_kv=lk, qdtype=qd, s1=s1, block_size=bs, lse=lq == "TND"))
    out.append(_v4_case(f"v4-{tag}-first-rows", SFM, f"{scenario}: S1 6 > S2 4, the first rows see no token (zero)",
                        scenario=scenario, s1=6, s2=4, batch=1, lse=True))
    for kind in ("-inf", "zero", "huge"):
        out.append(_v4_case(f"v4-{tag}-sinks-{kind}", SFM, f"{scenario} decode with every sink {kind}",
                            scenario=scenario, s1=1, sinks_kind=kind, lse=True))
    return out


for _sc in ("SWA", "CSA", "HCA"):
    register_set(f"v4-{_sc.lower()}", f"sparse_flash_mla {_sc} (DeepSeek-V4): decode and prefill, BSND / TND / "
                 "PA_BBND (blocks 16 / 128 / 1024), bf16 / fp16, 64 heads, first rows, sinks -inf / 0 / huge",
                 (lambda sc: lambda: _v4_cases(sc))(_sc))


def v4_mixed_quant_cases() -> list[Case]:
    out = []
    for mode, lk in ((1, "BSND"), (1, "PA_BBND"), (2, "PA_BBND")):
        for scenario in ("SWA", "CSA", "HCA"):
            for s1, phase in ((1, "decode"), (5, "prefill")):
                out.append(_v4_case(f"v4-mq{mode}-{scenario.lower()}-{phase}-{lk}", MQ,
                                    f"mixed_quant_sparse_flash_mla quant_mode {mode} "
                                    f"({'608-byte rows, bf16 scales' if mode == 1 else 'MODEL1 blocks, E8M0 scales'}), "
                                    f"{scenario} {phase}, KV {lk}", scenario=scenario, layout_kv=lk, s1=s1,
                                    quant_mode=mode))
    return out


register_set("v4-mixed-quant", "mixed_quant_sparse_flash_mla (Ascend 950): quant_mode 1 (608-byte rows) and 2 "
             "(MODEL1 blocks), SWA / CSA / HCA, decode and prefill", v4_mixed_quant_cases)


def v4_kv_quant_sharedkv_cases() -> list[Case]:
    out = []
    for scenario in ("SWA", "CSA", "HCA"):
        for s1, phase in ((1, "decode"), (5, "prefill")):
            for lq, bs in (("BSND", 16), ("TND", 128)):
                out.append(_v4_case(f"v4-kvq-{scenario.lower()}-{phase}-{lq}-bs{bs}", KQS,
                                    f"kv_quant_sparse_attn_sharedkv (640-byte rows, E8M0 scales), {scenario} {phase}, "
                                    f"q {lq}, PA_ND blocks of {bs}", scenario=scenario, layout_q=lq, layout_kv="PA_ND",
                                    s1=s1, block_size=bs))
    return out


register_set("v4-kv-quant-sharedkv", "kv_quant_sparse_attn_sharedkv (vLLM-Ascend, Ascend 950): 640-byte FP8 rows, "
             "SWA / CSA / HCA, decode and prefill, BSND / TND queries, PA_ND blocks 16 / 128",
             v4_kv_quant_sharedkv_cases)


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4 layer chains (qsfa.chain_v4; docs/golden.md#deepseek-v4-layer-chains): one case per link

_V4_PATHS = (("a3-bf16", {"chip": "A3", "path": "bf16"}), ("950-fp8", {"chip": "950", "path": "fp8"}))
#: kind -> step -> request shape (small: every set generates in seconds; HCA needs 128 tokens per compressed one)
_V4_SHAPES = {
    "swa": {"decode": {"q_lens": [1, 1, 1], "kv_lens": [37, 20, 200]},
            "prefill": {"q_lens": [4, 3], "kv_lens": [4, 140]}},
    "csa": {"decode": {"q_lens": [1, 1, 1], "kv_lens": [37, 20, 64]},
            "prefill": {"q_lens": [5, 3], "kv_lens": [5, 23]}},
    "hca": {"decode": {"q_lens": [1, 1, 1], "kv_lens": [256, 140, 37]},
            "prefill": {"q_lens": [2, 3], "kv_lens": [129, 140]}},
}


def _v4_layer_cases(kind: str, step: str) -> list[Case]:
    from .chain import chain_cases

    set_name = f"v4-layer-{kind}-{step}"
    out = []
    ring = (("950-fp8-ring", {"chip": "950", "path": "fp8", "cache_mode": 2}),) if kind != "swa" else ()
    for tag, path in _V4_PATHS + ring:  # the compressors' ring-buffer state (cache_mode 2) is the 950's
        inst = f"{step}-{tag}"
        params = {**_V4_SHAPES[kind][step], **path, "block_size": 16}
        out += chain_cases(f"v4-{kind}", inst, params, seed=seed_of(f"{set_name}.{inst}"),
                           description=f"v4-{kind} {step}, {path['chip']} {path['path']} caches"
                           + (", ring-buffer compressor state" if path.get("cache_mode") == 2 else ""))
    return out


for _kind, _what in (("swa", "sliding window only"), ("csa", "cmp_ratio 4 with the indexer's top-k"),
                     ("hca", "cmp_ratio 128, every compressed token")):
    for _step, _how in (("decode", "1 new token per request, uneven histories"),
                        ("prefill", "a fresh request and a chunk over a cached prefix")):
        register_set(f"v4-layer-{_kind}-{_step}",
                     f"DeepSeek-V4 {_kind.upper()} attention layer chain v4-{_kind} ({_what}), {_step} ({_how}): every "
                     "intermediate per link; A3 bf16 and 950 FP8 caches",
                     (lambda k, s: lambda: _v4_layer_cases(k, s))(_kind, _step))


# DeepSeek-V4 compressor (docs/numerics/compressor.md)


def compressor_cases() -> list[Case]:
    c4li, c4a, c128 = (dict(cmp_ratio=4, coff=2, head_dim=128), dict(cmp_ratio=4, coff=2, head_dim=512),
                       dict(cmp_ratio=128, coff=1, head_dim=512))
    return [
        _case("cmp-c4li-prefill-uneven", "compressor", "compressor", "C4Li batched prefill, TH cu_seqlens [0, 12, 23] "
              "from position 0 (vLLM-Ascend #9496), Ascend 950", lens=[12, 11], starts=[0, 0], chip="950", **c4li),
        _case("cmp-c4li-decode-a3", "compressor", "compressor", "C4Li decode on Atlas A3: one token per batch, "
              "completing a group (start 3), mid-group (start 5) and the first token", lens=[1, 1, 1],
              starts=[3, 5, 0], chip="A3", **c4li),
        _case("cmp-c4a-bsh-seqused", "compressor", "compressor", "C4A, BSH x (S 8) with seqused [8, 5], starts 2 "
              "and 0, float16, Atlas A3 (tree sums)", lens=[8, 8], starts=[2, 0], layout="BSH", used=[8, 5],
              x_dtype="float16", chip="A3", **c4a),
        _case("cmp-c4a-ring-950", "compressor", "compressor", "C4A, ring-buffer state (cache_mode 2), a residual of "
              "3 tokens, Ascend 950", lens=[7, 3], starts=[0, 6], cache_mode=2, chip="950", **c4a),
        _case("cmp-c128a-decode-950", "compressor", "compressor", "C128A: two tokens complete group 0 whose 126 "
              "other tokens are in the state, Ascend 950 (sequential sums)", lens=[2], starts=[126],
              block_size=64, chip="950", **c128),
        _case("cmp-c128a-decode-a3", "compressor", "compressor", "the same C128A step on Atlas A3 (tree sums)",
              lens=[2], starts=[126], block_size=64, chip="A3", seed_name="cmp-c128a-decode-950", **c128),
    ]


register_set("compressor", "cann_ops_transformer compressor (DeepSeek-V4 C4A / C4Li / C128A, Atlas A3 and Ascend "
             "950): batched prefill, decode with the state, BSH with seqused, the ring buffer, both sum orders",
             compressor_cases)


def quant_compressor_cases() -> list[Case]:
    q = "quant_compressor"
    c4li, c128 = dict(cmp_ratio=4, coff=2, head_dim=128), dict(cmp_ratio=128, coff=1, head_dim=512)
    return [
        _case("qcmp-c4li-prefill-uneven", q, q, "HiFloat8 C4Li batched prefill, TH cu_seqlens [0, 12, 23], Ascend 950",
              lens=[12, 11], starts=[0, 0], chip="950", **c4li),
        _case("qcmp-c4li-decode-ring", q, q, "HiFloat8 C4Li decode with a ring-buffer state, x_descale 1", lens=[1, 1],
              starts=[3, 6], cache_mode=2, x_descale_value=1.0, chip="950", **c4li),
        _case("qcmp-c128a-decode", q, q, "HiFloat8 C128A: two tokens complete group 0 (126 in the state), Atlas A3",
              lens=[2], starts=[126], block_size=64, chip="A3", **c128),
    ]


register_set("quant-compressor", "ops-transformer's experimental QuantCompressor (HiFloat8 x / weights, fp32 descales, "
             "bf16 rows): batched prefill, decode with a ring buffer, C128A", quant_compressor_cases)


def vllm_compressor_cases() -> list[Case]:
    v = "vllm_compressor"
    c4li, c4a, c128 = (dict(cmp_ratio=4, coff=2, head_dim=128), dict(cmp_ratio=4, coff=2, head_dim=512),
                       dict(cmp_ratio=128, coff=1, head_dim=512))
    attrs = dict(rope_head_dim=64, norm_eps=1e-6)
    return [
        _case("vcmp-c4a-prefill-uneven-a3", v, v, "C4A batched prefill, TH cu_seqlens [0, 12, 23] from position 0 "
              "(vLLM-Ascend #9496), interleave RoPE (what vLLM-Ascend passes), bf16 norm_weight, Atlas A3",
              lens=[12, 11], starts=[0, 0], rotary_mode=2, cache_mode=1, chip="A3", **c4a, **attrs),
        _case("vcmp-c4li-decode-950", v, v, "C4Li decode, one token per request completing a group (start 3), "
              "mid-group (5) and the first token; fp32 norm_weight and tables, Ascend 950", lens=[1, 1, 1],
              starts=[3, 5, 0], rotary_mode=2, cache_mode=1, chip="950", **c4li, **attrs),
        _case("vcmp-c128a-decode-a3", v, v, "C128A: two tokens complete group 0 (126 in the state); bf16 tables, "
              "Atlas A3 (tree sums, tree norm blocks)", lens=[2], starts=[126], block_size=64, rotary_mode=2,
              cache_mode=1, rope_dtype="x", chip="A3", **c128, **attrs),
        _case("vcmp-c4a-bsh-half-950", v, v, "C4A, BSH x (S 8) with seqused [8, 5], float16, half RoPE "
              "(rotary_mode 1), Ascend 950 (sequential sums and norm blocks)", lens=[8, 8], starts=[2, 0],
              layout="BSH", used=[8, 5], x_dtype="float16", rotary_mode=1, cache_mode=1, chip="950", **c4a, **attrs),
        _case("vcmp-c4li-ring-950", v, v, "C4Li with a ring-buffer state (cache_mode 2), a residual of 3 tokens, half "
              "RoPE, Ascend 950", lens=[7, 3], starts=[0, 6], rotary_mode=1, cache_mode=2, chip="950", **c4li,
              **attrs),
    ]


register_set("vllm-compressor", "vLLM-Ascend torch.ops._C_ascend.compressor (the compressor, then RMSNorm and RoPE "
             "of each row, one RINT cast; Atlas A2/A3 and Ascend 950): batched prefill, decode, C128A, BSH with "
             "seqused, the ring buffer, both rotary modes", vllm_compressor_cases)


def v4_quant_cases() -> list[Case]:
    out = []
    for scenario in ("SWA", "CSA", "HCA"):
        for s1, phase in ((1, "decode"), (5, "prefill")):
            for lq, lk, bs in (("BSND", "BSND", 16), ("TND", "TND", 16), ("BSND", "PA_BBND", 16),
                               ("TND", "PA_BBND", 128)):
                out.append(_v4_case(f"v4-quant-{scenario.lower()}-{phase}-{lq}-{lk}"
                                    f"{'' if lk != 'PA_BBND' else f'-bs{bs}'}", QSM,
                                    f"quant_sparse_flash_mla (HiFloat8 Q/K/V, descales 0.75 / 1.25 / 0.5), {scenario} "
                                    f"{phase}, q {lq} / KV {lk}{f' block {bs}' if lk == 'PA_BBND' else ''}, 64 heads, "
                                    "300 original tokens (three 128-token S2 tiles)", scenario=scenario,
                                    layout_q=lq, layout_kv=lk, s1=s1, block_size=bs, lse=lq == "TND"))
    return out


register_set("v4-quant", "quant_sparse_flash_mla (Ascend 950): HiFloat8 Q / K / V with per-tensor descales, "
             "SWA / CSA / HCA, decode and prefill, BSND / TND / PA_BBND", v4_quant_cases)
