"""Split-KV (flash-decoding) path of the QSFA kernel, docs/numerics/attention.md#split-kv.

A decode batch has few query rows, so the unsplit grid (rows x head blocks x column blocks) can leave most of
a GPU idle while each program walks a long selection (2048 tokens and more). The split path cuts every row's
selected positions into ``NS`` chunks of ``CHUNK`` positions (a multiple of BLOCK_N), one program per chunk,
writing partial results to an fp32 workspace, then :func:`split_combine_kernel` merges them.

Two-pass (the default under the interpreter, the reference's rounding points):
  phase 1 (``SPLIT=1``): each chunk's pass 1 -> (m_s, l_s);
  :func:`split_row_stats_kernel` forms each row's max m and sum l from its (m_s, l_s)
  (:func:`qsfa.kernels.qsfa_attention.split_stats`);
  phase 2 (``SPLIT=2``): every program reads its row's (m, l) and runs pass 2 on its chunk: P = exp(s - m) - against
  the row's final max, as unsplit - rounded to the query dtype (after / l when normalised), acc_s = P @ V;
  combine: out = round((acc_0 + acc_1 + ...) / l).
One-pass (``SPLIT=3``): each chunk runs the online softmax on its own (P rounded against the chunk's running
max, as the unsplit one-pass kernel rounds against the running max of its BLOCK_N steps) -> (m_s, l_s, acc_s);
combine: out = round(sum_s acc_s exp(m_s - m) / l).

The rounding points to the query dtype (K, P, out) are therefore those of the unsplit kernel in the same mode:
splitting changes only fp32 summation order (the sum l and the P @ V accumulation are regrouped by chunk), the
class of difference a tiling change makes, and the results meet the same docs/numerics/comparison.md#float-criterion
criterion against the reference.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ._common import round_to_dtype
from .qsfa_attention import NOPE_C, split_stats

__all__ = ["split_combine_kernel", "split_row_stats_kernel", "split_plan", "SPLIT_ENV", "SPLIT_MIN_POSITIONS"]

#: environment override of the split decision: "auto" (default), "off", "on", or a chunk size in positions
SPLIT_ENV = "QSFA_TRITON_SPLIT_KV"
#: the automatic rule splits only rows that may select at least this many positions
SPLIT_MIN_POSITIONS = 1024
#: the automatic rule's chunk size (positions per split program)
SPLIT_CHUNK = 256


@triton.jit
def split_combine_kernel(ws_ml_ptr, ws_acc_ptr, out_ptr, stride_or, stride_oh, max_ptr, sum_ptr, Q_N,
                         NS: tl.constexpr, RESCALE: tl.constexpr, P_NORMALISED: tl.constexpr,
                         IS_BF16: tl.constexpr, O_ROUND: tl.constexpr, WRITE_LSE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out[row, heads, cols] from the NS splits of the row (RESCALE: one-pass partials, weighted by
    exp(m_s - m); else two-pass partials, already relative to the row max)."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < Q_N
    cols = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m, l = split_stats(ws_ml_ptr, row, heads, hmask, Q_N, NS)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for sp in range(0, NS):
        ws_row = row * NS + sp
        a = tl.load(ws_acc_ptr + (ws_row * Q_N + heads.to(tl.int64))[:, None] * NOPE_C + cols[None, :],
                    mask=hmask[:, None], other=0.0)
        if RESCALE:
            ms = tl.load(ws_ml_ptr + (ws_row * 2) * Q_N + heads, mask=hmask, other=float("-inf"))
            a = a * tl.exp(ms - m_safe)[:, None]
        acc += a
    if P_NORMALISED:
        l_out = tl.where(l > 0.0, 1.0, 0.0)
    else:
        l_out = l
    has = l_out > 0.0
    o = tl.math.div_rn(acc, tl.broadcast_to(tl.where(has, l_out, 1.0)[:, None], acc.shape))
    o16 = round_to_dtype(tl.where(has[:, None], o, 0.0), IS_BF16, O_ROUND)
    tl.store(out_ptr + row * stride_or + heads.to(tl.int64)[:, None] * stride_oh + cols[None, :], o16,
             mask=hmask[:, None])
    if WRITE_LSE:
        if tl.program_id(2) == 0:
            tl.store(max_ptr + row * Q_N + heads, tl.where(l > 0.0, m, 0.0), mask=hmask)
            tl.store(sum_ptr + row * Q_N + heads, l, mask=hmask)


@triton.jit
def split_row_stats_kernel(ws_ml_ptr, row_ml_ptr, Q_N, NS: tl.constexpr, BLOCK_H: tl.constexpr):
    """row_ml[row] = (m, l) of the row from its NS splits (:func:`split_stats`; the bits the combine pass
    recomputes), read by phase 2 (a separate pass: looping over the splits there spills at the default tiling)."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < Q_N
    m, l = split_stats(ws_ml_ptr, row, heads, hmask, Q_N, NS)
    tl.store(row_ml_ptr + row * 2 * Q_N + heads, m, mask=hmask)
    tl.store(row_ml_ptr + (row * 2 + 1) * Q_N + heads, l, mask=hmask)


def split_plan(split_kv, n_max: int, base_programs: int, block_n: int, device) -> int:
    """Positions per split program (0 = do not split) for rows of at most ``n_max`` selected positions.

    split_kv: None = the environment's :data:`SPLIT_ENV` ("auto" when unset); "auto" splits when ``n_max >=
    SPLIT_MIN_POSITIONS`` and the unsplit grid (``base_programs``) would not fill a CUDA device twice over
    (never under the interpreter); "off" / False never; "on" / True always (chunks of SPLIT_CHUNK); an int
    forces chunks of that many positions (rounded up to a multiple of ``block_n``; tests use small ones).
    """
    if split_kv is None:
        split_kv = os.environ.get(SPLIT_ENV, "auto")
    if isinstance(split_kv, str):
        v = split_kv.strip().lower()
        if v.isdigit():
            split_kv = int(v)
        elif v in ("auto", "off", "on", "0", "1"):
            split_kv = {"off": False, "on": True, "0": False, "1": True}.get(v, "auto")
        else:
            raise ValueError(f"split_kv ({SPLIT_ENV}) must be 'auto', 'on', 'off' or a chunk size, got {split_kv!r}")
    if split_kv is False or (type(split_kv) is int and split_kv == 0) or n_max <= 0:
        return 0
    if split_kv is True:
        chunk = SPLIT_CHUNK
    elif split_kv == "auto":
        if n_max < SPLIT_MIN_POSITIONS or getattr(device, "type", str(device)) != "cuda":
            return 0
        import torch

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if base_programs >= 2 * sms:
            return 0
        want = -(-2 * sms // max(base_programs, 1))  # splits per row that fill the device twice
        chunk = max(SPLIT_CHUNK, -(-n_max // want))
    elif isinstance(split_kv, int) and split_kv > 0:
        chunk = split_kv
    else:
        raise ValueError(f"split_kv must be None, 'auto', True, False or a positive chunk size, got {split_kv!r}")
    chunk = -(-chunk // block_n) * block_n
    return chunk if chunk < n_max else 0
