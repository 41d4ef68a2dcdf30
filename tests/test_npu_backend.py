"""The npu backend on a machine without an Ascend device.

1. Here it is unusable, says why, and every operator called with backend="npu" raises that reason.
2. device.availability / chip_family in simulated environments (import failure, no device, each chip).
3. The whole npu call path - dispatch, contract with the chip's rules, backend_limits, mapping, the call,
   the result mapping - runs against a *fake* torch_npu: the recorded schemas of signatures.json are
   registered with torch.library (so torch itself checks every call against the schema, types and
   keyword-only rules included) with CPU implementations that return tensors shaped by the meta
   registrations' rules written out here, or (npu_scatter_nd_update_) apply the documented semantics.
   Every real operator's contract example is run through it and must produce outputs of the reference's
   shapes and dtypes in the caller's array kind; scatter_by_slot must produce the reference's bytes.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import sys
import types

import numpy as np
import pytest

from qsfa import _dispatch
from qsfa._arrays import dtype_name, is_torch, to_numpy, to_torch
from qsfa._contract import copy_args
from qsfa._dispatch import operators, run
from qsfa._errors import BackendUnavailable, InvalidArgument, InvalidDtype, NotImplementedByBackend, \
    UnsupportedByBackend
from qsfa.npu import device, mapping, signatures

torch = pytest.importorskip("torch")

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


# ---------------------------------------------------------------------------------- 1. unusable here


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed on this machine")
def test_npu_backend_is_unusable_here_with_the_reason():
    assert device.availability() == (False, "torch_npu is not installed")
    assert device.chip_family() is None
    st = _dispatch.backends()["npu"]
    assert st.usable is False and "torch_npu is not installed" in st.reason and st.operators == ()


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed on this machine")
@pytest.mark.parametrize("op_name", sorted(operators()))
def test_calling_any_operator_on_npu_raises_the_reason(op_name):
    args = operators()[op_name].contract.example(np.random.default_rng(0))
    inplace = {n: np.asarray(args[n]).tobytes() for n in operators()[op_name].contract.inplace if args.get(n) is not None}
    with pytest.raises(BackendUnavailable) as ei:
        run(op_name, args, backend="npu")
    assert str(ei.value).startswith("backend 'npu' is not usable here: torch_npu is not installed")
    assert {n: np.asarray(args[n]).tobytes() for n in inplace} == inplace


# ------------------------------------------------------------------------- 2. simulated environments


def _fake_env(monkeypatch, *, importable=True, import_error=None, available=True, count=1, soc_version=None,
              name="Ascend910B3"):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(device.importlib.util, "find_spec",
                        lambda n, *a: (object() if importable else None) if n == "torch_npu" else real_find_spec(n, *a))

    def fake_import():
        if import_error is not None:
            raise import_error
        npu = types.SimpleNamespace(is_available=lambda: available, device_count=lambda: count,
                                    get_device_name=lambda i=0: name)
        fake_torch = types.SimpleNamespace(npu=npu)

        def soc():
            if soc_version is None:
                raise RuntimeError("no soc version API")
            return soc_version

        return fake_torch, types.SimpleNamespace(npu=types.SimpleNamespace(get_soc_version=soc))

    monkeypatch.setattr(device, "_import_torch_npu", fake_import)
    device.chip_family.cache_clear()


@pytest.fixture
def clean_chip_cache():
    device.chip_family.cache_clear()
    yield
    device.chip_family.cache_clear()


def test_availability_reasons(monkeypatch, clean_chip_cache):
    _fake_env(monkeypatch, importable=False)
    assert device.availability() == (False, "torch_npu is not installed")
    _fake_env(monkeypatch, import_error=ImportError("libhccl.so: cannot open shared object file"))
    assert device.availability() == (False, "torch_npu failed to import: ImportError: libhccl.so: cannot open "
                                            "shared object file")
    _fake_env(monkeypatch, available=False)
    assert device.availability() == (False, "no Ascend device visible")
    _fake_env(monkeypatch, count=0)
    assert device.availability() == (False, "no Ascend device visible")
    _fake_env(monkeypatch, soc_version=223, name="Ascend910B3")
    assert device.availability() == (True, "Ascend910B3 (A2)")


@pytest.mark.parametrize("version,name,chip", [
    (220, "Ascend910B1", "A2"), (225, "Ascend910B4-1", "A2"),
    (250, "Ascend910_9391", "A3"), (255, "Ascend910_9362", "A3"),
    (260, "Ascend950PR_9599", "950"),
    (None, "Ascend910B2C", "A2"), (None, "Ascend910_9382", "A3"), (None, "Ascend950DT_9591", "950"),
    (None, "Ascend910_9579", "950"),
    (None, "Ascend310P3", None), (102, "Ascend910A", None), (None, "Ascend910ProB", None),
])
def test_chip_family_from_soc_version_then_name(monkeypatch, clean_chip_cache, version, name, chip):
    _fake_env(monkeypatch, soc_version=version, name=name)
    assert device.chip_family() == chip


def test_chip_tables_edges():
    assert [device.chip_from_soc_version(v) for v in (219, 220, 225, 226, 249, 250, 255, 256, 259, 260, 261)] == \
        [None, "A2", "A2", None, None, "A3", "A3", None, None, "950", None]
    assert device.chip_from_soc_version(True) is None and device.chip_from_soc_version("223") is None
    assert device.chip_from_soc_name(" ascend910b3 ") == "A2"
    assert device.chip_from_soc_name(None) is None and device.chip_from_soc_name("Ascend910") is None


def test_custom_op_loaded_is_false_without_vllm_ascend():
    assert device.custom_op_loaded("npu_kv_quant_sparse_flash_attention") is False
    assert device.loaded_custom_ops(("npu_kv_quant_sparse_flash_attention",)) == frozenset()


# ------------------------------------------------------------------------------ 3. fake torch_npu

_NS = "qsfa_fake_npu"
_CODE_DTYPES = {1: torch.int8, 290: torch.uint8, 291: torch.float8_e5m2, 292: torch.float8_e4m3fn,
                23: torch.float8_e5m2, 24: torch.float8_e4m3fn}


def _bind(target, args, kwargs):
    b = signatures.signature(target).bind(*args, **kwargs)
    b.apply_defaults()
    return b.arguments


def _f32(*shape, like):
    return torch.zeros(shape, dtype=torch.float32, device=like.device)


# Output shapes as the meta registrations in the torch_npu 2.14.0 wheel compute them (and, for the custom
# op, vLLM-Ascend's kv_quant_sparse_flash_attention_torch_adpt.h), written out here.
def _qsfa_tn(*args, **kwargs):
    a = _bind(mapping.QSFA_TORCH_NPU, args, kwargs)
    q = a["query"]
    return q.new_zeros(q.shape[:-1] + (q.shape[-1] - a["rope_head_dim"],))


def _lse_shapes(q, key, layout_q, layout_kv, on):
    if not on:
        return (0,)
    if layout_q == "TND":
        kv_n = key.shape[2] if layout_kv == "PA_BSND" else key.shape[1]
        return (kv_n, q.shape[0], q.shape[1] // kv_n)
    return (q.shape[0], key.shape[2], q.shape[1], q.shape[2] // key.shape[2])


def _qsfa_custom(*args, **kwargs):
    a = _bind(mapping.QSFA_CUSTOM_OP, args, kwargs)
    q, key = a["query"], a["key"]
    out = q.new_zeros(q.shape[:-1] + (q.shape[-1] - a["rope_head_dim"],))
    s = _lse_shapes(q, key, a["layout_query"], a["layout_kv"], a["return_softmax_lse"])
    return out, _f32(*s, like=q), _f32(*s, like=q)


def _sfa(*args, **kwargs):
    a = _bind("torch_npu.npu_sparse_flash_attention", args, kwargs)
    q, key = a["query"], a["key"]
    on = a["return_softmax_lse"]
    if not on:
        s = (0,)
    elif a["layout_query"] == "TND":
        s = (key.shape[1], q.shape[0], q.shape[1] // key.shape[1])
    else:
        s = (q.shape[0], key.shape[2], q.shape[1], q.shape[2] // key.shape[2])
    return q.new_zeros(q.shape), _f32(*s, like=q), _f32(*s, like=q)


def _li(*args, **kwargs):
    a = _bind("torch_npu.npu_lightning_indexer", args, kwargs)
    q, key, k = a["query"], a["key"], a["sparse_count"]
    n2 = key.shape[1] if a["layout_key"] == "TND" else key.shape[2]
    shape = (q.shape[0], q.shape[1], key.shape[2], k) if a["layout_query"] == "BSND" else (q.shape[0], n2, k)
    idx = torch.zeros(shape, dtype=torch.int32)
    vals = q.new_zeros(shape) if a["return_value"] else q.new_zeros((0,))
    return idx, vals


def _qli(*args, **kwargs):
    a = _bind("torch_npu.npu_quant_lightning_indexer", args, kwargs)
    q, key, k = a["query"], a["key"], a["sparse_count"]
    n2 = key.shape[1] if a["layout_key"] == "TND" else key.shape[2]
    shape = (q.shape[0], q.shape[1], n2, k) if a["layout_query"] == "BSND" else (q.shape[0], n2, k)
    return torch.zeros(shape, dtype=torch.int32)


def _dbq(*args, **kwargs):
    a = _bind("torch_npu.npu_dynamic_block_quant", args, kwargs)
    x = a["x"]
    y = torch.zeros(x.shape, dtype=_CODE_DTYPES.get(a["dst_type"], torch.float8_e5m2))
    s = list(x.shape)
    s[-2] = math.ceil(s[-2] / a["row_block_size"])
    s[-1] = math.ceil(s[-1] / a["col_block_size"])
    return y, torch.zeros(s, dtype=torch.float32)


def _krrc_outputs(a):
    kv = a["kv"]
    lead = tuple(kv.shape[:-1])
    if a["v"] is None:
        return kv.new_zeros(lead + (a["cos"].shape[3],)), kv.new_zeros(lead + (a["gamma"].shape[0],))
    return kv.new_zeros(lead + (kv.shape[3],)), kv.new_zeros(lead + (a["v"].shape[3],))


def _krrc_v1(*args, **kwargs):
    a = _bind("torch_npu.npu_kv_rmsnorm_rope_cache", args, kwargs)
    k_rope, c_kv = _krrc_outputs(a)
    return a["k_cache"].clone(), a["ckv_cache"].clone(), k_rope, c_kv


def _krrc_v2(*args, **kwargs):
    return _krrc_outputs(_bind("torch_npu.npu_kv_rmsnorm_rope_cache_v2", args, kwargs))


def _scatter_nd_update_(var, indices, updates):
    """The documented semantics: var[indices[i]] = updates[i] (indices' last dim indexes var's leading dims)."""
    if indices.shape[0]:
        var.index_put_(tuple(indices[:, j] for j in range(indices.shape[1])), updates)
    return var


def _kce_vllm(*args, **kwargs):
    """vLLM-Ascend's kv_compress_epilog on the fake device: binds the recorded schema, then writes what the
    reference writes into the caller's cache tensor (in place, as the op is declared)."""
    from qsfa.reference.kv_compress_epilog_vllm import kv_compress_epilog_vllm

    a = _bind(mapping.KCE_VLLM_CUSTOM_OP, args, kwargs)
    cache = a["kv_compress_cache"]
    host = to_numpy(cache).copy()
    kv_compress_epilog_vllm(host, to_numpy(a["x"]), to_numpy(a["slot_mapping"]),
                            quant_group_size=a["quant_group_size"], quant_mode=a["quant_mode"],
                            round_scale_flag=a["round_scale_flag"], layout=a["layout"])
    cache.copy_(to_torch(host))


