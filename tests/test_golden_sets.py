"""The catalogue's scenario sets hold what docs/numerics/attention.md#scenarios says they hold.

Each check reads the generated files with NumPy and the manifest only, and derives the expectation
independently (float64 attention written here, token counts from the indices, sentinel bytes).
Only single cases of the big sets are generated (``--only``).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from qsfa.cli import main
from qsfa.compare import compare_float
from qsfa.golden import load_manifest
from qsfa.golden.generators import POISON, SENTINEL

BF16 = np.dtype(ml_dtypes.bfloat16)


def generate(tmp_path, set_name, *only):
    out = tmp_path / set_name
    argv = ["golden", "generate", "--set", set_name, "--out", str(out), "-q"]
    for o in only:
        argv += ["--only", o]
    assert main(argv) == 0
    man = load_manifest(out)
    assert not man["skipped"], man["skipped"]
    return out, {c["name"]: c for c in man["cases"]}


def arrays(folder, case, role):
    """name -> array in its logical dtype, read with numpy.fromfile and the manifest entry only."""
    out = {}
    for e in case["arrays"]:
        if e["role"] != role:
            continue
        a = np.fromfile(os.path.join(folder, e["file"]), dtype=e["storage"]).reshape(e["shape"])
        if e["dtype"] == "bfloat16":
            a = a.view(BF16)
        out[e["name"]] = a
    return out


def selected_tokens(idx_row, threshold, sbs):
    toks = []
    for t in idx_row:
        if t < 0:
            break
        toks += range(t * sbs, min(t * sbs + sbs, threshold))
    return np.array(toks, np.int64)


def test_seed_decode_is_the_spec_scenario_and_its_output_holds(tmp_path):
    g, cases = generate(tmp_path, "seed-decode", "decode-bfloat16")
    c = cases["decode-bfloat16"]
    i, o = arrays(g, c, "input"), arrays(g, c, "output")
    call = c["call"]
    assert (call["layout_query"], call["layout_kv"], call["sparse_mode"], call["rope_head_dim"]) == \
        ("BSND", "PA_BSND", 3, 64)
    assert call["scale_value"] == (512 + 64) ** -0.5
    assert i["query"].shape == (1, 1, 64, 576) and i["query"].dtype == BF16
    assert i["key"].shape == (16, 256, 1, 656)
    assert sorted(i["block_table"].ravel()) == list(range(16))
    assert i["actual_seq_lengths_kv"].tolist() == [4096] and i["actual_seq_lengths_query"].tolist() == [1]
    idx = i["sparse_indices"].ravel()
    assert idx.shape == (2048,) and len(set(idx.tolist())) == 2048 and idx.min() >= 0 and idx.max() == 4095

    # independent float64 attention over the 2048 selected tokens (page table -> packed rows)
    rows = i["key"].view(np.uint8).reshape(16 * 256, 656)
    phys = i["block_table"][0, idx // 256] * 256 + idx % 256
    r = rows[phys]
    nope = r[:, :512].view(np.int8).astype(np.float64)
    scales = r[:, 640:656].copy().view("<f4").astype(np.float64)
    # docs/numerics/attention.md#rounding-points: K = decode(NoPE) * tile scale in fp32, rounded to the query dtype (bf16 RINT)
    k_nope = (nope * np.repeat(scales, 128, axis=1)).astype(np.float32).astype(BF16).astype(np.float64)
    k_rope = r[:, 512:640].copy().view(BF16).astype(np.float64)
    q = i["query"][0, 0].astype(np.float64)  # [64, 576]
    s = (q[:, :512] @ k_nope.T + q[:, 512:] @ k_rope.T) * call["scale_value"]
    m = s.max(1, keepdims=True)
    p = np.exp(s - m)
    want = (p @ k_nope) / p.sum(1, keepdims=True)
    res = compare_float(o["attention_out"][0, 0], want.astype(np.float32).astype(BF16), dtype="bfloat16")
    assert res.passed, res
    lse_res = compare_float(o["softmax_max"].reshape(64), m.ravel().astype(np.float32), dtype="float32")
    assert lse_res.passed, lse_res


@pytest.mark.parametrize("name", ["bsnd-pa-float16", "tnd-tnd-bfloat16"])
def test_uniform_attention_cases(tmp_path, name):
    g, cases = generate(tmp_path, "seed-rope0", f"rope0-{name}-uniform-rope0")
    c = cases[f"rope0-{name}-uniform-rope0"]
    i, o = arrays(g, c, "input"), arrays(g, c, "output")
    call = c["call"]
    sbs, lq = call["sparse_block_size"], call["layout_query"]
    q_lens = np.array(c["params"]["q_lens"])
    kv_lens = np.array(c["params"]["kv_lens"])
    # the query is zero except column 0 and key column 0 is zero: every score is 0
    q = i["query"].astype(np.float32)
    assert (q[..., 1:] == 0).all() and (q[..., 0] != 0).all() if lq == "TND" else (q[..., 1:] == 0).all()
    counts, rows = [], []
    for b in range(q_lens.size):
        for qi in range(q_lens[b]):
            thr = kv_lens[b] - q_lens[b] + qi + 1
            row = (int(q_lens[:b].sum()) + qi) if lq == "TND" else (b, qi)
            idx = i["sparse_indices"][row].ravel()
            counts.append(selected_tokens(idx, thr, sbs).size)
            rows.append(row)
    mx, sm = o["softmax_max"], o["softmax_sum"]
    for row, n in zip(rows, counts):
        lse_row = (0, row) if lq == "TND" else (row[0], 0, row[1])
        assert (mx[lse_row] == 0).all() and (sm[lse_row] == np.float32(n)).all(), (row, n, sm[lse_row])
    assert min(counts) >= 1


def test_rope0_equals_rope64_with_zero_rope(tmp_path):
    g, cases = generate(tmp_path, "seed-rope0", "rope0-tnd-pa-bfloat16-lse1-rope*")
    o0 = arrays(g, cases["rope0-tnd-pa-bfloat16-lse1-rope0"], "output")
    o64 = arrays(g, cases["rope0-tnd-pa-bfloat16-lse1-rope64"], "output")
    i0 = arrays(g, cases["rope0-tnd-pa-bfloat16-lse1-rope0"], "input")
    i64 = arrays(g, cases["rope0-tnd-pa-bfloat16-lse1-rope64"], "input")
    assert i0["query"].shape[-1] == 512 and i64["query"].shape[-1] == 576
    assert i0["key"].shape[-1] == 528 and i64["key"].shape[-1] == 656
    for name in ("attention_out", "softmax_max", "softmax_sum"):
        assert o0[name].tobytes() == o64[name].tobytes(), name


def test_pipeline_case_keeps_the_sentinel(tmp_path):
    g, cases = generate(tmp_path, "seed-rope0", "pipeline-c8-bfloat16-rope64")
    c = cases["pipeline-c8-bfloat16-rope64"]
    i, o = arrays(g, c, "input"), arrays(g, c, "output")
    assert i["slot_mapping"].tolist() == [0, 1, 2, 3, 4, -1]
    assert SENTINEL == 17 and (i["kv_cache"] == 17).all()
    out = o["kv_cache"].reshape(-1, 656)
    assert (out[5:] == 17).all()  # slots 5.. were never written
    assert (out[:5] != 17).any(axis=1).all()
    # the RoPE bytes of the written rows are 16-bit values, the scales positive fp32
    assert (out[:5, 640:656].copy().view("<f4") > 0).all()


def test_kv_compress_epilog_rows_keep_their_tails(tmp_path):
    g, cases = generate(tmp_path, "kv-compress-epilog", "kvce-mode1-rs")
    c = cases["kvce-mode1-rs"]
    i, o = arrays(g, c, "input"), arrays(g, c, "output")
    cache = o["cache"].reshape(-1, o["cache"].shape[-1])
    slots = i["slot_mapping"].ravel()
    col = 128 + 512 + 8  # quant_mode 1, d 576: kvCacheCol
    written = slots[slots >= 0]
    assert (cache[written, col:] == SENTINEL).all()  # bytes past kvCacheCol are not touched
    others = np.setdiff1d(np.arange(cache.shape[0]), written)
    assert (cache[others] == SENTINEL).all()
    e = next(e for e in c["arrays"] if e["role"] == "output" and e["name"] == "cache")
    assert [s[:3] for s in e["segments"]] == [[0, 128, "bfloat16"], [128, 640, "float8_e4m3fn"],
                                              [640, 648, "float8_e8m0"], [648, e["shape"][-1], "uint8"]]


def test_poisoned_rows_where_no_token_lives(tmp_path):
    g, cases = generate(tmp_path, "seed-rope0", "rope0-bsnd-pa-float16-lse0-rope0")
    c = cases["rope0-bsnd-pa-float16-lse0-rope0"]
    i = arrays(g, c, "input")
    key = i["key"].view(np.uint8).reshape(-1, 128, 528)
    table, kv_lens = i["block_table"], i["actual_seq_lengths_kv"]
    for b, n in enumerate(kv_lens):
        last = table[b, (n - 1) // 128]
        assert (key[last, (n - 1) % 128 + 1:] == POISON).all()  # the tail of the last page
        assert not (key[last, (n - 1) % 128] == POISON).all()
