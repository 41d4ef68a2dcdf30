"""Hypothesis strategies of the DeepSeek-V4 shared-KV attention (docs/numerics/attention-v4.md):
``sparse_flash_mla`` and ``sparse_attn_sharedkv``, and the quantised doors (``mixed_quant_sparse_flash_mla``,
``kv_quant_sparse_attn_sharedkv``, ``quant_sparse_flash_mla``: the same draws stored as FP8 rows or HiFloat8 codes).

A draw: scenario SWA / CSA / HCA, both query layouts, every KV layout (paged caches with shuffled blocks and a
spare), per-batch lengths, the three ori mask modes and windows (-1 = unlimited included), cmp_ratio, cmp mask
modes, indexer-like top-k lists (distinct tokens below each row's bound, then -1), sinks (None, -inf, values),
both precisions and the LSE. Cache rows no token maps to hold 300 (a stray read would dominate the row).
Edges (qsfa._edges.EDGES): a 4-token band window, the window's first rows (queries before the first cached token), a row that sees no
compressed token, top-k all -1, top-k entries at the bound, cmp_residual_kv 0 and cmp_ratio - 1, sinks -inf /
0 / huge, block size 1024, one token, rows longer than one S2 tile.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .. import _edges as _E
from ._common import _b, _choose, _QDT, _rng, Bounds, ints

__all__ = ["sparse_flash_mla_args", "sparse_attn_sharedkv_args", "mixed_quant_sparse_flash_mla_args",
           "kv_quant_sparse_attn_sharedkv_args", "quant_sparse_flash_mla_args"]

_D = 512
_JUNK = 300.0


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _store(rows_per_batch, layout, block_size, rng, qdt, pa_name):
    """rows_per_batch: list of [n_b, D] float arrays -> (storage, block_table or None, cu or None)."""
    bsz = len(rows_per_batch)
    lens = [r.shape[0] for r in rows_per_batch]
    if layout == "BSND":
        cap = max(max(lens), 1) + int(rng.integers(0, 2))
        out = np.full((bsz, cap, 1, _D), _JUNK, np.float32)
        for b, r in enumerate(rows_per_batch):
            out[b, : r.shape[0], 0] = r
        return out.astype(qdt), None, None
    if layout == "TND":
        flat = np.concatenate([r for r in rows_per_batch] + [np.full((1, _D), _JUNK, np.float32)], axis=0)
        return flat[:, None, :].astype(qdt), None, _cu(lens)
    per = [max(-(-n // block_size), 1) for n in lens]
    nb = sum(per) + 1
    order = rng.permutation(nb)
    out = np.full((nb, block_size, 1, _D), _JUNK, np.float32)
    bt = np.zeros((bsz, max(per)), np.int32)
    k = 0
    for b, r in enumerate(rows_per_batch):
        for j in range(per[b]):
            blk = int(order[k])
            k += 1
            bt[b, j] = blk
            seg = r[j * block_size:(j + 1) * block_size]
            out[blk, : seg.shape[0], 0] = seg
    return out.astype(qdt), bt, None


def _build(draw, op, bounds, pins):
    mq = op == "mixed_quant_sparse_flash_mla"
    kqs = op == "kv_quant_sparse_attn_sharedkv"
    qs = op == "quant_sparse_flash_mla"
    sfm = op in ("sparse_flash_mla", "mixed_quant_sparse_flash_mla", "quant_sparse_flash_mla")
    b = _b(bounds)
    pins, edge = _E.take(draw, op, pins)
    rng = _rng(draw)
    qname = _choose(draw, pins, "dtype", ("bfloat16",) if (mq or kqs or qs) else ("bfloat16", "float16"))
    qdt = _QDT[qname]
    scenario = _choose(draw, pins, "scenario", ("SWA", "CSA", "HCA"))
    pa = "PA_BBND" if sfm else "PA_ND"
    layout_q = _choose(draw, pins, "layout_q", ("BSND", "TND"))
    layout_kv = _choose(draw, pins, "layout_kv", (layout_q, pa))
    block_size = _choose(draw, pins, "block_size", (16, 32))
    if pins.get("cmp_ratio_by_scenario"):
        ratio = {"SWA": 1, "CSA": 4, "HCA": 128}[scenario]
    else:
        ratio = 1 if scenario == "SWA" else _choose(draw, pins, "cmp_ratio", (2, 4) if scenario == "CSA" else (4, 8, 16))
    bsz = _choose(draw, pins, "batch", tuple(range(1, b.max_batch + 1)))
    n1 = _choose(draw, pins, "n1", tuple(h for h in (1, 2, 4, 8, 16, 64) if h <= max(b.max_heads, 1)) or (1,))
    s1_max = _choose(draw, pins, "s1", tuple(range(1, b.max_q_tokens + 1)))
    if layout_q == "BSND":
        s1 = [s1_max] * bsz
    else:
        s1 = [int(draw(ints(1, s1_max))) for _ in range(bsz)]
    s2_hi = int(pins.get("s2_max", max(b.max_kv_tokens, 2)))
    s2 = [int(draw(ints(1, s2_hi))) for _ in range(bsz)]
    if "s2" in pins:
        s2 = [int(pins["s2"])] * bsz
    mode_o = _choose(draw, pins, "ori_mask_mode", (4, 4, 3, 0))
    mode_c = _choose(draw, pins, "cmp_mask_mode", (3, 3, 0)) if scenario != "SWA" else 0
    wl = _choose(draw, pins, "ori_win_left", (-1, 0, 1, 3, 127))
    wr = _choose(draw, pins, "ori_win_right", (0, 0, 1, -1))
    if qs and mode_o != 4:  # the torch doc: windows >= 0 only with the band mask
        wl = wr = -1
    residual_kind = _choose(draw, pins, "residual", ("exact", "exact", "zero", "max"))
    ori_rows = [rng.uniform(-1, 1, (n, _D)) for n in s2]
    s3 = [n // ratio for n in s2] if scenario != "SWA" else [0] * bsz
    residual = [n % ratio for n in s2]
    if sfm and not mq and scenario != "SWA" and residual_kind != "exact":
        residual = [0 if residual_kind == "zero" else ratio - 1] * bsz
    cmp_rows = [rng.uniform(-1, 1, (n, _D)) for n in s3]
    ori, ori_bt, cu_ori = _store(ori_rows, layout_kv, block_size, rng, qdt, pa)
    cmp = cmp_bt = cu_cmp = None
    if scenario != "SWA":
        cmp, cmp_bt, cu_cmp = _store(cmp_rows, layout_kv, block_size, rng, qdt, pa)
    quant_mode = None
    if mq:  # the same values as quantised rows (pack_mode1 / the MODEL1 writer)
        from ..ops.sharedkv import _FP8, _pack_mode2
        from ..reference.sharedkv import pack_mode1

        quant_mode = _choose(draw, pins, "quant_mode", (1, 2) if layout_kv == pa else (1,))
        pack = pack_mode1 if quant_mode == 1 else _pack_mode2
        ori = pack(ori).view(_FP8)
        cmp = None if cmp is None else pack(cmp).view(_FP8)
    if kqs:  # 640-byte rows of the same values
        from ..ops.sharedkv import _FP8
        from ..reference.sharedkv import pack_640

        ori = pack_640(ori).view(_FP8)
        cmp = None if cmp is None else pack_640(cmp).view(_FP8)
    rows = sum(s1)
    q = rng.uniform(-1, 1, (rows, n1, _D)).astype(qdt)
    if qs:  # HiFloat8 codes of the same values (uint8)
        from ..reference.formats import encode

        q, ori = encode(q, "hifloat8"), encode(ori, "hifloat8")
        cmp = None if cmp is None else encode(cmp, "hifloat8")
    if layout_q == "BSND":
        q = q.reshape(bsz, s1_max, n1, _D)
    idx = None
    if scenario == "CSA":
        k = _choose(draw, pins, "k", (1, 4, 8, 16))
        topk = _choose(draw, pins, "topk", ("indexer", "indexer", "all_minus1", "at_bound"))
        idx = np.full((rows, 1, k), -1, np.int32)
        r = 0
        for bi in range(bsz):
            big = s3[bi] * ratio + residual[bi]
            for i in range(s1[bi]):
                bound = (big - s1[bi] + i + 1) // ratio if mode_c == 3 else big // ratio
                bound = min(max(bound, 0), s3[bi])
                if topk == "indexer":
                    n = min(bound, k)
                    idx[r, 0, :n] = rng.permutation(bound)[:n]
                elif topk == "at_bound":
                    n = min(bound, k - 1)
                    idx[r, 0, :n] = rng.permutation(bound)[:n]
                    idx[r, 0, n] = bound  # at the bound: skipped
                r += 1
        if layout_q == "BSND":
            idx = idx.reshape(bsz, s1_max, 1, k)
    sink_kind = _choose(draw, pins, "sinks", ("values", "values", "none", "-inf", "zero"))
    sinks = {"none": None, "-inf": np.full(n1, -np.inf, np.float32), "zero": np.zeros(n1, np.float32),
             "huge": np.full(n1, 1e30, np.float32)}.get(sink_kind)
    if sink_kind == "values":
        sinks = rng.uniform(-2, 2, n1).astype(np.float32)
    lens = np.asarray(s2, np.int32)
    a = dict(q=q, ori_kv=ori, cmp_kv=cmp, ori_sparse_indices=None, cmp_sparse_indices=idx, ori_block_table=ori_bt,
             cmp_block_table=cmp_bt, cu_seqlens_q=_cu(s1) if layout_q == "TND" else None,
             cu_seqlens_ori_kv=cu_ori, cu_seqlens_cmp_kv=cu_cmp, seqused_q=None)
    if sfm:
        a.update(seqused_ori_kv=lens if (layout_kv != "TND") else None,
                 seqused_cmp_kv=np.asarray(s3, np.int32) if scenario != "SWA" and layout_kv != "TND" else None,
                 cmp_residual_kv=np.asarray(residual, np.int32) if scenario != "SWA" else None,
                 ori_topk_length=None, cmp_topk_length=None)
    else:
        a.update(seqused_kv=lens if layout_kv != "TND" else None)
    a.update(sinks=sinks, metadata=_choose(draw, pins, "metadata", (None, "zeros")),
             softmax_scale=float(_choose(draw, pins, "softmax_scale", (_D ** -0.5, 0.1))), cmp_ratio=ratio,
             ori_mask_mode=mode_o, cmp_mask_mode=mode_c, ori_win_left=wl, ori_win_right=wr, layout_q=layout_q,
             layout_kv=layout_kv)
    if a["metadata"] == "zeros":
        a["metadata"] = np.zeros(1024, np.int32)
    if sfm:
        a["topk_value_mode"] = 1
    if mq:
        a.update(quant_mode=quant_mode, rope_head_dim=64)
    if kqs:
        a.update(kv_quant_mode=1, tile_size=64, rope_head_dim=64)
    if qs:
        d = {"mixed": (rng.uniform(0.5, 2.0, 3)), "one": (1.0, 1.0, 1.0), "apart": (0.03125, 8.0, 0.125)}[
            _choose(draw, pins, "descales", ("mixed", "mixed", "one", "apart"))]
        a.update(quant_mode=1, q_descale=np.array([d[0]], np.float32), ori_kv_descale=np.array([d[1]], np.float32),
                 cmp_kv_descale=np.array([d[2]], np.float32) if cmp is not None else None)
    a.update(return_softmax_lse=bool(_choose(draw, pins, "return_softmax_lse", (False, True))),
             precision=_choose(draw, pins, "precision", ("faithful", "faithful", "exact")))
    return a


@st.composite
def sparse_flash_mla_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``sparse_flash_mla`` (see the module docstring). pins: dtype, scenario, layout_q, layout_kv, block_size,
    cmp_ratio, batch, n1, s1, s2 / s2_max, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, residual
    ("exact" / "zero" / "max"), k, topk ("indexer" / "all_minus1" / "at_bound"), sinks ("values" / "none" /
    "-inf" / "zero" / "huge"), metadata, softmax_scale, return_softmax_lse, precision, edge."""
    return _build(draw, "sparse_flash_mla", bounds, pins)


