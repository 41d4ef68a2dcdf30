"""kv_rmsnorm_rope_cache (docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache, seed 004): hand-worked values, every cache mode against a slow per-token
loop (ml_dtypes / en_dtypes encoders), NZ vs ND storage, PA_BLK chunks, skips and permutations."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import qsfa
from qsfa import layouts
from qsfa.ops.kv_rmsnorm_rope_cache import kv_rmsnorm_rope_cache_example as make_args

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def test_hand_worked_v1_pa():
    kv = np.array([3.0, 4.0, 0.0, 0.0, 1.0, 2.0], BF16).reshape(1, 1, 1, 6)  # Dv 4 | Dk 2
    gamma = np.ones(4, BF16)
    cos = np.full((1, 1, 1, 2), 0.5, BF16)
    sin = np.full((1, 1, 1, 2), 0.75, BF16)
    k_cache = np.full((2, 32, 1, 2), 17, np.int8)
    ckv_cache = np.full((2, 32, 1, 4), 17, np.uint16).view(BF16)
    k_scale = np.array([2.0, 4.0], np.float32)
    out = qsfa.kv_rmsnorm_rope_cache(kv, gamma, cos, sin, np.array([33]), k_cache, ckv_cache,
                                     k_rope_scale=k_scale, cache_mode="PA_BNSD", is_output_kv=True)
    assert out[0] is k_cache and out[1] is ckv_cache
    # RoPE of [1, 2]: [1*0.5 - 2*0.75, 2*0.5 + 1*0.75] = [-1, 1.75]; times [2, 4] -> int8 [-2, 7]
    assert k_cache[1, 1, 0].tolist() == [-2, 7]
    assert out[2].reshape(-1).astype(np.float32).tolist() == [-1.0, 1.75]
    # RMSNorm of [3, 4, 0, 0]: mean square 6.25, rms ~2.5 -> [1.2, 1.6, 0, 0] rounded to bf16
    assert ckv_cache[1, 1, 0].view(np.uint16).tolist() == [0x3F9A, 0x3FCD, 0, 0]
    assert out[3].reshape(-1).view(np.uint16).tolist() == [0x3F9A, 0x3FCD, 0, 0]
    untouched = np.ones((2, 32), bool)
    untouched[1, 1] = False
    assert np.all(k_cache[untouched] == 17) and np.all(ckv_cache.view(np.uint16)[untouched] == 17)


def test_hand_worked_asymmetric_fp8_and_hifloat8():
    en = pytest.importorskip("en_dtypes")
    kv = np.array([1.0, 1.0, 1.0, 1.0, 1.0, -1.0], np.float16).reshape(1, 1, 1, 6)
    gamma = np.array([1.0, 2.0, -1.0, 0.5], np.float16)
    cos, sin = np.ones((1, 1, 1, 2), np.float16), np.zeros((1, 1, 1, 2), np.float16)
    k_cache = np.full((1, 3, 1, 2), 17, np.uint8)  # Norm: [B, N, Scache, Dk], HiFloat8 bytes
    ckv_cache = np.full((1, 1, 3, 4), 17, np.uint8).view(ml_dtypes.float8_e5m2)
    qsfa.kv_rmsnorm_rope_cache(
        kv, gamma, cos, sin, np.array([[2]]), k_cache.reshape(1, 1, 3, 2), ckv_cache,
        k_rope_scale=np.array([3.0], np.float32), k_rope_offset=np.array([0.5], np.float32),
        c_kv_scale=np.array([10.0, 10.0, 10.0, 10.0], np.float32),  # all quant params: same rank
        c_kv_offset=np.array([0.0, 1.0, 0.0, -1.0], np.float32), k_cache_dtype="hifloat8")
    # k = RoPE([1, -1]) with cos 1, sin 0 = [1, -1]; y = k * 3 + 0.5 = [3.5, -2.5] -> HiF8 (ties away)
    assert k_cache[0, 2, 0].tolist() == np.array([3.5, -2.5], np.float32).astype(en.hifloat8).view(np.uint8).tolist()
    # c = gamma * x / rms(x) = gamma (rms of ones = 1, eps 1e-5 negligible after rounding to E5M2)
    y = F32(10.0) * (np.array([1.0, 2.0, -1.0, 0.5], np.float32) / np.sqrt(F32(1.0) + F32(1e-5))) + \
        np.array([0.0, 1.0, 0.0, -1.0], np.float32)
    assert ckv_cache[0, 0, 2].view(np.uint8).tolist() == y.astype(ml_dtypes.float8_e5m2).view(np.uint8).tolist()
    assert np.all(k_cache[0, :2] == 17) and np.all(ckv_cache[0, 0, :2].view(np.uint8) == 17)


def test_v2_rope_reads_fp32_rmsnorm_and_v_is_copied():
    args = make_args(np.random.default_rng(7), version=2, k_fmt="bfloat16", ckv_fmt="bfloat16", heads=2, dk=64,
                     rope=32, seq=4, skip=False)
    k_cache, ckv_cache, k_rope, c_kv = qsfa.kv_rmsnorm_rope_cache(**args)
    assert np.array_equal(c_kv.view(np.uint16), args["v"].view(np.uint16))
    b, n, s, d = args["kv"].shape
    # k_cache row of token (0, 0): slot index[0]
    slot = int(args["index"][0])
    got = k_cache[slot // k_cache.shape[1], slot % k_cache.shape[1]]  # [N, D]
    assert got.view(np.uint16).tobytes() == k_rope[0, :, 0].view(np.uint16).tobytes()
    got_v = ckv_cache[slot // k_cache.shape[1], slot % k_cache.shape[1]]
    assert got_v.view(np.uint16).tobytes() == args["v"][0, :, 0].view(np.uint16).tobytes()


# ------------------------------------------------------------------------ slow per-token reference


def _rms(x, g, eps):
    x = x.astype(np.float32)
    ss = F32(np.sum((x * x).astype(np.float64)))
    rms = np.sqrt(F32(ss * F32(1.0 / x.size)) + F32(eps), dtype=np.float32)
    return (g.astype(np.float32) * (x / rms)).astype(np.float32)


def _rope(x, c, s):
    x, c, s = x.astype(np.float32), c.astype(np.float32), s.astype(np.float32)
    h = x.size // 2
    out = np.empty(x.size, np.float32)
    for k in range(h):
        out[k] = F32(x[2 * k] * c[k]) + F32(-x[2 * k + 1] * s[k])
        out[h + k] = F32(x[2 * k + 1] * c[h + k]) + F32(x[2 * k] * s[h + k])
    return out


def _param(p, head, width):
    if p is None:
        return None
    p = np.asarray(p, np.float32)
    if p.ndim == 2:
        return np.broadcast_to(p[head if p.shape[0] > 1 else 0], (width,))
    return np.broadcast_to(p, (width,))


def _store(vals, fmt, kv_dtype, scale, offset):
    """What a cache of ``fmt`` holds for fp32 ``vals`` of one token/head (uint8 or uint16 codes)."""
    if fmt in ("float16", "bfloat16"):
        return vals.astype(kv_dtype).view(np.uint16)
    y = (vals * scale).astype(np.float32)
    if offset is not None:
        y = (y + offset).astype(np.float32)
    if fmt == "int8":
        return np.clip(np.rint(y), -128, 127).astype(np.int8).view(np.uint8)
    if fmt == "hifloat8":
        en = pytest.importorskip("en_dtypes")
        c = np.clip(y, -32768, 32768).astype(en.hifloat8).view(np.uint8).copy()
        c[c == 0x80] = 0
        return c
    dt = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}[fmt]
    mx = float(ml_dtypes.finfo(dt).max)
    return np.clip(y, -mx, mx).astype(dt).view(np.uint8)


def _logical(cache, mode):
    """The cache as raw codes [blocks, rows, N, D] (uint8 / uint16)."""
    raw = cache.view(np.uint8 if cache.dtype.itemsize == 1 else np.uint16)
    if mode == "Norm":
        return raw.transpose(0, 2, 1, 3).copy()
    if mode in ("PA_NZ", "PA_BLK_NZ"):
        return layouts.nz_to_nd(raw)
    return raw.copy()


def _slow(args, kfmt, cfmt):
    kv, gamma, cos, sin, index = (args[k] for k in ("kv", "gamma", "cos", "sin", "index"))
    v, mode, eps = args["v"], args["cache_mode"], args["epsilon"]
    k_log, c_log = _logical(args["k_cache"], mode), _logical(args["ckv_cache"], mode)
    b_, n_, s_, d_ = kv.shape
    rows = k_log.shape[1]
    for b in range(b_):
        for s in range(s_):
            if mode == "Norm":
                pos = int(index[b, s])
                dest = None if pos == -1 else (b, pos)
            elif mode in ("PA_BLK_BNSD", "PA_BLK_NZ"):
                chunks = -(-s_ // rows)
                start = int(index[b * chunks + s // rows])
                dest = None if start == -1 else (start // rows, s % rows)
            else:
                slot = int(index[b * s_ + s])
                dest = None if slot == -1 else (slot // rows, slot % rows)
            for n in range(n_):
                cs = 0 if cos.shape[2] == 1 else s
                c_, s_t = cos[b, n, cs], sin[b, n, cs]
                if v is None:
                    dv = gamma.size
                    cval = _rms(kv[b, n, s, :dv], gamma, eps)
                    kval = _rope(kv[b, n, s, dv:], c_, s_t)
                else:
                    r = _rms(kv[b, n, s], gamma, eps)
                    rw = cos.shape[3]
                    kval = np.concatenate([_rope(r[:rw], c_, s_t), r[rw:]])
                    cval = v[b, n, s].astype(np.float32)
                if dest is None:
                    continue
                k_log[dest[0], dest[1], n] = _store(kval, kfmt, kv.dtype, _param(args["k_rope_scale"], n, kval.size),
                                                    _param(args["k_rope_offset"], n, kval.size))
                if v is not None and cfmt in ("float16", "bfloat16"):
                    c_log[dest[0], dest[1], n] = v[b, n, s].view(np.uint16)
                else:
                    c_log[dest[0], dest[1], n] = _store(cval, cfmt, kv.dtype,
                                                        _param(args["c_kv_scale"], n, cval.size),
                                                        _param(args["c_kv_offset"], n, cval.size))
    return k_log, c_log


@st.composite
def _krr_case(draw):
    version = draw(st.sampled_from([1, 2]))
    mode = draw(st.sampled_from(["Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"]))
    dtype = draw(st.sampled_from(["bfloat16", "float16"]))
    fmts = ["int8", "float8_e4m3fn", "float8_e5m2", "hifloat8", dtype]
    kf, cf = draw(st.sampled_from(fmts)), draw(st.sampled_from(fmts))
    heads = draw(st.sampled_from([1, 2])) if version == 2 else 1
    kw = dict(version=version, cache_mode=mode, dtype=dtype, k_fmt=kf, ckv_fmt=cf, heads=heads,
              batch=draw(st.integers(1, 2)), seq=draw(st.integers(1, 40)), dv=draw(st.sampled_from([32, 64])),
              dk=draw(st.sampled_from([32, 64])), rope=draw(st.sampled_from([16, 32])),
              offsets=draw(st.booleans()), cos_seq1=draw(st.booleans()),
              param_shape=draw(st.sampled_from(["ND", "D", "1D", "1"])), skip=draw(st.booleans()),
              is_output_kv=draw(st.booleans()))
    return kw, draw(st.integers(0, 2**32 - 1))


@given(_krr_case())
def test_random_against_slow_loop(case):
    kw, seed = case
    args = make_args(np.random.default_rng(seed), **kw)
    k_exp, c_exp = _slow({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()},
                         kw["k_fmt"], kw["ckv_fmt"])
    k_cache, ckv_cache, k_rope, c_kv = qsfa.kv_rmsnorm_rope_cache(**args)
    assert _logical(k_cache, kw["cache_mode"]).tobytes() == k_exp.tobytes()
    assert _logical(ckv_cache, kw["cache_mode"]).tobytes() == c_exp.tobytes()
    quant = kw["k_fmt"] not in ("float16", "bfloat16") or kw["ckv_fmt"] not in ("float16", "bfloat16")
    effective = kw["is_output_kv"] and (kw["cache_mode"] != "Norm" or (kw["version"] == 2 and quant))
    assert (k_rope is not None) == effective and (c_kv is not None) == effective


@pytest.mark.parametrize("nd_mode,nz_mode", [("PA_BNSD", "PA_NZ"), ("PA_BLK_BNSD", "PA_BLK_NZ")])
@pytest.mark.parametrize("version,heads,kf,cf", [(1, 1, "int8", "bfloat16"), (2, 2, "bfloat16", "hifloat8"),
                                                 (1, 1, "float16", "float16")])
def test_nz_and_nd_hold_the_same_logical_contents(nd_mode, nz_mode, version, heads, kf, cf):
    dtype = "float16" if kf == "float16" else "bfloat16"
    common = dict(version=version, heads=heads, k_fmt=kf, ckv_fmt=cf, dtype=dtype, seq=37, dk=64)
    a_nd = make_args(np.random.default_rng(11), cache_mode=nd_mode, **common)
    a_nz = make_args(np.random.default_rng(11), cache_mode=nz_mode, **common)
    assert np.array_equal(a_nd["index"], a_nz["index"])
    nd = qsfa.kv_rmsnorm_rope_cache(**a_nd)
    nz = qsfa.kv_rmsnorm_rope_cache(**a_nz)
    for i in (0, 1):
        raw = nz[i].view(np.uint8 if nz[i].dtype.itemsize == 1 else np.uint16)
        assert nz[i].ndim == 5
        assert layouts.nz_to_nd(raw).tobytes() == nd[i].view(raw.dtype).tobytes()


def test_pa_blk_chunks_start_at_row_zero():
    args = make_args(np.random.default_rng(3), cache_mode="PA_BLK_BNSD", k_fmt="bfloat16", seq=40, batch=1,
                     block_size=32, block_num=4, skip=False)
    args["index"] = np.array([70, 32], np.int64)  # chunk 0 -> block 2 (70 // 32), chunk 1 -> block 1
    k_cache = qsfa.kv_rmsnorm_rope_cache(**args)[0]
    k_rope = qsfa.kv_rmsnorm_rope_cache(**{**args, "k_cache": args["k_cache"].copy(),
                                           "ckv_cache": args["ckv_cache"].copy()})[2]
    bits = k_cache.view(np.uint16)
    kr = k_rope[0, 0].view(np.uint16)  # [S, Dk]
    assert bits[2, :32, 0].tobytes() == kr[:32].tobytes()  # tokens 0..31, rows 0..31 (not from row 70 % 32)
    assert bits[1, :8, 0].tobytes() == kr[32:40].tobytes()  # tokens 32..39 at rows 0..7
    assert np.all(bits[1, 8:] == 17) and np.all(bits[0] == 17) and np.all(bits[3] == 17)


def test_norm_mode_positions_repeat_across_batches():
    args = make_args(np.random.default_rng(4), cache_mode="Norm", k_fmt="bfloat16", batch=2, seq=2, skip=False,
                     cache_seq=4)
    args["index"] = np.array([[3, -1], [3, 0]], np.int64)
    k_cache, _, _, _ = qsfa.kv_rmsnorm_rope_cache(**args)
    bits = k_cache.view(np.uint16)  # [B, N, Scache, Dk]
    assert not np.all(bits[0, 0, 3] == 17) and not np.all(bits[1, 0, 3] == 17) and not np.all(bits[1, 0, 0] == 17)
    assert np.all(bits[0, 0, :3] == 17) and np.all(bits[1, 0, 1:3] == 17)


def test_permuting_batches_with_their_indices_gives_the_same_caches():
    a = make_args(np.random.default_rng(5), cache_mode="PA", k_fmt="int8", ckv_fmt="float8_e4m3fn", batch=2,
                  seq=5, offsets=True)
    perm = np.array([1, 0])
    b = dict(a)
    b.update(kv=a["kv"][perm], cos=a["cos"][perm], sin=a["sin"][perm],
             index=a["index"].reshape(2, 5)[perm].reshape(-1), k_cache=a["k_cache"].copy(),
             ckv_cache=a["ckv_cache"].copy())
    r1, r2 = qsfa.kv_rmsnorm_rope_cache(**a), qsfa.kv_rmsnorm_rope_cache(**b)
    assert r1[0].tobytes() == r2[0].tobytes() and r1[1].tobytes() == r2[1].tobytes()


def test_int8_dequant_within_half_a_step():
    a = make_args(np.random.default_rng(6), cache_mode="PA_BNSD", k_fmt="int8", ckv_fmt="int8", seq=6, skip=False,
                  is_output_kv=True)
    a["k_rope_scale"] = np.full(32, 20.0, np.float32)
    a["c_kv_scale"] = np.full(64, 20.0, np.float32)
    k_cache, ckv_cache, _, _ = qsfa.kv_rmsnorm_rope_cache(**a)
    kv = a["kv"][0, 0].astype(np.float32)  # batch 0: [S, D]
    g = a["gamma"].astype(np.float32)
    rms = np.sqrt((kv[:, :64] ** 2).mean(axis=1, keepdims=True) + 1e-5)
    c_true = kv[:, :64] / rms * g
    bs = k_cache.shape[1]
    slots = a["index"][:6]
    codes = ckv_cache[slots // bs, slots % bs, 0].astype(np.float64)
    assert np.all(np.abs(codes / 20.0 - c_true) <= 0.5 / 20.0 + 1e-5)


def test_is_output_kv_none_in_v1_norm():
    a = make_args(np.random.default_rng(8), cache_mode="Norm", k_fmt="bfloat16", is_output_kv=True)
    assert qsfa.kv_rmsnorm_rope_cache(**a)[2:] == (None, None)


@pytest.mark.parametrize("edit,cid", [
    (lambda a: a.update(index=np.concatenate([a["index"][:1], a["index"][:1], a["index"][2:]])),
     "kv_rmsnorm_rope_cache.index_unique"),
    (lambda a: a.update(k_rope_offset=np.zeros(32, np.float32), k_rope_scale=None),
     "kv_rmsnorm_rope_cache.offset_needs_scale"),
    (lambda a: a.update(k_cache=a["k_cache"].view(np.uint8)), "kv_rmsnorm_rope_cache.k_cache_format"),
    (lambda a: a.update(c_kv_scale=np.ones(64, np.float32)), "kv_rmsnorm_rope_cache.scale_forbidden"),
])
def test_rejections_write_nothing(edit, cid):
    a = make_args(np.random.default_rng(9), skip=False)
    edit(a)
    k_before, c_before = a["k_cache"].tobytes(), a["ckv_cache"].tobytes()
    with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype)) as ei:
        qsfa.kv_rmsnorm_rope_cache(**a)
    assert ei.value.constraint_id == cid
    assert a["k_cache"].tobytes() == k_before and a["ckv_cache"].tobytes() == c_before


def test_torch_tensors_in_place():
    torch = pytest.importorskip("torch")
    a = make_args(np.random.default_rng(10), cache_mode="PA_NZ", k_fmt="int8", ckv_fmt="bfloat16")
    t = {k: (torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if isinstance(v, np.ndarray) and v.dtype == BF16
             else torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in a.items()}
    out = qsfa.kv_rmsnorm_rope_cache(**t)
    assert out[0] is t["k_cache"] and isinstance(out[2], torch.Tensor) and out[2].dtype == torch.bfloat16
    ref = qsfa.kv_rmsnorm_rope_cache(**a)
    assert t["k_cache"].numpy().tobytes() == ref[0].tobytes()
    assert t["ckv_cache"].view(torch.int16).numpy().tobytes() == ref[1].tobytes()


@pytest.mark.parametrize("mode", ["Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"])
@pytest.mark.parametrize("version,kf,cf", [(1, "int8", "float8_e5m2"), (1, "bfloat16", "hifloat8"),
                                           (2, "float8_e4m3fn", "bfloat16"), (2, "hifloat8", "int8")])
def test_every_mode_larger_shapes_against_slow_loop(mode, version, kf, cf):
    kw = dict(version=version, cache_mode=mode, k_fmt=kf, ckv_fmt=cf, heads=2 if version == 2 else 1, batch=2,
              seq=37, dk=64, offsets=True, cos_seq1=version == 1, param_shape="ND")
    args = make_args(np.random.default_rng(12), **kw)
    k_exp, c_exp = _slow({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}, kf, cf)
    k_cache, ckv_cache, _, _ = qsfa.kv_rmsnorm_rope_cache(**args)
    assert _logical(k_cache, mode).tobytes() == k_exp.tobytes()
    assert _logical(ckv_cache, mode).tobytes() == c_exp.tobytes()
    assert np.count_nonzero(_logical(k_cache, mode) != 17) > 0
