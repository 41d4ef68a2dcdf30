"""Reference number formats (docs/numerics/formats.md): exact encode / decode of every format qsfa stores.

Formats (``FORMAT_NAMES``) and their raw code dtypes:

==================  ==========================================  ===========  ===============================
format              layout                                      codes        default rounding (also allowed)
==================  ==========================================  ===========  ===============================
``int8``            two's complement                            uint8        "rint" ("round")
``float8_e4m3fn``   s.eeee.mmm, bias 7, 0x7F/0xFF NaN, no Inf   uint8        "rint" ("round")
``float8_e5m2``     s.eeeee.mm, bias 15, IEEE Inf/NaN           uint8        "rint" ("round")
``hifloat8``        tapered, 0x80 NaN, 0x6F/0xEF Inf            uint8        "round" (TA) ("hybrid")
``float4_e2m1``     s.ee.m, bias 1, no Inf/NaN                  uint8 (0-15) "rint" ("round")
``float8_e8m0``     unsigned exponent, 2^(b-127), 0xFF NaN      uint8        "floor" ("ceil", "rint", "round")
``bfloat16``        top half of fp32                            uint16       "rint" ("round")
``float16``         IEEE half                                   uint16       "rint" ("round")
==================  ==========================================  ===========  ===============================

Rounding: "rint" = round to nearest, ties to even; "round" = round to nearest, ties away from zero
(HiFloat8's TA, Ascend's CAST_ROUND); HiFloat8 also takes "hybrid" (TA for binades |e| <= 3, the deterministic
"SSR" rounding elsewhere - see :func:`_hif8_ssr_chunk`). For float8_e8m0 the modes act in the linear domain: "floor" is the
byte-extraction rule of docs/numerics/quantisers.md#e8m0-store (``(bits(s) >> 23) & 0xFF``), "ceil" the round_scale rule
(``(bits >> 23) + (mantissa != 0)``), "rint"/"round" the nearest power of two (ties 1.5*2^k to the even
code / upwards).

Overflow: with ``saturate=True`` a value beyond the largest finite one (Inf included) becomes +-max finite;
without it, +-Inf where the format has Inf (E5M2, HiFloat8, fp16, bf16), NaN for E4M3FN (0x7F/0xFF) and
E8M0 (0xFF); for int8 and E2M1 (no Inf/NaN) an out-of-range or non-finite input raises
:class:`~qsfa.InvalidArgument`. NaN input gives the format's NaN code (E4M3FN/E5M2/fp16/bf16 keep the
sign: 0x7F/0xFF, 0x7E/0xFE, 0x7E00/0xFE00, 0x7FC0/0xFFC0; HiFloat8 0x80; E8M0 0xFF) and is an error
for int8/E2M1 even when saturating. HiFloat8 has a single zero: -0 and negative underflow encode to 0x00;
the IEEE-like formats keep the sign of zero (E4M3FN -0 = 0x80, E2M1 -0 = 0x8). E8M0 has no sign: a
negative input is an error; +-0 encodes to 0x00 (2^-127, the nearest value) in every mode.

Implementation: one frozen :class:`FloatFormat` record describes each IEEE-like format and drives one
generic vectorised rounding core working on float32 bit patterns with integer arithmetic (normals,
subnormals, RINT/ROUND ties, overflow). HiFloat8 is tapered and has its own table-driven code. Inputs are
processed in chunks of :data:`CHUNK` elements so the temporaries stay in cache. float64 input is first
narrowed to float32 with round-to-odd, which keeps every later rounding to <= 22 bits exact (no double
rounding); float16 / bfloat16 input widens exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import ml_dtypes
import numpy as np

from .._errors import InvalidArgument, InvalidDtype

__all__ = [
    "FORMAT_NAMES",
    "ROUNDING_MODES",
    "FloatFormat",
    "FLOAT_FORMATS",
    "rounding_modes",
    "default_rounding",
    "code_dtype",
    "code_bits",
    "has_nan",
    "has_inf",
    "encode",
    "decode",
    "round_to",
    "pack_fp4",
    "unpack_fp4",
    "max_finite",
    "all_codes",
    "midpoints",
    "representable_values",
    "out_of_range",
    "NIBBLE_ORDERS",
    "CHUNK",
    "INPUT_DTYPES",
    "code_input_dtypes",
]

FORMAT_NAMES = (
    "int8",
    "float8_e4m3fn",
    "float8_e5m2",
    "hifloat8",
    "float4_e2m1",
    "float8_e8m0",
    "bfloat16",
    "float16",
)

#: Every rounding mode any format knows.
ROUNDING_MODES = ("rint", "round", "floor", "ceil", "hybrid")

_MODES = {
    "int8": ("rint", "round"),
    "float8_e4m3fn": ("rint", "round"),
    "float8_e5m2": ("rint", "round"),
    "hifloat8": ("round", "hybrid"),
    "float4_e2m1": ("rint", "round"),
    "float8_e8m0": ("floor", "ceil", "rint", "round"),
    "bfloat16": ("rint", "round"),
    "float16": ("rint", "round"),
}

#: FP4 nibble orders (docs/numerics/open-facts.md#nibble_order, OPEN): "low_first" = element 2i in the low nibble (default).
NIBBLE_ORDERS = ("low_first", "high_first")

#: Elements processed per step of the vectorised encoders (temporaries of 256 KiB stay in cache).
CHUNK = 1 << 16

_U32 = np.uint32


@dataclass(frozen=True)
class FloatFormat:
    """An IEEE-like binary float format.

    ebits, mbits: exponent and mantissa field widths; bias: exponent bias.
    has_inf:    exponent all ones + mantissa 0 is +-Inf.
    nan:        "ieee" (exponent all ones, mantissa != 0), "ones" (only the all-ones magnitude, E4M3FN
                and E8M0) or "none".
    signed:     a sign bit above the exponent (E8M0 has none).
    subnormals: exponent field 0 is a subnormal (IEEE); False means it is a normal 2^-bias (E8M0).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    has_inf: bool
    nan: str
    signed: bool = True
    subnormals: bool = True

    @property
    def width(self) -> int:
        return int(self.signed) + self.ebits + self.mbits

    @property
    def max_code(self) -> int:
        """Magnitude code (sign bit clear) of the largest finite value."""
        ones = (1 << (self.ebits + self.mbits)) - 1
        if self.has_inf:
            return (((1 << self.ebits) - 1) << self.mbits) - 1
        return ones - 1 if self.nan == "ones" else ones

    @property
    def inf_code(self) -> int | None:
        return (((1 << self.ebits) - 1) << self.mbits) if self.has_inf else None

    @property
    def nan_code(self) -> int | None:
        """Magnitude code of the canonical (quiet) NaN."""
        if self.nan == "ieee":
            return (((1 << self.ebits) - 1) << self.mbits) | (1 << (self.mbits - 1))
        if self.nan == "ones":
            return (1 << (self.ebits + self.mbits)) - 1
        return None

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return (1 if self.subnormals else 0) - self.bias

    def value_of(self, magnitude_code: int) -> float:
        """Value of a finite magnitude code (plain formula; used to build the decode tables)."""
        e = magnitude_code >> self.mbits
        m = magnitude_code & ((1 << self.mbits) - 1)
        if e == 0 and self.subnormals:
            return float(m) * 2.0 ** (1 - self.bias - self.mbits)
        return (1.0 + m / 2.0**self.mbits) * 2.0 ** (e - self.bias)

    @property
    def max_finite(self) -> float:
        return self.value_of(self.max_code)


