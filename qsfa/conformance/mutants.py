"""Mutant backends: the reference with one realistic kernel bug each, to measure what the catalogue catches.

A :class:`Mutant` names one operator and a bug; :func:`register_mutant` registers it exactly as a third-party
backend is registered (``qsfa.register_backend`` + ``qsfa.register_impl``): every operator runs the reference
except the mutated one, which runs the reference with the bug injected. The bugs are the kinds kernels ship
with: an off-by-one causal threshold, a -1 that does not stop the index list, ties rounded the wrong way, a
missing clamp, swapped nibbles, a scale read from the wrong bytes or the wrong tile, an E8M0 ceil for a floor,
a zero-group scale, a RoPE sign, an ignored epsilon, indexer ties, a scale product in another order, a dropped
128-token tile, a divide by a bf16-rounded sum, and bugs that only show for batch >= 2 or a PA block size
above 16.

Injection: most mutants swap one module-level helper of :mod:`qsfa.reference` for a buggy one while the
mutated operator runs (:func:`_patched`; the conformance run is single-threaded), the others change the
arguments the kernel "reads" or the outputs it "writes". Nothing here changes the reference outside a
mutant's own call.

:mod:`qsfa.conformance.campaign` runs ``qsfa conformance`` against every mutant and reports which ones the
catalogue kills and how fast (``python -m qsfa.conformance.campaign``; see ``docs/conformance.md``).
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from .._dispatch import Backend, operators, register_backend, register_impl, unregister_backend

__all__ = ["Mutant", "MUTANTS", "mutants", "register_mutant", "unregister_mutant", "backend_name"]

QSFA = "kv_quant_sparse_flash_attention"
SFA = "sparse_flash_attention"
LI = "lightning_indexer"
QLI = "quant_lightning_indexer"
MERGE = "merge_attention_lse"


@dataclass(frozen=True)
class Mutant:
    """One bug in one operator. ``make(reference_impl) -> buggy_impl``; both take the operator's normalised
    keyword arguments and return its outputs, writing in-place buffers like the reference."""

    name: str
    op: str
    doc: str
    make: Callable[[Callable], Callable]
    #: the chip the mutant backend runs on, as a device backend does (its ``chip()``): a run models that chip
    chip: str | None = None
    #: a must-pass control: no bug, only behaviour the docs allow (scratch in unspecified bytes); the catalogue
    #: must NOT fail it (the campaign counts a control that survives as passed, one that is "killed" as a false alarm)
    control: bool = False


def backend_name(m: Mutant) -> str:
    return f"mutant-{m.name}"


class _MutantBackend(Backend):
    array_kind = "numpy"

    def __init__(self, m: Mutant):
        self.name = backend_name(m)
        self.description = f"mutant of the reference: {m.op}: {m.doc}"
        self._chip = m.chip

    def chip(self):
        return self._chip


def register_mutant(m: Mutant) -> str:
    """Register ``m`` as a backend (the reference everywhere, the bug in ``m.op``); returns its name."""
    name = backend_name(m)
    register_backend(_MutantBackend(m), replace=True)
    for op_name, op in operators().items():
        ref = op.impls["reference"]
        register_impl(name, op_name, m.make(ref) if op_name == m.op else ref)
    return name


def unregister_mutant(m: Mutant):
    unregister_backend(backend_name(m))


# ---------------------------------------------------------------------------------------------------
# injection helpers


@contextlib.contextmanager
def _patched(*triples):
    """Temporarily set ``module.attr = value`` for each ``(module, attr, value)``."""
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in triples]
    try:
        for mod, attr, value in triples:
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def _patch(*specs):
    """A mutant maker: ``specs`` are ``(module, attr, factory)``; ``factory(original) -> replacement``."""

    def make(ref):
        def impl(**kw):
            with _patched(*[(mod, attr, factory(getattr(mod, attr))) for mod, attr, factory in specs]):
                return ref(**kw)

        return impl

    return make


def _args(change: Callable[[dict], dict]):
    """A mutant maker that changes the arguments the kernel reads (``change(kwargs) -> kwargs``)."""

    def make(ref):
        return lambda **kw: ref(**change(dict(kw)))

    return make


def _outputs(change: Callable[[dict, tuple], tuple]):
    """A mutant maker that changes what the kernel returns (``change(kwargs, outputs) -> outputs``)."""

    def make(ref):
        def impl(**kw):
            return change(kw, ref(**kw))

        return impl

    return make


def _away(x):
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def _loose_scatter(cache, rows, slots, *, row_of=None):
    """Scatter without the reference's asserts (a buggy kernel may write one row twice); ``row_of(s, bs)``
    maps a slot to ``(block, row)``."""
    rows = np.asarray(rows)
    bs = cache.shape[1]
    s = np.asarray(slots).reshape(-1).astype(np.int64)
    if rows.dtype != cache.dtype:
        rows = rows.view(cache.dtype)
    keep = s != -1
    blk, pos = row_of(s[keep], bs) if row_of is not None else (s[keep] // bs, s[keep] % bs)
    w = rows.shape[-1]
    if w == cache.shape[-1]:
        cache[blk, pos] = rows[keep]
    else:
        cache[blk, pos, ..., :w] = rows[keep]
    return cache


def _rope_wrong_sign(x, cos, sin):
    """Interleave RoPE with the sign on the wrong half: ``[x1, x2] cos + [x2, -x1] sin``."""
    xf = np.asarray(x).astype(np.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    p1 = np.concatenate([x1, x2], axis=-1)
    p2 = np.concatenate([x2, -x1], axis=-1)
    return ((p1 * np.asarray(cos, np.float32)).astype(np.float32)
            + (p2 * np.asarray(sin, np.float32)).astype(np.float32))


def _row_mod16(s, bs):
    return s // bs, s % min(bs, 16)  # the row inside a block taken modulo 16: right only for bs <= 16


# ---------------------------------------------------------------------------------------------------
# the modules the bugs go into


def _m(name):
    import importlib

    return importlib.import_module(f"qsfa.reference.{name}")


_MUTANTS: list[Mutant] = []


def _general_path():
    """``(module, attr, factory)`` that sends dynamic_block_quant down its general path (the one built from
    ``block_amax`` and ``_cast``, the helpers the quantiser mutants replace): the tiled fast path declines."""
    return _m("quant"), "_quant_tiled", lambda orig: (lambda *a, **k: (None, None))


def _add(name, op, doc, make, chip=None, control=False):
    _MUTANTS.append(Mutant(name, op, doc, make, chip, control))


def _formats():
    F = _m("formats")

    def e8m0(orig):
        return lambda u, rounding, *a, **k: orig(u, "ceil" if rounding == "floor" else rounding, *a, **k)

    _add("encode.e8m0_ceil_for_floor", "formats.encode", "E8M0 'floor' rounds up (ceil) off powers of two",
         _patch((F, "_e8m0_core", e8m0)))

    def ieee_even(orig):
        return lambda u, Fm, rounding: orig(u, Fm, "rint")

    _add("encode.ties_even_for_away", "formats.encode", "IEEE-like formats round ties to even under 'round'",
         _patch((F, "_ieee_magnitude", ieee_even)))

    def int8_away(orig):
        return lambda x, rounding, saturate: orig(x, "round" if rounding == "rint" else rounding, saturate)

    _add("encode.int8_ties_away_for_even", "formats.encode", "int8 rounds ties away from zero under 'rint'",
         _patch((F, "_int8_encode", int8_away)))

    def hif8_nosat(orig):
        return lambda u, saturate: orig(u, False)

    _add("encode.hif8_no_saturation", "formats.encode", "HiFloat8 ignores saturate (overflow gives Inf)",
         _patch((F, "_hif8_encode_chunk", hif8_nosat)))

    def fp8_nosat(orig):
        def f(u, Fm, rounding, saturate, *a):
            if Fm.name.startswith("float8") and saturate:
                a_ = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
                if not a_.any():
                    return orig(u, Fm, rounding, False, *a)
            return orig(u, Fm, rounding, saturate, *a)

        return f

    _add("encode.fp8_no_saturation", "formats.encode", "FP8 ignores saturate (overflow gives Inf/NaN)",
         _patch((F, "_ieee_encode_chunk", fp8_nosat)))

    def flush(kw, out):
        fmt = kw["fmt"]
        Fm = F.FLOAT_FORMATS.get(fmt)
        if Fm is None or fmt in ("bfloat16", "float16"):
            return out
        v = np.asarray(out)
        return np.where(np.abs(v) < np.float32(2.0 ** Fm.emin), np.float32(0) * v, v).astype(v.dtype)

    _add("decode.subnormals_flushed", "formats.decode", "8/4-bit subnormal codes decode to zero",
         _outputs(flush))

    def e4m3_ieee(kw, out):
        if kw["fmt"] != "float8_e4m3fn":
            return out
        c = np.asarray(kw["codes"]).view(np.uint8)
        v = np.array(out, copy=True)
        top = (c & 0x7F) >= 0x78  # the IEEE reading: exponent all ones = Inf / NaN
        v[top] = np.where((c[top] & 0x07) == 0, np.copysign(np.float32(np.inf), v[top]), np.float32(np.nan))
        return v

    _add("decode.e4m3fn_top_binade_as_inf", "formats.decode", "E4M3FN decoded as IEEE: the top binade is Inf/NaN",
         _outputs(e4m3_ieee))

    def hybrid_ties_down(kw, out):
        """HiFloat8 'hybrid' (TA for binades |e| <= 3): an exact tie there goes one code toward zero."""
        if kw["fmt"] != "hifloat8" or kw.get("rounding") != "hybrid":
            return out
        x = np.asarray(kw["x"]).astype(np.float64)
        ax = np.abs(x)
        _, e = np.frexp(np.where(ax > 0, ax, 1.0))
        tie = np.isin(ax, np.abs(F.midpoints("hifloat8"))) & (np.abs(e - 1) <= 3)
        if not tie.any():
            return out
        rep = np.abs(F.representable_values("hifloat8"))
        rep = np.unique(rep[np.isfinite(rep)])
        lower = rep[np.maximum(np.searchsorted(rep, ax) - 1, 0)]
        down = F.encode(np.copysign(lower, x).astype(np.float32), "hifloat8", saturate=True)
        return np.where(tie, down, np.asarray(out)).astype(np.asarray(out).dtype)

    _add("encode.hif8_hybrid_ties_toward_zero", "formats.encode",
         "HiFloat8 'hybrid': ties of its TA binades (|e| <= 3) round one code toward zero", _outputs(hybrid_ties_down))

    def swap(kw):
        kw["nibble_order"] = "high_first" if kw["nibble_order"] == "low_first" else "low_first"
        return kw

    _add("pack_fp4.nibbles_swapped", "formats.pack_fp4", "packs the two FP4 nibbles in the other order", _args(swap))
    _add("unpack_fp4.nibbles_swapped", "formats.unpack_fp4", "unpacks the two FP4 nibbles in the other order",
         _args(swap))


def _quant():
    Q = _m("quant")

    def cast_int8(rounding_for):
        def factory(orig):
            def f(y, dst_type, round_mode):
                if dst_type == "int8":
                    return orig(y, dst_type, rounding_for(round_mode))
                return orig(y, dst_type, round_mode)

            return f

        return factory

    _add("dynamic_block_quant.int8_ties_away_for_even", "dynamic_block_quant",
         "int8 codes round ties away from zero under round_mode 'rint'",
         _patch(_general_path(), (Q, "_cast", cast_int8(lambda r: "round"))))

    def cast_fp8_away(orig):
        return lambda y, dst_type, round_mode: orig(y, dst_type, "round" if dst_type.startswith("float8") else round_mode)

    _add("dynamic_block_quant.fp8_ties_away_for_even", "dynamic_block_quant",
         "FP8 codes round ties away from zero under round_mode 'rint'", _patch(_general_path(), (Q, "_cast", cast_fp8_away)))

    def clamp128(orig):
        def f(y, dst_type, round_mode):
            if dst_type != "int8":
                return orig(y, dst_type, round_mode)
            r = np.rint(y) if round_mode == "rint" else _away(y)
            return np.clip(r, -128, 127).astype(np.int8)

        return f

    def no_int8_clamp(orig):  # the clamp to +-FINITE_MAX skipped for int8 (the cast saturates at -128)
        return {**orig, "int8": np.float32(np.inf)}

    _add("dynamic_block_quant.int8_clamp_minus128", "dynamic_block_quant",
         "int8 codes saturate to [-128, 127] instead of [-127, 127] (visible when min_scale bounds the scale)",
         _patch(_general_path(), (Q, "_cast", clamp128), (Q, "FINITE_MAX", no_int8_clamp)))

    def zero_scale_one(orig):
        return lambda amax, type_max, min_scale=0.0: np.where(np.asarray(amax) == 0, np.float32(1.0),
                                                              orig(amax, type_max, min_scale)).astype(np.float32)

    _add("dynamic_block_quant.zero_block_scale_one", "dynamic_block_quant",
         "an all-zero block stores scale 1 instead of 0", _patch((Q, "dynamic_block_scale", zero_scale_one)))

    def multiply(kw):
        if kw["scale_order"] == "divide" and not kw["min_scale"]:
            kw["scale_order"] = "multiply"
        return kw

    _add("dynamic_block_quant.multiply_for_divide", "dynamic_block_quant",
         "quantises x * fp32(TYPE_MAX / amax) instead of x / scale (one code off at rare ties)", _args(multiply))

    def no_min_scale(kw):
        kw["min_scale"] = 0.0
        return kw

    _add("dynamic_block_quant.min_scale_ignored", "dynamic_block_quant", "min_scale is ignored", _args(no_min_scale))

    def no_dtm(kw):
        kw["dst_type_max"] = 0.0
        return kw

    _add("dynamic_block_quant.dst_type_max_ignored", "dynamic_block_quant",
         "dst_type_max is ignored (HiFloat8 always uses 32768)", _args(no_dtm))

    def first_row_amax(orig):
        return lambda a, rb, cb: orig(a[:, ::rb], 1, cb)

    _add("dynamic_block_quant.block_amax_first_row", "dynamic_block_quant",
         "a block's amax is taken over its first row only (row_block_size > 1)",
         _patch(_general_path(), (Q, "block_amax", first_row_amax)))


def _scatter():
    S = _m("scatter")

    def minus1_last(kw, out):
        s = np.asarray(kw["slot_mapping"]).reshape(-1)
        skip = np.flatnonzero(s == -1)
        if skip.size:  # slot -1 used as a Python index: the last row of the last block
            kw["cache"][-1, -1] = np.asarray(kw["rows"])[skip[-1]].view(kw["cache"].dtype)
        return out

    _add("scatter_by_slot.minus1_writes_last_row", "scatter_by_slot", "slot -1 writes the cache's last row",
         _outputs(minus1_last))

    def mod16(orig):
        return lambda cache, rows, slots: _loose_scatter(cache, rows, slots, row_of=_row_mod16)

    _add("scatter_by_slot.block_row_mod16", "scatter_by_slot",
         "the row inside a block is slot % 16 (wrong for block_size > 16)", _patch((S, "scatter_by_slot", mod16)))

    def stop_at_minus1(kw):
        s = np.array(kw["slot_mapping"], copy=True).reshape(-1)
        neg = np.flatnonzero(s == -1)
        if neg.size:
            s[neg[0]:] = -1
        kw["slot_mapping"] = s.reshape(np.shape(kw["slot_mapping"]))
        return kw

    _add("scatter_by_slot.stop_at_first_minus1", "scatter_by_slot",
         "the first slot -1 ends the token list (later tokens are not written)", _args(stop_at_minus1))


def _c8():
    Q, C = _m("quant"), _m("c8_cache")

    def cast(fmt, mode_for):
        def factory(orig):
            def f(y, dst_type, round_mode):
                return orig(y, dst_type, mode_for(round_mode) if dst_type == fmt else round_mode)

            return f

        return factory

    for op, tag in (("c8_cache_write", "c8_cache_write"), ("c8_rmsnorm_rope_cache", "c8_rmsnorm_rope_cache")):
        _add(f"{tag}.int8_ties_away_for_even", op, "int8 codes round ties away from zero instead of to even",
             _patch(_general_path(), (Q, "_cast", cast("int8", lambda r: "round"))))
    _add("c8_cache_write.fp8_ties_away_for_even", "c8_cache_write",
         "FP8 E4M3FN codes round ties away from zero instead of to even",
         _patch(_general_path(), (Q, "_cast", cast("float8_e4m3fn", lambda r: "round"))))

    def scale_at_rope_offset(orig):
        def f(q, rope, s):
            rows = orig(q, rope, s)
            if rope is not None and np.asarray(rope).shape[-1]:
                rows = rows.copy()  # scales written at 512 + rope (elements, not bytes) over the RoPE's 2nd half
                rows[..., 576:592] = rows[..., 640:656]
                rows[..., 640:656] = 0
            return rows

        return f

    _add("c8_cache_write.scale_at_wrong_offset", "c8_cache_write",
         "tile scales written at byte 512 + rope_head_dim instead of 512 + 2 * rope_head_dim",
         _patch((C, "pack_rows", scale_at_rope_offset)))

    def tile0(orig):
        def f(*a, **k):
            q, s = orig(*a, **k)
            return q, np.repeat(s[..., :1], s.shape[-1], axis=-1)

        return f

    _add("c8_cache_write.scale_of_first_tile", "c8_cache_write",
         "every tile stores the first tile's scale (the tile index is not advanced)",
         _patch((C, "quantize_nope", tile0)))

    def zero_tile(orig):
        def f(*a, **k):
            q, s = orig(*a, **k)
            return q, np.where(s == 0, np.float32(1.0 / 127.0), s).astype(np.float32)

        return f

    _add("c8_cache_write.zero_tile_scale", "c8_cache_write", "an all-zero tile stores scale 1/127 instead of 0",
         _patch((C, "quantize_nope", zero_tile)))

    def mod16(orig):
        return lambda cache, rows, slots: _loose_scatter(cache, rows, slots, row_of=_row_mod16)

    _add("c8_cache_write.block_row_mod16", "c8_cache_write",
         "the row inside a block is slot % 16 (wrong for block_size > 16)", _patch((C, "scatter_by_slot", mod16)))

    _add("c8_rmsnorm_rope_cache.rope_sign", "c8_rmsnorm_rope_cache",
         "RoPE rotates with the sign on the wrong half (x2 cos... + [x2, -x1] sin)",
         _patch((C, "interleave_rope_f32", lambda orig: _rope_wrong_sign)))

    def eps_fixed(orig):
        return lambda x, gamma, epsilon: orig(x, gamma, 1e-6)

    _add("c8_rmsnorm_rope_cache.epsilon_ignored", "c8_rmsnorm_rope_cache",
         "epsilon is ignored (1e-6 always)", _patch((C, "rms_norm_f32", eps_fixed)))

    def rope_interleaved(orig):
        def f(x, cos, sin):
            out = orig(x, cos, sin)
            h = out.shape[-1] // 2
            inter = np.empty_like(out)
            inter[..., 0::2], inter[..., 1::2] = out[..., :h], out[..., h:]
            return inter

        return f

    _add("c8_rmsnorm_rope_cache.rope_interleaved_output", "c8_rmsnorm_rope_cache",
         "RoPE output stored interleaved instead of half-split", _patch((C, "interleave_rope_f32", rope_interleaved)))


def _kce():
    K = _m("kv_compress_epilog")

    def zero_group(orig):
        return lambda amax: np.where(np.asarray(amax) == 0, np.float32(2.0 ** -22), orig(amax)).astype(np.float32)

    _add("kv_compress_epilog.zero_group_scale", "kv_compress_epilog",
         "an all-zero group gets scale 2^-22 instead of fp32(1e-4) * fp32(1/448)",
         _patch((K, "fp8_group_scale", zero_group)))

    def e8m0_ceil(orig):
        def f(s):
            b = np.ascontiguousarray(np.asarray(s, np.float32)).view(np.uint32)
            return (((b >> 23) + ((b & 0x7FFFFF) != 0)) & 0xFF).astype(np.uint8)

        return f

    _add("kv_compress_epilog.e8m0_ceil", "kv_compress_epilog",
         "mode 1 stores the ceil exponent of the scale instead of its floor (round_scale off)",
         _patch((K, "e8m0_byte", e8m0_ceil)))

    def no_round_scale(kw):
        kw["round_scale"] = False
        return kw

    _add("kv_compress_epilog.round_scale_ignored", "kv_compress_epilog", "round_scale is ignored", _args(no_round_scale))

    def swap(kw):
        kw["fp4_nibble_order"] = "high_first" if kw["fp4_nibble_order"] == "low_first" else "low_first"
        return kw

    _add("kv_compress_epilog.fp4_nibbles_swapped", "kv_compress_epilog", "FP4 nibbles packed in the other order",
         _args(swap))

    def inv_fp32(orig):
        def f(amax):
            r = orig(amax)
            a = np.asarray(amax, np.float32)
            with np.errstate(divide="ignore", over="ignore"):
                inv = np.where(a == 0, np.float32(0), np.float32(6.0) / a).astype(np.float32)
            return type(r)(r.scale_bits, inv)

        return f

    _add("kv_compress_epilog.fp4_multiplier_fp32", "kv_compress_epilog",
         "the FP4 multiplier 6 / amax is kept in fp32 instead of rounded to bf16",
         _patch((K, "fp4_group_scale", inv_fp32)))

    def no_x_scale(kw):
        kw["x_scale"] = 1.0
        return kw

    _add("kv_compress_epilog.x_scale_ignored", "kv_compress_epilog", "x_scale is ignored (mode 2 RoPE)",
         _args(no_x_scale))

    def bf16_trunc(orig):
        def f(x, fmt, **k):
            if fmt == "bfloat16":
                b = np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)
                return (b >> 16).astype(np.uint16)
            return orig(x, fmt, **k)

        return f

    _add("kv_compress_epilog.bf16_truncation", "kv_compress_epilog",
         "bf16 casts truncate instead of rounding to nearest even", _patch((K, "encode", bf16_trunc)))

    def group64(kw):
        if kw["quant_mode"] == 2:
            kw["quant_group_size"] = 64 if kw["quant_group_size"] != 64 else 32
        return kw

    _add("kv_compress_epilog.fp4_group_size_ignored", "kv_compress_epilog",
         "mode 2 ignores quant_group_size (uses 64)", _args(group64))


def _krr():
    R = _m("kv_rmsnorm_rope_cache")

    _add("kv_rmsnorm_rope_cache.rope_sign", "kv_rmsnorm_rope_cache", "RoPE with the sign on the wrong half",
         _patch((R, "interleave_rope_f32", lambda orig: _rope_wrong_sign)))

    def eps_fixed(orig):
        return lambda x, gamma, epsilon: orig(x, gamma, 1e-5)

    _add("kv_rmsnorm_rope_cache.epsilon_ignored", "kv_rmsnorm_rope_cache", "epsilon is ignored (1e-5 always)",
         _patch((R, "rms_norm_f32", eps_fixed)))

    def static(int8_round):
        def factory(orig):
            def f(x, fmt, scale, offset=None, *more, **kw):
                if fmt != "int8":
                    return orig(x, fmt, scale, offset, *more, **kw)
                n, d = x.shape[1], x.shape[-1]
                y = (x * R._bcast_param(scale, n, d)).astype(np.float32)
                if offset is not None:
                    y = (y + R._bcast_param(offset, n, d)).astype(np.float32)
                return int8_round(y).astype(np.int8).view(np.uint8)

            return f

        return factory

    _add("kv_rmsnorm_rope_cache.int8_ties_away_for_even", "kv_rmsnorm_rope_cache",
         "int8 cache codes round ties away from zero", _patch((R, "static_quant",
                                                               static(lambda y: np.clip(_away(y), -128, 127)))))
    _add("kv_rmsnorm_rope_cache.int8_clamp_symmetric", "kv_rmsnorm_rope_cache",
         "int8 cache codes saturate to [-127, 127] instead of [-128, 127]",
         _patch((R, "static_quant", static(lambda y: np.clip(np.rint(y), -127, 127)))))

    def no_offset(kw):
        kw["k_rope_offset"] = kw["c_kv_offset"] = None
        return kw

    _add("kv_rmsnorm_rope_cache.offset_ignored", "kv_rmsnorm_rope_cache", "the quant offsets are ignored",
         _args(no_offset))

    def rounded_norm(orig):
        def f(x, gamma, epsilon):
            dt = np.asarray(x).dtype
            return orig(x, gamma, epsilon).astype(dt).astype(np.float32)

        return f

    _add("kv_rmsnorm_rope_cache.quantises_rounded_norm", "kv_rmsnorm_rope_cache",
         "8-bit caches quantise the RMSNorm result rounded to kv's dtype instead of the fp32 value",
         _patch((R, "rms_norm_f32", rounded_norm)))

    def slots_no_skip(orig):
        def f(index, cache_mode, batch, seq, rows_per_block):
            s = orig(index, cache_mode, batch, seq, rows_per_block)
            if cache_mode == "Norm":  # -1 added to the batch row's base: batch b >= 1 writes batch b-1's last row
                idx = np.asarray(index).astype(np.int64).reshape(batch, seq)
                base = np.arange(batch, dtype=np.int64)[:, None] * rows_per_block
                s = np.where((idx == -1) & (base > 0), base - 1, s.reshape(batch, seq)).reshape(-1)
            return s

        return f

    def loose(orig):
        return lambda cache, rows, slots: _loose_scatter(cache, rows, slots)

    _add("kv_rmsnorm_rope_cache.minus1_not_skipped", "kv_rmsnorm_rope_cache",
         "Norm mode: index -1 of batch b >= 1 writes the previous batch row's last position",
         _patch((R, "token_slots", slots_no_skip), (R, "scatter_by_slot", loose)))


def _select(indices, threshold, limit, sbs, *, stop_at_minus1=True, stride=None):
    """Token selection (docs/numerics/attention.md#token-selection) with two possible bugs: ``stop_at_minus1=False`` skips a -1 entry but
    reads on; ``stride`` (instead of sbs) spaces the blocks the entries select."""
    idx = np.asarray(indices).astype(np.int64)
    c, k = idx.shape
    sbs = int(sbs)
    n_read = np.where(threshold > 0, np.minimum(k, -(-threshold // sbs)), 0)
    neg = idx < 0
    if stop_at_minus1:
        n_read = np.minimum(n_read, np.where(neg.any(axis=1), neg.argmax(axis=1), k))
    ok = (np.arange(k)[None, :] < n_read[:, None]) & ~neg
    tok = (idx[:, :, None] * (sbs if stride is None else stride) + np.arange(sbs)[None, None, :]).reshape(c, k * sbs)
    valid = np.repeat(ok, sbs, axis=1) & (tok >= 0) & (tok < limit[:, None])
    return np.where(valid, tok, 0), valid


def _attention():
    A, L, I = _m("attention"), _m("attn_layout"), _m("indexer")

    def thr_minus1(orig):
        def f(rows, act_kv, sparse_mode):
            thr, limit = orig(rows, act_kv, sparse_mode)
            if sparse_mode == 3:
                thr = np.where(rows.valid, thr - 1, thr)
                limit = np.clip(np.minimum(act_kv[rows.batch], thr), 0, None)
            return thr, limit

        return f

    def minus1_continues(orig):
        return lambda indices, threshold, limit, sbs: _select(indices, threshold, limit, sbs, stop_at_minus1=False)

    def drop_last_tile(orig):
        def f(indices, threshold, limit, sbs):
            tok, valid = orig(indices, threshold, limit, sbs)
            n = valid.sum(axis=1)
            rank = np.cumsum(valid, axis=1) - 1
            last = ((n - 1) // 128) * 128
            drop = valid & (n[:, None] > 128) & (rank >= last[:, None])
            return np.where(drop, 0, tok), valid & ~drop

        return f

    def sbs_stride(orig):
        return lambda indices, threshold, limit, sbs: _select(indices, threshold, limit, sbs, stride=1)

    def mode0_causal(kw):
        kw["sparse_mode"] = 3
        return kw

    def act_q_first(orig):
        def f(rows, act_kv, sparse_mode):
            import dataclasses

            r2 = dataclasses.replace(rows, act_q=np.full_like(rows.act_q, rows.act_q[0]))
            return orig(r2, act_kv, sparse_mode)

        return f

    def pa_mod16(orig):
        def f(layout_kv, key_shape, *a, **k):
            m = orig(layout_kv, key_shape, *a, **k)
            if layout_kv == "PA_BSND" and m.block_size > 16:
                base = m.storage_rows

                def storage_rows(batch, tok):
                    tok = np.asarray(tok, np.int64)
                    return base(batch, tok) - tok % m.block_size + tok % 16

                m.storage_rows = storage_rows
            return m

        return f

    for op, tag in ((QSFA, "qsfa"), (SFA, "sfa")):
        _add(f"{tag}.causal_threshold_off_by_one", op, "causal threshold actKV - actQ + i (the + 1 missing)",
             _patch((A, "row_limits", thr_minus1)))
        _add(f"{tag}.minus1_not_stopping", op, "a -1 entry is skipped but the entries after it are still read",
             _patch((A, "selected_tokens", minus1_continues)))
        _add(f"{tag}.pa_block_row_mod16", op, "PA: the row inside a block is token % 16 (wrong for block_size > 16)",
             _patch((A, "kv_map", pa_mod16)))
        _add(f"{tag}.batch_act_q_of_first", op,
             "the causal threshold uses batch 0's actual query length for every batch (wrong for batch >= 2)",
             _patch((A, "row_limits", act_q_first)))
    _add("qsfa.last_tile_dropped", QSFA, "a row selecting > 128 tokens drops its last 128-token tile",
         _patch((A, "selected_tokens", drop_last_tile)))
    _add("qsfa.sparse_block_stride", QSFA, "sparse_block_size > 1: entry t covers tokens [t, t + sbs)",
         _patch((A, "selected_tokens", sbs_stride)))
    _add("qsfa.sparse_mode0_as_causal", QSFA, "sparse_mode 0 is treated as 3 (causal)", _args(mode0_causal))

    def bf16_sum(orig):
        def f(q, q_facts, k, k_facts, v, v_facts, valid, scale, qdtype, probability_rounding, *rest):
            o, m, l = orig(q, q_facts, k, k_facts, v, v_facts, valid, scale, qdtype, probability_rounding, *rest)
            if probability_rounding != "normalised":
                lb = l.astype(ml_dtypes.bfloat16).astype(np.float32)
                with np.errstate(invalid="ignore", divide="ignore"):
                    o = np.where(lb[..., None] > 0, (o * l[..., None]).astype(np.float32) / lb[..., None], o)
            return o.astype(np.float32), m, l

        return f

    _add("qsfa.final_divide_by_bf16_sum", QSFA, "the output is divided by the softmax sum rounded to bf16",
         _patch((A, "_faithful_chunk", bf16_sum)))
    _add("qsfa.final_divide_by_bf16_sum.950", QSFA, "950: the output is divided by the softmax sum rounded to bf16 "
         "(no LSE there: only the output shows it)", _patch((A, "_faithful_chunk", bf16_sum)), "950")

    def big_pages_only(make):
        def outer(ref):
            bug = make(ref)

            def impl(**kw):
                big = kw.get("layout_kv") == "PA_BSND" and np.shape(kw["key"])[1] >= 128
                return (bug if big else ref)(**kw)

            return impl

        return outer

    _add("qsfa.pa128_minus1_not_stopping", QSFA,
         "PA with block_size >= 128: a -1 entry is skipped but the entries after it are still read",
         big_pages_only(_patch((A, "selected_tokens", minus1_continues))))

    def key_bytes(change):
        def ch(kw):
            key = np.array(kw["key"], copy=True)
            b = key.view(np.uint8)
            change(b, int(kw["rope_head_dim"]))
            kw["key"] = key
            return kw

        return _args(ch)

    def scale_offset(b, rope):
        if rope:
            b[..., 640:656] = b[..., 576:592]  # reads the scales at 512 + rope instead of 512 + 2 * rope

    def first_tile_scale(b, rope):
        off = 512 + 2 * rope
        for t in range(1, 4):
            b[..., off + 4 * t:off + 4 * t + 4] = b[..., off:off + 4]

    _add("qsfa.scale_read_at_wrong_offset", QSFA, "tile scales read at byte 512 + rope_head_dim",
         key_bytes(scale_offset))
    _add("qsfa.scale_of_first_tile", QSFA, "every NoPE tile is dequantised with the first tile's scale",
         key_bytes(first_tile_scale))

    def max_unscaled(kw, out):
        o, m, s = out
        if m.size and kw.get("return_softmax_lse"):
            m = (m / np.float32(kw["scale_value"])).astype(m.dtype)
        return o, m, s

    _add("qsfa.softmax_max_unscaled", QSFA, "softmax_max is the raw q.k maximum (before scale_value)",
         _outputs(max_unscaled))

    def no_sink(kw):
        kw["sinks"] = None
        return kw

    def sink_in_lse(kw):
        kw["lse_includes_sink"] = not kw.get("lse_includes_sink", False)
        return kw

    _add("sfa.sinks_ignored", SFA, "the attention sinks are ignored", _args(no_sink))
    _add("sfa.lse_includes_sink_flipped", SFA, "lse_includes_sink is read inverted", _args(sink_in_lse))

    def v_is_k(kw):
        if kw.get("value") is not None and kw["value"].shape == kw["key"].shape:
            kw["value"] = None
        return kw

    _add("sfa.value_ignored", SFA, "V is taken from the key even when a value is given", _args(v_is_k))

    # indexers
    def ties_high(orig):
        def f(scores, k, n_valid):
            rev = scores[:, ::-1]
            c, s = scores.shape
            kk = min(k, s)
            order = (s - 1 - np.argsort(-rev, axis=1, kind="stable"))[:, :kk]
            vals = np.take_along_axis(scores, order, axis=1)
            take = np.arange(kk)[None, :] < np.minimum(n_valid, k)[:, None]
            idx = np.full((c, k), -1, np.int32)
            val = np.full((c, k), -np.inf, np.float32)
            idx[:, :kk] = np.where(take, order, -1)
            val[:, :kk] = np.where(take, vals, -np.inf)
            return idx, val

        return f

    for op, tag in ((LI, "lightning_indexer"), (QLI, "quant_lightning_indexer")):
        _add(f"{tag}.ties_by_higher_index", op, "equal scores are ordered by higher token index first",
             _patch((I, "top_k_desc", ties_high)))
        _add(f"{tag}.causal_threshold_off_by_one", op, "causal threshold actKV - actQ + i (the + 1 missing)",
             _patch((I, "row_limits", thr_minus1)))
    _add("lightning_indexer.pa_block_row_mod16", LI, "PA: the row inside a block is token % 16",
         _patch((I, "kv_map", pa_mod16)))

    def short_k(kw, out):
        idx = out[0] if isinstance(out, tuple) else out
        idx = np.array(idx, copy=True)
        k = idx.shape[-1]
        if k > 1:
            idx[..., k - 1] = -1  # a k-1 loop bound: the last slot is never filled
        return (idx, out[1]) if isinstance(out, tuple) else idx

    _add("lightning_indexer.last_topk_slot_unfilled", LI, "the sparse_count-th index is never written (-1)",
         _outputs(short_k))

    def scale_order(orig):
        def f(query_rows, key_rows, head_weights, *, key_scale_rows=None, query_scale=None, **k):
            if key_scale_rows is None:
                return orig(query_rows, key_rows, head_weights, **k)
            return _indexer_run_scale_order(orig, query_rows, key_rows, head_weights, key_scale_rows,
                                            query_scale, **k)

        return f

    _add("quant_lightning_indexer.scale_order", QLI,
         "scores multiply (dot * sq) * sk instead of dot * (sq * sk) (one fp32 rounding apart)",
         _patch((I, "_run", scale_order)))

    def key_scale_first(kw):
        ks = np.array(kw["key_dequant_scale"], copy=True)
        kw["key_dequant_scale"] = np.broadcast_to(ks.reshape(-1)[:1], ks.shape).reshape(ks.shape).copy()
        return kw

    _add("quant_lightning_indexer.key_scale_of_first_token", QLI, "every key token uses token 0's dequant scale",
         _args(key_scale_first))


def _indexer_run_scale_order(orig, query_rows, key_rows, head_weights, key_scale_rows, query_scale, **k):
    """The reference driver with ``dots * (sq * sk)`` replaced by ``(dots * sq) * sk`` (both fp32)."""
    I = _m("indexer")
    real_dot = I._dot_f32
    state = {}  # the query scales of the chunk whose rows were loaded last (the dot product follows)

    def q_rows(r):
        q, facts = query_rows(r)
        state["qs_next"] = query_scale(r)
        return q, facts

    def dot_then_q(a, b, af, bf):
        d = real_dot(a, b, af, bf)
        qs = state["qs_next"]
        c, n1 = qs.shape
        return (d.reshape(c, n1, -1) * qs[:, :, None]).astype(np.float32).reshape(d.shape)

    with _patched((I, "_dot_f32", dot_then_q)):
        return orig(q_rows, key_rows, head_weights, key_scale_rows=key_scale_rows,
                    query_scale=lambda r: np.ones_like(query_scale(r)), **k)


def _merge():
    def empty_included(kw, out):
        s = np.asarray(kw["softmax_sum"])
        if not (s == 0).any():
            return out
        o, m, l = out  # an empty shard's max (0) still joins the running max
        m2 = np.maximum(m, np.where((s == 0).any(axis=0), np.zeros_like(m), m))
        return o, m2.astype(m.dtype), l

    _add("merge_attention_lse.empty_shard_max", MERGE, "an empty shard's softmax_max (0) joins the merged max",
         _outputs(empty_included))

    def sum_not_rescaled(kw, out):
        o, m, l = out
        s = np.asarray(kw["softmax_sum"]).astype(np.float64).sum(axis=0)
        return o, m, s.astype(l.dtype)

    _add("merge_attention_lse.sum_not_rescaled", MERGE, "softmax_sum is the plain sum of the shards' sums",
         _outputs(sum_not_rescaled))

    def fp32_no_max(kw, out):
        o, m, l = out
        mp = np.asarray(kw["softmax_max"]).astype(np.float32)
        lp = np.asarray(kw["softmax_sum"]).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            w = lp * np.exp(mp)  # exp of the raw max: overflows in fp32 above 88
            tot = w.sum(axis=0)
        bad = ~np.isfinite(tot) & (lp > 0).any(axis=0)
        if not bad.any():
            return out
        o = np.array(o, copy=True)
        lay = kw["layout_query"]
        bad_o = bad[:, 0] if lay == "BSND" else bad[0]
        o[bad_o] = np.nan
        return o, m, l

    _add("merge_attention_lse.no_max_subtraction", MERGE,
         "weights exp(max_p) * sum_p without subtracting the merged max (fp32 overflow above 88)",
         _outputs(fp32_no_max))


def _indexer_cache():
    IC = _m("indexer_cache")
    IQC, ICE2 = "indexer_quant_cache", "indexer_compress_epilog_v2"

    def floor_pow2(orig):
        def f(s):
            b = np.ascontiguousarray(np.asarray(s, np.float32)).view(np.uint32)
            return ((b >> np.uint32(23)) << np.uint32(23)).view(np.float32)

        return f

    _add("indexer_quant_cache.scale_floor_pow2", IQC,
         "power-of-two scales (MX-FP8, FP8 with round_scale) are floored instead of ceiled",
         _patch((IC, "round_scale_pow2", floor_pow2)))

    def high_first(orig):
        return lambda codes: orig(codes, nibble_order="high_first")

    _add("indexer_quant_cache.fp4_nibbles_swapped", IQC, "MX-FP4 packs element 2i in the high nibble",
         _patch((IC, "pack_fp4", high_first)))

    def no_sticky(orig):
        def f(x):
            x = np.asarray(x)
            return orig(x.astype(np.float32).astype(ml_dtypes.bfloat16) if x.dtype == np.float16 else x)

        return f

    _add("indexer_quant_cache.fp16_no_sticky_bit", IQC,
         "float16 x rounded to bf16 (ties to even) before MX-FP4 instead of the kernel's sticky-bit truncation",
         _patch((IC, "mxfp4_quant", no_sticky)))

    def no_x_scale(kw):
        kw["x_scale"] = 1.0
        return kw

    _add("indexer_quant_cache.x_scale_ignored", IQC, "x_scale is ignored (HiFloat8 mode)", _args(no_x_scale))

    def nan_zero_group(orig):
        def f(x):
            codes, s = orig(x)
            zero = np.repeat(s == 0, 128, axis=1)[:, :codes.shape[1]]
            return np.where(zero, np.uint8(0x7F), codes), s

        return f

    _add("indexer_compress_epilog_v2.zero_group_nan", ICE2,
         "an all-zero group casts 0 / 0 = NaN (0x7F) instead of keeping x",
         _patch((IC, "epilog_v2_quant", nan_zero_group)))
    def row_amax(orig):
        def f(x):
            xf = np.asarray(x).astype(np.float32)
            t, d = xf.shape
            amax = np.abs(xf).max(axis=1, keepdims=True)
            s = np.repeat(np.where(amax != 0, amax * IC.RECIP_448, 0).astype(np.float32), -(-d // 128), axis=1)
            with np.errstate(divide="ignore", invalid="ignore"):
                y = xf / np.repeat(s, 128, axis=1)[:, :d]
            return IC.encode(np.where(np.isnan(y), xf, y), "float8_e4m3fn", rounding="rint"), s

        return f

    _add("indexer_compress_epilog_v2.row_amax", ICE2, "every group of 128 takes the amax of the whole row",
         _patch((IC, "epilog_v2_quant", row_amax)))


def _k_scale_cache():
    KS = _m("k_scale_cache")
    SPKS = "scatter_pa_kv_cache_with_k_scale"

    def int64_read_as_int32(kw):
        sm = np.ascontiguousarray(kw["slot_mapping"])
        if sm.dtype == np.int64:
            kw["slot_mapping"] = sm.view(np.int32)[:sm.size].astype(np.int64)
        return kw

    _add("scatter_pa_kv_cache_with_k_scale.int64_slots_read_as_int32", SPKS,
         "int64 slot_mapping read as int32 words (the low and high halves of slot 0 become slots 0 and 1)",
         _args(int64_read_as_int32))

    def scale_head0(kw):
        ks = np.array(kw["key_scale"], copy=True)
        ks[:] = ks[:, :1]
        kw["key_scale"] = ks
        return kw

    _add("scatter_pa_kv_cache_with_k_scale.scale_of_head0", SPKS, "every head stores head 0's K scale",
         _args(scale_head0))


def _indexer_batches():
    def shortest_key(kw):
        lk = kw.get("actual_seq_lengths_key")
        if lk is not None and kw.get("layout_key") != "TND" and np.asarray(lk).size > 1:
            lk = np.asarray(lk)
            kw["actual_seq_lengths_key"] = np.full_like(lk, lk.min())
        return kw

    for op in (LI, QLI):
        _add(f"{op}.shortest_batch_key_length", op,
             "every batch sees only as many keys as the shortest batch (a per-call length read once)",
             _args(shortest_key))


def _chip_cells():
    """One mutant per attention cell of docs/numerics/chips.md: the kernel of that chip rounds that point the other
    way (RINT <-> ROUND, both query dtypes) - what a kernel built with the other chip's cast trait does."""
    flip = {"rint": "round", "round": "rint"}

    def flipped(point):
        def ch(kw):
            kw[f"{point}_rounding"] = flip[kw[f"{point}_rounding"]]
            return kw

        return _args(ch)

    names = {"k": "the dequantised K", "p": "P = exp(s - max)", "out": "the attention output"}
    for chip in ("A2", "950"):
        for op, tag, points in ((QSFA, "qsfa", ("k", "p", "out")), (SFA, "sfa", ("p", "out"))):
            for point in points:
                _add(f"{tag}.{point}_rounding_flipped.{chip}", op,
                     f"{chip}: {names[point]} cast to the query dtype with the other rounding mode (RINT <-> ROUND)",
                     flipped(point), chip)


def _tie_cells():
    """One mutant per non-attention and V4 cell of docs/numerics/chips.md, on each chip that has it: the kernel of
    that chip rounds (or saturates) that point the other way - each a bug the ``<op>.rounding_ties`` properties
    (qsfa.conformance.properties_ties) build exact ties for."""
    R = _m("kv_rmsnorm_rope_cache")
    F = _m("formats")
    KRR, DBQ = "kv_rmsnorm_rope_cache", "dynamic_block_quant"
    swap = {"rint": "round", "round": "rint"}

    def int8_away(orig):
        def f(x, fmt, scale, offset=None, *more, **kw):
            if fmt != "int8":
                return orig(x, fmt, scale, offset, *more, **kw)
            n, d = x.shape[1], x.shape[-1]
            y = (x * R._bcast_param(scale, n, d)).astype(np.float32)
            if offset is not None:
                y = (y + R._bcast_param(offset, n, d)).astype(np.float32)
            return np.clip(_away(y), -128, 127).astype(np.int8).view(np.uint8)

        return f

    def encode_flipped(fmts):
        def factory(orig):
            def f(x, fmt, *a, rounding="rint", **kw):
                return orig(x, fmt, *a, rounding=swap.get(rounding, rounding) if fmt in fmts else rounding, **kw)

            return f

        return factory

    def q16_away(orig):
        def f(x, dtype):
            dt = np.dtype(dtype) if not isinstance(dtype, str) else None
            name = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}.get(dt)
            if name is None:
                return orig(x, dtype)
            from ..reference.attention import round_q16

            return round_q16(np.asarray(x, np.float32), name, "round")

        return f

    for chip in ("A2", "950"):
        _add(f"kv_rmsnorm_rope_cache.int8_rounding_flipped.{chip}", KRR,
             f"{chip}: the int8 cache cast rounds ties away from zero (RINT in the kernel)",
             _patch((R, "static_quant", int8_away)), chip)
        _add(f"kv_rmsnorm_rope_cache.16bit_rounding_flipped.{chip}", KRR,
             f"{chip}: the 16-bit cache cast rounds ties away from zero (RINT in the kernel)",
             _patch((R, "round_to_dtype", q16_away)), chip)
    _add("kv_rmsnorm_rope_cache.fp8_rounding_flipped.950", KRR,
         "950: the FP8 cache casts round ties away from zero (RINT in the kernel)",
         _patch((F, "encode", encode_flipped(("float8_e4m3fn", "float8_e5m2")))), "950")
    def hif8_toward_zero(orig):  # ties one code toward zero: "round" of the next fp32 value toward zero
        def f(x, fmt, *a, rounding="rint", **kw):
            if fmt == "hifloat8" and rounding == "round":
                x = np.asarray(x, np.float32)
                x = np.where(np.isfinite(x), np.nextafter(x, np.float32(0)), x).astype(np.float32)
            return orig(x, fmt, *a, rounding=rounding, **kw)

        return f

    _add("kv_rmsnorm_rope_cache.hifloat8_ties_toward_zero.950", KRR,
         "950: the HiFloat8 cache cast rounds ties toward zero (ROUND, ties away, in the kernel)",
         _patch((F, "encode", hif8_toward_zero)), "950")

    def saturating(kw):
        kw["hifloat8_overflow"] = "saturate"
        return kw

    _add("kv_rmsnorm_rope_cache.hifloat8_saturates.950", KRR,
         "950: the HiFloat8 cache cast saturates to 32768 (the kernel's SatMode::NO_SAT writes Inf)",
         _args(saturating), "950")

    def order_flipped(kw):
        kw["scale_order"] = {"reciprocal": "divide", "divide": "reciprocal"}.get(kw["scale_order"], kw["scale_order"])
        return kw

    def mode_flipped(dsts):
        def ch(kw):
            if kw["dst_type"] in dsts:
                kw["round_mode"] = swap.get(kw["round_mode"], kw["round_mode"])
            return kw

        return _args(ch)

    for chip in ("A2", "950"):
        _add(f"dynamic_block_quant.scale_order_flipped.{chip}", DBQ,
             f"{chip}: the other chip's scale order (reciprocal multiply <-> divide)", _args(order_flipped), chip)
        _add(f"dynamic_block_quant.int8_rounding_flipped.{chip}", DBQ,
             f"{chip}: the int8 cast rounds with the other mode than round_mode", mode_flipped(("int8",)), chip)
    _add("dynamic_block_quant.fp8_rounding_flipped.950", DBQ, "950: the FP8 casts round with the other mode than "
         "round_mode", mode_flipped(("float8_e4m3fn", "float8_e5m2")), "950")
    _add("dynamic_block_quant.hifloat8_ties_toward_zero.950", DBQ, "950: the HiFloat8 cast of round_mode 'round' "
         "rounds ties toward zero", _patch((F, "encode", hif8_toward_zero)), "950")

    def flipped(point):
        def ch(kw):
            kw[f"{point}_rounding"] = swap[kw.get(f"{point}_rounding", "rint")]
            return kw

        return _args(ch)

    def tile_flipped(kw):
        kw["s2_tile"] = 128 if kw.get("s2_tile", 512) == 512 else 512
        return kw

    for chip in ("A2", "950"):
        _add(f"sfm.s2_tile_flipped.{chip}", "sparse_flash_mla",
             f"{chip}: the online softmax steps over the other chip's S2 tile (512 <-> 128 tokens)", _args(tile_flipped),
             chip)
    names = {"k": "the quant_mode 1 dequantised K", "p": "P = exp(S - m')", "out": "the attention output"}
    for op, tag, chips, points in (("sparse_flash_mla", "sfm", ("A2", "950"), ("p", "out")),
                                   ("sparse_attn_sharedkv", "sas", ("A3",), ("p", "out")),
                                   ("mixed_quant_sparse_flash_mla", "mqsfm", ("950",), ("k", "p", "out")),
                                   ("kv_quant_sparse_attn_sharedkv", "kqsas", ("950",), ("p", "out"))):
        for chip in chips:
            for point in points:
                _add(f"{tag}.{point}_rounding_flipped.{chip}", op,
                     f"{chip}: {names[point]} cast to bf16 / fp16 with the other rounding mode (RINT <-> ROUND)",
                     flipped(point), chip)


