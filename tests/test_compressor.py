"""compressor (docs/numerics/compressor.md): an independent per-token model, batch invariance (vLLM-Ascend #9496)
and the state carried between calls (speculative verification, vLLM-Ascend #9111).

``_model`` below walks every batch token by token and group by group with Python loops, exact dot products
and a dict as the state, following the public golden's semantics (ops-transformer@c8f98a3
attention/compressor/tests/pytest/compressor_golden.py ``cpu_compressor``); it shares no code with
qsfa.reference.compressor.
"""

import math
import re

import ml_dtypes
import numpy as np
import pytest

import qsfa

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def _dots(x, w):
    """RN32 of the exact dot products: the inputs are multiples of 2^-8 (x) and 2^-12 (w) with 8-bit significands,
    so every float64 partial sum is exact whatever order the matmul adds in."""
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(F32)


def _fold(vals, order):
    vals = [F32(v) for v in vals]
    if order == "sequential":
        acc = F32(0.0)
        for v in vals:
            acc = F32(acc + v)
        return acc
    while len(vals) > 1:
        h = len(vals) // 2
        vals = [F32(vals[i] + vals[i + h]) for i in range(h)]
    return vals[0]


def _bf16_away(v):
    """fp32 -> bf16, ties away from zero, by hand."""
    b = int(np.array([v], F32).view(np.uint32)[0])
    sign, mag = b & 0x80000000, b & 0x7FFFFFFF
    mag = (mag + 0x8000) & 0xFFFF0000
    return np.array([sign | mag], np.uint32).view(F32).astype(BF16)[0]


