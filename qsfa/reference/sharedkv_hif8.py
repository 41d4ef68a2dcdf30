"""quant_sparse_flash_mla (aclnnQuantSparseFlashMla, Ascend 950): the shared-KV attention of
:mod:`qsfa.reference.sharedkv` over HiFloat8 Q / K / V with per-tensor fp32 descales.
docs/numerics/attention-v4.md#quant_sparse_flash_mla.

Inputs are HiFloat8 codes (uint8): ``q`` ``[..., N1, 512]``, ``ori_kv`` / ``cmp_kv`` ``[..., 1, 512]`` (K = V),
and three one-element descales ``q_descale``, ``ori_kv_descale``, ``cmp_kv_descale``. Token selection (window,
compressed causal bound with ``cmp_residual_kv``, top-k, zero rows, sinks) is the shared core's
:func:`qsfa.reference.sharedkv.select_tokens`; only the arithmetic differs.

``precision="exact"`` (float64): with ``q = dq * decode(q)``, ``K_j = dk_j * decode(kv_j)`` (``dk_j`` the descale of
the part token j comes from), ``s_j = softmax_scale * q . K_j`` and
``out = sum_j exp(s_j) K_j / (sum_j exp(s_j) + exp(sink))``.

``precision="faithful"``: the arch35 kernel's rounding points (cannmirror/ops-transformer@5992a2b
attention/quant_sparse_flash_mla/op_kernel/arch35/quant_sparse_flash_mla_csa_block_vector.h ``ProcessVec1`` /
``ProcessVec2`` / ``Bmm2DataCopyOut``; attention/common/op_kernel/arch35/vf/vf_flashupdate_new.h,
vf_basic_block_128_common_sfa.h). Tiles of ``s2_tile`` (128) tokens, the window's first, then - from a new tile -
the compressed tokens. Per tile t, with ``d_t`` the descale of its part:

* ``c_t = fp32(fp32(softmax_scale * dq) * d_t)`` (two fp32 multiplies, the kernel's ``static_cast<T>`` of the
  product), ``S = RN32(RN32(codes_q . codes_k) * c_t)`` - the descales scale the logits, not the codes;
* ``m' = max(m, max S)``, ``a = RN32(exp(m - m'))``, ``E = RN32(exp(S - m'))``, ``l = RN32(a l + RN32(sum E))``
  (the sum is over E before the x16 below);
* ``P = HiFloat8_TA(E * 16)`` (``hifp8ScaleValue`` 16, CAST_ROUND = ties away, saturating);
* ``PV = RN32(P . codes_v)``; the first tile keeps ``O = PV`` un-descaled; the second tile
  ``O = RN32(RN32(RN32(a O) * d_0) + RN32(PV * d_1))`` (``FlashUpdateNew`` with ``isUpdatePre``), later tiles
  ``O = RN32(RN32(a O) + RN32(PV * d_t))``;
* last: ``O = RN32(O / l)`` (one tile: ``RN32(RN32(O * d_0) / l)``, ``LastDivNew``), then ``RN32(O * 1/16)``
  and the bf16 cast with ``out_rounding`` (CAST_ROUND).

``m`` starts at the sink (-inf when None) and ``l`` at 1, as the shared core. The LSE is ``m + RN32(log l)``
(bf16-free, float32). Every RN32 of a dot product or sum is correctly rounded (qsfa.reference.attention helpers).
"""

from __future__ import annotations

import numpy as np

from .attention import (
    _dot_f32, _QDT, exact_sum_f32, exp_f32, log_f32, min_lq, round_q16, row_facts, rows_in_range, zero_idle_rows,
)
from .formats import decode, encode
from .sharedkv import _exact, _kv_source, _query_rows, output_rows, select_tokens

__all__ = ["hif8_sharedkv_attention", "HIF8_P_SCALE", "S2_TILE_950", "descale_product"]

#: the kernel's P scale before the HiFloat8 cast (vf_basic_block_utils.h ``hifp8ScaleValue = 16.0f``)
HIF8_P_SCALE = 16.0
#: arch35 S2 tile (the golden's ``s2_base_size = 128``)
S2_TILE_950 = 128
_CHUNK_BYTES = 48 << 20
#: rows whose compressed selection is computed at once when counting (a few [rows, K] int64 blocks: 8 MiB each at
#: K = 1024)
_SELECT_ROWS = 1024
_HIF8_VALUES = decode(np.arange(256, dtype=np.uint8), "hifloat8").astype(np.float64)


