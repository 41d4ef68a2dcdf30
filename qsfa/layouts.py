"""Public byte-layout helpers of the quantised KV caches.

* Packed QSFA rows (docs/numerics/layouts.md#packed-qsfa-row): :func:`packed_head_dim`, :func:`row_offsets`, :func:`pack_rows`,
  :func:`unpack_rows`, :func:`dequant_rows`.
* FlashMLA V32 interop (FP8 NoPE | 4 fp32 scales | 64 bf16 RoPE): :func:`qsfa_to_flashmla_v32`,
  :func:`flashmla_v32_to_qsfa` - lossless byte moves.
* NZ fractal storage of paged caches (docs/numerics/layouts.md#nz): :func:`nz_columns`, :func:`nz_view`,
  :func:`nz_to_nd`, :func:`nd_to_nz`.
* Slot addressing of paged caches (docs/numerics/layouts.md#paged-caches): :func:`slot_positions`.
* FlashMLA MODEL1 FP8 sparse cache (DeepSeek V4: 448 E4M3FN NoPE + 64 bf16 RoPE, E8M0 scales of 64-value
  tiles; ``docs/numerics/flashmla-model1.md``): :func:`flashmla_model1_quantize`,
  :func:`flashmla_model1_dequantize` (operators, ``backend=`` as everywhere), :func:`flashmla_model1_block_bytes`.
* Unspecified ("don't-care") bytes of an operator's outputs (docs/numerics/layouts.md#unspecified-bytes):
  :func:`unspecified_bytes` - the MODEL1 pad bytes and block padding, ``kv_compress_epilog_vllm`` layout 2's scale
  padding. Conformance (``vs_reference``, ``round_trip``, ``skip_slots_untouched``), ``qsfa golden compare`` and
  ``qsfa golden verify`` ignore exactly these; the reference writes 0 there.

All functions take and return NumPy arrays; see :mod:`qsfa.reference.packing` for the layouts in detail.
"""

from __future__ import annotations

import numpy as np

from .reference.packing import (
    SCALE_BYTES,
    dequant_rows,
    flashmla_v32_to_qsfa,
    nz_to_nd,
    nz_view,
    pack_rows,
    packed_head_dim,
    qsfa_to_flashmla_v32,
    row_offsets,
    unpack_rows,
)
from .ops.layouts import flashmla_model1_dequantize, flashmla_model1_quantize
from .reference.flashmla_model1 import block_bytes as _block_bytes
from .reference.packing import nd_to_nz as _nd_to_nz
from .reference.packing import nz_columns as _nz_columns
from .reference.scatter import slot_positions  # checks its own arguments
from ._public import checked, positive_int


def _nz_dtype_ok(v, a=None) -> bool:
    from ._arrays import is_torch

    if is_torch(v):
        return v.itemsize in (1, 2)
    try:
        return np.dtype(v).itemsize in (1, 2)
    except TypeError:
        return False


# the operators' argument rules (qsfa/_public.py; issue 27)
flashmla_model1_block_bytes = checked("block_size:int", block_size=(positive_int, "must be a positive integer"))(
    _block_bytes)
nz_columns = checked("dtype:any", dtype=(_nz_dtype_ok, "must be a NumPy dtype (or name) of one or two bytes: "
                                                        "NZ caches are one-byte (32 columns) or two-byte (16)"))(
    _nz_columns)
# c = 0 raised ZeroDivisionError, a negative c NumPy's reshape error, True was taken as 1
nd_to_nz = checked("c:int?", c=(positive_int, "must be a positive integer (the columns of an NZ fractal; default: "
                                              "nz_columns of the dtype)"))(_nd_to_nz)

__all__ = [
    "SCALE_BYTES",
    "packed_head_dim",
    "row_offsets",
    "pack_rows",
    "unpack_rows",
    "dequant_rows",
    "qsfa_to_flashmla_v32",
    "flashmla_v32_to_qsfa",
    "nz_columns",
    "nz_view",
    "nz_to_nd",
    "nd_to_nz",
    "slot_positions",
    "flashmla_model1_quantize",
    "flashmla_model1_dequantize",
    "flashmla_model1_block_bytes",
    "unspecified_bytes",
    "UNSPECIFIED",
]


def _m1_unspecified(args: dict) -> dict:
    from .reference.flashmla_model1 import pad_mask

    nb, bs = args["k"].shape[:2]
    return {"cache": pad_mask(nb, bs)}


def _kcev_unspecified(args: dict) -> dict:
    from .reference.kv_compress_epilog_vllm import scale_pad_mask

    cache = args["kv_compress_cache"]
    return {"kv_compress_cache": scale_pad_mask(cache.shape, args["x"].shape[-1], args["slot_mapping"],
                                                 quant_group_size=int(args.get("quant_group_size", 64)),
                                                 layout=int(args.get("layout", 1)))}


#: operator -> ``f(args) -> {output name: bool mask}``: the outputs with bytes their layout leaves unspecified
UNSPECIFIED = {
    "layouts.flashmla_model1_quantize": _m1_unspecified,
    "kv_compress_epilog_vllm": _kcev_unspecified,
}


def unspecified_bytes(op: str, args: dict) -> dict:
    """``{output name: bool array of the output's shape}``, True where the layout of ``op``'s output leaves the byte
    unspecified (a kernel may leave scratch there; the reference writes 0), for a call with ``args`` (valid
    arguments: NumPy arrays or torch tensors, as the operator takes them; one-byte outputs, so one element is one
    byte). Operators without such bytes: {}. An unknown operator name or ``args`` that is not a dict: InvalidArgument.
    """
    from collections.abc import Mapping

    from ._arrays import is_torch, to_numpy
    from ._contract import Args
    from ._dispatch import operator, operators
    from ._errors import InvalidArgument
    from .chips import _bind

    if not isinstance(op, str) or op not in operators():
        raise InvalidArgument("value", "op", op, "not an operator of this build of qsfa (qsfa.operators())")
    if not isinstance(args, Mapping):
        raise InvalidArgument("type", "args", type(args).__name__, f"must be a dict of {op}'s arguments")
    f = UNSPECIFIED.get(op)
    if f is None:
        return {}
    args = {k: to_numpy(v) if is_torch(v) else v for k, v in args.items()}  # host views, bits preserved
    try:  # the call's arguments with the front door's defaults
        full = _bind(op, (), {k: v for k, v in dict(args).items() if k not in ("chip", "backend")})
    except TypeError as e:
        raise InvalidArgument("value", "args", sorted(dict(args)), f"not the arguments of {op}: {e}") from None
    operator(op).contract.validate(Args(full))  # arguments the operator refuses: its own error, by name
    return {k: v for k, v in f(full).items() if v.any()}
