"""Chip-aware drawing: what each chip family lets an operator's strategy draw (docs/numerics/chips.md).

A chip's limits are ``chips=`` rules of the operator's contract (``Constraint.chips``). Filtering draws through
those rules wastes the search when a rule rejects most draws (the 950's ``return_softmax_lse`` rule rejects every
draw of a property that needs the LSE; Atlas A2/A3 have no ``kv_compress_epilog`` at all): hypothesis draws
hundreds of examples and gives up. Here each such rule is also written as the *pins* that make the strategy draw
only what the rule allows, so :func:`qsfa.strategies.valid_args` with ``chip=`` draws within the chip's limits
from the start (the contract filter stays behind it as the guard for what no pin expresses, e.g. Q_N = 48 on
A2/A3, which the ``ci`` and ``dev`` bounds never draw).

* :func:`chip_pins` - the pins of one operator on one chip (with the rule each comes from);
* :func:`merge_pins` - a caller's pins (a property's) merged with them: each choice pinned on both sides keeps the
  values both allow; none left means the property cannot exist on that chip, :class:`NotApplicable` names the
  rule ("not applicable on 950: Ascend 950 writes only the attention output ...");
* an operator the chip does not have raises :class:`NotApplicable` for every property.

Edge pins (:mod:`qsfa._edges`) lose to chip pins: an edge that needs what the chip lacks becomes a plain example.
``tests/test_strategies.py`` checks that every operator's draws on every chip pass the contract with no rejection
the pins could have avoided.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["NotApplicable", "CHIP_RULES", "chip_pins", "merge_pins", "not_applicable"]

_A2A3 = ("A2", "A3")
_ALL = ("A2", "A3", "950")


class NotApplicable(ValueError):
    """A property (its operator, or its pins) that cannot exist on a chip; ``reason`` says which rule."""

    def __init__(self, op: str, chip: str, rule: str, reason: str):
        self.op, self.chip, self.rule, self.reason = op, chip, rule, reason
        super().__init__(f"not applicable on {chip}: {reason} (rule {op}.{rule})")


def _heads_950(b) -> dict:
    from ..ops.indexer import INDEXER_HEADS_950

    return {"n_heads": tuple(h for h in INDEXER_HEADS_950 if h <= b.max_heads) or INDEXER_HEADS_950[:1]}


def _const(pins: dict) -> Callable:
    return lambda b: dict(pins)


#: a chip rule an operator does not run under at all (every draw would break it)
ABSENT = None

# the V4 attention strategy's pins (qsfa.strategies.sharedkv) that keep it within the kernels' chip rules
_V4_WINDOW = {"k": 512, "ori_win_left": 127, "ori_win_right": 0, "ori_mask_mode": 4, "cmp_mask_mode": 3}
_V4_SINKS = ("values", "-inf", "zero")
_V4_SHAREDKV = {"residual": "exact", "sinks": _V4_SINKS, "n1": 64, "return_softmax_lse": False,
                "layout_kv": "PA_ND", "cmp_ratio_by_scenario": True}

def _rows_64(b) -> tuple:
    """Query rows of a draw the chip runs with 64 heads only: at most the work of the bounds' own max_heads x
    max_q_tokens query-row heads (``ci``: 8 x 4 = 32 -> one row; ``dev``: 16 x 8 -> two), so a chip run does not
    cost several times the run without a chip."""
    return tuple(range(1, max(1, b.max_q_tokens * b.max_heads // 64) + 1))


def _v4_64(pins: dict) -> Callable:
    return lambda b: {**pins, "s1": _rows_64(b)}


#: operator -> ``(chips, rule id, pins(bounds) | ABSENT, reason)``: the pins that keep a draw within the contract
#: rule ``<op>.<rule id>`` on those chips (reason: the rule's own words)
CHIP_RULES: dict[str, tuple] = {
    "kv_quant_sparse_flash_attention": (
        (_A2A3, "a2a3_key_dtype", _const({"key_dtype": "int8"}), "Atlas A2/A3 support only int8 KV"),
        (("950",), "950_sparse_block_size", _const({"sparse_block_size": 1}),
         "Ascend 950 supports only sparse_block_size 1"),
        (("950",), "950_return_softmax_lse", _const({"return_softmax_lse": False}),
         "Ascend 950 writes only the attention output: return_softmax_lse must be False"),
    ),
    "sparse_flash_attention": (
        (_ALL, "chip_attention_mode", _const({"attention_mode": 2}), "the NPU kernels support only attention_mode 2"),
        (_A2A3, "a2a3_sinks", _const({"sinks": False}), "sinks are supported on Ascend 950 only"),
    ),
    "lightning_indexer": (
        (("950",), "950_query_heads", _heads_950, "Ascend 950 supports N1 of 8, 16, 24, 32 or 64"),
        (("950",), "950_weights_dtype", _const({"weights_float32": False}),
         "Ascend 950 does not support float32 weights"),
    ),
    "quant_lightning_indexer": (
        (_A2A3, "a2a3_dtypes", _const({"format": "int8", "weights_dtype": "float16", "scale_dtype": "float16"}),
         "Atlas A2/A3 support int8 query/key with float16 weights and dequant scales only"),
        (("950",), "950_dtypes", _const({"weights_scale": {
            "float8_e4m3fn": (("bfloat16", "float32"), ("float16", "float16")),
            "hifloat8": (("bfloat16", "float32"),), "int8": (("float16", "float16"),)}}),
         "Ascend 950 supports (weights, dequant scales) (bfloat16, float32) or (float16, float16) per format"),
        (("950",), "950_query_heads", _heads_950, "Ascend 950 supports N1 of 8, 16, 24, 32 or 64"),
    ),
    "dynamic_block_quant": (
        (_A2A3, "a2a3_dst_type", _const({"dst_type": "int8", "dst_type_max": 0.0}), "Atlas A2/A3 support only int8"),
        (_A2A3, "a2a3_row_block_size", _const({"row_block_size": 1}), "Atlas A2/A3: row_block_size must be 1"),
        (_A2A3, "a2a3_col_block_size", _const({"col_block_size": (1, 128)}),
         "Atlas A2/A3: col_block_size must be 1 or 128"),
        (("950",), "950_row_block_size", _const({"row_block_size": (1, 128)}),
         "Ascend 950: row_block_size must be 1, 128, 256 or 512"),
        (("950",), "950_col_block_size", _const({"col_block_size": (64, 128, 192, 256)}),
         "Ascend 950: col_block_size must be 64, 128, 192 or 256"),
    ),
    "c8_cache_write": (
        (_A2A3, "a2a3_key_dtype", _const({"key_dtype": "int8"}), "Atlas A2/A3 packed caches are int8 only"),
    ),
    "c8_rmsnorm_rope_cache": (
        (_A2A3, "a2a3_key_dtype", _const({"key_dtype": "int8"}), "Atlas A2/A3 packed caches are int8 only"),
    ),
    "kv_rmsnorm_rope_cache": (
        # V1 on A2/A3 is the DeepSeek MLA kernel (Dv 512, Dk 64: wider than any drawn row); V2 needs [N, D] parameters
        (_A2A3, "a2a3_v1_dims", _const({"version": 2}),
         "Atlas A2/A3 V1 (the DeepSeek MLA kernel) need Dv = 512 (RMSNorm) and Dk = 64 (RoPE)"),
        (_A2A3, "a2a3_v2_no_broadcast", _const({"param_shape": "ND"}),
         "Atlas A2/A3 V2 need [N, D] quant parameters (no broadcast)"),
        (_A2A3, "a2a3_int8_only", _const({"eight_bit": ("int8",)}), "Atlas A2/A3 quantise to int8 only"),
        (("950",), "950_v1_only", _const({"version": 1}), "Ascend 950 supports only V1 (v must be None)"),
    ),
    "kv_compress_epilog": (
        (_A2A3, "a2a3_unsupported", ABSENT, "KvCompressEpilog runs on Ascend 950 only"),
    ),
    "kv_compress_epilog_vllm": (
        (_A2A3, "a2a3_unsupported", ABSENT, "the vLLM-Ascend kv_compress_epilog runs on Ascend 950 only"),
    ),
    "indexer_quant_cache": (
        (_A2A3, "a2a3_unsupported", ABSENT, "indexer_quant_cache runs on Ascend 950 only"),
    ),
    "indexer_compress_epilog_v2": (
        (_A2A3, "a2a3_unsupported", ABSENT, "indexer_compress_epilog_v2 runs on Ascend 950 only"),
    ),
    "scatter_pa_kv_cache_with_k_scale": (
        (_A2A3, "a2a3_unsupported", ABSENT, "scatter_pa_kv_cache_with_k_scale runs on Ascend 950 only"),
    ),
    "compressor": (
        (("A2",), "a2_unsupported", ABSENT, "compressor runs on Atlas A3 and Ascend 950 only"),
        (("A3",), "a3_cache_mode", _const({"cache_mode": 1}), "Atlas A3 supports cache_mode 1 only"),
    ),
    "quant_compressor": (
        (("A2",), "a2_unsupported", ABSENT, "quant_compressor runs on Atlas A3 and Ascend 950 only"),
        (("A3",), "a3_cache_mode", _const({"cache_mode": 1}), "Atlas A3 supports cache_mode 1 only"),
    ),
    "vllm_compressor": (
        (_A2A3, "a2_a3_cache_mode", _const({"cache_mode": 1, "chip_kind": "a2a3"}),
         "Atlas A2 / A3: cache_mode 1, norm_weight in x's dtype"),
        (("950",), "950_norm_weight_dtype", _const({"chip_kind": "950"}),
         "Ascend 950: float32 norm_weight and sin / cos tables"),
    ),
    # DeepSeek-V4 shared-KV attention (docs/numerics/attention-v4.md): every chip runs the band window 127 / 0,
    # mask modes 4 / 3, top-k 512 and sinks given; the compressed ratio follows the scenario (1 / 4 / 128) except
    # on the 950's sparse_flash_mla, which also takes free residuals
    "sparse_flash_mla": (
        (_A2A3, "chip_window", _const({**_V4_WINDOW, "residual": "exact", "sinks": _V4_SINKS,
                                        "cmp_ratio_by_scenario": True}),
         "Atlas A2/A3: band window 127 / 0, mask modes 4 / 3, top-k 512, cmp_ratio 1 / 4 / 128"),
        (("950",), "chip_q_heads_950", lambda b: {**_V4_WINDOW, "sinks": _V4_SINKS, "n1": tuple(
            h for h in (2, 4, 8, 16, 64) if h <= b.max_heads) or (2,)},
         "Ascend 950: N1 of 2 to 64 (not 1), band window 127 / 0, mask modes 4 / 3, top-k 512"),
    ),
    "sparse_attn_sharedkv": (
        (("A2", "950"), "chip_supported", ABSENT, "sparse_attn_sharedkv runs on Atlas A3 only"),
        (("A3",), "chip_window", _v4_64({**_V4_WINDOW, **_V4_SHAREDKV}),
         "Atlas A3: PA_ND, 64 heads, no LSE, band window 127 / 0, mask modes 4 / 3, top-k 512"),
    ),
    "mixed_quant_sparse_flash_mla": (
        (_A2A3, "chip_supported", ABSENT, "mixed_quant_sparse_flash_mla runs on Ascend 950 only"),
        (("950",), "chip_window", _v4_64({**_V4_WINDOW, "sinks": _V4_SINKS, "n1": 64, "return_softmax_lse": False}),
         "Ascend 950: 64 heads, no LSE, band window 127 / 0, mask modes 4 / 3, top-k 512"),
    ),
    "kv_quant_sparse_attn_sharedkv": (
        (_A2A3, "chip_supported", ABSENT, "kv_quant_sparse_attn_sharedkv runs on Ascend 950 only"),
        (("950",), "chip_window", _v4_64({**_V4_WINDOW, **_V4_SHAREDKV}),
         "Ascend 950: PA_ND, 64 heads, no LSE, band window 127 / 0, mask modes 4 / 3, top-k 512"),
    ),
    "quant_sparse_flash_mla": (
        (_A2A3, "chip_supported", ABSENT, "quant_sparse_flash_mla runs on Ascend 950 only"),
        (("950",), "chip_window", _const({"ori_win_left": 127, "ori_win_right": 0, "ori_mask_mode": 4,
                                           "sinks": _V4_SINKS, "metadata": "zeros"}),
         "Ascend 950: band window 127 / 0 (so ori_mask_mode 4: windows >= 0 need the band), sinks and metadata "
         "given"),
    ),
    "vllm_quant_lightning_indexer": (
        (_A2A3, "a2a3_dtypes", _const({"format": "int8"}),
         "Atlas A2/A3 support int8 query/key with float16 weights and dequant scales only"),
        (("950",), "950_dtypes", _const({"format": "float8_e4m3fn"}),
         "Ascend 950 supports float8_e4m3fn query/key with float32 weights and dequant scales only"),
    ),
    "quant_lightning_indexer_v2": (
        (_A2A3, "a2a3_quant_mode", _const({"format": "int8"}),
         "Atlas A2/A3 support quant_mode 2 (int8) with float16 weights and dequant scales only"),
        (_A2A3, "a2a3_layout_k", _const({"layout_k": "PA_BBND"}), "Atlas A2/A3 support layout_k PA_BBND only"),
        (("950",), "950_quant_mode", _const({"format": ("float8_e4m3fn", "hifloat8")}),
         "Ascend 950 supports quant_mode 1 (FP8 E4M3FN) or 4 (HiFloat8) with float32 weights and dequant scales only"),
        (("950",), "950_cmp_ratio", _const({"cmp_ratio": (1, 4, 128)}), "Ascend 950 supports cmp_ratio 1, 4 or 128"),
    ),
    "qkv_rms_norm_rope_cache_with_k_scale": (
        (_A2A3, "a2a3_unsupported", ABSENT, "qkv_rms_norm_rope_cache_with_k_scale runs on Ascend 950 only"),
    ),
}


def _allowed(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list, frozenset, set)) else (v,)


def chip_pins(op: str, chip: str | None, bounds=None) -> list:
    """``[(rule id, pins, reason)]`` of ``op`` on ``chip`` (None: no chip, []). Raises :class:`NotApplicable`
    when the chip does not have the operator."""
    if chip is None:
        return []
    from ._common import _b

    b = _b(bounds)
    out = []
    for chips, rid, make, reason in CHIP_RULES.get(op, ()):
        if chip not in chips:
            continue
        if make is ABSENT:
            raise NotApplicable(op, chip, rid, reason)
        out.append((rid, make(b), reason))
    return out


def merge_pins(op: str, chip: str | None, pins: dict, bounds=None) -> dict:
    """``pins`` (a caller's: a property's, a test's) with the chip's pins of ``op`` added. A choice pinned on both
    sides keeps the values both allow (in the caller's order); none left raises :class:`NotApplicable`."""
    out = dict(pins)
    for rid, cp, reason in chip_pins(op, chip, bounds):
        for k, v in cp.items():
            if k not in out:
                out[k] = v
                continue
            if isinstance(v, dict) or isinstance(out[k], dict):  # a table pin: the chip's wins
                out[k] = v
                continue
            chip_ok = _allowed(v)
            keep = tuple(x for x in _allowed(out[k]) if any(x == y and type(x) is type(y) for y in chip_ok))
            if not keep:
                raise NotApplicable(op, chip, rid, f"{reason}; the property needs {k}={out[k]!r}")
            out[k] = keep[0] if len(keep) == 1 else keep
    return out


def not_applicable(op: str, chip: str | None, pins: dict | None = None, bounds=None) -> NotApplicable | None:
    """The :class:`NotApplicable` a draw of ``op`` with ``pins`` on ``chip`` would raise, or None."""
    try:
        merge_pins(op, chip, dict(pins or {}), bounds)
    except NotApplicable as e:
        return e
    return None
