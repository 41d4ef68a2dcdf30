"""Shared builders and independent goldens for the attention tests (imported by tests/test_attention_*.py).

Everything here is written plainly and independently of qsfa.reference.attention: token selection as
per-row Python loops over index entries (the style of vLLM-Ascend's test golden), dequantisation from
the integer codes and scales, dense softmax attention. The few tests in this module check the builders
themselves (a wrong builder would make every other test meaningless).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from qsfa.reference import formats
from qsfa.reference.packing import pack_rows

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
QDT = {"bfloat16": BF16, "float16": F16}
SCALE = (512 + 64) ** -0.5


# ---------------------------------------------------------------------------------------------------
# data


class Case:
    """Logical per-batch data: query rows and KV tokens before any layout is applied.

    q:      [B, S, N, 512 + rope] query dtype
    codes:  [B, KV, 512] int8 NoPE codes (or uint8 codes of fp8 / HiFloat8)
    rope:   [B, KV, 64] query dtype or None
    scales: [B, KV, 4] float32
    idx:    [B, S, K] int32
    act_q, act_kv: per-batch lengths
    """

    def __init__(self, q, codes, rope, scales, idx, act_q, act_kv, key_fmt="int8"):
        self.q, self.codes, self.rope, self.scales, self.idx = q, codes, rope, scales, idx
        self.act_q = [int(x) for x in act_q]
        self.act_kv = [int(x) for x in act_kv]
        self.key_fmt = key_fmt

    @property
    def qdtype(self):
        return "bfloat16" if self.q.dtype == BF16 else "float16"

    @property
    def rope_dim(self):
        return 0 if self.rope is None else self.rope.shape[-1]

    def rows(self):
        """Packed rows uint8 [B, KV, 1, W]."""
        codes = self.codes.view(np.uint8)[:, :, None, :]
        rope = None if self.rope is None else self.rope[:, :, None, :]
        return pack_rows(codes, rope, self.scales[:, :, None, :])


def random_case(rng, *, batch=2, q_s=3, heads=4, kv=40, sparse=16, rope=64, qdtype="bfloat16", act_q=None,
                act_kv=None, sbs=1, key_fmt="int8", q_range=1.0):
    qdt = QDT[qdtype]
    q = rng.uniform(-q_range, q_range, (batch, q_s, heads, 512 + rope)).astype(qdt)
    if key_fmt == "int8":
        codes = rng.integers(-64, 64, (batch, kv, 512)).astype(np.int8)
    elif key_fmt == "float8_e4m3fn":
        codes = rng.uniform(-8, 8, (batch, kv, 512)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    else:
        codes = (rng.integers(0x08, 0x40, (batch, kv, 512)) | (rng.integers(0, 2, (batch, kv, 512)) << 7)).astype(
            np.uint8)
    rp = rng.uniform(-1, 1, (batch, kv, rope)).astype(qdt) if rope else None
    scales = rng.uniform(0.005, 0.1, (batch, kv, 4)).astype(np.float32)
    n_blocks = -(-kv // sbs)
    idx = np.full((batch, q_s, sparse), -1, np.int32)
    for b in range(batch):
        for i in range(q_s):
            perm = rng.permutation(n_blocks)[:sparse]
            idx[b, i, :perm.size] = perm
    return Case(q, codes, rp, scales, idx, act_q or [q_s] * batch, act_kv or [kv] * batch, key_fmt)


def widen_indices(case: Case, width=2048) -> Case:
    """Pad each row's indices with -1 to ``width`` entries (HiFloat8 KV requires sparse_size 2048); the
    selected tokens do not change."""
    idx = np.full(case.idx.shape[:-1] + (width,), -1, np.int32)
    idx[..., :case.idx.shape[-1]] = case.idx
    case.idx = idx
    return case


# ---------------------------------------------------------------------------------------------------
# layouts


def layout_args(case: Case, layout_query="BSND", layout_kv="BSND", *, block_size=16, page_order=None,
                rows=None):
    """Arguments of qsfa.kv_quant_sparse_flash_attention for ``case`` stored in the given layouts.

    TND stores only each batch's actual tokens (prefix sums); PA_BSND puts logical page j of batch b at
    physical page ``page_order[b * pages + j]`` (default: reversed) of a cache with one spare page
    filled with 0x7F bytes (stray reads would show)."""
    rows = case.rows() if rows is None else rows
    b, kv = rows.shape[:2]
    if layout_query == "BSND":
        query, idx = case.q, case.idx[:, :, None, :]
        lq = np.asarray(case.act_q, np.int32)
    else:
        query = np.concatenate([case.q[i, :case.act_q[i]] for i in range(b)])
        idx = np.concatenate([case.idx[i, :case.act_q[i]] for i in range(b)])[:, None, :]
        lq = np.cumsum(case.act_q).astype(np.int32)
    bt = None
    if layout_kv == "BSND":
        key = rows
        lk = np.asarray(case.act_kv, np.int32)
    elif layout_kv == "TND":
        key = np.concatenate([rows[i, :case.act_kv[i]] for i in range(b)])
        lk = np.cumsum(case.act_kv).astype(np.int32)
    else:
        pages = -(-kv // block_size)
        total = b * pages + 1
        order = np.arange(total - 1)[::-1] if page_order is None else np.asarray(page_order)
        key = np.full((total, block_size) + rows.shape[2:], 0x7F, np.uint8)
        bt = np.zeros((b, pages), np.int32)
        for i in range(b):
            for j in range(pages):
                phys = int(order[i * pages + j])
                bt[i, j] = phys
                seg = rows[i, j * block_size:(j + 1) * block_size]
                key[phys, :seg.shape[0]] = seg
        lk = np.asarray(case.act_kv, np.int32)
    key = key.view(np.int8) if case.key_fmt == "int8" else key
    return dict(query=np.ascontiguousarray(query), key=key, value=key, sparse_indices=np.ascontiguousarray(idx),
                scale_value=SCALE, block_table=bt, actual_seq_lengths_query=lq, actual_seq_lengths_kv=lk,
                layout_query=layout_query, layout_kv=layout_kv, rope_head_dim=case.rope_dim, key_dtype=case.key_fmt)


def to_logical(out, case: Case, layout_query):
    """Attention output of layout_query -> [B, S, N, D] (TND rows scattered back; padding rows 0)."""
    if layout_query == "BSND":
        return out
    full = np.zeros(case.q.shape[:3] + out.shape[-1:], out.dtype)
    t = 0
    for b, n in enumerate(case.act_q):
        full[b, :n] = out[t:t + n]
        t += n
    return full


def lse_to_logical(stat, case: Case, layout_query):
    """softmax_max / softmax_sum of layout_query -> [B, S, N]."""
    if layout_query == "BSND":
        return stat[:, 0]
    return to_logical(stat[0][..., None], case, "TND")[..., 0]


# ---------------------------------------------------------------------------------------------------
# independent goldens


def selected_tokens(idx_row, sbs, sparse_mode, i, act_q, act_kv):
    """The vLLM-Ascend golden's token loop, written out: entries read up to min(K, ceil(thr / sbs)),
    stop at the first -1, each entry's block clipped to [0, min(actKV, thr))."""
    thr = act_kv - act_q + i + 1 if sparse_mode == 3 else act_kv
    if thr <= 0:
        return []
    n_read = min(len(idx_row), math.ceil(thr / sbs))
    toks = []
    for e in idx_row[:n_read].tolist():
        if e == -1:
            break
        for t in range(e * sbs, e * sbs + sbs):
            if 0 <= t < min(act_kv, thr):
                toks.append(t)
    return toks


