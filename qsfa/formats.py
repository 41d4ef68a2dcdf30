"""Public number-format API: exact encode / decode of qsfa's storage formats and the scale rules.

The numerics live in :mod:`qsfa.reference.formats` (docs/numerics/formats.md#summary) and :mod:`qsfa.reference.scales`
(docs/numerics/quantisers.md#scale-rules); this module re-exports them and routes :func:`encode`, :func:`decode`,
:func:`pack_fp4` and :func:`unpack_fp4` through the one dispatch path (operators ``formats.encode``,
``formats.decode``, ``formats.pack_fp4``, ``formats.unpack_fp4``), so bad arguments are rejected by a
:class:`~qsfa._contract.Contract` with the usual ``Invalid <kind> for <param>, ...`` message, and torch
tensors in give torch tensors out.

Formats: ``int8``, ``float8_e4m3fn``, ``float8_e5m2``, ``hifloat8``, ``float4_e2m1``, ``float8_e8m0``,
``bfloat16``, ``float16`` (:data:`FORMAT_NAMES`). See :mod:`qsfa.reference.formats` for the code layout,
rounding modes and overflow rules of each.
"""

from __future__ import annotations

import numpy as np

from ._checks import dtype_in, is_array, is_int, is_num, set_param, value_in
from ._contract import Constraint, Contract, copy_args, params
from ._dispatch import define_operator, run
from ._errors import Raw
from ._public import checked, one_of_values, positive_int
from .reference import formats as _ref
from .reference import scales as _scales
from .reference.formats import (  # noqa: F401  (re-exported)
    CHUNK,
    FLOAT_FORMATS,
    FORMAT_NAMES,
    NIBBLE_ORDERS,
    ROUNDING_MODES,
    FloatFormat,
    all_codes,
    code_bits,
    code_dtype,
    code_input_dtypes,
    default_rounding,
    has_inf,
    has_nan,
    max_finite,
    midpoints,
    out_of_range,
    representable_values,
    rounding_modes,
)
from .reference.scales import *  # noqa: F401,F403  (the scale rules, re-exported)

__all__ = [
    "FORMAT_NAMES",
    "ROUNDING_MODES",
    "NIBBLE_ORDERS",
    "FloatFormat",
    "FLOAT_FORMATS",
    "encode",
    "decode",
    "round_to",
    "pack_fp4",
    "unpack_fp4",
    "max_finite",
    "all_codes",
    "midpoints",
    "representable_values",
    "rounding_modes",
    "default_rounding",
    "code_dtype",
    "code_bits",
    "code_input_dtypes",
    "has_nan",
    "has_inf",
    "out_of_range",
] + list(_scales.__all__)

# The scale rules and out_of_range with the operators' argument rules (qsfa/_public.py): a bad argument is an
# ``Invalid <kind> for <param>`` error, never a ZeroDivisionError / KeyError from inside NumPy (issue 27).
_VALUES_ND = (lambda v, a: np.ndim(v) >= 1, "must have at least one dimension (the groups run along the last axis)")
out_of_range = checked(
    "x:values fmt:str rounding:str?",
    rounding=(lambda v, a: a["fmt"] not in FORMAT_NAMES or v in _ref.rounding_modes(a["fmt"]),
              "must be None or one of the format's rounding modes (qsfa.formats.rounding_modes(fmt))"),
)(_ref.out_of_range)
group_amax = checked("x:values group:int", x=_VALUES_ND,
                     group=(positive_int, "must be a positive integer"))(_scales.group_amax)
int8_dynamic_scale = checked("amax:values")(_scales.int8_dynamic_scale)
int8_dynamic_quant = checked("x:values group:int order:str", x=_VALUES_ND,
                             group=(positive_int, "must be a positive integer"),
                             order=(one_of_values(_scales.INT8_DYNAMIC_ORDERS),
                                    f"must be one of {_scales.INT8_DYNAMIC_ORDERS}"))(_scales.int8_dynamic_quant)