FLOAT_FORMATS = {
    "float8_e4m3fn": FloatFormat("float8_e4m3fn", 4, 3, 7, has_inf=False, nan="ones"),
    "float8_e5m2": FloatFormat("float8_e5m2", 5, 2, 15, has_inf=True, nan="ieee"),
    "float4_e2m1": FloatFormat("float4_e2m1", 2, 1, 1, has_inf=False, nan="none"),
    "float8_e8m0": FloatFormat("float8_e8m0", 8, 0, 127, has_inf=False, nan="ones", signed=False,
                               subnormals=False),
    "bfloat16": FloatFormat("bfloat16", 8, 7, 127, has_inf=True, nan="ieee"),
    "float16": FloatFormat("float16", 5, 10, 15, has_inf=True, nan="ieee"),
}


# ---------------------------------------------------------------------------------------------------
# format facts


def _check_fmt(fmt: str):
    if fmt not in _MODES:
        raise InvalidArgument("value", "fmt", fmt, f"must be one of {FORMAT_NAMES}")


def rounding_modes(fmt: str) -> tuple[str, ...]:
    """The rounding modes ``fmt`` supports (the first is its default)."""
    _check_fmt(fmt)
    return _MODES[fmt]


def default_rounding(fmt: str) -> str:
    """The default rounding mode: "round" (TA) for hifloat8, "floor" for float8_e8m0, else "rint"."""
    return rounding_modes(fmt)[0]


def code_dtype(fmt: str) -> np.dtype:
    """dtype of :func:`encode`'s output: uint16 for bfloat16/float16, uint8 otherwise."""
    _check_fmt(fmt)
    return np.dtype(np.uint16) if fmt in ("bfloat16", "float16") else np.dtype(np.uint8)


