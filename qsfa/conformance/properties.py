"""The property catalogue: every conformance property, named and documented, with its strategy and check.

A :class:`Property` draws :class:`Example` records from a strategy (built on :mod:`qsfa.strategies`) and
checks one of them against a backend: ``check(example, backend)`` returns nothing when the property holds
and raises :class:`PropertyFailure` (an ``AssertionError``) saying what differs otherwise. The runner
(:mod:`qsfa.conformance.runner`), ``qsfa conformance`` and the pytest modules
``tests/test_conformance_*.py`` all run these same definitions.

Kinds:

* ``vs_reference`` - the backend's outputs against the reference backend's on the same arguments: bytes
  for formats, quantisation, scatter, cache writers and indices (docs/numerics/comparison.md#bit-exact: never a tolerance on
  codes); the docs/numerics/comparison.md#float-criterion float criterion (per-dtype atol / rtol plus cos_diff, ``qsfa.compare``)
  for attention outputs, softmax statistics and the LSE merge.
* ``metamorphic`` - relations that need no second backend (the expectation is derived independently in
  the check: by a transformation that must not change the result, or by a float64 model written here from
  docs/numerics/). Invalid-argument properties are metamorphic too: the named constraint must fire, before any
  write.

The catalogue is :func:`catalogue`; :func:`get` returns one property by name. Names are
``<operator>.<property>`` (e.g. ``kv_quant_sparse_flash_attention.page_permutation``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np
from hypothesis import strategies as st

from .. import strategies as qst
from .._arrays import dtype_name
from .._contract import Constraint
from .._dispatch import operator, run
from .._errors import InvalidArgument, InvalidDtype, UnsupportedByBackend
from ..layouts import unspecified_bytes
from ._models import uniform_scores_model
from ._support import (
    PropertyFailure,
    call,
    compare_outputs,
    current_chip,
    fail,
    float_kv,
    gather_tokens,
    kv_addressing,
    packed_kv,
    query_matrix,
    query_rows,
    repeat_count,
    read_entries,
    selected_tokens,
    selection,
    take_rows,
)

__all__ = ["Property", "Example", "PropertyFailure", "catalogue", "get", "select", "KINDS", "OUTPUT_KINDS"]

KINDS = ("vs_reference", "metamorphic")

QSFA = "kv_quant_sparse_flash_attention"
SFA = "sparse_flash_attention"
LI = "lightning_indexer"
QLI = "quant_lightning_indexer"
MERGE = "merge_attention_lse"
_ATTN_FLOAT = {"attention_out": "float", "softmax_max": "float", "softmax_sum": "float"}
#: how each operator's outputs are compared across backends ("bytes" unless listed)
OUTPUT_KINDS = {QSFA: _ATTN_FLOAT, SFA: _ATTN_FLOAT, MERGE: _ATTN_FLOAT}


class Example(NamedTuple):
    """One drawn example: the operator's arguments, a seed for the check's own random choices (which slot
    to skip, which permutation), and for invalid-argument properties the constraint that must fire."""

    args: dict
    seed: int = 0
    constraint: Constraint | None = None

    def __repr__(self) -> str:
        # arrays by shape and dtype (small integer ones by value): hypothesis reprs every explicit (edge) example
        # before running it, and NumPy's repr of the KV arrays cost more than a reference call (issue 15)
        from .runner import summarize

        return (f"Example(args={summarize(Example(self.args))!r}, seed={self.seed}, "
                f"constraint={getattr(self.constraint, 'id', None)!r})")


@dataclass(frozen=True)
class Property:
    """A named conformance property.

    name:     ``<operator>.<property>``, unique; used in reports, case files and ``--properties``.
    ops:      the operators it calls; the first is the one whose arguments it draws (and saves as a case).
    kind:     "vs_reference" or "metamorphic".
    doc:      what it asserts, in words.
    strategy: ``strategy(bounds, chip, pins) -> SearchStrategy[Example]``.
    check:    ``check(example, backend) -> None``; raises :class:`PropertyFailure` when it does not hold.
    pins:     choices the property fixes in the operator's strategy (e.g. ``layout_kv="PA_BSND"``).
    """

    name: str
    ops: tuple[str, ...]
    kind: str
    doc: str
    strategy: Callable[..., Any] = field(repr=False, compare=False)
    check: Callable[[Example, str], None] = field(repr=False, compare=False)
    pins: dict = field(default_factory=dict, compare=False)
    #: the check itself handles a backend's kernel limits on ``op`` (the runner then draws without filtering)
    own_limits: bool = field(default=False, compare=False)
    #: the property's own edges (its strategy takes them as the ``edge`` pin), run in the edge phase instead of
    #: the operator's (qsfa._edges.EDGES); None: the operator's
    edges: tuple | None = field(default=None, compare=False)

    @property
    def op(self) -> str:
        return self.ops[0]

    @property
    def family(self) -> str:
        return self.name[len(self.op) + 1:]

    def to_dict(self) -> dict:
        return {"name": self.name, "ops": list(self.ops), "kind": self.kind, "doc": self.doc}


def _examples(op: str, pins: dict | None = None):
    base = dict(pins or {})

    def make(bounds, chip=None, extra=None):
        p = {**base, **(extra or {})}
        return st.builds(lambda a, s: Example(a, s), qst.valid_args(op, bounds, chip=chip, **p),
                         st.integers(0, 2**32 - 1))

    return make


def _rng(ex: Example) -> np.random.Generator:
    return np.random.default_rng(ex.seed)


def _same_array(a, b) -> bool:
    return a is b or (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                      and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)))


# ===================================================================================================
# vs_reference


def _vs_reference(op: str) -> Property:
    kinds = OUTPUT_KINDS.get(op, {})
    how = ("the docs/numerics/comparison.md#float-criterion float criterion for " + ", ".join(sorted(kinds))) if kinds else "bytes"

    def check(ex: Example, backend: str):
        got = call(op, ex.args, backend)
        for run_no in range(2, repeat_count() + 1):  # --repeat: the backend must give the same bytes every run
            again = compare_outputs(call(op, ex.args, backend), got)
            if again:
                fail(f"backend {backend!r} is not deterministic: run {run_no} of {repeat_count()} differs from run 1 "
                     "byte for byte:\n" + "\n".join(again))
        want = call(op, ex.args, "reference")
        fmt = ex.args.get("fmt") if op == "formats.encode" and ex.args.get("fmt") != "int8" else None
        bad = compare_outputs(got, want, kinds, fmt=fmt, ignore=unspecified_bytes(op, ex.args), judge=True)
        if bad:
            fail(f"backend {backend!r} differs from the reference:\n" + "\n".join(bad))

    return Property(f"{op}.vs_reference", (op,), "vs_reference",
                    f"Every output equals the reference backend's on the same arguments ({how}; bytes a layout leaves "
                    "unspecified, qsfa.layouts.unspecified_bytes, are not compared).",
                    _examples(op), check)


# ===================================================================================================
# invalid arguments


def _snapshot(args: dict, names) -> dict:
    return {n: np.ascontiguousarray(args[n]).view(np.uint8).tobytes() for n in names
            if isinstance(args.get(n), np.ndarray)}


def _invalid(op: str) -> Property:
    inplace = operator(op).contract.inplace

    def make(bounds, chip=None, extra=None):
        return st.builds(lambda inv: Example(inv.args, 0, inv.constraint),
                         qst.invalid_args(op, bounds, chip=chip, **(extra or {})))

    def check(ex: Example, backend: str):
        c = ex.constraint
        a = {k: qst.clone(v) for k, v in ex.args.items()}
        before = _snapshot(a, inplace)
        try:
            run(op, a, backend, chip=current_chip())
        except (InvalidArgument, InvalidDtype) as e:
            if e.constraint_id != c.id:
                fail(f"expected constraint {c.id} to fire, got {e.constraint_id}: {e}")
            msg = str(e)
            if not (msg.startswith("Invalid ") and f" for {c.param}, actual: " in msg and "reason: " in msg):
                fail(f"{c.id}: message does not follow 'Invalid <kind> for <param>, actual: ..., reason: ...': {msg}")
            if isinstance(e, InvalidDtype) != c.dtype:
                fail(f"{c.id}: raised {type(e).__name__}, expected {'InvalidDtype' if c.dtype else 'InvalidArgument'}")
        except Exception as e:  # noqa: BLE001 - any other outcome is the failure being reported
            fail(f"expected {c.id} ({c.kind} of {c.param}) to be rejected, got {type(e).__name__}: {e}")
        else:
            fail(f"arguments violating {c.id} ({c.param}: {c.reason}) were accepted")
        after = _snapshot(a, inplace)
        changed = [n for n in before if before[n] != after.get(n)]
        if changed:
            fail(f"{c.id} was raised but in-place buffer(s) {changed} were written first")

    return Property(f"{op}.invalid_rejected", (op,), "metamorphic",
                    "Arguments that break exactly one documented constraint raise that constraint's "
                    "InvalidArgument / InvalidDtype ('Invalid <kind> for <param>, actual: ..., reason: ...') "
                    "and leave every in-place buffer untouched.", make, check)


# ===================================================================================================
# formats


def _decode_encode() -> Property:
    def check(ex: Example, backend: str):
        a = ex.args
        fmt = a["fmt"]
        vals = call("formats.decode", a, backend)["values"]
        codes = np.asarray(a["codes"])
        nan = np.isnan(vals)
        enc = call("formats.encode", dict(x=vals, fmt=fmt, saturate=False, rounding=None), backend)["codes"]
        want = codes.view(np.uint16 if codes.dtype.itemsize == 2 else np.uint8)
        got = enc.view(want.dtype)
        bad = (got != want) & ~nan
        if bad.any():
            i = int(np.argmax(bad.reshape(-1)))
            fail(f"{fmt}: encode(decode(c)) != c for {int(bad.sum())} codes; first: code {int(want.reshape(-1)[i]):#x} "
                 f"-> {float(vals.reshape(-1)[i])!r} -> {int(got.reshape(-1)[i]):#x}")

    return Property("formats.decode.encode_roundtrip", ("formats.decode", "formats.encode"), "metamorphic",
                    "encode(decode(c)) == c for every code that is not NaN (every finite value and infinity "
                    "has exactly one code, -0 included where the format has one).", _examples("formats.decode"), check)


def _pack_roundtrip() -> Property:
    def check(ex: Example, backend: str):
        a = ex.args
        packed = call("formats.pack_fp4", a, backend)["packed"]
        back = call("formats.unpack_fp4", dict(packed=packed, nibble_order=a["nibble_order"]), backend)["codes"]
        bad = compare_outputs({"codes": back}, {"codes": a["codes"]})
        if bad:
            fail("unpack_fp4(pack_fp4(c)) != c:\n" + "\n".join(bad))

    return Property("formats.pack_fp4.unpack_roundtrip", ("formats.pack_fp4", "formats.unpack_fp4"), "metamorphic",
                    "unpack_fp4(pack_fp4(c)) == c for both nibble orders.", _examples("formats.pack_fp4"), check)


# ===================================================================================================
# cache writers


#: operator -> (slot parameter, per-token parameters, row layout: "row" | "kce" | None)
_WRITERS = {
    "scatter_by_slot": ("slot_mapping", ("rows",), "row"),
    "c8_cache_write": ("slot_mapping", ("k_nope", "k_rope"), "row"),
    "c8_rmsnorm_rope_cache": ("slot_mapping", ("kv", "cos", "sin"), "row"),
    "kv_compress_epilog": ("slot_mapping", ("x",), "kce"),
    "kv_compress_epilog_vllm": ("slot_mapping", ("x",), None),
    "kv_rmsnorm_rope_cache": ("index", (), None),
    "indexer_quant_cache": ("slot_mapping", ("x",), None),
    "indexer_compress_epilog_v2": ("slot_mapping", ("x",), None),
    "scatter_pa_kv_cache_with_k_scale": ("slot_mapping", ("key", "value", "key_scale"), None),
}


#: writers whose kernel skips every slot at or past the cache's end (not only -1): operator -> number of slots
_SLOT_LIMIT = {"scatter_pa_kv_cache_with_k_scale": lambda a: a["key_cache"].shape[0] * a["key_cache"].shape[2]}


def _flip(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` (same layout) with every byte inverted: a prefill that differs from ``a`` everywhere."""
    out = qst.clone(a)
    if out.flags.c_contiguous:
        v = out.reshape(-1).view(np.uint8)
        v ^= 0xFF
    else:  # strided caches are one-byte arrays
        out.view(np.uint8)[...] ^= 0xFF
    return out


