"""Dynamic block quantisation (``npu_dynamic_block_quant``, docs/numerics/quantisers.md#dynamic_block_quant) and the int8 per-tile rule.

Per block (``row_block_size x col_block_size`` elements of the last two dimensions; edge blocks are
partial and take the amax over the elements that exist)::

    amax  = max |x|                                  (fp32; inf/nan excluded, see below)
    scale = amax / TYPE_MAX                          (fp32 division)
    scale = min(scale, 1 / min_scale)                (only when min_scale > 0; 1/min_scale in fp32)
    y     = cast(clamp(x / scale, -TYPE_MAX_FINITE, +TYPE_MAX_FINITE))   (fp32 division, then encode)

TYPE_MAX: INT8 127, FP8 E4M3FN 448, FP8 E5M2 57344, HiFloat8 32768, or ``dst_type_max`` when it is
non-zero (torch_npu: only for HiFloat8 destinations, values 15, 56, 224, 32768; it replaces HiF8_MAX in
the scale). The clamp is to the destination's own largest finite value (127 for INT8, so INT8 codes lie
in [-127, 127]); the cast rounds with ``round_mode`` ("rint" = half to even, "round" = half away from
zero) and saturates.

Special values, as in the CANN golden of DynamicBlockQuant (cann ops-nn quant/dynamic_block_quant
tests): inf/nan do not enter the amax; +-inf quantise to +-TYPE_MAX_FINITE and nan to 0. An all-zero
block has scale 0 and codes 0 (0/0 is treated as 0).

``scale_order`` - the order of the scale arithmetic, per chip (docs/numerics/chips.md#dynamic_block_quant):

* ``"divide"`` (default here; the Ascend 950 kernel and the aclnn doc): ``scale = amax / TYPE_MAX``,
  ``y = x / scale`` (fp32 divides);
* ``"reciprocal"`` (the A2/A3 kernel): ``y = x * fp32(fp32(1 / amax) * TYPE_MAX)`` (a reciprocal, then a
  multiply: two roundings) and ``scale = amax * fp32(1 / TYPE_MAX)``; with ``min_scale`` the multiplier is
  ``max(m, min_scale)`` and the scale ``min(scale, fp32(1 / min_scale))``;
* ``"reciprocal_multiply"``: the A2/A3 kernel's multiplier with the correctly rounded ``scale = amax / TYPE_MAX``
  - the op-plugin test golden (test/test_custom_ops/test_npu_dynamic_block_quant.py ``calc_base``) bit for bit:
  torch evaluates ``127.0 / x_amax`` as ``reciprocal(x_amax) * 127`` and ``x_amax / 127.0`` as one division;
* ``"multiply"``: ``y = x * fp32(TYPE_MAX / amax)`` (one correctly rounded division), ``scale = amax / TYPE_MAX``;
  only defined when ``min_scale == 0``.

The public operator's ``scale_order=None`` takes the chip's order (qsfa.chips.DYNAMIC_BLOCK_QUANT_ORDER).

The scale arithmetic is :func:`qsfa.reference.scales.dynamic_block_scale`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .scales import dynamic_block_scale

__all__ = ["TYPE_MAX", "FINITE_MAX", "SCALE_ORDERS", "dynamic_block_quant", "int8_tile_quant", "block_amax"]

#: the quantisation orders (module docstring): the 950 kernel's, the A2/A3 kernel's, the op-plugin test golden's, and
#: one correctly rounded multiplier
SCALE_ORDERS = ("divide", "reciprocal", "reciprocal_multiply", "multiply")

#: TYPE_MAX of the scale rule per destination format
TYPE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "hifloat8": 32768.0}
#: largest finite value of each destination (the clamp before the cast)
FINITE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "hifloat8": 32768.0}

_OUT_DTYPES = {
    "int8": np.dtype(np.int8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "hifloat8": np.dtype(np.uint8),
}


def block_amax(a: np.ndarray, row_block_size: int, col_block_size: int) -> np.ndarray:
    """Max over ``row x col`` blocks of the last two dims of a non-negative fp32 array ``[B, M, N]``.

    Partial edge blocks are padded with zeros (which cannot raise a max of absolute values).
    Returns ``[B, ceil(M/rb), ceil(N/cb)]``.
    """
    b, m, n = a.shape
    mb, nb = -(-m // row_block_size), -(-n // col_block_size)
    pm, pn = mb * row_block_size - m, nb * col_block_size - n
    if pm or pn:
        a = np.pad(a, ((0, 0), (0, pm), (0, pn)))
    return a.reshape(b, mb, row_block_size, nb, col_block_size).max(axis=(2, 4))


def _expand(s: np.ndarray, m: int, n: int, rb: int, cb: int) -> np.ndarray:
    """Broadcast a per-block array ``[B, Mb, Nb]`` back to elements ``[B, M, N]`` (general path only)."""
    b, mb, nb = s.shape
    full = np.broadcast_to(s[:, :, None, :, None], (b, mb, rb, nb, cb)).reshape(b, mb * rb, nb * cb)
    return full[:, :m, :n]


def _cast(y: np.ndarray, dst_type: str, round_mode: str) -> np.ndarray:
    """Encode clamped fp32 values ``y`` (finite, |y| <= FINITE_MAX) to ``dst_type`` codes/values."""
    if dst_type == "int8":
        r = np.rint(y) if round_mode == "rint" else np.sign(y) * np.floor(np.abs(y) + np.float32(0.5))
        return np.clip(r, -127, 127).astype(np.int8)
    from . import formats

    codes = np.asarray(formats.encode(y, dst_type, saturate=True, rounding=round_mode), dtype=np.uint8)
    return codes.view(_OUT_DTYPES[dst_type])


def dynamic_block_quant(x: np.ndarray, *, min_scale: float = 0.0, round_mode: str = "rint",
                        dst_type: str = "int8", row_block_size: int = 1, col_block_size: int = 128,
                        dst_type_max: float = 0.0, scale_order: str = "divide"):
    """Block-wise dynamic quantisation (see the module docstring for the exact rule).

    x:        ``[M, N]`` or ``[B, M, N]`` float16 / bfloat16 / float32.
    dst_type: "int8", "float8_e4m3fn", "float8_e5m2" or "hifloat8" (a name; the operator front door
              also maps torch_npu's integer codes).
    Returns ``(y, scale)``: ``y`` has x's shape and is int8, ml_dtypes float8_e4m3fn / float8_e5m2, or
    uint8 HiFloat8 codes; ``scale`` is float32 ``[(B,) ceil(M/rb), ceil(N/cb)]``.

    Speed (issue 15): blocks that tile x exactly are quantised a few hundred KiB of rows at a time (each
    chunk widened to float32 in one reused buffer and worked on in place while it is in cache; no per-element
    expansion of the scales); the inf / nan handling runs only when x holds inf or nan (then the general path
    below, which also serves partial edge blocks).
    """
    x = np.asarray(x)
    two_d = x.ndim == 2
    if scale_order not in SCALE_ORDERS:
        raise ValueError(f"unknown scale_order {scale_order!r}")
    assert scale_order != "multiply" or not min_scale, "scale_order='multiply' needs min_scale == 0"
    x3 = x[None] if two_d else x
    b, m, n = x3.shape
    # a block at least as large as the matrix is the whole matrix: clamping gives the same blocks and keeps
    # a huge declared block size (2**40) from padding to its size
    rb, cb = min(int(row_block_size), max(m, 1)), min(int(col_block_size), max(n, 1))
    type_max = np.float32(dst_type_max if dst_type_max else TYPE_MAX[dst_type])
    finite_max = np.float32(FINITE_MAX[dst_type])
    q = scale = None
    if m % rb == 0 and n % cb == 0 and x3.size:
        q, scale = _quant_tiled(x3, rb, cb, type_max, finite_max, min_scale, dst_type, round_mode, scale_order)
    if q is None:
        q, scale = _quant_general(x3.astype(np.float32), rb, cb, type_max, finite_max, min_scale, dst_type,
                                  round_mode, scale_order)
    if two_d:
        q, scale = q[0], scale[0]
    return q, scale


def _scale_and_multiplier(amax, type_max, min_scale, scale_order):
    """``(scale, multiplier)`` per block for ``scale_order`` (module docstring); multiplier None = divide by scale.
    The multiplier of an all-zero block is inf (callers map its 0 * inf to code 0)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if scale_order == "divide":
            return np.asarray(dynamic_block_scale(amax, type_max, min_scale), dtype=np.float32), None
        if scale_order == "multiply":
            return (np.asarray(dynamic_block_scale(amax, type_max, min_scale), dtype=np.float32),
                    (type_max / amax).astype(np.float32))
        mult = ((np.float32(1) / amax).astype(np.float32) * type_max).astype(np.float32)  # two fp32 roundings
        if min_scale:
            mult = np.maximum(mult, np.float32(min_scale))
        if scale_order == "reciprocal_multiply":
            return np.asarray(dynamic_block_scale(amax, type_max, min_scale), dtype=np.float32), mult
        scale = (amax * (np.float32(1) / type_max)).astype(np.float32)
        if min_scale:
            scale = np.minimum(scale, np.float32(1) / np.float32(min_scale))
        return scale, mult


#: float32 elements quantised per chunk on the tiled path (two such buffers: 1 MiB, within a core's L2 cache)
_CHUNK_ELEMS = 1 << 17


def _quant_tiled(x, rb, cb, type_max, finite_max, min_scale, dst_type, round_mode, scale_order):
    """Blocks that tile ``x [B, M, N]`` (any float dtype, not modified) exactly, finite values: ``(q, scale)``;
    ``(None, None)`` when x holds inf / nan (the caller then takes the general path). Works on chunks of whole
    row groups (``rb`` rows each); every block lies in one chunk, so the bytes are those of one whole-array pass."""
    b, m, n = x.shape
    g, nb = b * (m // rb), n // cb
    xg = x.reshape(g, rb, n)
    q = np.empty((g, rb, n), _OUT_DTYPES[dst_type])
    scale = np.empty((g, nb), np.float32)
    step = max(1, _CHUNK_ELEMS // (rb * n))
    buf = np.empty((min(step, g), rb, nb, cb), np.float32)
    absb = np.empty_like(buf)
    for s0 in range(0, g, step):
        c = min(step, g - s0)
        blocks, a = buf[:c], absb[:c]
        np.copyto(blocks.reshape(c, rb, n), xg[s0:s0 + c])  # widened to float32 (exact)
        np.abs(blocks, out=a)
        amax = a.max(axis=3)  # [c, rb, nb]; nan propagates; +0 for zeros
        amax = amax.max(axis=1) if rb > 1 else amax[:, 0]
        if not np.isfinite(amax).all():
            return None, None
        sc, mult = _scale_and_multiplier(amax, type_max, min_scale, scale_order)
        scale[s0:s0 + c] = sc
        zero = amax == 0  # all-zero blocks: 0 / 0 (0 * inf) -> code 0 (the only nan a finite x can produce here)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if mult is None:
                np.divide(blocks, sc[:, None, :, None], out=blocks)
            else:
                np.multiply(blocks, mult[:, None, :, None], out=blocks)
        if zero.any():
            np.copyto(blocks, np.float32(0), where=zero[:, None, :, None])
        _cast_into(q[s0:s0 + c], blocks.reshape(c, rb, n), dst_type, round_mode, finite_max)
    return q.reshape(b, m, n), scale.reshape(b, m // rb, nb)


def _cast_into(out, y, dst_type, round_mode, finite_max):
    """``out[...] = _cast(clip(y, +-finite_max))`` for nan-free fp32 ``y`` (overwritten). For int8 one clip after
    the rounding (rint and round-half-away are monotonic and fix the integer bounds, so clip-round-clip equals
    round-clip), then the float32 -> int8 conversion of ``astype``."""
    if dst_type == "int8":
        if round_mode == "rint":
            np.rint(y, out=y)
        else:
            y = np.sign(y) * np.floor(np.abs(y) + np.float32(0.5))
        np.clip(y, np.float32(-127), np.float32(127), out=y)
        np.copyto(out, y, casting="unsafe")
        return
    np.clip(y, -finite_max, finite_max, out=y)
    out[...] = _cast(y, dst_type, round_mode)


def _quant_general(xf, rb, cb, type_max, finite_max, min_scale, dst_type, round_mode, scale_order):
    """Any block shape (partial edge blocks) and inf / nan inputs."""
    b, m, n = xf.shape
    finite = np.isfinite(xf)
    amax = block_amax(np.where(finite, np.abs(xf), np.float32(0)), rb, cb).astype(np.float32)
    scale, mult = _scale_and_multiplier(amax, type_max, min_scale, scale_order)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # 0/0 and x/0 are handled below
        if mult is None:
            y = xf / _expand(scale, m, n, rb, cb)
        else:
            y = xf * _expand(mult, m, n, rb, cb)
    y = np.where(np.isnan(y), np.float32(0), y)  # nan inputs and 0/0 -> 0
    y = np.clip(y, -finite_max, finite_max).astype(np.float32)  # +-inf -> +-max
    return _cast(y, dst_type, round_mode), scale


def int8_tile_quant(x: np.ndarray, tile_size: int = 128, scale_order: str = "divide"):
    """The int8 dynamic rule of docs/numerics/quantisers.md#int8-dynamic over 1 x ``tile_size`` tiles of the last dimension.

    ``s = amax / 127`` (fp32), ``q = clamp(RINT(x / s), -127, 127)``; an all-zero tile gives ``s = 0`` and
    ``q = 0`` (qsfa's definition; OPEN on hardware). ``x``: ``[..., D]`` with ``D % tile_size == 0``.
    Returns ``(q int8 [..., D], s float32 [..., D / tile_size])``.
    """
    x = np.asarray(x)
    lead, d = x.shape[:-1], x.shape[-1]
    q, s = dynamic_block_quant(x.reshape(-1, 1, d), dst_type="int8", row_block_size=1,
                               col_block_size=tile_size, scale_order=scale_order)
    return q.reshape(*lead, d), s.reshape(*lead, d // tile_size)
