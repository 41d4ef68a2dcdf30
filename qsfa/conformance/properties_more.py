"""Metamorphic properties of the cache-family operators added beside the first catalogue.

:func:`more_properties` is called by :func:`qsfa.conformance.properties.catalogue` with the set of operators
that have strategies; each property here is built the same way as those of :mod:`.properties` and its
expectation is derived independently of the reference (a float64 model or a relation between two calls).

* FlashMLA MODEL1 cache (``docs/numerics/flashmla-model1.md``): quantise-dequantise round trip
  (RoPE bits exact, NoPE within half an E4M3 step of its tile scale, scale bytes as the rule says, pad bytes
  unspecified) and requantisation stability (dequantised values quantise back to themselves).
* vLLM-Ascend's kv_compress_epilog (``docs/numerics/cache-writers.md#kv_compress_epilog_vllm``): layouts 1 and 2
  store the same bytes per token, and with power-of-two scales every code times its E8M0 scale is within half a
  step of the input (a float64 model).
* The lightning indexers (``docs/numerics/indexer.md``): shape invariance - every batch of a BSND query run alone
  (its query rows, weights, lengths and its keys or block-table row) selects the same indices as inside the batch.
* vllm_quant_lightning_indexer (``docs/numerics/indexer.md#vllm_quant_lightning_indexer``): the same batch
  invariance over its paged compressed key, and shape invariance over query rows (vLLM-Ascend #15053): rows
  ``[a, b)`` of a batch run as their own request (``actQ' = b - a``, original key length ``actKV - actQ + b``
  under the causal rule) select what they select inside the whole call.
* quant_lightning_indexer_v2 (``docs/numerics/indexer.md#quant_lightning_indexer_v2``): the same two properties
  in its own terms - a batch alone keeps its seqused / cmp_residual_k entries and its block-table row (or its
  BSND keys); a slice of query rows keeps the compressed keys and moves the causal anchor through cmp_residual_k
  (through seqused_k when cmp_ratio is 1, where the op_host allows no residual).
"""

from __future__ import annotations

import numpy as np

from ._support import call, fail

__all__ = ["more_properties"]

M1Q = "layouts.flashmla_model1_quantize"
M1D = "layouts.flashmla_model1_dequantize"
KCEV = "kv_compress_epilog_vllm"
LI, QLI = "lightning_indexer", "quant_lightning_indexer"
VQLI = "vllm_quant_lightning_indexer"
QLI2 = "quant_lightning_indexer_v2"


def _m1_round_trip(P, examples):
    def check(ex, backend: str):
        k = ex.args["k"]
        nb, bs = k.shape[0], k.shape[1]
        cache = call(M1Q, ex.args, backend)["cache"]
        back = call(M1D, dict(cache=cache, block_size=bs), backend)["k"]
        if back.shape != k.shape:
            fail(f"dequantised shape {back.shape} != {k.shape}")
        if not np.array_equal(back[..., 448:].view(np.uint16), k[..., 448:].view(np.uint16)):
            fail("RoPE bits changed in the round trip")
        x = k[..., :448].astype(np.float64).reshape(nb, bs, 7, 64)
        y = back[..., :448].astype(np.float64).reshape(nb, bs, 7, 64)
        amax = np.abs(x).max(axis=-1)
        e = np.ceil(np.log2(np.maximum(amax / 448.0, 1e-4)))  # float64: exact for every bf16 amax
        s = np.exp2(e)[..., None]
        err = np.abs(y - x)
        lim = np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10)
        if not (err <= lim).all():
            i = np.unravel_index(int(np.argmax(err - lim)), err.shape)
            fail(f"NoPE value {x[i]!r} came back as {y[i]!r} (tile scale {float(s[i[:3]][0])!r}): more than half "
                 "an E4M3 step away")
        sc = cache[:, bs * 576:bs * 584].reshape(nb, bs, 8)
        if not np.array_equal(sc[..., :7].astype(np.int64), e.astype(np.int64) + 127):
            fail("E8M0 scale bytes are not log2(2^ceil(log2(max(amax / 448, 1e-4)))) + 127")
        # the pad bytes (8th scale byte, block padding) are unspecified: FlashMLA never writes them
        # (qsfa.layouts.unspecified_bytes), so any value passes

    return P(f"{M1Q}.round_trip", (M1Q, M1D), "metamorphic",
             "dequantize(quantize(k)) keeps the RoPE bits, puts every NoPE value within half an E4M3 step of its "
             "tile's power-of-two scale (float64 model of 2^ceil(log2(max(amax / 448, 1e-4)))) and stores that "
             "scale's E8M0 byte; the pad bytes are unspecified (any value).", examples(M1Q), check)