def _bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[:2] + (-1,)) if a.ndim >= 2 else a.view(np.uint8)


def _write_map(op: str, args: dict, backend: str):
    """Run twice with complementary prefills. Returns per cache ``(written, out1)`` with ``written`` the bytes
    whose new value does not depend on the old contents; fails if a byte is neither written nor kept."""
    inplace = operator(op).contract.inplace
    flipped = dict(args)
    for n in inplace:
        flipped[n] = _flip(args[n])
    o1 = call(op, args, backend)
    o2 = call(op, flipped, backend)
    free = unspecified_bytes(op, args)  # bytes the layout leaves unspecified: any value counts as written
    res = {}
    for n in inplace:
        p1, p2 = _bytes(args[n]), _bytes(flipped[n])
        b1, b2 = _bytes(o1[n]), _bytes(o2[n])
        written = b1 == b2
        if n in free:
            written |= _bytes(np.ascontiguousarray(free[n])).astype(bool)
        kept = (b1 == p1) & (b2 == p2)
        odd = ~(written | kept)
        if odd.any():
            pos = tuple(int(i) for i in np.argwhere(odd)[0])
            fail(f"{n}: {int(odd.sum())} bytes are neither rewritten nor kept (they depend on the old contents); "
                 f"first at {pos}")
        res[n] = (written, b1)
    return res


