"""Triton kernels of qsfa (installed as ``qsfa.kernels``; the folder is ``kernels/`` in the repository).

* :mod:`qsfa.kernels.c8_cache_writer` - the QSFA C8 cache writer (int8 / FP8 E4M3FN per-128-tile quant,
  pack, scatter by slot), bit-exact with ``qsfa.reference.c8_cache``;
* :mod:`qsfa.kernels.qsfa_attention` - QSFA sparse attention (decode and prefill, BSND / TND / PA_BSND,
  rope 0 / 64, int8 / FP8 E4M3FN / HiFloat8 NoPE, optional softmax_max / softmax_sum), within
  docs/numerics/comparison.md#float-criterion of the faithful reference;
* :mod:`qsfa.kernels.qsfa_split` - its split-KV (flash-decoding) path for long selections
  (docs/numerics/attention.md#split-kv);
* :mod:`qsfa.kernels.lse_merge` - merge_attention_lse, the reference's bytes
  (docs/numerics/attention.md#merge_attention_lse);
* :mod:`qsfa.kernels._common` - rounding helpers that give the same bits on a GPU and in the CPU
  interpreter (why: its docstring).

Use them through ``backend="triton"`` (:mod:`qsfa.triton_backend`). ``triton.jit`` reads
``TRITON_INTERPRET`` when these modules are imported, so set it (for the CPU interpreter) before the first
import.
"""
