"""Named input generators: ``generator(params, rng) -> {input name: array}``.

A generator turns a case's JSON parameters and a seeded ``numpy.random.Generator`` into the operator's
input arrays. The values are realistic rather than adversarial: randn-scaled activations rounded to the
input dtype, valid sparse indices with -1 padding and causal validity, block tables that are random
permutations of pages, slot mappings with -1 entries, and caches prefilled with the sentinel byte 0x11
(17) so that a kernel writing where it must not shows up as a byte difference.

Only the arrays come from here; scalar operator arguments are case ``params`` (see
:mod:`qsfa.golden.case`). Register new generators with :func:`register_generator`.
"""

from __future__ import annotations

import inspect
from typing import Callable

import ml_dtypes
import numpy as np

from .io import GoldenInputError

__all__ = [
    "SENTINEL",
    "register_generator",
    "get_generator",
    "generator_names",
    "randn",
    "sentinel_filled",
    "slot_mapping",
    "page_table",
    "causal_sparse_indices",
]

#: the byte every cache starts with, so untouched bytes are checked
SENTINEL = 0x11

Generator = Callable[[dict, np.random.Generator], dict]
_GENERATORS: dict[str, Generator] = {}


def register_generator(name: str, fn: Generator | None = None, *, replace: bool = False):
    """Register ``fn`` under ``name`` (usable as a decorator)."""

    def deco(f):
        if name in _GENERATORS and not replace:
            raise ValueError(f"generator {name!r} is already registered")
        _GENERATORS[name] = f
        return f

    return deco(fn) if fn is not None else deco


def get_generator(name: str) -> Generator:
    try:
        return _GENERATORS[name]
    except KeyError:
        raise GoldenInputError(f"unknown input generator {name!r}; known: {', '.join(sorted(_GENERATORS))}") from None


def generator_names() -> list[str]:
    return sorted(_GENERATORS)


# --------------------------------------------------------------------------------------------------
# building blocks

_FLOAT_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}


def float_dtype(name: str) -> np.dtype:
    try:
        return _FLOAT_DTYPES[name]
    except KeyError:
        raise GoldenInputError(f"unsupported float dtype {name!r}; one of {sorted(_FLOAT_DTYPES)}") from None


def randn(rng: np.random.Generator, shape, dtype: str = "float32", scale: float = 1.0) -> np.ndarray:
    """``scale * N(0, 1)`` in fp32, rounded (RNE) to ``dtype``."""
    x = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)
    return x.astype(float_dtype(dtype))