def _ice2(*args, **kwargs):
    """vLLM-Ascend's indexer_compress_epilog_v2 on the fake device: binds the recorded schema, then writes what the
    reference writes into the caller's uint8 cache (in place)."""
    from qsfa.reference.indexer_cache import indexer_compress_epilog_v2

    a = _bind(mapping.ICE2_CUSTOM_OP, args, kwargs)
    cache = a["indexer_compress_cache"]
    host = to_numpy(cache).copy()
    indexer_compress_epilog_v2(host, to_numpy(a["x"]), to_numpy(a["slot_mapping"]), layout=a["layout"])
    cache.copy_(to_torch(host))


def _vqli(*args, **kwargs):
    """vLLM-Ascend's npu_vllm_quant_lightning_indexer on the fake device: binds the recorded schema, refuses a missing
    metadata as the op_host does, returns the reference's indices and the empty float32 values."""
    from qsfa.reference.indexer_v4 import vllm_quant_lightning_indexer

    a = _bind(mapping.VQLI_CUSTOM_OP, args, kwargs)
    assert a["metadata"] is not None and tuple(a["metadata"].shape) == (1024,), "input metadata must not be null"
    host = {k: to_numpy(v) if is_torch(v) else v for k, v in a.items()}
    idx, _ = vllm_quant_lightning_indexer(**host)
    return to_torch(np.ascontiguousarray(idx)), torch.zeros((0,), dtype=torch.float32)


