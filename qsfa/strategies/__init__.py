"""Public hypothesis strategies: complete, valid (and, separately, invalid) argument sets for every operator.

Every strategy draws a ``dict`` of the operator's arguments (NumPy arrays and plain Python values, the
parameter names of the public function) that passes the operator's :class:`~qsfa._contract.Contract`
(``tests/test_strategies.py`` checks this for every operator). Structure (shapes, dtypes, layouts, modes,
lengths, block tables, slot mappings, sparse indices) is drawn by hypothesis and shrinks; bulk array
contents come from a NumPy generator seeded by a drawn integer, so large arrays stay cheap.

    from qsfa import strategies as qst
    @given(qst.valid_args("kv_quant_sparse_flash_attention", layout_kv="PA_BSND"))
    def test_something(args): ...

* :func:`valid_args(op, bounds=None, **pins) <valid_args>` - the strategy of one operator (:data:`STRATEGIES`);
  ``pins`` fix a drawn choice to a value or to a tuple of allowed values (``key_dtype=("int8",)``).
* :func:`invalid_args(op, ...) <invalid_args>` - :class:`InvalidArgs` records ``(args, constraint)`` whose
  arguments violate exactly the named constraint (it is the first one the contract reports).
* :class:`Bounds` / :func:`bounds` - size limits; the defaults come from the active hypothesis profile
  (:data:`qsfa._profiles.SIZE_BOUNDS`: ``ci`` small, ``nightly`` large).

What the attention strategies exercise: BSND / TND queries with per-batch lengths (padding rows past
``actQ`` included), BSND / TND / PA_BSND KV with random physical block order, spare blocks and junk in
unused block-table entries; sparse indices that are causally valid for the row (distinct entries below
``ceil(min(actKV, threshold) / sparse_block_size)``), optionally mixed with non-causal entries (at or past the
row's limit: they select nothing, and they push causal entries past the ``ceil(threshold / sbs)`` positions
that are read), then ``-1`` padding, optionally followed by junk that must be ignored (reading stops at the
first ``-1``). Every KV row that no query may read (tokens past
``actKV``, spare blocks, TND tail) is **poisoned**: packed rows get NaN NoPE codes (FP8 / HiFloat8), NaN
RoPE and NaN scales; float caches get NaN - a backend that reads them produces NaN and fails.

The indexer strategies draw integer-valued (or power-of-two scaled) inputs so every score is exact in
fp32: the top-k order (ties by lower token index, the OPEN ``tie_break`` default) is then exactly defined
and backends can be compared index for index.

One module per operator family, each beside its docs page: :mod:`qsfa.strategies.formats`
(docs/numerics/formats.md), :mod:`qsfa.strategies.quant` (quantisers.md), :mod:`qsfa.strategies.layouts`
(flashmla-model1.md), :mod:`qsfa.strategies.cache` (cache-writers.md) and :mod:`qsfa.strategies.attention`
(attention.md, indexer.md); the shared drawing helpers and :class:`Bounds` are in
:mod:`qsfa.strategies._common`. This package holds the registry (:data:`STRATEGIES`), :func:`valid_args`,
:func:`invalid_args` and re-exports every public strategy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from .._contract import Args
from .attention import (
    lightning_indexer_args, merge_attention_lse_args, qsfa_args, quant_lightning_indexer_args, sfa_args,
)
from .cache import (
    _with_hifloat8_keys, c8_cache_write_args, c8_rmsnorm_rope_cache_args, clone, kv_compress_epilog_args,
    kv_compress_epilog_vllm_args, kv_rmsnorm_rope_cache_args, scatter_by_slot_args, strided_like,
)
from ._common import Bounds, bounds, INT64_MAX, InvalidArgs, poison_bytes, slot_mapping, sparse_index_rows
from .indexer_cache import (
    indexer_compress_epilog_v2_args, indexer_quant_cache_args, qkv_rms_norm_rope_cache_with_k_scale_args,
    scatter_pa_kv_cache_with_k_scale_args,
)
from .indexer_v4 import quant_lightning_indexer_v2_args, vllm_quant_lightning_indexer_args
from .compressor import compressor_args, quant_compressor_args, vllm_compressor_args
from .formats import decode_args, encode_args, pack_fp4_args, unpack_fp4_args
from .layouts import flashmla_model1_dequantize_args, flashmla_model1_quantize_args
from .quant import dynamic_block_quant_args
from .sharedkv import (
    kv_quant_sparse_attn_sharedkv_args, mixed_quant_sparse_flash_mla_args, sparse_attn_sharedkv_args,
    sparse_flash_mla_args, quant_sparse_flash_mla_args,
)

__all__ = [
    "Bounds",
    "bounds",
    "with_bounds",
    "valid_args",
    "invalid_args",
    "InvalidArgs",
    "STRATEGIES",
    "encode_args",
    "decode_args",
    "pack_fp4_args",
    "unpack_fp4_args",
    "dynamic_block_quant_args",
    "scatter_by_slot_args",
    "c8_cache_write_args",
    "c8_rmsnorm_rope_cache_args",
    "kv_compress_epilog_args",
    "kv_rmsnorm_rope_cache_args",
    "qsfa_args",
    "sfa_args",
    "lightning_indexer_args",
    "quant_lightning_indexer_args",
    "merge_attention_lse_args",
    "slot_mapping",
    "sparse_index_rows",
    "poison_bytes",
    "clone",
    "strided_like",
    "INT64_MAX",
    "flashmla_model1_quantize_args",
    "flashmla_model1_dequantize_args",
    "kv_compress_epilog_vllm_args",
    "MORE_STRATEGIES",
    "indexer_quant_cache_args",
    "compressor_args",
    "quant_compressor_args",
    "vllm_compressor_args",
    "vllm_quant_lightning_indexer_args",
    "quant_lightning_indexer_v2_args",
    "qkv_rms_norm_rope_cache_with_k_scale_args",
    "indexer_compress_epilog_v2_args",
    "scatter_pa_kv_cache_with_k_scale_args",
    "sparse_flash_mla_args",
    "sparse_attn_sharedkv_args",
    "mixed_quant_sparse_flash_mla_args",
    "kv_quant_sparse_attn_sharedkv_args",
    "quant_sparse_flash_mla_args",
]


# ---------------------------------------------------------------------------------------------------
# registry


#: operator name -> strategy builder ``f(bounds=None, **pins)``
STRATEGIES: dict[str, Callable[..., st.SearchStrategy]] = {
    "formats.encode": encode_args,
    "formats.decode": decode_args,
    "formats.pack_fp4": pack_fp4_args,
    "formats.unpack_fp4": unpack_fp4_args,
    "dynamic_block_quant": dynamic_block_quant_args,
    "scatter_by_slot": scatter_by_slot_args,
    "c8_cache_write": c8_cache_write_args,
    "c8_rmsnorm_rope_cache": c8_rmsnorm_rope_cache_args,
    "kv_compress_epilog": kv_compress_epilog_args,
    "kv_rmsnorm_rope_cache": kv_rmsnorm_rope_cache_args,
    "kv_quant_sparse_flash_attention": qsfa_args,
    "sparse_flash_attention": sfa_args,
    "lightning_indexer": lightning_indexer_args,
    "quant_lightning_indexer": quant_lightning_indexer_args,
    "merge_attention_lse": merge_attention_lse_args,
}


def valid_args(op: str, bounds: Bounds | None = None, *, chip: str | None = None, **pins) -> st.SearchStrategy:
    """A strategy of valid argument dicts for operator ``op``.

    bounds: size limits (default: the active profile's). chip: draw only arguments within that chip
    family's limits ("A2", "A3", "950"; None = the reference's union): the chip's pins
    (:mod:`qsfa.strategies.chips`) are merged into ``pins`` and the contract's rules of the chip filter what no pin
    expresses; a combination the chip cannot run raises :class:`~qsfa.strategies.chips.NotApplicable` at once,
    before anything is drawn. pins: fix drawn choices (see each operator's strategy)."""
    try:
        make = STRATEGIES[op]
    except KeyError:
        raise KeyError(f"no strategy for operator {op!r}; known: {sorted(STRATEGIES)}") from None
    if chip is not None:
        from .chips import merge_pins

        pins = merge_pins(op, chip, pins, bounds)
    s = make(bounds, **pins)
    if chip is not None:
        from .._dispatch import operator

        contract = operator(op).contract
        s = s.filter(lambda a: contract.first_violation(Args(a), chip) is None)
    return s


def _violation_id(contract, args, chip):
    try:
        hit = contract.first_violation(Args(args), chip)
    except Exception:  # a check that cannot even read the broken arguments: not the rule we want
        return None
    return None if hit is None else hit[0].id


def invalid_args(op: str, bounds: Bounds | None = None, *, chip: str | None = None,
                 constraints: Any = None, **pins) -> st.SearchStrategy:
    """A strategy of :class:`InvalidArgs` for ``op``: a valid argument set broken by one constraint's
    ``violate`` function, such that exactly that constraint is the first the contract reports.

    The constraint is drawn from those that apply to ``chip`` (None: the operator's own rules, as the
    reference validates); ``constraints`` restricts them to given ids. The base is a drawn valid set; when
    the constraint's violate function does not make that base fire exactly this rule, the contract's own
    ``example`` is the base (tests/test_contracts.py guarantees that one works), and the draw is discarded
    only if that fails too."""
    from .._contract import copy_args
    from .._dispatch import operator

    contract = operator(op).contract
    cands = [c for c in contract.constraints if c.violate is not None and c.drawn and c.applies_to(chip)
             and (constraints is None or c.id in set(constraints))]
    if not cands:
        raise ValueError(f"no constraint of {op!r} applies (chip={chip!r}, constraints={constraints!r})")

    if chip is not None:  # bases within the chip's limits where it has the operator (fewer example fallbacks)
        from .chips import NotApplicable, merge_pins

        try:
            pins = merge_pins(op, chip, pins, bounds)
        except NotApplicable:
            pass

    @st.composite
    def strat(draw):
        c = draw(st.sampled_from(cands))
        base = draw(valid_args(op, bounds, **pins))
        bad = None
        try:
            with np.errstate(all="ignore"):
                bad = c.violate(copy_args(base))
        except Exception:
            bad = None
        if bad is None or _violation_id(contract, bad, chip) != c.id:
            seed = draw(st.integers(0, 2**16))
            try:
                with np.errstate(all="ignore"):
                    bad = c.violate(contract.example(np.random.default_rng(seed)))
            except Exception:
                bad = None
            assume(bad is not None and _violation_id(contract, bad, chip) == c.id)
        return InvalidArgs(bad, c)

    return strat()


def with_bounds(b: Bounds, **changes) -> Bounds:
    """A copy of ``b`` with some fields changed."""
    return replace(b, **changes)


MORE_STRATEGIES = {
    "layouts.flashmla_model1_quantize": flashmla_model1_quantize_args,
    "layouts.flashmla_model1_dequantize": flashmla_model1_dequantize_args,
    "kv_compress_epilog_vllm": kv_compress_epilog_vllm_args,
    "indexer_quant_cache": indexer_quant_cache_args,
    "indexer_compress_epilog_v2": indexer_compress_epilog_v2_args,
    "scatter_pa_kv_cache_with_k_scale": scatter_pa_kv_cache_with_k_scale_args,
    "vllm_quant_lightning_indexer": vllm_quant_lightning_indexer_args,
    "sparse_flash_mla": sparse_flash_mla_args,
    "sparse_attn_sharedkv": sparse_attn_sharedkv_args,
    "mixed_quant_sparse_flash_mla": mixed_quant_sparse_flash_mla_args,
    "kv_quant_sparse_attn_sharedkv": kv_quant_sparse_attn_sharedkv_args,
    "quant_lightning_indexer_v2": quant_lightning_indexer_v2_args,
    "qkv_rms_norm_rope_cache_with_k_scale": qkv_rms_norm_rope_cache_with_k_scale_args,
    "compressor": compressor_args,
    "quant_compressor": quant_compressor_args,
    "quant_sparse_flash_mla": quant_sparse_flash_mla_args,
    "vllm_compressor": vllm_compressor_args,
}

for _op in ("c8_cache_write", "c8_rmsnorm_rope_cache"):
    if _op in STRATEGIES and not getattr(STRATEGIES[_op], "_hifloat8_keys", False):
        MORE_STRATEGIES[_op] = _with_hifloat8_keys(STRATEGIES[_op], _op)
        MORE_STRATEGIES[_op]._hifloat8_keys = True
STRATEGIES.update(MORE_STRATEGIES)
