"""Regenerate ``qsfa/npu/signatures.json`` from an unpacked torch_npu wheel (and, optionally, vLLM-Ascend).

The npu backend calls a handful of torch_npu functions, vLLM-Ascend custom ops and ops of ops-transformer's
``cann_ops_transformer`` package. Their signatures
are recorded as data so the argument mappings in :mod:`qsfa.npu.mapping` can be checked on machines
without torch_npu (``inspect.Signature.bind`` on a signature rebuilt from the record).

Procedure (no torch or torch_npu import is needed; the files are parsed as text):

1. ``pip download --no-deps torch-npu==2.14.0`` (any platform tag) and unpack the two files we read::

       unzip -o torch_npu-2.14.0-*.whl 'torch_npu/op_plugin/meta/_meta_registrations.py' \\
             'torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml' -d /tmp/npuwheel

2. ``python -m qsfa.npu._record_signatures /tmp/npuwheel/torch_npu [--wheel-name NAME]``
   rewrites the torch_npu part of ``signatures.json``: for every function in :data:`TORCH_NPU_FUNCTIONS`
   the Python signature of its meta registration (``@impl(m, "<name>")`` in
   ``op_plugin/meta/_meta_registrations.py``: parameter order, keyword-only, defaults, line number) and
   the typed schema of the same function in ``csrc/aten/npu_native_functions_by_codegen.yaml`` (types,
   return tuple, line number); plus the dtype code tables of the meta file.

3. The vLLM-Ascend custom-op part is kept as it is unless ``--vllm-binding FILE --vllm-commit SHA`` is
   given: FILE is ``csrc/torch_binding.cpp`` of a vLLM-Ascend checkout at commit SHA, whose
   ``ops.def("...")`` schema strings are parsed for :data:`CUSTOM_OPS`.

4. The ``cann_ops_transformer`` part (ops-transformer's ``torch_extension`` package) is kept as it is unless
   ``--ops-transformer DIR --ops-transformer-commit SHA`` is given: DIR is an ops-transformer checkout at SHA;
   the schema strings returned by each OpBuilder's ``schema()`` in ``torch_extension/cann_ops_transformer/ops/``
   are parsed for :data:`PACKAGE_OPS`. Likewise ``--upstream-ops-transformer DIR SHA`` (a hicann/ops-transformer
   checkout at SHA; repeatable) for the ops of :data:`UPSTREAM_PACKAGE_OPS` whose file DIR has; records not
   re-read are kept as they are.

``tests/test_npu_signatures.py`` re-runs step 2 against ``/tmp/npuwheel/torch_npu`` (or
``$QSFA_TORCH_NPU_DIR``) when it exists and fails if the recorded data is not current.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path

__all__ = [
    "TORCH_NPU_FUNCTIONS",
    "CUSTOM_OPS",
    "META_FILE",
    "SCHEMA_FILE",
    "parse_schema",
    "extract_meta_functions",
    "extract_schemas",
    "extract_dtype_tables",
    "extract_torch_npu",
    "extract_custom_ops",
    "extract_package_ops",
    "PACKAGE_OPS",
    "PACKAGE_NAMESPACE",
    "PACKAGE_REPO",
    "UPSTREAM_REPO",
    "UPSTREAM_PACKAGE_OPS",
    "main",
]

#: torch_npu functions the npu backend maps to.
TORCH_NPU_FUNCTIONS = (
    "npu_kv_quant_sparse_flash_attention",
    "npu_sparse_flash_attention",
    "npu_lightning_indexer",
    "npu_quant_lightning_indexer",
    "npu_dynamic_block_quant",
    "npu_kv_rmsnorm_rope_cache",
    "npu_kv_rmsnorm_rope_cache_v2",
    "npu_scatter_nd_update_",
)

#: vLLM-Ascend custom ops (namespace ``_C_ascend``) the npu backend maps to.
CUSTOM_OPS = ("npu_kv_quant_sparse_flash_attention", "kv_compress_epilog", "indexer_compress_epilog_v2",
              "npu_vllm_quant_lightning_indexer", "npu_vllm_quant_lightning_indexer_metadata",
              "npu_sparse_attn_sharedkv", "npu_sparse_attn_sharedkv_metadata", "npu_kv_quant_sparse_attn_sharedkv",
              "npu_kv_quant_sparse_attn_sharedkv_metadata", "compressor")

#: namespace of the ops of ops-transformer's separately built ``cann_ops_transformer`` package
PACKAGE_NAMESPACE = "cann_ops_transformer"
#: its ops the npu backend maps to: op name -> the file under ``torch_extension/cann_ops_transformer/ops/`` whose
#: OpBuilder ``schema()`` defines it
PACKAGE_OPS = {
    "sparse_flash_mla": "sparse_flash_mla.py",
    "sparse_flash_mla_metadata": "sparse_flash_mla.py",
    "mixed_quant_sparse_flash_mla": "mixed_quant_sparse_flash_mla.py",
    "mixed_quant_sparse_flash_mla_metadata": "mixed_quant_sparse_flash_mla.py",
    "indexer_quant_cache": "indexer_quant_cache.py",
    "scatter_pa_kv_cache_with_k_scale": "scatter_pa_kv_cache_with_k_scale.py",
    "quant_lightning_indexer": "quant_lightning_indexer.py",
    "quant_lightning_indexer_metadata": "quant_lightning_indexer.py",
    "compressor": "compressor.py",
}
PACKAGE_OPS_DIR = "torch_extension/cann_ops_transformer/ops"
#: the repository the PACKAGE_OPS schemas are read from
PACKAGE_REPO = "cannmirror/ops-transformer"
#: ops of the same package whose OpBuilder file exists only in the upstream repository (not in the cannmirror
#: snapshot the rest is recorded from), or whose newer schema is read there (qkv_rms_norm_rope_cache_with_k_scale_,
#: with its M-RoPE arguments): op name -> file, read from :data:`UPSTREAM_REPO` checkouts (each op from the
#: checkout that has its file; they may be at different commits)
UPSTREAM_REPO = "hicann/ops-transformer"
UPSTREAM_PACKAGE_OPS = {
    "quant_compressor": "quant_compressor.py",
    "quant_sparse_flash_mla": "quant_sparse_flash_mla.py",
    "quant_sparse_flash_mla_metadata": "quant_sparse_flash_mla.py",
    "qkv_rms_norm_rope_cache_with_k_scale_": "qkv_rms_norm_rope_cache_with_k_scale.py",  # with the M-RoPE arguments
}

META_FILE = "op_plugin/meta/_meta_registrations.py"
SCHEMA_FILE = "csrc/aten/npu_native_functions_by_codegen.yaml"
DEFAULT_WHEEL = "torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl"
JSON_PATH = Path(__file__).with_name("signatures.json")

# ------------------------------------------------------------------------------ schema strings


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        parts.append(tail)
    return parts


def _parse_default(text: str):
    text = text.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_schema(schema: str) -> dict:
    """Parse a torch operator schema ``name(Type a, *, Type? b=None) -> (Tensor x, Tensor y)``.

    Returns ``{"name", "params": [{"name", "type", "kind", "default"?}], "returns": [types]}`` where kind
    is "positional" (may also be passed by keyword) or "keyword_only"; alias annotations such as
    ``Tensor(a!)`` are kept in "type" (they mark in-place arguments).
    """
    m = re.fullmatch(r"\s*([\w.]+)\((.*)\)\s*->\s*(.+?)\s*", schema, flags=re.S)
    if not m:
        raise ValueError(f"not a schema: {schema!r}")
    name, arg_text, ret_text = m.groups()
    params, kind = [], "positional"
    for item in _split_top_level(arg_text):
        if item == "*":
            kind = "keyword_only"
            continue
        decl, eq, default = item.partition("=")
        typ, _, pname = decl.strip().rpartition(" ")
        p = {"name": pname, "type": typ.strip(), "kind": kind}
        if eq:
            p["default"] = _parse_default(default)
        params.append(p)
    ret_text = ret_text.strip()
    if ret_text.startswith("(") and ret_text.endswith(")"):
        ret_text = ret_text[1:-1]
    returns = [r.strip().split(" ")[0] for r in _split_top_level(ret_text)] if ret_text else []
    return {"name": name, "params": params, "returns": returns}


# ------------------------------------------------------------------------------ torch_npu wheel


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.LShift: lambda a, b: a << b, ast.Pow: lambda a, b: a ** b}


def _literal(node):
    """A default value: a literal, or constant integer arithmetic such as ``(1 << 63) - 1``."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _literal(node.left), _literal(node.right)
        if isinstance(left, int) and isinstance(right, int):
            return _BINOPS[type(node.op)](left, right)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def extract_meta_functions(meta_source: str, names) -> dict:
    """Python signatures of the ``@impl(m, "<name>")`` meta registrations for ``names``."""
    tree = ast.parse(meta_source)
    wanted = set(names)
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "impl" and len(dec.args) == 2
                    and isinstance(dec.args[1], ast.Constant) and dec.args[1].value in wanted):
                op = dec.args[1].value
                a = node.args
                params = []
                pos = a.posonlyargs + a.args
                first_default = len(pos) - len(a.defaults)
                for i, arg in enumerate(pos):
                    p = {"name": arg.arg, "kind": "positional"}
                    if i >= first_default:
                        p["default"] = _literal(a.defaults[i - first_default])
                    params.append(p)
                for arg, d in zip(a.kwonlyargs, a.kw_defaults):
                    p = {"name": arg.arg, "kind": "keyword_only"}
                    if d is not None:
                        p["default"] = _literal(d)
                    params.append(p)
                out[op] = {"line": node.lineno, "python_name": node.name, "params": params}
    missing = wanted - set(out)
    if missing:
        raise LookupError(f"no meta registration for {sorted(missing)}")
    return out