dynamic_block_scale = checked(
    "amax:values min_scale:float32",
    type_max=(lambda v, a: v in _scales.TYPE_MAX if isinstance(v, str) else
              is_num(v) and 0 < float(v) <= float(np.finfo(np.float32).max),
              f"must be a positive number float32 holds or one of {sorted(_scales.TYPE_MAX)}"),
    min_scale=(lambda v, a: v >= 0, "must be >= 0 (0: no bound)"),
)(_scales.dynamic_block_scale)
fp8_group_scale = checked("amax:values")(_scales.fp8_group_scale)

def _no_negative(v, a) -> bool:
    with np.errstate(invalid="ignore"):
        return not np.any(_scales._f32(v) < 0)


def _no_nan(v, a) -> bool:
    return _no_negative(v, a) and not np.any(np.isnan(_scales._f32(v)))


# a scale is >= 0: the bit formulas read a negative value's sign bit as part of the exponent (e8m0_byte(-1.0) gave
# 127, round_scale_pow2(-1.0) a NaN) and a NaN's mantissa as a fraction (round_scale_pow2(nan) gave -0.0)
round_scale_pow2 = checked("s:values", s=(_no_nan, "must be >= 0 (+Inf allowed) and not NaN: the power-of-two "
                                                   "ceiling of a scale"))(_scales.round_scale_pow2)
e8m0_byte = checked("s:values", s=(_no_negative, "must be >= 0 (a scale; NaN stores 0xFF, E8M0's NaN)"))(
    _scales.e8m0_byte)
fp4_group_scale = checked("amax:values")(_scales.fp4_group_scale)
flashmla_v32_scale = checked("amax:values ceil_mode:str", ceil_mode=(one_of_values(("bits", "log2")),
                                                                     "must be one of ('bits', 'log2')"))(
    _scales.flashmla_v32_scale)
ocp_mx_scale_exponent = checked(
    "amax:values",
    elem_emax=(lambda v, a: v in _scales.MX_ELEM_EMAX if isinstance(v, str) else is_int(v) and abs(int(v)) < 1 << 16,
               f"must be an integer or one of {sorted(_scales.MX_ELEM_EMAX)}"),
)(_scales.ocp_mx_scale_exponent)

_SRC = "docs/numerics/formats.md#summary"
_NO_SPECIALS = ("int8", "float4_e2m1")
_INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _first_index(mask: np.ndarray):
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _known_fmt(a) -> bool:
    return isinstance(a.get("fmt"), str) and a["fmt"] in FORMAT_NAMES


# ---------------------------------------------------------------------------------------------------
# formats.encode


def _check_rounding_supported(a):
    r = a.get("rounding")
    modes = rounding_modes(a["fmt"])
    return None if r is None or r in modes else f"{r} with fmt {a['fmt']} (supported: {', '.join(modes)})"


def _first_bad_x(a, bad):
    """``None`` when the mask ``bad`` is empty, else the first offending element of ``x`` and its index."""
    if not bad.any():
        return None
    i = _first_index(bad)
    return Raw(f"{a['x'][i]} at index {i}")


def _check_x_finite(a):
    if a["fmt"] not in _NO_SPECIALS or a["saturate"]:
        return None
    with np.errstate(invalid="ignore"):
        return _first_bad_x(a, ~np.isfinite(a["x"].astype(np.float64, copy=False)))


def _check_x_nan(a):
    if a["fmt"] not in _NO_SPECIALS:
        return None
    return _first_bad_x(a, np.isnan(a["x"].astype(np.float64, copy=False)))


def _check_x_range(a):
    if a["fmt"] not in _NO_SPECIALS or a["saturate"]:
        return None
    return _first_bad_x(a, out_of_range(a["x"], a["fmt"], a.get("rounding")))


def _check_x_sign(a):
    if a["fmt"] != "float8_e8m0":
        return None
    return _first_bad_x(a, a["x"].astype(np.float64, copy=False) < 0)