def scratch_writer(op: str, output: str, *, shift: int = 0):
    """A mutant maker that fills the bytes ``op``'s layout leaves unspecified in ``output``
    (:func:`qsfa.layouts.unspecified_bytes`) with fresh random bytes on every call, as a kernel that leaves scratch
    there; ``shift`` moves the garbage that many bytes along the last axis (``shift=-1``: onto specified bytes,
    a real bug). Shifted garbage is the inverted byte, never random: a random byte equals the right one with
    probability 1/256, and hypothesis then saw the bug vanish when it replayed the example (a FlakyFailure)."""

    def change(kw, out):
        from ..layouts import unspecified_bytes

        m = unspecified_bytes(op, kw).get(output)
        res = out[0] if isinstance(out, tuple) else out
        if m is None:
            return out
        b = np.asarray(res).view(np.uint8)
        if shift:
            m = np.roll(m, shift, axis=-1)
            b[m] = ~b[m]
        else:
            b[m] = np.random.default_rng().integers(0, 256, int(m.sum()), dtype=np.uint8)
        return out

    return _outputs(change)


def _pad_scratch():
    """Must-pass controls: scratch in the bytes the layouts leave unspecified is allowed (docs/numerics/layouts.md)."""
    _add("layouts.m1_pad_scratch", "layouts.flashmla_model1_quantize",
         "control: MODEL1 pad bytes and block padding left as scratch (FlashMLA's torch.empty cache)",
         scratch_writer("layouts.flashmla_model1_quantize", "cache"), control=True)
    _add("kv_compress_epilog_vllm.scale_pad_scratch", "kv_compress_epilog_vllm",
         "control: layout-2 scale padding copied from scratch (the kernel's behaviour)",
         scratch_writer("kv_compress_epilog_vllm", "kv_compress_cache"), "950", control=True)