def code_bits(fmt: str) -> int:
    """Bits per code: 4 for float4_e2m1, 16 for bfloat16/float16, 8 otherwise."""
    _check_fmt(fmt)
    return {"float4_e2m1": 4, "bfloat16": 16, "float16": 16}.get(fmt, 8)


def has_nan(fmt: str) -> bool:
    _check_fmt(fmt)
    return fmt not in ("int8", "float4_e2m1")


def has_inf(fmt: str) -> bool:
    _check_fmt(fmt)
    return fmt in ("float8_e5m2", "hifloat8", "bfloat16", "float16")


def max_finite(fmt: str) -> float:
    """Largest finite value of ``fmt`` (int8: 127; HiFloat8: 32768; E8M0: 2^127)."""
    _check_fmt(fmt)
    if fmt == "int8":
        return 127.0
    if fmt == "hifloat8":
        return 32768.0
    return FLOAT_FORMATS[fmt].max_finite


def all_codes(fmt: str) -> np.ndarray:
    """Every code of ``fmt`` in increasing code order, in :func:`encode`'s output dtype
    (256 for the 8-bit formats and int8's two's complement bytes, 16 for float4_e2m1, 65536 for the
    16-bit formats)."""
    return np.arange(1 << code_bits(fmt), dtype=code_dtype(fmt))


def representable_values(fmt: str) -> np.ndarray:
    """The distinct finite values of ``fmt``, ascending, as float64 (-0 folded into 0)."""
    v = decode(all_codes(fmt), fmt)
    v = v[np.isfinite(v)].astype(np.float64)
    return np.unique(v + 0.0)


def midpoints(fmt: str) -> np.ndarray:
    """float64 midpoints between adjacent finite representable values of ``fmt`` (ascending; the
    midpoints next to zero included). Exact: every one is representable in float32 as well."""
    v = representable_values(fmt)
    return (v[:-1] + v[1:]) * 0.5


# ---------------------------------------------------------------------------------------------------
# decode


@lru_cache(maxsize=None)
def _decode_table(fmt: str) -> np.ndarray:
    """float32 value of every code of an 8/4-bit format (built from the format's field formula)."""
    n = 1 << code_bits(fmt)
    out = np.empty(n, np.float64)
    if fmt == "int8":
        out[:] = np.arange(n) - np.where(np.arange(n) >= 128, 256, 0)
    elif fmt == "hifloat8":
        out[:] = _hif8_table()
    else:
        F = FLOAT_FORMATS[fmt]
        mag_bits = F.ebits + F.mbits
        for c in range(n):  # builds a table of <= 256 entries once
            mag = c & ((1 << mag_bits) - 1)
            neg = F.signed and (c >> mag_bits) & 1
            if F.nan == "ieee" and mag > F.inf_code or F.nan == "ones" and mag == F.nan_code:
                val = np.nan
            elif F.has_inf and mag == F.inf_code:
                val = np.inf
            else:
                val = F.value_of(mag)
            out[c] = -val if neg else val
    t = out.astype(np.float32)
    t.setflags(write=False)
    return t


def _hif8_table() -> np.ndarray:
    """The 256 HiFloat8 values (docs/numerics/formats.md#hifloat8), float64."""
    vals = np.empty(256)
    for c in range(128):  # 128 codes, built once
        if c < 8:  # 0000 mmm: zero, denormals 2^(m-23)
            v = 0.0 if c == 0 else 2.0 ** (c - 23)
        else:
            if c >= 0x60:
                ebits, mbits = 4, 1
            elif c >= 0x40:
                ebits, mbits = 3, 2
            elif c >= 0x20:
                ebits, mbits = 2, 3
            elif c >= 0x10:
                ebits, mbits = 1, 3
            else:
                ebits, mbits = 0, 3
            m = c & ((1 << mbits) - 1)
            if ebits == 0:
                e = 0
            else:
                ef = (c >> mbits) & ((1 << ebits) - 1)
                neg_e = ef >> (ebits - 1)
                mag = (1 << (ebits - 1)) | (ef & ((1 << (ebits - 1)) - 1))  # implicit leading 1
                e = -mag if neg_e else mag
            v = 2.0**e * (1 + m / 2.0**mbits)
        vals[c] = v
        vals[c + 128] = -v
    vals[0x6F], vals[0xEF] = np.inf, -np.inf
    vals[0x80] = np.nan
    return vals


_CODE_INPUT_DTYPES = {
    "int8": (np.dtype(np.uint8), np.dtype(np.int8)),
    "float8_e4m3fn": (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8_e5m2": (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e5m2)),
    "hifloat8": (np.dtype(np.uint8),),
    "float4_e2m1": (np.dtype(np.uint8),),
    "float8_e8m0": (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e8m0fnu)),
    "bfloat16": (np.dtype(np.uint16), np.dtype(ml_dtypes.bfloat16)),
    "float16": (np.dtype(np.uint16), np.dtype(np.float16)),
}


