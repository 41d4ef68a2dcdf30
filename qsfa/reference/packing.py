"""Byte layouts of the quantised caches: packed QSFA rows, FlashMLA's V32 rows, NZ fractal storage.

Packed QSFA row ("combine" mode, quant_scale_repo_mode=1; docs/numerics/layouts.md#packed-qsfa-row), one row per token, KV_N = 1:

====================  =============================  ==============================  ======================
rope_head_dim         NoPE codes                     RoPE (query dtype, raw bits)    scales (fp32, LE)
====================  =============================  ==============================  ======================
64  (656 bytes)       [0, 512)                       [512, 640)                      [640, 656)
0   (528 bytes)       [0, 512)                       -                               [512, 528)
====================  =============================  ==============================  ======================

Width rule: ``kv_lora_rank + rope_head_dim * rope_itemsize + (kv_lora_rank / tile_size) * 4``
(vllm-ascend ``get_sfa_qsfa_packed_head_dim``). NoPE codes are INT8, FP8 E4M3FN or HiFloat8 bytes; the
dequantised value is ``decode(code[j]) * scale[j // tile_size]`` in fp32.

FlashMLA's V32 layout (deepseek-ai/FlashMLA tests/quant.py, ``V32_FP8Sparse``) holds the same pieces in
another order: FP8 NoPE ``[0, 512)``, 4 fp32 scales ``[512, 528)``, 64 bf16 RoPE ``[528, 656)``. The
converters here only move bytes, so they are lossless both ways.

NZ ("FRACTAL_NZ") storage of a paged cache with ``c`` elements per fractal column (16 for 16-bit
caches, 32 for 8-bit caches; docs/numerics/layouts.md#nz):

* N = 1: ``[block_num, D // c, block_size, 1, c]`` (the seed's layout); element ``(blk, pos, d)`` at flat
  offset ``blk*bs*D + (d//c)*bs*c + pos*c + d%c``;
* N > 1: ``[block_num, N, D // c, block_size, c]`` (the cannmirror/ops-transformer golden's layout).

:func:`nz_view` returns a writable, zero-copy view ``[block_num, block_size, N, D // c, c]`` of either
form; :func:`nz_to_nd` / :func:`nd_to_nz` convert to and from the logical ``[block_num, block_size, N, D]``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._errors import InvalidArgument, Raw

__all__ = [
    "SCALE_BYTES",
    "packed_head_dim",
    "row_offsets",
    "pack_rows",
    "unpack_rows",
    "dequant_rows",
    "qsfa_to_flashmla_v32",
    "flashmla_v32_to_qsfa",
    "nz_columns",
    "nz_view",
    "nz_to_nd",
    "nd_to_nz",
]

#: bytes per scale in a packed QSFA row (fp32)
SCALE_BYTES = 4

_ROPE_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def packed_head_dim(kv_lora_rank: int = 512, rope_head_dim: int = 64, tile_size: int = 128,
                    rope_itemsize: int = 2) -> int:
    """Bytes per packed QSFA row: ``r + rope * rope_itemsize + (r / tile) * 4``.

    Raises :class:`qsfa.InvalidArgument` when ``kv_lora_rank % tile_size != 0`` (a row must hold whole
    tiles) or any size is negative. ``packed_head_dim() == 656``; ``packed_head_dim(rope_head_dim=0) == 528``.
    """
    for name, v in (("kv_lora_rank", kv_lora_rank), ("rope_head_dim", rope_head_dim),
                    ("tile_size", tile_size), ("rope_itemsize", rope_itemsize)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise InvalidArgument("value", name, v, "must be a non-negative integer")
    if tile_size == 0 or kv_lora_rank % tile_size != 0:
        raise InvalidArgument("value", "kv_lora_rank", kv_lora_rank,
                              f"must be divisible by tile_size ({tile_size})")
    return int(kv_lora_rank + rope_head_dim * rope_itemsize + (kv_lora_rank // tile_size) * SCALE_BYTES)


def row_offsets(kv_lora_rank: int = 512, rope_head_dim: int = 64, tile_size: int = 128,
                rope_itemsize: int = 2) -> dict:
    """Byte ranges of one packed QSFA row: ``{"nope": (0, r), "rope": (r, r+R), "scales": (r+R, W)}``."""
    width = packed_head_dim(kv_lora_rank, rope_head_dim, tile_size, rope_itemsize)
    r = kv_lora_rank
    rope_end = r + rope_head_dim * rope_itemsize
    return {"nope": (0, r), "rope": (r, rope_end), "scales": (rope_end, width), "width": width}


def _bytes(a: np.ndarray) -> np.ndarray:
    """A uint8 view of ``a`` with the last dimension expanded to bytes (little-endian element bytes)."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.view(np.uint8).reshape(*a.shape[:-1], a.shape[-1] * a.dtype.itemsize)


