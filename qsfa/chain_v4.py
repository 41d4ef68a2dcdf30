"""DeepSeek-V4 attention-layer chains (qsfa.chain; docs/golden.md#deepseek-v4-layer-chains).

Three chains, one per attention kind of a V4 layer, each on two paths, wired as vLLM-Ascend's device adaptors wire
one layer step (vllm-project/vllm-ascend@0048b5e vllm_ascend/device/device_op.py: ``dsa_kv_compress_scatter``,
``indexer_quant_scatter``, ``get_dsa_sparse_attn_op``; A5 = Ascend 950, the base adaptor = Atlas A3):

* ``v4-swa``: the new tokens' KV rows into the window cache, then the attention (no compressed part, cmp_ratio 1);
* ``v4-hca``: as SWA plus the compressed rows (cmp_ratio 128) into the compressed cache; the attention reads every
  compressed token below its causal bound;
* ``v4-csa``: as HCA with cmp_ratio 4, plus the indexer cache written for the compressed rows and the V4 indexer
  (``vllm_quant_lightning_indexer``, top-``sparse_count`` over the compressed keys), whose indices the attention
  reads.

Paths (builder parameter ``path``):

* ``"bf16"`` (A3): ``scatter_by_slot`` writes bf16 rows (``npu_scatter_nd_update_v2``); the indexer keys are int8
  codes with fp16 scales written by two ``scatter_by_slot`` links (the int8 quantisation, ``npu_dynamic_quant``,
  is a chain input); attention ``sparse_attn_sharedkv`` (PA_ND, 64 heads, top-512).
* ``"fp8"`` (950): ``kv_compress_epilog_vllm`` (MXFP8, layout 1: 640-byte rows, group 64, round_scale) writes the
  window and compressed caches; ``indexer_compress_epilog_v2`` writes the FP8 indexer keys and their fp32 scales
  into one uint8 block cache, which the indexer reads through two views (the codes region of each block as
  float8_e4m3fn ``[blocks, block_size, 1, 128]`` and its scales region as float32 ``[blocks, block_size, 1]``);
  attention ``kv_quant_sparse_attn_sharedkv`` (kv_quant_mode 1, tile 64, rope 64).

The compressor is not a link yet: the compressed KV rows (``cmp_kv_rows``) and the indexer's compressed key rows
(``index_k_rows``, with ``index_k_scale_rows`` on A3) are chain inputs. To prepend a ``compressor`` link, add it
first in :func:`v4_layer`'s link list and replace the argument :data:`CMP_ROWS` (the ``x`` / ``rows`` argument of
link ``cmp_cache``) with ``"$compressor.<output>"``; nothing else changes. Decode writes one compressed row per
request (slot -1 where the request's new length is no multiple of cmp_ratio, as vLLM-Ascend pads a decode slot
mapping); prefill writes the rows its tokens complete (one slot -1 row when none).
"""

from __future__ import annotations

import numpy as np

from .chain import Chain, ChainError, chain_from_dict, register_chain

__all__ = ["v4_layer", "v4_swa", "v4_csa", "v4_hca", "gen_v4_layer", "v4_request_alone", "CMP_ROWS", "RATIOS",
           "V4_PATHS", "V4_CHAINS"]

#: the chain input a compressor link would produce (the compressed KV rows of this step)
CMP_ROWS = "$input.cmp_kv_rows"
RATIOS = {"swa": 1, "csa": 4, "hca": 128}
#: path -> (chip of the golden sets, attention operator)
V4_PATHS = {"bf16": ("A3", "sparse_attn_sharedkv"), "fp8": ("950", "kv_quant_sparse_attn_sharedkv")}
HEADS, INDEX_HEADS, D, INDEX_D = 64, 64, 512, 128
ROW_640 = 640  # kv_compress_epilog_vllm layout 1, d 512, group 64: 128 RoPE bytes + 448 codes + 7 scales, padded


def _writer(name: str, path: str, cache: str, rows: str, slots: str) -> dict:
    if path == "bf16":
        return {"name": name, "op": "scatter_by_slot",
                "args": {"cache": cache, "rows": {"from": rows, "reshape": [-1, 1, D]}, "slot_mapping": slots}}
    return {"name": name, "op": "kv_compress_epilog_vllm",
            "args": {"kv_compress_cache": cache, "x": rows, "slot_mapping": slots, "quant_group_size": 64,
                     "quant_mode": 2, "round_scale_flag": True, "layout": 1}}


