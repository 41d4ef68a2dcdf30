"""From qsfa's normalised operator arguments to the torch_npu / vLLM-Ascend call, and back.

One pure function per operator: ``map_<op>(args, ctx) -> NpuCall``. ``args`` are the operator's
normalised arguments (tensors already on the device, Python scalars); ``ctx`` says which chip family and
which vLLM-Ascend custom ops are present. The result names the callable (``target``, a dotted path such as
``"torch_npu.npu_kv_quant_sparse_flash_attention"``), its positional ``args`` and keyword ``kwargs``, and
``unpack(result)`` which turns the callable's return value into the operator's outputs in qsfa's order.
An ``NpuCall`` unpacks like the triple ``target, args, kwargs = call``.

The functions do no device work: they only reinterpret dtypes (``tensor.view(dtype)``, which shares
storage, so in-place caches stay the caller's memory), reshape, and cast small index tensors to the
dtype the kernel documents. They never compute results. tests/test_npu_mapping.py binds every call they
produce to the signatures recorded in ``signatures.json`` (:mod:`qsfa.npu.signatures`).

Routing (settled from public sources):

* ``kv_quant_sparse_flash_attention``: vLLM-Ascend (``vllm_ascend/device/device_op.py`` at 182b75e) calls
  ``torch.ops._C_ascend.npu_kv_quant_sparse_flash_attention`` on Atlas A2/A3 (BaseDeviceAdaptor; it has
  ``return_softmax_lse``) and ``torch_npu.npu_kv_quant_sparse_flash_attention`` on Ascend 950
  (A5DeviceAdaptor; no LSE outputs - it raises when they are asked for). torch_npu's function documents
  ``rope_head_dim`` 64 only and returns ``attention_out`` alone. So: ``rope_head_dim == 0`` or
  ``return_softmax_lse`` -> the custom op (required); a HiFloat8 key -> torch_npu (only it takes
  ``key_dtype=torch_npu.hifloat8``); otherwise the custom op on A2/A3 when it is loaded (as vLLM-Ascend),
  else torch_npu. When torch_npu is the target, ``softmax_max``/``softmax_sum`` come back as empty ``[0]``
  float32 tensors, like every kernel that was not asked for them.
* ``kv_rmsnorm_rope_cache``: Ascend 950 -> ``torch_npu.npu_kv_rmsnorm_rope_cache_v2`` (caches written in
  place, ``k_cache_dtype``/``ckv_cache_dtype`` codes for HiFloat8; the op-plugin doc lists only the 950 for
  it); other chips -> ``torch_npu.npu_kv_rmsnorm_rope_cache`` (what vLLM-Ascend's sfa_v1.py calls).
* ``kv_compress_epilog_vllm``: ``torch.ops._C_ascend.kv_compress_epilog`` (vLLM-Ascend ``csrc/torch_binding.cpp``
  at 182b75e; Ascend 950), positional as its schema; the cache is written in place (returns nothing).
* ``indexer_compress_epilog_v2``: ``torch.ops._C_ascend.indexer_compress_epilog_v2`` (vLLM-Ascend
  ``csrc/torch_binding.cpp`` at 182b75e; Ascend 950), positional as its schema, the uint8 cache in place (the binding
  passes ``stride(0)`` as block_stride itself).
* ``vllm_compressor``: ``torch.ops._C_ascend.compressor`` (vLLM-Ascend ``csrc/torch_binding.cpp`` l.2226 at 182b75e;
  Atlas A2 / A3 and Ascend 950), every value positional in the schema's order, ``state_cache`` in place; the padding
  rows of the returned ``cmp_kv`` are zeroed (the kernel leaves them unwritten).
* ``sparse_attn_sharedkv`` / ``kv_quant_sparse_attn_sharedkv``: ``torch.ops._C_ascend.npu_sparse_attn_sharedkv`` /
  ``npu_kv_quant_sparse_attn_sharedkv`` (vLLM-Ascend ``csrc/torch_binding.cpp`` at 182b75e; ``device_op.py`` picks
  the first on A2/A3, the second on the 950), after their ``*_metadata`` operator when ``metadata`` is None.
  None of the five V4 attention schemas (these two, ``sparse_flash_mla``, ``mixed_quant_sparse_flash_mla``,
  ``quant_sparse_flash_mla``) takes an output tensor: a caller's ``attention_out=`` buffer is filled by copying the
  call's output into it afterwards (``NpuCall.writeback``) and returned as the output.
* ``sparse_flash_mla`` / ``mixed_quant_sparse_flash_mla`` / ``indexer_quant_cache`` /
  ``scatter_pa_kv_cache_with_k_scale``: ``torch.ops.cann_ops_transformer.*``, ops of ops-transformer's separately
  built torch extension (``torch_extension/cann_ops_transformer``); the backend imports that package when such an
  operator is called (qsfa.npu.backend.resolve) and refuses the call naming it when it is missing.
* ``quant_lightning_indexer_v2`` / ``qkv_rms_norm_rope_cache_with_k_scale``: the same package's
  ``quant_lightning_indexer`` (after ``quant_lightning_indexer_metadata`` when ``metadata`` is None) and the in-place
  ``qkv_rms_norm_rope_cache_with_k_scale_`` (schema from hicann/ops-transformer@c0dda0b, with the M-RoPE arguments;
  that schema types ``query_start_loc`` / ``seq_lens`` as ``Tensor`` while the package's document has the M-RoPE call
  pass None for both, which the mapping does: docs/numerics/cache-writers.md#m-rope-scenario).
* ``compressor``: the same package's ``compressor`` (Atlas A3, Ascend 950), ``state_cache`` in place (the schema's
  ``Tensor(a!)``); it returns ``cmp_kv`` and the state comes back as the caller's tensor. ``quant_compressor``: the
  package's ``quant_compressor`` (Ascend 950; schema from hicann/ops-transformer, see signatures.json), the same way,
  with the HiFloat8 ``x`` / ``wkv`` / ``wgate`` as uint8 views (its doc's dtype for HIFLOAT8).
* ``quant_sparse_flash_mla``: the package's ``quant_sparse_flash_mla`` (Ascend 950; schema from
  hicann/ops-transformer), after ``quant_sparse_flash_mla_metadata`` when ``metadata`` is None, as sparse_flash_mla;
  HiFloat8 q / ori_kv / cmp_kv as uint8 views.
* dtype codes: torch_npu takes integer dtype codes (``op_plugin/meta/_meta_registrations.py``
  TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP / TORCH_NPU_DTYPE_TO_STRING_MAP): int8 1,
  hifloat8 290 (``torch_npu.hifloat8``, carried in uint8 tensors), float8_e5m2 291, float8_e4m3fn 292 (the
  torch_npu enumeration the op-plugin docs list for ``dst_type``). ``key_dtype``/``k_cache_dtype``-style
  arguments are passed only for HiFloat8 (torch_npu: "pass it only when the tensor is not a native PyTorch
  dtype"); int8 / float8 tensors carry their dtype themselves.

Operators with no torch_npu or vLLM-Ascend callable are listed in :data:`NOT_MAPPED` with the reason; the
npu backend does not implement them (nothing is emulated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "NpuContext",
    "NpuCall",
    "MAPPINGS",
    "NOT_MAPPED",
    "IGNORED",
    "DTYPE_CODES",
    "HIFLOAT8_CODE",
    "QSFA_TORCH_NPU",
    "QSFA_CUSTOM_OP",
    "qsfa_target",
    "map_call",
]

QSFA_TORCH_NPU = "torch_npu.npu_kv_quant_sparse_flash_attention"
QSFA_CUSTOM_OP = "torch.ops._C_ascend.npu_kv_quant_sparse_flash_attention"
QSFA_CUSTOM_NAME = "npu_kv_quant_sparse_flash_attention"
KCE_VLLM_CUSTOM_NAME = "kv_compress_epilog"
KCE_VLLM_CUSTOM_OP = "torch.ops._C_ascend.kv_compress_epilog"
ICE2_CUSTOM_NAME = "indexer_compress_epilog_v2"
ICE2_CUSTOM_OP = "torch.ops._C_ascend.indexer_compress_epilog_v2"
VQLI_CUSTOM_NAME = "npu_vllm_quant_lightning_indexer"
VQLI_CUSTOM_OP = "torch.ops._C_ascend.npu_vllm_quant_lightning_indexer"
VQLI_META_CUSTOM_OP = "torch.ops._C_ascend.npu_vllm_quant_lightning_indexer_metadata"
SAS_CUSTOM_NAME = "npu_sparse_attn_sharedkv"
SAS_CUSTOM_OP = "torch.ops._C_ascend.npu_sparse_attn_sharedkv"
SAS_META_CUSTOM_OP = "torch.ops._C_ascend.npu_sparse_attn_sharedkv_metadata"
KQS_CUSTOM_NAME = "npu_kv_quant_sparse_attn_sharedkv"
KQS_CUSTOM_OP = "torch.ops._C_ascend.npu_kv_quant_sparse_attn_sharedkv"
KQS_META_CUSTOM_OP = "torch.ops._C_ascend.npu_kv_quant_sparse_attn_sharedkv_metadata"
VCMP_CUSTOM_NAME = "compressor"
VCMP_CUSTOM_OP = "torch.ops._C_ascend.compressor"
#: ops-transformer's separately built torch extension (torch_extension/cann_ops_transformer); importing it
#: registers torch.ops.cann_ops_transformer.*. The npu backend imports it lazily (qsfa.npu.backend.resolve).
PACKAGE = "cann_ops_transformer"
SFM_OP = f"torch.ops.{PACKAGE}.sparse_flash_mla"
SFM_META_OP = f"torch.ops.{PACKAGE}.sparse_flash_mla_metadata"
MQ_OP = f"torch.ops.{PACKAGE}.mixed_quant_sparse_flash_mla"
MQ_META_OP = f"torch.ops.{PACKAGE}.mixed_quant_sparse_flash_mla_metadata"
IQC_OP = f"torch.ops.{PACKAGE}.indexer_quant_cache"
SPKS_OP = f"torch.ops.{PACKAGE}.scatter_pa_kv_cache_with_k_scale"
QLI2_OP = f"torch.ops.{PACKAGE}.quant_lightning_indexer"
QLI2_META_OP = f"torch.ops.{PACKAGE}.quant_lightning_indexer_metadata"
QKV_OP = f"torch.ops.{PACKAGE}.qkv_rms_norm_rope_cache_with_k_scale_"
CMP_OP = f"torch.ops.{PACKAGE}.compressor"
QCMP_OP = f"torch.ops.{PACKAGE}.quant_compressor"
QS_OP = f"torch.ops.{PACKAGE}.quant_sparse_flash_mla"
QS_META_OP = f"torch.ops.{PACKAGE}.quant_sparse_flash_mla_metadata"

#: qsfa format name -> torch_npu integer dtype code (see the module docstring for the source).
DTYPE_CODES = {"int8": 1, "hifloat8": 290, "float8_e5m2": 291, "float8_e4m3fn": 292}
HIFLOAT8_CODE = DTYPE_CODES["hifloat8"]

#: qsfa format name of an 8-bit payload -> torch dtype attribute its tensor must have for torch_npu.
_TORCH_BYTE_DTYPE = {"int8": "int8", "uint8": "uint8", "hifloat8": "uint8", "float8_e4m3fn": "float8_e4m3fn",
                     "float8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class NpuContext:
    """What the mapping may depend on besides the arguments: the chip family and the loaded custom ops."""

    chip: str | None = None
    custom_ops: frozenset = frozenset()


@dataclass(frozen=True)
class NpuCall:
    """One call of a torch_npu function or custom op, and how to read its result back.

    target:    dotted name of the callable (a key of ``signatures.json``).
    args, kwargs: the call's arguments.
    unpack:    ``unpack(result) -> tuple`` in the operator's output order.
    writeback: ``(result index, tensor)`` pairs: after the call, copy item ``result index`` of the raw
               result into ``tensor`` unless it already is that tensor's memory (for functions that return
               the updated caches instead of declaring them in place).
    """

    target: str
    args: tuple
    kwargs: dict
    unpack: Callable[[Any], tuple]
    writeback: tuple = field(default=())

    def __iter__(self):
        return iter((self.target, self.args, self.kwargs))


#: Parameters of our operators that no torch_npu call takes, and why dropping them is right.
IGNORED = {
    "chunk_size": "memory bound of the NumPy reference only",
    "scale_order": "the reference's model of the chip's quantisation order (docs/numerics/chips.md#dynamic_block_quant, "
                   "#c8-cache-writers); the device does what it does - compare the orders against backend='npu' to confirm it",
    "pad_to": "OPEN fact of the reference model (docs/numerics/open-facts.md#pad_to); the device does what it does",
    "fp4_nibble_order": "OPEN fact of the reference model (docs/numerics/open-facts.md#nibble_order); the device does what it does",
    "lse_includes_sink": "OPEN fact of the reference model (docs/numerics/open-facts.md#lse_includes_sink); the device does what it does",
    "tie_break": "OPEN fact of the reference model (docs/numerics/open-facts.md#tie_break); the device does what it does",
    "probability_rounding": "OPEN fact of the reference model (docs/numerics/open-facts.md#probability_rounding); the device does what it "
                            "does",
    "precision": "reference precision mode; backend_limits accepts only 'faithful' on the device",
    "attention_out": "a NumPy output buffer of the reference; a device backend allocates its own output, and the V3.2 "
                     "front doors reject a buffer there before any mapping (qsfa/ops/_out_buffers.py); the V4 "
                     "attention mappings copy their output into it after the call (_v4_call)",
    "softmax_max_out": "a NumPy output buffer of the reference (as attention_out)",
    "softmax_sum_out": "a NumPy output buffer of the reference (as attention_out)",
    "zero_head": "OPEN fact of the reference model (docs/numerics/open-facts.md#zero_head); the device does what it does",
    "k_quant_mode": "the package's qkv_rms_norm_rope_cache_with_k_scale_ schema recorded from hicann/ops-transformer@"
                    "c0dda0b has no K quant-mode argument: 'PerTokenPerHead' is its only mode, and the mapping refuses "
                    "'Mx' (the M-RoPE MX scenario) by name",
    "mx_aiv_num": "platform figure of the reference's MX tiling model (docs/numerics/open-facts.md#qkv-mx-platform); "
                  "the device reads its own",
    "mx_ub_bytes": "platform figure of the reference's MX tiling model (as mx_aiv_num); the device reads its own",
}

#: Operators the npu backend does not implement, with the reason (reported by the backend).
NOT_MAPPED = {
    "kv_compress_epilog": (
        "torch_npu 2.14.0 exposes no KvCompressEpilog function (absent from op_plugin/meta/_meta_registrations.py "
        "and the codegen yaml); vLLM-Ascend's torch.ops._C_ascend.kv_compress_epilog (csrc/torch_binding.cpp, "
        "Ascend 950) is a different variant - quant_mode 1 = FP8 with fp32 scales per 128, 2 = MXFP8, rows padded "
        "to 128 bytes, no x_scale, an FP8-typed cache - not the mode 0/1/2 row layout of this operator (seed 002); "
        "qsfa maps that variant as kv_compress_epilog_vllm"),
    "c8_cache_write": (
        "no single torch_npu or vLLM-Ascend callable: vLLM-Ascend quantises (Triton custom_kv_rmsnorm_rope), "
        "concatenates the row with torch.cat and scatters it with torch_npu.npu_scatter_nd_update_; run the "
        "device stages as qsfa.dynamic_block_quant and qsfa.scatter_by_slot with backend='npu'"),
    "c8_rmsnorm_rope_cache": (
        "no single torch_npu or vLLM-Ascend callable (vLLM-Ascend uses its Triton custom_kv_rmsnorm_rope plus "
        "torch_npu.npu_scatter_nd_update_)"),
    "merge_attention_lse": (
        "torch_npu's npu_attention_update merges partial results from lse = max + log(sum); no callable takes "
        "(out, softmax_max, softmax_sum) as this operator does"),
    "formats.encode": "no torch_npu function takes a format name with saturate/rounding options",
    "formats.decode": "no torch_npu function decodes raw format codes to float32",
    "formats.pack_fp4": "no torch_npu function packs FP4 codes",
    "formats.unpack_fp4": "no torch_npu function unpacks FP4 codes",
}


# ------------------------------------------------------------------------------------ helpers


def _torch():
    import torch

    return torch


def _check_params(op: str, a: Mapping, consumed) -> None:
    unknown = sorted(set(a) - set(consumed) - set(IGNORED))
    if unknown:
        raise TypeError(f"qsfa.npu.mapping for {op} does not know the parameter(s) {unknown}: map them or list "
                        f"them in IGNORED with the reason")


def _fmt_of(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _as_format(t, fmt: str):
    """Reinterpret a 1-byte tensor as the torch dtype that carries ``fmt`` (shares storage)."""
    if t is None:
        return None
    torch = _torch()
    want = getattr(torch, _TORCH_BYTE_DTYPE[fmt])
    if t.dtype == want:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte tensor to carry {fmt}, got {t.dtype}")
    return t.view(want)


def _int32(t):
    """Index / length tensors as int32 (the kernels document int32); None stays None."""
    if t is None:
        return None
    torch = _torch()
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _empty_f32(like):
    torch = _torch()
    return like.new_empty((0,), dtype=torch.float32)


def _dtype_code(v):
    """A torch_npu dtype code from a format name, an integer code or a torch dtype."""
    if isinstance(v, bool):
        raise TypeError(f"not a dtype: {v!r}")
    if isinstance(v, int):
        return v
    name = v if isinstance(v, str) else str(v).replace("torch.", "")
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise TypeError(f"no torch_npu dtype code for {v!r}; known: {sorted(DTYPE_CODES)}") from None


# ------------------------------------------------------------------------ kv_quant_sparse_flash_attention

_QSFA_PARAMS = (
    "query", "key", "value", "sparse_indices", "scale_value", "key_quant_mode", "value_quant_mode",
    "key_dequant_scale", "value_dequant_scale", "block_table", "actual_seq_lengths_query",
    "actual_seq_lengths_kv", "sparse_block_size", "layout_query", "layout_kv", "sparse_mode", "pre_tokens",
    "next_tokens", "attention_mode", "quant_scale_repo_mode", "tile_size", "rope_head_dim",
    "return_softmax_lse", "key_dtype",
)


def _qsfa_key_format(a) -> str:
    fmt = a.get("key_dtype") or "int8"
    key = a.get("key")
    if key is not None and _fmt_of(key) in ("float8_e4m3fn",):
        fmt = "float8_e4m3fn"
    return fmt


def qsfa_target(a: Mapping, ctx: NpuContext) -> str:
    """Which callable runs ``kv_quant_sparse_flash_attention`` for these arguments (see module docstring)."""
    custom = QSFA_CUSTOM_NAME in ctx.custom_ops
    needs_custom = a.get("rope_head_dim", 64) == 0 or bool(a.get("return_softmax_lse", False))
    if _qsfa_key_format(a) == "hifloat8":
        if needs_custom:
            raise ValueError("a HiFloat8 key runs only through torch_npu, which has rope_head_dim 64 and no "
                             "return_softmax_lse")
        return QSFA_TORCH_NPU
    if needs_custom:
        if not custom:
            raise ValueError(f"rope_head_dim 0 / return_softmax_lse need {QSFA_CUSTOM_OP}, which is not loaded")
        return QSFA_CUSTOM_OP
    if custom and ctx.chip in ("A2", "A3"):
        return QSFA_CUSTOM_OP
    return QSFA_TORCH_NPU


def map_kv_quant_sparse_flash_attention(a: Mapping, ctx: NpuContext) -> NpuCall:
    _check_params("kv_quant_sparse_flash_attention", a, _QSFA_PARAMS)
    target = qsfa_target(a, ctx)
    fmt = _qsfa_key_format(a)
    key = _as_format(a["key"], fmt)
    value = a.get("value")
    if value is not None and value.element_size() == 1:
        value = _as_format(value, fmt)
    args = (a["query"], key, value, a["sparse_indices"], float(a["scale_value"]))
    kw = dict(
        key_quant_mode=int(a.get("key_quant_mode", 2)),
        value_quant_mode=int(a.get("value_quant_mode", 2)),
        key_dequant_scale=a.get("key_dequant_scale"),
        value_dequant_scale=a.get("value_dequant_scale"),
        block_table=_int32(a.get("block_table")),
        actual_seq_lengths_query=_int32(a.get("actual_seq_lengths_query")),
        actual_seq_lengths_kv=_int32(a.get("actual_seq_lengths_kv")),
        sparse_block_size=int(a.get("sparse_block_size", 1)),
        layout_query=str(a.get("layout_query", "BSND")),
        layout_kv=str(a.get("layout_kv", "BSND")),
        sparse_mode=int(a.get("sparse_mode", 3)),
        pre_tokens=int(a.get("pre_tokens", 2**63 - 1)),
        next_tokens=int(a.get("next_tokens", 2**63 - 1)),
        attention_mode=int(a.get("attention_mode", 2)),
        quant_scale_repo_mode=int(a.get("quant_scale_repo_mode", 1)),
        tile_size=int(a.get("tile_size", 128)),
        rope_head_dim=int(a.get("rope_head_dim", 64)),
    )
    if target == QSFA_CUSTOM_OP:
        kw["return_softmax_lse"] = bool(a.get("return_softmax_lse", False))
        return NpuCall(target, args, kw, unpack=lambda r: tuple(r))
    if fmt == "hifloat8":
        kw["key_dtype"] = HIFLOAT8_CODE
        kw["value_dtype"] = HIFLOAT8_CODE
    return NpuCall(target, args, kw, unpack=lambda out: (out, _empty_f32(out), _empty_f32(out)))


# ------------------------------------------------------------------------------ sparse_flash_attention

_SFA_PARAMS = (
    "query", "key", "value", "sparse_indices", "scale_value", "block_table", "actual_seq_lengths_query",
    "actual_seq_lengths_kv", "query_rope", "key_rope", "sparse_block_size", "layout_query", "layout_kv",
    "sparse_mode", "pre_tokens", "next_tokens", "attention_mode", "return_softmax_lse", "sinks",
)


def map_sparse_flash_attention(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch_npu.npu_sparse_flash_attention``: the public torch_npu API has every parameter (LSE, sinks)."""
    _check_params("sparse_flash_attention", a, _SFA_PARAMS)
    args = (a["query"], a["key"], a.get("value"), a["sparse_indices"], float(a["scale_value"]))
    kw = dict(
        block_table=_int32(a.get("block_table")),
        actual_seq_lengths_query=_int32(a.get("actual_seq_lengths_query")),
        actual_seq_lengths_kv=_int32(a.get("actual_seq_lengths_kv")),
        query_rope=a.get("query_rope"),
        key_rope=a.get("key_rope"),
        sparse_block_size=int(a.get("sparse_block_size", 1)),
        layout_query=str(a.get("layout_query", "BSND")),
        layout_kv=str(a.get("layout_kv", "BSND")),
        sparse_mode=int(a.get("sparse_mode", 3)),
        pre_tokens=int(a.get("pre_tokens", 2**63 - 1)),
        next_tokens=int(a.get("next_tokens", 2**63 - 1)),
        attention_mode=int(a.get("attention_mode", 2)),
        return_softmax_lse=bool(a.get("return_softmax_lse", False)),
        sinks=a.get("sinks"),
    )
    return NpuCall("torch_npu.npu_sparse_flash_attention", args, kw, unpack=lambda r: tuple(r))