def dequant_f64(case: Case):
    """Exact dequantised K [B, KV, 512 + rope] float64 and V [B, KV, 512] float64."""
    vals = formats.decode(case.codes.view(np.uint8), case.key_fmt).astype(np.float64)
    kn = vals * np.repeat(case.scales.astype(np.float64), 128, axis=-1)
    k = kn if case.rope is None else np.concatenate([kn, case.rope.astype(np.float64)], axis=-1)
    return k, kn


def round_q(x, qdtype, mode=None):
    """float32 x rounded to the query dtype with ``mode`` ("rint" / "round"; None: bf16 RINT, fp16 ROUND)."""
    mode = mode or ("rint" if qdtype == "bfloat16" else "round")
    return formats.round_to(np.asarray(x, np.float32), qdtype, rounding=mode)


#: each chip's rounding modes at K, P and the output (docs/numerics/chips.md), written out here independently of
#: qsfa.chips: A2/A3 K and out bf16 RINT / fp16 ROUND, P ROUND; 950 K RINT, P ROUND, out ROUND
CHIP_MODES = {
    "A2": {"k": {"bfloat16": "rint", "float16": "round"}, "p": {"bfloat16": "round", "float16": "round"},
           "out": {"bfloat16": "rint", "float16": "round"}},
    "950": {"k": {"bfloat16": "rint", "float16": "rint"}, "p": {"bfloat16": "round", "float16": "round"},
            "out": {"bfloat16": "round", "float16": "round"}},
}