def v4_layer(kind: str, path: str = "bf16", block_size: int = 16, sparse_count: int = 512,
             softmax_scale: float = D ** -0.5, layout_q: str = "TND") -> Chain:
    """One step of a DeepSeek-V4 attention layer (module docstring): ``kind`` "swa" / "csa" / "hca", ``path``
    "bf16" (A3) / "fp8" (950), the caches' ``block_size``, the indexer's ``sparse_count`` (CSA; the attention's
    top-k: 512 on A3, 512 or 1024 on the 950). Inputs: those of :func:`gen_v4_layer`."""
    if kind not in RATIOS:
        raise ChainError("kind", kind, f"must be one of {sorted(RATIOS)}")
    if path not in V4_PATHS:
        raise ChainError("path", path, f"must be one of {sorted(V4_PATHS)}")
    ratio, bs = RATIOS[kind], int(block_size)
    cache_out = "cache" if path == "bf16" else "kv_compress_cache"
    inputs = ["q", "kv_rows", "slot_mapping", "ori_cache", "ori_block_table", "cu_seqlens_q", "seqused_kv", "sinks"]
    links = [_writer("ori_cache", path, "$input.ori_cache", "$input.kv_rows", "$input.slot_mapping")]
    if kind != "swa":
        inputs += ["cmp_kv_rows", "cmp_slot_mapping", "cmp_cache", "cmp_block_table"]
        links.append(_writer("cmp_cache", path, "$input.cmp_cache", CMP_ROWS, "$input.cmp_slot_mapping"))
    if kind == "csa":
        inputs += ["index_query", "index_query_scale", "index_weights", "index_k_rows", "index_cache",
                   "actual_seq_lengths_query"]
        if path == "bf16":  # int8 codes and fp16 scales, two scatters (the base adaptor's indexer_quant_scatter)
            inputs += ["index_k_scale_rows", "index_scale_cache"]
            links.append({"name": "index_cache", "op": "scatter_by_slot",
                          "args": {"cache": "$input.index_cache", "rows": "$input.index_k_rows",
                                   "slot_mapping": "$input.cmp_slot_mapping"}})
            links.append({"name": "index_scale", "op": "scatter_by_slot",
                          "args": {"cache": "$input.index_scale_cache", "rows": "$input.index_k_scale_rows",
                                   "slot_mapping": "$input.cmp_slot_mapping"}})
            key = "$index_cache.cache"
            key_scale = {"from": "$index_scale.cache", "reshape": [-1, bs, 1]}
        else:  # one uint8 block cache: every slot's 128 codes, then every slot's fp32 scale (A5 adaptor)
            links.append({"name": "index_cache", "op": "indexer_compress_epilog_v2",
                          "args": {"indexer_compress_cache": "$input.index_cache", "x": "$input.index_k_rows",
                                   "slot_mapping": "$input.cmp_slot_mapping", "layout": 2}})
            block = bs * (INDEX_D + 4)
            key = {"from": "$index_cache.indexer_compress_cache", "reshape": [-1, block],
                   "columns": [0, bs * INDEX_D], "dtype": "float8_e4m3fn", "shape": [-1, bs, 1, INDEX_D]}
            key_scale = {"from": "$index_cache.indexer_compress_cache", "reshape": [-1, block],
                         "columns": [bs * INDEX_D, block], "dtype": "float32", "shape": [-1, bs, 1]}
        links.append({"name": "indexer", "op": "vllm_quant_lightning_indexer",
                      "args": {"query": "$input.index_query", "key": key, "weights": "$input.index_weights",
                               "query_dequant_scale": "$input.index_query_scale", "key_dequant_scale": key_scale,
                               "actual_seq_lengths_query": "$input.actual_seq_lengths_query",
                               "actual_seq_lengths_key": "$input.seqused_kv", "block_table": "$input.cmp_block_table",
                               "layout_query": layout_q, "layout_key": "PA_BSND", "sparse_count": int(sparse_count),
                               "sparse_mode": 3, "cmp_ratio": ratio}})
    view = (lambda t: f"${t}.{cache_out}") if path == "bf16" else (
        lambda t: {"from": f"${t}.{cache_out}", "reshape": [-1, bs, 1, ROW_640]})
    att = {"q": "$input.q", "ori_kv": view("ori_cache"), "ori_block_table": "$input.ori_block_table",
           "cu_seqlens_q": "$input.cu_seqlens_q", "seqused_kv": "$input.seqused_kv", "sinks": "$input.sinks",
           "softmax_scale": float(softmax_scale), "cmp_ratio": ratio, "ori_mask_mode": 4,
           "cmp_mask_mode": 0 if kind == "swa" else 3, "ori_win_left": 127, "ori_win_right": 0,
           "layout_q": layout_q, "layout_kv": "PA_ND", "return_softmax_lse": False}
    if kind != "swa":
        att.update(cmp_kv=view("cmp_cache"), cmp_block_table="$input.cmp_block_table")
    if kind == "csa":
        att["cmp_sparse_indices"] = "$indexer.sparse_indices"
    if path == "fp8":
        att.update(kv_quant_mode=1, tile_size=64, rope_head_dim=64)
    links.append({"name": "attention", "op": V4_PATHS[path][1], "args": att})
    return chain_from_dict({"name": f"v4-{kind}", "inputs": inputs, "links": links})


