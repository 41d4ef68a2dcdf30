"""scatter_pa_kv_cache_with_k_scale (docs/numerics/cache-writers.md#scatter_pa_kv_cache_with_k_scale): a byte copy
into BNBD caches, checked against an element loop written here and against hand-placed bytes."""

import ml_dtypes
import numpy as np
import pytest

import qsfa

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _fp8(rng, shape, dt=E4M3):
    return rng.integers(0, 256, shape, dtype=np.uint8).view(dt)


def _loop(key, value, kc, vc, slots, ks, ksc):
    """The kernel's SIMT loop, element by element (op_kernel/arch35/scatter_pa_kv_cache_with_k_scale_simt.h)."""
    kc, vc, ksc = kc.view(np.uint8).copy(), vc.view(np.uint8).copy(), ksc.copy()
    nb, n, bs, _ = kc.shape
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s < 0 or s >= nb * bs:
            continue
        for h in range(n):
            for e in range(key.shape[2]):
                kc[s // bs, h, s % bs, e] = key.view(np.uint8)[t, h, e]
            for e in range(value.shape[2]):
                vc[s // bs, h, s % bs, e] = value.view(np.uint8)[t, h, e]
            ksc[s // bs, h, s % bs, 0] = ks[t, h]
    return kc, vc, ksc


@pytest.mark.parametrize("dt,slot_dt", [(E4M3, np.int32), (E5M2, np.int64)])
def test_matches_the_element_loop_with_out_of_range_slots_skipped(dt, slot_dt):
    rng = np.random.default_rng(1)
    t, n, dk, dv, nb, bs = 6, 3, 24, 40, 2, 4
    key, value = _fp8(rng, (t, n, dk), dt), _fp8(rng, (t, n, dv), dt)
    kc, vc = _fp8(rng, (nb, n, bs, dk), dt), _fp8(rng, (nb, n, bs, dv), dt)
    ks, ksc = rng.random((t, n)).astype(np.float32), rng.random((nb, n, bs, 1)).astype(np.float32)
    slots = np.array([7, -1, 8, 0, -5, 3], slot_dt)  # 8 = nb * bs and -5: skipped like -1
    want = _loop(key, value, kc, vc, slots, ks, ksc)
    out = qsfa.scatter_pa_kv_cache_with_k_scale(key, value, kc, vc, slots, ks, ksc)
    assert out[0] is kc and out[1] is vc and out[2] is ksc
    assert kc.view(np.uint8).tobytes() == want[0].tobytes() and vc.view(np.uint8).tobytes() == want[1].tobytes()
    assert ksc.tobytes() == want[2].tobytes()


def test_hand_placed_bytes_bnbd():
    # slot 5 with block_size 4 -> block 1, offset 1; head h of token 0 lands at key_cache[1, h, 1, :]
    key = np.arange(2 * 4, dtype=np.uint8).reshape(1, 2, 4).view(E4M3)
    value = (100 + np.arange(2 * 2, dtype=np.uint8)).reshape(1, 2, 2).view(E4M3)
    kc = np.zeros((2, 2, 4, 4), np.uint8).view(E4M3)
    vc = np.zeros((2, 2, 4, 2), np.uint8).view(E4M3)
    ksc = np.zeros((2, 2, 4, 1), np.float32)
    qsfa.scatter_pa_kv_cache_with_k_scale(key, value, kc, vc, np.array([5], np.int32),
                                          np.array([[0.5, -2.0]], np.float32), ksc)
    assert list(kc.view(np.uint8)[1, 0, 1]) == [0, 1, 2, 3] and list(kc.view(np.uint8)[1, 1, 1]) == [4, 5, 6, 7]
    assert list(vc.view(np.uint8)[1, 0, 1]) == [100, 101] and list(vc.view(np.uint8)[1, 1, 1]) == [102, 103]
    assert ksc[1, 0, 1, 0] == 0.5 and ksc[1, 1, 1, 0] == -2.0
    assert np.count_nonzero(kc.view(np.uint8)) == 7 and np.count_nonzero(ksc) == 2  # byte 0 is code 0


def test_strided_caches_and_inputs():
    rng = np.random.default_rng(2)
    key = _fp8(rng, (3, 2, 32))[:, :, ::2]  # non-contiguous input (the aclnn layer copies it)
    value = _fp8(rng, (3, 2, 8))
    big_k = _fp8(rng, (4, 2, 4, 16))
    kc = big_k[::2]  # blocks apart
    vc, ksc = _fp8(rng, (2, 2, 4, 8)), np.zeros((2, 2, 4, 1), np.float32)
    ks = rng.random((3, 2)).astype(np.float32)
    slots = np.array([6, 1, -1], np.int64)
    want = _loop(np.ascontiguousarray(key), value, kc, vc, slots, ks, ksc)
    untouched = big_k[1::2].view(np.uint8).copy()
    qsfa.scatter_pa_kv_cache_with_k_scale(key, value, kc, vc, slots, ks, ksc)
    assert kc.view(np.uint8).tobytes() == np.ascontiguousarray(want[0]).tobytes()
    assert (big_k[1::2].view(np.uint8) == untouched).all()


def test_errors_before_any_write():
    rng = np.random.default_rng(3)
    key, value = _fp8(rng, (2, 1, 8)), _fp8(rng, (2, 1, 8))
    kc, vc = np.zeros((1, 1, 4, 8), np.uint8).view(E4M3), np.zeros((1, 1, 4, 8), np.uint8).view(E4M3)
    ksc = np.zeros((1, 1, 4, 1), np.float32)
    ks = np.ones((2, 1), np.float32)
    with pytest.raises(qsfa.InvalidArgument, match="slot 2 repeated"):
        qsfa.scatter_pa_kv_cache_with_k_scale(key, value, kc, vc, np.array([2, 2], np.int32), ks, ksc)
    with pytest.raises(qsfa.InvalidDtype, match="Invalid dtype for value"):
        qsfa.scatter_pa_kv_cache_with_k_scale(key, value.view(E5M2), kc, vc, np.array([0, 1], np.int32), ks, ksc)
    with pytest.raises(qsfa.InvalidArgument, match="runs on Ascend 950 only"):
        qsfa.scatter_pa_kv_cache_with_k_scale(key, value, kc, vc, np.array([0, 1], np.int32), ks, ksc, chip="A2")
    assert not kc.view(np.uint8).any() and not ksc.any()
    # repeated out-of-range slots are fine: they are skipped
    qsfa.scatter_pa_kv_cache_with_k_scale(key, value, kc, vc, np.array([4, 4], np.int32), ks, ksc)
    assert not ksc.any()


def test_a_request_alone_equals_the_same_request_inside_an_uneven_batch():
    rng = np.random.default_rng(4)
    key, value = _fp8(rng, (23, 2, 16)), _fp8(rng, (23, 2, 16))
    ks = rng.random((23, 2)).astype(np.float32)
    slots = rng.permutation(40)[:23].astype(np.int32)

    def write(sl):
        kc, vc = np.zeros((5, 2, 8, 16), np.uint8).view(E4M3), np.zeros((5, 2, 8, 16), np.uint8).view(E4M3)
        ksc = np.zeros((5, 2, 8, 1), np.float32)
        s = slots.copy()
        s[~sl] = -1
        qsfa.scatter_pa_kv_cache_with_k_scale(key, value, kc, vc, s, ks, ksc)
        return kc.view(np.uint8).tobytes() + vc.view(np.uint8).tobytes() + ksc.tobytes()

    second = np.arange(23) >= 12  # cu_seqlens [0, 12, 23]
    alone = np.zeros((5, 2, 8, 16), np.uint8).view(E4M3), np.zeros((5, 2, 8, 16), np.uint8).view(E4M3), \
        np.zeros((5, 2, 8, 1), np.float32)
    qsfa.scatter_pa_kv_cache_with_k_scale(key[12:], value[12:], *alone[:2], slots[12:], ks[12:], alone[2])
    assert write(second) == alone[0].view(np.uint8).tobytes() + alone[1].view(np.uint8).tobytes() + alone[2].tobytes()