def _skip_slots(op: str) -> Property:
    slot_param, _, layout = _WRITERS[op]

    def check(ex: Example, backend: str):
        a = ex.args
        base = _write_map(op, a, backend)
        slots = np.asarray(a[slot_param]).reshape(-1).astype(np.int64)
        if layout is not None:
            cname = operator(op).contract.inplace[0]
            written, _ = base[cname]
            cache = a[cname]
            rows = written.reshape(cache.shape[0] * cache.shape[1], -1)
            targeted = np.zeros(rows.shape[0], bool)
            targeted[slots[slots >= 0]] = True
            if rows[~targeted].any():
                r = int(np.argmax(rows.any(axis=1) & ~targeted))
                fail(f"row {r} (block {r // cache.shape[1]}, offset {r % cache.shape[1]}) is written but no token "
                     f"maps to it (slots {slots.tolist()})")
            if layout == "row":
                expect = np.ones(rows.shape[1], bool)
            else:
                from ..reference.kv_compress_epilog import kv_cache_col

                col = kv_cache_col(a["x"].shape[-1], a["quant_mode"], a["quant_group_size"], a["pad_to"])
                expect = np.arange(rows.shape[1]) < col
            wrong = rows[targeted] != expect[None, :]
            if wrong.any():
                r, c = (int(i) for i in np.argwhere(wrong)[0])
                fail(f"a targeted row writes bytes {np.flatnonzero(rows[targeted][r]).tolist()[:8]}..., expected "
                     f"exactly bytes [0, {int(expect.sum())}) (first wrong byte {c})")
        ok = slots >= 0
        if op in _SLOT_LIMIT:  # slots past the cache skip their token too
            ok &= slots < _SLOT_LIMIT[op](a)
        valid = np.flatnonzero(ok)
        if valid.size == 0:
            return
        pick = int(valid[_rng(ex).integers(valid.size)])
        b = dict(a)
        s2 = np.array(a[slot_param], copy=True)
        s2.reshape(-1)[pick] = -1
        b[slot_param] = s2
        after = _write_map(op, b, backend)
        free = unspecified_bytes(op, a)
        for n, (w1, o1) in base.items():
            w2, o2 = after[n]
            if (w2 & ~w1).any():
                fail(f"{n}: skipping entry {pick} made other bytes written")
            if w1.any() and not (w1 & ~w2).any():  # (indexer_quant_cache's HiFloat8 mode writes no scale)
                fail(f"{n}: setting {slot_param}[{pick}] = -1 left every byte it wrote still written")
            if n in free:  # unspecified bytes may differ between any two calls
                w2 = w2 & ~_bytes(np.ascontiguousarray(free[n])).astype(bool)
            if (o2[w2] != o1[w2]).any():
                fail(f"{n}: skipping entry {pick} changed bytes written by other entries")

    return Property(f"{op}.skip_slots_untouched", (op,), "metamorphic",
                    f"Every cache byte is either rewritten (its new value does not depend on the old contents) "
                    f"or kept; rows no {slot_param} entry targets keep all their bytes"
                    + (" (a targeted row is written exactly over kvCacheCol bytes)" if layout == "kce" else "")
                    + f"; setting one more {slot_param} entry to -1 un-writes its bytes (they keep their old value) "
                      f"and changes nothing else.", _examples(op), check)


