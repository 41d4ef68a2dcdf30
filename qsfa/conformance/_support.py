"""Helpers of the property checks: calling an operator on copies, comparing outputs, and an independent
(written from docs/numerics/attention.md#token-selection, not from qsfa.reference) model of sparse token selection and KV addressing.

Everything here is vectorised over query rows and tokens; loops run over batches (a handful) only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import numpy as np

from .. import compare as C
from .._arrays import dtype_name, is_torch, to_numpy
from .._dispatch import operator, run
from .._errors import BackendError, InvalidArgument, InvalidDtype
from ..strategies import clone

__all__ = [
    "PropertyFailure",
    "BackendRaised",
    "call",
    "compare_outputs",
    "fail",
    "query_rows",
    "kv_addressing",
    "selection",
    "read_entries",
    "gather_tokens",
    "round_query_dtype",
    "packed_kv",
    "float_kv",
    "query_matrix",
    "selected_tokens",
    "take_rows",
    "judging",
    "start_tally",
    "repeat_count",
]


class PropertyFailure(AssertionError):
    """A property does not hold; the message says what differs."""


class BackendRaised(Exception):
    """The backend (or the reference a property compares with) raised instead of returning: not a verdict on
    the numerics, an ERROR (its own status, exit status 3; docs/conformance.md#verdicts). ``error`` is the
    original exception."""

    def __init__(self, backend: str, op: str, error: BaseException):
        self.backend, self.op, self.error = backend, op, error
        super().__init__(f"backend {backend!r} raised {type(error).__name__} in {op}: {error}")


def fail(msg: str):
    raise PropertyFailure(msg)


def _np(x):
    if x is None:
        return None
    return to_numpy(x) if is_torch(x) else np.asarray(x)


#: the chip the running conformance check models (``qsfa conformance --chip``, or the device's chip); every
#: call of a property - the backend's and the reference's - passes it (docs/numerics/chips.md)
_CHIP: contextvars.ContextVar = contextvars.ContextVar("qsfa_conformance_chip", default=None)


def current_chip() -> str | None:
    return _CHIP.get()


@contextlib.contextmanager
def modelling_chip(chip: str | None):
    """Within the block, :func:`call` (and :func:`current_chip`) use ``chip``."""
    token = _CHIP.set(chip)
    try:
        yield
    finally:
        _CHIP.reset(token)


#: helper operators the checked backend lacks: :func:`call` runs them on the reference (the property still checks
#: the backend's own operator; the runner says so in the result)
_HELPERS_ON_REFERENCE: contextvars.ContextVar = contextvars.ContextVar("qsfa_helpers_on_reference", default=())


@contextlib.contextmanager
def helpers_on_reference(ops):
    """Within the block, :func:`call` runs the operators ``ops`` on the reference whatever backend it is given."""
    token = _HELPERS_ON_REFERENCE.set(tuple(ops))
    try:
        yield
    finally:
        _HELPERS_ON_REFERENCE.reset(token)


class _Judging:
    """The acceptance standards a vs_reference check judges its outputs by (``qsfa conformance --standard``),
    the one that gives the verdict (``--verdict-by``), the runs per example (``--repeat``) and the tally of the
    property being run: {standard: {"judged": outputs, "failed": outputs, "strict_failed": outputs qsfa's
    criterion fails among them, "first_failure": figures}}."""

    def __init__(self, standards, verdict_by, repeat):
        from .. import standards as S

        self.everything = standards == "all" or (isinstance(standards, (list, tuple)) and "all" in standards)
        self.names = S.resolve(standards)
        if verdict_by is not None and verdict_by not in self.names:
            self.names.append(verdict_by)
        self.verdict_by = verdict_by
        self.repeat = int(repeat)
        self.tally: dict = {}

    def judge(self, name: str, got, want, dtype: str, strict_passed: bool = True) -> bool | None:
        """Judge one output by every standard (counting, beside, how many of the judged outputs qsfa's own
        criterion fails); returns the ``verdict_by`` standard's verdict (None: not set, or no rule here)."""
        from .. import standards as S

        res = C.CompareResult(name, "", True, (), dtype, 0, 0)
        C.add_standards(res, got, want, [n for n in self.names if S.applicable(n, dtype)], dtype=dtype)
        verdict = None
        for n, r in res.standards.items():
            if r.get("missing"):  # atk-dual: conformance has no exact / benchmark outputs to give it
                continue
            t = self.tally.setdefault(n, {"judged": 0, "failed": 0, "strict_failed": 0})
            t["judged"] += 1
            t["strict_failed"] += not strict_passed
            if not r.get("passed"):
                t["failed"] += 1
                t.setdefault("first_failure", {"output": name, **{k: v for k, v in r.items()
                                                                   if not isinstance(v, dict)}})
            if n == self.verdict_by:
                verdict = bool(r.get("passed"))
        return verdict


_JUDGING: contextvars.ContextVar = contextvars.ContextVar("qsfa_conformance_judging", default=None)


@contextlib.contextmanager
def judging(standards=None, verdict_by: str | None = None, repeat: int = 1):
    """Within the block, vs_reference checks also judge their outputs by ``standards`` (docs/numerics/comparison.md#standards),
    take ``verdict_by``'s verdict instead of the strict one where it has a rule, and run the backend ``repeat``
    times per example, failing on any byte that differs between the runs."""
    token = _JUDGING.set(_Judging(standards, verdict_by, repeat))
    try:
        yield
    finally:
        _JUDGING.reset(token)


def start_tally() -> dict:
    """A fresh tally for the property about to run (filled while it runs; empty without :func:`judging`)."""
    j = _JUDGING.get()
    if j is None:
        return {}
    j.tally = {}
    return j.tally


def repeat_count() -> int:
    j = _JUDGING.get()
    return 1 if j is None else j.repeat


def call(op: str, args: dict, backend: str) -> dict:
    """Run ``op`` on ``backend`` with copies of ``args`` (strided caches stay strided) for the chip of
    :func:`modelling_chip`; return ``{output name: NumPy array or None}``. The caller's arrays are never modified.
    Fails (PropertyFailure) when the backend writes into an input array that is not one of the operator's
    in-place parameters."""
    if op in _HELPERS_ON_REFERENCE.get():
        backend = "reference"
    inplace = set(operator(op).contract.inplace)
    a = {k: clone(v) for k, v in args.items()}
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        try:
            res = run(op, a, backend, chip=current_chip())
        except (InvalidArgument, InvalidDtype, BackendError):
            raise  # arguments a contract refused (a failure) or the dispatch's own errors (declined: not drawn)
        except Exception as e:  # noqa: BLE001 - a crash is an ERROR, not a failed property
            raise BackendRaised(backend, op, e) from e
    # the backend only ever sees the copies, so the caller's arrays are the "before" (no byte snapshots to take)
    changed = [k for k, v in a.items() if isinstance(v, np.ndarray) and k not in inplace
               and not _same_bytes(v, args[k])]
    if changed:
        fail(f"backend {backend!r} wrote into input(s) {changed} of {op}, which are not in-place parameters")
    res = res if isinstance(res, tuple) else (res,)
    return {name: _np(r) for name, r in zip(operator(op).outputs, res)}


_FLOAT = ("float16", "bfloat16", "float32", "float64")


def compare_outputs(got: dict, want: dict, kinds: dict | None = None, *, label: str = "",
                    fmt: str | None = None, ignore: dict | None = None, judge: bool = False) -> list[str]:
    """Compare two output dicts; ``kinds[name]`` is "bytes" (default) or "float" (the docs/numerics/comparison.md#float-criterion
    criterion with the output dtype's tolerances). ``fmt``: a qsfa.formats name whose decoded values are
    shown beside differing one-byte codes. ``ignore[name]``: a bool mask of one-byte output ``name``, True at
    unspecified bytes (:func:`qsfa.layouts.unspecified_bytes`): they are not compared. ``judge``: also judge each
    output by the standards of :func:`judging` (vs_reference checks). Returns one message per failing output."""
    kinds = kinds or {}
    j = _JUDGING.get() if judge else None
    bad = []
    for name, w in want.items():
        g = got.get(name)
        if w is None and g is None:
            continue
        if (w is None) != (g is None):
            bad.append(f"{label}{name}: one side returned None ({'got' if g is None else 'expected'} None)")
            continue
        m = (ignore or {}).get(name)
        if m is not None and np.shape(g) == np.shape(w) == np.shape(m) and np.asarray(w).dtype.itemsize == 1:
            g = np.where(m, np.asarray(w), np.asarray(g)).astype(np.asarray(g).dtype)  # don't-care bytes: as wanted
        kind = kinds.get(name, "bytes")
        same = _identical(g, w)  # passes either criterion (the float one with cos_diff 0): no full report
        r = None
        if not same:
            if kind == "float" and dtype_name(w) in _FLOAT:
                r = C.compare_float(g, w, name=name)
            else:
                r = C.compare_bytes(g, w, name=name, fmt=fmt if np.asarray(w).dtype.itemsize == 1 else None)
        verdict = None
        if j is not None and j.names:
            wd = np.asarray(w)
            sdt = fmt if (fmt is not None and wd.dtype.itemsize == 1) else dtype_name(wd)
            verdict = j.judge(name, g, w, sdt, strict_passed=same or r.passed)
        if same:
            continue
        if verdict is not None:  # --verdict-by: that standard's verdict on this output instead of the strict one
            if not verdict:
                bad.append(f"{label}{name}: FAIL by {j.verdict_by} (strict: {'PASS' if r.passed else 'FAIL'})\n"
                           + label + str(r))
            continue
        if not r.passed:
            bad.append(label + str(r))
    return bad


def _same_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    """``x.tobytes() == y.tobytes()`` for arrays of one shape and dtype, without the two copies when both are
    contiguous."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.flags.c_contiguous and y.flags.c_contiguous and not x.dtype.hasobject:
        return np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))
    return x.tobytes() == y.tobytes()


def _identical(g, w) -> bool:
    """Same shape, dtype and bytes (NaN payloads and the sign of zero included)."""
    g, w = np.asarray(g), np.asarray(w)
    if g.shape != w.shape or g.dtype != w.dtype or g.dtype.hasobject:
        return False
    return np.array_equal(np.ascontiguousarray(g).reshape(-1).view(np.uint8),
                          np.ascontiguousarray(w).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------------------
# independent model of docs/numerics/attention.md#token-selection token selection


def _i64(a):
    return np.asarray(a).astype(np.int64).reshape(-1)


def query_rows(args: dict):
    """Per query row: ``(batch, pos, valid, act_q)`` from the query layout and its lengths."""
    q = args["query"]
    if args["layout_query"] == "BSND":
        b, s = q.shape[:2]
        lens = args.get("actual_seq_lengths_query")
        act_q = np.full(b, s, np.int64) if lens is None else _i64(lens)
        batch = np.arange(b * s) // s
        pos = np.arange(b * s) % s
        return batch, pos, pos < act_q[batch], act_q
    ends = _i64(args["actual_seq_lengths_query"])
    t = q.shape[0]
    r = np.arange(t)
    # row r belongs to the first batch whose prefix sum exceeds r
    batch = (r[:, None] >= ends[None, :]).sum(axis=1)
    valid = batch < ends.size
    starts = np.concatenate([[0], ends[:-1]])
    bc = np.minimum(batch, ends.size - 1)
    pos = np.where(valid, r - starts[bc], 0)
    act_q = ends - starts
    return np.where(valid, bc, 0), pos, valid, act_q


def kv_addressing(args: dict, *, key="key", layout="layout_kv", lens="actual_seq_lengths_kv"):
    """``(act_kv [B], storage(b, j) -> flat row)`` for the KV layout (BSND / TND / PA_BSND)."""
    k = args[key]
    lay = args[layout]
    n_batch = query_rows(args)[3].size
    lv = args.get(lens)
    if lay == "BSND":
        s = k.shape[1]
        act = np.full(n_batch, s, np.int64) if lv is None else _i64(lv)
        return act, lambda b, j: b * s + j
    if lay == "TND":
        ends = _i64(lv)
        starts = np.concatenate([[0], ends[:-1]])
        return ends - starts, lambda b, j: starts[b] + j
    bt = np.asarray(args["block_table"]).astype(np.int64)
    bs = k.shape[1]

    def storage(b, j):
        col = np.minimum(j // bs, bt.shape[1] - 1)
        return bt[b, col] * bs + j % bs

    return _i64(lv), storage


def selection(args: dict, *, key="key", layout="layout_kv", lens="actual_seq_lengths_kv"):
    """Which tokens each query row attends to, with multiplicity.

    Returns ``(weights [R, S] int64, batch [R], act_kv [B], storage, n_read [R])`` with S = max actKV (>= 1)
    and ``n_read`` the number of leading index entries each row reads:
    ``weights[r, j]`` = how many of the row's read index entries select token j of its batch. Per docs/numerics/attention.md#token-selection
    3.6: threshold = actKV - actQ + i + 1 (sparse_mode 3) or actKV (0), padding rows see nothing; the first
    ``min(sparse_size, ceil(threshold / sbs))`` entries are read, stopping at the first negative one; entry t
    covers tokens ``[t*sbs, t*sbs + sbs)`` clipped to ``[0, min(actKV, threshold))``.
    """
    batch, pos, valid, act_q = query_rows(args)
    act_kv, storage = kv_addressing(args, key=key, layout=layout, lens=lens)
    akv = act_kv[batch]
    if args.get("sparse_mode", 3) == 3:
        thr = akv - act_q[batch] + pos + 1
    else:
        thr = akv.copy()
    thr = np.where(valid, thr, 0)
    limit = np.clip(np.minimum(akv, thr), 0, None)
    sbs = int(args.get("sparse_block_size", 1))
    r = batch.size
    idx = np.asarray(args["sparse_indices"]).astype(np.int64).reshape(r, -1)
    k = idx.shape[1]
    n_read = np.where(thr > 0, np.minimum(k, -(-thr // sbs)), 0)
    neg = idx < 0
    stop = np.where(neg.any(axis=1), np.argmax(neg, axis=1), k)
    n_read = np.minimum(n_read, stop)
    entry_ok = np.arange(k)[None, :] < n_read[:, None]
    s_max = max(int(act_kv.max(initial=0)), 1)
    tok = idx[:, :, None] * sbs + np.arange(sbs)[None, None, :]
    ok = entry_ok[:, :, None] & (tok >= 0) & (tok < limit[:, None, None])
    # count (row, token) hits with one bincount over flat positions (the same counts as np.add.at on the pairs, 1.6x faster)
    rr = np.broadcast_to(np.arange(r)[:, None, None] * s_max, tok.shape)
    w = np.bincount((rr + tok)[ok], minlength=r * s_max).astype(np.int64).reshape(r, s_max)
    return w, batch, act_kv, storage, n_read


def read_entries(args: dict):
    """``(idx [R, K], entry_ok [R, K])``: the index entries each row actually reads (see :func:`selection`)."""
    *_, n_read = selection(args)
    idx = np.asarray(args["sparse_indices"]).astype(np.int64)
    idx = idx.reshape(n_read.size, -1)
    return idx, np.arange(idx.shape[1])[None, :] < n_read[:, None]


def gather_tokens(rows_of: np.ndarray, storage, batch_id: int, s_max: int, act_kv: np.ndarray):
    """Rows of a flat storage array ``rows_of [n, W]`` for tokens 0..s_max-1 of one batch (zeros past actKV)."""
    j = np.arange(s_max)
    live = j < act_kv[batch_id]
    flat = np.where(live, storage(np.full(s_max, batch_id), np.where(live, j, 0)), 0)
    out = rows_of[flat].copy()
    out[~live] = 0
    return out


def selected_tokens(w: np.ndarray, batch: np.ndarray, act_kv: np.ndarray, storage) -> list:
    """Per batch that has query rows: ``(b, rows, tokens, flat)`` - its query rows, the tokens some of them select
    (weight > 0, ascending) and the flat storage rows of those tokens (``w, batch, act_kv, storage``:
    :func:`selection`). The models convert and multiply just these rows: a token no row selects has weight 0 and
    adds nothing, and about half of the addressable rows of a ci example are never selected (issue 15)."""
    out = []
    for b in range(act_kv.size):  # batches: a handful
        rb = np.flatnonzero(batch == b)
        if rb.size:
            tok = np.flatnonzero(w[rb].any(axis=0))
            out.append((b, rb, tok, storage(np.full(tok.size, b), tok)))
    return out


def take_rows(a: np.ndarray | None, flat: np.ndarray) -> np.ndarray | None:
    """Rows ``flat`` of an array of flat storage rows ``[..., W]`` (None stays None); a view of a bigger array is not
    copied whole (the oracle's own row access, ``attn_layout.flat_rows``)."""
    from ..reference.attn_layout import flat_rows

    return None if a is None else flat_rows(np.asarray(a))[flat]


def decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    """``qsfa.formats.decode(codes, fmt)`` on the reference, without the argument checks of a public call: the
    models decode arrays they cut from arguments the operator's contract accepted, and a checked call cost about a
    tenth of a millisecond each, several times per example (issue 15). Same values, same bytes: one-byte codes and
    float16 bit patterns are looked up (``np.take``) in the table of every code's value that the reference's own
    decode gives, built once - about 2x faster than its fancy-indexed table for one-byte codes, 1.2-1.5x than its
    float16 cast (issue 15)."""
    from ..reference import formats as F

    c = np.asarray(codes)
    if c.dtype.itemsize == 1 and F.code_bits(fmt) == 8:
        return _code_table(fmt).take(c.view(np.uint8))
    if c.dtype.itemsize == 2 and fmt == "float16":
        return _code_table(fmt).take(c.view(np.uint16))
    return F.decode(codes, fmt)


@functools.lru_cache(maxsize=None)
def _code_table(fmt: str) -> np.ndarray:
    """float32 ``[2^bits]``: the reference's decode of every code of an 8-bit format or of float16 (read-only)."""
    from ..reference import formats as F

    bits = F.code_bits(fmt)
    t = np.asarray(F.decode(np.arange(1 << bits, dtype=np.uint16 if bits == 16 else np.uint8), fmt), np.float32)
    t.setflags(write=False)
    return t


def round_to(x: np.ndarray, fmt: str, *, rounding: str | None = None) -> np.ndarray:
    """``qsfa.formats.round_to(x, fmt, rounding=rounding)`` on the reference, unchecked (see :func:`decode`).
    float32 without NaN to float16 takes :func:`_round_f16` (the same values, 1.4x (rint) to 3.5x (round) faster on
    56k values: the K / V rounding of the attention models; tests/test_conformance_cost.py compares the two)."""
    from ..reference import formats as F

    x = np.asarray(x)
    if (fmt == "float16" and rounding in (None, "rint", "round") and x.dtype == np.float32
            and not np.isnan(x).any()):
        return _round_f16(x, rounding or "rint")
    return F.decode(F.encode(x, fmt, saturate=False, rounding=rounding), fmt)


_F16_MIN_NORMAL = np.float32(2.0 ** -14)


def _round_f16(x: np.ndarray, rounding: str) -> np.ndarray:
    """float32 ``x`` (no NaN) rounded to float16 ("rint": ties to even, "round": ties away), as float32; beyond the
    largest float16 (65504) the result is +-inf (no saturation), as the reference's encode.

    At or above the smallest normal float16 (2^-14) the float16 value keeps the top 10 of float32's 23 fraction
    bits (same exponent), so the rounding is integer arithmetic on the float32 bits: add half of the dropped 2^13
    (minus one, plus the kept last bit, for ties to even), then clear the 13 low bits; a carry out of the fraction
    raises the exponent, which is the correct rounding up to the next binade, and anything that reaches 2^16 is
    float16's infinity. Below it the spacing is a fixed 2^-24: round ``x * 2^24`` (exact) to an integer in
    float64."""
    u = np.ascontiguousarray(x).view(np.uint32)
    if rounding == "rint":
        r = (u + (np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1)))) & np.uint32(0xFFFFE000)
    else:
        r = (u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    y = r.view(np.float32)
    y = np.where(np.abs(y) >= np.float32(65536.0), np.copysign(np.float32(np.inf), x), y)
    small = np.abs(x) < _F16_MIN_NORMAL
    if small.any():
        t = x[small].astype(np.float64) * 2.0 ** 24
        t = np.rint(t) if rounding == "rint" else np.copysign(np.floor(np.abs(t) + 0.5), t)
        y[small] = (t * 2.0 ** -24).astype(np.float32)
    return y


def round_query_dtype(x: np.ndarray, qdtype: str) -> np.ndarray:
    """float32 ``x`` rounded to the query dtype at the kernel's rounding point (bf16 RINT, fp16 ROUND;
    docs/numerics/attention.md#kv_quant_sparse_flash_attention) and returned as float64."""
    rounding = "rint" if qdtype == "bfloat16" else "round"
    return np.asarray(round_to(x.astype(np.float32), qdtype, rounding=rounding), np.float64)


def packed_kv(args: dict, *, faithful: bool, k_rounding: str | None = None, with_k: bool = True):
    """QSFA packed rows as float64 ``(K [n, 512 + 64], V [n, 512])``: NoPE ``decode(code) * tile scale``
    (one fp32 multiply), rounded to the query dtype when ``faithful`` (``k_rounding`` "rint" / "round"; None: the
    A2/A3 rule of :func:`round_query_dtype`); RoPE as stored (zeros at rope 0). ``with_k=False``: K is None (a
    model that needs V only)."""
    key = args["key"]
    rope = int(args["rope_head_dim"])
    qd = dtype_name(args["query"])
    rows = np.ascontiguousarray(key).reshape(-1, key.shape[-1]).view(np.uint8)
    n = rows.shape[0]
    codes = np.ascontiguousarray(rows[:, :512])
    vals = np.asarray(decode(codes, args.get("key_dtype", "int8")), np.float32)
    off = 512 + 2 * rope
    scales = np.ascontiguousarray(rows[:, off:off + 16]).view("<f4").astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        if faithful:  # one fp32 multiply, then the query-dtype rounding
            nope = (vals.reshape(n, 4, 128) * scales[:, :, None]).reshape(n, 512)
            nope64 = (round_query_dtype(nope, qd) if k_rounding is None else
                      np.asarray(round_to(nope, qd, rounding=k_rounding), np.float64))
        else:  # exact: the product of two fp32 values is exact in float64
            nope64 = (vals.reshape(n, 4, 128).astype(np.float64) * scales[:, :, None]).reshape(n, 512)
    if not with_k:
        return None, nope64
    k = np.zeros((n, 576), np.float64)
    k[:, :512] = nope64
    if rope:
        from .._arrays import numpy_dtype

        k[:, 512:] = np.ascontiguousarray(rows[:, 512:640]).view(numpy_dtype(qd)).astype(np.float64)
    return k, nope64


def float_kv(args: dict):
    """SFA rows as float64 ``(K [n, 512 (+64)], V [n, Dv])``."""
    key = args["key"]
    k = key.reshape(-1, key.shape[-1]).astype(np.float64)
    if args.get("key_rope") is not None:
        kr = args["key_rope"]
        k = np.concatenate([k, kr.reshape(-1, kr.shape[-1]).astype(np.float64)], axis=1)
    v = args.get("value")
    v = key if v is None else v
    return k, v.reshape(-1, v.shape[-1]).astype(np.float64)


def query_matrix(args: dict) -> np.ndarray:
    """The full query (NoPE + RoPE) as float64 ``[R, N, D]``."""
    q = args["query"]
    q = q.reshape(-1, q.shape[-2], q.shape[-1]).astype(np.float64)
    if args.get("query_rope") is not None:
        qr = args["query_rope"]
        q = np.concatenate([q, qr.reshape(-1, qr.shape[-2], qr.shape[-1]).astype(np.float64)], axis=-1)
    return q