def extract_schemas(yaml_text: str, names) -> dict:
    """First ``func: <name>(...)`` schema line of each name in the codegen yaml (exact name, no overload)."""
    out = {}
    for lineno, line in enumerate(yaml_text.splitlines(), start=1):
        m = re.match(r"\s*(?:-\s*)?func:\s*(([\w.]+)\(.*)$", line)
        if m and m.group(2) in names and m.group(2) not in out:
            out[m.group(2)] = {"line": lineno, "schema": m.group(1).strip()}
    missing = set(names) - set(out)
    if missing:
        raise LookupError(f"no schema for {sorted(missing)}")
    return out


def extract_dtype_tables(meta_source: str) -> dict:
    """The dtype code tables of the meta file (integer code -> dtype expression / torch_npu dtype name)."""
    tree = ast.parse(meta_source)
    tables = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Dict):
            name = getattr(node.targets[0], "id", None)
            if name in ("TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP", "TORCH_NPU_DTYPE_TO_STRING_MAP"):
                entries = {str(_literal(k)): (v.value if isinstance(v, ast.Constant) else ast.unparse(v))
                           for k, v in zip(node.value.keys, node.value.values)}
                tables[name] = {"line": node.lineno, "entries": entries}
    return tables


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def extract_torch_npu(root, wheel_name: str = DEFAULT_WHEEL, names=TORCH_NPU_FUNCTIONS) -> dict:
    """The torch_npu part of the record, read from an unpacked wheel's ``torch_npu`` folder ``root``."""
    root = Path(root)
    meta = (root / META_FILE).read_text(encoding="utf-8")
    yaml_text = (root / SCHEMA_FILE).read_text(encoding="utf-8")
    metas = extract_meta_functions(meta, names)
    schemas = extract_schemas(yaml_text, names)
    functions = {}
    for name in names:
        parsed = parse_schema(schemas[name]["schema"])
        types = {p["name"]: p["type"] for p in parsed["params"]}
        params = []
        for p in metas[name]["params"]:
            q = {"name": p["name"], "type": types.get(p["name"]), "kind": p["kind"]}
            if "default" in p:
                q["default"] = p["default"]
            params.append(q)
        functions[f"torch_npu.{name}"] = {
            "source": {
                "origin": "torch_npu wheel",
                "file": f"torch_npu/{META_FILE}",
                "line": metas[name]["line"],
                "schema_file": f"torch_npu/{SCHEMA_FILE}",
                "schema_line": schemas[name]["line"],
            },
            "schema": schemas[name]["schema"],
            "params": params,
            "returns": parsed["returns"],
        }
    version = re.search(r"torch_npu-([\w.+]+?)-", wheel_name)
    return {
        "torch_npu": {
            "version": version.group(1) if version else None,
            "wheel": wheel_name,
            "meta_file": f"torch_npu/{META_FILE}",
            "meta_sha256": _sha256(meta),
            "schema_file": f"torch_npu/{SCHEMA_FILE}",
            "schema_sha256": _sha256(yaml_text),
        },
        "dtype_tables": extract_dtype_tables(meta),
        "functions": functions,
    }