def sentinel_filled(shape, dtype) -> np.ndarray:
    """An array of ``dtype`` whose every byte is :data:`SENTINEL`."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    return np.full(n * dt.itemsize, SENTINEL, np.uint8).view(dt).reshape(shape)


def slot_mapping(rng: np.random.Generator, n: int, num_slots: int, skip: int = 0, dtype="int64") -> np.ndarray:
    """``n`` distinct slots drawn from ``[0, num_slots)``, ``skip`` of them replaced by -1."""
    if n - skip > num_slots:
        raise GoldenInputError(f"{n - skip} written slots do not fit in {num_slots} cache slots")
    s = rng.permutation(num_slots)[:n].astype(np.int64)
    if skip:
        s[rng.permutation(n)[:skip]] = -1
    return s.astype(dtype)


def page_table(rng: np.random.Generator, kv_lens, block_size: int, width: int | None = None,
               num_blocks: int | None = None) -> tuple[np.ndarray, int]:
    """A block table ``[B, width]`` (int32) mapping each sequence's logical pages to physical pages.

    The pages needed (``ceil(len / block_size)`` per sequence) are a random permutation of
    ``[0, num_blocks)``; unused entries are -1. Returns ``(table, num_blocks)``.
    """
    kv_lens = np.asarray(kv_lens, np.int64)
    pages = -(-kv_lens // block_size)
    need = int(pages.sum())
    num_blocks = need if num_blocks is None else int(num_blocks)
    if num_blocks < need:
        raise GoldenInputError(f"{need} pages needed but only {num_blocks} blocks")
    width = int(pages.max()) if width is None else int(width)
    perm = rng.permutation(num_blocks)[:need].astype(np.int32)
    table = np.full((kv_lens.size, width), -1, np.int32)
    col = np.arange(width)[None, :]
    used = col < pages[:, None]
    table[used] = perm
    return table, num_blocks


def causal_sparse_indices(rng: np.random.Generator, q_lens, kv_lens, q_rows: int, width: int,
                          sparse_block_size: int = 1, sparse_mode: int = 3) -> np.ndarray:
    """Sparse indices ``[B, q_rows, width]`` (int32) for every query row of every batch.

    Row ``i < q_lens[b]`` may select blocks of ``sparse_block_size`` tokens below its threshold
    (``kv - q + i + 1`` under sparse_mode 3, ``kv`` under 0): ``min(width, ceil(threshold / sbs))``
    distinct blocks in random order, always including the boundary block (the last, possibly partial
    one); the rest of the row is -1. Rows past ``q_lens[b]`` and rows with no visible token are all -1.
    """
    q_lens = np.asarray(q_lens, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    i = np.arange(q_rows)[None, :]
    if sparse_mode == 3:
        thr = kv_lens[:, None] - q_lens[:, None] + i + 1
    else:
        thr = np.broadcast_to(kv_lens[:, None], (q_lens.size, q_rows))
    thr = np.where(i < q_lens[:, None], np.maximum(thr, 0), 0)
    avail = -(-thr // sparse_block_size)  # blocks that hold a visible token
    count = np.minimum(avail, width)
    a_max = max(int(avail.max()), 1)
    # random order of the non-boundary blocks 0 .. avail-2 (others sort last)
    keys = rng.random((q_lens.size, q_rows, a_max))
    blk = np.arange(a_max)
    keys = np.where(blk < (avail - 1)[..., None], keys, np.inf)
    order = np.argsort(keys, axis=-1, kind="stable")[..., :width].astype(np.int64)
    if order.shape[-1] < width:
        order = np.concatenate([order, np.zeros(order.shape[:-1] + (width - order.shape[-1],), np.int64)], -1)
    slot = np.arange(width)
    out = np.where(slot < (count - 1)[..., None], order, -1)
    out = np.where(slot == (count - 1)[..., None], (avail - 1)[..., None], out)
    return out.astype(np.int32)


# --------------------------------------------------------------------------------------------------
# any operator: its contract's example


@register_generator("example")
def gen_example(params, rng):
    """The array arguments of ``qsfa.operators()[params["example_of"]].contract.example(rng)`` (its scalar
    arguments belong in the case params; :func:`qsfa.golden.catalogue.example_case` copies them there)."""
    from .._dispatch import operators

    args = operators()[params["example_of"]].contract.example(rng)
    return {k: v for k, v in args.items() if isinstance(v, np.ndarray)}


# --------------------------------------------------------------------------------------------------
# number formats (qsfa.formats.encode / decode)


def _formats():
    from ..reference import formats

    return formats


@register_generator("format_codes")
def format_codes(params, rng):
    """Every code of ``params["fmt"]`` in code order (decode cases)."""
    F = _formats()
    return {"codes": F.all_codes(params["fmt"])}


@register_generator("format_values")
def format_values(params, rng):
    """Encode input for ``params["fmt"]``: every finite representable value and every midpoint between
    neighbours, both signs, as float32 (``"overflow": true`` adds +-2*max and +-inf, for saturating
    cases). float8_e8m0 has no sign, so only non-negative values."""
    F = _formats()
    fmt = params["fmt"]
    v = np.concatenate([F.representable_values(fmt), F.midpoints(fmt)])
    if params.get("overflow"):
        m = float(F.max_finite(fmt))
        v = np.concatenate([v, [2.0 * m, np.inf]])
    signed = fmt != "float8_e8m0"
    if signed:
        v = np.concatenate([v, -v])
    with np.errstate(over="ignore"):  # E8M0's 2*max is beyond float32: inf, like the inf added anyway
        x = np.unique(v).astype(np.float32)
    if signed:
        x = np.concatenate([x, np.array([-0.0], np.float32)])
    if not params.get("saturate") and not (F.has_inf(fmt) or F.has_nan(fmt)):
        # no Inf/NaN to overflow into (int8, E2M1): drop what rounds out of range (e.g. int8 127.5)
        x = x[~F.out_of_range(x, fmt, params.get("rounding"))]
    return {"x": x}


# --------------------------------------------------------------------------------------------------
# dynamic block quant


@register_generator("dynamic_block_quant")
def gen_dynamic_block_quant(params, rng):
    """x ``[M, N]`` (or ``[B, M, N]`` with ``B``) in ``x_dtype``, randn * ``scale``; ``zero_block``
    zeroes the first block (scale 0 path); ``outliers`` puts a few large values in."""
    shape = ((params["B"],) if params.get("B") else ()) + (params["M"], params["N"])
    x = randn(rng, shape, "float32", params.get("scale", 1.0))
    if params.get("outliers"):
        flat = x.reshape(-1)
        pos = rng.permutation(flat.size)[: max(1, flat.size // 97)]
        flat[pos] *= np.float32(40.0)
    if params.get("zero_block"):
        x[..., : params.get("row_block_size", 1), : params.get("col_block_size", 128)] = 0
    return {"x": x.astype(float_dtype(params.get("x_dtype", "bfloat16")))}


# --------------------------------------------------------------------------------------------------
# KvCompressEpilog (docs/numerics/cache-writers.md#kv_compress_epilog)


@register_generator("kv_compress_epilog")
def gen_kv_compress_epilog(params, rng):
    """x bf16 ``[*lead, d]`` (``lead`` defaults to ``[bs]``) randn * ``scale``; cache uint8
    ``[block_num, block_size, 1, head_dim]`` of sentinel bytes, ``head_dim`` = kvCacheCol +
    ``tail`` (untouched bytes after the written row); ``skip`` slots are -1; ``zero_groups`` zeroes
    the first NoPE group of the first token and the whole NoPE of the last token."""
    d = int(params["d"])
    lead = tuple(params.get("lead") or (params["bs"],))
    mode = int(params.get("quant_mode", 1))
    gs = int(params.get("quant_group_size", 64))
    from ..reference.kv_compress_epilog import kv_cache_col

    col = kv_cache_col(d, mode, gs, int(params.get("pad_to", 32)))
    head_dim = col + int(params.get("tail", 32))
    n_tok = int(np.prod(lead))
    x = randn(rng, lead + (d,), "float32", params.get("scale", 1.0))
    if params.get("outliers"):
        xf = x.reshape(n_tok, d)
        xf[:, rng.integers(0, d - 64, size=1)] *= np.float32(30.0)
    if params.get("zero_groups"):
        xf = x.reshape(n_tok, d)
        xf[0, :gs if mode == 2 else 64] = 0
        xf[-1, : d - 64] = 0
    block_size = int(params.get("block_size", 16))
    block_num = int(params.get("block_num", -(-2 * n_tok // block_size)))
    slots = slot_mapping(rng, n_tok, block_num * block_size, int(params.get("skip", 0)),
                         params.get("slot_dtype", "int64")).reshape(lead)
    return {
        "cache": sentinel_filled((block_num, block_size, 1, head_dim), np.uint8),
        "x": x.astype(ml_dtypes.bfloat16),
        "slot_mapping": slots,
    }


# --------------------------------------------------------------------------------------------------
# FlashMLA MODEL1 cache (docs/numerics/flashmla-model1.md)


@register_generator("flashmla_model1")
def gen_flashmla_model1(params, rng):
    """k bf16 ``[block_num, block_size, 1, 512]`` randn * ``scale``; ``zero_tiles`` zeroes NoPE tile 1 of
    every token (scale byte 0x72) and ``tiny_tiles`` scales tile 2 by 1e-4 (the 1e-4 amax floor);
    ``spread`` multiplies each tile by 2^[-30, 30). For ``layouts.flashmla_model1_dequantize`` (``for_dequantize``)
    the input is the reference quantiser's cache of that k, or (``random_bytes``) uniform random bytes."""
    nb, bs = int(params["block_num"]), int(params["block_size"])
    from ..reference.flashmla_model1 import block_bytes, quantize

    if params.get("random_bytes"):
        return {"cache": rng.integers(0, 256, (nb, block_bytes(bs)), dtype=np.uint8)}
    k = randn(rng, (nb, bs, 1, 512), "float32", params.get("scale", 1.0))
    if params.get("spread"):
        k *= np.exp2(rng.integers(-30, 30, (nb, bs, 1, 8))).repeat(64, axis=-1).astype(np.float32)
    if params.get("zero_tiles"):
        k[..., 64:128] = 0
    if params.get("tiny_tiles"):
        k[..., 128:192] *= np.float32(1e-4)
    k = k.astype(ml_dtypes.bfloat16)
    return {"cache": quantize(k)} if params.get("for_dequantize") else {"k": k}


