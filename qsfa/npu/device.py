"""Ascend device discovery and the limits of the torch_npu / vLLM-Ascend call path.

* :func:`availability` - can the npu backend run here, and if not, why (cheap: no device work).
* :func:`chip_family` - "A2", "A3" or "950" (or None when unknown): the chip whose operator limits apply.
  Decided like vLLM-Ascend (``vllm_ascend/device/hardware.py``): the numeric SoC version that
  ``torch_npu.npu.get_soc_version()`` reports - 220-225 = Atlas A2 (Ascend910B1..B4), 250-255 = Atlas A3
  (Ascend910_93xx), 260 = Ascend 950 (the torch_npu 2.14.0 meta registrations name 260
  ``SocVersion::Ascend950``) - and otherwise the SoC name from ``torch.npu.get_device_name()``:
  ``Ascend910B*`` = A2, ``Ascend910_93*`` = A3, ``Ascend950*`` (and the ``Ascend910_95*`` names a
  triton-ascend capacity table lists with the 950's 256 KiB unified buffer) = 950.
* :func:`backend_limits` - rules of the *call path* beyond the operator's own chip constraints: which
  argument combinations have no torch_npu / custom-op callable here (e.g. ``rope_head_dim=0`` or
  ``return_softmax_lse=True`` need vLLM-Ascend's ``torch.ops._C_ascend.npu_kv_quant_sparse_flash_attention``;
  when that library is not loaded the call is unsupported with a message saying so).

vLLM-Ascend's custom ops are never imported implicitly (``import vllm_ascend`` patches modules such as
triton's); load them yourself (:func:`load_custom_ops`, or vLLM-Ascend's ``enable_custom_op()``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

from .._contract import Constraint
from .._checks import set_param

__all__ = [
    "availability",
    "chip_family",
    "chip_from_soc_version",
    "chip_from_soc_name",
    "soc_name",
    "custom_op_loaded",
    "load_custom_ops",
    "backend_limits",
    "CUSTOM_OP_NAMESPACE",
]

CUSTOM_OP_NAMESPACE = "_C_ascend"


def _import_torch_npu():
    import torch  # noqa: F401
    import torch_npu  # noqa: F401

    return torch, torch_npu


def availability() -> tuple[bool, str]:
    """``(usable, reason)`` for the npu backend on this machine."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed"
    try:
        torch, _ = _import_torch_npu()
    except Exception as e:  # noqa: BLE001 - any import failure makes the backend unusable
        return False, f"torch_npu failed to import: {type(e).__name__}: {e}"
    try:
        visible = bool(torch.npu.is_available()) and torch.npu.device_count() > 0
    except Exception as e:  # noqa: BLE001
        return False, f"no Ascend device visible ({type(e).__name__}: {e})"
    if not visible:
        return False, "no Ascend device visible"
    return True, f"{soc_name() or 'Ascend NPU'} ({chip_family() or 'unknown chip family'})"


def chip_from_soc_version(version) -> str | None:
    """Chip family of torch_npu's numeric SoC version (vLLM-Ascend's ranges), or None."""
    if not isinstance(version, int) or isinstance(version, bool):
        return None
    if 220 <= version <= 225:
        return "A2"
    if 250 <= version <= 255:
        return "A3"
    if version == 260:
        return "950"
    return None


def chip_from_soc_name(name) -> str | None:
    """Chip family of a SoC name such as ``"Ascend910B3"``, ``"Ascend910_9392"``, ``"Ascend950PR_9599"``."""
    if not isinstance(name, str):
        return None
    n = name.strip().lower()
    if n.startswith("ascend910b"):
        return "A2"
    if n.startswith("ascend910_93"):
        return "A3"
    if n.startswith("ascend950") or n.startswith("ascend910_95"):
        return "950"
    return None


def soc_name() -> str | None:
    """The SoC name of NPU 0 (``torch.npu.get_device_name()``), or None without a device."""
    try:
        torch, _ = _import_torch_npu()
        return str(torch.npu.get_device_name(0))
    except Exception:  # noqa: BLE001
        return None