def _token_permutation(op: str) -> Property:
    slot_param, token_params, _ = _WRITERS[op]

    def check(ex: Example, backend: str):
        a = ex.args
        slots = np.asarray(a[slot_param])
        n = slots.size
        perm = _rng(ex).permutation(n)
        b = dict(a)
        b[slot_param] = slots.reshape(-1)[perm].reshape(slots.shape)
        for p in token_params:
            v = a.get(p)
            if v is None:
                continue
            lead = slots.ndim
            flat = v.reshape((n,) + v.shape[lead:])
            b[p] = np.ascontiguousarray(flat[perm].reshape(v.shape))
        o1 = call(op, a, backend)
        o2 = call(op, b, backend)
        cache = operator(op).contract.inplace
        bad = compare_outputs({c: o2[c] for c in cache}, {c: o1[c] for c in cache}, ignore=unspecified_bytes(op, a))
        if bad:
            fail(f"permuting tokens together with their slots (permutation {perm.tolist()}) changed the cache:\n"
                 + "\n".join(bad))

    return Property(f"{op}.token_permutation", (op,), "metamorphic",
                    "Permuting the tokens together with their slots writes the same cache bytes.", _examples(op), check)


# ===================================================================================================
# attention


def _rope_pad(args: dict) -> dict:
    """The rope-0 arguments as rope 64 with zero RoPE: query + 64 zeros, packed rows + 128 zero bytes."""
    b = dict(args)
    q = args["query"]
    b["query"] = np.concatenate([q, np.zeros(q.shape[:-1] + (64,), q.dtype)], axis=-1)
    k = args["key"]
    new = np.concatenate([k[..., :512], np.zeros(k.shape[:-1] + (128,), k.dtype), k[..., 512:]], axis=-1)
    b["key"] = new
    if _same_array(args["value"], k):
        b["value"] = new
    b["rope_head_dim"] = 64
    return b


def _rope0() -> Property:
    def check(ex: Example, backend: str):
        o0 = call(QSFA, ex.args, backend)
        o64 = call(QSFA, _rope_pad(ex.args), backend)
        bad = compare_outputs(o64, o0)
        if bad:
            fail("rope_head_dim 0 and the same data zero-padded to rope 64 are not bit-identical:\n" + "\n".join(bad))

    pins = dict(rope_head_dim=0, key_dtype=("int8", "float8_e4m3fn"))
    return Property(f"{QSFA}.rope0_matches_zero_rope64", (QSFA,), "metamorphic",
                    "rope_head_dim 0 (Q_D 512, 528-byte rows) gives results bit-identical to the same data with "
                    "zero RoPE (Q_D 576, 656-byte rows with zeros at bytes 512..639) (docs/numerics/attention.md#rope-0).",
                    _examples(QSFA, pins), check, pins)


def _junk_after_first_minus1(idx: np.ndarray, rng, hi: int) -> np.ndarray | None:
    flat = idx.reshape(-1, idx.shape[-1]).astype(np.int64)
    neg = flat < 0
    has = neg.any(axis=1)
    first = np.where(has, np.argmax(neg, axis=1), flat.shape[1])
    after = np.arange(flat.shape[1])[None, :] > first[:, None]
    if not after.any():
        return None
    junk = rng.integers(-1, max(hi, 1), flat.shape)
    return np.where(after, junk, flat).astype(np.int32).reshape(idx.shape)


