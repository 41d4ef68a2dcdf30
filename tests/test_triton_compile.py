"""The Triton kernels compile for a real GPU target (sm_90, Hopper) without a GPU present.

The interpreter (which the other test_triton* modules use) executes the kernels as Python, so code that
only the compiler rejects - a name bound in one static branch and read in another, a dtype mismatch in
a loop-carried value, a tile that exceeds shared memory - would pass there and fail on a device.
This module compiles the kernels ahead of time with triton's bundled ptxas in a subprocess (the kernels
must be imported *without* TRITON_INTERPRET), and checks the default GPU tiling of the attention kernel
for register spills with triton's bundled cuobjdump (a spilling default would be a performance bug).
Skipped where triton has no NVIDIA backend or tools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _triton_env import require_triton

require_triton()

pytestmark = pytest.mark.triton

_SCRIPT = r'''
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qsfa.kernels import c8_cache_writer as W, lse_merge as M, qsfa_attention as A, qsfa_split as S

target = GPUTarget("cuda", 90, 32)
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

def usage(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                         capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    line = [l for l in out.splitlines() if "REG:" in l][-1]
    fields = dict(x.split(":") for x in line.split() if ":" in x)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": k.metadata.shared}

def compile_attn(cfg, is_bf16=True, rope=True, pa=True, fmt=0, sbs=1, lse=True, normalised=False, split=0):
    qdt = "*bf16" if is_bf16 else "*fp16"
    sig = dict(q_ptr=qdt, stride_qr="i64", stride_qh="i64", kv_i8_ptr="*i8", kv_16_ptr=qdt, kv_f32_ptr="*fp32",
               tab_ptr="*fp32",
               stride_kb="i64", stride_kt="i64", bt_ptr="*i32", stride_bt="i32", idx_ptr="*i32", stride_ir="i32",
               meta_ptr="*i64", out_ptr=qdt, stride_or="i32", stride_oh="i32", max_ptr="*fp32", sum_ptr="*fp32",
               scale_value="fp32", Q_N="i32", block_size="i32")
    # what the JIT specialises at a real launch: 16-aligned pointers, 16-divisible strides and sizes
    div16 = [n for n in sig if sig[n].startswith("*") or n in ("stride_qr", "stride_qh", "stride_kb", "stride_kt",
             "stride_ir", "stride_or", "stride_oh", "Q_N", "block_size")]
    const = dict(SBS=sbs, SCALE_IDX=160 if rope else 128, IS_PA=pa, HAS_ROPE=rope, IS_BF16=is_bf16, Q_ROUND=1,
                 P_ROUND=1, O_ROUND=1, KEY_FMT=fmt, TWO_PASS=cfg.two_pass or normalised, P_NORMALISED=normalised, WRITE_LSE=lse,
                 DOT_F32=False, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_DV=cfg.block_dv)
    if split:
        sig.update(ws_ml_ptr="*fp32", ws_acc_ptr="*fp32")
        const.update(SPLIT=split, NS=8, CHUNK=256)
    else:  # an unsplit launch leaves the workspace pointers at their default None
        const.update(ws_ml_ptr=None, ws_acc_ptr=None, SPLIT=0, NS=1, CHUNK=0)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=A.qsfa_attention_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                                           enable_fp_fusion=False))

def compile_c8(bf16, rope, order, fp8):
    sig = dict(nope_ptr="*bf16" if bf16 else "*fp16", stride_nt="i32", stride_nd="i32", rope_ptr="*u8",
               stride_rt="i32", slot_ptr="*i64", cache_ptr="*u8", stride_cb="i64", stride_cr="i32",
               stride_cc="i32", block_size="i32")
    const = dict(HAS_ROPE=rope, ORDER=order, IS_BF16=bf16, FP8=fp8)
    sig.update({k: "constexpr" for k in const})
    return triton.compile(ASTSource(fn=W.c8_cache_write_kernel, signature=sig, constexprs=const), target=target,
                          options=dict(num_warps=4, enable_fp_fusion=False))

res = {}
for args in [(True, True, 0, False), (False, False, 1, True), (True, True, 2, False), (False, True, 3, True)]:
    res["c8 %s" % (args,)] = usage(compile_c8(*args))
res["attn default"] = usage(compile_attn(A.default_config(128)))
res["attn fp16 fp8 rope0 BSND sbs16 normalised q_n 8"] = usage(compile_attn(
    A.default_config(8), is_bf16=False, rope=False, pa=False, fmt=1, sbs=16, lse=False, normalised=True))
res["attn hifloat8 default"] = usage(compile_attn(A.default_config(128), fmt=2))

def compile_merge(kind, stat64):
    odt = {0: "*bf16", 1: "*fp16", 2: "*fp32", 3: "*fp64"}[kind]
    sdt = "*fp64" if stat64 else "*fp32"
    sig = dict(o_ptr=odt, m_ptr=sdt, l_ptr=sdt, res_ptr=odt, res_m_ptr=sdt, res_l_ptr=sdt, P="i32", R="i32", D="i32")
    const = dict(OUT_KIND=kind, STAT_F64=stat64, BLOCK_D=512)
    sig.update({k: "constexpr" for k in const})
    return triton.compile(ASTSource(fn=M.merge_lse_kernel, signature=sig, constexprs=const), target=target,
                          options=dict(num_warps=4, enable_fp_fusion=False))

cfg2 = A.default_config(128)
cfg2.two_pass = True
res["attn two-pass default tiling"] = usage(compile_attn(cfg2))
for sp, two in ((1, True), (2, True), (3, False)):
    cfg = A.default_config(128)
    cfg.two_pass = two
    cfg.block_dv = cfg.split_block_dv  # the launcher's split programs use split_block_dv
    res["attn split %d" % sp] = usage(compile_attn(cfg, split=sp))

def compile_combine(two_pass, normalised):
    cfg = A.default_config(128)
    sig = dict(ws_ml_ptr="*fp32", ws_acc_ptr="*fp32", out_ptr="*bf16", stride_or="i32", stride_oh="i32",
               max_ptr="*fp32", sum_ptr="*fp32", Q_N="i32")
    const = dict(NS=8, RESCALE=not two_pass, P_NORMALISED=normalised, IS_BF16=True, O_ROUND=0, WRITE_LSE=True,
                 BLOCK_H=cfg.block_h, BLOCK_DV=cfg.split_block_dv)
    sig.update({k: "constexpr" for k in const})
    return triton.compile(ASTSource(fn=S.split_combine_kernel, signature=sig, constexprs=const), target=target,
                          options=dict(num_warps=cfg.num_warps, enable_fp_fusion=False))

res["split combine"] = usage(compile_combine(False, False))
res["split combine normalised"] = usage(compile_combine(True, True))

for kind in range(4):
    km = compile_merge(kind, kind == 3)
    res["merge %d" % kind] = usage(km)
    ptx = km.asm["ptx"]
    # float64 exp from libdevice (not the approximate fp32 ex2), IEEE float64 division and RNE narrowing
    res["merge %d" % kind]["ptx_ok"] = ("__nv_exp" in ptx and "ex2.approx" not in ptx and "div.rn.f64" in ptx
                                       and "div.full" not in ptx and "div.approx" not in ptx)
print("RESULT " + json.dumps(res))
'''


def _tools_present() -> bool:
    import triton

    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(d, t)) for t in ("ptxas", "cuobjdump"))


def test_kernels_compile_for_sm90_without_spilling_by_default():
    if not _tools_present():
        pytest.skip("triton's NVIDIA backend tools (ptxas, cuobjdump) are not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    for name, u in res.items():
        assert u["shared"] <= 227 * 1024, f"{name}: {u['shared']} bytes of shared memory exceed sm_90's 227 KiB"
    # the default tiling (one-pass and two-pass), its HiFloat8 variant and every phase of the split-KV path
    for name in ("attn default", "attn hifloat8 default", "attn two-pass default tiling", "attn split 1",
                 "attn split 2", "attn split 3"):
        assert res[name]["stack"] == 0, f"{name}: the default decode tiling spills registers: {res[name]}"
    for name, u in res.items():
        if name.startswith("merge"):
            assert u["ptx_ok"], f"{name}: the merge kernel must use libdevice exp and div.rn.f64 (lse_merge.py)"
        if name.startswith(("c8", "merge", "split")):
            assert u["stack"] == 0, f"{name} spills: {u}"