# ------------------------------------------------------------------------------------ lightning indexer

_LI_PARAMS = (
    "query", "key", "weights", "actual_seq_lengths_query", "actual_seq_lengths_key", "block_table",
    "layout_query", "layout_key", "sparse_count", "sparse_mode", "pre_tokens", "next_tokens", "return_value",
)


def _li_kwargs(a):
    return dict(
        actual_seq_lengths_query=_int32(a.get("actual_seq_lengths_query")),
        actual_seq_lengths_key=_int32(a.get("actual_seq_lengths_key")),
        block_table=_int32(a.get("block_table")),
        layout_query=str(a.get("layout_query", "BSND")),
        layout_key=str(a.get("layout_key", "BSND")),
        sparse_count=int(a.get("sparse_count", 2048)),
        sparse_mode=int(a.get("sparse_mode", 3)),
        pre_tokens=int(a.get("pre_tokens", 2**63 - 1)),
        next_tokens=int(a.get("next_tokens", 2**63 - 1)),
    )


def map_lightning_indexer(a: Mapping, ctx: NpuContext) -> NpuCall:
    _check_params("lightning_indexer", a, _LI_PARAMS)
    kw = _li_kwargs(a)
    kw["return_value"] = bool(a.get("return_value", False))
    return NpuCall("torch_npu.npu_lightning_indexer", (a["query"], a["key"], a["weights"]), kw,
                   unpack=lambda r: tuple(r))