def _v4():
    """DeepSeek-V4 shared-KV attention (docs/numerics/attention-v4.md)."""
    from ..reference import sharedkv as skv

    sfm = "sparse_flash_mla"

    def window_off_by_one(orig):
        def sel(*a, **k):  # the band starts one token late: thr - ori_win_left instead of thr - ori_win_left - 1
            wl = k["ori_win_left"]
            return orig(*a, **{**k, "ori_win_left": wl - 1 if wl > 0 else wl})

        return sel

    _add(f"{sfm}.window_off_by_one", sfm, "the band window starts at thr - ori_win_left (one token late)",
         _patch((skv, "select_tokens", window_off_by_one)))

    def no_residual(orig):
        def sel(bat, pos, s1, valid, ori_len, cmp_len, cmp_residual_kv, *a, **k):
            return orig(bat, pos, s1, valid, ori_len, cmp_len, None, *a, **k)

        return sel

    _add(f"{sfm}.bound_without_residual", sfm,
         "the compressed causal bound uses the window cache's length instead of S3 * cmp_ratio + cmp_residual_kv",
         _patch((skv, "select_tokens", no_residual)))

    def sink_numerator(ref):
        def impl(**kw):  # the sink joins the row as one more key whose value is the row's first selected key
            out, lse = ref(**kw)
            if kw.get("sinks") is None:
                return out, lse
            plain, _ = ref(**{**kw, "sinks": None, "return_softmax_lse": False})
            return ((out.astype(np.float64) + (plain.astype(np.float64) - out.astype(np.float64)) * 0.5)
                    .astype(out.dtype)), lse

        return impl

    _add(f"{sfm}.sink_weight_halved", sfm,
         "the sink's share of the denominator is half what it should be (out halfway to the sink-free output)",
         sink_numerator)


    # quant_sparse_flash_mla (HiFloat8): the descale and decode points of the arch35 kernel
    hq = _m("sharedkv_hif8")
    qs = "quant_sparse_flash_mla"

    def kv_descale_twice(orig):
        return lambda ss, dq, dk: orig(ss, dq, np.float32(np.float32(dk) * np.float32(dk)))

    _add(f"{qs}.kv_descale_twice", qs, "the KV descale multiplies the logit scale twice (softmax_scale * dq * dk^2)",
         _patch((hq, "descale_product", kv_descale_twice)))

    def decode_next_code(orig):
        t = orig.copy()
        t[1:0x6F] = orig[2:0x70]  # every positive finite code decodes as the code above it
        return t

    _add(f"{qs}.hif8_decode_off_by_one", qs, "a positive HiFloat8 code decodes to the next code's value",
         _patch((hq, "_HIF8_VALUES", decode_next_code)))
    _add(f"{qs}.p_unscaled", qs, "P is cast to HiFloat8 without the x16 scale (and the output not divided by 16)",
         _args(lambda kw: {**kw, "p_scale": 1.0} if "p_scale" in kw else kw))