def golden_faithful(case: Case, *, sbs=1, sparse_mode=3, scale=SCALE, normalised=False, accumulate="float32",
                    chip=None):
    """Per-row loop golden in the vLLM-Ascend style with the kernel's rounding points (float32).

    accumulate: "float32" - ``q @ K^T``, ``P @ V`` and the softmax sum accumulated in fp32 one term at a time in
    index order (``np.cumsum``: a fixed order, like a kernel's, and the same bits on every CPU - no BLAS, no SIMD
    reduction; each product of two 16-bit floats is exact in fp32), exp in float64 rounded once to fp32;
    "float64" - the same products and sums in float64 (exact products) rounded once to fp32, exp in float64
    rounded once: the correctly rounded values the oracle models, except where a float64 result lies within its
    own rounding error of an fp32 rounding boundary.
    chip: whose rounding modes (:data:`CHIP_MODES`); None = the chip qsfa resolves for the case (int8 KV: A2, an
    FP8 / HiFloat8 KV is Ascend 950 only)."""
    wide = accumulate == "float64"
    assert accumulate in ("float32", "float64"), accumulate

    def seq_dot(x, y):  # [M, K] @ [K, N] in fp32, summed sequentially over K
        return np.cumsum(x[:, :, None] * y[None, :, :], axis=1, dtype=np.float32)[:, -1, :]

    qd = case.qdtype
    modes = CHIP_MODES["A2" if chip in ("A2", "A3") or (chip is None and case.key_fmt == "int8") else "950"]
    km, pm, om = modes["k"][qd], modes["p"][qd], modes["out"][qd]
    vals = formats.decode(case.codes.view(np.uint8), case.key_fmt)
    kn = round_q(vals * np.repeat(case.scales, 128, axis=-1), qd, km)  # fp32 multiply, then query dtype
    k = kn if case.rope is None else np.concatenate([kn, case.rope.astype(np.float32)], axis=-1)
    b_, s_, n_, _ = case.q.shape
    out = np.zeros((b_, s_, n_, 512), np.float32)
    mx = np.zeros((b_, s_, n_), np.float32)
    sm = np.zeros((b_, s_, n_), np.float32)
    for b in range(b_):
        for i in range(case.act_q[b]):
            toks = selected_tokens(case.idx[b, i], sbs, sparse_mode, i, case.act_q[b], case.act_kv[b])
            if not toks:
                continue
            q = case.q[b, i].astype(np.float32)[:, :k.shape[-1]]
            if wide:
                s = (q.astype(np.float64) @ k[b, toks].T.astype(np.float64)).astype(np.float32) * np.float32(scale)
            else:
                s = seq_dot(q, k[b, toks].T.astype(np.float32)) * np.float32(scale)
            m = s.max(axis=-1, keepdims=True)
            e = np.exp((s - m).astype(np.float64)).astype(np.float32)
            l = (e.astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32) if wide
                 else np.cumsum(e, axis=-1, dtype=np.float32)[:, -1:])
            p = round_q(e / l, qd, pm) if normalised else round_q(e, qd, pm)
            if wide:
                o = (p.astype(np.float64) @ kn[b, toks].astype(np.float64)).astype(np.float32)
            else:
                o = seq_dot(p.astype(np.float32), kn[b, toks].astype(np.float32))
            if not normalised:
                o = o / l
            out[b, i] = round_q(o, qd, om)
            mx[b, i] = m[:, 0]
            sm[b, i] = l[:, 0]
    return out, mx, sm