def v4_swa(path: str = "bf16", block_size: int = 16, softmax_scale: float = D ** -0.5) -> Chain:
    return v4_layer("swa", path, block_size, softmax_scale=softmax_scale)


def v4_hca(path: str = "bf16", block_size: int = 16, softmax_scale: float = D ** -0.5) -> Chain:
    return v4_layer("hca", path, block_size, softmax_scale=softmax_scale)


def v4_csa(path: str = "bf16", block_size: int = 16, sparse_count: int = 512,
           softmax_scale: float = D ** -0.5) -> Chain:
    return v4_layer("csa", path, block_size, sparse_count, softmax_scale)


V4_CHAINS = {"v4-swa": v4_swa, "v4-csa": v4_csa, "v4-hca": v4_hca}
for _name, _builder in V4_CHAINS.items():
    register_chain(_name, _builder)


# --------------------------------------------------------------------------------------------------
# inputs


def _cmp_rows(q_lens, kv_lens, ratio: int, decode: bool):
    """Per compressed row of this step: (request, compressed position or -1). Decode: one row per request (-1: none
    completed); prefill: the rows the step's tokens complete, or one -1 row when there are none."""
    rows = []
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        done = range((kv - q) // ratio, kv // ratio)
        if decode:
            rows.append((b, done[0] if len(done) else -1))
        else:
            rows += [(b, j) for j in done]
    return rows or [(0, -1)]


def _is_decode(q_lens) -> bool:
    return all(int(q) == 1 for q in q_lens)


def gen_v4_layer(params, rng):
    """The inputs of chain ``v4-<kind>`` (params ``chain`` or ``kind``; ``path``, ``q_lens``, ``kv_lens`` tokens per
    request after the step, ``block_size``, ``chip``): request b's tokens ``kv_lens[b] - q_lens[b]`` .. ``kv_lens[b]
    - 1`` are this step's; the history is already in the caches, written by the same writers (the state a previous
    step left). Unused bf16 cache rows are zero, unused byte caches hold the sentinel byte."""
    import ml_dtypes

    from ._dispatch import run
    from .golden.generators import page_table, randn, sentinel_filled
    from .golden.io import GoldenInputError

    kind = params.get("kind") or str(params.get("chain", "")).replace("v4-", "")
    path, bs = params.get("path", "bf16"), int(params.get("block_size", 16))
    if kind not in RATIOS or path not in V4_PATHS:
        raise GoldenInputError(f"v4 layer: kind {kind!r} / path {path!r} must be one of {sorted(RATIOS)} / "
                               f"{sorted(V4_PATHS)}")
    q_lens = np.asarray(params["q_lens"], np.int64)
    kv_lens = np.asarray(params["kv_lens"], np.int64)
    if q_lens.shape != kv_lens.shape or not q_lens.size or (q_lens < 1).any() or (q_lens > kv_lens).any():
        raise GoldenInputError(f"v4 layer: q_lens {q_lens.tolist()} and kv_lens {kv_lens.tolist()} must pair up "
                               "with 1 <= q_len <= kv_len")
    chip = params.get("chip")
    ratio, fp8 = RATIOS[kind], path == "fp8"
    bf16 = ml_dtypes.bfloat16

    def write(cache, rows, slots):  # the chain's own writer for the history
        if not len(slots):
            return cache
        if fp8:
            return run("kv_compress_epilog_vllm", dict(kv_compress_cache=cache, x=rows, slot_mapping=slots,
                                                       quant_group_size=64, quant_mode=2, round_scale_flag=True,
                                                       layout=1), "reference", chip=chip)
        cache[slots // bs, slots % bs, 0] = rows
        return cache

    def new_cache(n_blocks):
        if fp8:
            return sentinel_filled((n_blocks * bs, 1, ROW_640), np.uint8).view(ml_dtypes.float8_e4m3fn)
        return np.zeros((n_blocks, bs, 1, D), bf16)

    table, n_blocks = page_table(rng, kv_lens, bs)
    table = np.where(table < 0, n_blocks, table).astype(np.int32)  # unused entries: the spare page (the
    # attention's table rule reads ceil(max length / block_size) entries of every row)
    pos = np.concatenate([np.arange(n) for n in kv_lens])
    req = np.repeat(np.arange(kv_lens.size), kv_lens)
    slots = table[req, pos // bs].astype(np.int64) * bs + pos % bs
    new = pos >= np.repeat(kv_lens - q_lens, kv_lens)
    kv = randn(rng, (pos.size, D), "bfloat16", 2.0)
    t_q = int(q_lens.sum())
    out = {"q": rng.uniform(-1, 1, (t_q, HEADS, D)).astype(bf16), "kv_rows": kv[new],
           "slot_mapping": slots[new].astype(np.int32 if fp8 else np.int64),
           "ori_cache": write(new_cache(n_blocks + 1), kv[~new], slots[~new]), "ori_block_table": table,
           "cu_seqlens_q": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
           "seqused_kv": kv_lens.astype(np.int32), "sinks": rng.uniform(-1, 1, HEADS).astype(np.float32)}
    if kind == "swa":
        return out
    n_cmp = kv_lens // ratio
    ctable, c_blocks = page_table(rng, n_cmp, bs)
    ctable = np.where(ctable < 0, c_blocks, ctable).astype(np.int32) if ctable.shape[1] else \
        np.full((kv_lens.size, 1), c_blocks, np.int32)
    cpos = np.concatenate([np.arange(n) for n in n_cmp]).astype(np.int64)
    creq = np.repeat(np.arange(kv_lens.size), n_cmp)
    cslots = ctable[creq, cpos // bs].astype(np.int64) * bs + cpos % bs
    cvals = randn(rng, (cpos.size, D), "bfloat16", 2.0)
    ck = randn(rng, (cpos.size, INDEX_D), "bfloat16")
    cold = cpos < np.repeat((kv_lens - q_lens) // ratio, n_cmp)
    step = _cmp_rows(q_lens, kv_lens, ratio, _is_decode(q_lens))
    first = np.concatenate([[0], np.cumsum(n_cmp)])
    pick = np.array([first[b] + j if j >= 0 else -1 for b, j in step], np.int64)
    step_slots = np.where(pick >= 0, cslots[np.maximum(pick, 0)] if cslots.size else -1, -1)
    fill = randn(rng, (len(step), D), "bfloat16", 2.0)  # a -1 row's values are read by nobody
    out.update(cmp_kv_rows=np.where((pick >= 0)[:, None], cvals[np.maximum(pick, 0)] if cvals.size else fill, fill),
               cmp_slot_mapping=step_slots.astype(np.int32 if fp8 else np.int64),
               cmp_cache=write(new_cache(c_blocks + 1), cvals[cold], cslots[cold]), cmp_block_table=ctable)
    if kind != "csa":
        return out
    kfill = randn(rng, (len(step), INDEX_D), "bfloat16")
    k_rows = np.where((pick >= 0)[:, None], ck[np.maximum(pick, 0)] if ck.size else kfill, kfill)
    out["actual_seq_lengths_query"] = np.cumsum(q_lens).astype(np.int32)
    if fp8:
        cache = np.full((c_blocks + 1, bs, 1, INDEX_D + 4), 0x11, np.uint8)
        if cold.any():
            cache = run("indexer_compress_epilog_v2", dict(indexer_compress_cache=cache, x=ck[cold],
                                                           slot_mapping=cslots[cold].astype(np.int32), layout=2),
                        "reference", chip=chip)
        codes = rng.uniform(-4, 4, (t_q, INDEX_HEADS, INDEX_D)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        out.update(index_query=codes, index_query_scale=rng.uniform(0.01, 0.1, (t_q, INDEX_HEADS)).astype(np.float32),
                   index_weights=rng.uniform(-1, 1, (t_q, INDEX_HEADS)).astype(np.float32), index_k_rows=k_rows,
                   index_cache=cache)
        return out
    # A3: npu_dynamic_quant per row (symmetric int8, scale amax / 127 in fp16) is upstream of the chain
    def quant(x):
        x = np.asarray(x, np.float32)
        s = (np.maximum(np.abs(x).max(-1, keepdims=True), 1e-4) / 127).astype(np.float16)
        return np.clip(np.rint(x / s.astype(np.float32)), -127, 127).astype(np.int8), s

    kc, ks = quant(ck)
    sc, ss = quant(k_rows)
    icache = np.zeros((c_blocks + 1, bs, 1, INDEX_D), np.int8)
    scache = np.zeros((c_blocks + 1, bs, 1, 1), np.float16)
    icache[cslots[cold] // bs, cslots[cold] % bs, 0] = kc[cold]
    scache[cslots[cold] // bs, cslots[cold] % bs, 0] = ks[cold]
    out.update(index_query=rng.integers(-64, 64, (t_q, INDEX_HEADS, INDEX_D)).astype(np.int8),
               index_query_scale=rng.uniform(0.01, 0.1, (t_q, INDEX_HEADS)).astype(np.float16),
               index_weights=rng.uniform(-1, 1, (t_q, INDEX_HEADS)).astype(np.float16),
               index_k_rows=sc[:, None], index_k_scale_rows=ss[:, None, :], index_cache=icache,
               index_scale_cache=scache)
    return out


def v4_request_alone(x: dict, params: dict, r: int) -> tuple[dict, slice, np.ndarray]:
    """Request ``r`` of a V4 chain case (``x`` from :func:`gen_v4_layer`) as a case of its own: its query-token rows,
    its compressed rows (one -1 row when it has none), its block-table rows and lengths; the caches (holding the
    other requests' history) as they are. Returns ``(inputs, its query-row slice, its compressed-row indices)``."""
    q_lens, kv_lens = list(params["q_lens"]), list(params["kv_lens"])
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    rows = slice(int(cu[r]), int(cu[r + 1]))
    out = dict(x)
    for k in ("q", "kv_rows", "slot_mapping", "index_query", "index_query_scale", "index_weights"):
        if k in x:
            out[k] = x[k][rows]
    out.update(ori_block_table=x["ori_block_table"][r:r + 1], cu_seqlens_q=np.array([0, q_lens[r]], np.int32),
               seqused_kv=np.array([kv_lens[r]], np.int32))
    if "actual_seq_lengths_query" in x:
        out["actual_seq_lengths_query"] = np.array([q_lens[r]], np.int32)
    mine = np.array([], np.int64)
    if "cmp_kv_rows" in x:
        kind = str(params.get("kind") or params.get("chain", "")).replace("v4-", "")
        step = _cmp_rows(q_lens, kv_lens, RATIOS[kind], _is_decode(q_lens))
        mine = np.array([i for i, (b, j) in enumerate(step) if b == r and (j >= 0 or _is_decode(q_lens))], np.int64)
        take = mine if mine.size else np.array([0])
        for k in ("cmp_kv_rows", "cmp_slot_mapping", "index_k_rows", "index_k_scale_rows"):
            if k in x:
                out[k] = x[k][take]
        if not mine.size:  # no row of its own: one row that writes nothing
            out["cmp_slot_mapping"] = np.full(1, -1, x["cmp_slot_mapping"].dtype)
        out["cmp_block_table"] = x["cmp_block_table"][r:r + 1]
    return out, rows, mine