# --------------------------------------------------------------------------------------------------
# vLLM-Ascend kv_compress_epilog (docs/numerics/cache-writers.md#kv_compress_epilog_vllm)


@register_generator("kv_compress_epilog_vllm")
def gen_kv_compress_epilog_vllm(params, rng):
    """x bf16 ``[bs, d]`` randn * ``scale``; ``zero_groups`` zeroes the first NoPE group of the first token and
    the whole NoPE of the last; ``pow2_group`` puts 448 in the first token (a scale that is a power of two before
    rounding); cache of sentinel bytes in ``cache_dtype`` - layout 1 ``[slots, 1, row bytes + tail]``, layout 2
    ``[block_num, block_size, 1, values + scales + tail]``; ``skip`` slots are -1."""
    from ..reference import kv_compress_epilog_vllm as kv

    d, t = int(params["d"]), int(params["bs"])
    gs = int(params.get("quant_group_size", 64))
    x = randn(rng, (t, d), "float32", params.get("scale", 1.0))
    if params.get("zero_groups"):
        x[0, :gs] = 0
        x[-1, :d - 64] = 0
    if params.get("pow2_group"):
        x[0, d - 64 - 1] = 448.0
    tail = int(params.get("tail", 32))
    if int(params.get("layout", 1)) == 1:
        num = int(params.get("num_slots", 2 * t))
        shape = (num, 1, kv.kv_cache_col(d, gs) + tail)
    else:
        bs, bn = int(params.get("block_size", 4)), int(params.get("block_num", 2))
        num = bs * bn
        shape = (bn, bs, 1, kv.value_per_token(d) + kv.scale_per_token(d, gs) + tail)
    cache = sentinel_filled(shape, np.uint8).view(getattr(ml_dtypes, params.get("cache_dtype", "float8_e4m3fn")))
    return {"kv_compress_cache": cache, "x": x.astype(ml_dtypes.bfloat16),
            "slot_mapping": slot_mapping(rng, t, num, int(params.get("skip", 0)), params.get("slot_dtype", "int64"))}


# --------------------------------------------------------------------------------------------------
# rotary tables


def rope_tables(positions: np.ndarray, dim: int, dtype: str, base: float = 10000.0):
    """Half-split cos/sin tables ``[..., dim]`` (``cat(cos t, cos t)``) for integer ``positions``, the
    form npu_interleave_rope and KvRmsNormRopeCache take, rounded to ``dtype``."""
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.asarray(positions, np.float64)[..., None] * inv
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1).astype(np.float32)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1).astype(np.float32)
    fd = float_dtype(dtype)
    return cos.astype(fd), sin.astype(fd)


# --------------------------------------------------------------------------------------------------
# QSFA C8 cache writers (docs/numerics/cache-writers.md#c8_cache_write)


def _c8_slots(params, rng, t, num_slots):
    if params.get("slots") is not None:
        return np.asarray(params["slots"], params.get("slot_dtype", "int64"))
    return slot_mapping(rng, t, num_slots, int(params.get("skip", 1)), params.get("slot_dtype", "int64"))


def _c8_cache(params, rope: int):
    width = 512 + 2 * rope + 16
    return sentinel_filled((int(params.get("block_num", 2)), int(params.get("block_size", 16)), 1, width),
                           np.dtype(params.get("cache_dtype", "uint8")))


