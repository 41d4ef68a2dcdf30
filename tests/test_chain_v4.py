"""DeepSeek-V4 layer chains v4-swa / v4-csa / v4-hca (qsfa.chain_v4), their golden sets v4-layer-*, ``compare
--chain`` on them, batch invariance and conformance over drawn V4 chains (docs/golden.md#deepseek-v4-layer-chains).

Independent checks: the 950 indexer's two views of indexer_compress_epilog_v2's cache are read here again from the
kernel's write addresses (K[row] at page_base + row * 128, scale[row] at page_base + block_size * 128 + row * 4;
vLLM-Ascend csrc/attention/indexer_compress_epilog_v2/op_kernel/indexer_compress_epilog_v2_single_row.h) and fed to
the indexer directly; the 950 window cache's 640-byte rows decode back to the bf16 rows within MXFP8's error.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import qsfa
from qsfa import chain as C
from qsfa import chain_v4 as V
from qsfa.cli import main
from qsfa.golden.generators import get_generator
from qsfa.strategies.chain import chain_cases

DECODE = {"q_lens": [1, 1, 1], "kv_lens": [37, 20, 64], "block_size": 16}
PREFILL = {"q_lens": [5, 3], "kv_lens": [5, 24], "block_size": 16}
PATHS = (("bf16", "A3"), ("fp8", "950"))


def case(kind, shape, path, chip, seed=1):
    p = dict(shape, path=path, chip=chip)
    return p, get_generator(f"v4-{kind}")(p, np.random.default_rng(seed)), C.get_chain(f"v4-{kind}", p,
                                                                                         ignore_unknown=True)


def u8(a):
    return np.ascontiguousarray(a).view(np.uint8)


def test_links_and_operators_per_kind_and_path():
    want = {
        ("swa", "bf16"): [("ori_cache", "scatter_by_slot"), ("attention", "sparse_attn_sharedkv")],
        ("hca", "bf16"): [("ori_cache", "scatter_by_slot"), ("cmp_cache", "scatter_by_slot"),
                          ("attention", "sparse_attn_sharedkv")],
        ("csa", "bf16"): [("ori_cache", "scatter_by_slot"), ("cmp_cache", "scatter_by_slot"),
                          ("index_cache", "scatter_by_slot"), ("index_scale", "scatter_by_slot"),
                          ("indexer", "vllm_quant_lightning_indexer"), ("attention", "sparse_attn_sharedkv")],
        ("swa", "fp8"): [("ori_cache", "kv_compress_epilog_vllm"), ("attention", "kv_quant_sparse_attn_sharedkv")],
        ("hca", "fp8"): [("ori_cache", "kv_compress_epilog_vllm"), ("cmp_cache", "kv_compress_epilog_vllm"),
                         ("attention", "kv_quant_sparse_attn_sharedkv")],
        ("csa", "fp8"): [("ori_cache", "kv_compress_epilog_vllm"), ("cmp_cache", "kv_compress_epilog_vllm"),
                         ("index_cache", "indexer_compress_epilog_v2"), ("indexer", "vllm_quant_lightning_indexer"),
                         ("attention", "kv_quant_sparse_attn_sharedkv")],
    }
    for (kind, path), links in want.items():
        ch = C.get_chain(f"v4-{kind}", {"path": path})
        assert [(lk.name, lk.op) for lk in ch.links] == links, (kind, path)
        att = ch.links[-1].args
        assert att["cmp_ratio"] == V.RATIOS[kind] and att["layout_kv"] == "PA_ND"
        if kind != "swa":  # where a compressor link will plug in: the compressed rows of link cmp_cache
            cmp = next(lk for lk in ch.links if lk.name == "cmp_cache")
            assert ["input.cmp_kv_rows", "cmp_cache", "x" if path == "fp8" else "rows"] in ch.edges()
            assert V.CMP_ROWS in json.dumps(cmp.args)
        if kind == "csa":
            assert ["indexer.sparse_indices", "attention", "cmp_sparse_indices"] in ch.edges()
            assert ch.links[-2].args["cmp_ratio"] == 4
    with pytest.raises(C.ChainError, match="Invalid value for path, actual: 'fp4'"):
        C.get_chain("v4-csa", {"path": "fp4"})


def test_the_950_indexer_reads_the_codes_and_scales_regions_of_one_byte_cache():
    """The indexer's key and key scale views equal the regions the kernel writes (codes of every slot of a block,
    then their fp32 scales), and the indexer called directly on those regions gives the chain's indices."""
    p, x, ch = case("csa", DECODE, "fp8", "950")
    v = C.run_chain(ch, x, chip="950")
    cache = v["index_cache.indexer_compress_cache"]
    bs = 16
    raw = cache.reshape(cache.shape[0], -1)
    codes = raw[:, :bs * 128].reshape(-1, bs, 1, 128).view(ml_dtypes.float8_e4m3fn)
    scales = np.ascontiguousarray(raw[:, bs * 128:bs * 132]).view("<f4").reshape(-1, bs, 1)
    # a slot written this step: its codes times its scale give back the bf16 key row within FP8's error
    t = int(np.nonzero(x["cmp_slot_mapping"] >= 0)[0][0])
    s = int(x["cmp_slot_mapping"][t])
    back = codes[s // bs, s % bs, 0].astype(np.float32) * scales[s // bs, s % bs, 0]
    want = x["index_k_rows"][t].astype(np.float32)
    assert np.abs(back - want).max() <= np.abs(want).max() * 2.0 ** -4
    idx, _ = qsfa.vllm_quant_lightning_indexer(
        x["index_query"], codes, x["index_weights"], x["index_query_scale"], scales,
        actual_seq_lengths_query=x["actual_seq_lengths_query"], actual_seq_lengths_key=x["seqused_kv"],
        block_table=x["cmp_block_table"], layout_query="TND", layout_key="PA_BSND", sparse_count=512,
        cmp_ratio=4, chip="950")
    assert u8(idx).tobytes() == u8(v["indexer.sparse_indices"]).tobytes()
    assert (v["indexer.sparse_indices"][:, 0, :1] >= 0).all()


def test_the_950_window_cache_rows_decode_back_to_the_kv_rows():
    """kv_compress_epilog_vllm's 640-byte rows are what kv_quant_sparse_attn_sharedkv reads: RoPE bf16 exact, NoPE
    within MXFP8 (E4M3 codes, power-of-two group scale) of the bf16 row."""
    from qsfa.reference.sharedkv import dequant_640

    p, x, ch = case("swa", DECODE, "fp8", "950")
    v = C.run_chain(ch, x, chip="950")
    rows = v["ori_cache.kv_compress_cache"][x["slot_mapping"], 0]
    back = dequant_640(rows).astype(np.float32)
    want = x["kv_rows"].astype(np.float32)
    assert (back[:, 448:] == want[:, 448:]).all()
    groups = np.abs(want[:, :448]).reshape(-1, 7, 64).max(-1, keepdims=True)
    assert (np.abs(back[:, :448] - want[:, :448]).reshape(-1, 7, 64) <= groups * 2.0 ** -3).all()


def test_the_a3_caches_hold_the_rows_and_the_history():
    p, x, ch = case("csa", PREFILL, "bf16", "A3")
    v = C.run_chain(ch, x, chip="A3")
    s = x["slot_mapping"]
    assert u8(v["ori_cache.cache"][s // 16, s % 16, 0]).tobytes() == u8(x["kv_rows"]).tobytes()
    # request 0's 5 tokens complete compressed token 0, request 1's tokens 21..23 its token 5: two rows
    cs = x["cmp_slot_mapping"]
    assert cs.shape == (2,) and (cs >= 0).all()
    assert cs.tolist() == [int(x["cmp_block_table"][0, 0]) * 16, int(x["cmp_block_table"][1, 0]) * 16 + 5]
    assert u8(v["cmp_cache.cache"][cs // 16, cs % 16, 0]).tobytes() == u8(x["cmp_kv_rows"]).tobytes()
    assert u8(v["index_cache.cache"][cs // 16, cs % 16]).tobytes() == u8(x["index_k_rows"]).tobytes()
    assert u8(v["index_scale.cache"][cs // 16, cs % 16]).tobytes() == u8(x["index_k_scale_rows"]).tobytes()
    # the history: request 1's compressed tokens 0..4 were in the caches already, unchanged
    hist = x["cmp_block_table"][1, 0] * 16 + np.arange(5)
    assert u8(v["cmp_cache.cache"][hist // 16, hist % 16]).tobytes() == \
        u8(x["cmp_cache"][hist // 16, hist % 16]).tobytes()
    assert np.abs(x["cmp_cache"][hist // 16, hist % 16].astype(np.float32)).min(-1).max() > 0  # written, not zeros


def test_a_decode_step_writes_one_compressed_row_per_request_or_skips_it():
    """Decode: one row per request, slot -1 where the new length is no multiple of cmp_ratio (kv 37: none; 20 and
    64: compressed tokens 4 and 15)."""
    for path, chip in PATHS:
        p, x, ch = case("csa", DECODE, path, chip)
        cs = x["cmp_slot_mapping"]
        t = x["cmp_block_table"]
        assert cs.tolist() == [-1, int(t[1, 0]) * 16 + 4, int(t[2, 0]) * 16 + 15], path
        v = C.run_chain(ch, x, chip=chip)
        assert v["attention.attention_out"].shape == (3, 64, 512)