# ------------------------------------------------------------------------------ vLLM-Ascend


def _cpp_string_concat(text: str) -> str:
    # C++ escapes inside the literals (\" around a string default) are undone
    return re.sub(r"\\(.)", r"\1", "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', text)))


def extract_custom_ops(binding_source: str, commit: str, names=CUSTOM_OPS,
                       path: str = "csrc/torch_binding.cpp") -> dict:
    """Schemas of ``ops.def("...")`` entries for ``names`` in vLLM-Ascend's ``csrc/torch_binding.cpp``."""
    out = {}
    for m in re.finditer(r"ops\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)\)", binding_source):
        schema = re.sub(r"\s+", " ", _cpp_string_concat(m.group(1))).strip()
        schema = re.sub(r"\(\s+", "(", schema)
        op = schema.split("(", 1)[0].strip()
        if op in names and op not in out:
            line = binding_source.count("\n", 0, m.start(1)) + 1  # line of the schema's first literal
            parsed = parse_schema(schema)
            out[f"torch.ops._C_ascend.{op}"] = {
                "source": {"origin": "vLLM-Ascend custom op (TORCH_LIBRARY _C_ascend)",
                           "repo": "vllm-project/vllm-ascend", "commit": commit, "file": path, "line": line},
                "schema": schema,
                "params": parsed["params"],
                "returns": parsed["returns"],
            }
    missing = {f"torch.ops._C_ascend.{n}" for n in names} - set(out)
    if missing:
        raise LookupError(f"no ops.def schema for {sorted(missing)}")
    return out


# ------------------------------------------------------------------------------ cann_ops_transformer


def _schema_strings(py_source: str):
    """``(line, schema)`` of every string a ``def schema(self)`` method returns (a string or a list of them;
    Python's implicit concatenation of adjacent literals is resolved by the parser)."""
    for node in ast.walk(ast.parse(py_source)):
        if not (isinstance(node, ast.FunctionDef) and node.name == "schema"):
            continue
        for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None):
            items = ret.value.elts if isinstance(ret.value, (ast.List, ast.Tuple)) else [ret.value]
            for item in items:
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    yield item.lineno, item.value