def descale_product(softmax_scale, q_descale, kv_descale) -> np.float32:
    """The kernel's logit scale ``fp32(fp32(softmax_scale * q_descale) * kv_descale)`` (all three fp32)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an fp32 overflow is inf, as on the chip
        return np.float32(np.float32(np.float32(softmax_scale) * np.float32(q_descale)) * np.float32(kv_descale))


def _one(x) -> np.float32:
    return np.float32(np.asarray(x, np.float32).reshape(-1)[0])


def hif8_sharedkv_attention(q, ori_kv, cmp_kv=None, cmp_sparse_indices=None, *, q_descale, ori_kv_descale,
                            cmp_kv_descale=None, ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None,
                            cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None,
                            seqused_cmp_kv=None, cmp_residual_kv=None, sinks=None, softmax_scale=1.0, cmp_ratio=1,
                            ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1, ori_win_right=-1, layout_q="BSND",
                            layout_kv="BSND", return_softmax_lse=False, precision="faithful", s2_tile=S2_TILE_950,
                            p_scale=HIF8_P_SCALE, out_rounding="round", descale_order="kernel", attention_out=None):
    """The module docstring's computation; arguments as :func:`qsfa.reference.sharedkv.sharedkv_attention` plus
    the three descales (one-element float32). ``q`` / ``ori_kv`` / ``cmp_kv`` are HiFloat8 codes (any one-byte
    dtype). Returns ``(attention_out, softmax_lse)``: bf16 (float64 exact) like q's shape, LSE float32 (float64)
    ``[B, 1, S1, N1]`` / ``[1, T1, N1]`` or an empty ``[0]`` array. ``descale_order`` (an OPEN fact,
    docs/numerics/open-facts.md#quant-sparse-flash-mla-descale-order): "kernel" (the arch35 points above) or
    "golden" (the public golden's: each tile's V descale at once, the logit scale one float64 product rounded
    once to fp32).

    ``attention_out``: an optional C-contiguous array of the output's shape and dtype (e.g. an ``np.memmap``): the
    rows are written into it chunk by chunk and it is returned; the compressed tokens are selected chunk by chunk
    too, so neither the output nor a ``[rows, K]`` selection exists in memory as a whole (the chunks and so the
    bytes are those of a call without it)."""
    exact = precision == "exact"
    qc = np.ascontiguousarray(q).view(np.uint8)
    rows, bat, pos, s1_act, valid, b_ = _query_rows(qc, layout_q, cu_seqlens_q, seqused_q)
    n_heads, d = rows.shape[1], rows.shape[2]
    oc = np.ascontiguousarray(ori_kv).view(np.uint8)
    ori_flat, ori_len, ori_row = _kv_source(oc, layout_kv, ori_block_table, cu_seqlens_ori_kv, seqused_ori_kv, b_)
    has_cmp = cmp_kv is not None
    cmp_flat = cmp_len = cmp_row = None
    if has_cmp:
        cc = np.ascontiguousarray(cmp_kv).view(np.uint8)
        cmp_flat, cmp_len, cmp_row = _kv_source(cc, layout_kv, cmp_block_table, cu_seqlens_cmp_kv, seqused_cmp_kv, b_)
        if cmp_len is None:
            cmp_len = ori_len // cmp_ratio
    idx = None if cmp_sparse_indices is None else np.asarray(cmp_sparse_indices).reshape(rows.shape[0], -1)
    masks = dict(cmp_ratio=int(cmp_ratio), ori_mask_mode=int(ori_mask_mode), cmp_mask_mode=int(cmp_mask_mode),
                 ori_win_left=int(ori_win_left), ori_win_right=int(ori_win_right))

    def select(r):  # the token selection of rows r (per row: independent of the rows selected with it)
        return select_tokens(bat[r], pos[r], s1_act[r], valid[r], ori_len, cmp_len, cmp_residual_kv,
                             None if idx is None else idx[r], has_cmp=has_cmp, **masks)

    zero, start, n_ori, _, _ = select_tokens(bat, pos, s1_act, valid, ori_len, cmp_len, cmp_residual_kv, None,
                                             has_cmp=False, **masks)
    # each row's compressed count, a block of rows at a time (a long prefill's [rows, K] selection would not fit)
    n_cmp = np.zeros_like(n_ori)
    for b0 in range(0, rows.shape[0], _SELECT_ROWS):
        n_cmp[b0:b0 + _SELECT_ROWS] = select(np.arange(b0, min(b0 + _SELECT_ROWS, rows.shape[0])))[4]
    tile = int(s2_tile)
    ori_slots = -(-n_ori // tile) * tile
    width_all = ori_slots + n_cmp
    sink = np.full(n_heads, -np.inf, np.float32) if sinks is None else np.asarray(sinks, np.float32)
    dq, d_ori = _one(q_descale), _one(ori_kv_descale)
    d_cmp = _one(cmp_kv_descale) if cmp_kv_descale is not None else np.float32(1)
    fdt = np.float64 if exact else np.float32
    odt = np.dtype(np.float64 if exact else _QDT["bfloat16"])
    out = output_rows(attention_out, rows.shape[0], n_heads, d, odt)
    lse = np.zeros((rows.shape[0], n_heads), fdt)
    live = rows_in_range(np.nonzero(~zero)[0])  # only_rows: the other rows are not computed (zero LSE)
    # rows of the range no chunk writes (before the causal diagonal, past seqused_q) are zero; the others' bytes stay
    zero_idle_rows([] if attention_out is None else [out], rows.shape[0], live, _SELECT_ROWS)
    step = max(1, _CHUNK_BYTES // (max(int(width_all.max(initial=0)), 1) * d * 8 * 2))
    for c0 in range(0, live.size, step):
        r = live[c0:c0 + step]
        _, _, _, cmp_toks, _ = select(r)
        w = max(int(width_all[r].max(initial=0)), 1)
        slot = np.arange(w, dtype=np.int64)[None, :]
        in_ori = slot < n_ori[r, None]
        cpos = slot - ori_slots[r, None]
        in_cmp = (cpos >= 0) & (cpos < n_cmp[r, None])
        sel = in_ori | in_cmp
        b2 = np.broadcast_to(bat[r, None], sel.shape)
        kc = np.zeros((r.size, w, d), np.uint8)
        oj = np.where(in_ori, start[r, None] + slot, 0)
        kc[in_ori] = ori_flat[ori_row(b2[in_ori], oj[in_ori])]
        if has_cmp and in_cmp.any():
            cj = np.take_along_axis(cmp_toks, np.clip(cpos, 0, max(cmp_toks.shape[1] - 1, 0)), 1) \
                if cmp_toks.shape[1] else np.zeros_like(cpos)
            kc[in_cmp] = cmp_flat[cmp_row(b2[in_cmp], cj[in_cmp])]
        k64 = _HIF8_VALUES[kc]
        q64 = _HIF8_VALUES[rows[r]]
        is_cmp = slot >= ori_slots[r, None]  # [c, w]: the part each slot (and so each tile) reads
        if exact:
            kd = np.where(is_cmp, np.float64(d_cmp), np.float64(d_ori))[..., None]
            o, l_ = _exact(q64 * np.float64(dq), k64 * kd, sel, float(softmax_scale), sink.astype(np.float64))
        else:
            o, l_ = _faithful(q64, rows[r], k64, kc, sel, is_cmp, softmax_scale, dq, d_ori, d_cmp, sink, tile,
                              np.float32(p_scale), out_rounding, descale_order == "golden")
        out[r] = o
        lse[r] = l_
    out = out.reshape(qc.shape) if attention_out is None else attention_out
    if not return_softmax_lse:
        return out, np.zeros((0,), fdt)
    lse = lse.reshape(qc.shape[0], 1, qc.shape[1], n_heads) if layout_q == "BSND" else lse.reshape(1, qc.shape[0],
                                                                                                     n_heads)
    return out, lse


def _faithful(q64, qcodes, k64, kcodes, sel, is_cmp, softmax_scale, dq, d_ori, d_cmp, sink, tile, p_scale,
              out_rounding, golden_order=False):
    c, n = q64.shape[:2]
    d = k64.shape[-1]
    w = k64.shape[1]
    if golden_order:
        with np.errstate(over="ignore"):
            c_ori = np.float32(float(softmax_scale) * float(dq) * float(d_ori))
            c_cmp = np.float32(float(softmax_scale) * float(dq) * float(d_cmp))
    else:
        c_ori = descale_product(softmax_scale, dq, d_ori)
        c_cmp = descale_product(softmax_scale, dq, d_cmp)
    qf = row_facts(q64, qcodes, "hifloat8")
    kf = row_facts(k64, kcodes, "hifloat8")
    m = np.broadcast_to(sink[None, :], (c, n)).astype(np.float32)
    l = np.ones((c, n), np.float32)
    acc = np.zeros((c, n, d), np.float32)
    count = np.zeros(c, np.int64)  # tiles accumulated so far per row
    d_first = np.zeros(c, np.float32)  # the first tile's descale (applied at the second tile or the end)
    f32 = np.float32
    for t0 in range(0, w, tile):
        sl = slice(t0, min(t0 + tile, w))
        vt = sel[:, sl]
        any_t = vt.any(axis=1)
        if not any_t.any():
            continue
        cmp_t = is_cmp[:, t0]  # [c]
        scale_t = np.where(cmp_t, c_cmp, c_ori).astype(f32)
        d_t = np.where(cmp_t, d_cmp, d_ori).astype(f32)
        s = _dot_f32(q64, k64[:, sl].transpose(0, 2, 1), qf, (kf[0][:, sl], kf[1][:, sl]))
        with np.errstate(over="ignore", invalid="ignore"):
            s = (s * scale_t[:, None, None]).astype(f32)
        s[~np.broadcast_to(vt[:, None, :], s.shape)] = -np.inf
        m_new = np.maximum(m, s.max(axis=-1))
        m_use = np.where(any_t[:, None], m_new, f32(0))
        with np.errstate(invalid="ignore"):
            a = np.where(np.isneginf(m), f32(0), exp_f32((m - m_use).astype(f32)))
            e = exp_f32((s - m_use[..., None]).astype(f32))
        e = np.where(np.isfinite(s), e, f32(0)).astype(f32)
        tsum = exact_sum_f32(e.reshape(-1, e.shape[-1]).astype(np.float64)).reshape(c, n)
        pcodes = encode((e * p_scale).astype(f32), "hifloat8", saturate=True, rounding="round")
        p64 = _HIF8_VALUES[pcodes]
        p_facts = (p64.sum(axis=-1) * (1 + 2.0 ** -40), min_lq(pcodes, "hifloat8"))
        kt = kcodes[:, sl]
        v_facts = (np.abs(k64[:, sl]).max(axis=1), min_lq(np.ascontiguousarray(kt.transpose(0, 2, 1)), "hifloat8"))
        pv = _dot_f32(p64, k64[:, sl], p_facts, v_facts)  # RN32(P . V codes)  [c, n, d]
        pv_d = (pv * d_t[:, None, None]).astype(f32)
        ao = (a[..., None] * acc).astype(f32)
        if golden_order:  # every tile's descale at once: O = a O + RN32(PV * d)
            new_acc = np.where((count == 0)[:, None, None], pv_d, (ao + pv_d).astype(f32))
        else:
            second = (count == 1)[:, None, None]
            ao = np.where(second, (ao * d_first[:, None, None]).astype(f32), ao)
            new_acc = np.where((count == 0)[:, None, None], pv, (ao + pv_d).astype(f32))
        upd = any_t[:, None]
        l = np.where(upd, a * l + tsum, l).astype(f32)
        acc = np.where(upd[..., None], new_acc, acc).astype(f32)
        m = np.where(upd, m_new, m).astype(f32)
        d_first = np.where(any_t & (count == 0), d_t, d_first).astype(f32)
        count = count + any_t
    if not golden_order:
        acc = np.where((count == 1)[:, None, None], (acc * d_first[:, None, None]).astype(f32), acc)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(l[..., None] > 0, acc / np.where(l > 0, l, f32(1))[..., None], f32(0)).astype(f32)
        lse = np.where(l > 0, m + log_f32(np.where(l > 0, l, f32(1))), -np.inf).astype(f32)
    o = (o * (f32(1) / p_scale)).astype(f32)  # 1/16: exact (a power of two)
    return round_q16(o, "bfloat16", out_rounding), lse