def code_input_dtypes(fmt: str) -> tuple[np.dtype, ...]:
    """dtypes :func:`decode` accepts for ``fmt``: the code dtype, plus int8 for "int8" and the
    bit-identical ml_dtypes / NumPy dtype where one exists (e.g. ``ml_dtypes.float8_e4m3fn``)."""
    _check_fmt(fmt)
    return _CODE_INPUT_DTYPES[fmt]


def decode(codes, fmt: str) -> np.ndarray:
    """float32 values of raw ``codes`` of format ``fmt`` (NaN codes -> nan, Inf codes -> +-inf).

    codes: any shape; uint8 (8-bit formats; int8 also for "int8"; float4_e2m1: one code 0..15 per
    byte), uint16 bit patterns for bfloat16/float16; the bit-identical ml_dtypes dtype is accepted too.
    Returns float32 of the same shape. Every value of every format is exact in float32.
    """
    _check_fmt(fmt)
    c = np.asarray(codes)
    if c.dtype not in _CODE_INPUT_DTYPES[fmt]:
        raise InvalidDtype("dtype", "codes", str(c.dtype),
                           f"{fmt} codes must be " + " or ".join(str(d) for d in _CODE_INPUT_DTYPES[fmt]))
    bits = code_bits(fmt)
    if bits == 16:
        c = c.view(np.uint16)
        if fmt == "float16":
            with np.errstate(invalid="ignore"):  # signalling NaN codes
                return c.view(np.float16).astype(np.float32)
        return (c.astype(np.uint32) << 16).view(np.float32)
    c = c.view(np.uint8)
    if bits == 4 and c.size and int(c.max()) > 15:
        raise InvalidArgument("value", "codes", int(c.max()), "float4_e2m1 codes must be in [0, 15]")
    return _decode_table(fmt)[c]


# ---------------------------------------------------------------------------------------------------
# encode helpers


def _float32_bits(x: np.ndarray) -> np.ndarray:
    """uint32 bit patterns of ``x`` narrowed to float32 without changing any later rounding.

    float32 in: a view. float16 / bfloat16: exact widening. float64: round-to-odd narrowing (truncate
    toward zero, then set the last bit when inexact): a later round-to-nearest or directed rounding to
    <= 22 mantissa bits gives the same result as rounding the float64 value directly.
    """
    if x.dtype == np.float32:
        return x.view(_U32)
    if x.dtype != np.float64:
        return x.astype(np.float32).view(_U32)
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(np.float32)
        back = t.astype(np.float64)
        away = np.abs(back) > np.abs(x)  # rounded away from zero (includes finite -> inf)
        inexact = back != x  # NaN compares unequal too: setting the last bit keeps it NaN
    b = t.view(_U32)
    b -= away.astype(_U32)
    b |= inexact.astype(_U32)
    return b


#: dtypes :func:`encode` accepts.
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _as_input(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in INPUT_DTYPES:
        raise InvalidDtype("dtype", "x", str(x.dtype), "must be float32, float64, float16 or bfloat16")
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)  # float16 / bfloat16: exact
    return x


def _chunks(n: int):
    for i in range(0, n, CHUNK):
        yield slice(i, min(i + CHUNK, n))


def _first_bad(x_flat, bad_chunk_mask, sl) -> str:
    i = int(np.flatnonzero(bad_chunk_mask)[0])
    from .._errors import Raw

    return Raw(f"{float(x_flat[sl][i])!r} at flat index {sl.start + i}")


def out_of_range(x, fmt: str, rounding: str | None = None) -> np.ndarray:
    """Boolean mask of the finite elements of ``x`` that round beyond ``fmt``'s finite range
    (what :func:`encode` with ``saturate=False`` rejects for int8 / float4_e2m1, and turns into
    Inf/NaN for the other formats)."""
    _check_fmt(fmt)
    rounding = rounding or default_rounding(fmt)
    x = _as_input(x)
    with np.errstate(invalid="ignore"):
        fin = np.isfinite(x)
        if fmt == "int8":
            r = _round_int(np.where(fin, x, 0).astype(x.dtype), rounding)
            return fin & ((r > 127) | (r < -128))
        if fmt == "float8_e8m0":
            ax = x
        else:
            ax = np.abs(x)
    if fmt == "hifloat8":
        if rounding == "hybrid":  # SSR can also round [32768, 40960) up to the Inf pattern
            codes = encode(np.where(fin, x, 0).astype(x.dtype), fmt, rounding="hybrid")
            return fin & ((codes & np.uint8(0x7F)) == np.uint8(0x6F))
        return fin & (ax >= 40960.0)
    F = FLOAT_FORMATS[fmt]
    xf = np.where(fin, ax, 0).astype(x.dtype).reshape(-1)
    mask = np.zeros(xf.shape, bool)
    for sl in _chunks(xf.size):
        u = _float32_bits(xf[sl])
        if fmt == "float8_e8m0":
            code = _e8m0_core(u, rounding, saturate=True, check=False, raw=True)
        else:
            code = _ieee_magnitude(u, F, rounding)
        mask[sl] = code > F.max_code
    return mask.reshape(x.shape)