def extract_package_ops(sources: dict, commit: str, names=PACKAGE_OPS, repo: str = PACKAGE_REPO) -> dict:
    """Schemas of the ``cann_ops_transformer`` ops ``names`` (op -> file name) from ``sources`` (file name -> the
    text of ``torch_extension/cann_ops_transformer/ops/<file>`` at ``repo``'s ``commit``)."""
    out = {}
    for op, fname in names.items():
        for line, text in _schema_strings(sources[fname]):
            schema = re.sub(r"\s+", " ", text).strip()
            schema = re.sub(r"\(\s+", "(", schema)
            schema = re.sub(r",(?=\S)", ", ", schema)
            if schema.split("(", 1)[0].strip() != op:
                continue
            parsed = parse_schema(schema)
            out[f"torch.ops.{PACKAGE_NAMESPACE}.{op}"] = {
                "source": {"origin": "ops-transformer torch_extension package cann_ops_transformer (OpBuilder.schema)",
                           "repo": repo, "commit": commit,
                           "file": f"{PACKAGE_OPS_DIR}/{fname}", "line": line},
                "schema": schema,
                "params": parsed["params"],
                "returns": parsed["returns"],
            }
            break
    missing = {f"torch.ops.{PACKAGE_NAMESPACE}.{n}" for n in names} - set(out)
    if missing:
        raise LookupError(f"no OpBuilder schema for {sorted(missing)}")
    return out


