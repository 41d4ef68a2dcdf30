"""Front door of the DeepSeek-V4 KV compressor (C4A / C4Li / C128A): ``compressor``.

The public callable is ``cann_ops_transformer.ops.compressor`` (ops-transformer ``attention/compressor/``, Atlas A3
and Ascend 950). Reference: :mod:`qsfa.reference.compressor`; numerics in ``docs/numerics/compressor.md``.
``state_cache`` is listed in the contract's ``inplace``; a rejected call writes nothing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import all_finite, dtype_in, edit_params, is_int, rule, set_param
from .._contract import Contract, copy_args, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import compressor as _cr

__all__ = ["compressor", "quant_compressor", "CMP", "CMP_CONTRACT", "QCMP", "QCMP_CONTRACT", "compressor_case"]

BF16 = ml_dtypes.bfloat16
CMP = "compressor"
SRC = ("cannmirror/ops-transformer@c8f98a3 attention/compressor/ (docs/aclnnCompressor.md, "
       "op_host/arch35/compressor_tiling.cpp); docs/numerics/compressor.md")
X_DTYPES = ("float16", "bfloat16")


def _example(rng):
    h, d, r, cf = 1024, 128, 4, 2
    x = (rng.standard_normal((7, h)) * 0.5).astype(BF16)
    wkv = (rng.standard_normal((cf * d, h)) * 0.05).astype(BF16)
    wgate = (rng.standard_normal((cf * d, h)) * 0.05).astype(BF16)
    state = rng.standard_normal((5, 4, 2 * cf * d)).astype(np.float32)
    ape = rng.standard_normal((r, cf * d)).astype(np.float32)
    return dict(x=x, wkv=wkv, wgate=wgate, state_cache=state, ape=ape,
                state_block_table=np.array([[1, 2], [3, 0]], np.int32), cu_seqlens=np.array([0, 5, 7], np.int32),
                seqused=None, start_pos=np.array([3, 0], np.int32), cmp_ratio=r, coff=cf, cache_mode=1,
                precision="faithful")


def compressor_case(seed=0, *, scenario=(4, 2, 128), lens=(5, 2), starts=(3, 0), layout="TH", seqused=None,
                    cache_mode=1, block_size=4, x_dtype="bfloat16", hidden=1024):
    """The arrays of a compressor call (golden cases, benchmarks): x ``randn * 0.5``, weights ``randn * 0.03`` in
    ``x_dtype``, ape and the state ``randn`` (fp32); cache_mode 1: blocks 1.. in a shuffled table (block 0 unused),
    cache_mode 2: one ring block per batch of ``coff * r + S - 1`` rows (``block_size`` ignored)."""
    rng = np.random.default_rng(seed)
    r, cf, d = scenario
    xdt = BF16 if x_dtype == "bfloat16" else np.float16
    nb, s = len(lens), max(lens)
    x = (rng.standard_normal((sum(lens) if layout == "TH" else nb * s, hidden)) * 0.5).astype(xdt)
    if layout == "BSH":
        x = x.reshape(nb, s, hidden)
    out = dict(x=x, wkv=(rng.standard_normal((cf * d, hidden)) * 0.03).astype(xdt),
               wgate=(rng.standard_normal((cf * d, hidden)) * 0.03).astype(xdt),
               ape=rng.standard_normal((r, cf * d)).astype(np.float32), start_pos=np.array(starts, np.int32))
    if layout == "TH":
        out["cu_seqlens"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if seqused is not None:
        out["seqused"] = np.array(seqused, np.int32)
    if cache_mode == 2:
        bs, nblk = cf * r + s - 1, nb + 1
        out["state_block_table"] = rng.permutation(nblk)[:nb].astype(np.int32)
    else:
        bs = block_size
        width = -(-(max(starts) + s) // bs)
        nblk = 1 + nb * width
        out["state_block_table"] = (1 + rng.permutation(nb * width)).astype(np.int32).reshape(nb, width)
    out["state_cache"] = rng.standard_normal((nblk, bs, 2 * cf * d)).astype(np.float32)
    return out


def _finite_codes(p):
    def check(a):
        v = np.ascontiguousarray(a[p]).view(np.uint8)
        bad = ~np.isfinite(_hif8_values()[v])
        return None if not bad.any() else Raw(f"code {int(v[bad].reshape(-1)[0]):#04x}")

    return check


def _poison_code(p):
    def edit(o):
        v = np.array(o[p], copy=True)
        v.reshape(-1)[0] = int(np.flatnonzero(~np.isfinite(_hif8_values()))[0])
        o[p] = v

    return edit


def _hif8_values():
    from ..reference.attention import decode_nope

    return decode_nope(np.arange(256, dtype=np.uint8), "hifloat8", np.float64)


def _th(a):
    return a.x.ndim == 2


def _nb(a):
    return a.cu_seqlens.size - 1 if _th(a) else a.x.shape[0]


def _lens(a):
    if _th(a):
        cu = np.asarray(a.cu_seqlens, np.int64)
        return cu[1:] - cu[:-1]
    return np.full(a.x.shape[0], a.x.shape[1], np.int64)


def _starts(a):
    return np.zeros(_nb(a), np.int64) if a.get("start_pos") is None else np.asarray(a.start_pos, np.int64)


def _d(a):
    return a.wkv.shape[0] // a.coff if a.coff in (1, 2) else a.wkv.shape[0]


def _same_dtype(op, src, p):
    def check(a):
        return None if dtype_name(a[p]) == dtype_name(a.x) else Raw(f"{dtype_name(a[p])} with x {dtype_name(a.x)}")

    def violate(args):
        out = copy_args(args)
        other = np.float16 if dtype_name(out["x"]) == "bfloat16" else BF16
        out[p] = out[p].astype(np.float32).astype(other)
        return out

    return rule(op, f"{p}_dtype_as_x", p, "dtype", "must have x's dtype", check, violate, dtype=True, source=src)


def _vec(op, src, p, n_of, what):
    def check(a):
        v = a.get(p)
        if v is None:
            return None
        return None if v.ndim == 1 and v.shape[0] == n_of(a) else tuple(v.shape)

    return rule(op, f"{p}_shape", p, "shape", what, check,
                edit_params(lambda o: o.update({p: np.zeros(3, np.int32)})), source=src)


def _cu_values(a):
    if not _th(a):
        return None
    cu = np.asarray(a.cu_seqlens, np.int64)
    ok = cu[0] == 0 and (np.diff(cu) >= 0).all() and cu[-1] == a.x.shape[0]
    return None if ok else Raw(f"{cu.tolist()} with T = {a.x.shape[0]}")


def _seqused_values(a):
    if a.get("seqused") is None:
        return None
    s = np.asarray(a.seqused, np.int64)
    return None if ((s >= 0) & (s <= _lens(a))).all() else Raw(f"{s.tolist()} with lengths {_lens(a).tolist()}")


def _smax(a):
    ln = _lens(a)
    return int(_starts(a).max() + ln.max()) if ln.size else 0


def _table_shape(a):
    t = a.get("state_block_table")
    if t is None:
        return None
    if a.cache_mode == 2:
        return None if t.ndim == 1 and t.shape[0] == _nb(a) else Raw(f"{tuple(t.shape)} with cache_mode 2")
    need = -(-_smax(a) // a.state_cache.shape[1])
    ok = t.ndim == 2 and t.shape[0] == _nb(a) and t.shape[1] >= need
    return None if ok else Raw(f"{tuple(t.shape)}, needs [{_nb(a)}, >= {need}] with cache_mode 1")


def _table_values(a):
    if a.get("state_block_table") is None:
        return None
    t = np.asarray(a.state_block_table, np.int64)
    if t.size == 0:
        return None
    ok = t.min() >= 0 and t.max() < a.state_cache.shape[0]
    return None if ok else Raw(f"entries in [{t.min()}, {t.max()}] with block_num {a.state_cache.shape[0]}")


def _shared_state_blocks(a):
    """A state block that one request writes must be no other request's (written or read) and, with cache_mode 1,
    appear once among the entries a request writes: otherwise the bytes left in it depend on the order the kernel
    handles requests in (cache writers refuse repeated slots for the same reason). Block 0 (cache_mode 1) is never
    written; blocks that requests only read (a shared prefix) may be shared."""
    if a.get("state_block_table") is None:
        return None
    t = np.asarray(a.state_block_table, np.int64)
    used = _lens(a) if a.get("seqused") is None else np.asarray(a.seqused, np.int64)
    start = _starts(a)
    if a.cache_mode == 2:
        rings = [int(t.reshape(-1)[b]) for b in range(_nb(a)) if used[b] > 0]
        dup = sorted({x for x in rings if rings.count(x) > 1})
        return Raw(f"ring block(s) {dup} given to more than one request") if dup else None
    bs, r = a.state_cache.shape[1], a.cmp_ratio
    writes, reads = [], []
    for b in range(_nb(a)):
        if used[b] <= 0:
            writes.append([]), reads.append(set())
            continue
        w = t[b, np.arange(start[b] // bs, (start[b] + used[b] - 1) // bs + 1)]
        w = [int(x) for x in w if x != 0]
        if len(set(w)) < len(w):
            return Raw(f"request {b} writes block(s) {sorted({x for x in w if w.count(x) > 1})} at two table entries")
        lo = max(0, (start[b] // r - (a.coff - 1)) * r)
        reads.append({int(x) for x in t[b, lo // bs:(start[b] - 1) // bs + 1]} if start[b] > lo else set())
        writes.append(w)
    for b, w in enumerate(writes):
        for c in range(_nb(a)):
            if c != b and set(w) & (set(writes[c]) | reads[c]):
                return Raw(f"block(s) {sorted(set(w) & (set(writes[c]) | reads[c]))} written by request {b} and used by "
                           f"request {c}")
    return None


def _ring_size(a):
    if a.cache_mode != 2:
        return None
    ln = _lens(a)
    s = int(ln.max()) if ln.size else 0
    need = a.coff * a.cmp_ratio + s - 1
    bs, bn = a.state_cache.shape[1], a.state_cache.shape[0]
    return None if bs >= need and bn >= _nb(a) else Raw(f"block_size {bs}, block_num {bn}: need >= {need}, >= {_nb(a)}")


def _ring_args(o):
    o["cache_mode"] = 2
    o["state_block_table"] = np.array([0, 1], np.int32)


def _to_mode2_small(o):
    _ring_args(o)
    o["state_cache"] = np.zeros((5, 12, o["state_cache"].shape[2]), np.float32)


def _input_rules(op, src, quant):
    if quant:
        return [dtype_in(op, p, ("uint8",), source=src) for p in ("x", "wkv", "wgate")] + [
            dtype_in(op, p, ("float32",), source=src) for p in ("x_descale", "wkv_descale", "wgate_descale")] + [
            rule(op, "quant_mode_value", "quant_mode", "value", "must be 1 (HiFloat8, the only mode)",
                 lambda a: None if a.quant_mode == 1 else a.quant_mode, set_param("quant_mode", 2), source=src)]
    return [dtype_in(op, "x", X_DTYPES, source=src), _same_dtype(op, src, "wkv"), _same_dtype(op, src, "wgate")]


def _finite_rules(op, src, quant):
    if not quant:
        return [all_finite(op, p, source=src) for p in ("x", "wkv", "wgate")]
    out = [rule(op, f"{p}_finite_codes", p, "value", "HiFloat8 codes must be finite (no NaN / Inf code)",
                _finite_codes(p), edit_params(_poison_code(p)), source=src) for p in ("x", "wkv", "wgate")]
    out.append(rule(op, "descale_shapes", "wkv_descale", "shape",
                    "x_descale must be [1], wkv_descale and wgate_descale [coff * D]",
                    lambda a: None if a.x_descale.shape == (1,) and a.wkv_descale.shape == (a.wkv.shape[0],)
                    and a.wgate_descale.shape == (a.wkv.shape[0],) else Raw(f"{tuple(a.x_descale.shape)}, "
                    f"{tuple(a.wkv_descale.shape)}, {tuple(a.wgate_descale.shape)}"),
                    edit_params(lambda o: o.update(wkv_descale=o["wkv_descale"][:-1])), source=src))
    out += [all_finite(op, p, source=src) for p in ("x_descale", "wkv_descale", "wgate_descale")]
    return out


def _rules(op, src, doc, quant=False):
    return _input_rules(op, src, quant) + [
        dtype_in(op, "state_cache", ("float32",), source=src),
        dtype_in(op, "ape", ("float32",), source=src),
        dtype_in(op, "state_block_table", ("int32",), source=src),
        dtype_in(op, "cu_seqlens", ("int32",), optional=True, source=src),
        dtype_in(op, "seqused", ("int32",), optional=True, source=src),
        dtype_in(op, "start_pos", ("int32",), optional=True, source=src),
        rule(op, "precision_value", "precision", "value", f"must be one of {_cr.PRECISIONS}",
             lambda a: None if a.precision in _cr.PRECISIONS else a.precision, set_param("precision", "bogus"),
             source="docs/numerics/compressor.md#precision (qsfa's parameter)"),
        rule(op, "coff_value", "coff", "value", "must be 1 or 2", lambda a: None if a.coff in (1, 2) else a.coff,
             set_param("coff", 3), source=src),
        rule(op, "cache_mode_value", "cache_mode", "value", "must be 1 (paged) or 2 (ring buffer)",
             lambda a: None if a.cache_mode in (1, 2) else a.cache_mode, set_param("cache_mode", 3), source=src),
        rule(op, "x_ndim", "x", "dim", "must be [B, S, H] (BSH) or [T, H] (TH)",
             lambda a: None if a.x.ndim in (2, 3) else a.x.ndim, edit_params(lambda o: o.update(x=o["x"][None, None])),
             source=src),
        rule(op, "cu_seqlens_layout", "cu_seqlens", "value", "is required for TH x [T, H] and must be None for BSH",
             lambda a: None if (a.get("cu_seqlens") is not None) == _th(a) else
             ("None" if a.get("cu_seqlens") is None else "given with BSH x"),
             set_param("cu_seqlens", None), source=src),
        rule(op, "wkv_shape", "wkv", "shape", "must be [coff * D, H] with H = x.shape[-1]",
             lambda a: None if a.wkv.ndim == 2 and a.wkv.shape[1] == a.x.shape[-1] else tuple(a.wkv.shape),
             edit_params(lambda o: o.update(wkv=np.ascontiguousarray(o["wkv"][:, :512]))), source=src),
        rule(op, "wgate_shape", "wgate", "shape", "must have wkv's shape",
             lambda a: None if a.wgate.shape == a.wkv.shape else tuple(a.wgate.shape),
             edit_params(lambda o: o.update(wgate=o["wgate"][:-1])), source=src),
        rule(op, "scenario", "cmp_ratio", "value",
             "(cmp_ratio, coff, D) must be (4, 2, 512) C4A, (4, 2, 128) C4Li or (128, 1, 512) C128A "
             "(op_host/arch35/compressor_tiling.cpp CheckScenarioConsistency)",
             lambda a: None if is_int(a.cmp_ratio) and a.wkv.shape[0] % a.coff == 0
             and (a.cmp_ratio, a.coff, _d(a)) in _cr.SCENARIOS else Raw(f"({a.cmp_ratio}, {a.coff}, {_d(a)})"),
             set_param("cmp_ratio", 8), source=src),
        rule(op, "hidden_size", "x", "shape", "H must be a multiple of 512 in [1024, 10240]",
             lambda a: None if 1024 <= a.x.shape[-1] <= 10240 and a.x.shape[-1] % 512 == 0 else a.x.shape[-1],
             edit_params(lambda o: o.update(x=np.ascontiguousarray(o["x"][..., :512]),
                                            wkv=np.ascontiguousarray(o["wkv"][:, :512]),
                                            wgate=np.ascontiguousarray(o["wgate"][:, :512]))), source=src),
        rule(op, "ape_shape", "ape", "shape", "must be [cmp_ratio, coff * D]",
             lambda a: None if a.ape.shape == (a.cmp_ratio, a.wkv.shape[0]) else tuple(a.ape.shape),
             edit_params(lambda o: o.update(ape=o["ape"][:-1])), source=src),
        rule(op, "state_cache_shape", "state_cache", "shape",
             "must be [block_num > 0, block_size in [1, 1024], 2 * coff * D]",
             lambda a: None if a.state_cache.ndim == 3 and a.state_cache.shape[0] > 0
             and 1 <= a.state_cache.shape[1] <= 1024 and a.state_cache.shape[2] == 2 * a.wkv.shape[0]
             else tuple(a.state_cache.shape),
             edit_params(lambda o: o.update(state_cache=np.ascontiguousarray(o["state_cache"][..., :-1]))),
             source=src),
        rule(op, "cu_seqlens_shape", "cu_seqlens", "shape", "must be 1-D [B + 1] (B >= 0)",
             lambda a: None if a.get("cu_seqlens") is None or (a.cu_seqlens.ndim == 1 and a.cu_seqlens.size >= 1)
             else tuple(a.cu_seqlens.shape),
             edit_params(lambda o: o.update(cu_seqlens=o["cu_seqlens"][None])), source=src),
        rule(op, "cu_seqlens_values", "cu_seqlens", "value",
             "must be prefix sums: 0 first, non-decreasing, T last",
             _cu_values, edit_params(lambda o: o.update(cu_seqlens=np.array([0, 5, 6], np.int32))), source=src),
        _vec(op, src, "seqused", _nb, "must be [B]"),
        _vec(op, src, "start_pos", _nb, "must be [B]"),
        rule(op, "seqused_values", "seqused", "value", "seqused[b] must be in [0, the batch's length]",
             _seqused_values, edit_params(lambda o: o.update(seqused=np.array([6, 0], np.int32))), source=src),
        rule(op, "start_pos_values", "start_pos", "value", "must be >= 0",
             lambda a: None if a.get("start_pos") is None or (np.asarray(a.start_pos) >= 0).all()
             else Raw(str(np.asarray(a.start_pos).tolist())),
             edit_params(lambda o: o.update(start_pos=np.array([-1, 0], np.int32))), source=src),
        rule(op, "state_block_table_required", "state_block_table", "value",
             "must be given (qsfa does not model a call without a state table)",
             lambda a: None if a.get("state_block_table") is not None else "None",
             set_param("state_block_table", None), source=src),
        rule(op, "state_block_table_shape", "state_block_table", "shape",
             "must be [B, >= ceil(Smax / block_size)] with cache_mode 1 (Smax = max(start_pos) + the longest batch), "
             "[B] with cache_mode 2", _table_shape,
             edit_params(lambda o: o.update(state_block_table=o["state_block_table"][:, :1])), source=src),
        rule(op, "state_block_table_values", "state_block_table", "value", "entries must be in [0, block_num)",
             _table_values, edit_params(lambda o: o["state_block_table"].__setitem__((0, 0), 5)), source=src),
        rule(op, "state_blocks_not_shared", "state_block_table", "value",
             "a state block written by one request must not be used by another, nor written twice by one (the "
             "state it leaves would depend on the order requests are handled in)", _shared_state_blocks,
             edit_params(lambda o: o["state_block_table"].__setitem__((1, 0), o["state_block_table"][0, 1])),
             source=src),
        rule(op, "ring_buffer_size", "state_cache", "shape",
             "with cache_mode 2, block_size >= coff * cmp_ratio + S - 1 (S the longest batch) and block_num >= B",
             _ring_size, edit_params(_ring_args), source=src),
        all_finite(op, "ape", source=src),
    ] + _finite_rules(op, src, quant) + [
        rule(op, "a2_unsupported", "x", "value", f"{op} runs on Atlas A3 and Ascend 950 only ({doc})",
             lambda a: "Atlas A2", lambda args: copy_args(args), chips=("A2",), source=src),
        rule(op, "a3_cache_mode", "cache_mode", "value", f"Atlas A3 supports cache_mode 1 only ({doc})",
             lambda a: None if a.cache_mode == 1 else a.cache_mode, edit_params(_to_mode2_small), chips=("A3",),
             source=src),
    ]


CMP_CONTRACT = Contract(
    op=CMP,
    constraints=_rules(CMP, SRC, "aclnnCompressor.md"),
    example=_example,
    inplace=("state_cache",),
    params=params("x:array wkv:array wgate:array state_cache:array ape:array state_block_table:array?"
                  " cu_seqlens:array? seqused:array? start_pos:array? cmp_ratio:int coff:int cache_mode:int"
                  " precision:str"),
)


def _reference(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, cmp_ratio, coff,
               cache_mode, precision="faithful", reduce_order="tree"):
    return _cr.compressor(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos,
                          cmp_ratio=int(cmp_ratio), coff=int(coff), cache_mode=int(cache_mode), precision=precision,
                          reduce_order=reduce_order)


def _numerics(chip, args):
    return {"reduce_order": "sequential" if chip == "950" else "tree"}


define_operator(CMP, CMP_CONTRACT, outputs=("cmp_kv", "state_cache"), reference=_reference, numerics=_numerics,
                doc="DeepSeek-V4 KV compressor (C4A / C4Li / C128A): matmuls, grouped softmax, weighted sum; "
                    "state carried in a paged / ring fp32 cache.")


def compressor(x, wkv, wgate, state_cache, ape, *, cmp_ratio, state_block_table=None, cu_seqlens=None, seqused=None,
               start_pos=None, coff=1, cache_mode=1, precision="faithful", chip=None, backend="reference"):
    """``cann_ops_transformer.ops.compressor`` (Atlas A3, Ascend 950): compress every ``cmp_ratio`` tokens of the
    KV into one row (DeepSeek-V4 C4A / C4Li / C128A).

    x:           float16 / bf16 ``[B, S, H]`` (BSH) or ``[T, H]`` (TH, with ``cu_seqlens``); H a multiple of 512 in
                 [1024, 10240].
    wkv, wgate:  x's dtype, ``[coff * D, H]``; (cmp_ratio, coff, D) is (4, 2, 512), (4, 2, 128) or (128, 1, 512).
    state_cache: float32 ``[block_num, block_size, 2 * coff * D]``: per position the fp32 ``[kv | score]`` row of
                 earlier calls (score with ape added); written in place with this call's tokens.
    ape:         float32 ``[cmp_ratio, coff * D]``, the positional bias added to the scores.
    state_block_table: int32 ``[B, >= ceil(Smax / block_size)]`` (cache_mode 1; entry 0 = do not write) or ``[B]``
                 (cache_mode 2, one ring buffer block per batch).
    cu_seqlens:  int32 ``[B + 1]`` prefix sums (TH only); seqused: int32 ``[B]`` tokens used per batch (None: all);
    start_pos:   int32 ``[B]`` position of each batch's first token (None: 0).
    coff:        2 = overlapping windows (each row also weighs the previous group), 1 = none.
    precision:   "faithful" (the kernel's rounding points, ``chip`` picks the sum order) or "exact" (float64).
    Returns ``(cmp_kv, state_cache)``: ``cmp_kv`` the compressed KV rows (x's dtype; ``[B, ceil(S / cmp_ratio), D]``
    or ``[min(T, T // cmp_ratio + B), D]``, packed batch after batch, padding rows zero) - the input of
    ``kv_compress_epilog`` / ``indexer_compress_epilog_v2``. Numerics: docs/numerics/compressor.md.
    """
    args = dict(x=x, wkv=wkv, wgate=wgate, state_cache=state_cache, ape=ape, state_block_table=state_block_table,
                cu_seqlens=cu_seqlens, seqused=seqused, start_pos=start_pos, cmp_ratio=cmp_ratio, coff=coff,
                cache_mode=cache_mode, precision=precision)
    return run(CMP, args, backend, chip=chip)


# ------------------------------------------------------------------------------------------- quant_compressor

QCMP = "quant_compressor"
QSRC = ("cannmirror/ops-transformer@f681b2f experimental/attention/quant_compressor/ (README.md, op_host/arch35/"
        "quant_compressor_tiling.cpp, op_kernel/arch35/); docs/numerics/compressor.md#quant_compressor")


def _hif8_codes(rng, shape, scale):
    from ..formats import encode

    return encode((rng.standard_normal(shape) * scale).astype(np.float32), "hifloat8", saturate=True)


def _quant_example(rng):
    a = _example(rng)
    t, h = a["x"].shape
    cd = a["wkv"].shape[0]
    a.update(x=_hif8_codes(rng, (t, h), 4.0), wkv=_hif8_codes(rng, (cd, h), 1.0), wgate=_hif8_codes(rng, (cd, h), 1.0),
             x_descale=np.array([0.125], np.float32), wkv_descale=(rng.random(cd) * 0.02 + 0.001).astype(np.float32),
             wgate_descale=(rng.random(cd) * 0.02 + 0.001).astype(np.float32), quant_mode=1)
    return a


QCMP_CONTRACT = Contract(
    op=QCMP,
    constraints=_rules(QCMP, QSRC, "quant_compressor README.md", quant=True),
    example=_quant_example,
    inplace=("state_cache",),
    params=params("x:array wkv:array wgate:array state_cache:array ape:array x_descale:array wkv_descale:array"
                  " wgate_descale:array state_block_table:array? cu_seqlens:array? seqused:array? start_pos:array?"
                  " quant_mode:int cmp_ratio:int coff:int cache_mode:int precision:str"),
)


def _quant_reference(x, wkv, wgate, state_cache, ape, x_descale, wkv_descale, wgate_descale, state_block_table,
                     cu_seqlens, seqused, start_pos, quant_mode, cmp_ratio, coff, cache_mode, precision="faithful",
                     reduce_order="sequential"):
    return _cr.compressor(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos,
                          cmp_ratio=int(cmp_ratio), coff=int(coff), cache_mode=int(cache_mode), precision=precision,
                          reduce_order=reduce_order, quant=(x_descale, wkv_descale, wgate_descale))


def _quant_numerics(chip, args):
    return {"reduce_order": "sequential"}  # only the arch35 kernel is published (docs/numerics/compressor.md)


define_operator(QCMP, QCMP_CONTRACT, outputs=("cmp_kv", "state_cache"), reference=_quant_reference,
                numerics=_quant_numerics,
                doc="DeepSeek-V4 KV compressor with HiFloat8 x / weights and fp32 descales (experimental).")


def quant_compressor(x, wkv, wgate, state_cache, ape, x_descale, wkv_descale, wgate_descale, *, cmp_ratio,
                     state_block_table=None, cu_seqlens=None, seqused=None, start_pos=None, quant_mode=1, coff=1,
                     cache_mode=1, precision="faithful", chip=None, backend="reference"):
    """ops-transformer's experimental QuantCompressor: :func:`compressor` with HiFloat8 ``x``, ``wkv``, ``wgate``
    (uint8 codes) and fp32 descales - ``x_descale [1]``, ``wkv_descale`` / ``wgate_descale [coff * D]``; each dot
    product is dequantised by ``fp32(w_descale * x_descale)``. ``quant_mode`` 1 (HiFloat8) is the only mode.
    Returns ``(cmp_kv, state_cache)``, ``cmp_kv`` bf16. Numerics: docs/numerics/compressor.md#quant_compressor.
    """
    args = dict(x=x, wkv=wkv, wgate=wgate, state_cache=state_cache, ape=ape, x_descale=x_descale,
                wkv_descale=wkv_descale, wgate_descale=wgate_descale, state_block_table=state_block_table,
                cu_seqlens=cu_seqlens, seqused=seqused, start_pos=start_pos, quant_mode=quant_mode,
                cmp_ratio=cmp_ratio, coff=coff, cache_mode=cache_mode, precision=precision)
    return run(QCMP, args, backend, chip=chip)