def _put(name, index, value, **extra):
    def violate(args):
        out = copy_args(args)
        out.update(extra)
        v = out[name].copy()
        v.reshape(-1)[index] = value
        out[name] = v
        return out

    return violate


def _e8m0_negative(args):
    out = copy_args(args)
    x = np.abs(out["x"])
    x.reshape(-1)[0] = -1.0
    out.update(fmt="float8_e8m0", x=x)
    return out


def _encode_example(rng):
    return dict(x=(rng.standard_normal(16) * 4).astype(np.float32), fmt="int8", saturate=False,
                rounding=None)


ENCODE_CONTRACT = Contract(
    op="formats.encode",
    constraints=[
        value_in("formats.encode", "fmt", FORMAT_NAMES, source=_SRC),
        is_array("formats.encode", "x", source=_SRC),
        dtype_in("formats.encode", "x", _INPUT_DTYPES, source=_SRC),
        value_in("formats.encode", "rounding", ROUNDING_MODES + (None,), bad="nearest", source=_SRC),
        Constraint(
            id="formats.encode.rounding_supported", param="rounding", kind="value",
            reason="the format does not support this rounding mode (hifloat8: round or hybrid; float8_e8m0 "
                   "adds floor and ceil)",
            check=_check_rounding_supported, violate=set_param("rounding", "floor"), source=_SRC,
        ),
        Constraint(
            id="formats.encode.x_finite", param="x", kind="value",
            reason="int8 and float4_e2m1 have no Inf/NaN: inputs must be finite unless saturate=True",
            check=_check_x_finite, violate=_put("x", 0, np.inf), source=_SRC,
        ),
        Constraint(
            id="formats.encode.x_nan", param="x", kind="value",
            reason="int8 and float4_e2m1 have no NaN code (saturate does not apply to NaN)",
            check=_check_x_nan, violate=_put("x", 0, np.nan, saturate=True), source=_SRC,
        ),
        Constraint(
            id="formats.encode.x_range", param="x", kind="value",
            reason="rounds beyond the format's range (int8 [-128, 127], float4_e2m1 +-6) and saturate is off",
            check=_check_x_range, violate=_put("x", 0, 1000.0), source=_SRC,
        ),
        Constraint(
            id="formats.encode.x_sign", param="x", kind="value",
            reason="float8_e8m0 is unsigned: values must be >= 0",
            check=_check_x_sign, violate=_e8m0_negative, source=_SRC,
        ),
    ],
    example=_encode_example,
    params=params("x:array fmt:str saturate:bool rounding:str?"),
)


def _encode_reference(x, fmt, saturate=False, rounding=None):
    return _ref.encode(x, fmt, saturate=bool(saturate), rounding=rounding)


define_operator("formats.encode", ENCODE_CONTRACT, outputs=("codes",), reference=_encode_reference,
                doc="raw codes of x in a number format")


def encode(x, fmt: str, *, saturate: bool = False, rounding: str | None = None, chip: str | None = None,
           backend: str = "reference"):
    """Raw codes of ``x`` rounded to number format ``fmt``.

    x:        float32 / float64 / float16 / bfloat16 array or tensor, any shape.
    fmt:      one of :data:`FORMAT_NAMES`.
    saturate: clamp beyond-range values (Inf included) to +-max finite; otherwise +-Inf / NaN where the
              format has them, and an error for int8 / float4_e2m1.
    rounding: "rint" (ties to even) | "round" (ties away) | float8_e8m0 also "floor" / "ceil" | hifloat8 also
              "hybrid" (ties away for |e| <= 3, deterministic SSR elsewhere;
              docs/numerics/formats.md#hybrid-rounding); None = the format's default (hifloat8 "round",
              float8_e8m0 "floor", others "rint").
    backend:  "reference" (the only implementation of this operator).

    Returns codes of x's shape: uint8 (8-bit formats; int8 as two's complement bytes; float4_e2m1 one
    code 0..15 per byte) or uint16 bit patterns (bfloat16, float16), in the caller's array kind.
    """
    return run("formats.encode", dict(x=x, fmt=fmt, saturate=saturate, rounding=rounding), backend, chip=chip)