_QLI_PARAMS = _LI_PARAMS[:-1] + (
    "query_dequant_scale", "key_dequant_scale", "query_quant_mode", "key_quant_mode", "query_dtype", "key_dtype",
)


def map_quant_lightning_indexer(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch_npu.npu_quant_lightning_indexer``.

    ``query_dtype`` / ``key_dtype`` name the one-byte format when the tensor does not carry it (uint8
    bytes): the tensor is viewed as that format's torch dtype, and HiFloat8 also gets the dtype code 290.
    """
    _check_params("quant_lightning_indexer", a, _QLI_PARAMS)
    kw = _li_kwargs(a)
    tensors = {}
    for tensor_name, code_name in (("query", "query_dtype"), ("key", "key_dtype")):
        fmt = a.get(code_name)
        fmt = "hifloat8" if fmt == HIFLOAT8_CODE else fmt
        t = a[tensor_name]
        if fmt is not None and t.element_size() == 1:
            t = _as_format(t, fmt)
        tensors[tensor_name] = t
        kw[code_name] = HIFLOAT8_CODE if fmt == "hifloat8" else None
    args = (tensors["query"], tensors["key"], a["weights"], a["query_dequant_scale"], a["key_dequant_scale"],
            int(a.get("query_quant_mode", 0)), int(a.get("key_quant_mode", 0)))
    return NpuCall("torch_npu.npu_quant_lightning_indexer", args, kw, unpack=lambda r: (r,))


# ------------------------------------------------------------------------------------ dynamic_block_quant

_DBQ_PARAMS = ("x", "min_scale", "round_mode", "dst_type", "row_block_size", "col_block_size", "dst_type_max")


def map_dynamic_block_quant(a: Mapping, ctx: NpuContext) -> NpuCall:
    _check_params("dynamic_block_quant", a, _DBQ_PARAMS)
    kw = dict(
        min_scale=float(a.get("min_scale", 0.0)),
        round_mode=str(a.get("round_mode", "rint")),
        dst_type=_dtype_code(a.get("dst_type", "int8")),
        row_block_size=int(a.get("row_block_size", 1)),
        col_block_size=int(a.get("col_block_size", 128)),
        dst_type_max=float(a.get("dst_type_max", 0.0)),
    )
    return NpuCall("torch_npu.npu_dynamic_block_quant", (a["x"],), kw, unpack=lambda r: tuple(r))


# ------------------------------------------------------------------------------- kv_rmsnorm_rope_cache

_KRRC_PARAMS = (
    "kv", "gamma", "cos", "sin", "index", "k_cache", "ckv_cache", "k_rope_scale", "c_kv_scale",
    "k_rope_offset", "c_kv_offset", "v", "epsilon", "cache_mode", "is_output_kv", "k_cache_dtype",
    "ckv_cache_dtype",
)


def map_kv_rmsnorm_rope_cache(a: Mapping, ctx: NpuContext) -> NpuCall:
    _check_params("kv_rmsnorm_rope_cache", a, _KRRC_PARAMS)
    k_cache, ckv_cache = a["k_cache"], a["ckv_cache"]
    k_fmt, ckv_fmt = a.get("k_cache_dtype"), a.get("ckv_cache_dtype")
    if k_fmt is not None and k_cache.element_size() == 1:
        k_cache = _as_format(k_cache, k_fmt)
    if ckv_fmt is not None and ckv_cache.element_size() == 1:
        ckv_cache = _as_format(ckv_cache, ckv_fmt)
    args = (a["kv"], a["gamma"], a["cos"], a["sin"], a["index"], k_cache, ckv_cache)
    kw = dict(
        k_rope_scale=a.get("k_rope_scale"),
        c_kv_scale=a.get("c_kv_scale"),
        k_rope_offset=a.get("k_rope_offset"),
        c_kv_offset=a.get("c_kv_offset"),
        v=a.get("v"),
        epsilon=float(a.get("epsilon", 1e-5)),
        cache_mode=str(a.get("cache_mode", "Norm")),
        is_output_kv=bool(a.get("is_output_kv", False)),
    )
    # k_rope / c_kv are outputs only where is_output_kv takes effect (the reference's rule: PA* modes, or
    # Norm with v and a quantised cache); elsewhere the kernel's tensors are not results.
    quant = ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8")
    quantised = (k_fmt or _fmt_of(a["k_cache"])) in quant or (ckv_fmt or _fmt_of(a["ckv_cache"])) in quant
    effective = kw["is_output_kv"] and (kw["cache_mode"] != "Norm" or (kw["v"] is not None and quantised))

    def outputs(k_rope, c_kv):
        return (a["k_cache"], a["ckv_cache"], k_rope if effective else None, c_kv if effective else None)

    if ctx.chip == "950":
        kw["k_cache_dtype"] = HIFLOAT8_CODE if k_fmt == "hifloat8" else None
        kw["ckv_cache_dtype"] = HIFLOAT8_CODE if ckv_fmt == "hifloat8" else None
        return NpuCall("torch_npu.npu_kv_rmsnorm_rope_cache_v2", args, kw, unpack=lambda r: outputs(r[0], r[1]))
    if "hifloat8" in (k_fmt, ckv_fmt):
        raise ValueError("HiFloat8 caches need torch_npu.npu_kv_rmsnorm_rope_cache_v2 (Ascend 950)")
    return NpuCall("torch_npu.npu_kv_rmsnorm_rope_cache", args, kw, unpack=lambda r: outputs(r[2], r[3]),
                   writeback=((0, k_cache), (1, ckv_cache)))


# ------------------------------------------------------------------------------------ scatter_by_slot


_SCATTER_NATIVE = ("float32", "float16", "bfloat16", "bool", "int64", "int8")


def map_scatter_by_slot(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch_npu.npu_scatter_nd_update_`` with ``[block, row]`` indices; -1 slots are dropped first.

    npu_scatter_nd_update_ does not accept out-of-range indices (its doc), so the -1 ("skip") slots are
    removed from the index and update tensors here. It takes float32/float16/bfloat16/bool/int64/int8
    tensors (its doc); other 1-byte caches (uint8, float8) are scattered through an int8 view of the same
    memory, other dtypes through a trailing byte dimension (``unsqueeze(-1).view(int8)``) - bit for bit.
    """
    _check_params("scatter_by_slot", a, ("cache", "rows", "slot_mapping"))
    torch = _torch()
    cache, rows, slots = a["cache"], a["rows"], a["slot_mapping"]
    dt = _fmt_of(cache)
    if dt not in _SCATTER_NATIVE:
        if cache.element_size() == 1:
            cache, rows = cache.view(torch.int8), rows.view(torch.int8)
        else:
            cache, rows = cache.unsqueeze(-1).view(torch.int8), rows.unsqueeze(-1).view(torch.int8)
    block_size = cache.shape[1]
    flat = slots.reshape(-1).to(torch.int64)
    keep = flat >= 0
    kept = flat[keep]
    indices = torch.stack((kept // block_size, kept % block_size), dim=-1)
    updates = rows.reshape((flat.shape[0],) + tuple(cache.shape[2:]))[keep]
    return NpuCall("torch_npu.npu_scatter_nd_update_", (cache, indices, updates), {},
                   unpack=lambda r: (a["cache"],))


# ---------------------------------------------------------------------------------- kv_compress_epilog_vllm


def map_kv_compress_epilog_vllm(a: Mapping, ctx: NpuContext) -> NpuCall:
    """vLLM-Ascend's ``torch.ops._C_ascend.kv_compress_epilog`` (positional, as its schema), cache in place."""
    params = ("kv_compress_cache", "x", "slot_mapping", "quant_group_size", "quant_mode", "round_scale_flag",
              "layout")
    _check_params("kv_compress_epilog_vllm", a, params)
    if KCE_VLLM_CUSTOM_NAME not in ctx.custom_ops:
        raise ValueError(f"kv_compress_epilog_vllm needs {KCE_VLLM_CUSTOM_OP}, which is not loaded")
    args = (a["kv_compress_cache"], a["x"], a["slot_mapping"], int(a["quant_group_size"]), int(a["quant_mode"]),
            bool(a["round_scale_flag"]), int(a["layout"]))
    return NpuCall(KCE_VLLM_CUSTOM_OP, args, {}, unpack=lambda r: (a["kv_compress_cache"],))


# ------------------------------------------------------------------------------- indexer_compress_epilog_v2


def map_indexer_compress_epilog_v2(a: Mapping, ctx: NpuContext) -> NpuCall:
    """vLLM-Ascend's ``torch.ops._C_ascend.indexer_compress_epilog_v2`` (positional, as its schema), cache in place."""
    _check_params("indexer_compress_epilog_v2", a, ("indexer_compress_cache", "x", "slot_mapping", "layout"))
    if ICE2_CUSTOM_NAME not in ctx.custom_ops:
        raise ValueError(f"indexer_compress_epilog_v2 needs {ICE2_CUSTOM_OP}, which is not loaded")
    args = (a["indexer_compress_cache"], a["x"], a["slot_mapping"], int(a["layout"]))
    return NpuCall(ICE2_CUSTOM_OP, args, {}, unpack=lambda r: (a["indexer_compress_cache"],))


# --------------------------------------------------------------------------- vllm_quant_lightning_indexer

_VQLI_PARAMS = (
    "query", "key", "weights", "query_dequant_scale", "key_dequant_scale", "query_quant_mode", "key_quant_mode",
    "actual_seq_lengths_query", "actual_seq_lengths_key", "block_table", "metadata", "layout_query", "layout_key",
    "sparse_count", "sparse_mode", "pre_tokens", "next_tokens", "cmp_ratio", "return_value",
)


def _max_len(lengths, cumulative: bool = False) -> int:
    """The largest per-batch length of a length vector (``cumulative``: prefix sums, whose first entry counts too:
    vLLM-Ascend's indexer takes ``query_start_loc[1:]``, cu_seqlens start at 0)."""
    if lengths is None or lengths.numel() == 0:
        return 0
    flat = lengths.reshape(-1)
    most = int(flat[0].item())
    if cumulative and flat.numel() > 1:
        most = max(most, int((flat[1:] - flat[:-1]).max().item()))
    elif not cumulative:
        most = int(flat.max().item())
    return most


def _device_name(t) -> str:
    return str(t.device).split(":")[0]


def _metadata(a: Mapping, build: Callable[[Mapping], NpuCall]):
    """The caller's ``metadata`` tensor, or - when it is None - the metadata operator's call ``build(a)`` (an
    NpuCall as a keyword value: the backend runs it first and passes its output). The kernels refuse a missing
    metadata; vLLM-Ascend computes it per step the same way (dsa_v1.py)."""
    meta = a.get("metadata")
    return build(a) if meta is None else meta


def vqli_metadata_call(a: Mapping) -> NpuCall:
    """``torch.ops._C_ascend.npu_vllm_quant_lightning_indexer_metadata`` for the indexer arguments ``a``."""
    q, lq, lk = a["query"], a.get("actual_seq_lengths_query"), a["actual_seq_lengths_key"]
    tnd = str(a.get("layout_query", "BSND")) == "TND"
    max_q = _max_len(lq, cumulative=tnd) if lq is not None else int(q.shape[1])
    kw = dict(actual_seq_lengths_query=lq, actual_seq_lengths_key=lk, batch_size=int(lk.numel()),
              max_seqlen_q=max_q, max_seqlen_k=_max_len(lk), layout_query=str(a.get("layout_query", "BSND")),
              layout_key=str(a.get("layout_key", "PA_BSND")), sparse_count=int(a.get("sparse_count", 2048)),
              sparse_mode=int(a.get("sparse_mode", 3)), pre_tokens=int(a.get("pre_tokens", 2**63 - 1)),
              next_tokens=int(a.get("next_tokens", 2**63 - 1)), cmp_ratio=int(a.get("cmp_ratio", 1)),
              device=_device_name(q))
    args = (int(q.shape[-2]), int(a["key"].shape[-2]), int(q.shape[-1]), int(a.get("query_quant_mode", 0)),
            int(a.get("key_quant_mode", 0)))
    return NpuCall(VQLI_META_CUSTOM_OP, args, kw, unpack=lambda r: (r,))


def map_vllm_quant_lightning_indexer(a: Mapping, ctx: NpuContext) -> NpuCall:
    """vLLM-Ascend's ``torch.ops._C_ascend.npu_vllm_quant_lightning_indexer``. A ``metadata`` of None becomes
    the :func:`vqli_metadata_call` (:func:`_metadata`)."""
    _check_params("vllm_quant_lightning_indexer", a, _VQLI_PARAMS)
    if VQLI_CUSTOM_NAME not in ctx.custom_ops:
        raise ValueError(f"vllm_quant_lightning_indexer needs {VQLI_CUSTOM_OP}, which is not loaded")
    kw = dict(actual_seq_lengths_query=a.get("actual_seq_lengths_query"),
              actual_seq_lengths_key=a.get("actual_seq_lengths_key"), block_table=a.get("block_table"),
              metadata=_metadata(a, vqli_metadata_call),
              layout_query=str(a.get("layout_query", "BSND")), layout_key=str(a.get("layout_key", "PA_BSND")),
              sparse_count=int(a.get("sparse_count", 2048)), sparse_mode=int(a.get("sparse_mode", 3)),
              pre_tokens=int(a.get("pre_tokens", 2**63 - 1)), next_tokens=int(a.get("next_tokens", 2**63 - 1)),
              cmp_ratio=int(a.get("cmp_ratio", 1)), return_value=bool(a.get("return_value", False)))
    args = (a["query"], a["key"], a["weights"], a["query_dequant_scale"], a["key_dequant_scale"],
            int(a.get("query_quant_mode", 0)), int(a.get("key_quant_mode", 0)))
    return NpuCall(VQLI_CUSTOM_OP, args, kw, unpack=lambda r: tuple(r))


# ------------------------------------------------------------------------ DeepSeek-V4 shared-KV attention
#
# Four front doors, two conventions (qsfa/ops/sharedkv.py):
# * sparse_attn_sharedkv / kv_quant_sparse_attn_sharedkv -> vLLM-Ascend torch.ops._C_ascend.npu_[kv_quant_]
#   sparse_attn_sharedkv (csrc/torch_binding.cpp at 182b75e; device_op.py routes A2/A3 to the first, the 950 to the
#   second with kv_quant_mode=1, tile_size=64, rope_head_dim=64), seqused_kv conventions;
# * sparse_flash_mla / mixed_quant_sparse_flash_mla -> torch.ops.cann_ops_transformer.[mixed_quant_]sparse_flash_mla
#   (ops-transformer torch_extension/cann_ops_transformer/ops/*.py), seqused_ori_kv / seqused_cmp_kv /
#   cmp_residual_kv conventions.
# Every schema default is overridden by qsfa's value, passed explicitly: the registered defaults disagree with the
# public docs (vLLM-Ascend npu_sparse_attn_sharedkv: softmax_scale=0, cmp_ratio=0, ori_win_left=128 where the
# ops-transformer README says None / None / 127; mixed_quant_sparse_flash_mla declares ``int quant_mode=None``).
# The metadata operator (a per-core task list the kernels require) runs first when metadata is None (_metadata).

#: parameters of all five attention front doors (qsfa/ops/sharedkv.py _COMMON_PARAMS)
_V4_COMMON = (
    "q", "ori_kv", "cmp_kv", "ori_sparse_indices", "cmp_sparse_indices", "ori_block_table", "cmp_block_table",
    "cu_seqlens_q", "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q", "sinks", "metadata", "softmax_scale",
    "cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right", "layout_q", "layout_kv",
    "return_softmax_lse", "attention_out",
)
_SAS_PARAMS = _V4_COMMON + ("seqused_kv",)
_KQS_PARAMS = _SAS_PARAMS + ("kv_quant_mode", "tile_size", "rope_head_dim")
_SFM_PARAMS = _V4_COMMON + ("seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv", "ori_topk_length",
                            "cmp_topk_length", "topk_value_mode")
_MQ_PARAMS = _SFM_PARAMS + ("quant_mode", "rope_head_dim")
_QS_DESCALES = ("q_descale", "ori_kv_descale", "cmp_kv_descale")
_QS_PARAMS = _SFM_PARAMS + ("quant_mode",) + _QS_DESCALES
_V4_LENGTHS = ("cu_seqlens_q", "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q", "seqused_kv", "seqused_ori_kv",
               "seqused_cmp_kv", "cmp_residual_kv", "ori_topk_length", "cmp_topk_length")


def _v4_batch(a) -> int:
    return int(a["q"].shape[0]) if a.get("layout_q", "BSND") == "BSND" else int(a["cu_seqlens_q"].numel()) - 1


def _v4_kv_len(a, kv: str, used: str | None, cu: str) -> int:
    """Longest per-batch token count of ``kv``: its seqused vector, else its cu_seqlens (TND), else S (BSND)."""
    if a.get(kv) is None:
        return 0
    if used is not None and a.get(used) is not None:
        return _max_len(a[used])
    if a.get("layout_kv") == "TND":
        return _max_len(a.get(cu), cumulative=True) if a.get(cu) is not None else 0
    return int(a[kv].shape[1]) if a.get("layout_kv") == "BSND" else 0


def _v4_shape_kwargs(a) -> dict:
    """The metadata operators' shared arguments (vLLM-Ascend dsa_v1.py passes the same set)."""
    q = a["q"]
    idx = a.get("cmp_sparse_indices")
    return dict(
        cu_seqlens_q=_int32(a.get("cu_seqlens_q")), cu_seqlens_ori_kv=_int32(a.get("cu_seqlens_ori_kv")),
        cu_seqlens_cmp_kv=_int32(a.get("cu_seqlens_cmp_kv")), seqused_q=_int32(a.get("seqused_q")),
        batch_size=_v4_batch(a),
        max_seqlen_q=int(q.shape[1]) if a.get("layout_q", "BSND") == "BSND" else _max_len(a["cu_seqlens_q"], True),
        ori_topk=0, cmp_topk=int(idx.shape[-1]) if idx is not None else 0,
        cmp_ratio=int(a["cmp_ratio"]), ori_mask_mode=int(a["ori_mask_mode"]), cmp_mask_mode=int(a["cmp_mask_mode"]),
        ori_win_left=int(a["ori_win_left"]), ori_win_right=int(a["ori_win_right"]), layout_q=str(a["layout_q"]),
        layout_kv=str(a["layout_kv"]), has_ori_kv=a.get("ori_kv") is not None, has_cmp_kv=a.get("cmp_kv") is not None,
    )


def _v4_heads(a) -> tuple:
    """(num_heads_q, num_heads_kv, head_dim) as vLLM-Ascend passes them: q's N1, the KV's N2 (1), q's D (512)."""
    return int(a["q"].shape[-2]), int(a["ori_kv"].shape[-2]), int(a["q"].shape[-1])


def _v4_kwargs(a, kv_fmt: str | None) -> dict:
    """The attention call's keyword arguments shared by the four operators, every one explicit."""
    kw = {p: _int32(a.get(p)) for p in ("ori_sparse_indices", "cmp_sparse_indices", "ori_block_table",
                                         "cmp_block_table") + _V4_LENGTHS if p in a}
    kw.update(
        ori_kv=_as_format(a.get("ori_kv"), kv_fmt) if kv_fmt else a.get("ori_kv"),
        cmp_kv=_as_format(a.get("cmp_kv"), kv_fmt) if kv_fmt else a.get("cmp_kv"),
        sinks=a.get("sinks"), softmax_scale=float(a["softmax_scale"]), cmp_ratio=int(a["cmp_ratio"]),
        ori_mask_mode=int(a["ori_mask_mode"]), cmp_mask_mode=int(a["cmp_mask_mode"]),
        ori_win_left=int(a["ori_win_left"]), ori_win_right=int(a["ori_win_right"]), layout_q=str(a["layout_q"]),
        layout_kv=str(a["layout_kv"]), return_softmax_lse=bool(a["return_softmax_lse"]),
    )
    return kw


def _v4_unpack(a):
    """(attention_out, softmax_lse); without return_softmax_lse the LSE is qsfa's empty float32 ``[0]``. With an
    ``attention_out=`` buffer the output is that buffer (:func:`_v4_call` copies the result into it)."""
    buf = a.get("attention_out")
    if a["return_softmax_lse"]:
        return lambda r: (r[0] if buf is None else buf, r[1])
    return lambda r: (r[0] if buf is None else buf, _empty_f32(r[0]))


def _v4_call(target: str, args: tuple, kw: dict, a) -> NpuCall:
    """The attention call. None of the five schemas has an ``out=`` tensor (signatures.json: each returns
    ``(Tensor, Tensor)``), so a caller's ``attention_out=`` buffer is filled after the call: the result's first item
    is copied into it (``writeback``; the dispatch layer copies a device tensor back into the caller's NumPy buffer)
    and it is returned as the output. The kernel still allocates its own output on the device."""
    buf = a.get("attention_out")
    return NpuCall(target, args, kw, unpack=_v4_unpack(a), writeback=() if buf is None else ((0, buf),))


def sas_metadata_call(a: Mapping) -> NpuCall:
    """``torch.ops._C_ascend.npu_sparse_attn_sharedkv_metadata`` for ``sparse_attn_sharedkv`` arguments."""
    kw = _v4_shape_kwargs(a)
    kw.update(seqused_kv=_int32(a.get("seqused_kv")), max_seqlen_kv=_v4_kv_len(a, "ori_kv", "seqused_kv",
                                                                               "cu_seqlens_ori_kv"),
              device=_device_name(a["q"]))
    return NpuCall(SAS_META_CUSTOM_OP, _v4_heads(a), kw, unpack=lambda r: (r,))


def kqs_metadata_call(a: Mapping) -> NpuCall:
    """``torch.ops._C_ascend.npu_kv_quant_sparse_attn_sharedkv_metadata``. vLLM-Ascend's device_op.py passes only
    kv_quant_mode=1, leaving tile_size / rope_head_dim at the schema's 0; qsfa passes the attention call's values
    (64 / 64), the only ones csrc/attention/kv_quant_sparse_attn_sharedkv_metadata/README.md supports."""
    kw = _v4_shape_kwargs(a)
    kw.update(seqused_kv=_int32(a.get("seqused_kv")), max_seqlen_kv=_v4_kv_len(a, "ori_kv", "seqused_kv",
                                                                               "cu_seqlens_ori_kv"),
              tile_size=int(a["tile_size"]), rope_head_dim=int(a["rope_head_dim"]), device=_device_name(a["q"]))
    return NpuCall(KQS_META_CUSTOM_OP, _v4_heads(a) + (int(a["kv_quant_mode"]),), kw, unpack=lambda r: (r,))


def _sfm_meta_kwargs(a) -> dict:
    kw = _v4_shape_kwargs(a)
    ori_len = _v4_kv_len(a, "ori_kv", "seqused_ori_kv", "cu_seqlens_ori_kv")
    cmp_len = _v4_kv_len(a, "cmp_kv", "seqused_cmp_kv", "cu_seqlens_cmp_kv")
    if a.get("cmp_kv") is not None and a.get("seqused_cmp_kv") is None and a.get("seqused_ori_kv") is not None:
        cmp_len = ori_len // int(a["cmp_ratio"])  # the README's default for a missing seqused_cmp_kv
    kw.update({p: _int32(a.get(p)) for p in ("seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv",
                                              "ori_topk_length", "cmp_topk_length")})
    kw.update(max_seqlen_ori_kv=ori_len, max_seqlen_cmp_kv=cmp_len)
    return kw


def sfm_metadata_call(a: Mapping) -> NpuCall:
    """``torch.ops.cann_ops_transformer.sparse_flash_mla_metadata`` for ``sparse_flash_mla`` arguments."""
    return NpuCall(SFM_META_OP, _v4_heads(a), _sfm_meta_kwargs(a), unpack=lambda r: (r,))


def mq_metadata_call(a: Mapping) -> NpuCall:
    """``torch.ops.cann_ops_transformer.mixed_quant_sparse_flash_mla_metadata``."""
    kw = _sfm_meta_kwargs(a)
    kw["rope_head_dim"] = int(a["rope_head_dim"])
    return NpuCall(MQ_META_OP, _v4_heads(a) + (int(a["quant_mode"]),), kw, unpack=lambda r: (r,))


def qs_metadata_call(a: Mapping) -> NpuCall:
    """``torch.ops.cann_ops_transformer.quant_sparse_flash_mla_metadata`` (sparse_flash_mla's arguments plus the
    positional quant_mode)."""
    return NpuCall(QS_META_OP, _v4_heads(a) + (int(a["quant_mode"]),), _sfm_meta_kwargs(a), unpack=lambda r: (r,))


def map_sparse_attn_sharedkv(a: Mapping, ctx: NpuContext) -> NpuCall:
    """vLLM-Ascend's ``torch.ops._C_ascend.npu_sparse_attn_sharedkv`` (q positional, the rest keyword-only)."""
    _check_params("sparse_attn_sharedkv", a, _SAS_PARAMS)
    if SAS_CUSTOM_NAME not in ctx.custom_ops:
        raise ValueError(f"sparse_attn_sharedkv needs {SAS_CUSTOM_OP}, which is not loaded")
    kw = _v4_kwargs(a, None)
    kw["metadata"] = _metadata(a, sas_metadata_call)
    return _v4_call(SAS_CUSTOM_OP, (a["q"],), kw, a)


def map_kv_quant_sparse_attn_sharedkv(a: Mapping, ctx: NpuContext) -> NpuCall:
    """vLLM-Ascend's ``torch.ops._C_ascend.npu_kv_quant_sparse_attn_sharedkv`` (q and kv_quant_mode positional);
    the 640-byte rows are passed as float8_e4m3fn views of the caller's memory (the README's KV dtype)."""
    _check_params("kv_quant_sparse_attn_sharedkv", a, _KQS_PARAMS)
    if KQS_CUSTOM_NAME not in ctx.custom_ops:
        raise ValueError(f"kv_quant_sparse_attn_sharedkv needs {KQS_CUSTOM_OP}, which is not loaded")
    kw = _v4_kwargs(a, "float8_e4m3fn")
    kw.update(metadata=_metadata(a, kqs_metadata_call), tile_size=int(a["tile_size"]),
              rope_head_dim=int(a["rope_head_dim"]))
    return _v4_call(KQS_CUSTOM_OP, (a["q"], int(a["kv_quant_mode"])), kw, a)


def map_sparse_flash_mla(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.sparse_flash_mla`` (ops-transformer's torch extension package)."""
    _check_params("sparse_flash_mla", a, _SFM_PARAMS)
    kw = _v4_kwargs(a, None)
    kw.update(metadata=_metadata(a, sfm_metadata_call), topk_value_mode=int(a["topk_value_mode"]))
    return _v4_call(SFM_OP, (a["q"],), kw, a)


def map_mixed_quant_sparse_flash_mla(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.mixed_quant_sparse_flash_mla``: rows as float8_e4m3fn views (the doc's
    FLOAT8_E4M3FN storage, so ``key_dtype`` / ``value_dtype`` stay None: torch_npu's rule, the dtype is native)."""
    _check_params("mixed_quant_sparse_flash_mla", a, _MQ_PARAMS)
    kw = _v4_kwargs(a, "float8_e4m3fn")
    kw.update(metadata=_metadata(a, mq_metadata_call), topk_value_mode=int(a["topk_value_mode"]),
              quant_mode=int(a["quant_mode"]), rope_head_dim=int(a["rope_head_dim"]), key_dtype=None,
              value_dtype=None)
    return _v4_call(MQ_OP, (a["q"],), kw, a)


def map_quant_sparse_flash_mla(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.quant_sparse_flash_mla``: q / ori_kv / cmp_kv as uint8 views of the HiFloat8
    codes (the package wraps them as ACL_HIFLOAT8; the schema has no dtype argument), the per-tensor descales as
    given, every value explicit (the schema's quant_mode / softmax_scale / cmp_ratio default to None)."""
    _check_params("quant_sparse_flash_mla", a, _QS_PARAMS)
    kw = _v4_kwargs(a, "hifloat8")
    kw.update({p: a[p] for p in _QS_DESCALES})
    kw.update(metadata=_metadata(a, qs_metadata_call), topk_value_mode=int(a["topk_value_mode"]),
              quant_mode=int(a["quant_mode"]))
    return _v4_call(QS_OP, (_as_format(a["q"], "hifloat8"),), kw, a)


# --------------------------------------------------------------------- cann_ops_transformer cache writers


def map_indexer_quant_cache(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.indexer_quant_cache``, both caches in place (returns nothing). The MX
    modes' E8M0 scale bytes go as a float8_e8m0fnu view (the doc's FLOAT8_E8M0 cache_scale)."""
    _check_params("indexer_quant_cache", a, ("cache", "cache_scale", "x", "slot_mapping", "quant_mode", "round_scale",
                                             "x_scale"))
    mode = str(a.get("quant_mode", "fp8")).strip().lower()
    scale = a["cache_scale"]
    if mode in ("mxfp8", "mxfp4") and scale.element_size() == 1:
        scale = scale.view(_torch().float8_e8m0fnu)
    args = (a["cache"], scale, a["x"], _int32(a["slot_mapping"]))
    kw = dict(quant_mode=mode, round_scale=bool(a.get("round_scale", True)), x_scale=float(a.get("x_scale", 1.0)))
    return NpuCall(IQC_OP, args, kw, unpack=lambda r: (a["cache"], a["cache_scale"]))


def map_scatter_pa_kv_cache_with_k_scale(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.scatter_pa_kv_cache_with_k_scale`` (positional as its schema, the three
    caches in place; the returned aliases are the caller's tensors)."""
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping", "key_scale", "key_scale_cache")
    _check_params("scatter_pa_kv_cache_with_k_scale", a, names + ("cache_layout",))
    return NpuCall(SPKS_OP, tuple(a[n] for n in names), dict(cache_layout=str(a.get("cache_layout", "BNBD"))),
                   unpack=lambda r: (a["key_cache"], a["value_cache"], a["key_scale_cache"]))



# ------------------------------------------------------------------ cann_ops_transformer QLI v2 and QKV writer

_QLI2_PARAMS = (
    "query", "key", "weights", "query_dequant_scale", "key_dequant_scale", "topk", "quant_mode", "cu_seqlens_q",
    "cu_seqlens_k", "seqused_q", "seqused_k", "cmp_residual_k", "block_table", "output_idx_offset", "metadata",
    "max_seqlen_q", "layout_q", "layout_k", "mask_mode", "cmp_ratio", "return_value",
)
_QLI2_LENGTHS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "cmp_residual_k")
#: quant_mode -> the format query / key carry (qsfa.ops.quant_lightning_indexer_v2.QLI2_QUANT_MODES)
_QLI2_FORMATS = {2: "int8", 1: "float8_e4m3fn", 4: "hifloat8"}


def qli2_metadata_call(a: Mapping) -> NpuCall:
    """``torch.ops.cann_ops_transformer.quant_lightning_indexer_metadata`` for ``quant_lightning_indexer_v2``
    arguments. Every schema default (None) is replaced by a value: the batch size, and the largest query / compressed
    key length per batch (ops-transformer's QLI v2 pytest passes the largest per-batch lengths; the key's counts
    compressed tokens)."""
    q, k = a["query"], a["key"]
    tnd_q, layout_k = str(a["layout_q"]) == "TND", str(a["layout_k"])
    batch = int(a["cu_seqlens_q"].numel()) - 1 if tnd_q else int(q.shape[0])
    if a.get("seqused_q") is not None:
        max_q = _max_len(a["seqused_q"])
    else:
        max_q = _max_len(a["cu_seqlens_q"], cumulative=True) if tnd_q else int(q.shape[1])
    if layout_k == "TND":
        max_k = _max_len(a["cu_seqlens_k"], cumulative=True)
    elif a.get("seqused_k") is not None:
        max_k = _max_len(a["seqused_k"])
    else:
        max_k = int(k.shape[1]) if layout_k == "BSND" else -1  # the wrapper's own value for "not given"
    kw = {p: _int32(a.get(p)) for p in _QLI2_LENGTHS}
    kw.update(batch_size=batch, max_seqlen_q=max_q, max_seqlen_k=max_k, layout_q=str(a["layout_q"]),
              layout_k=layout_k, mask_mode=int(a["mask_mode"]), cmp_ratio=int(a["cmp_ratio"]))
    args = (int(q.shape[-2]), int(k.shape[-2]), int(q.shape[-1]), int(a["topk"]), int(a["quant_mode"]))
    return NpuCall(QLI2_META_OP, args, kw, unpack=lambda r: (r,))


def map_quant_lightning_indexer_v2(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.quant_lightning_indexer`` (seven positional, the rest keyword-only, every
    value explicit); a ``metadata`` of None becomes :func:`qli2_metadata_call` (:func:`_metadata`). Query / key go
    as views of the caller's bytes in the torch dtype their quant_mode names (2 int8, 1 float8_e4m3fn, 4 HiFloat8 as
    uint8: cannmirror/ops-transformer@25fb6b9 ``torch_extension/cann_ops_transformer/ops/csrc/
    quant_lightning_indexer.cpp`` refuses a quant_mode 4 query / key that is not uint8 and wraps it as ACL_HIFLOAT8;
    the schema has no dtype argument)."""
    _check_params("quant_lightning_indexer_v2", a, _QLI2_PARAMS)
    kw = {p: _int32(a.get(p)) for p in _QLI2_LENGTHS + ("block_table", "output_idx_offset")}
    kw.update(metadata=_metadata(a, qli2_metadata_call), max_seqlen_q=int(a["max_seqlen_q"]),
              layout_q=str(a["layout_q"]), layout_k=str(a["layout_k"]), mask_mode=int(a["mask_mode"]),
              cmp_ratio=int(a["cmp_ratio"]), return_value=int(a["return_value"]))
    fmt = _QLI2_FORMATS.get(int(a["quant_mode"]))
    q, k = (_as_format(a[n], fmt) if fmt else a[n] for n in ("query", "key"))
    args = (q, k, a["weights"], a["query_dequant_scale"], a["key_dequant_scale"], int(a["topk"]), int(a["quant_mode"]))
    return NpuCall(QLI2_OP, args, kw, unpack=lambda r: (r[0], r[1]))


_QKV_TENSORS = ("qkv", "q_gamma", "k_gamma", "cos_sin", "slot_mapping", "k_cache", "v_cache", "k_scale_cache",
                "query_start_loc", "seq_lens")


def map_qkv_rms_norm_rope_cache_with_k_scale(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.qkv_rms_norm_rope_cache_with_k_scale_``, the in-place variant: the K / V
    caches go as float8_e4m3fn views of the caller's bytes (the schema's ``Tensor(a!)`` / ``Tensor(b!)``), the
    K-scale cache as it is; the op returns ``(q_out, q_scale)`` and the caches come back as the caller's tensors."""
    _check_params("qkv_rms_norm_rope_cache_with_k_scale", a, _QKV_TENSORS + (
        "head_nums", "rotation", "v_scale", "layout_qkv", "layout_q_out", "epsilon", "mrope_position", "mrope_section",
        "q_quant_mode", "q_out_dtype"))
    if a.get("k_quant_mode", "PerTokenPerHead") == "Mx" or a.get("q_quant_mode") == "Mx":
        raise ValueError(f"the M-RoPE MX scenario (k_quant_mode 'Mx') needs {QKV_OP}'s k_quant_mode argument, which "
                         "the recorded schema (hicann/ops-transformer@c0dda0b) lacks; recursion-ascend/ops-transformer@"
                         "a093e95 torch_extension adds it between q_quant_mode and q_out_dtype")
    mrope = a.get("mrope_position") is not None
    args = [a[n] for n in _QKV_TENSORS]
    args[5] = _as_format(a["k_cache"], "int8" if mrope else "float8_e4m3fn")
    args[6] = _as_format(a["v_cache"], "float8_e4m3fn")
    args[4], args[8], args[9] = (_int32(a[n]) for n in ("slot_mapping", "query_start_loc", "seq_lens"))
    section = a.get("mrope_section")
    kw = dict(rotation=a["rotation"], v_scale=a["v_scale"], layout_qkv=str(a["layout_qkv"]),
              layout_q_out=str(a["layout_q_out"]), epsilon=float(a["epsilon"]),
              mrope_position=_int32(a.get("mrope_position")),
              mrope_section=None if section is None else [int(v) for v in section],
              q_quant_mode=str(a.get("q_quant_mode", "PerTokenPerHead")),
              q_out_dtype=getattr(_torch(), str(a.get("q_out_dtype", "float8_e4m3fn"))))
    return NpuCall(QKV_OP, tuple(args) + ([int(n) for n in a["head_nums"]],), kw,
                   unpack=lambda r: (r[0], r[1], a["k_cache"], a["v_cache"], a["k_scale_cache"]))


_CMP_TABLES = ("state_block_table", "cu_seqlens", "seqused", "start_pos")


_CMP_COMMON = ("x", "wkv", "wgate", "state_cache", "ape", "cmp_ratio", "coff", "cache_mode") + _CMP_TABLES
_QCMP_DESCALES = ("x_descale", "wkv_descale", "wgate_descale")


def _compressor_call(op: str, a: Mapping, quant: bool) -> NpuCall:
    tensors = [a[n] for n in ("x", "wkv", "wgate", "state_cache", "ape")]
    if quant:  # HiFloat8 codes: uint8 views of the caller's bytes
        tensors[:3] = (_as_format(t, "hifloat8") for t in tensors[:3])
    args = tuple(tensors) + ((int(a["quant_mode"]),) if quant else ()) + (int(a["cmp_ratio"]),)
    kw = {p: a[p] for p in _QCMP_DESCALES} if quant else {}
    kw.update({p: _int32(a.get(p)) for p in _CMP_TABLES})
    kw.update(coff=int(a["coff"]), cache_mode=int(a["cache_mode"]))
    return NpuCall(op, args, kw, unpack=lambda r: (r, a["state_cache"]))


def map_compressor(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.compressor``: x, wkv, wgate, state_cache, ape and cmp_ratio positional, the
    rest keyword-only, every value explicit (the schema's defaults cmp_ratio=4, coff=1, cache_mode=1 are never
    relied on); index tensors as int32. ``state_cache`` (``Tensor(a!)``) is the caller's float32 tensor, updated in
    place; the op returns ``cmp_kv`` alone."""
    _check_params("compressor", a, _CMP_COMMON)
    return _compressor_call(CMP_OP, a, quant=False)


def map_quant_compressor(a: Mapping, ctx: NpuContext) -> NpuCall:
    """``torch.ops.cann_ops_transformer.quant_compressor``: as :func:`map_compressor` with ``quant_mode`` between
    ape and cmp_ratio (both positional, no default), the three descales keyword-only, and x / wkv / wgate as uint8
    views of the HiFloat8 codes (hicann/ops-transformer@3d7eca4 ``torch_extension/cann_ops_transformer/docs/zh/
    quant_compressor.md``: uint8 carries HIFLOAT8)."""
    _check_params("quant_compressor", a, _CMP_COMMON + _QCMP_DESCALES + ("quant_mode",))
    return _compressor_call(QCMP_OP, a, quant=True)


# --------------------------------------------------------------------------------------- vllm_compressor

_VCMP_PARAMS = ("x", "wkv", "wgate", "state_cache", "ape", "norm_weight", "rope_sin", "rope_cos") + _CMP_TABLES + (
    "rope_head_dim", "cmp_ratio", "coff", "norm_eps", "rotary_mode", "cache_mode")


def _zero_padding(cmp_kv, a: Mapping):
    """``cmp_kv`` with the rows no completed group fills set to zero, qsfa's documented padding (the kernel does not
    write them and the binding allocates with ``at::empty``; docs/numerics/compressor.md#vllm_compressor)."""
    from ..reference.vllm_compressor import real_rows

    def host(t):
        return None if t is None else t.detach().cpu().numpy()

    mask = real_rows(tuple(a["x"].shape), host(a.get("cu_seqlens")), host(a.get("seqused")), host(a.get("start_pos")),
                     int(a["cmp_ratio"]))
    if not mask.all():
        torch = _torch()
        cmp_kv[torch.from_numpy(~mask).to(cmp_kv.device)] = 0
    return cmp_kv


def map_vllm_compressor(a: Mapping, ctx: NpuContext) -> NpuCall:
    """vLLM-Ascend's ``torch.ops._C_ascend.compressor`` (vllm-project/vllm-ascend@182b75e csrc/torch_binding.cpp
    l.2226): every parameter positional, in the schema's order (none has a default); index tensors as int32.
    ``state_cache`` (``Tensor(a!)``) is the caller's float32 tensor, written in place; the op returns ``cmp_kv``,
    whose padding rows are zeroed here (:func:`_zero_padding`)."""
    _check_params("vllm_compressor", a, _VCMP_PARAMS)
    if VCMP_CUSTOM_NAME not in ctx.custom_ops:
        raise ValueError(f"vllm_compressor needs {VCMP_CUSTOM_OP}, which is not loaded")
    tensors = tuple(a[n] for n in ("x", "wkv", "wgate", "state_cache", "ape", "norm_weight", "rope_sin", "rope_cos"))
    tables = tuple(_int32(a.get(p)) for p in _CMP_TABLES)
    attrs = (int(a["rope_head_dim"]), int(a["cmp_ratio"]), int(a["coff"]), float(a["norm_eps"]),
             int(a["rotary_mode"]), int(a["cache_mode"]))
    return NpuCall(VCMP_CUSTOM_OP, tensors + tables + attrs, {},
                   unpack=lambda r: (_zero_padding(r, a), a["state_cache"]))


#: operator name -> mapping function
MAPPINGS: dict[str, Callable[[Mapping, NpuContext], NpuCall]] = {
    "kv_quant_sparse_flash_attention": map_kv_quant_sparse_flash_attention,
    "sparse_flash_attention": map_sparse_flash_attention,
    "lightning_indexer": map_lightning_indexer,
    "quant_lightning_indexer": map_quant_lightning_indexer,
    "dynamic_block_quant": map_dynamic_block_quant,
    "kv_rmsnorm_rope_cache": map_kv_rmsnorm_rope_cache,
    "scatter_by_slot": map_scatter_by_slot,
    "kv_compress_epilog_vllm": map_kv_compress_epilog_vllm,
    "indexer_compress_epilog_v2": map_indexer_compress_epilog_v2,
    "vllm_quant_lightning_indexer": map_vllm_quant_lightning_indexer,
    "sparse_attn_sharedkv": map_sparse_attn_sharedkv,
    "kv_quant_sparse_attn_sharedkv": map_kv_quant_sparse_attn_sharedkv,
    "sparse_flash_mla": map_sparse_flash_mla,
    "mixed_quant_sparse_flash_mla": map_mixed_quant_sparse_flash_mla,
    "indexer_quant_cache": map_indexer_quant_cache,
    "scatter_pa_kv_cache_with_k_scale": map_scatter_pa_kv_cache_with_k_scale,
    "quant_lightning_indexer_v2": map_quant_lightning_indexer_v2,
    "qkv_rms_norm_rope_cache_with_k_scale": map_qkv_rms_norm_rope_cache_with_k_scale,
    "compressor": map_compressor,
    "quant_compressor": map_quant_compressor,
    "quant_sparse_flash_mla": map_quant_sparse_flash_mla,
    "vllm_compressor": map_vllm_compressor,
}


def map_call(op: str, args: Mapping, ctx: NpuContext) -> NpuCall:
    """The call for ``op``; ``KeyError`` with the reason for operators in :data:`NOT_MAPPED`."""
    try:
        return MAPPINGS[op](args, ctx)
    except KeyError:
        if op in MAPPINGS:
            raise
        reason = NOT_MAPPED.get(op, "no mapping written")
        raise KeyError(f"no npu mapping for {op}: {reason}") from None