def _array(x, name: str) -> np.ndarray:
    if x is None or isinstance(x, (str, bytes)):
        raise InvalidArgument("type", name, x, "must be an array")
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise InvalidArgument("type", name, type(x).__name__, f"must be an array ({e})") from None


_CODE_KINDS = ("i", "u", "V", "f")  # int8 / uint8 codes, or ml_dtypes' one-byte floats (kind "V"; e5m2 "f")
_NOPE_FORMATS = ("int8", "float8_e4m3fn", "hifloat8")


def _one_byte_codes(x, name: str) -> np.ndarray:
    a = _array(x, name)
    if a.dtype.itemsize != 1 or a.dtype.kind not in _CODE_KINDS:
        raise InvalidArgument("dtype", name, str(a.dtype),
                              "must be an array of one-byte codes (int8, uint8 or float8_e4m3fn; HiFloat8 as uint8)")
    if a.ndim == 0:  # (a 0-d uint8 array was told "Invalid dtype ..., actual: ()")
        raise InvalidArgument("dim", name, 0, "needs at least one dimension (the bytes of a row)")
    return a


def pack_rows(nope_codes: np.ndarray, rope: np.ndarray | None, scales: np.ndarray, *,
              tile_size: int = 128) -> np.ndarray:
    """Concatenate NoPE codes, RoPE bits and fp32 scales into packed QSFA rows.

    nope_codes: ``[..., r]`` one-byte codes (int8, uint8, float8_e4m3fn; HiFloat8 as uint8), ``r`` a multiple of
                ``tile_size``.
    rope:       ``[..., R]`` float16/bfloat16 (copied bit for bit) or ``None`` (rope_head_dim 0).
    scales:     ``[..., r / tile_size]`` float32, stored little-endian.
    Leading dimensions must agree. Returns uint8 ``[..., r + 2R + 4 * r / tile_size]``; anything else is refused
    with :class:`qsfa.InvalidArgument` naming the parameter.
    """
    nope_codes = _one_byte_codes(nope_codes, "nope_codes")
    if not isinstance(tile_size, (int, np.integer)) or isinstance(tile_size, bool) or tile_size < 1:
        raise InvalidArgument("value", "tile_size", tile_size, "must be a positive integer")
    if nope_codes.shape[-1] % tile_size:
        raise InvalidArgument("shape", "nope_codes", tuple(nope_codes.shape),
                              f"the last dimension must be a whole number of {tile_size}-code tiles (tile_size)")
    lead, n_tiles = nope_codes.shape[:-1], nope_codes.shape[-1] // tile_size
    scales = _array(scales, "scales")
    if scales.dtype != np.float32:
        raise InvalidArgument("dtype", "scales", str(scales.dtype), "must be float32")
    if scales.shape != lead + (n_tiles,):
        raise InvalidArgument("shape", "scales", tuple(scales.shape),
                              f"must be {lead + (n_tiles,)}: nope_codes' leading dimensions and one scale per "
                              f"{tile_size}-code tile")
    parts = [_bytes(nope_codes)]
    if rope is not None:
        rope = _array(rope, "rope")
        if rope.dtype not in _ROPE_DTYPES.values():
            raise InvalidArgument("dtype", "rope", str(rope.dtype), "must be float16 or bfloat16 (or None)")
        if rope.ndim != nope_codes.ndim or rope.shape[:-1] != lead:
            raise InvalidArgument("shape", "rope", tuple(rope.shape),
                                  f"the leading dimensions must be nope_codes' {lead}")
        if rope.shape[-1]:
            parts.append(_bytes(rope))
    parts.append(_bytes(scales.astype("<f4")))
    return np.concatenate(parts, axis=-1)