_BUILT = False


def _indexer_v4():
    V = _m("indexer_v4")
    VQLI = "vllm_quant_lightning_indexer"

    def compress_first(orig):
        def f(rows, act_kv_orig, sparse_mode, cmp_ratio):
            if sparse_mode != 3:
                return orig(rows, act_kv_orig, sparse_mode, cmp_ratio)
            akv = act_kv_orig[rows.batch] // cmp_ratio
            n = np.minimum(akv - rows.act_q[rows.batch] + rows.pos + 1, akv)
            return np.where(rows.valid, np.clip(n, 0, None), 0).astype(np.int64)

        return f

    _add(f"{VQLI}.causal_offset_on_compressed_length", VQLI,
         "causal visibility actKV // cmp_ratio - actQ + i + 1 (the offset applied after compressing the key length)",
         _patch((V, "visible_compressed", compress_first)))

    def ties_high(orig):
        def f(scores, k, n_valid):
            s = scores.shape[1]
            idx, val = orig(scores[:, ::-1], k, n_valid)
            return np.where(idx >= 0, s - 1 - idx, -1).astype(np.int32), val

        return f

    _add(f"{VQLI}.ties_by_higher_index", VQLI, "equal scores are ordered by higher compressed-token index first",
         _patch((V, "top_k_desc", ties_high)))


