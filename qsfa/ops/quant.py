"""Public front door of ``dynamic_block_quant`` (torch_npu ``npu_dynamic_block_quant``, docs/numerics/quantisers.md#dynamic_block_quant).

The contract holds every documented rule: operator rules (dtypes, ranks, names, value ranges) and the
per-chip limits of the torch_npu / aclnn docs as ``chips=`` constraints (also exported as plain data in
:data:`BLOCK_LIMITS`). The computation is :func:`qsfa.reference.quant.dynamic_block_quant`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, is_array, is_int, is_num, ndim_in, rule, set_param, set_params
from .._contract import Contract, copy_args, one_of, params
from .. import chips as _chips
from .._dispatch import define_operator, run
from ..reference import quant as _ref

__all__ = ["dynamic_block_quant", "BLOCK_LIMITS", "DST_TYPE_CODES", "dst_type_name", "CONTRACT"]

OP = "dynamic_block_quant"

#: torch_npu integer dtype codes accepted for ``dst_type`` (torch_npu op_plugin/meta/_meta_registrations.py
#: TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP: 1 torch.int8, 23/291 float8_e5m2, 24/292 float8_e4m3fn,
#: 290 torch_npu.hifloat8).
DST_TYPE_CODES = {1: "int8", 23: "float8_e5m2", 291: "float8_e5m2", 24: "float8_e4m3fn", 292: "float8_e4m3fn",
                  290: "hifloat8"}

DST_TYPES = ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8")

#: Per-chip limits (torch_npu doc torch_npu-npu_dynamic_block_quant.md in Ascend/op-plugin; aclnn doc
#: aclnnDynamicBlockQuantV2.md in ops-nn). The reference accepts the union.
BLOCK_LIMITS = {
    "A2": dict(dst_types=("int8",), round_modes=("rint",), row_block_sizes=(1,), col_block_sizes=(1, 128),
               dst_type_max=(0.0,)),
    "A3": dict(dst_types=("int8",), round_modes=("rint",), row_block_sizes=(1,), col_block_sizes=(1, 128),
               dst_type_max=(0.0,)),
    "950": dict(dst_types=DST_TYPES, round_modes=("rint", "round"), row_block_sizes=(1, 128, 256, 512),
                col_block_sizes=(64, 128, 192, 256), dst_type_max=(0.0, 15.0, 56.0, 224.0, 32768.0)),
}

SOURCE = "docs/numerics/quantisers.md#dynamic_block_quant; torch_npu npu_dynamic_block_quant doc (Ascend/op-plugin)"


def dst_type_name(v):
    """Canonical format name of a ``dst_type`` given as a name, a torch_npu integer code or a torch /
    NumPy dtype; ``None`` if it is none of the four destinations."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, np.integer)):
        return DST_TYPE_CODES.get(int(v))
    if isinstance(v, str):
        return v if v in DST_TYPES else None
    try:
        name = dtype_name(v)
    except TypeError:
        return None
    return name if name in DST_TYPES else None


_is_int, _is_num = is_int, is_num
_rule = functools.partial(rule, OP, source=SOURCE)
_with = set_params


def _nonempty(a):
    return None if a.x.size else tuple(a.x.shape)


def _dst(a):
    return None if dst_type_name(a.dst_type) is not None else a.dst_type


def _round_mode_for_dst(a):
    want = "round" if dst_type_name(a.dst_type) == "hifloat8" else "rint"
    return None if a.round_mode == want else a.round_mode


def _block(param):
    def check(a):
        v = a[param]
        return None if _is_int(v) and v >= 1 else v

    return check


def _min_scale(a):
    v = a.min_scale
    return None if _is_num(v) and math.isfinite(v) and v >= 0 else v


def _dst_type_max(a):
    v = a.dst_type_max
    return None if _is_num(v) and math.isfinite(v) and (v == 0 or v >= 1) else v


def _dst_type_max_hif8(a):
    if a.dst_type_max == 0 or dst_type_name(a.dst_type) == "hifloat8":
        return None
    return a.dst_type_max


def _multiply_min_scale(a):
    return None if a.scale_order != "multiply" or a.min_scale == 0 else a.min_scale


def _limit(chip, key, param, getter=None):
    allowed = BLOCK_LIMITS[chip][key]

    def check(a):
        v = a[param] if getter is None else getter(a)
        return None if v in allowed else v

    return check, allowed