def unpack_rows(rows: np.ndarray, *, kv_lora_rank: int = 512, rope_head_dim: int = 64, tile_size: int = 128,
                rope_dtype: str = "bfloat16"):
    """Split packed QSFA rows ``[..., W]`` (one-byte elements: uint8, int8 or float8_e4m3fn) into ``(nope uint8
    [..., r], rope [..., R] of rope_dtype or None when R = 0, scales float32 [..., r / tile])``. Exact inverse of
    :func:`pack_rows` on the bytes.
    """
    rows = _one_byte_codes(rows, "rows")
    if rope_dtype not in _ROPE_DTYPES:
        raise InvalidArgument("value", "rope_dtype", rope_dtype, "must be 'bfloat16' or 'float16'")
    off = row_offsets(kv_lora_rank, rope_head_dim, tile_size, 2)
    if rows.shape[-1] != off["width"]:
        raise InvalidArgument("shape", "rows", tuple(rows.shape),
                              f"last dimension must be {off['width']} bytes for kv_lora_rank={kv_lora_rank}, "
                              f"rope_head_dim={rope_head_dim}, tile_size={tile_size}")
    b = np.ascontiguousarray(rows).view(np.uint8)
    nope = b[..., off["nope"][0]:off["nope"][1]].copy()
    rope = None
    if rope_head_dim:
        rope = np.ascontiguousarray(b[..., off["rope"][0]:off["rope"][1]]).view(_ROPE_DTYPES[rope_dtype])
    scales = np.ascontiguousarray(b[..., off["scales"][0]:off["scales"][1]]).view("<f4").astype(np.float32)
    return nope, rope, scales


def dequant_rows(rows: np.ndarray, *, nope_format: str = "int8", kv_lora_rank: int = 512,
                 rope_head_dim: int = 64, tile_size: int = 128, rope_dtype: str = "bfloat16",
                 allow_nonfinite: bool = False):
    """Dequantise packed QSFA rows to float32.

    Returns ``(k_nope float32 [..., r], k_rope float32 [..., R] or None)`` with
    ``k_nope[j] = decode(code[j], nope_format) * scale[j // tile_size]`` (one fp32 multiply) and the RoPE
    widened exactly from its 16-bit dtype. ``nope_format``: "int8", "float8_e4m3fn" or "hifloat8".
    A non-finite scale, RoPE value or code (a corrupt or poisoned row) is refused with its position, unless
    ``allow_nonfinite=True`` (then it dequantises to inf / NaN, as the bytes say).
    """
    from . import formats

    if nope_format not in _NOPE_FORMATS:
        raise InvalidArgument("value", "nope_format", nope_format, f"must be one of {list(_NOPE_FORMATS)}")
    nope, rope, scales = unpack_rows(rows, kv_lora_rank=kv_lora_rank, rope_head_dim=rope_head_dim,
                                     tile_size=tile_size, rope_dtype=rope_dtype)
    if nope_format == "int8":
        vals = nope.view(np.int8).astype(np.float32)
    else:
        vals = np.asarray(formats.decode(nope, nope_format), dtype=np.float32)
    k_rope = None if rope is None else rope.astype(np.float32)
    if not allow_nonfinite:
        for what, arr in (("scales", scales), ("NoPE codes", vals), ("RoPE", k_rope)):
            if arr is not None and not np.isfinite(arr).all():
                pos = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
                raise InvalidArgument("value", "rows", Raw(f"{float(arr[pos])} in the {what} at {pos}"),
                                      "packed rows must hold finite scales, codes and RoPE values "
                                      "(allow_nonfinite=True dequantises them as they are)")
    tiles = kv_lora_rank // tile_size
    with np.errstate(invalid="ignore", over="ignore"):
        k_nope = (vals.reshape(*vals.shape[:-1], tiles, tile_size) * scales[..., :, None]).reshape(vals.shape)
    return k_nope.astype(np.float32, copy=False), k_rope