# ---------------------------------------------------------------------------------------------------
# formats.decode


def _check_codes_dtype(a):
    from ._arrays import dtype_name

    c = a["codes"]
    return None if c.dtype in code_input_dtypes(a["fmt"]) else dtype_name(c)


def _bad_codes_dtype(args):
    out = copy_args(args)
    out["codes"] = np.zeros(np.shape(out["codes"]), np.float64)
    return out


def _check_fp4_codes(param):
    def check(a):
        if param == "codes" and a.get("fmt", "float4_e2m1") != "float4_e2m1":
            return None
        c = a[param]
        if c.size == 0:
            return None
        m = int(c.max())
        return None if m <= 15 else m

    return check


def _fp4_code_16(args):
    out = copy_args(args)
    c = np.zeros(np.shape(out["codes"]), np.uint8)
    c.reshape(-1)[0] = 16
    out["codes"] = c
    if "fmt" in out:
        out["fmt"] = "float4_e2m1"
    return out


DECODE_CONTRACT = Contract(
    op="formats.decode",
    constraints=[
        value_in("formats.decode", "fmt", FORMAT_NAMES, source=_SRC),
        is_array("formats.decode", "codes", source=_SRC),
        Constraint(
            id="formats.decode.codes_dtype", param="codes", kind="dtype",
            reason="must be the format's code dtype: uint8 for 8/4-bit formats (int8 also int8), uint16 "
                   "for bfloat16/float16, or the bit-identical ml_dtypes dtype",
            check=_check_codes_dtype, dtype=True, violate=_bad_codes_dtype, source=_SRC,
        ),
        Constraint(
            id="formats.decode.codes_range", param="codes", kind="value",
            reason="float4_e2m1 codes must be in [0, 15] (one code per byte; unpack_fp4 first)",
            check=_check_fp4_codes("codes"), violate=_fp4_code_16, source=_SRC,
        ),
    ],
    example=lambda rng: dict(codes=rng.integers(0, 256, 16).astype(np.uint8), fmt="float8_e4m3fn"),
    params=params("codes:array fmt:str"),
)

define_operator("formats.decode", DECODE_CONTRACT, outputs=("values",),
                reference=lambda codes, fmt: _ref.decode(codes, fmt), doc="float32 values of raw codes")


def decode(codes, fmt: str, *, chip: str | None = None, backend: str = "reference"):
    """float32 values of raw ``codes`` of format ``fmt`` (NaN codes -> nan, Inf codes -> +-inf).

    codes:   uint8 (8-bit formats, int8 also int8, float4_e2m1 one code 0..15 per byte) or uint16
             (bfloat16, float16); the bit-identical ml_dtypes / torch dtype is accepted too.
    fmt:     one of :data:`FORMAT_NAMES`.
    backend: "reference".
    Returns float32 of codes' shape.
    """
    return run("formats.decode", dict(codes=codes, fmt=fmt), backend, chip=chip)


def round_to(x, fmt: str, *, saturate: bool = False, rounding: str | None = None, chip: str | None = None,
             backend: str = "reference"):
    """``x`` rounded to ``fmt`` and back as float32: ``decode(encode(x, fmt, ...), fmt)``."""
    return decode(encode(x, fmt, saturate=saturate, rounding=rounding, chip=chip, backend=backend), fmt, chip=chip,
                  backend=backend)


# ---------------------------------------------------------------------------------------------------
# formats.pack_fp4 / formats.unpack_fp4


def _at_least_1d(op, param):
    def violate(args):
        out = copy_args(args)
        out[param] = np.asarray(out[param].reshape(-1)[0])
        return out

    return Constraint(
        id=f"{op}.{param}_ndim", param=param, kind="dim", reason="needs at least one dimension",
        check=lambda a: None if a[param].ndim >= 1 else a[param].ndim, violate=violate, source="docs/numerics/formats.md#fp4-packing",
    )