@functools.lru_cache(maxsize=1)
def chip_family() -> str | None:
    """"A2", "A3" or "950" for the NPU here; None when there is none or it is not one of these."""
    try:
        _, torch_npu = _import_torch_npu()
    except Exception:  # noqa: BLE001
        return None
    try:
        fam = chip_from_soc_version(int(torch_npu.npu.get_soc_version()))
    except Exception:  # noqa: BLE001
        fam = None
    return fam or chip_from_soc_name(soc_name())


def custom_op_loaded(name: str) -> bool:
    """Whether ``torch.ops._C_ascend.<name>`` is registered in this process (vLLM-Ascend loaded)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    try:
        return hasattr(getattr(torch.ops, CUSTOM_OP_NAMESPACE), name)
    except Exception:  # noqa: BLE001
        return False


def load_custom_ops() -> bool:
    """Try to register vLLM-Ascend's custom ops (``import vllm_ascend.vllm_ascend_C``); True on success."""
    try:
        importlib.import_module("vllm_ascend.vllm_ascend_C")
    except Exception:  # noqa: BLE001
        return False
    return True


def loaded_custom_ops(names) -> frozenset:
    return frozenset(n for n in names if custom_op_loaded(n))


# ------------------------------------------------------------------------------------ call-path limits

_QSFA_CUSTOM = f"torch.ops.{CUSTOM_OP_NAMESPACE}.npu_kv_quant_sparse_flash_attention"
_HOW_TO_LOAD = ("install vllm-ascend built for this chip and register its ops before the call "
                "(import vllm_ascend.vllm_ascend_C, or qsfa.npu.device.load_custom_ops())")


def _precision_faithful(op: str) -> Constraint:
    return Constraint(
        id=f"npu.{op}.precision", param="precision", kind="value",
        reason="the device computes with its own rounding; precision='exact' (float64, no intermediate "
               "rounding) exists only on the reference backend",
        check=lambda a: None if a.get("precision", "faithful") == "faithful" else a.get("precision"),
        violate=set_param("precision", "exact"), source="qsfa: reference-only mode",
    )


#: operators that run only through a vLLM-Ascend custom op: operator -> (the parameter the refusal names, the
#: custom op's name under torch.ops.<CUSTOM_OP_NAMESPACE>)
_NEEDS_CUSTOM_OP = {
    "kv_compress_epilog_vllm": ("kv_compress_cache", "kv_compress_epilog"),
    "indexer_compress_epilog_v2": ("indexer_compress_cache", "indexer_compress_epilog_v2"),
    "vllm_quant_lightning_indexer": ("query", "npu_vllm_quant_lightning_indexer"),
    "sparse_attn_sharedkv": ("q", "npu_sparse_attn_sharedkv"),
    "kv_quant_sparse_attn_sharedkv": ("q", "npu_kv_quant_sparse_attn_sharedkv"),
    "vllm_compressor": ("x", "compressor"),
}