def _vqli_meta(*args, **kwargs):
    _bind(mapping.VQLI_META_CUSTOM_OP, args, kwargs)
    return torch.zeros(1024, dtype=torch.int32)


def _v4_attention(target, out_dtype=None):
    """A V4 shared-KV attention op on the fake device: binds the recorded schema, refuses a missing metadata (the
    kernels require one), returns q-shaped output (in ``out_dtype``, else q's: quant_sparse_flash_mla's Meta
    registration gives bf16 for its HiFloat8 q) and the LSE shaped as ops-transformer's sparse_flash_mla Meta
    registration computes it ([B, N2, S1, N1 / N2] BSND, [N2, T1, N1 / N2] TND; empty without the switch)."""
    def impl(*args, **kwargs):
        a = _bind(target, args, kwargs)
        assert a["metadata"] is not None and tuple(a["metadata"].shape) == (1024,), "metadata must not be null"
        q, kv = a["q"], a["ori_kv"]
        n2 = kv.shape[-2]
        if not a["return_softmax_lse"]:
            s = (0,)
        elif a["layout_q"] == "TND":
            s = (n2, q.shape[0], q.shape[1] // n2)
        else:
            s = (q.shape[0], n2, q.shape[1], q.shape[2] // n2)
        return q.new_zeros(q.shape, dtype=out_dtype or q.dtype), _f32(*s, like=q)

    return impl


def _v4_metadata(target):
    def impl(*args, **kwargs):
        _bind(target, args, kwargs)
        return torch.zeros(1024, dtype=torch.int32)

    return impl


def _host(v):
    """A fake device tensor as the reference's NumPy array (E8M0 scale bytes as uint8, as qsfa carries them)."""
    if not is_torch(v):
        return v
    return to_numpy(v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v).copy()


def _package_cache_writer(target, op_name):
    """A cann_ops_transformer cache writer on the fake device: binds the recorded schema, runs the qsfa reference
    (whose parameter names are the schema's) on host copies and writes the resulting bytes into the caller's caches."""
    def impl(*args, **kwargs):
        a = _bind(target, args, kwargs)
        host = {k: _host(v) for k, v in a.items()}
        run(op_name, host, backend="reference")
        for name in operators()[op_name].contract.inplace:
            dev = a[name]
            dev.view(torch.uint8).copy_(to_torch(np.ascontiguousarray(host[name]).view(np.uint8)))
        if op_name == "scatter_pa_kv_cache_with_k_scale":
            return a["key_cache"], a["value_cache"], a["key_scale_cache"]
        return None

    return impl


def _qli2(*args, **kwargs):
    """cann_ops_transformer.quant_lightning_indexer on the fake device: binds the recorded schema, refuses a missing
    metadata (the op_host requires it), returns the reference's indices and values (its names are the schema's)."""
    a = _bind(mapping.QLI2_OP, args, kwargs)
    assert a["metadata"] is not None and tuple(a["metadata"].shape) == (1024,), "metadata must not be null"
    idx, vals = run("quant_lightning_indexer_v2", {k: _host(v) for k, v in a.items()}, backend="reference")
    return to_torch(np.ascontiguousarray(idx)), to_torch(np.ascontiguousarray(vals))


def _qkv_inplace(*args, **kwargs):
    """cann_ops_transformer.qkv_rms_norm_rope_cache_with_k_scale_ on the fake device: binds the recorded schema, runs
    the reference on host copies, writes the caches' bytes into the tensors passed and returns (q_out, q_scale)."""
    a = _bind(mapping.QKV_OP, args, kwargs)
    host = {k: _host(v) for k, v in a.items()}
    dt = a["q_out_dtype"]  # a torch dtype in the schema (None: the package's default, float8_e4m3fn)
    host["q_out_dtype"] = "float8_e4m3fn" if dt is None else str(dt).replace("torch.", "")
    q_out, q_scale, *_ = run("qkv_rms_norm_rope_cache_with_k_scale", host, backend="reference")
    for name in ("k_cache", "v_cache", "k_scale_cache"):
        a[name].view(torch.uint8).copy_(to_torch(np.ascontiguousarray(host[name]).view(np.uint8)))
    return to_torch(np.ascontiguousarray(q_out)), None if q_scale is None else to_torch(np.ascontiguousarray(q_scale))


def _compressor(target, op_name):
    """cann_ops_transformer.[quant_]compressor on the fake device: binds the recorded schema, runs the reference (its
    parameter names are the schema's) on host copies for the fake's chip, writes the state's bytes into the tensor
    passed and returns cmp_kv alone, as the package's op does."""
    def impl(*args, **kwargs):
        a = _bind(target, args, kwargs)
        host = {k: _host(v) for k, v in a.items()}
        cmp_kv, state = run(op_name, {**host, "precision": "faithful"}, backend="reference", chip=device.chip_family())
        a["state_cache"].copy_(to_torch(np.ascontiguousarray(state)))
        return to_torch(np.ascontiguousarray(cmp_kv))

    return impl


def _vllm_compressor(*args, **kwargs):
    """vLLM-Ascend's _C_ascend.compressor on the fake device: binds the recorded schema (every value positional),
    runs the reference for the fake's chip on host copies, writes the state's bytes into the tensor passed and
    returns cmp_kv with its padding rows holding garbage, as the kernel leaves the binding's at::empty rows."""
    a = _bind(mapping.VCMP_CUSTOM_OP, args, kwargs)
    host = {k: _host(v) for k, v in a.items()}
    cmp_kv, state = run("vllm_compressor", {**host, "precision": "faithful"}, backend="reference",
                        chip=device.chip_family())
    a["state_cache"].copy_(to_torch(np.ascontiguousarray(state)))
    out = to_torch(np.ascontiguousarray(cmp_kv))
    pad = (out == 0).all(dim=-1)
    out[pad] = 3.0
    return out


_FAKE_IMPLS = {
    "torch_npu.npu_kv_quant_sparse_flash_attention": _qsfa_tn,
    "torch_npu.npu_sparse_flash_attention": _sfa,
    "torch_npu.npu_lightning_indexer": _li,
    "torch_npu.npu_quant_lightning_indexer": _qli,
    "torch_npu.npu_dynamic_block_quant": _dbq,
    "torch_npu.npu_kv_rmsnorm_rope_cache": _krrc_v1,
    "torch_npu.npu_kv_rmsnorm_rope_cache_v2": _krrc_v2,
    "torch_npu.npu_scatter_nd_update_": _scatter_nd_update_,
    mapping.KCE_VLLM_CUSTOM_OP: _kce_vllm,
    mapping.ICE2_CUSTOM_OP: _ice2,
    mapping.QSFA_CUSTOM_OP: _qsfa_custom,
    mapping.VQLI_CUSTOM_OP: _vqli,
    mapping.VQLI_META_CUSTOM_OP: _vqli_meta,
    mapping.SAS_CUSTOM_OP: _v4_attention(mapping.SAS_CUSTOM_OP),
    mapping.KQS_CUSTOM_OP: _v4_attention(mapping.KQS_CUSTOM_OP),
    mapping.SFM_OP: _v4_attention(mapping.SFM_OP),
    mapping.MQ_OP: _v4_attention(mapping.MQ_OP),
    mapping.QS_OP: _v4_attention(mapping.QS_OP, torch.bfloat16),
    mapping.QS_META_OP: _v4_metadata(mapping.QS_META_OP),
    mapping.SAS_META_CUSTOM_OP: _v4_metadata(mapping.SAS_META_CUSTOM_OP),
    mapping.KQS_META_CUSTOM_OP: _v4_metadata(mapping.KQS_META_CUSTOM_OP),
    mapping.SFM_META_OP: _v4_metadata(mapping.SFM_META_OP),
    mapping.MQ_META_OP: _v4_metadata(mapping.MQ_META_OP),
    mapping.IQC_OP: _package_cache_writer(mapping.IQC_OP, "indexer_quant_cache"),
    mapping.SPKS_OP: _package_cache_writer(mapping.SPKS_OP, "scatter_pa_kv_cache_with_k_scale"),
    mapping.QLI2_OP: _qli2,
    mapping.QLI2_META_OP: _v4_metadata(mapping.QLI2_META_OP),
    mapping.QKV_OP: _qkv_inplace,
    mapping.CMP_OP: _compressor(mapping.CMP_OP, "compressor"),
    mapping.QCMP_OP: _compressor(mapping.QCMP_OP, "quant_compressor"),
    mapping.VCMP_CUSTOM_OP: _vllm_compressor,
}


_PACKAGE_PREFIX = f"torch.ops.{mapping.PACKAGE}."


class FakeNpu:
    """Registers the fake torch_npu (optionally the _C_ascend custom ops, and the cann_ops_transformer package's
    ops behind a fake importable package) and an npu backend on the CPU. Without ``package`` the package is not
    importable (``sys.modules[name] = None``)."""

    def __init__(self, monkeypatch, chip, custom, package=True):
        self.calls = []
        main = torch.library.Library(_NS, "DEF")
        self.libs = [main]
        libs = {}
        if custom:
            libs["torch.ops._C_ascend."] = torch.library.Library(device.CUSTOM_OP_NAMESPACE, "DEF")
        if package:
            libs[_PACKAGE_PREFIX] = torch.library.Library(mapping.PACKAGE, "DEF")
            pkg = types.ModuleType(mapping.PACKAGE)
            pkg.__spec__ = importlib.machinery.ModuleSpec(mapping.PACKAGE, None)
            monkeypatch.setitem(sys.modules, mapping.PACKAGE, pkg)
        else:
            monkeypatch.setitem(sys.modules, mapping.PACKAGE, None)  # import raises ModuleNotFoundError
        self.libs += list(libs.values())
        module = types.ModuleType("torch_npu")
        module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        for target in signatures.targets():
            prefix = next((p for p in ("torch.ops._C_ascend.", _PACKAGE_PREFIX) if target.startswith(p)), None)
            if prefix is not None and prefix not in libs:
                continue
            lib = libs[prefix] if prefix else main
            name = target.rsplit(".", 1)[1]
            lib.define(signatures.record(target)["schema"])
            lib.impl(name, self._recording(target, _FAKE_IMPLS[target]), "CompositeExplicitAutograd")
            if target.startswith("torch_npu."):
                setattr(module, name, getattr(getattr(torch.ops, _NS), name))
        monkeypatch.setitem(sys.modules, "torch_npu", module)
        monkeypatch.delitem(sys.modules, "qsfa.npu.backend", raising=False)
        be = _dispatch.get_backend("npu", require_usable=False)
        monkeypatch.setattr(be, "availability", lambda: (True, "fake torch_npu on the CPU"), raising=False)
        monkeypatch.setattr(be, "device", lambda: "cpu", raising=False)
        monkeypatch.setattr(device, "chip_family", lambda: chip)

    def _recording(self, target, impl):
        def run_impl(*args, **kwargs):
            self.calls.append(target)
            return impl(*args, **kwargs)

        return run_impl

    def close(self):
        for op in _dispatch._OPERATORS.values():
            op.impls.pop("npu", None)
        for lib in self.libs:
            lib._destroy()
        sys.modules.pop("qsfa.npu.backend", None)


def _fake_custom_ops(fake):
    """The custom ops the fake device loads: every recorded _C_ascend op with vllm_ascend, none without."""
    return frozenset(t.rsplit(".", 1)[1] for t in signatures.targets() if t.startswith("torch.ops._C_ascend.")) \
        if fake.custom else frozenset()


@pytest.fixture(params=[("A3", False), ("A3", True), ("950", False)], ids=["A3", "A3+vllm_ascend", "950"])
def fake_npu(request, monkeypatch):
    chip, custom = request.param
    fake = FakeNpu(monkeypatch, chip, custom)
    fake.chip, fake.custom = chip, custom
    yield fake
    fake.close()


def _mapped_ops():
    return sorted(set(mapping.MAPPINGS) & set(operators()))


def _example(op_name):
    return operators()[op_name].contract.example(np.random.default_rng(0))


def _as_torch(args):
    return {k: (to_torch(v).clone() if isinstance(v, np.ndarray) else v) for k, v in copy_args(args).items()}


def _outputs(res, n):
    return res if n > 1 else (res,)


def _variants():
    """(op, id, args builder): every mapped operator's contract example, plus the attention operators over
    layouts x rope x LSE x key format built with qsfa.ops.attention's case helpers."""
    out = [(op, "example", (lambda op=op: _example(op))) for op in _mapped_ops()]
    try:
        from qsfa.ops import cache
    except ImportError:
        cache = None
    if hasattr(cache, "kv_rmsnorm_rope_cache_example"):
        for mode in ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"):
            for k_fmt, ckv_fmt in (("bfloat16", "bfloat16"), ("int8", "int8"), ("hifloat8", "float8_e4m3fn")):
                for version in (1, 2):
                    dims = dict(dv=512, dk=64) if version == 1 else dict(dv=128, dk=192, rope=64)
                    out.append(("kv_rmsnorm_rope_cache", f"v{version}-{mode}-{k_fmt}-{ckv_fmt}",
                                lambda mode=mode, k_fmt=k_fmt, ckv_fmt=ckv_fmt, version=version, dims=dims:
                                cache.kv_rmsnorm_rope_cache_example(np.random.default_rng(0), version=version,
                                                                    cache_mode=mode, k_fmt=k_fmt, ckv_fmt=ckv_fmt,
                                                                    batch=1, seq=2, **dims)))
    try:
        from qsfa.ops import attention as att
    except ImportError:
        return out
    layouts = [("BSND", "BSND"), ("TND", "TND"), ("BSND", "PA_BSND"), ("TND", "PA_BSND")]
    if hasattr(att, "qsfa_case"):
        for lq, lkv in layouts:
            for rope in (0, 64):
                for lse in (False, True):
                    for fmt in ("int8", "float8_e4m3fn", "hifloat8"):
                        def build(lq=lq, lkv=lkv, rope=rope, lse=lse, fmt=fmt):
                            a = att.qsfa_case(layout_query=lq, layout_kv=lkv, rope=rope, key_fmt=fmt,
                                              sparse=2048 if fmt == "hifloat8" else 2)
                            a["return_softmax_lse"] = lse
                            return a
                        out.append(("kv_quant_sparse_flash_attention", f"{lq}-{lkv}-rope{rope}-lse{int(lse)}-{fmt}",
                                    build))
    if hasattr(att, "sfa_case"):
        for lq, lkv in layouts:
            for lse in (False, True):
                for rope in (False, True):
                    def build(lq=lq, lkv=lkv, rope=rope, lse=lse):
                        a = att.sfa_case(layout_query=lq, layout_kv=lkv, rope=rope, value=not rope)
                        a["return_softmax_lse"] = lse
                        return a
                    out.append(("sparse_flash_attention", f"{lq}-{lkv}-rope{int(rope)}-lse{int(lse)}", build))
    if hasattr(att, "indexer_case"):
        for lq, lkv in layouts:
            out.append(("lightning_indexer", f"{lq}-{lkv}", lambda lq=lq, lkv=lkv: att.indexer_case(
                layout_query=lq, layout_kv=lkv)))
            for fmt in ("int8", "float8_e4m3fn", "hifloat8"):
                out.append(("quant_lightning_indexer", f"{lq}-{lkv}-{fmt}", lambda lq=lq, lkv=lkv, fmt=fmt:
                            att.indexer_case(layout_query=lq, layout_kv=lkv, quant=True, fmt=fmt)))
    return out


_VARIANTS = _variants()


_REF_CACHE: dict = {}


def _reference_outputs(op_name, key, build):
    """(shape, dtype name) of each reference output (None for a None output), computed once per variant."""
    if key not in _REF_CACHE:
        op = operators()[op_name]
        try:
            res = _outputs(run(op_name, build(), backend="reference"), len(op.outputs))
            _REF_CACHE[key] = [None if r is None else (tuple(r.shape), dtype_name(r)) for r in res]
        except (InvalidArgument, InvalidDtype) as e:
            _REF_CACHE[key] = e
    return _REF_CACHE[key]


_CALLER_PARAMS = [pytest.param(op, i, b, c, id=f"{op}-{i}-{c}") for op, i, b in _VARIANTS
                  for c in (("numpy", "torch") if i == "example" else ("torch",))]


@pytest.mark.parametrize("op_name,vid,build,caller", _CALLER_PARAMS)
def test_every_mapped_operator_runs_through_the_fake_torch_npu(fake_npu, op_name, vid, build, caller):
    """Args -> npu path -> outputs with the reference's shapes and dtypes, in the caller's kind; or the
    rejection the chip's contract rules / the call-path limits predict, before anything is called."""
    op = operators()[op_name]
    ref = _reference_outputs(op_name, (op_name, vid), build)
    if isinstance(ref, Exception):
        pytest.skip(f"not a valid argument set for the operator itself: {ref.constraint_id}")
    host = build()
    ctx = mapping.NpuContext(fake_npu.chip, _fake_custom_ops(fake_npu))
    chip_hit = op.contract.first_violation(host, chip=fake_npu.chip)
    limits_hit = [c.id for c in device.backend_limits(op_name, chip=ctx.chip, custom_ops=ctx.custom_ops)
                  if chip_hit is None and c.check(op.contract.validate(host, chip=fake_npu.chip)) is not None]
    args = build() if caller == "numpy" else _as_torch(build())
    if chip_hit is not None:
        with pytest.raises((InvalidArgument, InvalidDtype)) as ei:
            run(op_name, args, backend="npu")
        assert ei.value.constraint_id == chip_hit[0].id and chip_hit[0].chips is not None
        assert fake_npu.calls == []
        return
    if limits_hit:
        with pytest.raises(UnsupportedByBackend) as ei:
            run(op_name, args, backend="npu")
        assert ei.value.constraint_id == limits_hit[0]
        assert fake_npu.calls == []
        return
    res = _outputs(run(op_name, args, backend="npu"), len(op.outputs))
    call = mapping.map_call(op_name, _as_torch(op.contract.validate(build(), chip=ctx.chip)), ctx)
    before = [v.target for v in call.kwargs.values() if isinstance(v, mapping.NpuCall)]  # a metadata operator
    assert fake_npu.calls == before + [call.target]
    assert len(res) == len(op.outputs)
    for name, r, e in zip(op.outputs, res, ref):
        if e is None:
            assert r is None, name
            continue
        if caller == "numpy":
            assert isinstance(r, np.ndarray), name
        else:
            assert is_torch(r) and r.device.type == "cpu", name
        assert (tuple(r.shape), dtype_name(r)) == e, name
        if name in op.contract.inplace:
            assert r is args[name], name


def test_the_routes_the_variants_reach(fake_npu):
    """Across the attention variants, each fixture reaches the callables its chip / custom op allow."""
    reached = set()
    for op_name, _, build in _VARIANTS:
        if op_name != "kv_quant_sparse_flash_attention":
            continue
        op = operators()[op_name]
        try:
            a = op.contract.validate(build(), chip=fake_npu.chip)
        except (InvalidArgument, InvalidDtype):
            continue
        ctx = mapping.NpuContext(fake_npu.chip, frozenset({mapping.QSFA_CUSTOM_NAME} if fake_npu.custom else ()))
        try:
            reached.add(mapping.qsfa_target(a, ctx))
        except ValueError:
            reached.add("unsupported")
    if not reached:
        pytest.skip("no QSFA variants in this checkout")
    want = {("A3", False): {mapping.QSFA_TORCH_NPU, "unsupported"},
            ("A3", True): {mapping.QSFA_CUSTOM_OP},
            ("950", False): {mapping.QSFA_TORCH_NPU, "unsupported"}}[(fake_npu.chip, fake_npu.custom)]
    assert reached == want


@pytest.mark.parametrize("caller", ["numpy", "torch"])
def test_scatter_by_slot_on_the_fake_device_writes_the_reference_bytes(fake_npu, caller):
    args = _example("scatter_by_slot")
    expected = run("scatter_by_slot", copy_args(args), backend="reference")
    if caller == "torch":
        args = _as_torch(args)
    out = run("scatter_by_slot", args, backend="npu")
    assert out is args["cache"]
    assert np.ascontiguousarray(to_numpy(out)).tobytes() == np.ascontiguousarray(expected).tobytes()


def test_chip_rules_apply_on_the_npu_backend(fake_npu):
    args = _example("dynamic_block_quant")
    args["dst_type"] = "hifloat8"
    args["round_mode"] = "round"
    if fake_npu.chip == "950":
        y, scale = run("dynamic_block_quant", args, backend="npu")
        assert y.dtype == np.uint8 and fake_npu.calls == ["torch_npu.npu_dynamic_block_quant"]
    else:
        with pytest.raises(InvalidArgument) as ei:
            run("dynamic_block_quant", args, backend="npu")
        assert operators()["dynamic_block_quant"].contract.constraint(ei.value.constraint_id).chips is not None
        assert fake_npu.calls == []
    run("dynamic_block_quant", args, backend="reference")  # the reference accepts the union of the chips


@pytest.mark.parametrize("op_name", sorted(mapping.NOT_MAPPED))
def test_unmapped_operators_are_not_implemented_on_npu_with_the_reason(fake_npu, op_name):
    if op_name not in operators():
        pytest.skip(f"{op_name} is not defined in this checkout")
    with pytest.raises(NotImplementedByBackend) as ei:
        run(op_name, _example(op_name), backend="npu")
    assert str(ei.value) == f"backend 'npu' does not implement {op_name}: {mapping.NOT_MAPPED[op_name]}"
    assert fake_npu.calls == []


def test_backends_lists_the_npu_operators_when_usable(fake_npu):
    st = _dispatch.backends()["npu"]
    assert st.usable and st.operators == tuple(_mapped_ops())
    import qsfa.npu.backend as npu_backend

    assert npu_backend.registered == tuple(op for op in mapping.MAPPINGS if op in operators())
    assert npu_backend.resolve("torch_npu.npu_dynamic_block_quant") is sys.modules["torch_npu"].npu_dynamic_block_quant


@pytest.mark.parametrize("caller", ["numpy", "torch"])
def test_kv_compress_epilog_vllm_runs_its_custom_op_in_place(monkeypatch, caller):
    fake = FakeNpu(monkeypatch, "950", True)
    try:
        args = _example("kv_compress_epilog_vllm")
        expected = run("kv_compress_epilog_vllm", copy_args(args), backend="reference")
        if caller == "torch":
            args = _as_torch(args)
        out = run("kv_compress_epilog_vllm", args, backend="npu")
        assert fake.calls == [mapping.KCE_VLLM_CUSTOM_OP]
        assert out is args["kv_compress_cache"]
        assert np.ascontiguousarray(to_numpy(out)).view(np.uint8).tobytes() == \
            np.ascontiguousarray(expected).view(np.uint8).tobytes()
    finally:
        fake.close()


@pytest.mark.parametrize("caller", ["numpy", "torch"])
def test_indexer_compress_epilog_v2_runs_its_custom_op_in_place(monkeypatch, caller):
    fake = FakeNpu(monkeypatch, "950", True)
    try:
        args = _example("indexer_compress_epilog_v2")
        expected = run("indexer_compress_epilog_v2", copy_args(args), backend="reference")
        if caller == "torch":
            args = _as_torch(args)
        out = run("indexer_compress_epilog_v2", args, backend="npu")
        assert fake.calls == [mapping.ICE2_CUSTOM_OP]
        assert out is args["indexer_compress_cache"]
        assert np.ascontiguousarray(to_numpy(out)).tobytes() == np.ascontiguousarray(expected).tobytes()
    finally:
        fake.close()


@pytest.mark.parametrize("metadata", [None, "given"])
def test_vllm_quant_lightning_indexer_computes_its_metadata_first_when_none_is_given(monkeypatch, metadata):
    fake = FakeNpu(monkeypatch, "A3", True)
    try:
        from qsfa.ops.indexer_v4 import vqli_case

        args = vqli_case(cmp_ratio=4, layout_query="TND")
        want, _ = run("vllm_quant_lightning_indexer", copy_args(args), backend="reference")
        if metadata is not None:
            args["metadata"] = np.zeros(1024, np.int32)
        idx, vals = run("vllm_quant_lightning_indexer", _as_torch(args), backend="npu")
        meta = [mapping.VQLI_META_CUSTOM_OP] if metadata is None else []
        assert fake.calls == meta + [mapping.VQLI_CUSTOM_OP]
        assert np.array_equal(to_numpy(idx), want) and tuple(vals.shape) == (0,)
    finally:
        fake.close()


@pytest.mark.parametrize("op_name,chip", [("sparse_flash_mla", "950"), ("mixed_quant_sparse_flash_mla", "950"),
                                          ("indexer_quant_cache", "950"), ("scatter_pa_kv_cache_with_k_scale", "950"),
                                          ("quant_lightning_indexer_v2", "A3"),
                                          ("qkv_rms_norm_rope_cache_with_k_scale", "950"), ("compressor", "A3"),
                                          ("quant_compressor", "950"), ("quant_sparse_flash_mla", "950")])
def test_package_operators_without_cann_ops_transformer_are_refused_naming_the_package(monkeypatch, op_name, chip):
    fake = FakeNpu(monkeypatch, chip, False, package=False)
    try:
        args = _as_torch(_example(op_name))
        before = {n: args[n].clone() for n in operators()[op_name].contract.inplace}
        with pytest.raises(UnsupportedByBackend, match=r"the cann_ops_transformer package \(ops-transformer "
                                                        r"torch_extension/.*failed to import \(ModuleNotFoundError"):
            run(op_name, args, backend="npu")
        assert fake.calls == []  # refused before anything ran (the metadata operator included)
        assert all(torch.equal(args[n].view(torch.uint8), v.view(torch.uint8)) for n, v in before.items())
    finally:
        fake.close()


@pytest.mark.parametrize("metadata", [None, "given"])
@pytest.mark.parametrize("op_name,chip", [("kv_quant_sparse_attn_sharedkv", "950"), ("sparse_attn_sharedkv", "A3"),
                                          ("sparse_flash_mla", "A2"), ("mixed_quant_sparse_flash_mla", "950"),
                                          ("quant_sparse_flash_mla", "950")])
def test_v4_attention_runs_its_metadata_operator_first_when_none_is_given(monkeypatch, op_name, chip, metadata):
    fake = FakeNpu(monkeypatch, chip, True)
    try:
        args = _example(op_name)
        args["metadata"] = None if metadata is None else np.zeros(1024, np.int32)
        try:  # the LSE output where the chip's contract allows it (reserved on some)
            operators()[op_name].contract.validate({**args, "return_softmax_lse": True}, chip=chip)
            args["return_softmax_lse"] = True
        except InvalidArgument:
            pass
        want = run(op_name, copy_args(args), backend="reference")
        out, lse = run(op_name, _as_torch(args), backend="npu")
        target = {"kv_quant_sparse_attn_sharedkv": mapping.KQS_CUSTOM_OP, "sparse_attn_sharedkv": mapping.SAS_CUSTOM_OP,
                  "sparse_flash_mla": mapping.SFM_OP, "mixed_quant_sparse_flash_mla": mapping.MQ_OP,
                  "quant_sparse_flash_mla": mapping.QS_OP}[op_name]
        meta = [target + "_metadata"] if metadata is None else []
        assert fake.calls == meta + [target]
        assert (tuple(out.shape), dtype_name(out)) == (want[0].shape, dtype_name(want[0]))
        assert (tuple(lse.shape), dtype_name(lse)) == (want[1].shape, "float32")
        assert (lse.numel() > 0) is args["return_softmax_lse"]
    finally:
        fake.close()


@pytest.mark.parametrize("caller", ["numpy", "memmap", "torch"])
@pytest.mark.parametrize("op_name,chip", [("kv_quant_sparse_attn_sharedkv", "950"), ("sparse_attn_sharedkv", "A3"),
                                          ("sparse_flash_mla", "A2"), ("mixed_quant_sparse_flash_mla", "950"),
                                          ("quant_sparse_flash_mla", "950")])
def test_v4_attention_out_gets_the_devices_output_copied_in(monkeypatch, tmp_path, op_name, chip, caller):
    """The V4 schemas take no output tensor: the npu path copies the op's output into the caller's attention_out=
    buffer after the call (mapping writeback, then the dispatch layer's copy back) and returns that buffer."""
    fake = FakeNpu(monkeypatch, chip, True)
    try:
        args = _example(op_name)
        plain = run(op_name, copy_args(args) if caller != "torch" else _as_torch(args), backend="npu")
        want = to_numpy(plain[0]) if is_torch(plain[0]) else plain[0]
        if caller == "memmap":
            buf = np.memmap(tmp_path / "out.bin", dtype=want.dtype, mode="w+", shape=want.shape)
            buf[...] = 7
        elif caller == "numpy":
            buf = np.full(want.shape, 7, want.dtype)
        else:
            buf = to_torch(np.full(want.shape, 7, want.dtype))
        call_args = _as_torch(args) if caller == "torch" else copy_args(args)
        fake.calls.clear()
        out, lse = run(op_name, {**call_args, "attention_out": buf}, backend="npu")
        assert out is buf
        got = to_numpy(buf) if is_torch(buf) else np.asarray(buf)
        assert got.tobytes() == want.tobytes() and not (got.view(np.uint8) == 7).all()
        assert fake.calls[-1] == {"kv_quant_sparse_attn_sharedkv": mapping.KQS_CUSTOM_OP,
                                  "sparse_attn_sharedkv": mapping.SAS_CUSTOM_OP, "sparse_flash_mla": mapping.SFM_OP,
                                  "mixed_quant_sparse_flash_mla": mapping.MQ_OP,
                                  "quant_sparse_flash_mla": mapping.QS_OP}[op_name]
    finally:
        fake.close()


@pytest.mark.parametrize("mode", ["fp8", "mxfp8", "mxfp4", "hifloat8"])
def test_indexer_quant_cache_runs_the_package_op_in_place(monkeypatch, mode):
    fake = FakeNpu(monkeypatch, "950", False)
    try:
        import ml_dtypes

        args = _example("indexer_quant_cache")  # mxfp4: packed E2M1 codes, E8M0 scales per 32
        f8 = np.dtype(ml_dtypes.float8_e4m3fn)
        cache, scale = {"mxfp4": (None, None), "mxfp8": (f8, (2, np.uint8)), "fp8": (f8, (1, np.float32)),
                        "hifloat8": (np.uint8, (1, np.float32))}[mode]
        if cache is not None:
            args.update(quant_mode=mode, cache=np.zeros((3, 4, 1, 64), np.uint8).view(cache),
                        cache_scale=np.zeros((3, 4, 1, scale[0]), scale[1]))
        operators()["indexer_quant_cache"].contract.validate(args, chip="950")
        expected = run("indexer_quant_cache", copy_args(args), backend="reference")
        targs = _as_torch(args)
        cache, scale = run("indexer_quant_cache", targs, backend="npu")
        assert fake.calls == [mapping.IQC_OP]
        assert cache is targs["cache"] and scale is targs["cache_scale"]
        for got, want in zip((cache, scale), expected):
            assert np.ascontiguousarray(to_numpy(got.view(torch.uint8) if got.element_size() == 1 else got)).view(
                np.uint8).tobytes() == np.ascontiguousarray(want).view(np.uint8).tobytes()
    finally:
        fake.close()


@pytest.mark.parametrize("metadata", [None, "given"])
@pytest.mark.parametrize("chip,fmt,layout_q,layout_k", [("A3", "int8", "BSND", "PA_BBND"),
                                                        ("950", "float8_e4m3fn", "TND", "TND"),
                                                        ("950", "hifloat8", "BSND", "PA_BBND")])
def test_qli2_runs_the_package_op_after_its_metadata_operator(monkeypatch, chip, fmt, layout_q, layout_k, metadata):
    from qsfa.ops.quant_lightning_indexer_v2 import qli2_case

    fake = FakeNpu(monkeypatch, chip, False)
    try:
        args = qli2_case(fmt=fmt, layout_q=layout_q, layout_k=layout_k)
        args["metadata"] = None if metadata is None else np.zeros(1024, np.int32)
        want = run("quant_lightning_indexer_v2", copy_args(args), backend="reference")
        idx, vals = run("quant_lightning_indexer_v2", _as_torch(args), backend="npu")
        meta = [mapping.QLI2_META_OP] if metadata is None else []
        assert fake.calls == meta + [mapping.QLI2_OP]
        assert np.array_equal(to_numpy(idx), want[0]) and to_numpy(idx).dtype == want[0].dtype
        assert (tuple(vals.shape), dtype_name(vals)) == (want[1].shape, dtype_name(want[1]))
    finally:
        fake.close()


@pytest.mark.parametrize("layouts", [("TND", "NTD"), ("NTD", "NTD"), ("TND", "TND")])
def test_qkv_runs_the_package_op_in_place(monkeypatch, layouts):
    from qsfa.ops.qkv_k_scale import qkv_case

    fake = FakeNpu(monkeypatch, "950", False)
    try:
        args = qkv_case(layout_qkv=layouts[0], layout_q_out=layouts[1])
        expected = run("qkv_rms_norm_rope_cache_with_k_scale", copy_args(args), backend="reference")
        targs = _as_torch(args)
        caches = (targs["k_cache"], targs["v_cache"], targs["k_scale_cache"])
        before = [c.clone() for c in caches]
        got = run("qkv_rms_norm_rope_cache_with_k_scale", targs, backend="npu")
        assert fake.calls == [mapping.QKV_OP]
        assert all(g is c for g, c in zip(got[2:], caches))  # the caller's tensors, written in place
        assert not all(torch.equal(b.view(torch.uint8), c.view(torch.uint8)) for b, c in zip(before, caches))
        for g, w in zip(got, expected):
            assert tuple(g.shape) == w.shape and dtype_name(g) == dtype_name(w)
            assert np.ascontiguousarray(to_numpy(g.view(torch.uint8) if g.element_size() == 1 else g)).view(
                np.uint8).tobytes() == np.ascontiguousarray(w).view(np.uint8).tobytes()
    finally:
        fake.close()


def test_qkv_mrope_runs_the_package_op_in_place(monkeypatch):
    """The M-RoPE scenario through the fake device (which binds the recorded schema): bf16 q_out, no q_scale, the
    INT8 K cache written in place, byte for byte the reference's."""
    from qsfa.ops.qkv_k_scale import mrope_case

    fake = FakeNpu(monkeypatch, "950", False)
    try:
        args = mrope_case()
        expected = run("qkv_rms_norm_rope_cache_with_k_scale", copy_args(args), backend="reference")
        targs = _as_torch(args)
        got = run("qkv_rms_norm_rope_cache_with_k_scale", targs, backend="npu")
        assert fake.calls == [mapping.QKV_OP] and got[1] is None and expected[1] is None
        assert got[0].dtype == torch.bfloat16 and got[2] is targs["k_cache"] and got[2].dtype == torch.int8
        for g, w in zip(got[:1] + got[2:], expected[:1] + expected[2:]):
            assert np.ascontiguousarray(to_numpy(g)).view(np.uint8).tobytes() == \
                np.ascontiguousarray(w).view(np.uint8).tobytes()
    finally:
        fake.close()


_CMP_RUNS = [("A3", "TH", 1, (4, 2, 128)), ("A3", "BSH", 1, (128, 1, 512)), ("950", "TH", 2, (4, 2, 512)),
             ("950", "BSH", 1, (4, 2, 128))]


@pytest.mark.parametrize("chip,layout,cache_mode,scenario,quant", [r + (False,) for r in _CMP_RUNS] +
                         [r + (True,) for r in _CMP_RUNS if r[0] == "950"])  # quant_compressor: 950 only (its doc)
def test_compressor_runs_the_package_op_with_the_state_in_place(monkeypatch, chip, layout, cache_mode, scenario, quant):
    from qsfa.formats import encode
    from qsfa.ops.compressor import compressor_case

    op_name = "quant_compressor" if quant else "compressor"
    fake = FakeNpu(monkeypatch, chip, False)
    try:
        args = compressor_case(scenario=scenario, layout=layout, cache_mode=cache_mode, seqused=(4, 1))
        args.update(cmp_ratio=scenario[0], coff=scenario[1], cache_mode=cache_mode, precision="faithful")
        args.setdefault("cu_seqlens", None)  # BSH: no cu_seqlens (the public function passes every parameter)
        if quant:
            cd = args["wkv"].shape[0]
            args.update({n: encode(args[n].astype(np.float32), "hifloat8", saturate=True) for n in ("x", "wkv", "wgate")})
            args.update(x_descale=np.array([0.5], np.float32), wkv_descale=np.full(cd, 0.25, np.float32),
                        wgate_descale=np.full(cd, 0.125, np.float32), quant_mode=1)
        want_kv, want_state = run(op_name, copy_args(args), backend="reference", chip=chip)
        targs = _as_torch(args)
        state = targs["state_cache"]
        before = state.clone()
        cmp_kv, got_state = run(op_name, targs, backend="npu", chip=chip)
        assert fake.calls == [mapping.QCMP_OP if quant else mapping.CMP_OP]
        assert got_state is state and not torch.equal(state, before)  # the caller's tensor, written in place
        for got, want in ((cmp_kv, want_kv), (got_state, want_state)):
            assert tuple(got.shape) == want.shape and dtype_name(got) == dtype_name(want)
            assert np.ascontiguousarray(to_numpy(got)).view(np.uint8).tobytes() == \
                np.ascontiguousarray(want).view(np.uint8).tobytes()
    finally:
        fake.close()