def _check_even(a):
    c = a["codes"]
    return None if c.shape[-1] % 2 == 0 else tuple(c.shape)


def _make_odd(args):
    out = copy_args(args)
    out["codes"] = out["codes"][..., :-1].copy()
    return out


def _nibble_order(op):
    return value_in(op, "nibble_order", NIBBLE_ORDERS, source="docs/numerics/open-facts.md#nibble_order (OPEN)")


PACK_CONTRACT = Contract(
    op="formats.pack_fp4",
    constraints=[
        is_array("formats.pack_fp4", "codes", source="docs/numerics/formats.md#fp4-packing"),
        dtype_in("formats.pack_fp4", "codes", ("uint8",), source="docs/numerics/formats.md#fp4-packing"),
        _at_least_1d("formats.pack_fp4", "codes"),
        Constraint(
            id="formats.pack_fp4.codes_last_axis_even", param="codes", kind="shape",
            reason="the last axis must have an even length (two codes per byte)",
            check=_check_even, violate=_make_odd, source="docs/numerics/formats.md#fp4-packing",
        ),
        Constraint(
            id="formats.pack_fp4.codes_range", param="codes", kind="value",
            reason="float4_e2m1 codes must be in [0, 15]",
            check=_check_fp4_codes("codes"), violate=_fp4_code_16, source="docs/numerics/formats.md#fp4-packing",
        ),
        _nibble_order("formats.pack_fp4"),
    ],
    example=lambda rng: dict(codes=rng.integers(0, 16, (3, 8)).astype(np.uint8), nibble_order="low_first"),
    params=params("codes:array nibble_order:str"),
)

define_operator("formats.pack_fp4", PACK_CONTRACT, outputs=("packed",),
                reference=lambda codes, nibble_order: _ref.pack_fp4(codes, nibble_order=nibble_order),
                doc="two float4_e2m1 codes per byte")


def pack_fp4(codes, *, nibble_order: str = "low_first", chip: str | None = None, backend: str = "reference"):
    """Pack float4_e2m1 codes two per byte along the last axis: uint8 ``[..., 2k]`` -> uint8 ``[..., k]``.

    nibble_order (**OPEN**, docs/numerics/open-facts.md#nibble_order): "low_first" (default) = element 2i in the low nibble
    (``byte = lo | hi << 4``); "high_first" = element 2i in the high nibble.
    """
    return run("formats.pack_fp4", dict(codes=codes, nibble_order=nibble_order), backend, chip=chip)


UNPACK_CONTRACT = Contract(
    op="formats.unpack_fp4",
    constraints=[
        is_array("formats.unpack_fp4", "packed", source="docs/numerics/formats.md#fp4-packing"),
        dtype_in("formats.unpack_fp4", "packed", ("uint8",), source="docs/numerics/formats.md#fp4-packing"),
        _at_least_1d("formats.unpack_fp4", "packed"),
        _nibble_order("formats.unpack_fp4"),
    ],
    example=lambda rng: dict(packed=rng.integers(0, 256, (3, 4)).astype(np.uint8), nibble_order="low_first"),
    params=params("packed:array nibble_order:str"),
)

define_operator("formats.unpack_fp4", UNPACK_CONTRACT, outputs=("codes",),
                reference=lambda packed, nibble_order: _ref.unpack_fp4(packed, nibble_order=nibble_order),
                doc="float4_e2m1 codes from packed bytes")


def unpack_fp4(packed, *, nibble_order: str = "low_first", chip: str | None = None, backend: str = "reference"):
    """Inverse of :func:`pack_fp4`: uint8 ``[..., k]`` -> uint8 codes ``[..., 2k]`` (0..15 each)."""
    return run("formats.unpack_fp4", dict(packed=packed, nibble_order=nibble_order), backend, chip=chip)
