"""The "triton" backend: registers the Triton kernels of ``kernels/`` (installed as ``qsfa.kernels``).

Operators implemented:

* ``c8_cache_write``: :func:`qsfa.kernels.c8_cache_writer.launch_c8_cache_write` (bit-exact with the
  reference: quantise + pack + scatter in one launch);
* ``merge_attention_lse``: :func:`qsfa.kernels.lse_merge.launch_merge_attention_lse` (the reference's bytes);
* ``kv_quant_sparse_flash_attention``: :func:`qsfa.kernels.qsfa_attention.launch_qsfa_attention`
  (within docs/numerics/comparison.md#float-criterion of the faithful reference; int8, FP8 E4M3FN and
  HiFloat8 NoPE).

The operator contract validates every call before a kernel runs; :func:`limits` adds what the kernels
themselves do not cover, as data (each a :class:`~qsfa._contract.Constraint` with a ``violate``
function), and the dispatch layer turns a violation into ``UnsupportedByBackend`` before launch.

Targets: CUDA GPUs, Ascend through triton-ascend (untested here), and the CPU interpreter
(``TRITON_INTERPRET=1``, which must be set before this module is first imported: ``triton.jit`` reads it
when the kernels are defined).
"""

from __future__ import annotations

from ._checks import set_param
from ._contract import Constraint, one_of
from ._dispatch import operator, register_impl
from ._errors import BackendUnavailable

__all__ = ["limits", "c8_cache_write", "kv_quant_sparse_flash_attention", "merge_attention_lse", "IMPLEMENTED"]

BACKEND = "triton"


def _kernels():
    from .kernels import c8_cache_writer, qsfa_attention
    from .kernels._common import interpreting

    kern = qsfa_attention.qsfa_attention_kernel
    is_interp = type(kern).__name__ == "InterpretedFunction"
    if is_interp != interpreting():
        raise BackendUnavailable(
            "backend 'triton' is not usable here: qsfa.kernels was imported with TRITON_INTERPRET="
            f"{'1' if is_interp else '0'} but it is now {'1' if interpreting() else 'unset'}; set "
            "TRITON_INTERPRET before the first import of qsfa.kernels / qsfa.triton_backend"
        )
    return c8_cache_writer, qsfa_attention


# ---------------------------------------------------------------------------------------------------
# implementations (arguments: validated, normalised, torch tensors on the backend's device)

_C8_PARAMS = {"k_nope", "k_rope", "slot_mapping", "kv_cache", "key_dtype", "scale_order", "dst_type_max"}


def c8_cache_write(**args):
    """Triton implementation of ``qsfa.c8_cache_write`` (in place into ``kv_cache``; returns it)."""
    unknown = set(args) - _C8_PARAMS
    if unknown:
        raise TypeError(f"triton c8_cache_write does not know the parameters {sorted(unknown)}")
    c8, _ = _kernels()
    return c8.launch_c8_cache_write(args["k_nope"], args.get("k_rope"), args["slot_mapping"], args["kv_cache"],
                                    key_dtype=args.get("key_dtype") or "int8",
                                    scale_order=args.get("scale_order") or "divide")


_ATTN_PARAMS = {
    "query", "key", "value", "sparse_indices", "scale_value", "key_quant_mode", "value_quant_mode",
    "key_dequant_scale", "value_dequant_scale", "block_table", "actual_seq_lengths_query",
    "actual_seq_lengths_kv", "sparse_block_size", "layout_query", "layout_kv", "sparse_mode", "pre_tokens",
    "next_tokens", "attention_mode", "quant_scale_repo_mode", "tile_size", "rope_head_dim",
    "return_softmax_lse", "key_dtype", "precision", "probability_rounding",
    "k_rounding", "p_rounding", "out_rounding",  # the requested chip's modes (qsfa.chips)
}