def _round_int(x: np.ndarray, rounding: str) -> np.ndarray:
    """Round to integers in x's own float dtype (exact): RINT or ROUND (ties away from zero)."""
    if rounding == "rint":
        return np.rint(x)
    t = np.trunc(x)
    frac = np.abs(x - t)  # exact
    return t + np.copysign((frac >= 0.5).astype(x.dtype), x)


# ---------------------------------------------------------------------------------------------------
# generic IEEE-like core


def _ieee_magnitude(u: np.ndarray, F: FloatFormat, rounding: str) -> np.ndarray:
    """Magnitude code (uint32, unclamped) of float32 bit patterns ``u`` rounded to format ``F``.

    Normal results: round the fp32 pattern to F.mbits mantissa bits with integer arithmetic (a carry
    moves into the exponent by itself), then re-bias the exponent. Subnormal results (|x| < 2^emin):
    add 2^(emin - mbits + 23) in float32 - the sum's ulp is the format's subnormal spacing, so the
    hardware's RNE addition does the rounding - and subtract the magic's bits; ROUND fixes the exact ties.
    Inf/NaN give codes above ``F.max_code`` (the caller maps them).
    """
    a = u & _U32(0x7FFFFFFF)
    s0 = 23 - F.mbits
    half = _U32(1 << (s0 - 1))
    if rounding == "rint":
        code = a >> _U32(s0)
        code &= _U32(1)
        code += a
        code += half - _U32(1)
    else:
        code = a + half
    code >>= _U32(s0)
    rebias = (127 - F.bias) << F.mbits
    if rebias:
        code -= _U32(rebias)  # wraps below the normal range; replaced just below
    if F.emin > -126:  # the format's subnormals lie inside fp32's normal range
        tiny = a < _U32((127 + F.emin) << 23)
        if tiny.any():
            magic_e = F.emin - F.mbits + 23
            magic = np.float32(2.0**magic_e)
            mbits32 = _U32((127 + magic_e) << 23)
            ax = a.view(np.float32)
            f = ax + magic
            sub = f.view(_U32) - mbits32
            if rounding == "round":
                with np.errstate(invalid="ignore"):
                    resid = ax - (f - magic)  # exact; +half spacing = a tie RNE rounded down
                sub += resid == np.float32(2.0 ** (F.emin - F.mbits - 1))
            np.copyto(code, sub, where=tiny)
    return code


def _ieee_encode_chunk(u, F: FloatFormat, rounding: str, saturate: bool, out_dtype, x_flat, sl):
    code = _ieee_magnitude(u, F, rounding)
    maxc = F.max_code
    a_nan = None
    over = code > _U32(maxc)
    if over.any():
        a_nan = (u & _U32(0x7FFFFFFF)) > _U32(0x7F800000)
        if F.nan == "none":
            if a_nan.any():
                raise InvalidArgument("value", "x", _first_bad(x_flat, a_nan, sl),
                                      f"{F.name} has no NaN")
            if not saturate:
                raise InvalidArgument(
                    "value", "x", _first_bad(x_flat, over, sl),
                    f"out of the {F.name} range (max {F.max_finite:g}) and saturate is off")
        np.minimum(code, _U32(maxc if saturate else maxc + 1), out=code)  # +1 = Inf (or E4M3FN NaN)
        if a_nan.any():
            code[a_nan] = F.nan_code
    out = code.astype(out_dtype)
    shift = 32 - F.width
    sign = (u >> _U32(shift)).astype(out_dtype)
    sign &= out_dtype.type(1 << (F.width - 1))
    out |= sign
    return out


# ---------------------------------------------------------------------------------------------------
# E8M0


