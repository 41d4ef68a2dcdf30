"""Batch invariance of the DeepSeek-V4 compressors and attention operators as conformance properties (issue 25).

:func:`batch_properties` is called by :func:`qsfa.conformance.properties.catalogue` beside
:func:`qsfa.conformance.properties_v4.v4_properties`; each expectation is a relation between calls of the same
backend, never a result of the reference:

* ``compressor.batch_slices`` / ``quant_compressor.batch_slices`` / ``vllm_compressor.batch_slices`` (vLLM-Ascend
  #9496; vllm_compressor's sin / cos rows travel with the cmp_kv rows they rotate): each request of a TH call
  (``cu_seqlens``) run alone - its x rows, its seqused / start_pos entries and its state pages (block-table row,
  or ring block) - gives the same ``cmp_kv`` rows (the rows of its completed groups, packed batch after batch in
  the whole call) and the same bytes in its state pages as inside the batch;
* ``compressor.speculative_state`` / ``quant_compressor.speculative_state`` / ``vllm_compressor.speculative_state``
  (vLLM-Ascend #9111): a request's tokens in one call equal the same tokens in one-token calls, each carrying the
  state the previous one left - the rows of the groups they complete and the state bytes of its pages (cache_mode
  1: the ring buffer of cache_mode 2 stores only the last ``coff`` groups a call reaches, so serial calls store rows
  a single call leaves alone; a block-table entry 0, "do not write", is given a page of its own holding block 0's
  bytes, since a skipped write is state the next one-token call cannot read);
* ``<op>.batch_slices`` of the five V4 attention operators: each batch of a BSND query run alone (its query rows,
  top-k rows, seqused / residual entries, and its BSND caches or its block-table rows over the shared paged caches)
  gives the same output and LSE bytes (faithful; exact mode's float64 sums span the call's widest row).

docs/numerics/compressor.md gives the group and state rules both properties rest on.
"""

from __future__ import annotations

import numpy as np

from ._support import call, fail

__all__ = ["batch_properties"]

CMP, QCMP, VCMP = "compressor", "quant_compressor", "vllm_compressor"


