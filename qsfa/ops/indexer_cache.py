"""Front doors of the DeepSeek-V4 indexer cache writers (Ascend 950; listed in :mod:`qsfa.ops.cache`).

* :func:`indexer_quant_cache` - ``torch.ops.cann_ops_transformer.indexer_quant_cache`` (ops-transformer
  ``attention/indexer_quant_cache/``): MX-FP8, FP8 with an fp32 scale per token, HiFloat8, MX-FP4.
* :func:`indexer_compress_epilog_v2` - vLLM-Ascend's ``torch.ops._C_ascend.indexer_compress_epilog_v2``: FP8 E4M3FN
  with fp32 scales per 128 values, codes and scales in one uint8 block cache.

References: :mod:`qsfa.reference.indexer_cache`; numerics in ``docs/numerics/cache-writers.md#indexer_quant_cache``
and ``#indexer_compress_epilog_v2``. Every cache is listed in its contract's ``inplace``; a rejected call writes
nothing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import all_finite, dtype_in, edit_params, is_bool, is_int, is_num, rule, set_param
from .._contract import Contract, copy_args, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import indexer_cache as _ic
from ._cache_rules import _slot_rules

__all__ = [
    "indexer_quant_cache",
    "indexer_compress_epilog_v2",
    "IQC",
    "IQC_CONTRACT",
    "ICE2",
    "ICE2_CONTRACT",
]

BF16 = ml_dtypes.bfloat16
X_DTYPES = ("float16", "bfloat16")

IQC = "indexer_quant_cache"
IQC_SRC = ("cannmirror/ops-transformer@7904813 attention/indexer_quant_cache/ (op_host/indexer_quant_cache_tiling_arch35"
           ".cpp, op_kernel/arch35/, docs/aclnnIndexerQuantCache.md); docs/numerics/cache-writers.md#indexer_quant_cache")
ICE2 = "indexer_compress_epilog_v2"
ICE2_SRC = ("vllm-project/vllm-ascend@182b75e csrc/attention/indexer_compress_epilog_v2/ (op_host/"
            "indexer_compress_epilog_v2_tiling.cpp, _def.cpp), csrc/torch_binding.cpp; "
            "docs/numerics/cache-writers.md#indexer_compress_epilog_v2")

#: cache / cache_scale dtypes per quant_mode (HiFloat8 codes, E8M0 bytes and packed E2M1 pairs are carried as uint8)
IQC_CACHE_DTYPES = {"mxfp8": ("float8_e4m3fn", "float8_e5m2"), "fp8": ("float8_e4m3fn", "float8_e5m2"),
                    "hifloat8": ("uint8",), "mxfp4": ("uint8",)}
IQC_SCALE_DTYPES = {"mxfp8": ("uint8",), "fp8": ("float32",), "hifloat8": ("float32",), "mxfp4": ("uint8",)}
MAX_D = 8192


# ------------------------------------------------------------------------------------------- shared helpers


def _mode(a):
    return a.quant_mode.lower()


def _block_dense(p):
    """Dimensions 1..3 of a 4-D cache must be dense (only the block dimension may be strided)."""

    def check(a):
        c = a[p]
        it = c.itemsize
        ok = c.strides[3] == it or c.shape[3] <= 1
        ok = ok and (c.shape[2] <= 1 or c.strides[2] == c.shape[3] * it)
        ok = ok and (c.shape[1] <= 1 or c.strides[1] == c.shape[2] * c.shape[3] * it)
        return None if ok else Raw(f"strides {c.strides}")

    def violate(args):
        out = copy_args(args)
        c = out[p]
        wide = np.zeros(c.shape[:3] + (2 * c.shape[3],), c.dtype)
        out[p] = wide[..., ::2]
        return out

    return check, violate


def _four_d(op, p, src):
    return rule(op, f"{p}_shape", p, "shape", "must be 4-D [num_blocks, block_size, 1, head_dim]",
                lambda a: None if a[p].ndim == 4 and a[p].shape[2] == 1 else tuple(a[p].shape),
                edit_params(lambda o: o.update({p: o[p][:, :, None]})), source=src)


def _x_rules(op, src):
    return [
        rule(op, "x_ndim", "x", "dim", "must have at least 2 dimensions [..., d]",
             lambda a: None if a.x.ndim >= 2 else a.x.ndim, edit_params(lambda o: o.update(x=o["x"][0])), source=src),
        rule(op, "x_tokens", "x", "shape", "needs at least one token (the kernel rejects an empty x)",
             lambda a: None if a.x.size else tuple(a.x.shape),
             edit_params(lambda o: o.update(x=o["x"][:0], slot_mapping=o["slot_mapping"][:0])), source=src),
    ]


def _slot_shape(op, src):
    return rule(op, "slot_mapping_shape", "slot_mapping", "shape", "must be x.shape[:-1] (one slot per token)",
                lambda a: None if tuple(a.slot_mapping.shape) == tuple(a.x.shape[:-1]) else tuple(a.slot_mapping.shape),
                edit_params(lambda o: o.update(slot_mapping=o["slot_mapping"][:-1])), source=src)


def _only_950(op, param, src):
    return rule(op, "a2a3_unsupported", param, "value", f"{op} runs on Ascend 950 only (op_def: ascend950)",
                lambda a: "Atlas A2/A3", lambda args: copy_args(args), chips=("A2", "A3"), source=src)


# ------------------------------------------------------------------------------------------ indexer_quant_cache


def _iqc_example(rng):
    x = (rng.standard_normal((5, 64)) * 3).astype(BF16)
    cache = np.full((3, 4, 1, 32), 0x5A, np.uint8)
    scale = np.full((3, 4, 1, 2), 0x7F, np.uint8)
    # x first: the generic aliasing rule of an in-place buffer aliases it with the first other array
    return dict(x=x, cache=cache, cache_scale=scale, slot_mapping=np.array([0, 7, -1, 11, 2], np.int32),
                quant_mode="mxfp4", round_scale=True, x_scale=1.0)


def _iqc_d(a):
    d = a.x.shape[-1]
    return None if 0 < d <= MAX_D and d % _ic.MX_BLOCK == 0 else d


def _iqc_cache_width(a):
    need = _ic.cache_width(a.x.shape[-1], _mode(a))
    w = a.cache.shape[3]
    return None if w >= need else Raw(f"head_dim {w} < {need} bytes per token")


def _iqc_scale_width(a):
    need = _ic.scale_cols(a.x.shape[-1], _mode(a))
    w = a.cache_scale.shape[3]
    return None if w >= need else Raw(f"head_dim {w} < {need} scales per token")


def _iqc_dtype(p, table):
    def check(a):
        allowed = table[_mode(a)]
        return None if dtype_name(a[p]) in allowed else Raw(f"{dtype_name(a[p])} with quant_mode {a.quant_mode!r}")

    def violate(args):
        out = copy_args(args)
        out[p] = np.zeros(out[p].shape, np.int16)
        return out

    return rule(IQC, f"{p}_dtype_for_mode", p, "dtype",
                "must match quant_mode: cache float8_e4m3fn / float8_e5m2 for 'mxfp8' and 'fp8', uint8 for 'hifloat8' "
                "(HiFloat8 codes) and 'mxfp4' (packed E2M1 pairs); cache_scale uint8 E8M0 bytes for 'mxfp8' / 'mxfp4', "
                "float32 for 'fp8' / 'hifloat8'", check, violate, dtype=True, source=IQC_SRC)


_iqc_dense_c = _block_dense("cache")
_iqc_dense_s = _block_dense("cache_scale")

IQC_CONTRACT = Contract(
    op=IQC,
    constraints=[
        dtype_in(IQC, "x", X_DTYPES, source=IQC_SRC),
        dtype_in(IQC, "slot_mapping", ("int32",), source=IQC_SRC),
        rule(IQC, "quant_mode_value", "quant_mode", "value",
             "must be 'mxfp8', 'fp8', 'hifloat8' or 'mxfp4' (any case)",
             lambda a: None if a.quant_mode.lower() in _ic.QUANT_MODES else a.quant_mode,
             set_param("quant_mode", "int8"), source=IQC_SRC),
        rule(IQC, "round_scale_type", "round_scale", "type", "must be a bool",
             lambda a: None if is_bool(a.round_scale) else a.round_scale, set_param("round_scale", 1),
             dtype=True, source=IQC_SRC),
        rule(IQC, "x_scale_finite", "x_scale", "value", "must be a finite number",
             lambda a: None if is_num(a.x_scale) and np.isfinite(float(a.x_scale)) else a.x_scale,
             set_param("x_scale", float("inf")), source=IQC_SRC),
        _iqc_dtype("cache", IQC_CACHE_DTYPES),
        _iqc_dtype("cache_scale", IQC_SCALE_DTYPES),
        *_x_rules(IQC, IQC_SRC),
        rule(IQC, "x_last_dim", "x", "shape", f"d must be a multiple of 32 in [32, {MAX_D}] (MX blocks of 32)",
             _iqc_d, edit_params(lambda o: o.update(x=o["x"][..., :48])), source=IQC_SRC),
        _slot_shape(IQC, IQC_SRC),
        _four_d(IQC, "cache", IQC_SRC),
        _four_d(IQC, "cache_scale", IQC_SRC),
        rule(IQC, "cache_scale_blocks", "cache_scale", "shape",
             "must have cache's num_blocks and block_size (one scale row per cache slot)",
             lambda a: None if a.cache_scale.shape[:2] == a.cache.shape[:2] else tuple(a.cache_scale.shape),
             edit_params(lambda o: o.update(cache_scale=o["cache_scale"][:, :-1])), source=IQC_SRC),
        rule(IQC, "cache_strides", "cache", "layout", "only the block dimension may be strided (blocks are dense)",
             _iqc_dense_c[0], _iqc_dense_c[1], source=IQC_SRC),
        rule(IQC, "cache_scale_strides", "cache_scale", "layout",
             "only the block dimension may be strided (blocks are dense)", _iqc_dense_s[0], _iqc_dense_s[1],
             source=IQC_SRC),
        rule(IQC, "cache_width", "cache", "shape",
             "head_dim must hold a token: d values (ceil(d / 2) packed bytes for 'mxfp4')", _iqc_cache_width,
             edit_params(lambda o: o.update(cache=np.ascontiguousarray(o["cache"][..., :1]))), source=IQC_SRC),
        rule(IQC, "cache_scale_width", "cache_scale", "shape",
             "head_dim must hold a token's scales: ceil(d / 32) for 'mxfp8' / 'mxfp4', 1 otherwise", _iqc_scale_width,
             edit_params(lambda o: o.update(cache_scale=np.ascontiguousarray(o["cache_scale"][..., :1]))), source=IQC_SRC),
        all_finite(IQC, "x", source=IQC_SRC),
        *_slot_rules(IQC, "slot_mapping", lambda a: a["cache"].shape[0] * a["cache"].shape[1], source=IQC_SRC),
        _only_950(IQC, "cache", IQC_SRC),
    ],
    example=_iqc_example,
    inplace=("cache", "cache_scale"),
    params=params("cache:array cache_scale:array x:array slot_mapping:array quant_mode:str round_scale:bool"
                  " x_scale:float32"),
)


def _iqc_reference(cache, cache_scale, x, slot_mapping, quant_mode, round_scale, x_scale):
    return _ic.indexer_quant_cache(cache, cache_scale, x, slot_mapping, quant_mode=quant_mode,
                                   round_scale=bool(round_scale), x_scale=float(x_scale))


define_operator(IQC, IQC_CONTRACT, outputs=("cache", "cache_scale"), reference=_iqc_reference,
                doc="Indexer K cache writer (Ascend 950): MX-FP8 / FP8 / HiFloat8 / MX-FP4 quantisation, scattered by slot.")


def indexer_quant_cache(cache, cache_scale, x, slot_mapping, *, quant_mode="fp8", round_scale=True, x_scale=1.0,
                        chip=None, backend="reference"):
    """``cann_ops_transformer.indexer_quant_cache`` (Ascend 950): quantise float16 / bf16 ``x [..., d]`` (d a multiple
    of 32, at most 8192) and write each token by slot (-1 skips) into ``cache`` and ``cache_scale``, in place.

    quant_mode:  "mxfp8" - FP8 codes, one E8M0 scale per 32 values (always a power-of-two ceiling);
                 "fp8" - FP8 codes, one fp32 scale per token (``amax * fp32(1 / FMAX)``; with round_scale ceiled to
                 a power of two); "hifloat8" - HiFloat8 codes of ``x * x_scale``, no scale written;
                 "mxfp4" - E2M1 codes packed two per byte, one E8M0 scale per 32 values. Any case.
    cache:       ``[num_blocks, block_size, 1, head_dim]``; float8_e4m3fn / float8_e5m2 (FP8 modes), uint8 (HiFloat8
                 codes, packed E2M1); head_dim >= d (ceil(d / 2) for "mxfp4"). Only dimension 0 may be strided.
    cache_scale: ``[num_blocks, block_size, 1, head_dim]``; uint8 E8M0 bytes (MX modes) or float32.
    slot_mapping: int32 ``x.shape[:-1]``; -1 skips a token, others unique and below num_blocks * block_size.
    round_scale: read by "fp8" only (the kernel's MX-FP8 path always rounds).
    x_scale:     read by "hifloat8" only.
    Returns ``(cache, cache_scale)``. Numerics: docs/numerics/cache-writers.md#indexer_quant_cache.
    """
    args = dict(cache=cache, cache_scale=cache_scale, x=x, slot_mapping=slot_mapping, quant_mode=quant_mode,
                round_scale=round_scale, x_scale=x_scale)
    return run(IQC, args, backend, chip=chip)


# ---------------------------------------------------------------------------------- indexer_compress_epilog_v2


def _ice2_example(rng):
    x = (rng.standard_normal((4, 160)) * 2).astype(BF16)
    x[1, 128:] = 0  # an all-zero partial group
    cache = np.full((3, 2, 1, 168), 0x33, np.uint8)
    return dict(indexer_compress_cache=cache, x=x, slot_mapping=np.array([3, -1, 0, 5], np.int32), layout=2)


def _ice2_width(a):
    d = a.x.shape[-1]
    need = d + 4 * -(-d // _ic.EPILOG_V2_GROUP)
    w = a.indexer_compress_cache.shape[3]
    return None if w >= need else Raw(f"head_dim {w} < {need} (d codes + 4 bytes per fp32 scale)")


_ice2_dense = _block_dense("indexer_compress_cache")

ICE2_CONTRACT = Contract(
    op=ICE2,
    constraints=[
        dtype_in(ICE2, "indexer_compress_cache", ("uint8",), source=ICE2_SRC),
        dtype_in(ICE2, "x", X_DTYPES, source=ICE2_SRC),
        dtype_in(ICE2, "slot_mapping", ("int32",), source=ICE2_SRC),
        rule(ICE2, "layout_value", "layout", "value", "must be 2 (the only layout the kernel implements)",
             lambda a: None if is_int(a.layout) and a.layout == 2 else a.layout, set_param("layout", 1),
             source=ICE2_SRC),
        *_x_rules(ICE2, ICE2_SRC),
        _slot_shape(ICE2, ICE2_SRC),
        _four_d(ICE2, "indexer_compress_cache", ICE2_SRC),
        rule(ICE2, "cache_strides", "indexer_compress_cache", "layout",
             "only the block dimension may be strided (block_stride = stride(0); blocks are dense)",
             _ice2_dense[0], _ice2_dense[1], source=ICE2_SRC),
        rule(ICE2, "cache_width", "indexer_compress_cache", "shape",
             "head_dim must be at least d + 4 * ceil(d / 128) (a block holds block_size rows of codes, then their "
             "fp32 scales)", _ice2_width,
             edit_params(lambda o: o.update(
                 indexer_compress_cache=np.ascontiguousarray(o["indexer_compress_cache"][..., :160]))),
             source=ICE2_SRC),
        all_finite(ICE2, "x", source=ICE2_SRC),
        *_slot_rules(ICE2, "slot_mapping",
                     lambda a: a["indexer_compress_cache"].shape[0] * a["indexer_compress_cache"].shape[1],
                     source=ICE2_SRC),
        _only_950(ICE2, "indexer_compress_cache", ICE2_SRC),
    ],
    example=_ice2_example,
    inplace=("indexer_compress_cache",),
    params=params("indexer_compress_cache:array x:array slot_mapping:array layout:int"),
)


def _ice2_reference(indexer_compress_cache, x, slot_mapping, layout):
    return _ic.indexer_compress_epilog_v2(indexer_compress_cache, x, slot_mapping, layout=int(layout))


define_operator(ICE2, ICE2_CONTRACT, outputs=("indexer_compress_cache",), reference=_ice2_reference,
                doc="vLLM-Ascend indexer_compress_epilog_v2: FP8 E4M3FN with fp32 scales per 128, one uint8 block cache.")


def indexer_compress_epilog_v2(indexer_compress_cache, x, slot_mapping, *, layout=2, chip=None, backend="reference"):
    """vLLM-Ascend's ``torch.ops._C_ascend.indexer_compress_epilog_v2`` (Ascend 950): quantise float16 / bf16
    ``x [..., d]`` to FP8 E4M3FN with one fp32 scale ``amax * fp32(1/448)`` per 128 values (codes ``x / s``, an fp32
    divide) and write each token by slot (-1 skips) into the uint8 cache, in place.

    indexer_compress_cache: uint8 ``[num_blocks, block_size, 1, head_dim]``, head_dim >= d + 4 * ceil(d / 128);
                 block b holds the codes of its block_size slots (slot position p at ``p * d``), then their
                 little-endian fp32 scales (at ``block_size * d + p * 4 * ceil(d / 128)``). Only dimension 0 may be
                 strided (vLLM-Ascend passes ``stride(0)`` as block_stride).
    slot_mapping: int32 ``x.shape[:-1]``; -1 skips a token, others unique and below num_blocks * block_size.
    layout:      2 (the only one).
    Returns ``indexer_compress_cache``. Numerics: docs/numerics/cache-writers.md#indexer_compress_epilog_v2.
    """
    args = dict(indexer_compress_cache=indexer_compress_cache, x=x, slot_mapping=slot_mapping, layout=layout)
    return run(ICE2, args, backend, chip=chip)
