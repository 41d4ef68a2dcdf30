"""Front door of ``kv_compress_epilog``: quantise compressed KV rows into a paged cache
(docs/numerics/cache-writers.md#kv_compress_epilog).

Contract, example and front door; the computation is :mod:`qsfa.reference.kv_compress_epilog`, the tests
tests/test_kv_compress_epilog.py. The vLLM-Ascend variant is :mod:`qsfa.ops.kv_compress_epilog_vllm`.
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import all_finite, dtype_in, is_array, ndim_in, set_param
from .._contract import Contract, copy_args, params
from .._dispatch import define_operator, run
from ..reference import kv_compress_epilog as _kce
from ._cache_rules import _edit, _is_bool, _is_int, _is_num, _rule, _slot_rules, _with, BF16, SLOT_DTYPES

__all__ = [
    "kv_compress_epilog",
]


# --------------------------------------------------------------------------------- kv_compress_epilog

KCE = "kv_compress_epilog"
KCE_SRC = "docs/numerics/cache-writers.md#kv_compress_epilog; seed 002 (KvCompressEpilog)"


def _kce_d(a):
    return a.x.shape[-1]


def _kce_col(a):
    return _kce.kv_cache_col(_kce_d(a), a.quant_mode, a.quant_group_size, a.pad_to)


def _kce_example(rng):
    x = (rng.standard_normal((5, 576)) * 2).astype(BF16)
    cache = np.full((3, 4, 1, 672), 17, np.uint8)
    return dict(cache=cache, x=x, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64), quant_group_size=64,
                quant_mode=1, round_scale=True, x_scale=1.0, pad_to=32, fp4_nibble_order="low_first")


def _kce_cache_strides(a):
    c = a.cache
    item = c.dtype.itemsize
    ok = c.strides[3] == item and (c.shape[1] <= 1 or c.strides[1] == c.shape[3] * item * c.shape[2])
    return None if ok else f"strides {c.strides}"


def _kce_d_rule(a):
    d = _kce_d(a)
    return None if d % 64 == 0 and 64 < d <= 8192 else d


def _kce_gs(a):
    if a.quant_mode != 2:
        return None
    return None if a.quant_group_size in (16, 32, 64) else a.quant_group_size


KCE_CONTRACT = Contract(
    op=KCE,
    constraints=[
        is_array(KCE, "cache", source=KCE_SRC),
        is_array(KCE, "x", source=KCE_SRC),
        is_array(KCE, "slot_mapping", source=KCE_SRC),
        dtype_in(KCE, "cache", ("uint8",), source=KCE_SRC),
        ndim_in(KCE, "cache", (4,), source=KCE_SRC),
        _rule(KCE, "cache_heads", "cache", "shape", "must be [blockNum, blockSize, 1, headDim]",
              lambda a: None if a.cache.shape[2] == 1 else tuple(a.cache.shape),
              _edit(lambda o: o.update(cache=np.zeros((3, 4, 2, 672), np.uint8))), source=KCE_SRC),
        _rule(KCE, "cache_strides", "cache", "layout",
              "only the blockNum dimension may be non-contiguous (rows must be dense)", _kce_cache_strides,
              _edit(lambda o: o.update(cache=np.zeros((3, 4, 1, 1344), np.uint8)[..., ::2])), source=KCE_SRC),
        dtype_in(KCE, "x", ("bfloat16",), source=KCE_SRC),
        _rule(KCE, "x_ndim", "x", "dim", "must have at least 2 dimensions [..., d]",
              lambda a: None if a.x.ndim >= 2 else a.x.ndim,
              _edit(lambda o: o.update(x=o["x"][0], slot_mapping=np.array(0, np.int64))), source=KCE_SRC),
        _rule(KCE, "x_last_dim", "x", "shape", "d must satisfy d % 64 == 0 and 64 < d <= 8192", _kce_d_rule,
              _edit(lambda o: o.update(x=o["x"][:, :560])), source=KCE_SRC),
        dtype_in(KCE, "slot_mapping", SLOT_DTYPES, source=KCE_SRC),
        _rule(KCE, "slot_mapping_shape", "slot_mapping", "shape", "must be x.shape[:-1]",
              lambda a: None if tuple(a.slot_mapping.shape) == tuple(a.x.shape[:-1]) else tuple(a.slot_mapping.shape),
              _edit(lambda o: o.update(slot_mapping=o["slot_mapping"][:-1])), source=KCE_SRC),
        _rule(KCE, "quant_mode_value", "quant_mode", "value", "must be one of {0, 1, 2}",
              lambda a: None if _is_int(a.quant_mode) and a.quant_mode in (0, 1, 2) else a.quant_mode,
              set_param("quant_mode", 3), source=KCE_SRC),
        _rule(KCE, "quant_group_size_value", "quant_group_size", "value",
              "quant_mode 2 supports quant_group_size 16, 32 or 64", _kce_gs,
              _with(quant_mode=2, quant_group_size=128), source=KCE_SRC),
        _rule(KCE, "round_scale_type", "round_scale", "type", "must be a bool",
              lambda a: None if _is_bool(a.round_scale) else a.round_scale, set_param("round_scale", 1),
              source=KCE_SRC),
        _rule(KCE, "x_scale_value", "x_scale", "value", "must be a finite number",
              lambda a: None if _is_num(a.x_scale) and math.isfinite(a.x_scale) else a.x_scale,
              set_param("x_scale", float("inf")), source=KCE_SRC),
        _rule(KCE, "pad_to_value", "pad_to", "value", "must be one of {32, 128} (docs/numerics/open-facts.md#pad_to OPEN)",
              lambda a: None if _is_int(a.pad_to) and a.pad_to in (32, 128) else a.pad_to, set_param("pad_to", 64),
              source="docs/numerics/open-facts.md#pad_to (OPEN: padding granularity)"),
        _rule(KCE, "fp4_nibble_order_value", "fp4_nibble_order", "value",
              "must be one of {'low_first', 'high_first'} (docs/numerics/open-facts.md#nibble_order OPEN)",
              lambda a: None if a.fp4_nibble_order in ("low_first", "high_first") else a.fp4_nibble_order,
              set_param("fp4_nibble_order", "bogus"), source="docs/numerics/open-facts.md#nibble_order (OPEN: FP4 nibble order)"),
        _rule(KCE, "head_dim", "cache", "shape", "headDim (cache.shape[3]) must be >= kvCacheCol, the bytes per row",
              lambda a: None if a.cache.shape[3] >= _kce_col(a) else f"headDim {a.cache.shape[3]} < kvCacheCol "
              f"{_kce_col(a)}", _edit(lambda o: o.update(cache=np.zeros((3, 4, 1, 512), np.uint8))),
              source=KCE_SRC),
        all_finite(KCE, "x", source=KCE_SRC),
        *_slot_rules(KCE, "slot_mapping", lambda a: a["cache"].shape[0] * a["cache"].shape[1], source=KCE_SRC),
        _rule(KCE, "a2a3_unsupported", "cache", "value", "KvCompressEpilog runs on Ascend 950 only",
              lambda a: "Atlas A2/A3", lambda args: copy_args(args), chips=("A2", "A3"), source=KCE_SRC),
    ],
    example=_kce_example,
    inplace=("cache",),
    params=params("cache:array x:array slot_mapping:array quant_group_size:int quant_mode:int round_scale:bool"
                  " x_scale:float32 pad_to:int fp4_nibble_order:str"),
)


def _kce_reference(cache, x, slot_mapping, quant_group_size, quant_mode, round_scale, x_scale, pad_to,
                   fp4_nibble_order):
    return _kce.kv_compress_epilog(cache, x, slot_mapping, quant_group_size=quant_group_size, quant_mode=quant_mode,
                                   round_scale=round_scale, x_scale=x_scale, pad_to=pad_to,
                                   fp4_nibble_order=fp4_nibble_order)


define_operator(KCE, KCE_CONTRACT, outputs=("cache",), reference=_kce_reference,
                doc="KvCompressEpilog: group-quantise bf16 rows (FP8 / HiF8 + FP4) and scatter them by slot.")


def kv_compress_epilog(cache, x, slot_mapping, *, quant_group_size=64, quant_mode=1, round_scale=True, x_scale=1.0,
                       pad_to=32, fp4_nibble_order="low_first", chip=None, backend="reference"):
    """Quantise bf16 rows ``x [..., d]`` and scatter them into ``cache`` by slot (aclnn KvCompressEpilog).

    With n = d - 64 NoPE columns first and the last 64 columns the RoPE, each written row is
    (:func:`qsfa.reference.kv_compress_epilog.kv_cache_col` bytes; bytes from there to headDim untouched):

    * mode 0: [0,128) RoPE bf16 raw bits | n FP8 E4M3FN codes | n/64 bf16 scales | zero pad to ``pad_to``;
    * mode 1: [0,128) RoPE bf16 raw bits | n FP8 E4M3FN codes | n/64 E8M0 scale bytes (no pad);
    * mode 2: [0,64) RoPE HiFloat8 of ``x * x_scale`` | n/2 packed FP4 E2M1 bytes | n/gs bf16 scales | zero pad.

    Modes 0/1 use groups of 64 (quant_group_size ignored): ``s = max(amax, 1e-4) * fp32(1/448)``, ceiled to a
    power of two when ``round_scale``; ``q = E4M3FN(RINT, clamp(x / s, +-448))``; mode 0 stores
    ``BF16_RINT(s)``, mode 1 the floor-exponent byte of s (with round_scale=False the data used the unrounded
    s - the kernel's quirk, kept). Mode 2: stored ``BF16_RINT(amax * fp32(1/6))``; codes
    ``E2M1(RINT, clamp(bf16(x) * BF16_RINT(6/amax), +-6))`` with the product rounded to bf16.

    Parameters:
      cache:            uint8 ``[blockNum, blockSize, 1, headDim]``, in place; may be strided along blockNum
                        (the writes land in the caller's buffer).
      x:                bfloat16 ``[..., d]``, d % 64 == 0, 64 < d <= 8192.
      slot_mapping:     int32 / int64 of shape ``x.shape[:-1]``; -1 skips a token; others unique and in range.
      quant_group_size: 16, 32 or 64 (mode 2 only; (d - 64) % gs == 0 follows from d % 64 == 0).
      quant_mode:       0 (bf16 scales), 1 (E8M0 scales, default), 2 (HiF8 RoPE + FP4 NoPE).
      round_scale:      ceil the group scales to powers of two (modes 0/1).
      x_scale:          mode 2's static RoPE multiplier (fp32).
      pad_to:           **OPEN** (docs/numerics/open-facts.md#pad_to): row padding granularity of modes 0 and 2, default 32 (tiling
                        code and docs); 128 per an older comment. Not an aclnn argument.
      fp4_nibble_order: **OPEN** (docs/numerics/open-facts.md#nibble_order): "low_first" (default: element 2i in the low nibble) or
                        "high_first". Not an aclnn argument.
    Returns ``cache``.
    """
    args = dict(cache=cache, x=x, slot_mapping=slot_mapping, quant_group_size=quant_group_size, quant_mode=quant_mode,
                round_scale=round_scale, x_scale=x_scale, pad_to=pad_to, fp4_nibble_order=fp4_nibble_order)
    return run(KCE, args, backend, chip=chip)
