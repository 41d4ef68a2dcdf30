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
from _golden_cli import cli, actual_copy

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
        ("hca", "bf16"): [("compressor", "vllm_compressor"), ("ori_cache", "scatter_by_slot"),
                          ("cmp_cache", "scatter_by_slot"), ("attention", "sparse_attn_sharedkv")],
        ("csa", "bf16"): [("compressor", "vllm_compressor"), ("ori_cache", "scatter_by_slot"),
                          ("cmp_cache", "scatter_by_slot"), ("index_cache", "scatter_by_slot"),
                          ("index_scale", "scatter_by_slot"),
                          ("indexer", "vllm_quant_lightning_indexer"), ("attention", "sparse_attn_sharedkv")],
        ("swa", "fp8"): [("ori_cache", "kv_compress_epilog_vllm"), ("attention", "kv_quant_sparse_attn_sharedkv")],
        ("hca", "fp8"): [("compressor", "vllm_compressor"), ("ori_cache", "kv_compress_epilog_vllm"),
                         ("cmp_cache", "kv_compress_epilog_vllm"), ("attention", "kv_quant_sparse_attn_sharedkv")],
        ("csa", "fp8"): [("compressor", "vllm_compressor"), ("ori_cache", "kv_compress_epilog_vllm"),
                         ("cmp_cache", "kv_compress_epilog_vllm"), ("index_compressor", "vllm_compressor"),
                         ("index_cache", "indexer_compress_epilog_v2"), ("indexer", "vllm_quant_lightning_indexer"),
                         ("attention", "kv_quant_sparse_attn_sharedkv")],
    }
    for (kind, path), links in want.items():
        ch = C.get_chain(f"v4-{kind}", {"path": path})
        assert [(lk.name, lk.op) for lk in ch.links] == links, (kind, path)
        att = ch.links[-1].args
        assert att["cmp_ratio"] == V.RATIOS[kind] and att["layout_kv"] == "PA_ND"
        if kind != "swa":  # the compressor link's packed rows are what link cmp_cache writes
            cmp = next(lk for lk in ch.links if lk.name == "cmp_cache")
            assert ["compressor.cmp_kv", "cmp_cache", "x" if path == "fp8" else "rows"] in ch.edges()
            assert V.CMP_ROWS in json.dumps(cmp.args) and "cmp_kv_rows" not in ch.inputs
            c = ch.links[0].args
            assert (c["cmp_ratio"], c["coff"], c["cache_mode"]) == ({"csa": (4, 2, 1), "hca": (128, 1, 1)}[kind])
            assert ["input.cu_seqlens_q", "compressor", "cu_seqlens"] in ch.edges()
            # as vLLM-Ascend's Compressor.forward calls _C_ascend.compressor: its RMSNorm, interleaved RoPE of the
            # last 64 lanes with compressor_metadata's cos / sin rows
            assert (c["rope_head_dim"], c["norm_eps"], c["rotary_mode"], c["seqused"]) == (64, 1e-6, 2, None)
            for e in (["input.norm_weight", "compressor", "norm_weight"], ["input.compress_sin", "compressor",
                      "rope_sin"], ["input.compress_cos", "compressor", "rope_cos"]):
                assert e in ch.edges()
        if kind == "csa":
            assert ["indexer.sparse_indices", "attention", "cmp_sparse_indices"] in ch.edges()
            assert ch.links[-2].args["cmp_ratio"] == 4
        if (kind, path) == ("csa", "fp8"):  # the indexer's own C4Li compressor writes every indexer key
            c = next(lk for lk in ch.links if lk.name == "index_compressor").args
            assert (c["cmp_ratio"], c["coff"], c["cache_mode"]) == (4, 2, 1) == V.C4LI[:2] + (1,)
            assert ["index_compressor.cmp_kv", "index_cache", "x"] in ch.edges()
            assert ["input.index_norm_weight", "index_compressor", "norm_weight"] in ch.edges()
            assert ["input.compress_cos", "index_compressor", "rope_cos"] in ch.edges()
            assert ["input.cmp_slot_mapping", "index_cache", "slot_mapping"] in ch.edges()
            assert "index_k_rows" not in ch.inputs and "index_state_cache" in ch.inputs
        elif kind == "csa":
            assert "index_k_rows" in ch.inputs
    with pytest.raises(C.ChainError, match="Invalid value for path, actual: 'fp4'"):
        C.get_chain("v4-csa", {"path": "fp4"})
    # the 950's ring-buffer state: both compressors of the chain take it; the A3 path refuses it by name
    ring = C.get_chain("v4-csa", {"path": "fp8", "cache_mode": 2})
    assert [lk.args["cache_mode"] for lk in ring.links if lk.op == "vllm_compressor"] == [2, 2]
    for bad, why in (({"path": "bf16", "cache_mode": 2}, "the A3 takes cache_mode 1 only"),
                     ({"path": "fp8", "cache_mode": 3}, "must be 1 .paged compressor state. or 2")):
        with pytest.raises(C.ChainError, match=f"Invalid value for cache_mode, actual: {bad['cache_mode']}.*{why}"):
            C.get_chain("v4-hca", bad)


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
    want = v["index_compressor.cmp_kv"][t].astype(np.float32)
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
    # (the compressor's rows: min(T 8, 8 // 4 + B 2) = 4, the two completed groups first, then padding at slot -1)
    cs = x["cmp_slot_mapping"]
    assert cs.shape == (4,) == v["compressor.cmp_kv"].shape[:1]
    assert cs.tolist() == [int(x["cmp_block_table"][0, 0]) * 16, int(x["cmp_block_table"][1, 0]) * 16 + 5, -1, -1]
    cs = cs[:2]
    assert u8(v["cmp_cache.cache"][cs // 16, cs % 16, 0]).tobytes() == u8(v["compressor.cmp_kv"][:2]).tobytes()
    assert not v["compressor.cmp_kv"][2:].astype(np.float32).any()  # padding rows (zeros here), written nowhere
    assert u8(v["index_cache.cache"][cs // 16, cs % 16]).tobytes() == u8(x["index_k_rows"][:2]).tobytes()
    assert u8(v["index_scale.cache"][cs // 16, cs % 16]).tobytes() == u8(x["index_k_scale_rows"][:2]).tobytes()
    # the history: request 1's compressed tokens 0..4 were in the caches already, unchanged
    hist = x["cmp_block_table"][1, 0] * 16 + np.arange(5)
    assert u8(v["cmp_cache.cache"][hist // 16, hist % 16]).tobytes() == \
        u8(x["cmp_cache"][hist // 16, hist % 16]).tobytes()
    assert np.abs(x["cmp_cache"][hist // 16, hist % 16].astype(np.float32)).min(-1).max() > 0  # written, not zeros


def test_a_decode_step_writes_the_compressors_packed_rows_and_skips_the_padding():
    """Decode, B 3: the compressor gives B rows, one per completed group first (kv 20 and 64 complete compressed
    tokens 4 and 15; kv 37 none), then a padding row at slot -1; the cache slots hold its rows byte for byte."""
    for path, chip in PATHS:
        p, x, ch = case("csa", DECODE, path, chip)
        cs = x["cmp_slot_mapping"]
        t = x["cmp_block_table"]
        assert cs.tolist() == [int(t[1, 0]) * 16 + 4, int(t[2, 0]) * 16 + 15, -1], path
        v = C.run_chain(ch, x, chip=chip)
        rows = v["compressor.cmp_kv"]
        f = rows.astype(np.float32)
        assert rows.shape == (3, 512) and np.abs(f[:2]).max(-1).min() > 0 and not f[2].any()
        if path == "bf16":
            assert u8(v["cmp_cache.cache"][cs[:2] // 16, cs[:2] % 16, 0]).tobytes() == u8(rows[:2]).tobytes()
        assert v["attention.attention_out"].shape == (3, 64, 512)


def test_compressor_slots_follow_vllm_ascends_compressor_metadata_kernel():
    """Slots worked out by hand from vLLM-Ascend's compressor_metadata kernel (ratio 4, block size 2): request 0
    (start 3, 14 tokens) fills compressed positions 0..3 (table 7, 7, 3, 3); request 1 has no token; request 2
    (start 14, 11 tokens) fills positions 3..5, the last two in a block of id -1; request 3 (start 24, 4 tokens)
    fills position 6, past its 3-column table row; request 4 starts at -1: nothing. Then padding, or truncation
    at ``n_rows``."""
    cu = [0, 14, 14, 25, 29, 32]
    start = [3, 0, 14, 24, -1]
    table = [[7, 3, 0], [5, 6, 9], [2, 4, -1], [1, 1, 1], [0, 0, 0]]
    assert V.compressor_slots(cu, start, table, 2, 4, 10).tolist() == [14, 15, 6, 7, 9, -1, -1, -1, -1, -1]
    assert V.compressor_slots(cu, start, table, 2, 4, 5).tolist() == [14, 15, 6, 7, 9]
    # the cos / sin rows: row p * 4 (the group's first token) of the full tables where the slot is valid, cos 1 /
    # sin 0 (no rotation) for the rows of slot -1 (invalid block, past the table, padding)
    full_cos = np.arange(13, dtype=np.float32)[:, None] + np.zeros((1, 64), np.float32) + 10
    cos, sin, slots = V.compressor_metadata(cu, start, table, 2, 4, 10, full_cos, -full_cos)
    assert slots.tolist() == [14, 15, 6, 7, 9, -1, -1, -1, -1, -1]
    assert cos[:, 0].tolist() == [10, 14, 18, 22, 22] + [1] * 5 and (cos == cos[:, :1]).all()
    assert sin[:, 0].tolist() == [-10, -14, -18, -22, -22] + [0] * 5 and cos.dtype == np.float32
    with pytest.raises(C.ChainError, match="must cover RoPE position 12"):
        V.compressor_metadata(cu, start, table, 2, 4, 10, full_cos[:12], -full_cos[:12])


def test_the_compressed_rope_table_is_vllm_ascends_yarn_table():
    """compress_rope_table against frequencies worked out here from YaRN's rule (base 160000, factor 16, original
    length 65536, beta 32 / 1): pair k turns by the base's own frequency 160000^(-k/32) below the ramp (k < 15),
    by that divided by 16 from k = 25 on; every lane pair shares its angle."""
    cos, sin = V.compress_rope_table(3000)
    assert cos.shape == sin.shape == (3000, 64) and cos.dtype == np.float32
    assert (cos[:, 0::2] == cos[:, 1::2]).all() and (sin[:, 0::2] == sin[:, 1::2]).all()
    pos = np.arange(3000.0)[:, None]
    for k, inv in ((0, 1.0), (14, 160000.0 ** (-14 / 32)), (25, 160000.0 ** (-25 / 32) / 16),
                   (31, 160000.0 ** (-31 / 32) / 16)):
        # fp32 frequency and angle: within a few fp32 ulps of the angle, times the position
        tol = 3000 * inv * 2.0 ** -21 + 2.0 ** -22
        assert np.abs(cos[:, 2 * k] - np.cos(pos[:, 0] * inv)).max() <= tol, k
        assert np.abs(sin[:, 2 * k] - np.sin(pos[:, 0] * inv)).max() <= tol, k
    assert cos[0].tolist() == [1.0] * 64 and sin[0].tolist() == [0.0] * 64


def test_the_compressor_link_reads_the_generated_state_and_the_steps_token():
    """Each completed row recomputed here in float64 from the chain inputs (the state rows of the group's earlier
    positions at state_block_table[b, p // 16], the step's token projected with wkv / wgate plus ape[p % r], a
    per-column softmax over the group's slots; coff 2 also weighs the previous group in columns [0, D)) is the
    compressor link's bf16 row within bf16 rounding once RMS-normed and rotated here too: the chain feeds it the
    right state, positions, ape, norm weight and RoPE row."""
    for kind, shape in (("csa", DECODE), ("hca", {"q_lens": [1, 1, 1], "kv_lens": [256, 140, 37], "block_size": 16})):
        r, coff = V.CMP_SCENARIOS[kind]
        for path, chip in PATHS:
            p, x, ch = case(kind, shape, path, chip)
            got = C.run_chain(ch, x, chip=chip, until="ori_cache")["compressor.cmp_kv"].astype(np.float64)
            f64 = {k: x[k].astype(np.float64) for k in ("x", "wkv", "wgate", "ape", "state_cache")}
            cd, done = coff * 512, 0
            for b, kv in enumerate(shape["kv_lens"]):
                if kv % r:
                    continue
                g, last = kv // r - 1, kv - 1  # the group the step's token completes; the token's position
                pos = np.arange((g - coff + 1) * r, (g + 1) * r)  # coff 2: the previous group, then its own
                rows = np.zeros((pos.size, 2 * cd))
                for i, q in enumerate(pos):
                    if q == last:
                        rows[i, :cd] = f64["x"][b] @ f64["wkv"].T
                        rows[i, cd:] = f64["x"][b] @ f64["wgate"].T + f64["ape"][q % r]
                    elif q >= 0:
                        rows[i] = f64["state_cache"][x["state_block_table"][b, q // 16], q % 16]
                col = np.repeat(np.arange(coff), r)[:, None] * 512 + np.arange(512)  # [slots, D] column picked
                kvs = np.take_along_axis(rows[:, :cd], col, 1)
                sc = np.where((pos >= 0)[:, None], np.take_along_axis(rows[:, cd:], col, 1), -np.inf)
                w = np.exp(sc - sc.max(0))
                c = (w / w.sum(0) * kvs).sum(0)
                # vLLM-Ascend's compressor: RMSNorm (eps 1e-6), then the last 64 lanes' interleaved pairs rotated by
                # the angles of the group's first position g * r (compressor_metadata: CopyRopeTile), whose first
                # pair turns by exactly g * r radians (inverse frequency 1: the YaRN ramp is 0 there)
                y = c / np.sqrt((c * c).mean() + 1e-6) * x["norm_weight"].astype(np.float64)
                cos = V.compress_rope_table(g * r + 1)[0][g * r].astype(np.float64)
                sin = V.compress_rope_table(g * r + 1)[1][g * r].astype(np.float64)
                assert abs(cos[0] - np.cos(g * r)) <= 2.0 ** -23 and cos[0] == cos[1]
                assert (x["compress_cos"][done] == cos).all() and (x["compress_sin"][done] == sin).all()
                a, bb = y[448::2].copy(), y[449::2].copy()
                y[448::2], y[449::2] = a * cos[::2] - bb * sin[::2], bb * cos[::2] + a * sin[::2]
                err = np.abs(got[done] - y)
                assert (err <= np.abs(y) * 2.0 ** -8 + 2.0 ** -14).all(), (kind, path, b, err.max())
                done += 1
            assert done and not got[done:].any(), (kind, path)


# --------------------------------------------------------------------------------------------------
# golden sets and compare --chain


@pytest.fixture(scope="module")
def csa_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("v4") / "csa"
    assert main(["golden", "generate", "--set", "v4-layer-csa-decode", "--out", str(out), "-q", "--only",
                 "decode-950-fp8.*"]) == 0
    return out


def test_every_v4_set_is_registered_with_both_chips():
    from qsfa.golden.catalogue import get_set

    for kind in ("swa", "csa", "hca"):
        for step in ("decode", "prefill"):
            cases = get_set(f"v4-layer-{kind}-{step}").cases()
            insts = sorted({c.name.split(".")[0] for c in cases})
            ring = [f"{step}-950-fp8-ring"] if kind != "swa" else []  # the 950's ring-buffer compressor state
            assert insts == [f"{step}-950-fp8"] + ring + [f"{step}-a3-bf16"], (kind, step)
            assert len(cases) == sum(len(C.get_chain(f"v4-{kind}", {"path": p}).links)
                                     for p in ("bf16", "fp8") + ("fp8",) * len(ring))
            for c in cases:
                if c.name == f"{step}-950-fp8-ring.compressor":
                    ch = C.get_chain(f"v4-{kind}", c.params, ignore_unknown=True)
                    assert {lk.args["cache_mode"] for lk in ch.links if lk.op == "vllm_compressor"} == {2}


def test_v4_set_stores_every_intermediate_and_the_edges(csa_set, capsys):
    man = json.loads((csa_set / "manifest.json").read_text())
    (rec,) = man["chains"]
    assert rec["instance"] == "decode-950-fp8" and rec["chain"]["name"] == "v4-csa"
    assert sorted(rec["cases"]) == ["attention", "cmp_cache", "compressor", "index_cache", "index_compressor",
                                    "indexer", "ori_cache"]
    edges = rec["chain"]["edges"]
    for e in (["index_compressor.cmp_kv", "index_cache", "x"],
              ["index_cache.indexer_compress_cache", "indexer", "key"],
              ["index_cache.indexer_compress_cache", "indexer", "key_dequant_scale"],
              ["cmp_cache.kv_compress_cache", "attention", "cmp_kv"],
              ["indexer.sparse_indices", "attention", "cmp_sparse_indices"]):
        assert e in edges, e
    d = csa_set
    assert (d / "decode-950-fp8.attention/in.cmp_sparse_indices.bin").read_bytes() == \
        (d / "decode-950-fp8.indexer/out.sparse_indices.bin").read_bytes()
    # the indexer's key file is the codes region of the index_cache link's output (a view: sliced, reinterpreted)
    cache = np.fromfile(d / "decode-950-fp8.index_cache/out.indexer_compress_cache.bin", np.uint8).reshape(-1, 16 * 132)
    assert (d / "decode-950-fp8.indexer/in.key.bin").read_bytes() == cache[:, :16 * 128].tobytes()
    assert (d / "decode-950-fp8.indexer/in.key_dequant_scale.bin").read_bytes() == cache[:, 16 * 128:].tobytes()
    assert (d / "decode-950-fp8.index_cache/in.x.bin").read_bytes() == \
        (d / "decode-950-fp8.index_compressor/out.cmp_kv.bin").read_bytes()
    rc, out, err = cli(capsys, "verify", d, "--recompute", "-q")
    assert rc == 0 and "7 recomputed" in out, out + err


def test_compare_chain_identical_passes_and_a_cache_byte_names_its_link(csa_set, tmp_path, capsys):
    rc, out, err = cli(capsys, "compare", csa_set, "--actual", csa_set, "--chain")
    assert rc == 0 and "every link passes" in out, out + err
    a = actual_copy(csa_set, tmp_path)
    man = json.loads((csa_set / "manifest.json").read_text())
    slots = next(c for c in man["cases"] if c["name"] == "decode-950-fp8.index_cache")
    f = a / "decode-950-fp8.index_cache/out.indexer_compress_cache.bin"
    b = np.fromfile(f, np.uint8)
    b[:16 * 128].reshape(16, 128)[:, 0] ^= 0x01  # block 0's codes: a code of each of its slots one step off
    b.tofile(f)
    rc, out, err = cli(capsys, "compare", csa_set, "--actual", a, "--chain", "--json", tmp_path / "r.json")
    assert rc == 1 and "first failing link: index_cache (own)" in out and "inputs matched" in out, out + err
    links = json.loads((tmp_path / "r.json").read_text())["instances"][0]["links"]
    assert [lk["verdict"] for lk in links] == ["PASS", "PASS", "PASS", "PASS", "own", "PASS", "PASS"]
    assert slots["op"] == "indexer_compress_epilog_v2"


def test_indices_changed_upstream_of_the_attention_own_then_propagated(csa_set, tmp_path, capsys, mirror_backend):
    """The indexer's indices replaced (a worse token first) and the attention that read them off: the indexer is
    the first failing link, its own error; the attention's re-run on golden inputs on a right device passes, so its
    failure is propagated (undecided without --backend)."""
    a = actual_copy(csa_set, tmp_path)
    f = a / "decode-950-fp8.indexer/out.sparse_indices.bin"
    s = np.fromfile(f, np.int32).reshape(3, 512)
    s[2, 0], s[2, 15] = s[2, 15], -1  # request 2 loses one of its 16 candidates
    s.tofile(f)
    g = a / "decode-950-fp8.attention/out.attention_out.bin"
    o = np.fromfile(g, np.uint16)
    o[:64] ^= 0x0100
    o.tofile(g)
    rc, out, _ = cli(capsys, "compare", csa_set, "--actual", a, "--chain")
    assert rc == 1 and "first failing link: indexer (own)" in out and "re-run it with --backend" in out, out
    assert "sparse_indices topk FAIL" in out, out
    rc, out, _ = cli(capsys, "compare", csa_set, "--actual", a, "--chain", "--backend",
                     mirror_backend("v4-chain-right-device"), "--json", tmp_path / "r.json")
    links = json.loads((tmp_path / "r.json").read_text())["instances"][0]["links"]
    assert rc == 1 and [lk["verdict"] for lk in links] == ["PASS"] * 5 + ["own", "propagated"], out
    assert links[6]["differing_inputs"] == ["cmp_sparse_indices = indexer.sparse_indices"]


def test_reordered_indices_pass_tie_fair_and_the_attention_bug_is_own(csa_set, tmp_path, capsys, mirror_backend):
    """Indices in another order within a row: not the golden's bytes, the same set (top-k criterion, exact). An
    attention whose re-run on golden inputs fails too (a device with a planted bug) is its own error."""
    a = actual_copy(csa_set, tmp_path)
    f = a / "decode-950-fp8.indexer/out.sparse_indices.bin"
    s = np.fromfile(f, np.int32).reshape(3, 512)
    s[2, :2] = s[2, 1::-1]
    s.tofile(f)
    g = a / "decode-950-fp8.attention/out.attention_out.bin"
    o = np.fromfile(g, np.uint16)
    o[:64] ^= 0x0100
    o.tofile(g)

    def bug(ref):
        def impl(*args, **kw):
            out, lse = ref(*args, **kw)
            return (np.asarray(out, np.float32) + 1).astype(out.dtype), lse
        return impl

    be = mirror_backend("v4-chain-buggy-attention", {"kv_quant_sparse_attn_sharedkv": bug})
    rc, out, _ = cli(capsys, "compare", csa_set, "--actual", a, "--chain", "--backend", be, "--json",
                     tmp_path / "r.json")
    links = json.loads((tmp_path / "r.json").read_text())["instances"][0]["links"]
    assert rc == 1 and [lk["verdict"] for lk in links] == ["PASS"] * 6 + ["own"], out
    ix = links[5]["outputs"][0]
    assert ix["kind"] == "topk" and ix["topk"]["exact_rows"] == 3, ix
    assert links[6]["rerun_passed"] is False


def test_scores_table_ranks_to_the_v4_indexers_indices():
    from qsfa.reference.indexer import top_k_desc
    from qsfa.reference.indexer_v4 import vllm_quant_lightning_indexer_scores

    for (path, chip), shape in zip(PATHS, (PREFILL, DECODE)):  # A3 int8 on a prefill, the 950 FP8 on a decode
        p, x, ch = case("csa", shape, path, chip, seed=2)
        v = C.run_chain(ch, x, chip=chip)
        lk = ch.links[-2]
        sc = vllm_quant_lightning_indexer_scores(**C._link_args(lk, C._spec(lk.op), v, "test"))
        n = np.isfinite(sc).sum(-1).reshape(-1)
        idx, _ = top_k_desc(sc.reshape(n.size, -1), 512, n)
        assert (idx == v["indexer.sparse_indices"].reshape(n.size, -1)).all(), (path, shape)


# --------------------------------------------------------------------------------------------------
# bad input on V4 chain files: one line naming the link and the field, exit 2, nothing written


def test_missing_intermediate_is_exit_2_naming_the_link(csa_set, tmp_path, capsys):
    a = actual_copy(csa_set, tmp_path)
    os.remove(a / "decode-950-fp8.cmp_cache/out.kv_compress_cache.bin")
    rc, out, err = cli(capsys, "compare", csa_set, "--actual", a, "--chain", "--json", tmp_path / "r.json")
    assert rc == 2 and "link cmp_cache: missing intermediate" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.json").exists()


def edited(csa_set, tmp_path, edit):
    g = actual_copy(csa_set, tmp_path)
    man = json.loads((g / "manifest.json").read_text())
    edit(man["chains"][0]["chain"]["links"])
    (g / "manifest.json").write_text(json.dumps(man))
    return g


@pytest.mark.parametrize("edit, where, what", [
    (lambda lk: lk[5].update(op="vllm_quant_lightning_indexer_v9"), "link 'indexer' op",
     "vllm_quant_lightning_indexer_v9"),
    (lambda lk: lk[5]["args"].update(key="$attention.attention_out"), "link 'indexer' args.key", "a later one"),
    (lambda lk: lk[5]["args"].update(key="$indexer.sparse_indices"), "link 'indexer' args.key", "a cycle"),
    (lambda lk: lk[5]["args"]["key"].update(dtype="int8"), "link 'indexer' args.key",
     "the recorded edge from index_cache.indexer_compress_cache gives int8 [4, 16, 1, 128], not the array"),
    (lambda lk: lk[5]["args"]["key_dequant_scale"].update(columns=[2048, 4096]),
     "link 'indexer' args.key_dequant_scale columns", "outside the last dimension"),
    (lambda lk: lk[6]["args"]["ori_kv"].update(reshape=[-1, 16, 1, 512]), "link 'attention' args.ori_kv",
     "cannot be reshaped to [-1, 16, 1, 512]"),
    (lambda lk: lk[6]["args"].update(cmp_kv="$ori_cache.kv_compress_cache"), "link 'attention' args.cmp_kv",
     "gives float8_e4m3fn [160, 1, 640], not the array the case stores"),
    (lambda lk: lk[6]["args"].update(tile_size=32), "link 'attention' (kv_quant_sparse_attn_sharedkv): the operator "
     "refuses", "Invalid value for tile_size, actual: 32"),
    (lambda lk: lk[5]["args"].update(cmp_ratio=3), "link 'indexer' (vllm_quant_lightning_indexer): the operator "
     "refuses", "Invalid value for cmp_ratio, actual: 3"),
])
def test_a_recorded_v4_chain_the_operators_refuse_is_exit_2(csa_set, tmp_path, capsys, edit, where, what):
    g = edited(csa_set, tmp_path, edit)
    rc, out, err = cli(capsys, "compare", g, "--actual", csa_set, "--chain", "--json", tmp_path / "r.json")
    assert rc == 2 and where in err and what in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.json").exists() and out == ""


def test_generating_a_v4_chain_whose_edge_is_refused_is_exit_2_and_writes_nothing(tmp_path, capsys):
    """The A3 indexer fed the bf16 compressed cache as its key: the indexer's contract refuses the dtype, named with
    the link; no file is written."""
    import inspect

    from qsfa.golden import catalogue, generators
    from qsfa.golden.chain import chain_cases as link_cases

    def bad_chain(**p):
        d = V.v4_csa(**p).to_dict()
        d["name"] = "test-v4-bad-edge"
        d["links"][5]["args"]["key"] = "$cmp_cache.cache"
        return C.chain_from_dict(d)

    bad_chain.__signature__ = inspect.signature(V.v4_csa)
    C.register_chain("test-v4-bad-edge", bad_chain)
    generators.register_generator("test-v4-bad-edge", generators.get_generator("v4-csa"))
    catalogue.register_set("test-v4-bad-edge", "an indexer reading the compressed KV cache",
                           lambda: link_cases("test-v4-bad-edge", "x", dict(DECODE, chip="A3", path="bf16"), seed=1))
    try:
        rc, _, err = cli(capsys, "generate", "--set", "test-v4-bad-edge", "--out", tmp_path / "out", "-q")
    finally:
        catalogue.unregister_set("test-v4-bad-edge")
        generators._GENERATORS.pop("test-v4-bad-edge", None)
        C._CHAINS.pop("test-v4-bad-edge", None)
    assert rc == 2 and err.count("\n") == 1, err
    assert "link 'indexer' (vllm_quant_lightning_indexer)" in err and "Invalid dtype for key" in err, err
    assert not (tmp_path / "out").exists()


def test_chain_file_views_are_checked_by_name():
    base = C.get_chain("v4-csa", {"path": "fp8"}).to_dict()
    for change, field, reason in (
            ({"columns": [5, 2]}, "args.key columns", "0 <= start <= stop"),
            ({"dtype": "float7"}, "args.key dtype", "not a dtype name"),
            ({"shape": "x"}, "args.key", "a view is"),
            ({"stride": 2}, "args.key", "a view is")):
        d = json.loads(json.dumps(base))
        d["links"][5]["args"]["key"].update(change)
        with pytest.raises(C.ChainError, match=f"link 'indexer' {field}.*{reason}"):
            C.chain_from_dict(d)


# --------------------------------------------------------------------------------------------------
# batch invariance and conformance over drawn V4 chains (a failing chain shrinks to a minimal one)

#: a V4 chain example costs two chain runs with a 64-head attention: a sixth of the profile's examples, at least 4
V4_EXAMPLES = max(4, settings.default.max_examples // 6)
V4_NAMES = ("v4-swa", "v4-csa", "v4-hca")


def pages(table_row, n, bs=16):
    return np.asarray(table_row[:-(-int(n) // bs)], np.int64)


def blocks(a, bs=16):
    """A cache in block form: the 950's kv_compress_epilog_vllm caches are [slots, 1, 640]."""
    return a.reshape(-1, bs, *a.shape[1:]) if a.ndim == 3 else a


def assert_alone_equals_batched(chain, x, p, r, chip):
    """Request ``r`` alone (its rows, its compressed rows, its block-table rows and lengths, the same caches) gives
    the bytes it has inside the batch: its pages of every cache, its indices, its attention rows."""
    kind = chain.replace("v4-", "")
    ch = C.get_chain(chain, p, ignore_unknown=True)
    batch = C.run_chain(ch, x, chip=chip)
    alone_in, rows, crows = V.v4_request_alone(x, dict(p, kind=kind), r)
    alone = C.run_chain(ch, alone_in, chip=chip)
    kv = p["kv_lens"][r]
    mine = {"ori_cache": pages(x["ori_block_table"][r], kv)}
    checked = 0
    if kind != "swa":
        mine["cmp_cache"] = mine["index_cache"] = mine["index_scale"] = pages(x["cmp_block_table"][r],
                                                                              kv // V.RATIOS[kind])
        # each compressor (the 950 CSA also has the indexer's C4Li): its rows (alone: the first ones, the rest
        # padding) and its state pages
        n = crows.size
        st = np.atleast_1d(x["state_block_table"][r])  # cache_mode 2: one ring block
        st = st[st > 0]
        for cmp in ("compressor", "index_compressor"):
            if f"{cmp}.cmp_kv" not in batch:
                continue
            assert u8(alone[f"{cmp}.cmp_kv"][:n]).tobytes() == u8(batch[f"{cmp}.cmp_kv"][crows]).tobytes(), cmp
            assert not alone[f"{cmp}.cmp_kv"][n:].astype(np.float32).any(), cmp
            assert st.size and u8(alone[f"{cmp}.state_cache"][st]).tobytes() == \
                u8(batch[f"{cmp}.state_cache"][st]).tobytes(), cmp
            checked += 1
    for key in batch:
        link = key.split(".")[0]
        if link in mine:
            assert u8(blocks(alone[key])[mine[link]]).tobytes() == u8(blocks(batch[key])[mine[link]]).tobytes(), key
            checked += 1
    for key in ("indexer.sparse_indices", "attention.attention_out"):
        if key in batch:
            assert u8(alone[key]).tobytes() == u8(batch[key][rows]).tobytes(), key
            checked += 1
    assert checked == len(ch.links)


@pytest.mark.parametrize("kind, shape", [
    ("csa", {"q_lens": [2, 3, 1], "kv_lens": [9, 41, 24]}),
    ("hca", {"q_lens": [1, 1, 1], "kv_lens": [256, 130, 5]}),
    ("swa", {"q_lens": [3, 1], "kv_lens": [150, 7]}),
])
@pytest.mark.parametrize("path, chip", PATHS)
def test_batch_invariance_one_request_alone_equals_it_inside_an_uneven_batch(kind, shape, path, chip):
    """The middle request (or the first of two) run alone gives the same bytes as inside the uneven batch: the
    kind of bug vLLM-Ascend #9496 reported for the compressor, whose difference reached the compressed cache."""
    p, x, _ = case(kind, dict(shape, block_size=16), path, chip, seed=5)
    assert_alone_equals_batched(f"v4-{kind}", x, p, 1 if len(shape["q_lens"]) > 2 else 0, chip)


@pytest.mark.parametrize("kind, shape", [("csa", {"q_lens": [2, 3, 1], "kv_lens": [9, 41, 24]}),
                                         ("hca", {"q_lens": [1, 1, 1], "kv_lens": [256, 130, 5]})])
def test_batch_invariance_with_the_950_ring_buffer_state(kind, shape):
    """The same with the compressors' ring-buffer state (cache_mode 2, one block per request): its ring block too."""
    p, x, _ = case(kind, dict(shape, block_size=16, cache_mode=2), "fp8", "950", seed=5)
    assert x["state_block_table"].shape == (3,)
    assert_alone_equals_batched(f"v4-{kind}", x, p, 1, "950")


def v4_case_strategy(max_requests=2):
    """Any V4 chain; 2 requests at most (uneven batches already; the attention's cost grows with query rows)."""
    return st.sampled_from(V4_NAMES).flatmap(lambda n: chain_cases(n, max_requests=max_requests))


@settings(max_examples=V4_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v4_case_strategy(), st.integers(0, 1))
def test_batch_invariance_property(case_, r):
    """Any drawn V4 chain case: each request alone equals it inside the batch, byte for byte on the reference."""
    r = r % len(case_["params"]["q_lens"])
    assert_alone_equals_batched(case_["chain"], case_["inputs"], case_["params"], r, case_["chip"])


@settings(max_examples=V4_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v4_case_strategy())
def test_every_drawn_v4_chain_is_valid_and_the_reference_conforms(case_):
    """Every drawn case passes every link's contract on its chip, and the reference conforms to itself."""
    ch = C.get_chain(case_["chain"], case_["params"], ignore_unknown=True)
    assert C.first_divergence(ch, case_["inputs"], backend="reference", chip=case_["chip"]) is None


def test_a_failing_v4_chain_shrinks_to_a_minimal_one(mirror_backend):
    """A device whose A3 attention is off when some request holds more than 9 tokens: the drawn v4-swa chains
    that fail it shrink to one decode request of 10 tokens, the attention link's own error."""
    def bug(ref):
        def impl(*args, **kw):
            out, lse = ref(*args, **kw)
            if int(np.max(kw["seqused_kv"])) > 9:
                out = (np.asarray(out, np.float32) + 1).astype(out.dtype)
            return out, lse
        return impl

    be = mirror_backend("v4-chain-long-history", {"sparse_attn_sharedkv": bug})

    def fails(c):
        d = C.first_divergence(C.get_chain(c["chain"], c["params"], ignore_unknown=True), c["inputs"], backend=be,
                               chip=c["chip"])
        return d is not None and d["link"] == "attention" and d["verdict"] == "own"

    found = find(chain_cases("v4-swa", chip="A3", max_requests=1, max_kv=12), fails,
                 settings=settings(max_examples=100, deadline=None, database=None, derandomize=True))
    assert found["params"]["kv_lens"] == [10] and found["params"]["q_lens"] == [1], found["params"]


def test_a_perturbed_compressor_is_own_and_the_links_after_it_propagated(tmp_path, mirror_backend):
    """A device whose compressor scales each row it completes by 16: dumped as a
    chain folder and compared with the reference's, the compressor is the first failing link, its own error; the
    compressed cache it feeds and the attention reading that cache fail with inputs that already differed, and
    each passes re-run on golden inputs on that device: propagated. The window cache and the indexer (no edge from
    the compressor) pass."""
    def bug(ref):
        def impl(*args, **kw):
            out, state = ref(*args, **kw)
            if out.shape[-1] != 512:
                return out, state
            out = np.array(out)
            u = out.view(np.uint16)  # every non-zero element times 16 (exponent + 4): zero padding rows stay
            u += np.where(u & 0x7F80, np.uint16(0x200), np.uint16(0))
            return out, state
        return impl

    be = mirror_backend("v4-chain-compressor", {"vllm_compressor": bug})
    for path, chip in PATHS:  # (the 950 CSA's index_compressor is a compressor too: D 128, left right here)
        p, x, ch = case("csa", DECODE, path, chip, seed=4)
        C.write_chain_golden(ch, x, str(tmp_path / f"g-{path}"))
        C.write_chain_golden(ch, x, str(tmp_path / f"a-{path}"), backend=be)
        rep = C.compare_chain_dirs(str(tmp_path / f"g-{path}"), str(tmp_path / f"a-{path}"), rerun_backend=be)
        verdicts = {lk.link: lk.verdict.split(":")[0] for lk in rep.links}
        assert rep.first_failure.link == "compressor" and verdicts["compressor"] == "FAIL (own error", str(rep)
        assert verdicts["cmp_cache"] == verdicts["attention"] == "FAIL (propagated", (path, verdicts)
        assert {verdicts[k] for k in verdicts if k not in ("compressor", "cmp_cache", "attention")} == {"PASS"}


def test_first_divergence_names_the_v4_indexer_and_not_the_attention_after_it(mirror_backend):
    """A device whose V4 indexer swaps its first two indices: the first failing link is the indexer, its own error
    (its inputs are the reference's bytes); the attention that read them is not reported."""
    def bug(ref):
        def impl(*args, **kw):
            idx, val = ref(*args, **kw)
            idx = np.array(idx)
            idx.reshape(-1, idx.shape[-1])[-1, [0, 1]] = idx.reshape(-1, idx.shape[-1])[-1, [1, 0]]
            return idx, val
        return impl

    be = mirror_backend("v4-chain-indexer", {"vllm_quant_lightning_indexer": bug})
    for path, chip in PATHS:
        p, x, ch = case("csa", DECODE, path, chip, seed=6)
        d = C.first_divergence(ch, x, backend=be, chip=chip)
        assert d == {"link": "indexer", "op": "vllm_quant_lightning_indexer", "outputs": ["sparse_indices"],
                     "differing_inputs": [], "rerun_passed": None, "verdict": "own"}, (path, d)


def test_a_v4_chain_folder_round_trips_and_a_changed_scale_names_the_indexer(tmp_path):
    """write_chain_golden / compare_chain_dirs (a folder of one chain run, e.g. dumped from a device) on the 950
    v4-csa chain: identical passes; an index-cache scale changed in the dump fails that link first, its own."""
    p, x, ch = case("csa", DECODE, "fp8", "950", seed=3)
    x = dict(x)
    g = tmp_path / "g"
    C.write_chain_golden(ch, x, str(g))
    assert C.compare_chain_dirs(str(g), str(g)).passed
    a = tmp_path / "a"
    shutil.copytree(g, a)
    f = a / "index_cache.indexer_compress_cache.npy"
    arr = np.load(f)
    s = int(x["cmp_slot_mapping"][1])
    arr.reshape(arr.shape[0], -1)[s // 16, 16 * 128 + (s % 16) * 4 + 3] ^= 0x01  # its fp32 scale's top byte
    np.save(f, arr)
    rep = C.compare_chain_dirs(str(g), str(a))
    first = rep.first_failure
    assert first.link == "index_cache" and first.inputs_matched, str(rep)


def test_a_perturbed_c4li_compressor_is_own_and_the_indexer_after_it_propagated(tmp_path, mirror_backend):
    """A 950 device whose indexer compressor (C4Li, D 128) negates the rows it completes: compared link by link,
    index_compressor is the first failing link, its own error; the index cache written from its rows, the indexer
    reading that cache (515 and 522 candidates for top-512: the negated keys change the selected set) fail with
    inputs that already differed, and each passes re-run on golden inputs on that device: propagated. The
    attention's compressor and the caches it writes pass; so does the attention, over a few other low-ranked
    tokens."""
    def bug(ref):
        def impl(*args, **kw):
            out, state = ref(*args, **kw)
            if out.shape[-1] != 128:
                return out, state
            out = np.array(out)
            out.view(np.uint16)[...] ^= np.uint16(0x8000)
            return out, state
        return impl

    be = mirror_backend("v4-chain-c4li", {"vllm_compressor": bug})
    p, x, ch = case("csa", {"q_lens": [1, 8], "kv_lens": [2060, 2088], "block_size": 16}, "fp8", "950", seed=4)
    C.write_chain_golden(ch, x, str(tmp_path / "g"))
    C.write_chain_golden(ch, x, str(tmp_path / "a"), backend=be)
    rep = C.compare_chain_dirs(str(tmp_path / "g"), str(tmp_path / "a"), rerun_backend=be)
    verdicts = {lk.link: lk.verdict.split(":")[0] for lk in rep.links}
    assert rep.first_failure.link == "index_compressor", str(rep)
    assert verdicts == {"compressor": "PASS", "ori_cache": "PASS", "cmp_cache": "PASS",
                        "index_compressor": "FAIL (own error", "index_cache": "FAIL (propagated",
                        "indexer": "FAIL (propagated", "attention": "PASS"}, verdicts
    # the attention read other indices (its input differs), yet the few lowest-ranked tokens swapped keep its output
    # within the float criterion
    assert not rep.links[-1].inputs_matched


# --------------------------------------------------------------------------------------------------
# two steps over the same caches: the second step's compressed history derived from the first step's state


_FRESH = ("csa", {"q_lens": [8, 5], "kv_lens": [8, 5]}, [7, 4])  # a fresh prefill, then a decode step
_CHUNKS = ("csa", {"q_lens": [6, 5], "kv_lens": [6, 29]}, [3, 2])  # two chunks, one over a cached prefix
_HCA = ("hca", {"q_lens": [3, 2], "kv_lens": [129, 140]}, [1, 1])


@pytest.mark.parametrize("kind, shape, first, path, chip, cache_mode", [
    _FRESH + ("bf16", "A3", 1), _FRESH + ("fp8", "950", 1), _FRESH + ("fp8", "950", 2),
    _CHUNKS + ("fp8", "950", 2), _HCA + ("fp8", "950", 1), _HCA + ("bf16", "A3", 1)])
def test_two_steps_over_the_same_caches_equal_one_step(kind, shape, first, path, chip, cache_mode):
    """A step cut in two (v4_two_steps): the first ``first[b]`` tokens of each request, then the rest, the second
    step reading every cache and state the first one wrote. Request 0 of the first CSA case completes group 1 (tokens
    4..7) in its decode step from the state of tokens 4..6 (and group 0's, coff 2) that its prefill left: the caches
    and states after both steps, the indices and the attention rows equal one step over all the tokens, byte for
    byte. The same second step fed the state as it was before the first step gives other compressor rows. With the
    950's ring-buffer state (cache_mode 2) a call writes only the tokens of the last coff groups it reaches, so the
    first step leaves rows one step does not write: there the state rows of those tokens are compared."""
    p, x, ch = case(kind, dict(shape, block_size=16, cache_mode=cache_mode), path, chip, seed=7)
    p = dict(p, kind=kind)
    one = C.run_chain(ch, x, chip=chip)
    p1, x1, second = V.v4_two_steps(x, p, first)
    t1 = C.run_chain(ch, x1, chip=chip)
    p2, x2 = second(t1)
    assert p2["q_lens"] == [q - f for q, f in zip(shape["q_lens"], first)] and p2["kv_lens"] == shape["kv_lens"]
    t2 = C.run_chain(ch, x2, chip=chip)
    carry = V.carried(ch)
    assert {"state_cache", "ori_cache", "cmp_cache"} <= set(carry)
    assert ("index_state_cache" in carry) == ((kind, path) == ("csa", "fp8"))
    r, coff = V.RATIOS[kind], V.CMP_SCENARIOS[kind][1]
    for name, t in carry.items():
        if cache_mode == 2 and name.endswith("state_cache"):
            assert x[name].shape[1] == coff * r + max(shape["q_lens"]) - 1  # the contract's least ring size
            for b, (q, kv) in enumerate(zip(shape["q_lens"], shape["kv_lens"])):
                pos = [p_ for p_ in range(kv - q, kv) if p_ // r >= kv // r - (coff - 1)]
                blk, at = x["state_block_table"][b], np.asarray(pos) % x[name].shape[1]
                assert pos and u8(t2[t][blk, at]).tobytes() == u8(one[t][blk, at]).tobytes(), (name, b)
            continue
        assert u8(t2[t]).tobytes() == u8(one[t]).tobytes(), name
    cu = np.concatenate([[0], np.cumsum(shape["q_lens"])])
    rows1 = np.concatenate([np.arange(cu[b], cu[b] + f) for b, f in enumerate(first)])
    rows2 = np.concatenate([np.arange(cu[b] + f, cu[b + 1]) for b, f in enumerate(first)])
    for k in ("indexer.sparse_indices", "attention.attention_out"):
        if k in one:
            assert u8(t1[k]).tobytes() == u8(one[k][rows1]).tobytes(), k
            assert u8(t2[k]).tobytes() == u8(one[k][rows2]).tobytes(), k
    # the second step's completed rows come from the first step's state: the state before it gives other rows
    done = int((x2["cmp_slot_mapping"] >= 0).sum())
    assert done
    stale = C.run_chain(ch, dict(x2, state_cache=x["state_cache"]), chip=chip, until="ori_cache")
    assert u8(stale["compressor.cmp_kv"][:done]).tobytes() != u8(t2["compressor.cmp_kv"][:done]).tobytes()
    if "index_state_cache" in carry:  # the same for the indexer's C4Li compressor
        stale = C.run_chain(ch, dict(x2, index_state_cache=x["index_state_cache"]), chip=chip, until="index_cache")
        assert u8(stale["index_compressor.cmp_kv"][:done]).tobytes() != \
            u8(t2["index_compressor.cmp_kv"][:done]).tobytes()


def test_two_steps_refuses_a_split_that_leaves_a_step_empty():
    p, x, _ = case("csa", PREFILL, "fp8", "950")
    for first in ([5, 1], [0, 1], [2]):
        with pytest.raises(C.ChainError, match=r"Invalid value for first, actual: .*must give each request 1 \.\. "
                                               r"q_len - 1 tokens \(q_lens \[5, 3\]\)"):
            V.v4_two_steps(x, dict(p, kind="csa"), first)