# ------------------------------------------------------------------------------ command line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("torch_npu_dir", help="the torch_npu folder of an unpacked torch_npu wheel")
    ap.add_argument("--wheel-name", default=DEFAULT_WHEEL, help="file name of the wheel it came from")
    ap.add_argument("--vllm-binding", help="csrc/torch_binding.cpp of a vLLM-Ascend checkout")
    ap.add_argument("--vllm-commit", help="the commit that file was read at")
    ap.add_argument("--ops-transformer", help="an ops-transformer checkout (for the cann_ops_transformer ops)")
    ap.add_argument("--ops-transformer-commit", help="the commit that checkout is at")
    ap.add_argument("--upstream-ops-transformer", nargs=2, action="append", default=[], metavar=("DIR", "SHA"),
                    help=f"a {UPSTREAM_REPO} checkout and its commit (for UPSTREAM_PACKAGE_OPS; repeatable)")
    ap.add_argument("--out", default=str(JSON_PATH))
    ns = ap.parse_args(argv)
    old = json.loads(Path(ns.out).read_text()) if Path(ns.out).exists() else {}
    rec = extract_torch_npu(ns.torch_npu_dir, ns.wheel_name)
    kept = old.get("functions", {})
    custom = {k: v for k, v in kept.items() if k.startswith("torch.ops._C_ascend.")}
    package = {k: v for k, v in kept.items() if k.startswith(f"torch.ops.{PACKAGE_NAMESPACE}.")}
    if ns.vllm_binding:
        if not ns.vllm_commit:
            ap.error("--vllm-commit is required with --vllm-binding")
        custom = extract_custom_ops(Path(ns.vllm_binding).read_text(encoding="utf-8"), ns.vllm_commit)
    if ns.ops_transformer:
        if not ns.ops_transformer_commit:
            ap.error("--ops-transformer-commit is required with --ops-transformer")
        root = Path(ns.ops_transformer) / PACKAGE_OPS_DIR
        package = {k: v for k, v in package.items() if v["source"]["repo"] != PACKAGE_REPO}
        package.update(extract_package_ops({f: (root / f).read_text(encoding="utf-8") for f in set(PACKAGE_OPS.values())},
                                           ns.ops_transformer_commit))
    for checkout, commit in ns.upstream_ops_transformer:
        root = Path(checkout) / PACKAGE_OPS_DIR
        names = {op: f for op, f in UPSTREAM_PACKAGE_OPS.items() if (root / f).exists()}
        if not names:
            ap.error(f"{checkout} has none of the files of UPSTREAM_PACKAGE_OPS under {PACKAGE_OPS_DIR}")
        package.update(extract_package_ops({f: (root / f).read_text(encoding="utf-8") for f in set(names.values())},
                                           commit, names, UPSTREAM_REPO))
    if not custom:
        ap.error("no vLLM-Ascend custom-op record yet: pass --vllm-binding and --vllm-commit")
    if not package:
        ap.error("no cann_ops_transformer record yet: pass --ops-transformer and --ops-transformer-commit")
    rec["functions"].update(custom)
    rec["functions"].update(package)
    rec = {"generated_by": "python -m qsfa.npu._record_signatures (see its docstring)", **rec}
    Path(ns.out).write_text(json.dumps(rec, indent=1, sort_keys=False) + "\n")
    print(f"wrote {ns.out}: {len(rec['functions'])} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
