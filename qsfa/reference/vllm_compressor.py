"""vLLM-Ascend's compressor (``torch.ops._C_ascend.compressor``): the DeepSeek-V4 compressor followed by RMSNorm of
every compressed row and RoPE of its last ``rope_head_dim`` lanes. docs/numerics/compressor.md#vllm_compressor.

The compression (matmuls, grouped softmax, weighted sum, paged / ring state) is :func:`qsfa.reference.compressor.
compressor`, called with ``raw_rows=True``: the vLLM-Ascend kernel hands the reduce's fp32 rows to the norm through
an fp32 workspace, without a cast (vllm-project/vllm-ascend@182b75e ``csrc/attention/compressor/op_kernel/arch32/
compressor_block_vec_perf.h`` ``DealVec2BaseBlock``; ``arch35/compressor_block_vec.h`` the same). Then, per row
``c`` (fp32, ``D`` lanes), faithful::

    sq   = RN32(c * c)                                       Mul
    ss   = sum of sq: 64-lane blocks folded ("tree", A2/A3 RowSum: block i + block i + n/2, halving) or
           accumulated block after block from +0 ("sequential", 950 RmsNormVFImpl), then the 64 lanes'
           correctly rounded sum (the hardware's lane reduction order is not published; as qkv_k_scale)
    rms  = RN32(sqrt(RN32(RN32(ss * fp32(1 / D)) + fp32(norm_eps))))
    y    = RN32(RN32(c / rms) * fp32(norm_weight))           Div, Mul
    r    = y[D - rope_head_dim:], rot = [-r[h:], r[:h]] (rotary_mode 1, half) or
           rot[2k] = -r[2k + 1], rot[2k + 1] = r[2k] (rotary_mode 2, interleave)
    r'   = RN32(RN32(r * cos) + RN32(rot * sin))              cos / sin: row i of rope_cos / rope_sin, widened
    out  = CAST_RINT(y with r') to x's dtype                  one rounding, half to even

Row ``i`` of ``cmp_kv`` (TH: packed, BSH: ``[b, k]``) takes row ``i`` of ``rope_sin`` / ``rope_cos`` - which
position that row stands for is decided by whoever builds the tables (vLLM-Ascend: ``compressor_metadata``).
Rows no group fills are padding: zeros here (the kernel does not write them; the binding allocates with
``at::empty``). ``precision="exact"``: float64 throughout, float64 rows.
"""

from __future__ import annotations

import numpy as np

from .attention import exact_sum_f32
from .compressor import _fold_sum, compressor, plan
from .rmsnorm_rope import round_to_dtype

__all__ = ["vllm_compressor", "real_rows", "norm_rope_rows", "ROTARY_MODES", "LANES"]

#: rotary_mode values: 1 half (rotate_half), 2 interleave
ROTARY_MODES = (1, 2)
#: fp32 lanes of one vector register (the norm's partial sums)
LANES = 64


def real_rows(x_shape, cu_seqlens, seqused, start_pos, cmp_ratio) -> np.ndarray:
    """Boolean mask over ``cmp_kv``'s leading axes: True where a completed group wrote the row."""
    _, used, start, nb = plan(x_shape, cu_seqlens, seqused, start_pos, cmp_ratio)
    n_g = np.maximum((start + used) // cmp_ratio - start // cmp_ratio, 0)
    if len(x_shape) == 3:
        width = -(-x_shape[1] // cmp_ratio)
        return np.arange(width)[None, :] < n_g[:, None]
    t = x_shape[0]
    return np.arange(min(t, t // cmp_ratio + nb)) < int(n_g.sum())


def _rotate(r, rotary_mode):
    """The partner lanes of RoPE, negated where the formula subtracts."""
    if rotary_mode == 1:
        h = r.shape[-1] // 2
        return np.concatenate([-r[..., h:], r[..., :h]], axis=-1)
    out = np.empty_like(r)
    out[..., 0::2] = -r[..., 1::2]
    out[..., 1::2] = r[..., 0::2]
    return out


def norm_rope_rows(c, norm_weight, rope_sin, rope_cos, *, rope_head_dim, norm_eps, rotary_mode,
                   precision="faithful", norm_order="tree"):
    """RMSNorm + RoPE of rows ``c [n, D]`` (fp32 faithful, float64 exact) with tables ``[n, rope_head_dim]``;
    returns fp32 (faithful) or float64 (exact) rows, not yet cast."""
    d = c.shape[-1]
    base = d - rope_head_dim
    if precision == "exact":
        c = c.astype(np.float64)
        rms = np.sqrt((c * c).sum(axis=-1, keepdims=True) / d + float(np.float32(norm_eps)))
        y = c / rms * np.asarray(norm_weight, np.float64)
        r = y[:, base:]
        y[:, base:] = r * np.asarray(rope_cos, np.float64) + _rotate(r, rotary_mode) * np.asarray(rope_sin,
                                                                                                  np.float64)
        return y
    c = np.asarray(c, np.float32)
    sq = c * c
    lanes = _fold_sum(sq.reshape(c.shape[0], d // LANES, LANES), norm_order)
    ss = exact_sum_f32(lanes.astype(np.float64))[:, None]
    rms = np.sqrt((ss * np.float32(1.0 / d)) + np.float32(norm_eps))
    y = (c / rms) * np.asarray(norm_weight).astype(np.float32)
    r = y[:, base:]
    y[:, base:] = (r * np.asarray(rope_cos).astype(np.float32)) + (
        _rotate(r, rotary_mode) * np.asarray(rope_sin).astype(np.float32))
    return y


def vllm_compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table=None,
                    cu_seqlens=None, seqused=None, start_pos=None, *, rope_head_dim, cmp_ratio, coff, norm_eps,
                    rotary_mode, cache_mode, precision="faithful", reduce_order="tree"):
    """The operator (module docstring); ``state_cache`` is written in place. ``reduce_order`` is the chip's order
    of the compressor's sums and of the norm's 64-lane blocks. Returns ``(cmp_kv, state_cache)``."""
    x = np.asarray(x)
    raw, state_cache = compressor(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused,
                                  start_pos, cmp_ratio=cmp_ratio, coff=coff, cache_mode=cache_mode,
                                  precision=precision, reduce_order=reduce_order, raw_rows=True)
    d = raw.shape[-1]
    mask = real_rows(x.shape, cu_seqlens, seqused, start_pos, int(cmp_ratio))
    out = np.zeros(raw.shape, np.float64 if precision == "exact" else x.dtype)
    if mask.any():
        rows = norm_rope_rows(raw[mask], norm_weight, np.asarray(rope_sin)[mask], np.asarray(rope_cos)[mask],
                              rope_head_dim=int(rope_head_dim), norm_eps=norm_eps, rotary_mode=int(rotary_mode),
                              precision=precision, norm_order=reduce_order)
        out[mask] = rows if precision == "exact" else round_to_dtype(rows, x.dtype)
    assert out.shape[-1] == d
    return out, state_cache