def _e8m0_core(u, rounding, saturate, check=True, raw=False, x_flat=None, sl=None):
    """E8M0 byte of non-negative float32 patterns ``u``."""
    if check:
        neg = (u > _U32(0x80000000)) & (u <= _U32(0xFF800000))  # negative non-zero, not NaN
        if neg.any():
            raise InvalidArgument("value", "x", _first_bad(x_flat, neg, sl),
                                  "float8_e8m0 has no sign: the value must be >= 0")
    a = u & _U32(0x7FFFFFFF)
    if rounding == "floor":
        code = a >> _U32(23)
    elif rounding == "ceil":
        code = (a >> _U32(23)) + ((a & _U32(0x7FFFFF)) != 0).astype(_U32)
    else:
        if rounding == "rint":
            code = ((a >> _U32(23)) & _U32(1)) + a + _U32((1 << 22) - 1)
        else:
            code = a + _U32(1 << 22)
        code >>= _U32(23)
        # below 2^-126 the choice is 2^-127 (code 0, bits 0x400000) or 2^-126 (code 1): midpoint 0x600000
        tiny = a < _U32(0x800000)
        if tiny.any():
            up = (a > _U32(0x600000)) if rounding == "rint" else (a >= _U32(0x600000))
            np.copyto(code, up.astype(_U32), where=tiny)
    if raw:
        return code
    nan_in = a > _U32(0x7F800000)
    if saturate:
        np.minimum(code, _U32(254), out=code)
    else:
        np.minimum(code, _U32(255), out=code)
    code[nan_in] = 255
    return code.astype(np.uint8)


# ---------------------------------------------------------------------------------------------------
# HiFloat8


def _hif8_encode_tables():
    """Two lookup tables that make HiFloat8 encoding two gathers.

    ADD[bits >> 23] (512 entries: sign + fp32 exponent field ef): half of the dropped part of the
    mantissa for the binade e = ef - 127 (docs/numerics/formats.md#hifloat8 classes: |e| <= 3 keeps 3 mantissa bits, 4..7 keeps
    2, 8..15 keeps 1; -23..-16 are the denormal powers of two (0 bits); e < -23 adds nothing (-> 0);
    e >= 16 rounds to a power of two, which is an overflow anyway). Adding it to the fp32 pattern is
    the TA rounding: a carry moves into the next binade by itself.

    CODE[sat][r >> 20] (4096 entries: sign, exponent field ef2 and the top 3 mantissa bits of the
    *rounded* pattern r): the HiFloat8 code, re-derived from the binade the rounded value landed in
    (its class keeps the top M bits; the bits below are zero or, after a carry, ignored). Binade -23
    (x in [2^-23, 2^-22) that did not carry) also maps to 2^-22 (code 1): the TA midpoint between 0
    and 2^-22 is 2^-23. Overflow (e >= 16, or 1.5*2^15 = the 0x6F pattern) gives 0x6F (+-Inf), or
    0x6E (+-32768) in the saturating table. Zero never carries the sign (single zero 0x00).
    """
    add = np.zeros(256, np.uint32)
    base = np.zeros(256, np.uint8)
    mbits = np.zeros(256, np.int64)
    for ef in range(256):  # 256 binades, built once at import
        e = ef - 127
        if -15 <= e <= 15:
            mag = abs(e)
            if mag >= 8:
                mb, prefix, eb = 1, 0b11, 4
            elif mag >= 4:
                mb, prefix, eb = 2, 0b10, 3
            elif mag >= 2:
                mb, prefix, eb = 3, 0b01, 2
            elif mag == 1:
                mb, prefix, eb = 3, 0b001, 1
            else:
                mb, prefix, eb = 3, 0b0001, 0
            efield = 0 if eb == 0 else (((1 if e < 0 else 0) << (eb - 1)) | (mag - (1 << (eb - 1))))
            base[ef] = ((prefix << eb) | efield) << mb
            mbits[ef] = mb
            add[ef] = 1 << (22 - mb)
        elif -23 <= e <= -16:
            base[ef] = max(e + 23, 1)  # 2^(m-23), m = e + 23; binade -23 -> 2^-22
            add[ef] = 1 << 22
        elif e >= 16:
            base[ef] = 0x6F
            add[ef] = 1 << 22
    idx = np.arange(4096)
    sign, ef2, m3 = idx >> 11, (idx >> 3) & 0xFF, idx & 7
    mag = base[ef2].astype(np.int64) | (m3 >> (3 - mbits[ef2]))
    codes = []
    for sat in (False, True):
        m = np.where(mag == 0x6F, 0x6E, mag) if sat else mag
        c = np.where((sign == 1) & (m != 0), m | 0x80, m).astype(np.uint8)
        c.setflags(write=False)
        codes.append(c)
    add512 = np.concatenate([add, add])
    add512.setflags(write=False)
    return add512, codes[0], codes[1]


_HIF8_ADD, _HIF8_CODE, _HIF8_CODE_SAT = _hif8_encode_tables()