def backend_limits(op: str, *, chip: str | None = ..., custom_ops=None) -> list[Constraint]:
    """Constraints of the npu call path for ``op`` (checked after the operator's contract).

    ``chip`` (default: :func:`chip_family`) and ``custom_ops`` (default: the vLLM-Ascend ops registered
    now) are parameters so the rules can be tested without a device.
    """
    if chip is ...:
        chip = chip_family()
    loaded = (lambda name: custom_op_loaded(name)) if custom_ops is None else (lambda name: name in custom_ops)
    out: list[Constraint] = []
    if op in ("kv_quant_sparse_flash_attention", "sparse_flash_attention", "sparse_attn_sharedkv",
              "kv_quant_sparse_attn_sharedkv", "sparse_flash_mla", "mixed_quant_sparse_flash_mla",
              "quant_lightning_indexer_v2", "compressor", "quant_compressor",
              "quant_sparse_flash_mla", "vllm_compressor"):
        out.append(_precision_faithful(op))
    if op == "kv_quant_sparse_flash_attention":
        custom = "npu_kv_quant_sparse_flash_attention"
        src = ("torch_npu 2.14.0 npu_kv_quant_sparse_flash_attention (no return_softmax_lse; docs: rope_head_dim "
               "only 64); vLLM-Ascend vllm_ascend/device/device_op.py routes C8 attention to the custom op")
        out += [
            Constraint(
                id=f"npu.{op}.rope0_needs_custom_op", param="rope_head_dim", kind="value",
                reason=f"rope_head_dim 0 runs only through {_QSFA_CUSTOM} (torch_npu's "
                       f"npu_kv_quant_sparse_flash_attention supports rope_head_dim 64 only), which is not "
                       f"loaded: {_HOW_TO_LOAD}",
                check=lambda a: 0 if a.get("rope_head_dim", 64) == 0 and a.get("key_dtype") != "hifloat8"
                and not loaded(custom) else None,
                violate=set_param("rope_head_dim", 0), source=src,
            ),
            Constraint(
                id=f"npu.{op}.lse_needs_custom_op", param="return_softmax_lse", kind="value",
                reason=f"softmax_max/softmax_sum come only from {_QSFA_CUSTOM} (torch_npu's "
                       f"npu_kv_quant_sparse_flash_attention returns attention_out alone), which is not "
                       f"loaded: {_HOW_TO_LOAD}",
                check=lambda a: True if a.get("return_softmax_lse", False) and a.get("key_dtype") != "hifloat8"
                and not loaded(custom) else None,
                violate=set_param("return_softmax_lse", True), source=src,
            ),
            Constraint(
                id=f"npu.{op}.hifloat8_torch_npu_only", param="key_dtype", kind="value",
                reason="a HiFloat8 key is passed only through torch_npu's npu_kv_quant_sparse_flash_attention "
                       "(key_dtype=torch_npu.hifloat8), which has rope_head_dim 64 and no return_softmax_lse; "
                       f"{_QSFA_CUSTOM} takes no key dtype",
                check=lambda a: "hifloat8" if a.get("key_dtype") == "hifloat8"
                and (a.get("return_softmax_lse", False) or a.get("rope_head_dim", 64) == 0) else None,
                violate=lambda d: {**d, "key_dtype": "hifloat8", "return_softmax_lse": True}, source=src,
            ),
        ]
    if op in _NEEDS_CUSTOM_OP:
        param, custom = _NEEDS_CUSTOM_OP[op]
        out.append(Constraint(
            id=f"npu.{op}.needs_custom_op", param=param, kind="value",
            reason=f"runs only through torch.ops.{CUSTOM_OP_NAMESPACE}.{custom}, which is not loaded: {_HOW_TO_LOAD}",
            check=lambda a, custom=custom: "custom op absent" if not loaded(custom) else None,
            violate=lambda d: dict(d), source="vllm-project/vllm-ascend@182b75e csrc/torch_binding.cpp",
        ))
    if op == "kv_rmsnorm_rope_cache" and chip != "950":
        def needs_code(a):
            for p in ("k_cache_dtype", "ckv_cache_dtype"):
                if a.get(p) == "hifloat8":
                    return "hifloat8"
            return None

        out.append(Constraint(
            id="npu.kv_rmsnorm_rope_cache.hifloat8_needs_v2", param="k_cache_dtype", kind="value",
            reason=f"HiFloat8 caches need torch_npu.npu_kv_rmsnorm_rope_cache_v2 (k_cache_dtype/ckv_cache_dtype "
                   f"codes), an Ascend 950 API; this chip ({chip or 'unknown'}) uses npu_kv_rmsnorm_rope_cache, "
                   f"which takes no cache dtype",
            check=needs_code, violate=set_param("k_cache_dtype", "hifloat8"),
            source="op-plugin docs torch_npu-npu_kv_rmsnorm_rope_cache_v2.md (Ascend 950 only)",
        ))
    return out