def _requests(a: dict):
    """Per request of a TH call: (x rows slice, used tokens, start position, rows of cmp_kv it fills)."""
    cu = np.asarray(a["cu_seqlens"], np.int64)
    nb, r = len(cu) - 1, a["cmp_ratio"]
    lens = np.diff(cu)
    used = lens if a["seqused"] is None else np.asarray(a["seqused"], np.int64)
    starts = np.zeros(nb, np.int64) if a["start_pos"] is None else np.asarray(a["start_pos"], np.int64)
    off, out = 0, []
    for b in range(nb):
        g = int((starts[b] + used[b]) // r - starts[b] // r)
        out.append((slice(int(cu[b]), int(cu[b + 1])), int(used[b]), int(starts[b]), slice(off, off + g)))
        off += g
    return out


def _pages(a: dict, b: int) -> np.ndarray:
    """The state blocks request ``b`` may write (entry 0 of a paged table means "do not write")."""
    t = np.asarray(a["state_block_table"], np.int64)
    if a["cache_mode"] == 2:
        return t[b:b + 1]
    row = t[b]
    return row[row != 0]


def _tables(a: dict, rows, n_rows: int) -> dict:
    """vllm_compressor's sin / cos tables for a call of ``n_rows`` cmp_kv rows whose first rows are the whole
    call's ``rows`` (the rest padding, zeros); {} for the operators without tables."""
    if a.get("rope_sin") is None:
        return {}
    out = {}
    for p in ("rope_sin", "rope_cos"):
        t = np.asarray(a[p])
        got = t[rows]
        out[p] = np.concatenate([got, np.zeros((n_rows - len(got),) + t.shape[1:], t.dtype)])
    return out


def _alone(a: dict, b: int, req) -> dict:
    xs, _, s, rows = req
    n = xs.stop - xs.start
    return dict(a, x=a["x"][xs], cu_seqlens=np.array([0, n], np.int32), start_pos=np.array([s], np.int32),
                seqused=None if a["seqused"] is None else np.asarray(a["seqused"])[b:b + 1],
                state_block_table=np.asarray(a["state_block_table"])[b:b + 1],
                **_tables(a, rows, min(n, n // a["cmp_ratio"] + 1)))


def _same(got, want, what):
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    if got.shape != want.shape or got.tobytes() != want.tobytes():
        n = int((got.view(np.uint8) != want.view(np.uint8)).sum()) if got.shape == want.shape else -1
        fail(f"{what} ({n} bytes differ)" if n >= 0 else f"{what} (shape {got.shape} vs {want.shape})")


def _batch_slices(op, P, examples):
    pins = {"layout": "TH"}

    def check(ex, backend: str):
        a = ex.args
        full = call(op, a, backend)
        for b, req in enumerate(_requests(a)):
            alone = call(op, _alone(a, b, req), backend)
            rows = req[3]
            g = rows.stop - rows.start
            _same(alone["cmp_kv"][:g], full["cmp_kv"][rows],
                  f"request {b} alone gives other cmp_kv rows than inside the batch (cmp_ratio {a['cmp_ratio']}, "
                  f"cache_mode {a['cache_mode']})")
            pages = _pages(a, b)
            _same(alone["state_cache"][pages], full["state_cache"][pages],
                  f"request {b} alone leaves other state bytes in its pages than inside the batch")

    return P(f"{op}.batch_slices", (op,), "metamorphic",
             "Batch invariance (vLLM-Ascend #9496): each request of a TH call run alone (its x rows, seqused and "
             "start_pos entries and state pages) gives byte-identical cmp_kv rows and state-page bytes to the same "
             "request inside the whole call.", examples(op, pins), check, pins)


def _written(one: dict) -> dict:
    """``one`` (a request alone, cache_mode 1) with each block-table entry 0 ("do not write") turned into a page of
    its own holding block 0's bytes: the call reads the same slots, and every token it brings reaches the state
    (a skipped write is state a later one-token call cannot read, so serial and single calls differ there)."""
    t = np.array(one["state_block_table"], np.int32, copy=True)
    z = t == 0
    if not z.any():
        return one
    st = np.asarray(one["state_cache"])
    t[z] = st.shape[0] + np.arange(int(z.sum()), dtype=np.int32)
    grown = np.concatenate([st, np.repeat(st[:1], int(z.sum()), axis=0)])
    return dict(one, state_block_table=t, state_cache=grown)


def _speculative_state(P, examples, op=CMP):
    pins = {"layout": "TH", "cache_mode": 1}

    def check(ex, backend: str):
        a = ex.args
        r = a["cmp_ratio"]
        reqs = _requests(a)
        b = int(np.random.default_rng(ex.seed).integers(len(reqs)))  # one request per example keeps it fast
        req = reqs[b]
        one = _written(_alone(a, b, req))
        xs, used, s, _ = req
        at_once = call(op, one, backend)
        state, rows = one["state_cache"], []
        for i in range(used):  # the same tokens one by one, each call carrying the state the last one left
            step = dict(one, x=a["x"][xs.start + i:xs.start + i + 1], cu_seqlens=np.array([0, 1], np.int32),
                        seqused=None, start_pos=np.array([s + i], np.int32), state_cache=state,
                        **_tables(one, slice(len(rows), len(rows) + 1), 1))
            out = call(op, step, backend)
            state = out["state_cache"]
            if (s + i + 1) % r == 0:
                rows.append(out["cmp_kv"][0])
        g = len(rows)
        if g:
            _same(np.stack(rows), at_once["cmp_kv"][:g],
                  f"request {b}: {used} tokens one by one give other cmp_kv rows than in one call "
                  f"(start_pos {s}, cmp_ratio {r})")
        pages = _pages(one, 0)
        _same(state[pages], at_once["state_cache"][pages],
              f"request {b}: {used} tokens one by one leave other state bytes than one call (start_pos {s})")

    return P(f"{op}.speculative_state", (op,), "metamorphic",
             "Speculative verification (vLLM-Ascend #9111): the tokens of a request (one per example, drawn by its "
             "seed) in one call equal the same tokens in one-token calls carrying the state - byte-identical rows "
             "of the groups they complete and state-page bytes (cache_mode 1).", examples(op, pins), check, pins)


V4_ATTN = ("sparse_flash_mla", "sparse_attn_sharedkv", "mixed_quant_sparse_flash_mla", "kv_quant_sparse_attn_sharedkv",
           "quant_sparse_flash_mla")
# [B, ...] arguments of a BSND query: its rows, its lengths, its top-k rows and (paged caches) its block-table rows
_PER_BATCH = ("q", "ori_sparse_indices", "cmp_sparse_indices", "seqused_q", "seqused_kv", "seqused_ori_kv",
              "seqused_cmp_kv", "cmp_residual_kv")


def _attn_one(a: dict, b: int) -> dict:
    """The V4 attention arguments of batch ``b`` alone (BSND query; BSND caches sliced, paged caches shared through
    the batch's block-table row; sinks and the per-tensor descales stay)."""
    sl = slice(b, b + 1)
    names = list(_PER_BATCH) + (["ori_block_table", "cmp_block_table"] if a["layout_kv"].startswith("PA")
                                else ["ori_kv", "cmp_kv"])
    one = dict(a, metadata=None)  # a tiling belongs to its own call's shapes
    for p in names:
        if a.get(p) is not None:
            one[p] = np.ascontiguousarray(a[p][sl])
    return one


def _attn_batch_slices(op, P, examples):
    # faithful: exact mode's float64 BLAS sums (over a slot layout as wide as the call's widest row) are no bytes
    pins = {"layout_q": "BSND", "batch": (2, 3), "precision": "faithful"}

    def check(ex, backend: str):
        a = ex.args
        full = call(op, a, backend)
        bsz = a["q"].shape[0]
        for b in range(bsz):
            alone = call(op, _attn_one(a, b), backend)
            for name, v in alone.items():
                if v is None or full.get(name) is None or (name == "softmax_lse" and not a["return_softmax_lse"]):
                    continue
                _same(v, full[name][b:b + 1], f"batch {b} alone gives other {name} than inside the batch of {bsz} "
                      f"(layout_kv {a['layout_kv']}, cmp_ratio {a['cmp_ratio']})")

    return P(f"{op}.batch_slices", (op,), "metamorphic",
             "Batch invariance (vLLM-Ascend #9496): each batch of a BSND query run alone (its query rows, top-k "
             "rows, seqused / residual entries and its BSND caches or block-table rows over the shared paged "
             "caches) gives byte-identical output (and LSE) to the same batch inside the whole call (faithful).",
             examples(op, pins), check, pins)


def batch_properties(have: set, P, examples) -> list:
    """The properties of this module whose operators are in ``have`` (``P`` and ``examples`` as for
    :func:`qsfa.conformance.properties_more.more_properties`)."""
    out = []
    for op in (CMP, QCMP, VCMP):
        if op in have:
            out.append(_batch_slices(op, P, examples))
    for op in (CMP, QCMP, VCMP):
        if op in have:
            out.append(_speculative_state(P, examples, op))
    for op in V4_ATTN:
        if op in have:
            out.append(_attn_batch_slices(op, P, examples))
    return out