def _hif8_encode_chunk(u, saturate):
    r = u + _HIF8_ADD[u >> _U32(23)]  # TA rounding of the fp32 pattern (sign bit untouched for non-NaN)
    r >>= _U32(20)
    code = (_HIF8_CODE_SAT if saturate else _HIF8_CODE)[r]
    nan_in = (u & _U32(0x7FFFFFFF)) > _U32(0x7F800000)
    if nan_in.any():
        code[nan_in] = 0x80
    return code


#: fp32 exponent field -> mantissa bits HiFloat8 keeps in that binade (0 for the denormal powers of two and
#: outside -23..15)
_HIF8_MBITS = np.array([(1 if 8 <= abs(ef - 127) <= 15 else 2 if 4 <= abs(ef - 127) <= 7 else
                         3 if abs(ef - 127) <= 3 else 0) for ef in range(256)], np.uint32)
_HIF8_MBITS.setflags(write=False)


def _hif8_ssr_chunk(u, saturate):
    """HiFloat8 "hybrid" rounding of fp32 patterns ``u``: TA where the binade |e| <= 3, else "SSR".

    Source: Ascend/op-plugin@517f2e7 ``test/test_custom_ops/test_npu_kv_quant_sparse_flash_attention.py``
    (``cvt_float32_to_hifuint8(x, round_mode="hybrid")``, which generates that test's HiFloat8 keys);
    docs/numerics/formats.md#hybrid-rounding. SSR is stochastic rounding whose random threshold is taken from
    the value itself, so it is deterministic: with f the 23-bit fp32 mantissa field, M the mantissa bits of the
    binade (0 for the denormal powers of two 2^-22..2^-16), q the top M bits of f and R the 23 - M bits below
    them, the magnitude is rounded up to q + 1 (a carry moves to the next binade) iff ``F >= T`` with
    ``F = R >> (9 - M)`` (the top 14 bits of R) and ``T = f & 0x3FFF`` (the low 14 bits of f); in the binade
    2^-23 ``F = (f >> 10) + 2^13`` against the same T decides between 2^-22 and 0. Consequences kept from the
    source: a value already on the grid (R = 0, so F = T = 0) is rounded up one step (16 -> 20), and
    32768 <= |x| < 40960 can round up to the 0x6F (Inf) pattern. |x| >= 40960, Inf, NaN and |x| < 2^-23 are
    handled as in TA.
    """
    ta = _hif8_encode_chunk(u, saturate)
    ef = (u >> _U32(23)) & _U32(0xFF)
    e = ef.astype(np.int64) - 127
    mag = u & _U32(0x7FFFFFFF)
    ssr = (np.abs(e) >= 4) & (e >= -23) & (mag < _U32(0x47200000))  # 0x47200000 = 40960
    if not ssr.any():
        return ta
    uu, ee = u[ssr], e[ssr]
    f = uu & _U32(0x7FFFFF)
    m = _HIF8_MBITS[ef[ssr]]
    drop = _U32(23) - m
    rem = f & ((_U32(1) << drop) - _U32(1))
    big_f = rem >> (drop - _U32(14))
    t = f & _U32(0x3FFF)
    edge = ee == -23
    big_f = np.where(edge, (f >> _U32(10)) + _U32(8192), big_f)
    up = (big_f >= t).astype(_U32)
    r = (uu & ~((_U32(1) << drop) - _U32(1))) + (up << drop)
    sign = uu & _U32(0x80000000)
    r = np.where(edge, np.where(up == 1, sign | _U32(0x34800000), sign), r)  # 2^-22 or zero
    code = (_HIF8_CODE_SAT if saturate else _HIF8_CODE)[r >> _U32(20)]
    out = ta.copy()
    out[ssr] = code
    return out


# ---------------------------------------------------------------------------------------------------
# int8


def _int8_encode(x_flat, rounding, saturate):
    with np.errstate(invalid="ignore"):
        bad_nan = np.isnan(x_flat)
        if bad_nan.any():
            raise InvalidArgument("value", "x", _first_bad(x_flat, bad_nan, slice(0, x_flat.size)),
                                  "int8 has no NaN")
        r = _round_int(x_flat, rounding)
        over = (r > 127) | (r < -128)
    if over.any():
        if not saturate:
            raise InvalidArgument("value", "x", _first_bad(x_flat, over, slice(0, x_flat.size)),
                                  "out of the int8 range [-128, 127] and saturate is off")
        r = np.clip(r, -128, 127)
    return r.astype(np.int8).view(np.uint8)


# ---------------------------------------------------------------------------------------------------
# public API