def _chip_rules():
    out = []
    a2a3 = ("A2", "A3")
    c, allowed = _limit("A2", "dst_types", "dst_type", lambda a: dst_type_name(a.dst_type))
    out.append(_rule("a2a3_dst_type", "dst_type", "value", f"Atlas A2/A3 support only {one_of(allowed)}", c,
                     _with(dst_type="float8_e4m3fn"), chips=a2a3))
    c, allowed = _limit("A2", "row_block_sizes", "row_block_size")
    out.append(_rule("a2a3_row_block_size", "row_block_size", "value", f"Atlas A2/A3: must be {one_of(allowed)}",
                     c, _with(row_block_size=2), chips=a2a3))
    c, allowed = _limit("A2", "col_block_sizes", "col_block_size")
    out.append(_rule("a2a3_col_block_size", "col_block_size", "value", f"Atlas A2/A3: must be {one_of(allowed)}",
                     c, _with(col_block_size=64), chips=a2a3))
    c, allowed = _limit("950", "row_block_sizes", "row_block_size")
    out.append(_rule("950_row_block_size", "row_block_size", "value", f"Ascend 950: must be {one_of(allowed)}",
                     c, _with(row_block_size=2), chips=("950",)))
    c, allowed = _limit("950", "col_block_sizes", "col_block_size")
    out.append(_rule("950_col_block_size", "col_block_size", "value", f"Ascend 950: must be {one_of(allowed)}",
                     c, _with(col_block_size=32), chips=("950",)))
    c, allowed = _limit("950", "dst_type_max", "dst_type_max")
    out.append(_rule("950_dst_type_max", "dst_type_max", "value", f"Ascend 950: must be {one_of(allowed)}", c,
                     _with(dst_type="hifloat8", round_mode="round", dst_type_max=100.0), chips=("950",)))
    return out


def _example(rng):
    import ml_dtypes

    x = (rng.standard_normal((3, 200)) * 4).astype(ml_dtypes.bfloat16)
    return dict(x=x, min_scale=0.0, round_mode="rint", dst_type="int8", row_block_size=1,
                col_block_size=128, dst_type_max=0.0, scale_order="divide")


def _normalise(a):
    out = dict(a)
    out["dst_type"] = dst_type_name(a.dst_type)
    return out


CONTRACT = Contract(
    op=OP,
    constraints=[
        is_array(OP, "x", source=SOURCE),
        dtype_in(OP, "x", ("float16", "bfloat16", "float32"), source=SOURCE),
        ndim_in(OP, "x", (2, 3), source=SOURCE),
        _rule("x_nonempty", "x", "shape", "empty tensors are not supported", _nonempty,
              lambda args: {**copy_args(args), "x": args["x"][:0]}),
        _rule("dst_type_value", "dst_type", "value",
              f"must be {one_of(DST_TYPES)}, a torch_npu dtype code {one_of(sorted(DST_TYPE_CODES))} or the "
              "matching torch dtype", _dst, set_param("dst_type", "int4")),
        _rule("round_mode_value", "round_mode", "value",
              "must be 'round' for hifloat8 and 'rint' for int8 / float8 destinations", _round_mode_for_dst,
              set_param("round_mode", "floor")),
        _rule("row_block_size_value", "row_block_size", "value", "must be a positive integer",
              _block("row_block_size"), set_param("row_block_size", 0)),
        _rule("col_block_size_value", "col_block_size", "value", "must be a positive integer",
              _block("col_block_size"), set_param("col_block_size", 0)),
        _rule("min_scale_value", "min_scale", "value", "must be a finite number >= 0", _min_scale,
              set_param("min_scale", -1.0)),
        _rule("dst_type_max_value", "dst_type_max", "value",
              "must be 0 (the type's max) or a finite number >= 1 (below 1 the scale leaves the data's range)",
              _dst_type_max, set_param("dst_type_max", -15.0)),
        _rule("dst_type_max_hifloat8", "dst_type_max", "value",
              "only a hifloat8 destination takes dst_type_max (the kernel ignores it otherwise)",
              _dst_type_max_hif8, set_param("dst_type_max", 15.0)),
        _rule("scale_order_value", "scale_order", "value",
              f"must be None (the chip's order) or {one_of(_ref.SCALE_ORDERS)}",
              lambda a: None if a.scale_order is None or a.scale_order in _ref.SCALE_ORDERS else a.scale_order,
              set_param("scale_order", "bogus"), source="docs/numerics/open-facts.md#scale_order (OPEN: quantise x / s or x * 127 / amax)"),
        _rule("scale_order_min_scale", "min_scale", "value",
              "scale_order='multiply' is defined only without a min_scale bound (min_scale == 0)",
              _multiply_min_scale, _with(scale_order="multiply", min_scale=0.5)),
        *_chip_rules(),
    ],
    example=_example,
    normalise=_normalise,
    params=params("x:array min_scale:float32 round_mode:str dst_type:any row_block_size:int col_block_size:int"
                  " dst_type_max:float32 scale_order:str?"),
)