@st.composite
def sparse_attn_sharedkv_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``sparse_attn_sharedkv``: as :func:`sparse_flash_mla_args` with its conventions (seqused_kv, no residual,
    layout PA_ND)."""
    return _build(draw, "sparse_attn_sharedkv", bounds, pins)


@st.composite
def mixed_quant_sparse_flash_mla_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``mixed_quant_sparse_flash_mla``: as :func:`sparse_flash_mla_args` with bfloat16 queries and the cache rows
    quantised - quant_mode 1 (608-byte rows, every layout) or 2 (MODEL1 blocks, PA_BBND); pin ``quant_mode``."""
    return _build(draw, "mixed_quant_sparse_flash_mla", bounds, pins)


@st.composite
def kv_quant_sparse_attn_sharedkv_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``kv_quant_sparse_attn_sharedkv``: as :func:`sparse_attn_sharedkv_args` with bfloat16 queries and the cache
    rows as 640-byte FP8 rows (E8M0 tile scales)."""
    return _build(draw, "kv_quant_sparse_attn_sharedkv", bounds, pins)



@st.composite
def quant_sparse_flash_mla_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``quant_sparse_flash_mla``: as :func:`sparse_flash_mla_args` with q / ori_kv / cmp_kv HiFloat8 codes of the
    same values and per-tensor descales (pin ``descales``: "mixed" / "one" / "apart" = 1/32, 8, 1/8)."""
    return _build(draw, "quant_sparse_flash_mla", bounds, pins)
