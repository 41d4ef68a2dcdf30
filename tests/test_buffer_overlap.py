"""qsfa._buffers.self_overlaps: which in-place layouts may write one byte twice."""

import numpy as np

from qsfa._buffers import self_overlaps


def test_stride_zero_and_interleaved_views_overlap():
    assert self_overlaps(np.broadcast_to(np.zeros(1, np.uint8), (3, 2)))
    a = np.zeros(16, np.uint8)
    assert self_overlaps(np.lib.stride_tricks.as_strided(a, shape=(4, 4), strides=(2, 1)))  # rows interleave


def test_plain_and_empty_arrays_do_not_overlap():
    assert not self_overlaps(np.zeros((2, 3, 4), np.float32))
    assert not self_overlaps(np.zeros((2, 3, 4), np.float32)[:, ::-1, ::2])
    # an empty array has no two elements, whatever strides NumPy gives it (broadcast: stride 0)
    assert not self_overlaps(np.broadcast_to(np.zeros(1, np.uint8), (2, 1, 1, 0)))
    assert not self_overlaps(np.lib.stride_tricks.as_strided(np.zeros(4), shape=(3, 0), strides=(0, 0)))