@register_generator("c8_cache_write")
def gen_c8_cache_write(params, rng):
    """k_nope ``[T, 512]`` randn * ``scale`` (``zero_tile``: the first 128 columns of token 0 are 0),
    k_rope ``[T, 64]`` randn (None when ``rope`` is 0), slots with ``skip`` -1 entries (or ``slots``),
    kv_cache of sentinel bytes ``[block_num, block_size, 1, 656 | 528]``."""
    t, rope, dt = int(params["T"]), int(params.get("rope", 64)), params.get("dtype", "bfloat16")
    k_nope = randn(rng, (t, 512), "float32", params.get("scale", 2.0))
    if params.get("zero_tile"):
        k_nope[0, :128] = 0
    cache = _c8_cache(params, rope)
    return {
        "k_nope": k_nope.astype(float_dtype(dt)),
        "k_rope": randn(rng, (t, 64), dt) if rope else None,
        "slot_mapping": _c8_slots(params, rng, t, cache.shape[0] * cache.shape[1]),
        "kv_cache": cache,
    }


@register_generator("c8_rmsnorm_rope_cache")
def gen_c8_rmsnorm_rope_cache(params, rng):
    """kv ``[T, 512 + rope_head_dim]`` randn * ``scale``, gamma ``[512]`` ~ 1 + 0.1 randn, cos/sin for
    random positions (None at rope 0), slots (``slots`` or random with ``skip`` -1), sentinel cache."""
    t, rope, dt = int(params["T"]), int(params.get("rope_head_dim", 64)), params.get("dtype", "bfloat16")
    kv = randn(rng, (t, 512 + rope), dt, params.get("scale", 2.0))
    gamma = (1.0 + 0.1 * rng.standard_normal(512, dtype=np.float32)).astype(float_dtype(dt))
    cos = sin = None
    if rope:
        cos, sin = rope_tables(rng.integers(0, 4096, size=t), 64, dt)
    cache = _c8_cache(params, rope)
    return {"kv": kv, "gamma": gamma, "cos": cos, "sin": sin,
            "slot_mapping": _c8_slots(params, rng, t, cache.shape[0] * cache.shape[1]), "kv_cache": cache}


# --------------------------------------------------------------------------------------------------
# QSFA attention (docs/numerics/attention.md#kv_quant_sparse_flash_attention)

#: byte written into every packed KV row no selected token lives in (tails of pages and of BSND
#: sequences, unused pages): int8 127, RoPE 0x7F7F (~3.4e38), scales 0x7F7F7F7F (~3.4e38); a kernel that
#: reads a token it must not ends up with Inf/NaN instead of a plausible number.
POISON = 0x7F


def _qsfa_nope(params, rng, b, s_kv):
    """Per-token NoPE codes ``[b, s_kv, 512]`` (int8) and tile scales ``[b, s_kv, 4]`` (fp32)."""
    data = params.get("data", "random")
    if data == "uniform":
        # every score is 0 (query only in column 0, key column 0 zero): softmax is uniform
        flat = np.arange(b * s_kv * 512).reshape(b, s_kv, 512)
        codes = (flat % 31 + 8).astype(np.int8) * np.int8(params.get("value_sign", 1))
        codes[..., 0] = 0
        tok = np.arange(b * s_kv).reshape(b, s_kv)
        scales = np.exp2(((tok[..., None] + np.arange(4)) % 4 - 3).astype(np.float32)).astype(np.float32)
    elif data == "realistic":
        from ..reference.quant import int8_tile_quant

        codes, scales = int8_tile_quant(rng.standard_normal((b, s_kv, 512), dtype=np.float32))
    else:  # "random", the vllm-ascend QSFA test distribution
        codes = rng.integers(-64, 64, size=(b, s_kv, 512)).astype(np.int8)
        scales = (rng.random((b, s_kv, 4), dtype=np.float32) * np.float32(0.095) + np.float32(0.005)).astype(np.float32)
    return codes, scales


