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

The CSA and HCA chains start with link ``compressor``: the ``vllm_compressor`` operator (C4A ``cmp_ratio`` 4 /
``coff`` 2 on CSA, C128A 128 / 1 on HCA, D 512) called as vLLM-Ascend's ``Compressor.forward`` calls
``torch.ops._C_ascend.compressor`` (vllm-project/vllm-ascend@182b75e vllm_ascend/models/deepseek_v4/compressor.py
l.212-231: RMSNorm weight ``norm_weight`` - bf16 on A3, fp32 on the 950 -, eps :data:`NORM_EPS`, rope_head_dim 64,
rotary_mode 2, cache_mode 1, seqused None; the cos / sin rows ``compress_cos`` / ``compress_sin`` that
``compressor_metadata`` gathers from :func:`compress_rope_table`), fed the step's hidden rows ``x`` (TH, the query's
``cu_seqlens_q``), ``wkv`` / ``wgate`` / ``ape``, the fp32 ``state_cache`` with its ``state_block_table`` and
``start_pos`` (each request's length before the step); link ``cmp_cache`` writes its ``cmp_kv`` (:data:`CMP_ROWS`)
as it comes. The compressor packs its rows: one per group the step completes, request after request, then padding up
to ``min(T, T // cmp_ratio + B)`` rows. ``cmp_slot_mapping`` has one entry per compressor row: the cache slot of the
i-th completed group, -1 for every padding row (so a decode step of B requests writes B rows, the completed groups
first; a request completing none writes nothing). This is the rule of vLLM-Ascend's ``compressor_metadata`` kernel,
which makes the slot mapping the compressor's rows are scattered with and their cos / sin rows
(:func:`compressor_metadata`; the generator computes ``cmp_slot_mapping``, ``compress_cos`` and ``compress_sin``
with it).

The indexer's keys on the 950 path come from its own compressor, as in vLLM-Ascend (vllm-project/vllm-ascend@182b75e
vllm_ascend/models/deepseek_v4/indexer.py ``DeepseekV4Indexer._indexer_qkv_prepare``: the indexer's
``Compressor(4, 128)`` gives its rows and their slot mapping, and ``quantize_key_and_update_cache`` - the A5 adaptor's
``indexer_quant_scatter_part1`` - passes the rows to ``indexer_compress_epilog_v2``). Link ``index_compressor`` (the
same ``vllm_compressor`` call with the C4Li triple: cmp_ratio 4, coff 2, D 128; the step's ``x``, the same cos / sin
rows, its own ``index_wkv`` / ``index_wgate`` / ``index_ape`` / ``index_norm_weight`` and fp32
``index_state_cache``, paged by the same ``state_block_table``) feeds its packed rows (:data:`INDEX_ROWS`) to link
``index_cache`` with the same ``cmp_slot_mapping`` (both compressors have ratio 4, so the same rows complete). Not
modelled between the two: the Hadamard rotation (``rotate_activation``) of the indexer's key rows. On the A3 path
the keys are int8 codes with fp16 scales from ``npu_dynamic_quant`` (no qsfa operator), so the indexer's key rows
(``index_k_rows``, ``index_k_scale_rows``) stay chain inputs there, in the compressor's row order.
"""

from __future__ import annotations

import numpy as np

from .chain import Chain, ChainError, chain_from_dict, register_chain

__all__ = ["v4_layer", "v4_swa", "v4_csa", "v4_hca", "gen_v4_layer", "v4_request_alone", "CMP_ROWS", "CMP_SCENARIOS",
           "RATIOS", "V4_PATHS", "V4_CHAINS", "C4LI", "INDEX_ROWS", "compressor_slots", "carried", "v4_two_steps",
           "compressor_metadata", "compress_rope_table", "NORM_EPS", "ROPE_DIM", "ROTARY_MODE", "COMPRESS_ROPE"]

#: what link cmp_cache writes: the compressor link's packed rows (module docstring)
CMP_ROWS = "$compressor.cmp_kv"
#: kind -> (cmp_ratio, coff) of the compressor link (C4A on CSA, C128A on HCA; D 512 both)
CMP_SCENARIOS = {"csa": (4, 2), "hca": (128, 1)}
#: (cmp_ratio, coff, D) of the indexer's own compressor link ``index_compressor`` (CSA, 950 path)
C4LI = (4, 2, 128)
#: what link index_cache writes on the 950 path: the C4Li compressor's packed rows
INDEX_ROWS = "$index_compressor.cmp_kv"
HIDDEN = 1024  # the chain's hidden size: the compressor's smallest (DeepSeek-V4 has 7168; cost, not numerics)
RATIOS = {"swa": 1, "csa": 4, "hca": 128}
#: path -> (chip of the golden sets, attention operator)
V4_PATHS = {"bf16": ("A3", "sparse_attn_sharedkv"), "fp8": ("950", "kv_quant_sparse_attn_sharedkv")}
HEADS, INDEX_HEADS, D, INDEX_D = 64, 64, 512, 128
#: the compressors' RMSNorm epsilon (DeepSeek-V4 ``rms_norm_eps``), RoPE lanes (``qk_rope_head_dim``) and rotary
#: mode (vLLM-Ascend passes 2, interleaved pairs)
NORM_EPS, ROPE_DIM, ROTARY_MODE = 1e-6, 64, 2
#: the compressed layers' RoPE table as vLLM-Ascend builds it (:func:`compress_rope_table`): base
#: ``compress_rope_theta``, YaRN factor, original length, beta_fast, beta_slow of DeepSeek-V4's configuration
COMPRESS_ROPE = (160000.0, 16.0, 65536, 32.0, 1.0)
ROW_640 = 640  # kv_compress_epilog_vllm layout 1, d 512, group 64: 128 RoPE bytes + 448 codes + 7 scales, padded


def _writer(name: str, path: str, cache: str, rows: str, slots: str) -> dict:
    if path == "bf16":
        return {"name": name, "op": "scatter_by_slot",
                "args": {"cache": cache, "rows": {"from": rows, "reshape": [-1, 1, D]}, "slot_mapping": slots}}
    return {"name": name, "op": "kv_compress_epilog_vllm",
            "args": {"kv_compress_cache": cache, "x": rows, "slot_mapping": slots, "quant_group_size": 64,
                     "quant_mode": 2, "round_scale_flag": True, "layout": 1}}


def _compressor(name: str, prefix: str, ratio: int, coff: int, cache_mode: int) -> dict:
    """A compressor link as vLLM-Ascend's ``Compressor.forward`` calls ``_C_ascend.compressor`` (module docstring):
    its own weights, ape, state and RMSNorm weight (names prefixed ``prefix``), the shared state table, start
    positions and cos / sin rows, rope_head_dim 64, rotary_mode 2, norm_eps :data:`NORM_EPS`."""
    return {"name": name, "op": "vllm_compressor",
            "args": {"x": "$input.x", "wkv": f"$input.{prefix}wkv", "wgate": f"$input.{prefix}wgate",
                     "state_cache": f"$input.{prefix}state_cache", "ape": f"$input.{prefix}ape",
                     "norm_weight": f"$input.{prefix}norm_weight", "rope_sin": "$input.compress_sin",
                     "rope_cos": "$input.compress_cos", "state_block_table": "$input.state_block_table",
                     "cu_seqlens": "$input.cu_seqlens_q", "seqused": None, "start_pos": "$input.start_pos",
                     "rope_head_dim": ROPE_DIM, "cmp_ratio": ratio, "coff": coff, "norm_eps": NORM_EPS,
                     "rotary_mode": ROTARY_MODE, "cache_mode": int(cache_mode)}}


def v4_layer(kind: str, path: str = "bf16", block_size: int = 16, sparse_count: int = 512,
             softmax_scale: float = D ** -0.5, layout_q: str = "TND", cache_mode: int = 1) -> Chain:
    """One step of a DeepSeek-V4 attention layer (module docstring): ``kind`` "swa" / "csa" / "hca", ``path``
    "bf16" (A3) / "fp8" (950), the caches' ``block_size``, the indexer's ``sparse_count`` (CSA; the attention's
    top-k: 512 on A3, 512 or 1024 on the 950), the compressors' ``cache_mode`` (1 paged state; 2 one ring-buffer
    block per request, the 950 path only). Inputs: those of :func:`gen_v4_layer`."""
    if kind not in RATIOS:
        raise ChainError("kind", kind, f"must be one of {sorted(RATIOS)}")
    if path not in V4_PATHS:
        raise ChainError("path", path, f"must be one of {sorted(V4_PATHS)}")
    if cache_mode not in (1, 2) or isinstance(cache_mode, bool):
        raise ChainError("cache_mode", cache_mode, "must be 1 (paged compressor state) or 2 (one ring-buffer block "
                         "per request)")
    if cache_mode == 2 and path != "fp8":
        raise ChainError("cache_mode", cache_mode, "the compressor's ring-buffer state is the 950's (the A3 takes "
                         "cache_mode 1 only): path 'fp8'")
    ratio, bs = RATIOS[kind], int(block_size)
    cache_out = "cache" if path == "bf16" else "kv_compress_cache"
    inputs = ["q", "kv_rows", "slot_mapping", "ori_cache", "ori_block_table", "cu_seqlens_q", "seqused_kv", "sinks"]
    links = [_writer("ori_cache", path, "$input.ori_cache", "$input.kv_rows", "$input.slot_mapping")]
    if kind != "swa":
        inputs += ["x", "wkv", "wgate", "ape", "state_cache", "state_block_table", "start_pos", "cmp_slot_mapping",
                   "cmp_cache", "cmp_block_table"]
        inputs += ["norm_weight", "compress_cos", "compress_sin"]
        links.insert(0, _compressor("compressor", "", ratio, CMP_SCENARIOS[kind][1], cache_mode))
        links.append(_writer("cmp_cache", path, "$input.cmp_cache", CMP_ROWS, "$input.cmp_slot_mapping"))
    if kind == "csa":
        inputs += ["index_query", "index_query_scale", "index_weights", "index_cache", "actual_seq_lengths_query"]
        if path == "bf16":  # int8 codes and fp16 scales, two scatters (the base adaptor's indexer_quant_scatter)
            inputs += ["index_k_rows", "index_k_scale_rows", "index_scale_cache"]
            links.append({"name": "index_cache", "op": "scatter_by_slot",
                          "args": {"cache": "$input.index_cache", "rows": "$input.index_k_rows",
                                   "slot_mapping": "$input.cmp_slot_mapping"}})
            links.append({"name": "index_scale", "op": "scatter_by_slot",
                          "args": {"cache": "$input.index_scale_cache", "rows": "$input.index_k_scale_rows",
                                   "slot_mapping": "$input.cmp_slot_mapping"}})
            key = "$index_cache.cache"
            key_scale = {"from": "$index_scale.cache", "reshape": [-1, bs, 1]}
        else:
            inputs += ["index_wkv", "index_wgate", "index_ape", "index_state_cache", "index_norm_weight"]
            # one uint8 block cache: every slot's 128 codes, then every slot's fp32 scale (A5 adaptor), written
            # from the packed rows of the indexer's own C4Li compressor (module docstring)
            links.append(_compressor("index_compressor", "index_", ratio, C4LI[1], cache_mode))
            links.append({"name": "index_cache", "op": "indexer_compress_epilog_v2",
                          "args": {"indexer_compress_cache": "$input.index_cache", "x": INDEX_ROWS,
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


def v4_hca(path: str = "bf16", block_size: int = 16, softmax_scale: float = D ** -0.5, cache_mode: int = 1) -> Chain:
    return v4_layer("hca", path, block_size, softmax_scale=softmax_scale, cache_mode=cache_mode)


def v4_csa(path: str = "bf16", block_size: int = 16, sparse_count: int = 512,
           softmax_scale: float = D ** -0.5, cache_mode: int = 1) -> Chain:
    return v4_layer("csa", path, block_size, sparse_count, softmax_scale, cache_mode=cache_mode)


V4_CHAINS = {"v4-swa": v4_swa, "v4-csa": v4_csa, "v4-hca": v4_hca}
for _name, _builder in V4_CHAINS.items():
    register_chain(_name, _builder)


# --------------------------------------------------------------------------------------------------
# inputs


def _cmp_rows(q_lens, kv_lens, ratio: int):
    """The compressor's output rows of this step: (request, compressed position) per group the step completes,
    request after request, then (-1, -1) padding up to ``min(T, T // ratio + B)`` rows (module docstring)."""
    rows = []
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        rows += [(b, j) for j in range((kv - q) // ratio, kv // ratio)]
    t = int(sum(q_lens))
    return rows + [(-1, -1)] * (min(t, t // ratio + len(q_lens)) - len(rows))


def compressor_slots(cu_seqlens, start_pos, block_table, block_size: int, cmp_ratio: int, n_rows: int) -> np.ndarray:
    """The slot mapping of :func:`compressor_metadata` alone (no cos / sin tables)."""
    return compressor_metadata(cu_seqlens, start_pos, block_table, block_size, cmp_ratio, n_rows)[2]


def compressor_metadata(cu_seqlens, start_pos, block_table, block_size: int, cmp_ratio: int, n_rows: int,
                        rope_cos=None, rope_sin=None):
    """``(compress_cos, compress_sin, slot_mapping)`` of a compressor call's packed rows, as vLLM-Ascend's
    ``compressor_metadata`` kernel computes them in its flat format (vllm-project/vllm-ascend@182b75e
    ``csrc/attention/compressor_metadata/op_kernel/compressor_metadata.h``: ``BuildCompressedPrefix``,
    ``ProcessValidRows``, ``ProcessTile``, ``CopyRopeTile``, ``WriteSlotTile``, ``WriteInvalidTile``): request b
    fills ``(start_pos[b] + len_b) // r - start_pos[b] // r`` rows (none when its start is negative or it has no
    token), request after request; its i-th row is compressed position ``p = start_pos[b] // r + i``, at slot
    ``block_table[b, p // block_size] * block_size + p % block_size`` with the RoPE row of the group's first token,
    ``rope_cos[p * r]`` / ``rope_sin[p * r]``. Slot -1 with cos 1 / sin 0 (no rotation) where that table column is
    past the table or holds a negative block id, and for every row past the filled ones (padding up to
    ``n_rows``). The kernel also writes an invalid row where the group's RoPE position lies past the cos / sin
    tables (per tile); that is refused here (the chain's tables cover every position). Without tables, the cos /
    sin results are None."""
    cu = np.asarray(cu_seqlens, np.int64)
    starts = np.asarray(start_pos, np.int64)
    table = np.asarray(block_table, np.int64)
    r, bs = int(cmp_ratio), int(block_size)
    out = np.full(int(n_rows), -1, np.int64)
    pos = np.full(int(n_rows), -1, np.int64)  # the RoPE row of each valid row
    row = 0
    for b in range(starts.size):
        n = int(cu[b + 1] - cu[b])
        s = int(starts[b])
        filled = (s + n) // r - s // r if s >= 0 and n > 0 else 0
        for i in range(min(filled, out.size - row)):
            p = s // r + i
            col = p // bs
            if col < table.shape[1] and table[b, col] >= 0:
                out[row] = table[b, col] * bs + p % bs
                pos[row] = p * r
            row += 1
    if rope_cos is None:
        return None, None, out
    rope_cos, rope_sin = np.asarray(rope_cos), np.asarray(rope_sin)
    if pos.max(initial=-1) >= rope_cos.shape[0]:
        raise ChainError("rope_cos", f"{rope_cos.shape[0]} rows", f"must cover RoPE position {int(pos.max())}")
    cos = np.ones((out.size, rope_cos.shape[-1]), rope_cos.dtype)
    sin = np.zeros((out.size, rope_sin.shape[-1]), rope_sin.dtype)
    ok = pos >= 0
    cos[ok], sin[ok] = rope_cos[pos[ok]], rope_sin[pos[ok]]
    return cos, sin, out


def compress_rope_table(n_pos: int, base: float = COMPRESS_ROPE[0], factor: float = COMPRESS_ROPE[1],
                        original: int = COMPRESS_ROPE[2], beta_fast: float = COMPRESS_ROPE[3],
                        beta_slow: float = COMPRESS_ROPE[4]) -> tuple[np.ndarray, np.ndarray]:
    """Rows 0 .. ``n_pos - 1`` of the compressed layers' full RoPE table, fp32 ``[n_pos, 64]``, as vLLM-Ascend builds
    it (vllm-project/vllm-ascend@182b75e vllm_ascend/ops/rope_dsv4.py l.195-210 ``ComplexExpRotaryEmbedding``,
    l.243-289 ``precompute_freqs_cis``, called with ``original_max_position_embeddings`` for both lengths:
    vllm_ascend/models/deepseek_v4/model.py l.522-538, l.663): YaRN-blended fp32 inverse frequencies, fp32 angles
    ``t * inv_freq``, cos / sin, each repeated for the two lanes of a pair (interleaved, rotary_mode 2). The cos /
    sin here are float64 results rounded to fp32 (the device's fp32 cos may differ in the last bit; the tables are
    chain inputs, stored with every set)."""
    import math

    dim = ROPE_DIM

    def corr(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extra = np.float32(1) / pos_freqs
    inter = np.float32(1) / (np.float32(factor) * pos_freqs)
    mask = np.float32(1) - ramp.astype(np.float32)
    inv = inter * (np.float32(1) - mask) + extra * mask
    ang = (np.arange(int(n_pos), dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
    cos = np.repeat(np.cos(ang).astype(np.float32), 2, axis=-1)
    sin = np.repeat(np.sin(ang).astype(np.float32), 2, axis=-1)
    return cos, sin


def _weights(rng, shape):
    """Compressor weights: ``0.03 * N(0, 1)`` on a grid of 2^-11, clipped to +-255 steps (every value exact in bf16).
    The grid bounds each weight row's exponent span, so the faithful reference proves every projection's RN32 from
    the float64 product without exact re-summation (its cost with raw randn weights doubled the chain tests' time);
    the compressor's own golden sets cover unbounded spans."""
    import ml_dtypes

    k = np.clip(np.rint(rng.standard_normal(shape) * (0.03 * 2 ** 11)), -255, 255)
    return (k * 2.0 ** -11).astype(ml_dtypes.bfloat16)


def gen_v4_layer(params, rng):
    """The inputs of chain ``v4-<kind>`` (:func:`_gen_v4_layer`), then the compressors' RMSNorm weights ``1 + 0.1
    N(0, 1)``: bf16 (x's dtype) on the A3 path, fp32 on the 950's (vLLM-Ascend's ``Compressor`` builds its
    ``RMSNorm`` in fp32 on A5); drawn last, so every other input is the same as without them."""
    import ml_dtypes

    out = _gen_v4_layer(params, rng)
    if "x" in out:
        dt = np.float32 if params.get("path", "bf16") == "fp8" else ml_dtypes.bfloat16
        for pre, d in (("", D), ("index_", INDEX_D)):
            if pre == "" or "index_wkv" in out:
                out[f"{pre}norm_weight"] = (1.0 + 0.1 * rng.standard_normal(d)).astype(dt)
    return out


def _gen_v4_layer(params, rng):
    """The inputs of chain ``v4-<kind>`` (params ``chain`` or ``kind``; ``path``, ``q_lens``, ``kv_lens`` tokens per
    request after the step, ``block_size``, ``chip``, ``cache_mode``): request b's tokens ``kv_lens[b] - q_lens[b]`` .. ``kv_lens[b]
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
    cvals = randn(rng, (cpos.size, D), "bfloat16", 0.5)  # the history: rows of the compressor's size
    ck = randn(rng, (cpos.size, INDEX_D), "bfloat16")
    cold = cpos < np.repeat((kv_lens - q_lens) // ratio, n_cmp)
    step = _cmp_rows(q_lens, kv_lens, ratio)
    first = np.concatenate([[0], np.cumsum(n_cmp)])
    pick = np.array([first[b] + j if j >= 0 else -1 for b, j in step], np.int64)
    step_cos, step_sin, step_slots = compressor_metadata(out["cu_seqlens_q"], kv_lens - q_lens, ctable, bs, ratio,
                                                         len(step), *compress_rope_table(int(kv_lens.max())))
    # the compressor link: the step's hidden rows, weights (about randn 0.03: kv of std ~0.5), ape, and the fp32
    # state of each request's last coff groups before the step (the only positions the step's groups read; randn,
    # kv part * 0.5), in pages of block_size; every other table entry is 0 (block 0: not written, not read)
    coff, start = CMP_SCENARIOS[kind][1], kv_lens - q_lens
    cd = coff * D
    lo = np.maximum(start // ratio - (coff - 1), 0) * ratio
    if int(params.get("cache_mode", 1)) == 2:  # ring buffer (950): one block per request, of the contract's least
        # size coff * cmp_ratio + S - 1, every row random (whichever rows the step's positions map to)
        sbs = coff * ratio + int(q_lens.max()) - 1
        k = kv_lens.size
        stable = (1 + rng.permutation(k)).astype(np.int32)
    else:
        sbs = bs
        width = -(-int(start.max() + q_lens.max()) // bs)  # the contract's ceil(Smax / block_size)
        stable = np.zeros((kv_lens.size, width), np.int32)
        need = [np.arange(int(lo[b_]) // bs, -(-int(kv_lens[b_]) // bs)) for b_ in range(kv_lens.size)]
        ids = 1 + rng.permutation(sum(n.size for n in need))
        k = 0
        for b_, n in enumerate(need):
            stable[b_, n] = ids[k:k + n.size]
            k += n.size
    state = np.concatenate([rng.standard_normal((k + 1, sbs, cd)) * 0.5, rng.standard_normal((k + 1, sbs, cd))], -1)
    out.update(x=randn(rng, (t_q, HIDDEN), "bfloat16", 0.5), wkv=_weights(rng, (cd, HIDDEN)),
               wgate=_weights(rng, (cd, HIDDEN)),
               ape=rng.standard_normal((ratio, cd)).astype(np.float32), state_cache=state.astype(np.float32),
               state_block_table=stable, start_pos=start.astype(np.int32),
               cmp_slot_mapping=step_slots.astype(np.int32 if fp8 else np.int64), compress_cos=step_cos,
               compress_sin=step_sin,
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
                   index_weights=rng.uniform(-1, 1, (t_q, INDEX_HEADS)).astype(np.float32), index_cache=cache)
        # the indexer's C4Li compressor (coff 2, D 128): its own weights, ape and fp32 state, drawn as the
        # attention compressor's, in its own state cache paged by the same state_block_table (same ratio and coff:
        # the same pages hold the positions its groups read)
        icd = C4LI[1] * INDEX_D
        istate = np.concatenate([rng.standard_normal((k + 1, sbs, icd)) * 0.5,
                                 rng.standard_normal((k + 1, sbs, icd))], -1)
        out.update(index_wkv=_weights(rng, (icd, HIDDEN)), index_wgate=_weights(rng, (icd, HIDDEN)),
                   index_ape=rng.standard_normal((ratio, icd)).astype(np.float32),
                   index_state_cache=istate.astype(np.float32))
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
    """Request ``r`` of a V4 chain case (``x`` from :func:`gen_v4_layer`) as a case of its own: its query-token and
    hidden rows, its start position, its block-table and state-table rows and lengths, its compressed rows (the
    compressor's packing for one request: its groups, then -1 padding rows); the caches and the state (holding the
    other requests' history) as they are. Returns ``(inputs, its query-row slice, the indices of its compressed rows
    among the batch's)`` - alone, they are its first rows in the same order."""
    q_lens, kv_lens = list(params["q_lens"]), list(params["kv_lens"])
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    rows = slice(int(cu[r]), int(cu[r + 1]))
    out = dict(x)
    for k in ("q", "kv_rows", "slot_mapping", "index_query", "index_query_scale", "index_weights", "x"):
        if k in x:
            out[k] = x[k][rows]
    out.update(ori_block_table=x["ori_block_table"][r:r + 1], cu_seqlens_q=np.array([0, q_lens[r]], np.int32),
               seqused_kv=np.array([kv_lens[r]], np.int32))
    if "actual_seq_lengths_query" in x:
        out["actual_seq_lengths_query"] = np.array([q_lens[r]], np.int32)
    mine = np.array([], np.int64)
    if "cmp_slot_mapping" in x:
        kind = str(params.get("kind") or params.get("chain", "")).replace("v4-", "")
        ratio = RATIOS[kind]
        step = _cmp_rows(q_lens, kv_lens, ratio)
        mine = np.array([i for i, (b, _) in enumerate(step) if b == r], np.int64)
        n_alone = len(_cmp_rows(q_lens[r:r + 1], kv_lens[r:r + 1], ratio))
        take = np.concatenate([mine, np.zeros(n_alone - mine.size, np.int64)])  # padding: any row, slot -1
        for k in _CMP_ROW_INPUTS:
            if k in x:
                out[k] = x[k][take]
        _pad_rows(out, np.arange(take.size) >= mine.size)
        out.update(cmp_block_table=x["cmp_block_table"][r:r + 1], state_block_table=x["state_block_table"][r:r + 1],
                   start_pos=x["start_pos"][r:r + 1])
    return out, rows, mine


#: per-token (TH row) inputs of the V4 chains
_TOKEN_ROWS = ("q", "kv_rows", "slot_mapping", "x", "index_query", "index_query_scale", "index_weights")
#: the compressor's packed rows: one entry per compressor output row
_CMP_ROW_INPUTS = ("cmp_slot_mapping", "index_k_rows", "index_k_scale_rows", "compress_cos", "compress_sin")


def _pad_rows(out: dict, pad) -> None:
    """Padding rows of the compressors (``pad`` True) as compressor_metadata writes them: slot -1, cos 1, sin 0."""
    out["cmp_slot_mapping"][pad] = -1
    if "compress_cos" in out:
        out["compress_cos"][pad] = 1
        out["compress_sin"][pad] = 0


def carried(chain: Chain) -> dict[str, str]:
    """``{chain input: tensor}``: each cache or state a link of ``chain`` updates in place (an argument
    ``$input.<name>`` of an in-place parameter) and the output holding it after the step - what the next step reads
    as that input."""
    from .chain import _spec

    out = {}
    for lk in chain.links:
        for p in _spec(lk.op).inplace:
            v = lk.args.get(p)
            if isinstance(v, str) and v.startswith("$input."):
                out[v[len("$input."):]] = f"{lk.name}.{p}"
    return out


def v4_two_steps(x: dict, params: dict, first) -> tuple[dict, dict, object]:
    """One step of a V4 chain case (``x`` from :func:`gen_v4_layer`, ``params`` its parameters) cut in two: the first
    ``first[b]`` of request b's step tokens, then the rest (each request keeps at least one token in each step).
    Returns ``(params1, inputs1, second)``: ``second(tensors1)`` gives ``(params2, inputs2)``, the second step's
    inputs with every cache and state the first step wrote (:func:`carried`) taken from ``tensors1`` (what
    :func:`qsfa.chain.run_chain` returned) - the second step's compressed history is derived from the state the
    first step left. Each step's compressed rows are the compressor's packing for that step (its completed groups
    request after request, then padding rows at slot -1)."""
    kind = str(params.get("kind") or params.get("chain", "")).replace("v4-", "")
    q_lens, kv_lens = [int(n) for n in params["q_lens"]], [int(n) for n in params["kv_lens"]]
    first = [int(n) for n in first]
    if len(first) != len(q_lens) or any(not 1 <= f < q for f, q in zip(first, q_lens)):
        raise ChainError("first", first, f"must give each request 1 .. q_len - 1 tokens (q_lens {q_lens})")
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    ratio = RATIOS[kind]
    full = _cmp_rows(q_lens, kv_lens, ratio)
    at = {bj: i for i, bj in enumerate(full) if bj[0] >= 0}

    def step(qs, kvs, token_rows):
        p = dict(params, q_lens=qs, kv_lens=kvs)
        out = dict(x)
        for k in _TOKEN_ROWS:
            if k in x:
                out[k] = x[k][token_rows]
        out.update(cu_seqlens_q=np.concatenate([[0], np.cumsum(qs)]).astype(np.int32),
                   seqused_kv=np.asarray(kvs, np.int32))
        if "actual_seq_lengths_query" in x:
            out["actual_seq_lengths_query"] = np.cumsum(qs).astype(np.int32)
        if "cmp_slot_mapping" in x:
            rows = _cmp_rows(qs, kvs, ratio)
            take = np.array([at[bj] if bj[0] >= 0 else 0 for bj in rows], np.int64)
            for k in _CMP_ROW_INPUTS:
                if k in x:
                    out[k] = x[k][take]
            _pad_rows(out, np.array([bj[0] < 0 for bj in rows], bool))
            out["start_pos"] = (np.asarray(kvs) - np.asarray(qs)).astype(np.int32)
        return p, out

    rows1 = np.concatenate([np.arange(cu[b], cu[b] + f) for b, f in enumerate(first)])
    rows2 = np.concatenate([np.arange(cu[b] + f, cu[b + 1]) for b, f in enumerate(first)])
    kv1 = [kv - q + f for kv, q, f in zip(kv_lens, q_lens, first)]
    p1, x1 = step(first, kv1, rows1)

    def second(tensors1: dict):
        from .chain import get_chain

        p2, x2 = step([q - f for q, f in zip(q_lens, first)], kv_lens, rows2)
        for name, t in carried(get_chain(f"v4-{kind}", params, ignore_unknown=True)).items():
            x2[name] = tensors1[t]
        return p2, x2

    return p1, x1, second