def _qli2():
    V = _m("indexer_v4")
    QLI2 = "quant_lightning_indexer_v2"

    def no_residual(orig):
        def f(rows, s2, residual, mask_mode, cmp_ratio):
            return orig(rows, s2, np.zeros_like(residual), mask_mode, cmp_ratio)

        return f

    _add(f"{QLI2}.residual_ignored", QLI2,
         "causal visibility from seqused_k * cmp_ratio alone (cmp_residual_k dropped from the original length)",
         _patch((V, "visible_v2", no_residual)))

    def hif8_as_e4m3(orig):
        def f(q, k, fmt):
            return orig(q, k, "float8_e4m3fn" if fmt == "hifloat8" else fmt)

        return f

    _add(f"{QLI2}.hifloat8_decoded_as_e4m3", QLI2, "quant_mode 4 codes decoded as FP8 E4M3FN instead of HiFloat8",
         _patch((V, "_dots", hif8_as_e4m3)))


def _qkv_k_scale():
    Q = _m("qkv_k_scale")
    QKVS = "qkv_rms_norm_rope_cache_with_k_scale"

    def no_history(orig):
        def f(query_start_loc, seq_lens, n_tokens):
            return orig(query_start_loc, np.asarray(query_start_loc)[1:] - np.asarray(query_start_loc)[:-1],
                        n_tokens)

        return f

    _add(f"{QKVS}.positions_without_history", QKVS, "RoPE positions count from 0 in every request (seq_lens ignored)",
         _patch((Q, "positions", no_history)))

    def sin_sign(orig):
        def f(y, cos, sin):
            return orig(y, cos, -sin)

        return f

    _add(f"{QKVS}.rope_rotates_the_other_way", QKVS, "RoPE with the sine's sign flipped (y_lo c + y_hi s, ...)",
         _patch((Q, "rope_half_split_f32", sin_sign)))

    def one_rounding(orig):
        def f(r):
            amax = np.abs(r).max(axis=-1)
            scale = (amax / np.float32(127)).astype(np.float32)
            y = r / np.where(scale > 0, scale, np.float32(1))[..., None]
            return np.clip(np.rint(y), -128, 127).astype(np.int8), scale

        return f

    _add(f"{QKVS}.mrope_int8_one_rounding", QKVS,
         "M-RoPE K: r / scale rounded straight to INT8 (no fp16 step in between)",
         _patch((Q, "quant_per_head_int8", one_rounding)))

    def h_w_swapped(orig):
        return lambda section: orig([section[0], section[2], section[1]])

    _add(f"{QKVS}.mrope_h_w_sections_swapped", QKVS, "M-RoPE lanes: the H and W section sizes swapped",
         _patch((Q, "mrope_lane_axes", h_w_swapped)))

    def nearest_scale(orig):
        def f(amax):
            a = np.abs(np.asarray(amax, np.float64))
            with np.errstate(divide="ignore"):
                k = np.where(a > 0, np.rint(np.log2(np.where(a > 0, a, 1.0) / 448.0)), -127)
            return np.where(np.isfinite(a), np.clip(k + 127, 0, 254), 255).astype(np.uint8)

        return f

    _add(f"{QKVS}.mx_scale_rounded_to_nearest", QKVS,
         "M-RoPE MX: the E8M0 exponent log2(amax / 448) rounded to nearest instead of up",
         _patch((Q, "mx_scale_bytes", nearest_scale)))

    def rows_only(orig):
        return lambda t, nq, nk, aiv_num=None, ub_bytes=None: np.zeros(t, bool)

    _add(f"{QKVS}.mx_k_always_row_path", QKVS,
         "M-RoPE MX: every K row normalised first (the 16-row batch path of Nk = 2 / 4 ignored)",
         _patch((Q, "mx_k_batch_tokens", rows_only)))