def golden_exact(case: Case, *, sbs=1, sparse_mode=3, scale=SCALE, token_subset=None):
    """Dense float64 softmax attention over the explicitly gathered tokens of each row.

    token_subset(b, i, toks) -> toks: restrict each row's tokens (used for shard tests)."""
    k, kn = dequant_f64(case)
    b_, s_, n_, _ = case.q.shape
    out = np.zeros((b_, s_, n_, 512))
    mx = np.zeros((b_, s_, n_))
    sm = np.zeros((b_, s_, n_))
    for b in range(b_):
        for i in range(case.act_q[b]):
            toks = selected_tokens(case.idx[b, i], sbs, sparse_mode, i, case.act_q[b], case.act_kv[b])
            if token_subset is not None:
                toks = token_subset(b, i, toks)
            if not toks:
                continue
            q = case.q[b, i].astype(np.float64)[:, :k.shape[-1]]
            s = scale * (q @ k[b, toks].T)
            m = s.max(axis=-1, keepdims=True)
            e = np.exp(s - m)
            l = e.sum(axis=-1, keepdims=True)
            out[b, i] = (e / l) @ kn[b, toks]
            mx[b, i] = m[:, 0]
            sm[b, i] = l[:, 0]
    return out, mx, sm


# ---------------------------------------------------------------------------------------------------
# checks of the builders themselves


def test_selected_tokens_hand_cases():
    # causal: actQ 3, actKV 5, row 0 threshold 3
    assert selected_tokens(np.array([0, 1, 2, 3, 4]), 1, 3, 0, 3, 5) == [0, 1, 2]
    # only the first ceil(thr/sbs) = 3 entries are read: 4 and 3 are past the threshold, 2 is kept
    assert selected_tokens(np.array([4, 3, 2, 1, 0]), 1, 3, 0, 3, 5) == [2]
    assert selected_tokens(np.array([1, -1, 3]), 1, 0, 0, 1, 5) == [1]
    assert selected_tokens(np.array([2, 0]), 4, 0, 0, 1, 10) == [8, 9, 0, 1, 2, 3]
    assert selected_tokens(np.array([0]), 1, 3, 0, 6, 5) == []  # threshold 0


def test_layout_args_roundtrip():
    rng = np.random.default_rng(1)
    case = random_case(rng, kv=37, act_kv=[37, 20], act_q=[3, 2])
    rows = case.rows()
    for lk in ("BSND", "TND", "PA_BSND"):
        a = layout_args(case, "TND", lk, block_size=16)
        key = a["key"].view(np.uint8)
        flat = key.reshape(-1, key.shape[-1])
        for b in range(2):
            for j in range(case.act_kv[b]):
                if lk == "BSND":
                    r = b * key.shape[1] + j
                elif lk == "TND":
                    r = int(np.concatenate([[0], a["actual_seq_lengths_kv"]])[b]) + j
                else:
                    r = int(a["block_table"][b, j // 16]) * 16 + j % 16
                assert np.array_equal(flat[r], rows[b, j, 0])


def test_dequant_matches_packing_module():
    from qsfa.reference.packing import dequant_rows

    rng = np.random.default_rng(2)
    case = random_case(rng, kv=5)
    k, _ = dequant_f64(case)
    kn32, kr32 = dequant_rows(case.rows()[:, :, 0], nope_format="int8")
    # one fp32 multiply = the exact float64 product rounded once to fp32
    assert np.array_equal(kn32, k[..., :512].astype(np.float32))
    assert np.array_equal(kr32.astype(np.float64), k[..., 512:])
