"""Metamorphic properties of the cache-family operators added beside the first catalogue.

:func:`more_properties` is called by :func:`qsfa.conformance.properties.catalogue` with the set of operators
that have strategies; each property here is built the same way as those of :mod:`.properties` and its
expectation is derived independently of the reference (a float64 model or a relation between two calls).

* FlashMLA MODEL1 cache (``docs/numerics/flashmla-model1.md``): quantise-dequantise round trip
  (RoPE bits exact, NoPE within half an E4M3 step of its tile scale, scale bytes and pad bytes as the rule
  says) and requantisation stability (dequantised values quantise back to themselves).
"""

from __future__ import annotations

import numpy as np

from ._support import call, fail

__all__ = ["more_properties"]

M1Q = "layouts.flashmla_model1_quantize"
M1D = "layouts.flashmla_model1_dequantize"


def _m1_round_trip(P, examples):
    def check(ex, backend: str):
        k = ex.args["k"]
        nb, bs = k.shape[0], k.shape[1]
        cache = call(M1Q, ex.args, backend)["cache"]
        back = call(M1D, dict(cache=cache, block_size=bs), backend)["k"]
        if back.shape != k.shape:
            fail(f"dequantised shape {back.shape} != {k.shape}")
        if not np.array_equal(back[..., 448:].view(np.uint16), k[..., 448:].view(np.uint16)):
            fail("RoPE bits changed in the round trip")
        x = k[..., :448].astype(np.float64).reshape(nb, bs, 7, 64)
        y = back[..., :448].astype(np.float64).reshape(nb, bs, 7, 64)
        amax = np.abs(x).max(axis=-1)
        e = np.ceil(np.log2(np.maximum(amax / 448.0, 1e-4)))  # float64: exact for every bf16 amax
        s = np.exp2(e)[..., None]
        err = np.abs(y - x)
        lim = np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10)
        if not (err <= lim).all():
            i = np.unravel_index(int(np.argmax(err - lim)), err.shape)
            fail(f"NoPE value {x[i]!r} came back as {y[i]!r} (tile scale {float(s[i[:3]][0])!r}): more than half "
                 "an E4M3 step away")
        sc = cache[:, bs * 576:bs * 584].reshape(nb, bs, 8)
        if not np.array_equal(sc[..., :7].astype(np.int64), e.astype(np.int64) + 127):
            fail("E8M0 scale bytes are not log2(2^ceil(log2(max(amax / 448, 1e-4)))) + 127")
        if sc[..., 7].any() or cache[:, bs * 584:].any():
            fail("pad bytes (8th scale byte, block padding) are not zero")

    return P(f"{M1Q}.round_trip", (M1Q, M1D), "metamorphic",
             "dequantize(quantize(k)) keeps the RoPE bits, puts every NoPE value within half an E4M3 step of its "
             "tile's power-of-two scale (float64 model of 2^ceil(log2(max(amax / 448, 1e-4)))), stores that "
             "scale's E8M0 byte and zero pad bytes.", examples(M1Q), check)


def _m1_requantize(P, examples):
    def check(ex, backend: str):
        k = ex.args["k"]
        bs = k.shape[1]
        once = call(M1D, dict(cache=call(M1Q, ex.args, backend)["cache"], block_size=bs), backend)["k"]
        again = call(M1D, dict(cache=call(M1Q, dict(k=once), backend)["cache"], block_size=bs), backend)["k"]
        if not np.array_equal(once.view(np.uint16), again.view(np.uint16)):
            n = int((once.view(np.uint16) != again.view(np.uint16)).sum())
            fail(f"{n} dequantised values changed when quantised and dequantised again")

    return P(f"{M1Q}.requantize_stable", (M1Q, M1D), "metamorphic",
             "Dequantised values are fixed points: quantising and dequantising them again returns the same bf16 "
             "bits (each is an E4M3 value times a power-of-two scale no smaller than the new tile scale).",
             examples(M1Q), check)


def more_properties(have: set, P, examples) -> list:
    """The properties of this module whose operators are all in ``have``. ``P`` is the Property class and
    ``examples(op)`` the example-strategy builder of :mod:`.properties` (passed in to avoid an import cycle)."""
    out = []
    if {M1Q, M1D} <= have:
        out += [_m1_round_trip(P, examples), _m1_requantize(P, examples)]
    return out
