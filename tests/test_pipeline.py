"""c8_pipeline: latent KV -> C8 cache writer -> lightning indexer -> QSFA, end to end.

Independent checks: the caches hold exactly what the writer ops write (slot -1 and unused bytes untouched),
the indices are a dense top-k computed here (integer-valued indexer data: exact scores), and the attention
equals QSFA driven by those indices; in exact mode it equals a plain float64 attention over the tokens
dequantised here from the cache bytes.
"""

import numpy as np
import pytest

import qsfa
from test_attention_support import BF16
from test_indexer import dense_topk

BLOCK = 16
SCALE = 576 ** -0.5


def make_step(rng, lens=(20, 13), heads=4, n1=8):
    t = sum(lens)
    kv = (rng.standard_normal((t, 576)) * 2).astype(BF16)
    gamma = rng.uniform(0.5, 1.5, 512).astype(BF16)
    ang = rng.uniform(0, 2 * np.pi, (t, 32))
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1).astype(BF16)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1).astype(BF16)
    pages = [-(-n // BLOCK) for n in lens]
    n_blocks = sum(pages) + 2
    order = rng.permutation(n_blocks)
    bt = np.zeros((len(lens), max(pages)), np.int32)
    slots, k = [], 0
    for b, n in enumerate(lens):
        for j in range(pages[b]):
            bt[b, j] = order[k]
            k += 1
        slots += [int(bt[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
    slots = np.asarray(slots, np.int64)
    slots[5] = -1  # one token is not cached (vLLM's padding slot)
    iq = rng.integers(-3, 4, (t, n1, 128)).astype(BF16)
    ik = rng.integers(-3, 4, (t, 1, 128)).astype(BF16)
    w = rng.integers(-2, 3, (t, n1)).astype(BF16)
    query = rng.uniform(-1, 1, (t, heads, 576)).astype(BF16)
    return dict(query=query, kv=kv, gamma=gamma, cos=cos, sin=sin, index_query=iq, index_key=ik, weights=w,
                slot_mapping=slots, kv_cache=np.full((n_blocks, BLOCK, 1, 656), 17, np.uint8),
                index_cache=np.zeros((n_blocks, BLOCK, 1, 128), BF16), block_table=bt,
                actual_seq_lengths_query=np.cumsum(lens).astype(np.int32),
                actual_seq_lengths_kv=np.asarray(lens, np.int32)), lens


def test_c8_pipeline_end_to_end():
    rng = np.random.default_rng(0)
    step, lens = make_step(rng)
    k_count = 12
    kv_cache0, index_cache0 = step["kv_cache"].copy(), step["index_cache"].copy()
    out, mx, sm, idx = qsfa.c8_pipeline(**step, scale_value=SCALE, sparse_count=k_count, return_softmax_lse=True)

    # 1. caches: exactly the writer ops' bytes; the -1 slot's row and unused rows untouched
    want_kv = qsfa.c8_rmsnorm_rope_cache(step["kv"], step["gamma"], step["cos"], step["sin"], step["slot_mapping"],
                                         kv_cache0.copy())
    assert step["kv_cache"].tobytes() == want_kv.tobytes()
    written = np.zeros(step["kv_cache"].shape[:2], bool)
    s = step["slot_mapping"][step["slot_mapping"] >= 0]
    written[s // BLOCK, s % BLOCK] = True
    assert (step["kv_cache"][~written] == 17).all()
    assert np.array_equal(step["index_cache"][s // BLOCK, s % BLOCK], step["index_key"][step["slot_mapping"] >= 0])
    assert not step["index_cache"][~written].astype(np.float32).any() and not index_cache0.astype(np.float32).any()

    # 2. indices = a dense top-k over the cached index keys (the skipped token's key is the cache's zero row)
    t = sum(lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    keys = np.zeros((2, max(lens), 128))
    for b, n in enumerate(lens):
        for j in range(n):
            slot = int(step["block_table"][b, j // BLOCK]) * BLOCK + j % BLOCK
            keys[b, j] = step["index_cache"][slot // BLOCK, slot % BLOCK, 0].astype(np.float64)
    q4 = np.zeros((2, max(lens), 8, 128))
    w3 = np.zeros((2, max(lens), 8))
    for b, n in enumerate(lens):
        q4[b, :n] = step["index_query"][starts[b]:starts[b] + n]
        w3[b, :n] = step["weights"][starts[b]:starts[b] + n]
    want_idx, _ = dense_topk(q4, keys, w3, list(lens), list(lens), k_count, 3)
    got_idx = np.zeros_like(want_idx)
    for b, n in enumerate(lens):
        got_idx[b, :n] = idx[starts[b]:starts[b] + n, 0]
        got_idx[b, n:] = -1
    assert np.array_equal(got_idx, want_idx)

    # 3. attention = QSFA over the written cache with those indices
    direct = qsfa.kv_quant_sparse_flash_attention(
        step["query"], step["kv_cache"], step["kv_cache"], idx, SCALE, block_table=step["block_table"],
        actual_seq_lengths_query=step["actual_seq_lengths_query"], actual_seq_lengths_kv=step["actual_seq_lengths_kv"],
        layout_query="TND", layout_kv="PA_BSND", return_softmax_lse=True)
    for a, b in zip((out, mx, sm), direct):
        assert a.tobytes() == b.tobytes()
    assert out.shape == (t, 4, 512) and np.abs(out.astype(np.float32)).max() > 0

    # 4. exact mode: plain float64 attention over tokens dequantised here from the cache bytes
    step2, _ = make_step(np.random.default_rng(0))
    ex = qsfa.c8_pipeline(**step2, scale_value=SCALE, sparse_count=k_count, precision="exact")[0]
    cache = step2["kv_cache"].reshape(-1, 656)
    for b, n in enumerate(lens):
        for i in range(n):
            toks = [int(x) for x in idx[starts[b] + i, 0] if x >= 0]
            rows = cache[[int(step2["block_table"][b, j // BLOCK]) * BLOCK + j % BLOCK for j in toks]]
            scales = np.ascontiguousarray(rows[:, 640:656]).view("<f4").astype(np.float64)
            nope = rows[:, :512].view(np.int8).astype(np.float64) * np.repeat(scales, 128, axis=-1)
            rope = np.ascontiguousarray(rows[:, 512:640]).view(BF16).astype(np.float64)
            q = step2["query"][starts[b] + i].astype(np.float64)
            sc = SCALE * (q @ np.concatenate([nope, rope], axis=-1).T)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            np.testing.assert_allclose(ex[starts[b] + i], (p / p.sum(-1, keepdims=True)) @ nope, rtol=1e-12,
                                       atol=1e-13)


def test_c8_pipeline_rejects_bad_step_before_writing():
    rng = np.random.default_rng(1)
    step, _ = make_step(rng)
    step["slot_mapping"] = step["slot_mapping"].copy()
    step["slot_mapping"][1] = step["slot_mapping"][0]  # duplicate slot: the writer's contract rejects it
    before = step["kv_cache"].tobytes()
    with pytest.raises(qsfa.InvalidArgument):
        qsfa.c8_pipeline(**step, scale_value=SCALE, sparse_count=8)
    assert step["kv_cache"].tobytes() == before


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


#: issue 27: each breaks one step after the writers (indexer / QSFA) or a writer's buffer; the call must be
#: refused by name with both caches byte-identical
_LATE_BREAKS = {
    "scale_value": lambda s: {"scale_value": float("nan")},
    "sparse_count": lambda s: {"sparse_count": 0},
    "block_table": lambda s: {"block_table": s["block_table"] + 1000},
    "actual_seq_lengths_kv": lambda s: {"actual_seq_lengths_kv": s["actual_seq_lengths_kv"].astype(np.int64)},
    "query": lambda s: {"query": s["query"][:, :3].copy()},
    "precision": lambda s: {"precision": "bogus"},
    "index_cache": lambda s: {"index_cache": _readonly(s["index_cache"])},
}


@pytest.mark.parametrize("param", sorted(_LATE_BREAKS))
def test_c8_pipeline_checks_every_step_before_writing(param):
    step, _ = make_step(np.random.default_rng(2))
    kw = {"scale_value": SCALE, "sparse_count": 8}
    change = _LATE_BREAKS[param](step)
    for k, v in change.items():
        (kw if k in kw or k == "precision" else step)[k] = v
    before = (step["kv_cache"].tobytes(), step["index_cache"].tobytes())
    with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype)) as ei:
        qsfa.c8_pipeline(**step, **kw)
    assert f" for {param}, actual: " in str(ei.value), str(ei.value)
    assert (step["kv_cache"].tobytes(), step["index_cache"].tobytes()) == before


def test_c8_pipeline_refuses_caches_that_share_memory():
    step, _ = make_step(np.random.default_rng(3))
    whole = np.zeros(step["kv_cache"].nbytes, np.uint8)
    step["kv_cache"] = whole.reshape(step["kv_cache"].shape)
    step["index_cache"] = whole[:step["index_cache"].nbytes].view(BF16).reshape(step["index_cache"].shape)
    with pytest.raises(qsfa.InvalidArgument, match="for index_cache, actual: shares memory with kv_cache"):
        qsfa.c8_pipeline(**step, scale_value=SCALE, sparse_count=8)
    assert not whole.any()