def _v32_sizes(rows: np.ndarray, kv_lora_rank: int, tile_size: int, rope_head_dim: int):
    width = packed_head_dim(kv_lora_rank, rope_head_dim, tile_size, 2)
    rows = np.asarray(rows)
    if rows.dtype.itemsize != 1:
        raise InvalidArgument("dtype", "rows", str(rows.dtype), "packed rows are one-byte elements")
    if rows.ndim == 0:  # (was an IndexError from rows.shape[-1])
        raise InvalidArgument("dim", "rows", 0, "needs at least one dimension (the bytes of a row)")
    if rows.shape[-1] != width:
        raise InvalidArgument("shape", "rows", tuple(rows.shape), f"last dimension must be {width} bytes")
    return kv_lora_rank, rope_head_dim * 2, (kv_lora_rank // tile_size) * SCALE_BYTES


def qsfa_to_flashmla_v32(rows: np.ndarray, *, kv_lora_rank: int = 512, rope_head_dim: int = 64,
                         tile_size: int = 128) -> np.ndarray:
    """Reorder packed QSFA rows ``[..., 656]`` (NoPE | RoPE | scales) into FlashMLA V32 order
    (NoPE | scales | RoPE). Bytes are moved, never re-encoded; the dtype of ``rows`` is kept."""
    n, r, s = _v32_sizes(rows, kv_lora_rank, tile_size, rope_head_dim)
    rows = np.asarray(rows)
    return np.concatenate([rows[..., :n], rows[..., n + r:n + r + s], rows[..., n:n + r]], axis=-1)


def flashmla_v32_to_qsfa(rows: np.ndarray, *, kv_lora_rank: int = 512, rope_head_dim: int = 64,
                         tile_size: int = 128) -> np.ndarray:
    """Inverse of :func:`qsfa_to_flashmla_v32`: FlashMLA V32 rows (NoPE | scales | RoPE) to packed QSFA
    rows (NoPE | RoPE | scales)."""
    n, r, s = _v32_sizes(rows, kv_lora_rank, tile_size, rope_head_dim)
    rows = np.asarray(rows)
    return np.concatenate([rows[..., :n], rows[..., n + s:n + s + r], rows[..., n:n + s]], axis=-1)


# ----------------------------------------------------------------------------------------------------
# NZ fractal storage


def nz_columns(dtype) -> int:
    """Elements per NZ fractal column for a cache dtype: 32 for one-byte caches, 16 for two-byte ones."""
    size = np.dtype(dtype).itemsize
    if size == 1:
        return 32
    if size == 2:
        return 16
    raise ValueError(f"no NZ layout for {size}-byte elements")


def _nz_axes(nz: np.ndarray):
    """``(n_heads_first, block_num, N, D1, block_size, c)`` of a 5-D NZ array (see module docstring)."""
    if nz.ndim != 5:
        raise InvalidArgument("dim", "cache", nz.ndim, "an NZ cache has 5 dimensions")
    if nz.shape[3] == 1:  # [block_num, D//c, block_size, 1, c]
        return False, nz.shape[0], 1, nz.shape[1], nz.shape[2], nz.shape[4]
    return True, nz.shape[0], nz.shape[1], nz.shape[2], nz.shape[3], nz.shape[4]


def nz_view(nz: np.ndarray) -> np.ndarray:
    """A writable zero-copy view ``[block_num, block_size, N, D // c, c]`` of an NZ cache.

    Accepts ``[block_num, D//c, block_size, 1, c]`` (N = 1) and ``[block_num, N, D//c, block_size, c]``.
    Writing ``view[blk, pos, n, d // c, d % c]`` writes logical element ``(blk, pos, n, d)`` in place.
    """
    heads_first, *_ = _nz_axes(nz)
    if heads_first:
        return nz.transpose(0, 3, 1, 2, 4)
    return nz.transpose(0, 2, 3, 1, 4)


def nz_to_nd(nz: np.ndarray) -> np.ndarray:
    """The logical contents ``[block_num, block_size, N, D]`` (a new contiguous array) of an NZ cache."""
    v = nz_view(nz)
    return np.ascontiguousarray(v).reshape(*v.shape[:3], v.shape[3] * v.shape[4])


def nd_to_nz(nd: np.ndarray, c: int | None = None) -> np.ndarray:
    """NZ storage of a logical cache ``[block_num, block_size, N, D]`` (a new contiguous array).

    ``c`` defaults to :func:`nz_columns` of the dtype; ``D % c`` must be 0. N = 1 gives
    ``[block_num, D//c, block_size, 1, c]``; N > 1 gives ``[block_num, N, D//c, block_size, c]``.
    """
    nd = np.asarray(nd)
    if nd.ndim != 4:
        raise InvalidArgument("dim", "nd", nd.ndim, "a logical cache has 4 dimensions [block_num, block_size, N, D]")
    c = nz_columns(nd.dtype) if c is None else int(c)
    bn, bs, n, d = nd.shape
    if d % c:
        raise InvalidArgument("shape", "nd", tuple(nd.shape), f"the last dimension must be a multiple of {c}")
    x = nd.reshape(bn, bs, n, d // c, c)
    if n == 1:
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2, 4))  # [bn, D1, bs, 1, c]
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1, 4))  # [bn, N, D1, bs, c]