def _model(x, wkv, wgate, state, ape, table, lens, starts, base, r, cf, order, dots=None, raw=False):
    """Per-token, per-group model: (rows per batch [list of bf16 arrays], state after the call); ``raw``: the
    fp32 rows before the cast (the input of vllm_compressor's norm, tests/test_vllm_compressor.py)."""
    dots = dots or (lambda xr, w, which: _dots(xr, w))
    state = state.copy()
    cd = wkv.shape[0]
    d = cd // cf
    bs = state.shape[1]
    before = state.copy()
    rows_out = []
    for b in range(len(lens)):
        new = {}
        for i in range(lens[b]):
            p = starts[b] + i
            xr = x[base[b] + i][None]
            kv = dots(xr, wkv, 0)[0]
            sc = np.array([F32(v + ape[p % r, c]) for c, v in enumerate(dots(xr, wgate, 1)[0])], F32)
            new[p] = (kv, sc)
            blk = table[b, p // bs]
            if blk != 0:
                state[blk, p % bs, :cd], state[blk, p % bs, cd:] = kv, sc

        def slot(q, half):
            if q < 0:
                return np.zeros(d, F32), np.full(d, -np.inf, F32)
            if q in new:
                kv, sc = new[q]
            else:
                row = before[table[b, q // bs], q % bs]
                kv, sc = row[:cd], row[cd:]
            return kv[half * d:(half + 1) * d], sc[half * d:(half + 1) * d]

        out = []
        for g in range(starts[b] // r, (starts[b] + lens[b]) // r):
            slots = [slot((g - 1) * r + j, 0) for j in range(r)] if cf == 2 else []
            slots += [slot(g * r + j, cf - 1) for j in range(r)]
            kvs = np.stack([s[0] for s in slots])
            scs = np.stack([s[1] for s in slots])
            row = np.empty(d, F32 if raw else BF16)
            for c in range(d):
                m = scs[:, c].max()
                e = [F32(0.0) if s == -np.inf else F32(math.exp(float(F32(s - m)))) for s in scs[:, c]]
                l = _fold(e, order)
                prods = [F32(kvs[k, c] * F32(e[k] / l)) for k in range(len(e))]
                row[c] = _fold(prods, order) if raw else _bf16_away(_fold(prods, order))
            out.append(row)
        rows_out.append(out)
    return rows_out, state


def _grid(rng, shape, step):
    return (rng.integers(-127, 128, shape) * step).astype(BF16)  # 8-bit significands: exact in bf16


def _inputs(rng, h=1024, d=128, r=4, cf=2, t=(6, 5), starts=(3, 0), bs=4, scale=0.05):
    x = _grid(rng, (sum(t), h), 2.0 ** -8)
    wkv = _grid(rng, (cf * d, h), 2.0 ** -12)
    wgate = _grid(rng, (cf * d, h), 2.0 ** -12)
    ape = rng.standard_normal((r, cf * d)).astype(F32)
    width = -(-(max(starts) + max(t)) // bs)
    nblk = 1 + len(t) * width
    state = rng.standard_normal((nblk, bs, 2 * cf * d)).astype(F32)
    table = (1 + np.arange(len(t) * width, dtype=np.int32)).reshape(len(t), width)
    cu = np.concatenate([[0], np.cumsum(t)]).astype(np.int32)
    return dict(x=x, wkv=wkv, wgate=wgate, state_cache=state, ape=ape, state_block_table=table, cu_seqlens=cu,
                start_pos=np.array(starts, np.int32), cmp_ratio=r, coff=cf)


@pytest.mark.parametrize("chip,order", [("A3", "tree"), ("950", "sequential")])
def test_c4_matches_the_independent_model(chip, order):
    rng = np.random.default_rng(1)
    a = _inputs(rng, d=128, t=(6, 3), starts=(3, 5))
    st0 = a["state_cache"].copy()
    cmp_kv, state = qsfa.compressor(**a, chip=chip)
    lens, starts, base = [6, 3], [3, 5], [0, 6]
    rows, st_model = _model(a["x"], a["wkv"], a["wgate"], st0, a["ape"], a["state_block_table"], lens, starts, base,
                            4, 2, order)
    flat = [row for rb in rows for row in rb]
    # groups 0, 1 of batch 0 (positions 3..8: 0..2 from the state) and 1 of batch 1 (positions 5..7: 1..4 from
    # the state; the previous group 0 too)
    assert len(flat) == 3
    assert cmp_kv.shape == (min(9, 9 // 4 + 2), 128)
    assert np.array_equal(cmp_kv[:3].view(np.uint16), np.stack(flat).view(np.uint16))
    assert not cmp_kv[3:].view(np.uint16).any()
    assert np.array_equal(state.view(np.uint32), st_model.view(np.uint32))


@pytest.mark.parametrize("chip,order", [("A3", "tree"), ("950", "sequential")])
def test_c128_matches_the_independent_model(chip, order):
    rng = np.random.default_rng(2)
    a = _inputs(rng, d=512, r=128, cf=1, t=(4,), starts=(126,), bs=64)
    st0 = a["state_cache"].copy()
    cmp_kv, state = qsfa.compressor(**a, chip=chip)
    rows, st_model = _model(a["x"], a["wkv"], a["wgate"], st0, a["ape"], a["state_block_table"], [4], [126], [0],
                            128, 1, order)
    assert len(rows[0]) == 1  # group 0: 126 slots from the state, 2 new; positions 128, 129 wait in the state
    assert np.array_equal(cmp_kv[:1].view(np.uint16), np.stack(rows[0]).view(np.uint16))
    assert np.array_equal(state.view(np.uint32), st_model.view(np.uint32))


def test_exact_is_float64_and_close_to_faithful():
    rng = np.random.default_rng(3)
    a = _inputs(rng)
    f, _ = qsfa.compressor(**dict(a, state_cache=a["state_cache"].copy()))
    e, _ = qsfa.compressor(**dict(a, state_cache=a["state_cache"].copy()), precision="exact")
    assert e.dtype == np.float64 and f.dtype == BF16
    assert np.abs(e - f.astype(np.float64)).max() <= 2.0 ** -7 * np.abs(e).max()


def _run(a, **kw):
    a = dict(a, **kw)
    a["state_cache"] = a["state_cache"].copy()
    return qsfa.compressor(**a)


@pytest.mark.parametrize("chip", ["A3", "950"])
def test_a_request_alone_equals_the_same_request_inside_an_uneven_batch(chip):
    # vLLM-Ascend #9496: one request alone vs inside a batched prefill with cu_seqlens [0, 12, 23]
    rng = np.random.default_rng(4)
    a = _inputs(rng, t=(12, 11), starts=(0, 0), bs=8)
    both, st_both = _run(a, chip=chip)
    alone = dict(a, x=a["x"][12:], cu_seqlens=np.array([0, 11], np.int32), start_pos=np.array([0], np.int32),
                 state_block_table=a["state_block_table"][1:])
    one, st_one = _run(alone, chip=chip)
    n = 11 // 4
    assert np.array_equal(one[:n].view(np.uint16), both[12 // 4:12 // 4 + n].view(np.uint16))
    blocks = a["state_block_table"][1]
    assert np.array_equal(st_one[blocks].view(np.uint32), st_both[blocks].view(np.uint32))


@pytest.mark.parametrize("chip,r,cf,d", [("A3", 4, 2, 128), ("950", 4, 2, 512), ("950", 128, 1, 512)])
def test_k_tokens_at_once_equal_k_serial_one_token_calls(chip, r, cf, d):
    # vLLM-Ascend #9111: batched speculative verification must carry the same state as serial decoding
    rng = np.random.default_rng(5)
    k, p0 = (5, 6) if r == 4 else (3, 126)
    a = _inputs(rng, d=d, r=r, cf=cf, t=(k,), starts=(p0,), bs=8 if r == 4 else 128, scale=0.03)
    at_once, st_once = _run(a, chip=chip)
    state = a["state_cache"].copy()
    rows = []
    for i in range(k):
        one = dict(a, x=a["x"][i:i + 1], cu_seqlens=np.array([0, 1], np.int32),
                   start_pos=np.array([p0 + i], np.int32), state_cache=state)
        out, state = qsfa.compressor(**one, chip=chip)
        if (p0 + i + 1) % r == 0:
            rows.append(out[0])
    assert len(rows) >= 1
    assert np.array_equal(np.stack(rows).view(np.uint16), at_once[:len(rows)].view(np.uint16))
    assert np.array_equal(state.view(np.uint32), st_once.view(np.uint32))


def test_bsh_layout_and_seqused():
    rng = np.random.default_rng(6)
    a = _inputs(rng, t=(8, 8), starts=(0, 2))
    bsh = dict(a, x=a["x"].reshape(2, 8, -1), cu_seqlens=None, seqused=np.array([8, 5], np.int32))
    out, _ = _run(bsh)
    assert out.shape == (2, 2, 128)
    th = dict(a, seqused=np.array([8, 5], np.int32))
    ref, _ = _run(th)
    # batch 0: groups 0, 1; batch 1 (positions 2..6): group 0 only, its row 1 is padding
    assert np.array_equal(out[0].view(np.uint16), ref[:2].view(np.uint16))
    assert np.array_equal(out[1, 0].view(np.uint16), ref[2].view(np.uint16))
    assert not out[1, 1].view(np.uint16).any()


def test_ring_buffer_keeps_the_last_coff_groups():
    rng = np.random.default_rng(7)
    a = _inputs(rng, t=(9,), starts=(0,), bs=4)
    ring = dict(a, cache_mode=2, state_block_table=np.array([1], np.int32),
                state_cache=rng.standard_normal((2, 2 * 4 + 9 - 1, 512)).astype(F32))
    before = ring["state_cache"].copy()
    out, st = _run(ring, chip="950")
    paged, _ = _run(a, chip="950")
    assert np.array_equal(out.view(np.uint16), paged.view(np.uint16))
    # (0 + 9) // 4 = 2 groups done: the ring keeps groups 1 and 2 (positions 4..8), at p % 16
    changed = np.flatnonzero((st[1] != before[1]).any(axis=1))
    assert changed.tolist() == [4, 5, 6, 7, 8]
    assert np.array_equal(st[0], before[0])


def test_a2_is_refused_and_a3_refuses_the_ring_buffer():
    a = _inputs(np.random.default_rng(8))
    with pytest.raises(qsfa.InvalidArgument, match="Atlas A3 and Ascend 950 only"):
        _run(a, chip="A2")
    ring = dict(a, cache_mode=2, state_block_table=np.array([1, 2], np.int32),
                state_cache=np.zeros((3, 16, 512), F32))
    with pytest.raises(qsfa.InvalidArgument, match="cache_mode 1 only"):
        _run(ring, chip="A3")


# ------------------------------------------------------------------------------------------- quant_compressor


def _hif8(values):
    codes = qsfa.formats.encode(np.asarray(values, F32), "hifloat8")
    assert np.array_equal(qsfa.formats.decode(codes, "hifloat8"), np.asarray(values, F32))  # exact by choice
    return codes


def _quant_inputs(rng, **kw):
    a = _inputs(rng, **kw)
    cd = a["wkv"].shape[0]
    # x: integers -8..8, weights k / 64: every product a multiple of 2^-6, every float64 partial sum exact
    a["x"] = _hif8(rng.integers(-8, 9, a["x"].shape))
    a["wkv"] = _hif8(rng.integers(-8, 9, a["wkv"].shape) / 64)
    a["wgate"] = _hif8(rng.integers(-8, 9, a["wgate"].shape) / 64)
    a.update(x_descale=np.array([0.37], F32), wkv_descale=(rng.random(cd) * 0.01 + 1e-3).astype(F32),
             wgate_descale=(rng.random(cd) * 0.01 + 1e-3).astype(F32))
    return a


def test_quant_compressor_matches_the_independent_model():
    rng = np.random.default_rng(11)
    a = _quant_inputs(rng, t=(6, 3), starts=(3, 5))
    st0 = a["state_cache"].copy()
    cmp_kv, state = qsfa.quant_compressor(**a, chip="950")

    def dots(xr, w, which):
        raw = qsfa.formats.decode(xr, "hifloat8").astype(np.float64) @ \
            qsfa.formats.decode(w, "hifloat8").astype(np.float64).T
        desc = F32(a["x_descale"][0]) * (a["wkv_descale"], a["wgate_descale"])[which]  # fp32(w * x), then one multiply
        return raw.astype(F32) * desc.astype(F32)

    rows, st_model = _model(a["x"], a["wkv"], a["wgate"], st0, a["ape"], a["state_block_table"], [6, 3], [3, 5],
                            [0, 6], 4, 2, "sequential", dots)
    flat = np.stack([row for rb in rows for row in rb])
    assert cmp_kv.dtype == BF16 and len(flat) == 3
    assert np.array_equal(cmp_kv[:3].view(np.uint16), flat.view(np.uint16))
    assert np.array_equal(state.view(np.uint32), st_model.view(np.uint32))


def test_quant_compressor_batch_invariance_and_serial_state():
    rng = np.random.default_rng(12)
    a = _quant_inputs(rng, t=(12, 11), starts=(0, 0), bs=8)
    both, st_both = qsfa.quant_compressor(**dict(a, state_cache=a["state_cache"].copy()))
    alone = dict(a, x=a["x"][12:], cu_seqlens=np.array([0, 11], np.int32), start_pos=np.array([0], np.int32),
                 state_block_table=a["state_block_table"][1:], state_cache=a["state_cache"].copy())
    one, _ = qsfa.quant_compressor(**alone)
    assert np.array_equal(one[:2].view(np.uint16), both[3:5].view(np.uint16))
    state = a["state_cache"].copy()
    rows = []
    for i in range(11):  # batch 1 token by token, each call carrying the state the previous one left
        step = dict(alone, x=alone["x"][i:i + 1], cu_seqlens=np.array([0, 1], np.int32),
                    start_pos=np.array([i], np.int32), state_cache=state)
        out, state = qsfa.quant_compressor(**step)
        if (i + 1) % 4 == 0:
            rows.append(out[0])
    assert np.array_equal(np.stack(rows).view(np.uint16), both[3:5].view(np.uint16))
    blocks = a["state_block_table"][1]
    assert np.array_equal(state[blocks].view(np.uint32), st_both[blocks].view(np.uint32))


def test_quant_compressor_refuses_a_nan_code_before_writing():
    a = _quant_inputs(np.random.default_rng(13))
    a["x"] = a["x"].copy()
    a["x"][0, 0] = int(np.flatnonzero(~np.isfinite(qsfa.formats.decode(np.arange(256, dtype=np.uint8), "hifloat8")))[0])
    before = a["state_cache"].copy()
    with pytest.raises(qsfa.InvalidArgument, match="Invalid value for x.*finite"):
        qsfa.quant_compressor(**a)
    assert np.array_equal(a["state_cache"], before)


def test_a_state_block_two_requests_write_or_one_writes_and_another_reads_is_refused():
    """The state a call leaves in a block written by two requests (or written by one and read by another) depends
    on the order requests are handled in; a block both only read (a shared prefix) is fine. C4Li, block size 4."""
    import qsfa
    from qsfa import InvalidArgument
    from qsfa.ops.compressor import compressor_case

    def call(table, starts, lens=(2, 2)):
        a = compressor_case(3, lens=lens, starts=starts, block_size=4)
        a["state_block_table"] = np.array(table, np.int32)
        a["state_cache"] = np.zeros((8, 4, a["state_cache"].shape[-1]), np.float32)
        return qsfa.compressor(**a, cmp_ratio=4, coff=2, chip="950")

    for table, starts, why in (([[1, 3], [3, 0]], (4, 0), "written by request 0 and used by request 1"),
                               ([[1, 2], [3, 2]], (4, 4), "written by request 0 and used by request 1"),
                               ([[1, 1], [0, 0]], (2, 0), "writes block(s) [1] at two table entries")):
        with pytest.raises(InvalidArgument, match=r"state_block_table.*" + re.escape(why)):
            call(table, starts, lens=(4, 2) if why.startswith("writes") else (2, 2))
    call([[5, 1], [5, 2]], (4, 4))  # block 5 (positions 0..3: the previous group) is read by both, written by none