def _minus1_padding(op: str) -> Property:
    def check(ex: Example, backend: str):
        a = ex.args
        base = call(op, a, backend)
        idx = a["sparse_indices"]
        variants = []
        if not (op == QSFA and a.get("key_dtype") == "hifloat8"):  # HiFloat8 needs sparse_size 2048 exactly
            pad = np.full(idx.shape[:-1] + (3,), -1, np.int32)
            variants.append(("three -1 columns appended", np.concatenate([idx, pad], axis=-1)))
        act_kv, _ = kv_addressing(a)
        hi = -(-int(act_kv.max(initial=1)) // int(a["sparse_block_size"])) + 2
        junk = _junk_after_first_minus1(idx, _rng(ex), hi)
        if junk is not None:
            variants.append(("entries after the first -1 replaced by junk", junk))
        # the faithful reference models every fp32 accumulation as correctly rounded, so its result cannot
        # depend on the index width: bytes for it; other backends (and float64 BLAS in precision="exact")
        # may sum a wider score row in another order
        exact_bytes = backend == "reference" and a.get("precision", "faithful") == "faithful"
        kinds = None if exact_bytes else _ATTN_FLOAT
        for what, new in variants:
            out = call(op, {**a, "sparse_indices": new}, backend)
            bad = compare_outputs(out, base, kinds)
            if bad:
                fail(f"{what} changed the result:\n" + "\n".join(bad))

    return Property(f"{op}.minus1_padding_inert", (op,), "metamorphic",
                    "Reading stops at the first -1: appending -1 columns to sparse_indices, or replacing every entry "
                    "after a row's first -1 by junk, changes no output: not a byte on the faithful reference (its fp32 "
                    "accumulations are correctly rounded, independent of the index width), nothing beyond the "
                    "docs/numerics/comparison.md#float-criterion criterion on other backends (a wider score row may be summed in another "
                    "order).", _examples(op), check)


_PAGED = {
    QSFA: ("key", "value"),
    SFA: ("key", "value", "key_rope"),
    LI: ("key",),
    QLI: ("key", "key_dequant_scale"),
}


def _permute_pages(args: dict, rng, names) -> dict:
    key_name = names[0]
    nb = args[key_name].shape[0]
    perm = rng.permutation(nb)  # old block i -> new block perm[i]
    out = dict(args)
    done = {}
    for n in names:
        v = args.get(n)
        if v is None:
            continue
        if id(v) in done:
            out[n] = done[id(v)]
            continue
        new = np.empty_like(v)
        new[perm] = v
        out[n] = new
        done[id(v)] = new
    if "value" in names and _same_array(args.get("value"), args[key_name]):
        out["value"] = out[key_name]
    bt = np.asarray(args["block_table"]).astype(np.int64)
    ok = (bt >= 0) & (bt < nb)
    out["block_table"] = np.where(ok, perm[np.where(ok, bt, 0)], bt).astype(np.int32)
    return out


def _page_permutation(op: str) -> Property:
    names = _PAGED[op]

    def check(ex: Example, backend: str):
        a = ex.args
        o1 = call(op, a, backend)
        o2 = call(op, _permute_pages(a, _rng(ex), names), backend)
        bad = compare_outputs(o2, o1)
        if bad:
            fail("moving the pages and rewriting block_table accordingly changed the result:\n" + "\n".join(bad))

    pins = {"layout_kv": "PA_BSND"}
    return Property(f"{op}.page_permutation", (op,), "metamorphic",
                    f"Under PA_BSND, permuting the physical blocks of {', '.join(names)} and rewriting block_table to "
                    "match gives bit-identical outputs (pages are addressed only through the block table).",
                    _examples(op, pins), check, pins)


def _stats(out: dict, rows: int):
    n = out["attention_out"].shape[-2]
    o = out["attention_out"].reshape(rows, n, -1)
    m = out["softmax_max"].reshape(rows, n)
    s = out["softmax_sum"].reshape(rows, n)
    return o, m, s


def _kv_model(op: str, args: dict, flat: np.ndarray):
    """float64 (K rows, V rows) as the kernel sees them (docs/numerics/attention.md#rounding-points precision points),
    of the flat cache rows ``flat`` only (:func:`~qsfa.conformance._support.selected_tokens`)."""
    names = ("key",) if op == QSFA else ("key", "value", "key_rope")
    sub = dict(args, **{n: take_rows(args.get(n), flat) for n in names if n in args})
    if op == QSFA:
        faithful = args.get("precision", "faithful") == "faithful"
        return packed_kv(sub, faithful=faithful)
    return float_kv(sub)


def _uniform(op: str) -> Property:
    def check(ex: Example, backend: str):
        a = dict(ex.args)
        a["query"] = np.zeros_like(a["query"])
        if a.get("query_rope") is not None:
            a["query_rope"] = np.zeros_like(a["query_rope"])
        out = call(op, a, backend)
        w, batch, act_kv, storage, _ = selection(a)
        rows = batch.size
        cnt = w.sum(axis=1)
        want, bound = uniform_scores_model(op, a, w, batch, act_kv, storage)
        if a.get("return_softmax_lse"):  # the statistics where the chip writes them (not the 950's QSFA)
            o, m, s = _stats(out, rows)
            if (m != 0).any():
                r, h = (int(i) for i in np.argwhere(m != 0)[0])
                fail(f"all scores are 0 but softmax_max[{r}, {h}] = {m[r, h]!r}")
            bad_cnt = s != cnt[:, None]
            if bad_cnt.any():
                r, h = (int(i) for i in np.argwhere(bad_cnt)[0])
                fail(f"softmax_sum[row {r}, head {h}] = {s[r, h]!r}, expected the number of selected tokens "
                     f"{int(cnt[r])}")
        else:
            n = out["attention_out"].shape[-2]
            o = out["attention_out"].reshape(rows, n, -1)
        err = np.abs(o.astype(np.float64) - want[:, None, :])
        bad = ~(err <= bound[:, None, :])
        if bad.any():
            r, h, j = (int(i) for i in np.argwhere(bad)[0])
            fail(f"with all scores 0, attention_out[row {r}, head {h}, {j}] = {float(o[r, h, j])!r}; the model of "
                 f"the {int(cnt[r])} selected V rows gives {float(want[r, j])!r} (|error| {float(err[r, h, j]):.3g} > "
                 f"derived bound {float(bound[r, j]):.3g}; {int(bad.sum())} elements out of bound)")

    pins = {"return_softmax_lse": (True, False)}  # the output alone where the chip writes no LSE (the 950's QSFA)
    if op == SFA:
        pins.update(layout_kv=("BSND", "TND"), sinks=False)
    return Property(f"{op}.uniform_scores", (op,), "metamorphic",
                    "With a zero query every score is 0: softmax_max == 0 and softmax_sum == the number of selected "
                    "tokens exactly (where return_softmax_lse; the 950's QSFA writes no LSE and is checked on the "
                    "output alone), and the output is the selected V rows' sum times the probability as the "
                    "kernel rounds it (1 / count, or the query-dtype rounding of fp32(1 / count) when normalised), "
                    "within a derived fp32-accumulation + half-ulp bound (qsfa.conformance._models; docs/numerics/attention.md#token-selection).",
                    _examples(op, pins), check, pins)


_U32 = 2.0 ** -24


def _lse(op: str) -> Property:
    def check(ex: Example, backend: str):
        a = ex.args
        out = call(op, a, backend)
        w, batch, act_kv, storage, _ = selection(a)
        rows = batch.size
        o, m, s = _stats(out, rows)
        groups = selected_tokens(w, batch, act_kv, storage)  # only the selected tokens' rows (weight 0 adds nothing)
        flat = np.concatenate([g[3] for g in groups]).astype(np.int64) if groups else np.zeros(0, np.int64)
        k, _ = _kv_model(op, a, flat)
        q = query_matrix(a)
        k = k[:, : q.shape[-1]]
        exact = a.get("precision", "faithful") == "exact"
        scale = float(a["scale_value"])
        d = q.shape[-1]
        gamma = d * _U32 / (1 - d * _U32)
        sinks = a.get("sinks")
        with_sink = sinks is not None and bool(a.get("lse_includes_sink"))
        cnt = w.sum(axis=1)
        empty = cnt == 0
        if (m[empty] != 0).any() or (s[empty] != 0).any() or (o[empty] != 0).any():
            r = int(np.flatnonzero(empty)[0])
            fail(f"row {r} selects no token: expected output 0 and softmax_max = softmax_sum = 0, got max "
                 f"{m[r].tolist()[:4]}, sum {s[r].tolist()[:4]}")
        start = 0
        for _, rb, tok, _ in groups:  # batches: a handful
            kb = k[start:start + tok.size]
            start += tok.size
            rb = rb[~empty[rb]]
            if not rb.size:
                continue
            sc = scale * np.einsum("rnd,sd->rns", q[rb], kb)
            mag = np.abs(scale) * np.einsum("rnd,sd->rns", np.abs(q[rb]), np.abs(kb))
            wb = w[rb][:, tok][:, None, :]
            sel = wb > 0
            mx = np.where(sel, sc, -np.inf).max(axis=-1)
            tot = (wb * np.exp(np.where(sel, sc - mx[..., None], -np.inf))).sum(axis=-1)
            lse = mx + np.log(tot)
            if with_sink:
                lse = np.logaddexp(lse, sinks.astype(np.float64)[None, :])
            got_lse = m[rb].astype(np.float64) + np.log(s[rb].astype(np.float64))
            if exact:
                tol_m = 1e-12 * (1 + np.abs(mx))
                tol = 1e-9 * (1 + np.abs(lse))
            else:
                delta = np.where(sel, mag * gamma + np.abs(sc) * 2 * _U32, 0).max(axis=-1)
                tol_m = delta + 4 * _U32 * np.abs(mx)
                tol = 2 * delta + (cnt[rb][:, None] + 16) * 2 * _U32 + 4 * _U32 * (np.abs(mx) + np.abs(lse))
            for what, got, want, t in (("softmax_max", m[rb], mx, tol_m), ("max + log(sum)", got_lse, lse, tol)):
                err = np.abs(got.astype(np.float64) - want)
                bad = ~(err <= t)
                if bad.any():
                    r, h = (int(i) for i in np.argwhere(bad)[0])
                    fail(f"{what} of row {int(rb[r])} head {h} is {float(got[r, h])!r}, the float64 logsumexp over its "
                         f"{int(cnt[rb[r]])} selected scores gives {float(want[r, h])!r} (|error| {float(err[r, h]):.3g} "
                         f"> bound {float(t[r, h]):.3g})")

    pins = {"return_softmax_lse": True}
    if op == SFA:
        pins.update(layout_kv=("BSND", "TND"))
    return Property(f"{op}.lse_matches_logsumexp", (op,), "metamorphic",
                    "softmax_max + log(softmax_sum) equals a float64 logsumexp over the row's selected scores "
                    "(scores from the dequantised K as the kernel rounds it, selection modelled from docs/numerics/attention.md#rounding-points), "
                    "within the fp32 dot-product / exp / sum error bound; rows that select nothing give 0 / 0 and "
                    "a zero output.", _examples(op, pins), check, pins)


def _split_merge(op: str) -> Property:
    def check(ex: Example, backend: str):
        a = ex.args
        try:
            full = call(op, a, backend)
            att = backend
        except UnsupportedByBackend:  # a faithful-only backend (triton): exact shards from the reference, its merge
            att = "reference"
            full = call(op, a, att)
        idx, ok = read_entries(a)
        rank = np.cumsum(ok, axis=1) - 1
        shards = []
        for part in (0, 1):
            mask = ok & (rank % 2 == part)
            order = np.argsort(~mask, axis=1, kind="stable")
            vals = np.take_along_axis(idx, order, axis=1)
            keep = np.take_along_axis(mask, order, axis=1)
            new = np.where(keep, vals, -1).astype(np.int32).reshape(a["sparse_indices"].shape)
            shards.append(call(op, {**a, "sparse_indices": new}, att))
        for part, sh in enumerate(shards):  # the backend's own output, not a merge input error, is the failure
            for stat in ("softmax_max", "softmax_sum"):
                bad_stat = ~np.isfinite(np.asarray(sh[stat], np.float64))
                if bad_stat.any():
                    fail(f"shard {part}: {stat} has {int(bad_stat.sum())} non-finite values (first "
                         f"{np.asarray(sh[stat]).reshape(-1)[np.argmax(bad_stat.reshape(-1))]!r} at flat index "
                         f"{int(np.argmax(bad_stat.reshape(-1)))}); the LSE statistics must be finite")
        merged = call(MERGE, dict(attention_out=np.stack([p["attention_out"] for p in shards]),
                                  softmax_max=np.stack([p["softmax_max"] for p in shards]),
                                  softmax_sum=np.stack([p["softmax_sum"] for p in shards]),
                                  layout_query=a["layout_query"]), backend)
        bad = compare_outputs(merged, full, _ATTN_FLOAT)
        if bad:
            fail("attention over two disjoint halves of each row's entries, merged through the LSE, differs from "
                 "the unsplit call:\n" + "\n".join(bad))

    pins = {"return_softmax_lse": True, "precision": "exact"}
    if op == SFA:
        pins.update(layout_kv=("BSND", "TND"), sinks=False)
    return Property(f"{op}.split_merge", (op, MERGE), "metamorphic",
                    "Splitting every row's read index entries into two disjoint shards, attending over each with "
                    "return_softmax_lse and merging with merge_attention_lse gives the unsplit result (precision "
                    "'exact'; docs/numerics/comparison.md#float-criterion criterion). A backend that declines 'exact' "
                    "attention (triton) is checked on its merge of the reference's exact shards.", _examples(op, pins),
                    check, pins, own_limits=True)


# ===================================================================================================
# indexers


def _indexer_scores(op: str, args: dict):
    """float64 scores [R, S] of every row against tokens 0..S-1 of its batch, the row limits and the batch."""
    from .. import formats

    batch, pos, valid, act_q = query_rows(args)
    act_kv, storage = kv_addressing(args, layout="layout_key", lens="actual_seq_lengths_key")
    akv = act_kv[batch]
    thr = akv - act_q[batch] + pos + 1 if args.get("sparse_mode", 3) == 3 else akv.copy()
    limit = np.clip(np.minimum(akv, np.where(valid, thr, 0)), 0, None)
    q, k = args["query"], args["key"]
    n1 = q.shape[-2]
    if op == QLI:
        qf = args.get("query_dtype") or dtype_name(q)
        kf = args.get("key_dtype") or dtype_name(k)
        qv = np.asarray(formats.decode(np.ascontiguousarray(q).view(np.uint8), qf), np.float64)
        kv = np.asarray(formats.decode(np.ascontiguousarray(k).view(np.uint8), kf), np.float64)
        qs = args["query_dequant_scale"].reshape(-1, n1).astype(np.float64)
        ks = args["key_dequant_scale"].reshape(-1).astype(np.float64)
    else:
        qv, kv = q.astype(np.float64), k.astype(np.float64)
        qs = ks = None
    qv = qv.reshape(-1, n1, 128)
    kv = kv.reshape(-1, 128)
    wts = args["weights"].reshape(-1, n1).astype(np.float64)
    s_max = max(int(act_kv.max(initial=0)), 1)
    scores = np.full((batch.size, s_max), -np.inf)
    for b in range(act_kv.size):  # batches: a handful
        rb = np.flatnonzero(batch == b)
        if not rb.size:
            continue
        kb = gather_tokens(kv, storage, b, s_max, act_kv)
        dots = np.einsum("rnd,sd->rns", qv[rb], kb)
        if qs is not None:
            ksb = gather_tokens(ks[:, None], storage, b, s_max, act_kv)[:, 0]
            dots = dots * (qs[rb][:, :, None] * ksb[None, None, :])
        sc = (wts[rb][:, :, None] * np.maximum(dots, 0)).sum(axis=1)
        scores[rb] = np.where(np.arange(s_max)[None, :] < limit[rb][:, None], sc, -np.inf)
    return scores, limit


def _topk(op: str) -> Property:
    pins = {"exact_scores": True}  # no scale_order edge (its near-ties are not exact in fp32)

    def check(ex: Example, backend: str):
        a = ex.args
        out = call(op, a, backend)
        scores, limit = _indexer_scores(op, a)
        k = int(a["sparse_count"])
        rows = scores.shape[0]
        order = np.argsort(-scores, axis=1, kind="stable")
        want = np.full((rows, k), -1, np.int64)
        take = min(k, scores.shape[1])
        keep = np.arange(take)[None, :] < np.minimum(limit, k)[:, None]
        want[:, :take] = np.where(keep, order[:, :take], -1)
        got = out["sparse_indices"].reshape(rows, k).astype(np.int64)
        if not np.array_equal(got, want):
            r = int(np.argmax((got != want).any(axis=1)))
            fail(f"row {r} (visible tokens {int(limit[r])}): indices {got[r][:12].tolist()}, expected the top-{k} of the "
                 f"exact scores in descending order, ties by lower index: {want[r][:12].tolist()}")
        if op == LI and a.get("return_value"):
            qd = dtype_name(a["query"])
            vals = np.take_along_axis(scores, np.maximum(want, 0), axis=1)
            from .._arrays import numpy_dtype

            exp_v = np.where(want >= 0, vals, -np.inf).astype(np.float32).astype(numpy_dtype(qd))
            bad = compare_outputs({"sparse_values": out["sparse_values"].reshape(rows, k)},
                                  {"sparse_values": exp_v})
            if bad:
                fail("sparse_values are not the selected exact scores rounded to the query dtype:\n" + "\n".join(bad))

    return Property(f"{op}.topk_exact_scores", (op,), "metamorphic",
                    "On inputs whose scores are exact in fp32, sparse_indices are the top-sparse_count visible tokens "
                    "of a float64 model of the score (docs/numerics/indexer.md#lightning_indexer) in descending order, ties by lower index (the "
                    "OPEN tie_break default), padded with -1" + (", and sparse_values are those scores rounded to the "
                                                                  "query dtype." if op == LI else "."),
                    _examples(op, pins), check, pins)


# ===================================================================================================
# merge


def _merge_single() -> Property:
    def check(ex: Example, backend: str):
        a = ex.args
        out = call(MERGE, a, backend)
        s = a["softmax_sum"][0]
        o = a["attention_out"][0]
        empty = (s == 0)
        empty_o = empty[:, 0] if a["layout_query"] == "BSND" else empty[0]
        want_o = np.where(empty_o[..., None], 0, o.astype(np.float64)).astype(o.dtype)
        want = {"attention_out": want_o, "softmax_max": np.where(empty, 0, a["softmax_max"][0]).astype(s.dtype),
                "softmax_sum": s}
        kinds = {"attention_out": "float"} if o.dtype == np.float64 else {}
        bad = compare_outputs(out, want, kinds)
        if bad:
            fail("merging a single partial result did not return it unchanged:\n" + "\n".join(bad))

    pins = {"parts": 1}
    return Property(f"{MERGE}.single_part_identity", (MERGE,), "metamorphic",
                    "Merging one partial result returns it unchanged (bit-identical for 16/32-bit outputs; an empty "
                    "shard gives 0 / 0 / 0).", _examples(MERGE, pins), check, pins)


# ===================================================================================================
# the catalogue


def _build() -> list[Property]:
    from .._dispatch import operators
    from ..strategies import STRATEGIES

    ops = [o for o in STRATEGIES if o in operators()]
    props: list[Property] = []
    for op in ops:
        props.append(_vs_reference(op))
        props.append(_invalid(op))
    have = set(ops)
    if {"formats.decode", "formats.encode"} <= have:
        props.append(_decode_encode())
    if {"formats.pack_fp4", "formats.unpack_fp4"} <= have:
        props.append(_pack_roundtrip())
    for op in _WRITERS:
        if op in have:
            props.append(_skip_slots(op))
            if _WRITERS[op][1]:
                props.append(_token_permutation(op))
    if QSFA in have:
        props.append(_rope0())
    for op in (QSFA, SFA):
        if op in have:
            props += [_minus1_padding(op), _page_permutation(op), _uniform(op), _lse(op)]
            if MERGE in have:
                props.append(_split_merge(op))
    for op in (LI, QLI):
        if op in have:
            props += [_page_permutation(op), _topk(op)]
    if MERGE in have:
        props.append(_merge_single())
    from .properties_more import more_properties

    props += more_properties(have, Property, _examples)
    from .properties_chips import rounding_properties

    props += rounding_properties(have, Property, Example)
    from .properties_ties import tie_properties

    props += tie_properties(have, Property, Example)
    from .properties_v4 import v4_properties

    props += v4_properties(have, Property, _examples)
    from .properties_batch import batch_properties

    props += batch_properties(have, Property, _examples)
    order = {op: i for i, op in enumerate(ops)}
    props.sort(key=lambda p: (order.get(p.op, 99), p.kind != "vs_reference", p.name))
    names = [p.name for p in props]
    assert len(names) == len(set(names)), "duplicate property names"
    return props


_CATALOGUE: list[Property] | None = None


def catalogue() -> list[Property]:
    """Every property, grouped by operator (the vs_reference property of each operator first)."""
    global _CATALOGUE
    if _CATALOGUE is None:
        _CATALOGUE = _build()
    return list(_CATALOGUE)


def get(name: str) -> Property:
    for p in catalogue():
        if p.name == name:
            return p
    raise KeyError(f"unknown property {name!r}")


def select(*, ops=None, properties=None, kinds=None) -> list[Property]:
    """Properties filtered by operator names (a property matches if any of its ops is listed), by name
    patterns (``fnmatch``: ``"*.page_permutation"``; a plain family name such as ``"vs_reference"`` also
    matches) and by kind."""
    out = []
    for p in catalogue():
        if ops and not any(o in ops for o in p.ops):
            continue
        if properties and not any(fnmatch.fnmatchcase(p.name, pat) or p.family == pat or
                                  fnmatch.fnmatchcase(p.family, pat) for pat in properties):
            continue
        if kinds and p.kind not in kinds:
            continue
        out.append(p)
    return out