def _compressor():
    C, CMP = _m("compressor"), "compressor"

    def no_ape(kw):
        kw["ape"] = np.zeros_like(kw["ape"])
        return kw

    _add(f"{CMP}.ape_ignored", CMP, "the positional bias ape is not added to the scores", _args(no_ape))

    def missing_weighs(orig):
        def f(kv, sc, *a):
            return orig(kv, np.where(np.isneginf(sc), 0.0, sc).astype(sc.dtype), *a)

        return f

    _add(f"{CMP}.overlap_missing_slots_weigh", CMP,
         "group 0's missing previous-group slots (coff 2) take the score 0 instead of weighing nothing",
         _patch((C, "_reduce", missing_weighs)))

    def residual_lost(ref):
        def impl(**kw):
            before = np.array(kw["state_cache"], copy=True)
            cmp_kv, state = ref(**kw)
            if int(kw["cache_mode"]) != 1:
                return cmp_kv, state
            x = np.asarray(kw["x"])
            base, used, start, nb = C.plan(x.shape, kw.get("cu_seqlens"), kw.get("seqused"), kw.get("start_pos"),
                                           int(kw["cmp_ratio"]))
            table, bs, r = np.asarray(kw["state_block_table"]), state.shape[1], int(kw["cmp_ratio"])
            for b in range(nb):  # the tokens after the last full group never reach the state
                for p in range((start[b] + used[b]) // r * r, start[b] + used[b]):
                    blk = table[b, p // bs]
                    if blk:
                        state[blk, p % bs] = before[blk, p % bs]
            return cmp_kv, state

        return impl

    QCMP = "quant_compressor"

    def no_x_descale(kw):
        kw["x_descale"] = np.ones_like(kw["x_descale"])
        return kw

    def swapped_descales(kw):
        kw["wkv_descale"], kw["wgate_descale"] = kw["wgate_descale"], kw["wkv_descale"]
        return kw

    _add(f"{QCMP}.x_descale_ignored", QCMP, "the dots are dequantised by the weight descale only", _args(no_x_descale))
    _add(f"{QCMP}.descales_swapped", QCMP, "wkv's descale applied to the score and wgate's to the kv",
         _args(swapped_descales))

    _add(f"{CMP}.residual_not_saved", CMP, "the residual (tokens after the last complete group) is not written to "
         "the state, so the next call cannot finish its group", residual_lost)


def _vllm_compressor():
    VR, VCMP = _m("vllm_compressor"), "vllm_compressor"

    def cast_first(orig):
        def f(*a, **kw):  # the reduce's rows rounded to x's dtype (the ops-transformer kernel's CAST_ROUND) first
            cmp_kv, state = orig(*a, **{**kw, "raw_rows": False})
            return cmp_kv.astype(np.float64 if kw.get("precision") == "exact" else np.float32), state

        return f

    _add(f"{VCMP}.norm_after_a_cast", VCMP, "the compressed rows are cast to x's dtype (CAST_ROUND) before the "
         "RMSNorm instead of going to it in fp32", _patch((VR, "compressor", cast_first)))

    def other_mode(orig):
        return lambda r, rotary_mode: orig(r, 3 - rotary_mode)

    _add(f"{VCMP}.rotary_modes_swapped", VCMP, "rotary_mode 1 pairs lanes as interleave and 2 as half",
         _patch((VR, "_rotate", other_mode)))


def _build():
    global _BUILT
    if _BUILT:
        return
    _BUILT = True
    for f in (_formats, _quant, _scatter, _c8, _kce, _krr, _attention, _merge, _indexer_cache, _k_scale_cache,
              _indexer_batches, _chip_cells, _pad_scratch, _indexer_v4, _v4, _qli2, _qkv_k_scale, _compressor, _tie_cells,
              _vllm_compressor):
        f()
    names = [m.name for m in _MUTANTS]
    assert len(names) == len(set(names)), "duplicate mutant names"


def mutants(patterns=None) -> list[Mutant]:
    """Every mutant (or those whose name or operator matches one of the fnmatch ``patterns``)."""
    _build()
    ops = operators()
    out = [m for m in _MUTANTS if m.op in ops]
    if patterns:
        out = [m for m in out if any(fnmatch.fnmatchcase(m.name, p) or m.op == p for p in patterns)]
    return out


def __getattr__(name):
    if name == "MUTANTS":
        return mutants()
    raise AttributeError(name)

