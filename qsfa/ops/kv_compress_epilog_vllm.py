"""Front door of ``kv_compress_epilog_vllm`` (the cache writers are listed in :mod:`qsfa.ops.cache`).

* :func:`kv_compress_epilog_vllm` - vLLM-Ascend's own KvCompressEpilog, ``torch.ops._C_ascend.kv_compress_epilog``
  (Ascend 950; MXFP8: FP8 codes with E8M0 scales of 64 / 128 values, rows padded to 128 bytes, or the
  FlashMLA-MODEL1-like block layout 2). Reference: :mod:`qsfa.reference.kv_compress_epilog_vllm`; numerics in
  ``docs/numerics/cache-writers.md#kv_compress_epilog_vllm``.

Every cache is listed in its contract's ``inplace``; a rejected call writes nothing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._checks import all_finite, dtype_in, edit_params, is_array, is_bool, is_int, rule, set_param
from .._contract import Contract, copy_args, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import kv_compress_epilog_vllm as _kv
from ._cache_rules import _slot_rules

__all__ = [
    "kv_compress_epilog_vllm",
    "KCEV",
    "KCEV_CONTRACT",
]


BF16 = ml_dtypes.bfloat16
SLOT_DTYPES = ("int32", "int64")

KCEV = "kv_compress_epilog_vllm"
KCEV_SRC = ("vllm-project/vllm-ascend@182b75e csrc/attention/kv_compress_epilog/, csrc/torch_binding.cpp "
            "kv_compress_epilog; docs/numerics/cache-writers.md#kv_compress_epilog_vllm")


def _d(a):
    return a.x.shape[-1]


def _kcev_example(rng):
    x = (rng.standard_normal((5, 512)) * 2).astype(BF16)
    cache = np.full((12, 1, 704), 17, np.uint8).view(ml_dtypes.float8_e4m3fn)
    return dict(kv_compress_cache=cache, x=x, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64),
                quant_group_size=64, quant_mode=2, round_scale_flag=True, layout=1)


def _cache_rank(a):
    c = a.kv_compress_cache
    if a.layout == 1:
        return None if c.ndim == 3 and c.shape[1] == 1 else f"{tuple(c.shape)} with layout 1"
    return None if c.ndim == 4 and c.shape[2] == 1 else f"{tuple(c.shape)} with layout 2"


def _cache_dense(a):
    c = a.kv_compress_cache
    if a.layout == 1:
        return None if c.strides[-1] == 1 else Raw(f"strides {c.strides}")
    want = (c.shape[2] * c.shape[3], c.shape[3], 1)
    ok = c.strides[3] == 1 and (c.shape[2] <= 1 or c.strides[2] == c.shape[3]) and \
        (c.shape[1] <= 1 or c.strides[1] == c.shape[2] * c.shape[3])
    return None if ok else Raw(f"strides {c.strides} (dimensions 1..3 must be dense: {want[:2]})")


def _cache_width(a):
    c, d, g = a.kv_compress_cache, _d(a), a.quant_group_size
    if a.layout == 1:
        col = _kv.kv_cache_col(d, g)
        return None if c.shape[-1] >= col else Raw(f"head_dim {c.shape[-1]} < row bytes {col}")
    need = _kv.value_per_token(d) + _kv.scale_per_token(d, g)
    return None if c.shape[-1] >= need else Raw(f"{c.shape[-1]} bytes per token < {need} (values + scales)")


def _num_slots(a):
    c = a["kv_compress_cache"]
    return c.shape[0] if a["layout"] == 1 else c.shape[0] * c.shape[1]


def _x_width(a):
    d = _d(a)
    return None if d > 64 and d % 16 == 0 else d


_rule = rule
_edit = edit_params

KCEV_CONTRACT = Contract(
    op=KCEV,
    constraints=[
        is_array(KCEV, "kv_compress_cache", source=KCEV_SRC),
        is_array(KCEV, "x", source=KCEV_SRC),
        is_array(KCEV, "slot_mapping", source=KCEV_SRC),
        dtype_in(KCEV, "kv_compress_cache", ("float8_e4m3fn", "float8_e5m2"), source=KCEV_SRC),
        dtype_in(KCEV, "x", ("bfloat16",), source=KCEV_SRC),
        _rule(KCEV, "x_ndim", "x", "dim", "must be 2-D [tokens, d]",
              lambda a: None if a.x.ndim == 2 else a.x.ndim,
              _edit(lambda o: o.update(x=o["x"][None])), source=KCEV_SRC),
        _rule(KCEV, "x_tokens", "x", "shape", "needs at least one token",
              lambda a: None if a.x.shape[0] >= 1 else tuple(a.x.shape),
              _edit(lambda o: o.update(x=o["x"][:0], slot_mapping=o["slot_mapping"][:0])), source=KCEV_SRC),
        _rule(KCEV, "x_last_dim", "x", "shape",
              "d must be a multiple of 16 above 64 (d - 64 NoPE columns, 64 RoPE columns; the kernel's rows are "
              "16-element aligned)", _x_width, _edit(lambda o: o.update(x=o["x"][:, :504])), source=KCEV_SRC),
        dtype_in(KCEV, "slot_mapping", SLOT_DTYPES, source=KCEV_SRC),
        _rule(KCEV, "slot_mapping_shape", "slot_mapping", "shape", "must be 1-D of length x.shape[0]",
              lambda a: None if tuple(a.slot_mapping.shape) == (a.x.shape[0],) else tuple(a.slot_mapping.shape),
              _edit(lambda o: o.update(slot_mapping=o["slot_mapping"][:-1])), source=KCEV_SRC),
        _rule(KCEV, "quant_mode_value", "quant_mode", "value",
              "must be 2 (MXFP8); quant_mode 1 (FP8 with fp32 scales per 128 values) is not modelled by qsfa",
              lambda a: None if is_int(a.quant_mode) and a.quant_mode == 2 else a.quant_mode,
              set_param("quant_mode", 1), source=KCEV_SRC),
        _rule(KCEV, "quant_group_size_value", "quant_group_size", "value", "MXFP8 groups are 64 or 128 values",
              lambda a: None if is_int(a.quant_group_size) and a.quant_group_size in (64, 128) else a.quant_group_size,
              set_param("quant_group_size", 32), source=KCEV_SRC),
        _rule(KCEV, "round_scale_flag_type", "round_scale_flag", "type", "must be a bool",
              lambda a: None if is_bool(a.round_scale_flag) else a.round_scale_flag,
              set_param("round_scale_flag", 1), source=KCEV_SRC),
        _rule(KCEV, "layout_value", "layout", "value",
              "must be 1 (one padded row per slot) or 2 (blocks: values of every token, then their scales)",
              lambda a: None if is_int(a.layout) and a.layout in (1, 2) else a.layout,
              set_param("layout", 3), source=KCEV_SRC),
        _rule(KCEV, "cache_shape", "kv_compress_cache", "shape",
              "layout 1 takes [num_slots, 1, head_dim] (row s at s * stride(0), as vLLM-Ascend's "
              "cache.view(-1, 1, head_dim)); layout 2 takes [num_blocks, block_size, 1, X]", _cache_rank,
              _edit(lambda o: o.update(kv_compress_cache=o["kv_compress_cache"][:, :, None])), source=KCEV_SRC),
        _rule(KCEV, "cache_strides", "kv_compress_cache", "layout",
              "only dimension 0 may be strided (rows, and layout 2's blocks, are dense bytes)", _cache_dense,
              _edit(lambda o: o.update(kv_compress_cache=np.zeros((12, 1, 1408), np.uint8).view(
                  ml_dtypes.float8_e4m3fn)[..., ::2])), source=KCEV_SRC),
        _rule(KCEV, "cache_width", "kv_compress_cache", "shape",
              "the last dimension must hold a row (layout 1: roundup(n + 128 + ceil(n / G), 128) bytes) or a "
              "token's values and scales (layout 2: n + 128 + roundup(ceil(n / G), 8) bytes)", _cache_width,
              _edit(lambda o: o.update(kv_compress_cache=o["kv_compress_cache"][..., :600])), source=KCEV_SRC),
        all_finite(KCEV, "x", source=KCEV_SRC),
        *_slot_rules(KCEV, "slot_mapping", _num_slots, source=KCEV_SRC),
        _rule(KCEV, "a2a3_unsupported", "kv_compress_cache", "value",
              "vLLM-Ascend's kv_compress_epilog runs on Ascend 950 only (op_host: AddConfig ascend950)",
              lambda a: "Atlas A2/A3", lambda args: copy_args(args), chips=("A2", "A3"), source=KCEV_SRC),
    ],
    example=_kcev_example,
    inplace=("kv_compress_cache",),
    params=params("kv_compress_cache:array x:array slot_mapping:array quant_group_size:int quant_mode:int"
                  " round_scale_flag:bool layout:int"),
)


def _kcev_reference(kv_compress_cache, x, slot_mapping, quant_group_size, quant_mode, round_scale_flag, layout):
    return _kv.kv_compress_epilog_vllm(kv_compress_cache, x, slot_mapping, quant_group_size=int(quant_group_size),
                                       quant_mode=int(quant_mode), round_scale_flag=bool(round_scale_flag),
                                       layout=int(layout))


define_operator(KCEV, KCEV_CONTRACT, outputs=("kv_compress_cache",), reference=_kcev_reference,
                doc="vLLM-Ascend's kv_compress_epilog: MXFP8 group quant of bf16 rows, scattered into an FP8 cache.")


def kv_compress_epilog_vllm(kv_compress_cache, x, slot_mapping, *, quant_group_size=64, quant_mode=2,
                            round_scale_flag=True, layout=1, chip=None, backend="reference"):
    """vLLM-Ascend's ``torch.ops._C_ascend.kv_compress_epilog`` (Ascend 950): quantise bf16 ``x [T, d]`` (n = d - 64
    NoPE columns, then 64 RoPE) to FP8 with one E8M0 scale per ``quant_group_size`` NoPE values and write each
    token by slot (-1 skips) into the FP8-typed cache, in place.

    Scale ``s = max(amax, 1e-4) * fp32(1 / FMAX)`` (FMAX 448 for float8_e4m3fn caches, 57344 for float8_e5m2);
    with ``round_scale_flag`` ``s = 2^(floor(log2 s) + 1)`` (a power of two is doubled - the kernel's rule);
    codes ``FP8_RINT(clamp(x / s, +-FMAX))``; stored byte ``(bits(s) >> 23) & 0xFF``.

    kv_compress_cache: float8_e4m3fn / float8_e5m2; layout 1 ``[num_slots, 1, head_dim]`` - row s =
                       RoPE bf16 (128 bytes) | n codes | ceil(n / G) scale bytes | zero pad to a multiple of 128;
                       layout 2 ``[num_blocks, block_size, 1, X]`` - per block every token's n codes + RoPE, then
                       every token's scale bytes padded to 8 (FlashMLA's MODEL1 layout for d 512, G 64).
    x:                 bfloat16 ``[T, d]``, d a multiple of 16 above 64, finite.
    slot_mapping:      int32 / int64 ``[T]``; -1 skips a token; others unique and inside the cache.
    quant_group_size:  64 (vLLM-Ascend's call) or 128 (the op's default attribute).
    quant_mode:        2 (MXFP8) - mode 1 is not modelled.
    round_scale_flag:  power-of-two scales (vLLM-Ascend passes True).
    layout:            1 (vLLM-Ascend's call) or 2.
    Returns ``kv_compress_cache``.
    """
    args = dict(kv_compress_cache=kv_compress_cache, x=x, slot_mapping=slot_mapping,
                quant_group_size=quant_group_size, quant_mode=quant_mode, round_scale_flag=round_scale_flag,
                layout=layout)
    return run(KCEV, args, backend, chip=chip)