@register_generator("qsfa_attention")
def gen_qsfa_attention(params, rng):
    """Inputs of kv_quant_sparse_flash_attention for batches with query lengths ``q_lens`` and KV
    lengths ``kv_lens``.

    params: layout_query ("BSND" / "TND"), layout_kv ("BSND" / "TND" / "PA_BSND"), heads (Q_N),
    rope_head_dim (0 / 64), dtype (query), sparse_block_size, width (index entries per row; default
    ceil(max kv / sparse_block_size)), block_size (PA page size, default 128), num_blocks (PA, default:
    the pages needed), data: "random" (query U[-1, 1), int8 codes in [-64, 64), scales U[0.005, 0.1) -
    the vllm-ascend test's distribution), "realistic" (randn query, randn KV quantised per 1x128 tile) or
    "uniform" (all scores 0: output = mean of the selected V, softmax_max 0, softmax_sum = count);
    rope_fill "randn" / "zeros".

    KV rows no selected token lives in hold :data:`POISON` bytes; pages are a random permutation; sparse
    indices are causal (sparse_mode 3) with -1 padding (:func:`causal_sparse_indices`).
    """
    from ..reference.packing import pack_rows

    q_lens = np.asarray(params["q_lens"], np.int64)
    kv_lens = np.asarray(params["kv_lens"], np.int64)
    b = q_lens.size
    lq, lkv = params.get("layout_query", "BSND"), params.get("layout_kv", "BSND")
    heads, rope = int(params["heads"]), int(params.get("rope_head_dim", 64))
    dt, sbs = params.get("dtype", "bfloat16"), int(params.get("sparse_block_size", 1))
    s_q, s_kv = int(params.get("q_seq", q_lens.max())), int(params.get("kv_seq", kv_lens.max()))
    width = int(params.get("width", -(-s_kv // sbs)))
    data = params.get("data", "random")

    # query [B, S_q, N, 512 + rope]. The random stream does not depend on rope_head_dim when the RoPE
    # parts are zero, so a rope 0 case and its rope 64 twin (same seed) hold the same data.
    zero_rope = params.get("rope_fill", "randn") == "zeros" or data == "uniform"
    q = np.zeros((b, s_q, heads, 512 + rope), np.float32)
    if data == "uniform":
        q[..., 0] = np.arange(b * s_q * heads).reshape(b, s_q, heads) % 7 + 1
    elif data == "realistic":
        q[..., :512] = rng.standard_normal((b, s_q, heads, 512), dtype=np.float32)
    else:
        q[..., :512] = rng.random((b, s_q, heads, 512), dtype=np.float32) * 2 - 1
    codes, scales = _qsfa_nope(params, rng, b, s_kv)
    if rope and not zero_rope:
        q[..., 512:] = rng.standard_normal((b, s_q, heads, rope), dtype=np.float32)
        rope_v = randn(rng, (b, s_kv, rope), dt)
    else:
        rope_v = np.zeros((b, s_kv, rope), float_dtype(dt))
    q = q.astype(float_dtype(dt))
    packed = pack_rows(codes, rope_v if rope else None, scales)[:, :, None, :]  # [B, S_kv, 1, W]
    nope = codes[:, :, None, :]
    valid_tok = np.arange(s_kv)[None, :] < kv_lens[:, None]  # [B, S_kv]
    poison_rows = np.full(packed.shape[-1], POISON, np.uint8)

    idx = causal_sparse_indices(rng, q_lens, kv_lens, s_q, width, sbs, int(params.get("sparse_mode", 3)))
    idx = idx[:, :, None, :]  # [B, S_q, 1, K]
    out = {}
    if lkv == "PA_BSND":
        bs = int(params.get("block_size", 128))
        table, nb = page_table(rng, kv_lens, bs, width=params.get("table_width"), num_blocks=params.get("num_blocks"))
        key = np.tile(poison_rows, (nb, bs, 1, 1))
        value = np.full((nb, bs, 1, 512), POISON, np.int8)
        bi, si = np.nonzero(valid_tok)
        blk = table[bi, si // bs]
        key[blk, si % bs, 0] = packed[bi, si, 0]
        value[blk, si % bs, 0] = nope[bi, si, 0]
        out["block_table"] = table
    elif lkv == "TND":
        key, value = packed[valid_tok], nope[valid_tok]
    else:  # BSND
        key = np.where(valid_tok[:, :, None, None], packed, poison_rows)
        value = np.where(valid_tok[:, :, None, None], nope, np.int8(POISON))
    key_dtype = params.get("key_storage", "int8")
    out["key"] = np.ascontiguousarray(key).view(np.dtype(key_dtype))
    out["value"] = np.ascontiguousarray(value)
    if lq == "TND":
        rows = np.arange(s_q)[None, :] < q_lens[:, None]
        out["query"], out["sparse_indices"] = q[rows], idx[rows]
        out["actual_seq_lengths_query"] = np.cumsum(q_lens).astype(np.int32)
    else:
        out["query"], out["sparse_indices"] = q, idx
        out["actual_seq_lengths_query"] = q_lens.astype(np.int32)
    out["actual_seq_lengths_kv"] = (np.cumsum(kv_lens) if lkv == "TND" else kv_lens).astype(np.int32)
    return out


# --------------------------------------------------------------------------------------------------
# KvRmsNormRopeCache V1 / V2 (docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache)


@register_generator("kv_rmsnorm_rope_cache")
def gen_kv_rmsnorm_rope_cache(params, rng):
    """The operator's own valid-argument builder (``qsfa.ops.kv_rmsnorm_rope_cache.kv_rmsnorm_rope_cache_example``: randn
    kv, gamma ~ 1 + 0.25 randn, random-angle cos/sin, static quant scales sized for the format, caches of
    sentinel bytes, a -1 index) with the params it knows (version, cache_mode, dtype, k_fmt, ckv_fmt,
    batch, heads, seq, dv, dk, rope, block_size, block_num, cache_seq, offsets, cos_seq1, param_shape,
    skip). The scalar operator arguments (cache_mode, is_output_kv, k_cache_dtype, ...) are case params."""
    from ..ops.kv_rmsnorm_rope_cache import kv_rmsnorm_rope_cache_example as example

    known = set(inspect.signature(example).parameters) - {"rng"}
    args = example(rng, **{k: v for k, v in params.items() if k in known})
    return {k: v for k, v in args.items() if isinstance(v, np.ndarray)}


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4 indexer cache writers (docs/numerics/cache-writers.md#indexer_quant_cache, #indexer_compress_epilog_v2)


def _indexer_x(params, rng, d, t):
    """x ``[t, d]`` randn * ``scale`` in ``x_dtype``; ``zero_groups`` zeroes the first 32 values of the first token and
    the whole last token (an all-zero MX group, an all-zero row)."""
    x = randn(rng, (t, d), "float32", params.get("scale", 1.0))
    if params.get("zero_groups"):
        x[0, :32] = 0
        x[-1, :] = 0
    return x.astype(float_dtype(params.get("x_dtype", "bfloat16")))


@register_generator("indexer_quant_cache")
def gen_indexer_quant_cache(params, rng):
    """x ``[bs, d]`` (:func:`_indexer_x`); ``cache [block_num, block_size, 1, width + tail]`` and ``cache_scale [...,
    scales + tail]`` of sentinel bytes in the dtypes ``quant_mode`` takes (``cache_dtype`` for the FP8 modes);
    ``skip`` slots are -1 (int32)."""
    from ..reference import indexer_cache as ic

    d, t = int(params["d"]), int(params["bs"])
    mode = params.get("quant_mode", "fp8")
    bs, bn, tail = int(params.get("block_size", 4)), int(params.get("block_num", 2)), int(params.get("tail", 8))
    cdt = (getattr(ml_dtypes, params.get("cache_dtype", "float8_e4m3fn")) if mode in ("fp8", "mxfp8") else np.uint8)
    sdt = np.uint8 if mode in ("mxfp8", "mxfp4") else np.float32
    cache = sentinel_filled((bn, bs, 1, ic.cache_width(d, mode) + tail), np.uint8).view(cdt)
    cache_scale = sentinel_filled((bn, bs, 1, ic.scale_cols(d, mode) + tail), sdt)
    return {"cache": cache, "cache_scale": cache_scale, "x": _indexer_x(params, rng, d, t),
            "slot_mapping": slot_mapping(rng, t, bs * bn, int(params.get("skip", 0)), "int32")}


@register_generator("indexer_compress_epilog_v2")
def gen_indexer_compress_epilog_v2(params, rng):
    """x ``[bs, d]`` (:func:`_indexer_x`); uint8 ``indexer_compress_cache [block_num, block_size, 1, d + 4 ceil(d / 128)
    + tail]`` of sentinel bytes; ``skip`` slots are -1 (int32)."""
    d, t = int(params["d"]), int(params["bs"])
    bs, bn, tail = int(params.get("block_size", 4)), int(params.get("block_num", 2)), int(params.get("tail", 0))
    cache = sentinel_filled((bn, bs, 1, d + 4 * -(-d // 128) + tail), np.uint8)
    return {"indexer_compress_cache": cache, "x": _indexer_x(params, rng, d, t),
            "slot_mapping": slot_mapping(rng, t, bs * bn, int(params.get("skip", 0)), "int32")}


@register_generator("scatter_pa_kv_cache_with_k_scale")
def gen_scatter_pa_kv_cache_with_k_scale(params, rng):
    """Random FP8 bytes ``key [bs, heads, dk]`` / ``value [bs, heads, dv]`` in ``fmt``, fp32 ``key_scale``; BNBD caches
    ``[block_num, heads, block_size, d]`` of sentinel bytes (the fp32 scale cache of -1.0); ``skip`` slots -1 and
    ``past_end`` slots at ``num_slots + 5`` (skipped too)."""
    t, n = int(params["bs"]), int(params.get("heads", 2))
    dk, dv = int(params.get("dk", 128)), int(params.get("dv", 128))
    bs, bn = int(params.get("block_size", 4)), int(params.get("block_num", 2))
    fmt = getattr(ml_dtypes, params.get("fmt", "float8_e4m3fn"))
    slots = slot_mapping(rng, t, bs * bn, int(params.get("skip", 0)), params.get("slot_dtype", "int32"))
    slots[:int(params.get("past_end", 0))] = bs * bn + 5
    return {"key": rng.integers(0, 256, (t, n, dk), dtype=np.uint8).view(fmt),
            "value": rng.integers(0, 256, (t, n, dv), dtype=np.uint8).view(fmt),
            "key_cache": sentinel_filled((bn, n, bs, dk), np.uint8).view(fmt),
            "value_cache": sentinel_filled((bn, n, bs, dv), np.uint8).view(fmt),
            "slot_mapping": slots, "key_scale": randn(rng, (t, n), "float32"),
            "key_scale_cache": np.full((bn, n, bs, 1), -1.0, np.float32)}


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4 compressor (docs/numerics/compressor.md)


@register_generator("compressor")
def gen_compressor(params, rng):
    """The arrays of :func:`qsfa.ops.compressor.compressor_case` for ``params`` (scenario, lens, starts, layout,
    used = seqused, cache_mode, block_size, x_dtype), seeded from ``rng``; the scalars are case params."""
    from ..ops.compressor import compressor_case

    keys = ("lens", "starts", "layout", "used", "cache_mode", "block_size", "x_dtype")
    kw = {k: (tuple(params[k]) if isinstance(params[k], list) else params[k]) for k in keys if k in params}
    scen = (int(params["cmp_ratio"]), int(params["coff"]), int(params["head_dim"]))
    kw["seqused"] = kw.pop("used", None)
    return compressor_case(seed=int(rng.integers(0, 2**31 - 1)), scenario=scen, **kw)


@register_generator("quant_compressor")
def gen_quant_compressor(params, rng):
    """:func:`gen_compressor`'s arrays with x, wkv and wgate as HiFloat8 codes of ``randn`` values (x scaled by 4) and
    fp32 descales (``x_descale_value`` param, weight descales uniform in [1e-3, 0.021))."""
    from ..formats import encode

    a = gen_compressor(params, rng)
    cd = a["wkv"].shape[0]
    for k, sc in (("x", 4.0), ("wkv", 1.0), ("wgate", 1.0)):
        a[k] = encode((rng.standard_normal(a[k].shape) * sc).astype(np.float32), "hifloat8", saturate=True)
    a["x_descale"] = np.array([params.get("x_descale_value", 0.37)], np.float32)
    a["wkv_descale"] = (rng.random(cd) * 0.02 + 1e-3).astype(np.float32)
    a["wgate_descale"] = (rng.random(cd) * 0.02 + 1e-3).astype(np.float32)
    return a


@register_generator("vllm_compressor")
def gen_vllm_compressor(params, rng):
    """The arrays of :func:`qsfa.ops.vllm_compressor.vllm_compressor_case` for ``params`` (:func:`gen_compressor`'s,
    plus ``chip`` - the norm_weight dtype - and ``rope_dtype``), seeded from ``rng``; the scalars are case params."""
    from ..ops.vllm_compressor import vllm_compressor_case

    keys = ("lens", "starts", "layout", "used", "cache_mode", "block_size", "x_dtype", "chip", "rope_dtype")
    kw = {k: (tuple(params[k]) if isinstance(params[k], list) else params[k]) for k in keys if k in params}
    kw["seqused"] = kw.pop("used", None)
    scen = (int(params["cmp_ratio"]), int(params["coff"]), int(params["head_dim"]))
    a = vllm_compressor_case(seed=int(rng.integers(0, 2**31 - 1)), scenario=scen, **kw)
    return {k: v for k, v in a.items() if isinstance(v, np.ndarray)}


# --------------------------------------------------------------------------------------------------
# layer chains (qsfa.chain; docs/golden.md#chains)


@register_generator("v32-mla-c8")
def gen_v32_mla_c8(params, rng):
    """The case inputs of chain ``v32-mla-c8`` (one step of a DeepSeek-V3.2 MLA layer on the C8 path).

    params: ``q_lens`` (new tokens per request: 1 each for decode), ``kv_lens`` (tokens per request after
    the step), ``heads`` (query heads), ``n1`` (indexer heads), ``block_size``, ``key_dtype``, ``dtype``.
    Request b's tokens ``kv_lens[b] - q_lens[b]`` .. ``kv_lens[b] - 1`` are this step's; the earlier ones
    are already in the caches, written here by the reference C8 writer (the state a previous step left).
    The kv cache's unused rows hold the sentinel byte, the index cache's unused rows zeros.
    """
    from ..ops.c8_cache import c8_rmsnorm_rope_cache as _c8r

    q_lens = np.asarray(params["q_lens"], np.int64)
    kv_lens = np.asarray(params["kv_lens"], np.int64)
    if q_lens.shape != kv_lens.shape or (q_lens < 1).any() or (q_lens > kv_lens).any():
        raise GoldenInputError(f"v32-mla-c8: q_lens {q_lens.tolist()} and kv_lens {kv_lens.tolist()} must pair up "
                               "with 1 <= q_len <= kv_len")
    bs, dt = int(params.get("block_size", 16)), params.get("dtype", "bfloat16")
    heads, n1, key_dtype = int(params.get("heads", 4)), int(params.get("n1", 8)), params.get("key_dtype", "int8")
    fd = float_dtype(dt)
    table, n_blocks = page_table(rng, kv_lens, bs)
    n_blocks += 1  # one page no request uses
    pos = np.concatenate([np.arange(n) for n in kv_lens])
    req = np.repeat(np.arange(kv_lens.size), kv_lens)
    slots = (table[req, pos // bs].astype(np.int64) * bs + pos % bs)
    new = pos >= np.repeat(kv_lens - q_lens, kv_lens)
    kv = randn(rng, (pos.size, 576), dt, 2.0)
    gamma = (1.0 + 0.1 * rng.standard_normal(512, dtype=np.float32)).astype(fd)
    cos, sin = rope_tables(pos, 64, dt)
    index_key = randn(rng, (pos.size, 1, 128), dt)
    kv_cache = sentinel_filled((n_blocks, bs, 1, 656), np.uint8)
    index_cache = np.zeros((n_blocks, bs, 1, 128), fd)
    old = ~new
    if old.any():  # the history a previous step wrote
        kv_cache = _c8r(kv[old], gamma, cos[old], sin[old], slots[old], kv_cache, epsilon=1e-6, rope_head_dim=64,
                        key_dtype=key_dtype, chip=params.get("chip"))
        index_cache[slots[old] // bs, slots[old] % bs] = index_key[old]
    t_q = int(q_lens.sum())
    return {
        "query": rng.uniform(-1, 1, (t_q, heads, 576)).astype(fd),
        "kv": kv[new], "gamma": gamma, "cos": cos[new], "sin": sin[new], "slot_mapping": slots[new],
        "kv_cache": np.asarray(kv_cache), "index_key": index_key[new], "index_cache": index_cache,
        "index_query": randn(rng, (t_q, n1, 128), dt),
        "weights": rng.uniform(-1, 1, (t_q, n1)).astype(fd),
        "block_table": table,
        "actual_seq_lengths_query": np.cumsum(q_lens).astype(np.int32),
        "actual_seq_lengths_kv": kv_lens.astype(np.int32),
    }


@register_generator("chain-link")
def gen_chain_link(params, rng):
    """The array arguments of link ``params["link"]`` of chain ``params["chain"]`` (qsfa.chain.get_chain with these
    params): the chain's own generator (registered under the chain's name) makes the chain inputs, the reference
    runs the links before this one (with ``params["chip"]`` when given), and the link's array arguments are picked
    from chain inputs and intermediates (views reshaped)."""
    from .. import chain as qchain

    ch = qchain.get_chain(params["chain"], params, ignore_unknown=True)
    inputs = get_generator(params["chain"])(params, rng)
    tensors = qchain.run_chain(ch, inputs, chip=params.get("chip"), until=params["link"])
    lk = next(ln for ln in ch.links if ln.name == params["link"])
    spec = qchain._spec(lk.op)
    args = qchain._link_args(lk, spec, tensors, "golden generation")
    # the link's call checked through the chain (its contract on the chip, nothing computed), so that an edge its
    # operator refuses is reported with the chain's names (the link and the field) rather than as a bare case error
    qchain.check_args(lk, qchain.with_chip(lk, args, params.get("chip")))
    return {k: v for k, v in args.items() if isinstance(v, np.ndarray)}


@register_generator("vllm_quant_lightning_indexer")
def gen_vllm_quant_lightning_indexer(params, rng):
    """The arrays of :func:`qsfa.ops.indexer_v4.vqli_case` for ``params`` (fmt, cmp_ratio, batch, q_s, kv_s compressed
    tokens, act_kv_orig original key lengths, layout_query, block_size, sparse_count) with a seed drawn from ``rng``:
    a paged compressed key whose blocks run in reverse order, explicit query lengths."""
    from ..ops.indexer_v4 import vqli_case

    keys = ("layout_query", "block_size", "sparse_count", "batch", "q_s", "kv_s", "cmp_ratio", "fmt", "act_kv_orig")
    args = vqli_case(seed=int(rng.integers(2**31)), explicit_lengths=True,
                     **{k: params[k] for k in keys if k in params})
    return {k: v for k, v in args.items() if isinstance(v, np.ndarray)}


@register_generator("quant_lightning_indexer_v2")
def gen_quant_lightning_indexer_v2(params, rng):
    """The arrays of :func:`qsfa.ops.quant_lightning_indexer_v2.qli2_case` for ``params`` (fmt, layout_q, layout_k,
    batch, q_s, kv_s compressed tokens, cmp_ratio, mask_mode, topk, block_size, residual) with a seed drawn from
    ``rng``: a paged key whose blocks run in reverse order, or a BSND / TND one; cmp_residual_k where required."""
    from ..ops.quant_lightning_indexer_v2 import qli2_case

    keys = ("fmt", "layout_q", "layout_k", "batch", "q_s", "kv_s", "cmp_ratio", "mask_mode", "topk", "block_size",
            "residual")
    args = qli2_case(seed=int(rng.integers(2**31)), **{k: params[k] for k in keys if k in params})
    return {k: v for k, v in args.items() if isinstance(v, np.ndarray)}


@register_generator("qkv_rms_norm_rope_cache_with_k_scale")
def gen_qkv_rms_norm_rope_cache_with_k_scale(params, rng):
    """The arrays of :func:`qsfa.ops.qkv_k_scale.qkv_case` for ``params`` (t, nq, batch, layout_qkv, layout_q_out,
    block_num, block_size, max_seq) with a seed drawn from ``rng``; Nk = Nv = nq / 8. With a non-empty
    ``mrope_section`` those of :func:`qsfa.ops.qkv_k_scale.mrope_case` (the M-RoPE scenario), or of
    :func:`qsfa.ops.qkv_k_scale.mx_case` when ``q_quant_mode`` is "Mx" (the M-RoPE MX scenario)."""
    from ..ops.qkv_k_scale import qkv_case

    keys = ("t", "batch", "layout_qkv", "layout_q_out", "block_num", "block_size", "max_seq")
    if params.get("mrope_section"):  # the M-RoPE scenarios: mrope_case's / mx_case's arrays (section from the params)
        from ..ops.qkv_k_scale import mrope_case, mx_case

        make = mx_case if params.get("q_quant_mode") == "Mx" else mrope_case
        args = make(seed=int(rng.integers(2**31)), nq=params["nq"], nk=params["nq"] // 8,
                    section=tuple(params["mrope_section"]),
                    **{k: params[k] for k in keys if k in params and k not in ("batch", "layout_qkv", "layout_q_out")})
    else:
        args = qkv_case(seed=int(rng.integers(2**31)), nq=params["nq"], nk=params["nq"] // 8,
                        **{k: params[k] for k in keys if k in params})
    return {k: v for k, v in args.items() if isinstance(v, np.ndarray)}


# --------------------------------------------------------------------------------------------------
# DeepSeek-V4 shared-KV attention (docs/numerics/attention-v4.md)


@register_generator("sharedkv")
def gen_sharedkv(params, rng):
    """The arrays of ``qsfa.ops.sharedkv._case(params["v4_op"], **builder params)`` (scenario, layout_q, layout_kv,
    qdtype, batch, s1, s2, n1, k, block_size, ratio, quant_mode), seeded from ``rng``; ``sinks_kind`` "-inf" /
    "zero" / "huge" replaces the sinks. The scalar arguments are case params (qsfa.golden.catalogue)."""
    from ..ops.sharedkv import _case

    keys = ("scenario", "layout_q", "layout_kv", "qdtype", "batch", "s1", "s2", "n1", "k", "block_size", "ratio",
            "quant_mode")
    a = _case(params["v4_op"], seed=int(rng.integers(0, 2**31 - 1)), **{k: params[k] for k in keys if k in params})
    kind = params.get("sinks_kind")
    if kind is not None:
        a["sinks"] = np.full(a["sinks"].shape, {"-inf": -np.inf, "zero": 0.0, "huge": 1e30}[kind], np.float32)
    return {k: v for k, v in a.items() if isinstance(v, np.ndarray)}


# DeepSeek-V4 layer chains (qsfa.chain_v4): the inputs of chains v4-swa / v4-csa / v4-hca


def _v4_layer_generator(kind):
    def gen(params, rng):
        from ..chain_v4 import gen_v4_layer

        return gen_v4_layer({**params, "kind": kind}, rng)

    gen.__doc__ = f"The inputs of chain ``v4-{kind}`` (:func:`qsfa.chain_v4.gen_v4_layer`)."
    return gen


for _kind in ("swa", "csa", "hca"):
    register_generator(f"v4-{_kind}")(_v4_layer_generator(_kind))