def _resolve_rounding(fmt: str, rounding: str | None) -> str:
    modes = rounding_modes(fmt)
    if rounding is None:
        return modes[0]
    if rounding not in modes:
        raise InvalidArgument("value", "rounding", rounding, f"{fmt} supports {modes}")
    return rounding


def encode(x, fmt: str, *, saturate: bool = False, rounding: str | None = None) -> np.ndarray:
    """Raw codes of ``x`` rounded to format ``fmt`` (see the module docstring for every format).

    x:        float32 / float64 array (float16 and ml_dtypes.bfloat16 are widened exactly); any shape.
    fmt:      one of :data:`FORMAT_NAMES`.
    saturate: clamp values beyond the largest finite one (Inf included) to +-max finite; otherwise
              +-Inf / NaN where the format has them, an error for int8 and float4_e2m1.
    rounding: "rint" (ties to even) or "round" (ties away); float8_e8m0 also "floor" (its default:
              the byte-extraction rule) and "ceil" (round_scale); hifloat8 also "hybrid" (TA for
              |e| <= 3, the deterministic SSR elsewhere: :func:`_hif8_ssr_chunk`); default per format
              (hifloat8 "round", float8_e8m0 "floor", every other "rint").

    Returns codes of x's shape: uint8 for the 8-bit formats (int8 as its two's complement byte) and
    for float4_e2m1 (one code 0..15 per byte; :func:`pack_fp4` packs pairs), uint16 bit patterns for
    bfloat16 / float16.
    """
    _check_fmt(fmt)
    rounding = _resolve_rounding(fmt, rounding)
    x = _as_input(x)
    shape = x.shape
    xf = x.reshape(-1)
    if fmt == "int8":
        return _int8_encode(xf, rounding, saturate).reshape(shape)
    out_dtype = code_dtype(fmt)
    out = np.empty(xf.size, out_dtype)
    F = FLOAT_FORMATS.get(fmt)
    for sl in _chunks(xf.size):
        u = _float32_bits(xf[sl])
        if fmt == "hifloat8":
            out[sl] = _hif8_ssr_chunk(u, saturate) if rounding == "hybrid" else _hif8_encode_chunk(u, saturate)
        elif fmt == "float8_e8m0":
            out[sl] = _e8m0_core(u, rounding, saturate, x_flat=xf, sl=sl)
        else:
            out[sl] = _ieee_encode_chunk(u, F, rounding, saturate, out_dtype, xf, sl)
    return out.reshape(shape)


def round_to(x, fmt: str, *, saturate: bool = False, rounding: str | None = None) -> np.ndarray:
    """``x`` rounded to ``fmt`` and back, as float32: ``decode(encode(x, fmt, ...), fmt)``."""
    return decode(encode(x, fmt, saturate=saturate, rounding=rounding), fmt)


def pack_fp4(codes, *, nibble_order: str = "low_first") -> np.ndarray:
    """Pack float4_e2m1 codes (uint8, one code 0..15 per element) two per byte along the last axis.

    codes: uint8 ``[..., 2k]`` -> uint8 ``[..., k]``. nibble_order (**OPEN**, docs/numerics/open-facts.md#nibble_order): "low_first"
    (default, best evidence) puts element 2i in the low nibble and 2i+1 in the high one
    (``byte = lo | hi << 4``); "high_first" the reverse.
    """
    c = np.asarray(codes)
    if c.ndim == 0 or c.shape[-1] % 2:
        raise InvalidArgument("shape", "codes", c.shape, "the last axis must have an even length")
    if nibble_order not in NIBBLE_ORDERS:
        raise InvalidArgument("value", "nibble_order", nibble_order, f"must be one of {NIBBLE_ORDERS}")
    c = c.view(np.uint8)
    first, second = c[..., 0::2], c[..., 1::2]
    if nibble_order == "low_first":
        return first | (second << np.uint8(4))
    return second | (first << np.uint8(4))


def unpack_fp4(packed, *, nibble_order: str = "low_first") -> np.ndarray:
    """Inverse of :func:`pack_fp4`: uint8 ``[..., k]`` -> uint8 codes ``[..., 2k]`` (0..15 each)."""
    p = np.asarray(packed)
    if nibble_order not in NIBBLE_ORDERS:
        raise InvalidArgument("value", "nibble_order", nibble_order, f"must be one of {NIBBLE_ORDERS}")
    if p.ndim == 0:
        raise InvalidArgument("dim", "packed", 0, "needs at least one dimension")
    p = p.view(np.uint8)
    lo = p & np.uint8(0x0F)
    hi = p >> np.uint8(4)
    first, second = (lo, hi) if nibble_order == "low_first" else (hi, lo)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2] = first
    out[..., 1::2] = second
    return out