def _m1_requantize(P, examples):
    def check(ex, backend: str):
        k = ex.args["k"]
        bs = k.shape[1]
        once = call(M1D, dict(cache=call(M1Q, ex.args, backend)["cache"], block_size=bs), backend)["k"]
        again = call(M1D, dict(cache=call(M1Q, dict(k=once), backend)["cache"], block_size=bs), backend)["k"]
        if not np.array_equal(once.view(np.uint16), again.view(np.uint16)):
            n = int((once.view(np.uint16) != again.view(np.uint16)).sum())
            fail(f"{n} dequantised values changed when quantised and dequantised again")

    return P(f"{M1Q}.requantize_stable", (M1Q, M1D), "metamorphic",
             "Dequantised values are fixed points: quantising and dequantising them again returns the same bf16 "
             "bits (each is an E4M3 value times a power-of-two scale no smaller than the new tile scale).",
             examples(M1Q), check)


def _kcev_tokens(a: dict, cache: np.ndarray):
    """Per valid token ``(codes, rope bytes, scale bytes)`` read back from a written cache (either layout)."""
    from ..reference import kv_compress_epilog_vllm as kv

    d, gs = a["x"].shape[1], a["quant_group_size"]
    n, g = d - 64, -(-(d - 64) // gs)
    slots = np.asarray(a["slot_mapping"]).astype(np.int64)
    s = slots[slots >= 0]
    b = cache.view(np.uint8)
    if a["layout"] == 1:
        rows = b[s, 0]
        return rows[:, 128:128 + n], rows[:, :128], rows[:, 128 + n:128 + n + g]
    nb, bs = b.shape[0], b.shape[1]
    blocks = np.ascontiguousarray(b).reshape(nb, -1)
    vpt, spt = kv.value_per_token(d), kv.scale_per_token(d, gs)
    blk, pos = s // bs, s % bs
    vals = blocks[blk[:, None], pos[:, None] * vpt + np.arange(vpt)]
    sc = blocks[blk[:, None], bs * vpt + pos[:, None] * spt + np.arange(g)]
    return vals[:, :n], vals[:, n:], sc


def _kcev_layouts(P, examples):
    def check(ex, backend: str):
        a = ex.args
        got = _kcev_tokens(a, call(KCEV, a, backend)["kv_compress_cache"])
        other = dict(a)
        slots = np.asarray(a["slot_mapping"]).astype(np.int64)
        t, d, gs = a["x"].shape[0], a["x"].shape[1], a["quant_group_size"]
        from ..reference import kv_compress_epilog_vllm as kv

        if a["layout"] == 1:
            other["layout"] = 2
            shape = (t, 1, 1, kv.value_per_token(d) + kv.scale_per_token(d, gs))
        else:
            other["layout"] = 1
            shape = (t, 1, kv.kv_cache_col(d, gs))
        other["kv_compress_cache"] = np.zeros(shape, np.uint8).view(a["kv_compress_cache"].dtype)
        remap = np.full(t, -1, np.int64)
        remap[slots >= 0] = np.arange(int((slots >= 0).sum()))  # the valid tokens, in order, to slots 0, 1, ...
        other["slot_mapping"] = remap.astype(slots.dtype)
        want = _kcev_tokens(other, call(KCEV, other, backend)["kv_compress_cache"])
        for name, g_, w_ in zip(("codes", "RoPE", "scales"), got, want):
            if not np.array_equal(g_, w_):
                fail(f"layout {a['layout']} and layout {other['layout']} store different {name} bytes")

    return P(f"{KCEV}.layouts_agree", (KCEV,), "metamorphic",
             "Layout 1 (padded rows) and layout 2 (blocks of values, then scales) store the same FP8 codes, RoPE "
             "bytes and E8M0 scale bytes for every token.", examples(KCEV), check)


def _kcev_half_step(P, examples):
    import ml_dtypes

    def check(ex, backend: str):
        a = ex.args
        codes, _, sc = _kcev_tokens(a, call(KCEV, a, backend)["kv_compress_cache"])
        fmt = np.dtype(a["kv_compress_cache"].dtype)
        e5m2 = fmt == np.dtype(ml_dtypes.float8_e5m2)
        mant, sub = (2, 2.0**-16) if e5m2 else (3, 2.0**-9)
        slots = np.asarray(a["slot_mapping"]).astype(np.int64)
        x = a["x"][slots >= 0, :codes.shape[1]].astype(np.float64)
        gs = a["quant_group_size"]
        s = np.exp2(np.repeat(sc.astype(np.float64) - 127, gs, axis=1)[:, :x.shape[1]])
        y = codes.view(fmt).astype(np.float64) * s
        lim = np.maximum(np.abs(x) * 2.0 ** -(mant + 1), s * sub / 2)
        if not (np.abs(y - x) <= lim).all():
            i = np.unravel_index(int(np.argmax(np.abs(y - x) - lim)), x.shape)
            fail(f"x {x[i]!r} is stored as {y[i]!r} (code times 2^(byte - 127)): more than half a step away")

    return P(f"{KCEV}.dequant_within_half_step", (KCEV,), "metamorphic",
             "With round_scale_flag every stored code times its E8M0 scale 2^(byte - 127) is within half an FP8 "
             "step of x (float64 model): the scale byte is the divisor the codes were made with.",
             examples(KCEV, {"round_scale_flag": True}), check, {"round_scale_flag": True})


def _one_batch(op: str, a: dict, b: int) -> dict:
    """The arguments of batch ``b`` alone (BSND query; BSND keys or a paged cache shared by every batch)."""
    one = dict(a)
    sl = slice(b, b + 1)
    for p in ("query", "weights", "query_dequant_scale", "actual_seq_lengths_query", "actual_seq_lengths_key"):
        if a.get(p) is not None:
            one[p] = np.ascontiguousarray(a[p][sl])
    if a["layout_key"] == "PA_BSND":
        one["block_table"] = np.ascontiguousarray(a["block_table"][sl])
    else:
        for p in ("key", "key_dequant_scale"):
            if a.get(p) is not None:
                one[p] = np.ascontiguousarray(a[p][sl])
    return one


def _indexer_batch_slices(op: str, P, examples):
    pins = {"layout_query": "BSND", "layout_kv": ("BSND", "PA_BSND"), "batch": (2, 3)}

    def check(ex, backend: str):
        a = ex.args
        full = call(op, a, backend)
        for b in range(a["query"].shape[0]):
            alone = call(op, _one_batch(op, a, b), backend)
            for name, v in alone.items():
                if v is None or full.get(name) is None:
                    continue
                whole = np.ascontiguousarray(full[name][b:b + 1])
                if whole.shape != v.shape or whole.tobytes() != np.ascontiguousarray(v).tobytes():
                    fail(f"batch {b} run alone gives other {name} than inside the batch of {a['query'].shape[0]} "
                         f"(layout_key {a['layout_key']})")

    return P(f"{op}.batch_slices", (op,), "metamorphic",
             "Shape invariance: each batch of a BSND query run alone (its query rows, weights, lengths and keys or "
             "block-table row) gives byte-identical indices (and values) to the same batch inside the whole call.",
             examples(op, pins), check, pins)


def _vqli_batch_slices(P, examples):
    pins = {"layout_query": "BSND", "batch": (2, 3)}

    def check(ex, backend: str):
        a = ex.args
        full = call(VQLI, a, backend)
        for b in range(a["query"].shape[0]):
            one = _one_batch(VQLI, a, b)
            one["metadata"] = None  # a tiling belongs to its own call's shapes
            alone = call(VQLI, one, backend)
            if alone["sparse_indices"].tobytes() != np.ascontiguousarray(full["sparse_indices"][b:b + 1]).tobytes():
                fail(f"batch {b} run alone selects other compressed tokens than inside the batch of "
                     f"{a['query'].shape[0]} (cmp_ratio {a['cmp_ratio']})")

    return P(f"{VQLI}.batch_slices", (VQLI,), "metamorphic",
             "Batch invariance: each batch of a BSND query run alone (its query rows, weights, scales, lengths and "
             "block-table row over the shared paged compressed key) gives byte-identical indices to the same batch "
             "inside the whole call.", examples(VQLI, pins), check, pins)


def _vqli_row_slices(P, examples):
    pins = {"layout_query": "BSND"}

    def check(ex, backend: str):
        a = ex.args
        s1 = a["query"].shape[1]
        if s1 < 2:
            return
        full = call(VQLI, a, backend)["sparse_indices"]
        act_q = (np.full(a["query"].shape[0], s1, np.int64) if a["actual_seq_lengths_query"] is None
                 else np.asarray(a["actual_seq_lengths_query"], np.int64))
        act_kv = np.asarray(a["actual_seq_lengths_key"], np.int64)
        for lo, hi in ((0, s1 // 2), (s1 // 2, s1)):
            q2 = np.clip(np.minimum(act_q, hi) - lo, 0, hi - lo)
            kv2 = act_kv - act_q + lo + q2 if a["sparse_mode"] == 3 else act_kv
            # a batch with no row in the slice (actQ <= lo) has no causal anchor there: its key length stays
            # actKV (actKV - actQ + lo would reach past the keys its block table holds)
            kv2 = np.where(q2 > 0, kv2, act_kv)
            if (kv2 < 0).any():
                continue  # that slice is no request of its own
            part = dict(a, metadata=None, actual_seq_lengths_query=q2.astype(np.int32),
                        actual_seq_lengths_key=kv2.astype(np.int32))
            for p in ("query", "weights", "query_dequant_scale"):
                part[p] = np.ascontiguousarray(a[p][:, lo:hi])
            got = call(VQLI, part, backend)["sparse_indices"]
            want = np.ascontiguousarray(full[:, lo:hi])
            if got.tobytes() != want.tobytes():
                fail(f"query rows [{lo}, {hi}) run as their own request select other compressed tokens than inside "
                     f"the whole call (cmp_ratio {a['cmp_ratio']}, sparse_mode {a['sparse_mode']})")

    return P(f"{VQLI}.row_slices", (VQLI,), "metamorphic",
             "Shape invariance (vLLM-Ascend #15053): query rows [a, b) of every batch run as a request of their own "
             "(actQ' = rows of the slice, original key length actKV - actQ + a + actQ' under the causal rule) give "
             "byte-identical indices to the same rows inside the whole call.", examples(VQLI, pins), check, pins)


def more_properties(have: set, P, examples) -> list:
    """The properties of this module whose operators are all in ``have``. ``P`` is the Property class and
    ``examples(op)`` the example-strategy builder of :mod:`.properties` (passed in to avoid an import cycle)."""
    out = []
    if {M1Q, M1D} <= have:
        out += [_m1_round_trip(P, examples), _m1_requantize(P, examples)]
    if KCEV in have:
        out += [_kcev_layouts(P, examples), _kcev_half_step(P, examples)]
    for op in (LI, QLI):
        if op in have:
            out.append(_indexer_batch_slices(op, P, examples))
    if VQLI in have:
        out += [_vqli_batch_slices(P, examples), _vqli_row_slices(P, examples)]
    if QLI2 in have:
        out += [_qli2_batch_slices(P, examples), _qli2_row_slices(P, examples)]
    return out


def _qli2_one_batch(a: dict, b: int) -> dict:
    """quant_lightning_indexer_v2's arguments of batch ``b`` alone (BSND query; a paged key shared by every batch or
    BSND keys; quant_mode 4's [1] scales are per tensor and stay)."""
    sl = slice(b, b + 1)
    one = dict(a, metadata=None)  # a tiling belongs to its own call's shapes
    per_row = ["query", "weights", "seqused_q", "seqused_k", "cmp_residual_k"]
    if a["quant_mode"] != 4:
        per_row.append("query_dequant_scale")
    if a["layout_k"] == "PA_BBND":
        per_row.append("block_table")
    else:
        per_row += ["key"] + (["key_dequant_scale"] if a["quant_mode"] != 4 else [])
    for p in per_row:
        if a.get(p) is not None:
            one[p] = np.ascontiguousarray(a[p][sl])
    return one


def _qli2_batch_slices(P, examples):
    pins = {"layout_q": "BSND", "batch": (2, 3)}

    def check(ex, backend: str):
        a = ex.args
        full = call(QLI2, a, backend)["sparse_indices"]
        for b in range(a["query"].shape[0]):
            alone = call(QLI2, _qli2_one_batch(a, b), backend)["sparse_indices"]
            if alone.tobytes() != np.ascontiguousarray(full[b:b + 1]).tobytes():
                fail(f"batch {b} run alone selects other compressed tokens than inside the batch of "
                     f"{a['query'].shape[0]} (cmp_ratio {a['cmp_ratio']}, layout_k {a['layout_k']})")

    return P(f"{QLI2}.batch_slices", (QLI2,), "metamorphic",
             "Batch invariance: each batch of a BSND query run alone (its query rows, weights, scales, seqused and "
             "cmp_residual_k entries and block-table row or keys) gives byte-identical indices to the same batch "
             "inside the whole call.", examples(QLI2, pins), check, pins)


def _qli2_row_slices(P, examples):
    pins = {"layout_q": "BSND"}

    def check(ex, backend: str):
        a = ex.args
        bn, s1 = a["query"].shape[:2]
        if s1 < 2:
            return
        full = call(QLI2, a, backend)["sparse_indices"]
        act_q = np.full(bn, s1, np.int64) if a["seqused_q"] is None else np.asarray(a["seqused_q"], np.int64)
        s2 = (np.full(bn, a["key"].shape[1], np.int64) if a["seqused_k"] is None
              else np.asarray(a["seqused_k"], np.int64))
        res = None if a["cmp_residual_k"] is None else np.asarray(a["cmp_residual_k"], np.int64)
        causal = a["mask_mode"] == 3
        for lo, hi in ((0, s1 // 2), (s1 // 2, s1)):
            q2 = np.clip(np.minimum(act_q, hi) - lo, 0, hi - lo)
            shift = np.where(q2 > 0, lo + q2 - act_q, 0) if causal else np.zeros(bn, np.int64)
            part = dict(a, metadata=None, seqused_q=q2.astype(np.int32))
            if res is not None:  # the original length moves by the rows before the slice and after it
                part["cmp_residual_k"] = (res + shift).astype(np.int32)
            elif causal:  # cmp_ratio 1: compressed = original tokens
                if (s2 + shift < 0).any():
                    continue  # that slice is no request of its own
                part["seqused_k"] = (s2 + shift).astype(np.int32)
            for p in ("query", "weights") + (("query_dequant_scale",) if a["quant_mode"] != 4 else ()):
                part[p] = np.ascontiguousarray(a[p][:, lo:hi])
            got = call(QLI2, part, backend)["sparse_indices"]
            if got.tobytes() != np.ascontiguousarray(full[:, lo:hi]).tobytes():
                fail(f"query rows [{lo}, {hi}) run as their own request select other compressed tokens than inside "
                     f"the whole call (cmp_ratio {a['cmp_ratio']}, mask_mode {a['mask_mode']})")

    return P(f"{QLI2}.row_slices", (QLI2,), "metamorphic",
             "Shape invariance (vLLM-Ascend #15053): query rows [a, b) of every batch run as a request of their own "
             "(seqused_q = rows of the slice, the original key length moved through cmp_residual_k - or seqused_k "
             "at cmp_ratio 1 - by a + rows - actQ under the causal rule) give byte-identical indices to the same "
             "rows inside the whole call.", examples(QLI2, pins), check, pins)