def _reference(x, min_scale, round_mode, dst_type, row_block_size, col_block_size, dst_type_max, scale_order):
    return _ref.dynamic_block_quant(x, min_scale=min_scale, round_mode=round_mode, dst_type=dst_type,
                                    row_block_size=row_block_size, col_block_size=col_block_size,
                                    dst_type_max=dst_type_max, scale_order=scale_order or "divide")


define_operator(OP, CONTRACT, outputs=("y", "scale"), reference=_reference, numerics=_chips.dbq_numerics,
                doc="Block-wise dynamic quantisation with one fp32 scale per block (npu_dynamic_block_quant).")


def dynamic_block_quant(x, *, min_scale=0.0, round_mode="rint", dst_type="int8", row_block_size=1,
                        col_block_size=128, dst_type_max=0.0, scale_order=None, chip=None, backend="reference"):
    """Quantise ``x`` block by block with one float32 scale per block (``npu_dynamic_block_quant``).

    Computes, per ``row_block_size x col_block_size`` block of the last two dimensions (edge blocks are
    partial: the amax covers the elements that exist)::

        scale = min(amax / TYPE_MAX, 1 / min_scale)     (the bound only when min_scale > 0)
        y     = cast(clamp(x / scale, +-max finite))     (fp32; RINT or ROUND, saturating)

    with TYPE_MAX 127 (INT8), 448 (FP8 E4M3FN), 57344 (FP8 E5M2), 32768 (HiFloat8) or ``dst_type_max``.
    An all-zero block gives scale 0 and codes 0; inf/nan are excluded from the amax, +-inf quantise to
    +-max finite and nan to 0.

    Parameters (torch_npu names):
      x:              ``[M, N]`` or ``[B, M, N]`` float16 / bfloat16 (float32 also accepted, as aclnn V2).
      min_scale:      float >= 0; 0 means no bound.
      round_mode:     "rint" (half to even) for INT8 / FP8, "round" (half away from zero) for HiFloat8.
      dst_type:       "int8" (default), "float8_e4m3fn", "float8_e5m2", "hifloat8"; also torch_npu's integer
                      codes (1 int8, 23/291 e5m2, 24/292 e4m3fn, 290 hifloat8) or torch dtypes.
      row_block_size, col_block_size: block shape (chip limits in :data:`BLOCK_LIMITS`).
      dst_type_max:   0 = the type's own max; otherwise (HiFloat8 only) the TYPE_MAX used in the scale
                      (torch_npu: 15, 56, 224, 32768 on Ascend 950).
      scale_order:    None (default: the chip's kernel order - A2/A3 "reciprocal", 950 "divide") or an explicit order:
                      "divide" (``x / scale``), "reciprocal" (``x * fp32(fp32(1 / amax) * TYPE_MAX)``, scale
                      ``amax * fp32(1 / TYPE_MAX)``: the A2/A3 kernel), "reciprocal_multiply" (that multiplier with
                      ``scale = amax / TYPE_MAX``: the op-plugin test golden, bit for bit) or "multiply"
                      (``x * fp32(TYPE_MAX / amax)``). docs/numerics/chips.md#dynamic_block_quant; not a torch_npu
                      argument.
      chip:           None | "A2" | "A3" | "950": whose block limits apply (:data:`BLOCK_LIMITS`); None = the npu
                      device's chip, else :func:`qsfa.resolve_chip`'s rule. docs/numerics/chips.md.
      backend:        "reference" | "npu" | "triton".
    Returns ``(y, scale)``: ``y`` of x's shape (int8; float8_e4m3fn / float8_e5m2 as ml_dtypes arrays or
    torch float8 tensors; HiFloat8 as uint8 codes), ``scale`` float32 ``[(B,) ceil(M/rb), ceil(N/cb)]``.
    """
    args = dict(x=x, min_scale=min_scale, round_mode=round_mode, dst_type=dst_type,
                row_block_size=row_block_size, col_block_size=col_block_size, dst_type_max=dst_type_max,
                scale_order=scale_order)
    return run(OP, args, backend, chip=chip)
