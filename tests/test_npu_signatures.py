"""The recorded torch_npu / vLLM-Ascend signatures (qsfa/npu/signatures.json) and the recorder.

* With the unpacked torch_npu wheel at /tmp/npuwheel/torch_npu (or $QSFA_TORCH_NPU_DIR) the record is
  re-extracted and must equal what is committed; without it that test is skipped, saying so.
* Always: the parsers on hand-written inputs, the record's internal consistency (the Python meta
  signature and the typed schema agree), and facts read by hand from the sources.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qsfa.npu import _record_signatures as rec
from qsfa.npu import mapping, signatures

WHEEL_DIR = Path(os.environ.get("QSFA_TORCH_NPU_DIR", "/tmp/npuwheel/torch_npu"))


# ------------------------------------------------------------------------------ the record is current


@pytest.mark.skipif(not (WHEEL_DIR / rec.META_FILE).exists() or not (WHEEL_DIR / rec.SCHEMA_FILE).exists(),
                    reason=f"unpacked torch_npu wheel not found at {WHEEL_DIR} (set QSFA_TORCH_NPU_DIR; see "
                           "qsfa/npu/_record_signatures.py for how to unpack it)")
def test_recorded_torch_npu_part_matches_the_unpacked_wheel():
    recorded = signatures.load()
    fresh = rec.extract_torch_npu(WHEEL_DIR, recorded["torch_npu"]["wheel"])
    assert fresh["torch_npu"] == recorded["torch_npu"], "wheel files changed: regenerate signatures.json"
    assert fresh["dtype_tables"] == recorded["dtype_tables"]
    recorded_tn = {k: v for k, v in recorded["functions"].items() if k.startswith("torch_npu.")}
    assert fresh["functions"] == recorded_tn


@pytest.mark.skipif(not (WHEEL_DIR / rec.META_FILE).exists(), reason=f"unpacked torch_npu wheel not found at {WHEEL_DIR}")
def test_recorder_cli_reproduces_the_committed_file(tmp_path):
    out = tmp_path / "signatures.json"
    out.write_text(Path(signatures.__file__).with_name("signatures.json").read_text())
    assert rec.main([str(WHEEL_DIR), "--out", str(out),
                     "--wheel-name", signatures.load()["torch_npu"]["wheel"]]) == 0
    assert json.loads(out.read_text()) == signatures.load()


# ------------------------------------------------------------------------------ the record itself


def test_every_mapping_target_is_recorded():
    expected = {f"torch_npu.{n}" for n in rec.TORCH_NPU_FUNCTIONS} | \
        {f"torch.ops._C_ascend.{n}" for n in rec.CUSTOM_OPS} | \
        {f"torch.ops.{rec.PACKAGE_NAMESPACE}.{n}" for n in (*rec.PACKAGE_OPS, *rec.UPSTREAM_PACKAGE_OPS)}
    assert set(signatures.targets()) == expected
    assert mapping.QSFA_TORCH_NPU in expected and mapping.QSFA_CUSTOM_OP in expected


@pytest.mark.parametrize("target", signatures.targets())
def test_python_signature_and_typed_schema_agree(target):
    r = signatures.record(target)
    parsed = rec.parse_schema(r["schema"])
    assert parsed["name"] == target.rsplit(".", 1)[1]
    assert [p["name"] for p in parsed["params"]] == [p["name"] for p in r["params"]]
    for p_schema, p_rec in zip(parsed["params"], r["params"]):
        assert p_schema["type"] == p_rec["type"], p_rec["name"]
        assert p_schema["kind"] == p_rec["kind"], p_rec["name"]
        assert ("default" in p_schema) == ("default" in p_rec), p_rec["name"]
        if "default" in p_rec:
            assert p_schema["default"] == p_rec["default"], p_rec["name"]
    assert parsed["returns"] == r["returns"]
    src = r["source"]
    assert isinstance(src["line"], int) and src["line"] > 0 and src["file"]


def _params(target):
    return {p["name"]: p for p in signatures.record(target)["params"]}


def test_hand_read_facts_of_the_qsfa_signatures():
    """Read by hand from the wheel (meta line 2200, yaml line 482) and vLLM-Ascend csrc/torch_binding.cpp."""
    tn = _params(mapping.QSFA_TORCH_NPU)
    co = _params(mapping.QSFA_CUSTOM_OP)
    # torch_npu: quant modes are positional and required; attention_mode defaults to 0; HiF8 dtype codes;
    # no LSE switch; one output
    assert tn["key_quant_mode"]["kind"] == "positional" and "default" not in tn["key_quant_mode"]
    assert tn["attention_mode"]["default"] == 0 and tn["rope_head_dim"]["default"] == 64
    assert tn["key_dtype"]["type"] == "int?" and "return_softmax_lse" not in tn
    assert signatures.record(mapping.QSFA_TORCH_NPU)["returns"] == ["Tensor"]
    # custom op: quant modes keyword-only with default 1 (!), attention_mode 2, LSE switch, three outputs
    assert co["key_quant_mode"]["kind"] == "keyword_only" and co["key_quant_mode"]["default"] == 1
    assert co["attention_mode"]["default"] == 2 and co["return_softmax_lse"]["default"] is False
    assert "key_dtype" not in co
    assert signatures.record(mapping.QSFA_CUSTOM_OP)["returns"] == ["Tensor", "Tensor", "Tensor"]
    assert signatures.record(mapping.QSFA_CUSTOM_OP)["source"]["commit"] == "182b75ea84ff13ece27b57391331ef8935410aea"
    for p in (tn, co):
        assert p["pre_tokens"]["default"] == 2**63 - 1 and p["next_tokens"]["default"] == 2**63 - 1


def test_hand_read_facts_of_the_other_signatures():
    sfa = _params("torch_npu.npu_sparse_flash_attention")
    assert sfa["value"]["type"] == "Tensor?" and "default" not in sfa["value"]
    assert sfa["pre_tokens"]["default"] == 2**63 - 1  # written (1 << 63) - 1 in the meta file
    assert sfa["sinks"]["kind"] == "keyword_only"
    dbq = _params("torch_npu.npu_dynamic_block_quant")
    assert dbq["dst_type"]["default"] == 1 and dbq["dst_type"]["kind"] == "keyword_only"
    v1, v2 = _params("torch_npu.npu_kv_rmsnorm_rope_cache"), _params("torch_npu.npu_kv_rmsnorm_rope_cache_v2")
    assert "k_cache_dtype" not in v1 and v2["k_cache_dtype"]["type"] == "int?"
    assert v2["k_cache"]["type"] == "Tensor(a!)" and v1["k_cache"]["type"] == "Tensor"
    assert len(signatures.record("torch_npu.npu_kv_rmsnorm_rope_cache")["returns"]) == 4
    assert len(signatures.record("torch_npu.npu_kv_rmsnorm_rope_cache_v2")["returns"]) == 2
    assert list(_params("torch_npu.npu_scatter_nd_update_")) == ["self", "indices", "updates"]
    qli = _params("torch_npu.npu_quant_lightning_indexer")
    assert qli["query_quant_mode"]["kind"] == "positional" and qli["query_dtype"]["type"] == "int?"


def test_hand_read_facts_of_the_v4_signatures():
    """Read by hand from vLLM-Ascend csrc/torch_binding.cpp at 182b75e (l.2276-2472) and ops-transformer
    torch_extension/cann_ops_transformer/ops/*.py at 25fb6b9 (OpBuilder.schema)."""
    sas, kqs = _params(mapping.SAS_CUSTOM_OP), _params(mapping.KQS_CUSTOM_OP)
    assert list(sas)[:2] == ["q", "ori_kv"] and sas["ori_kv"]["kind"] == "keyword_only"
    assert list(kqs)[:2] == ["q", "kv_quant_mode"] and kqs["kv_quant_mode"]["kind"] == "positional"
    assert "default" not in kqs["kv_quant_mode"] and kqs["ori_kv"]["kind"] == "positional"
    assert (sas["softmax_scale"]["default"], sas["cmp_ratio"]["default"], sas["ori_win_left"]["default"]) == (0, 0, 128)
    assert kqs["ori_win_left"]["default"] == 127 and kqs["layout_kv"]["default"] == "PA_ND"
    for t in (mapping.SAS_CUSTOM_OP, mapping.KQS_CUSTOM_OP, mapping.SFM_OP, mapping.MQ_OP):
        assert signatures.record(t)["returns"] == ["Tensor", "Tensor"], t
        assert _params(t)["metadata"]["type"] == "Tensor?", t
    sm, km = _params(mapping.SAS_META_CUSTOM_OP), _params(mapping.KQS_META_CUSTOM_OP)
    assert list(sm)[:3] == ["num_heads_q", "num_heads_kv", "head_dim"] and list(km)[3] == "kv_quant_mode"
    assert sm["device"]["default"] == "npu" and km["cmp_ratio"]["default"] == -1 and sm["cmp_ratio"]["default"] == 4
    sfm, mq = _params(mapping.SFM_OP), _params(mapping.MQ_OP)
    assert sfm["ori_win_left"]["default"] == 127 and sfm["layout_kv"]["default"] == "BSND"
    assert sfm["cmp_residual_kv"]["kind"] == "keyword_only" and sfm["topk_value_mode"]["default"] == 1
    assert mq["quant_mode"]["type"] == "int" and mq["quant_mode"]["default"] is None
    assert mq["key_dtype"]["type"] == "int?" and mq["ori_win_left"]["default"] == -1
    sfm_meta, mq_meta = _params(mapping.SFM_META_OP), _params(mapping.MQ_META_OP)
    assert sfm_meta["batch_size"]["type"] == "int?" and "device" not in sfm_meta
    assert mq_meta["quant_mode"]["kind"] == "positional" and mq_meta["rope_head_dim"]["kind"] == "keyword_only"
    iqc, spks = _params(mapping.IQC_OP), _params(mapping.SPKS_OP)
    assert iqc["cache"]["type"] == "Tensor(a!)" and iqc["cache_scale"]["type"] == "Tensor(b!)"
    assert iqc["quant_mode"] == {"name": "quant_mode", "type": "str", "kind": "keyword_only", "default": "fp8"}
    assert signatures.record(mapping.IQC_OP)["returns"] == []
    assert spks["cache_layout"]["default"] == "BNBD" and spks["key_scale_cache"]["type"] == "Tensor(c!)"
    assert len(signatures.record(mapping.SPKS_OP)["returns"]) == 3
    for t in (mapping.SFM_OP, mapping.MQ_OP, mapping.IQC_OP, mapping.SPKS_OP):
        src = signatures.record(t)["source"]
        assert src["repo"] == "cannmirror/ops-transformer" and src["commit"].startswith("25fb6b9")
        assert src["file"].startswith("torch_extension/cann_ops_transformer/ops/")


def test_extract_package_ops_reads_the_opbuilder_schemas():
    source = """
class B(OpBuilder):
    def sources(self):
        return ["x.cpp"]

    def schema(self) -> str:
        return [
            "toy_metadata(int n, *, "
            "Tensor? lens=None,int? size=None) -> Tensor",
            "toy(Tensor q, *,"
            'str layout="BSND", float scale=1.0) -> (Tensor, Tensor)',
        ]
"""
    out = rec.extract_package_ops({"toy.py": source}, "abc", names={"toy": "toy.py", "toy_metadata": "toy.py"})
    toy = out["torch.ops.cann_ops_transformer.toy"]
    assert toy["schema"] == 'toy(Tensor q, *, str layout="BSND", float scale=1.0) -> (Tensor, Tensor)'
    assert toy["source"]["line"] == 10 and toy["source"]["commit"] == "abc"
    assert [p["kind"] for p in toy["params"]] == ["positional", "keyword_only", "keyword_only"]
    meta = out["torch.ops.cann_ops_transformer.toy_metadata"]
    assert meta["schema"] == "toy_metadata(int n, *, Tensor? lens=None, int? size=None) -> Tensor"
    assert meta["source"]["line"] == 8 and meta["returns"] == ["Tensor"]
    with pytest.raises(LookupError, match="no OpBuilder schema"):
        rec.extract_package_ops({"toy.py": source}, "abc", names={"absent": "toy.py"})


def test_dtype_codes_used_by_the_mapping_are_the_wheels():
    tables = signatures.load()["dtype_tables"]
    enum = tables["TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP"]["entries"]
    names = tables["TORCH_NPU_DTYPE_TO_STRING_MAP"]["entries"]
    assert enum[str(mapping.DTYPE_CODES["int8"])] == "torch.int8"
    assert enum[str(mapping.DTYPE_CODES["float8_e5m2"])] == "torch.float8_e5m2"
    assert enum[str(mapping.DTYPE_CODES["float8_e4m3fn"])] == "torch.float8_e4m3fn"
    assert names[str(mapping.HIFLOAT8_CODE)] == "torch_npu.hifloat8"
    assert enum[str(mapping.HIFLOAT8_CODE)] == "torch.uint8"  # HiFloat8 travels in uint8 tensors


# ------------------------------------------------------------------------------ signature helpers


def test_signature_kinds_and_defaults():
    import inspect

    sig = signatures.signature(mapping.QSFA_TORCH_NPU)
    ps = sig.parameters
    assert ps["query"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and ps["query"].default is inspect.Parameter.empty
    assert ps["block_table"].kind is inspect.Parameter.KEYWORD_ONLY and ps["block_table"].default is None
    with pytest.raises(KeyError, match="no recorded signature for 'torch_npu.nope'"):
        signatures.signature("torch_npu.nope")


def test_type_problems_reports_binding_and_type_errors():
    torch = pytest.importorskip("torch")
    t = torch.zeros(2)
    target = "torch_npu.npu_dynamic_block_quant"
    assert signatures.type_problems(target, (t,), {"dst_type": 290, "min_scale": 0}) == []
    assert signatures.type_problems(target, (t,), {"dst_type": "int8"}) == \
        [f"{target}: dst_type expects int, got 'int8'"]
    assert signatures.type_problems(target, (t,), {"dst_type": True}) == \
        [f"{target}: dst_type expects int, got True"]
    assert signatures.type_problems(target, (None,)) == [f"{target}: x expects Tensor, got None"]
    probs = signatures.type_problems(target, (t, 0.0))  # keyword-only passed positionally
    assert len(probs) == 1 and "too many positional arguments" in probs[0]
    probs = signatures.type_problems(target, (), {"min_scale": 1.0})
    assert len(probs) == 1 and "missing a required argument: 'x'" in probs[0]
    probs = signatures.type_problems("torch_npu.npu_sparse_flash_attention", (t, t, None, t, 1.0), {"sinks": 3})
    assert probs == ["torch_npu.npu_sparse_flash_attention: sinks expects Tensor?, got 3"]


# ------------------------------------------------------------------------------ the parsers


def test_parse_schema_hand_written():
    s = ("foo_(Tensor(a!) self, Tensor? w, SymInt[]? sizes=None, *, int n=3, float eps=1e-5, str mode='PA', "
         "bool flag=False, int? code=None, int big=9223372036854775807) -> (Tensor y, Tensor scale)")
    p = rec.parse_schema(s)
    assert p["name"] == "foo_" and p["returns"] == ["Tensor", "Tensor"]
    assert p["params"] == [
        {"name": "self", "type": "Tensor(a!)", "kind": "positional"},
        {"name": "w", "type": "Tensor?", "kind": "positional"},
        {"name": "sizes", "type": "SymInt[]?", "kind": "positional", "default": None},
        {"name": "n", "type": "int", "kind": "keyword_only", "default": 3},
        {"name": "eps", "type": "float", "kind": "keyword_only", "default": 1e-5},
        {"name": "mode", "type": "str", "kind": "keyword_only", "default": "PA"},
        {"name": "flag", "type": "bool", "kind": "keyword_only", "default": False},
        {"name": "code", "type": "int?", "kind": "keyword_only", "default": None},
        {"name": "big", "type": "int", "kind": "keyword_only", "default": 2**63 - 1},
    ]
    assert rec.parse_schema("bar(Tensor x) -> ()")["returns"] == []
    assert rec.parse_schema("baz(Tensor x) -> Tensor(a!)")["returns"] == ["Tensor(a!)"]
    with pytest.raises(ValueError, match="not a schema"):
        rec.parse_schema("no arrow(Tensor x)")


def test_extract_meta_functions_hand_written():
    src = '''
m = Library("npu", "IMPL", "Meta")

@impl(m, "op_a")
def op_a_meta(x, y, scale=1.0, *, mode="BSND", big=(1 << 63) - 1, opt=None):
    return x

@impl(m, "op_b")
def op_b_meta(q, k=None):
    return q

def helper(x):
    return x
'''
    out = rec.extract_meta_functions(src, ["op_a", "op_b"])
    assert out["op_a"]["line"] == 5 and out["op_b"]["line"] == 9
    assert out["op_a"]["params"] == [
        {"name": "x", "kind": "positional"},
        {"name": "y", "kind": "positional"},
        {"name": "scale", "kind": "positional", "default": 1.0},
        {"name": "mode", "kind": "keyword_only", "default": "BSND"},
        {"name": "big", "kind": "keyword_only", "default": 2**63 - 1},
        {"name": "opt", "kind": "keyword_only", "default": None},
    ]
    assert out["op_b"]["params"][1] == {"name": "k", "kind": "positional", "default": None}
    with pytest.raises(LookupError, match="op_c"):
        rec.extract_meta_functions(src, ["op_a", "op_c"])


def test_extract_schemas_takes_the_exact_name_and_the_first_line():
    text = ("custom:\n- func: op_a.overload(Tensor x) -> Tensor\n  impl_ns: op_api\n"
            "- exposed: true\n  func: op_a(Tensor x, *, int n=1) -> Tensor\n"
            "- func: op_a(Tensor x) -> Tensor\n")
    out = rec.extract_schemas(text, ["op_a"])
    assert out == {"op_a": {"line": 5, "schema": "op_a(Tensor x, *, int n=1) -> Tensor"}}
    with pytest.raises(LookupError):
        rec.extract_schemas(text, ["op_z"])


def test_extract_custom_ops_joins_cpp_string_literals():
    cpp = '''TORCH_LIBRARY_EXPAND(CONCAT(_C, _ascend), ops)
{
    ops.def(
        "other(Tensor x) -> Tensor"
    );
    ops.def(
        "npu_kv_quant_sparse_flash_attention(Tensor query,"
        "                                    float scale_value, *,"
        "                                    int tile_size=128,"
        "                                    bool return_softmax_lse=False)"
        " -> (Tensor attention_out, Tensor softmax_max, Tensor softmax_sum)"
    );
    ops.def(
        "kv_compress_epilog("
            "Tensor(a!) kv_compress_cache, "
            "int layout"
        ") -> ()"
    );
    ops.def(
        "indexer_compress_epilog_v2("
            "Tensor(a!) indexer_compress_cache, "
            "int layout=2"
        ") -> ()"
    );
    ops.def(
        "npu_vllm_quant_lightning_indexer("
            "Tensor query, str layout_key=\\"BSND\\", int cmp_ratio=1"
        ") -> (Tensor sparse_indices, Tensor sparse_values)"
    );
    ops.def(
        "npu_vllm_quant_lightning_indexer_metadata(int num_heads_q, str device=\\"npu\\") -> (Tensor metadata)"
    );
}
'''
    out = rec.extract_custom_ops(cpp, "abc123", names=rec.CUSTOM_OPS[:5])
    v = out["torch.ops._C_ascend.npu_vllm_quant_lightning_indexer"]["params"]
    assert v[1]["default"] == "BSND" and v[2]["default"] == 1  # C++ escaped quotes undone
    assert out["torch.ops._C_ascend.indexer_compress_epilog_v2"]["params"][1]["default"] == 2
    k = out["torch.ops._C_ascend.kv_compress_epilog"]
    assert k["schema"] == "kv_compress_epilog(Tensor(a!) kv_compress_cache, int layout) -> ()"
    assert [p["name"] for p in k["params"]] == ["kv_compress_cache", "layout"] and k["returns"] == []
    r = out["torch.ops._C_ascend.npu_kv_quant_sparse_flash_attention"]
    assert r["source"]["commit"] == "abc123" and r["source"]["line"] == 7
    assert r["schema"] == ("npu_kv_quant_sparse_flash_attention(Tensor query, float scale_value, *, "
                           "int tile_size=128, bool return_softmax_lse=False) -> "
                           "(Tensor attention_out, Tensor softmax_max, Tensor softmax_sum)")
    assert [p["name"] for p in r["params"]] == ["query", "scale_value", "tile_size", "return_softmax_lse"]
    assert r["returns"] == ["Tensor", "Tensor", "Tensor"]


def test_extract_dtype_tables_hand_written():
    src = ("import torch\nA = 1\nTORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP = {\n    1: torch.int8,\n"
           "    290: torch.uint8,\n}\nTORCH_NPU_DTYPE_TO_STRING_MAP = {290: 'torch_npu.hifloat8'}\n")
    t = rec.extract_dtype_tables(src)
    assert t["TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP"] == {"line": 3, "entries": {"1": "torch.int8",
                                                                                     "290": "torch.uint8"}}
    assert t["TORCH_NPU_DTYPE_TO_STRING_MAP"]["entries"] == {"290": "torch_npu.hifloat8"}


def test_hand_read_facts_of_the_qli2_and_qkv_package_schemas():
    """Read by hand from cannmirror/ops-transformer@25fb6b9 torch_extension/cann_ops_transformer/ops/
    quant_lightning_indexer.py (the same schema as at cbd7c6b, where the file was added) and from
    hicann/ops-transformer@c0dda0b qkv_rms_norm_rope_cache_with_k_scale.py (the same path; with the M-RoPE
    arguments)."""
    qli = signatures.record(mapping.QLI2_OP)
    assert qli["source"]["commit"].startswith("25fb6b9") and qli["returns"] == ["Tensor", "Tensor"]
    p = _params(mapping.QLI2_OP)
    assert [n for n, q in p.items() if q["kind"] == "positional"] == [
        "query", "key", "weights", "query_dequant_scale", "key_dequant_scale", "topk", "quant_mode"]
    assert {n: p[n]["default"] for n in ("max_seqlen_q", "layout_q", "layout_k", "mask_mode", "cmp_ratio",
                                          "return_value")} == dict(max_seqlen_q=-1, layout_q="BSND", layout_k="BSND",
                                                                   mask_mode=0, cmp_ratio=1, return_value=0)
    assert p["cmp_residual_k"] == {"name": "cmp_residual_k", "type": "Tensor?", "kind": "keyword_only", "default": None}
    meta = _params(mapping.QLI2_META_OP)
    assert [n for n, q in meta.items() if q["kind"] == "positional"] == [
        "num_heads_q", "num_heads_k", "head_dim", "topk", "quant_mode"]
    assert all(q["default"] is None for q in meta.values() if q["kind"] == "keyword_only")
    assert signatures.record(mapping.QLI2_META_OP)["returns"] == ["Tensor"]
    q = _params(mapping.QKV_OP)
    assert q["head_nums"]["type"] == "int[]" and q["epsilon"] == {"name": "epsilon", "type": "float",
                                                                  "kind": "keyword_only", "default": 1e-06}
    assert (q["layout_qkv"]["default"], q["layout_q_out"]["default"]) == ("TND", "NTD")
    assert signatures.record(mapping.QKV_OP)["returns"] == ["Tensor", "Tensor"]
    src = signatures.record(mapping.QKV_OP)["source"]
    assert (src["repo"], src["commit"][:7], src["line"]) == ("hicann/ops-transformer", "c0dda0b", 38)
    assert [(n, q[n]["type"], q[n]["default"]) for n in ("mrope_position", "mrope_section", "q_quant_mode",
                                                         "q_out_dtype")] == [
        ("mrope_position", "Tensor?", None), ("mrope_section", "int[]?", None),
        ("q_quant_mode", "str", "PerTokenPerHead"), ("q_out_dtype", "ScalarType?", None)]
    assert q["query_start_loc"]["type"] == q["seq_lens"]["type"] == "Tensor"  # not optional (docs/backends.md)


def test_int_list_schema_type():
    import torch

    t = torch.zeros(1)
    args = (t,) * 10
    assert signatures.type_problems(mapping.QKV_OP, args + ([16, 2, 2],)) == []
    assert signatures.type_problems(mapping.QKV_OP, args + ((16, 2, 2),)) == []
    assert signatures.type_problems(mapping.QKV_OP, args + ([16, True, 2],)) == [
        f"{mapping.QKV_OP}: head_nums expects int[], got [16, True, 2]"]
    assert signatures.type_problems(mapping.QKV_OP, args + (16,)) == [f"{mapping.QKV_OP}: head_nums expects int[], got 16"]


def test_extract_package_ops_names_the_repository_it_read():
    source = 'class B(OpBuilder):\n    def schema(self):\n        return "toy(Tensor(a!) s, int r) -> Tensor"\n'
    out = rec.extract_package_ops({"toy.py": source}, "abc", names={"toy": "toy.py"}, repo=rec.UPSTREAM_REPO)
    assert out["torch.ops.cann_ops_transformer.toy"]["source"]["repo"] == "hicann/ops-transformer"
    assert rec.extract_package_ops({"toy.py": source}, "abc", names={"toy": "toy.py"})[
        "torch.ops.cann_ops_transformer.toy"]["source"]["repo"] == rec.PACKAGE_REPO == "cannmirror/ops-transformer"
    assert set(rec.PACKAGE_OPS).isdisjoint(rec.UPSTREAM_PACKAGE_OPS)