def kv_quant_sparse_flash_attention(**args):
    """Triton implementation of ``qsfa.kv_quant_sparse_flash_attention`` (precision "faithful"; int8,
    float8_e4m3fn and hifloat8 NoPE; both probability_rounding choices).

    ``value`` is not read (MLA-absorb: V is the dequantised K NoPE). The parameters the contract pins to
    one value (quant modes, attention_mode, tile_size, pre/next tokens, reserved dequant scales) need no
    handling. Returns ``(attention_out, softmax_max, softmax_sum)``.
    """
    unknown = set(args) - _ATTN_PARAMS
    if unknown:
        raise TypeError(f"triton kv_quant_sparse_flash_attention does not know the parameters {sorted(unknown)}")
    _, attn = _kernels()
    return attn.launch_qsfa_attention(
        args["query"], args["key"], args["sparse_indices"], args["scale_value"],
        block_table=args.get("block_table"),
        actual_seq_lengths_query=args.get("actual_seq_lengths_query"),
        actual_seq_lengths_kv=args.get("actual_seq_lengths_kv"),
        sparse_block_size=int(args.get("sparse_block_size", 1)),
        layout_query=args.get("layout_query", "BSND"),
        layout_kv=args.get("layout_kv", "BSND"),
        sparse_mode=int(args.get("sparse_mode", 3)),
        rope_head_dim=int(args.get("rope_head_dim", 64)),
        return_softmax_lse=bool(args.get("return_softmax_lse", False)),
        key_dtype=args.get("key_dtype") or "int8",
        probability_rounding=args.get("probability_rounding") or "unnormalised",
        k_rounding=args.get("k_rounding"), p_rounding=args.get("p_rounding"), out_rounding=args.get("out_rounding"),
    )


def merge_attention_lse(**args):
    """Triton implementation of ``qsfa.merge_attention_lse``: :func:`qsfa.kernels.lse_merge.launch_merge_attention_lse`
    (float64 in the reference's operation order, one rounding to the inputs' dtypes: the reference's bytes, see
    that module for the one caveat, float64 ``exp`` on a GPU)."""
    unknown = set(args) - {"attention_out", "softmax_max", "softmax_sum", "layout_query"}
    if unknown:
        raise TypeError(f"triton merge_attention_lse does not know the parameters {sorted(unknown)}")
    _kernels()
    from .kernels import lse_merge

    return lse_merge.launch_merge_attention_lse(args["attention_out"], args["softmax_max"], args["softmax_sum"],
                                                layout_query=args.get("layout_query", "BSND"))


IMPLEMENTED = {
    "c8_cache_write": c8_cache_write,
    "kv_quant_sparse_flash_attention": kv_quant_sparse_flash_attention,
    "merge_attention_lse": merge_attention_lse,
}


def _register():
    for op, fn in IMPLEMENTED.items():
        try:
            operator(op)
        except KeyError:  # the operator's front door is not defined (yet): nothing to register
            continue
        register_impl(BACKEND, op, fn)


_register()


# ---------------------------------------------------------------------------------------------------
# kernel limits (data)

#: NoPE code formats the attention kernel decodes (all of the operator's: no kernel limit on key_dtype)
ATTENTION_KEY_DTYPES = ("int8", "float8_e4m3fn", "hifloat8")


def _precision_faithful() -> Constraint:
    def check(a):
        v = a.get("precision", "faithful")
        return None if v == "faithful" else v

    return Constraint(
        id="triton.kv_quant_sparse_flash_attention.precision", param="precision", kind="value",
        reason="the Triton kernel rounds where the NPU kernel rounds: precision must be 'faithful' "
               "('exact' is the float64 oracle, reference backend only)",
        check=check, violate=set_param("precision", "exact"), source="qsfa.kernels.qsfa_attention",
    )


#: NoPE code formats the C8 writer kernel produces
C8_KEY_DTYPES = ("int8", "float8_e4m3fn")


def _c8_key_dtype() -> Constraint:
    return Constraint(
        id="triton.c8_cache_write.key_dtype", param="key_dtype", kind="value",
        reason=f"the Triton C8 writer quantises to {one_of(C8_KEY_DTYPES)} only (no HiFloat8)",
        check=lambda a: None if a.get("key_dtype", "int8") in C8_KEY_DTYPES else a.get("key_dtype"),
        violate=set_param("key_dtype", "hifloat8"), source="qsfa.kernels.c8_cache_writer",
    )


_LIMITS = {
    "kv_quant_sparse_flash_attention": lambda: [_precision_faithful()],
    "c8_cache_write": lambda: [_c8_key_dtype()],
}


def limits(op: str) -> list[Constraint]:
    """The kernel limits of ``op`` on this backend (checked after the operator contract): the attention
    kernel's precision, the C8 writer's key formats."""
    make = _LIMITS.get(op)
    return make() if make else []
