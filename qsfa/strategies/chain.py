"""Hypothesis strategy of a layer chain's case (qsfa.chain; docs/golden.md#chains): the chain parameters and the
seed of its input generator, drawn so that a failing chain shrinks to few requests, short histories and the
first chip.

    from qsfa.strategies.chain import chain_cases
    @given(chain_cases("v32-mla-c8"))
    def test_chain(case):
        chain = qsfa.chain.get_chain(case["chain"], case["params"], ignore_unknown=True)
        assert qsfa.chain.first_divergence(chain, case["inputs"], backend="mine", chip=case["chip"]) is None
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

__all__ = ["chain_cases"]

#: v32-mla-c8 per chip: the cache format and the return_softmax_lse values its attention takes
_V32_CHIPS = {"A3": ("int8", (True, False)), "A2": ("int8", (True, False)), "950": ("float8_e4m3fn", (False,))}


@st.composite
def chain_cases(draw, chain: str = "v32-mla-c8", *, chip: str | None = None, max_requests: int = 3,
                max_kv: int = 48) -> dict:
    """``{"chain", "chip", "params", "seed", "inputs"}``: a valid case of ``chain`` (``v32-mla-c8``, or a V4 layer
    chain ``v4-swa`` / ``v4-csa`` / ``v4-hca``: :func:`_v4_cases`).

    Draws 1 .. ``max_requests`` requests, each with 1 .. ``max_kv`` tokens after the step of which 1 (decode) or
    more (prefill, chunked prefill) are new, the indexer's ``sparse_count`` (16 first, then below the shortest
    length and above the longest), the chip (A3 first) and its cache format, and the seed of the input generator."""
    from ..golden.generators import get_generator

    if chain in _V4:
        return draw(_v4_cases(chain, chip=chip, max_requests=max_requests, max_kv=max_kv))
    if chain != "v32-mla-c8":
        raise ValueError(f"no strategy for chain {chain!r}; strategies exist for: v32-mla-c8, {', '.join(_V4)}")
    chip = chip or draw(st.sampled_from(("A3", "A2", "950")))
    key_dtype, lse = _V32_CHIPS[chip]
    n = draw(st.integers(1, max_requests))
    kv_lens = [draw(st.integers(1, max_kv)) for _ in range(n)]
    q_lens = [draw(st.one_of(st.just(1), st.integers(1, k))) for k in kv_lens]
    params = {"q_lens": q_lens, "kv_lens": kv_lens, "key_dtype": key_dtype,
              "sparse_count": draw(st.sampled_from((16, 1, 4, 2048))), "scale_value": 576 ** -0.5,
              "return_softmax_lse": draw(st.sampled_from(lse)), "heads": 4, "n1": 8, "block_size": 16}
    seed = draw(st.integers(0, 2 ** 32 - 1))
    inputs = get_generator(chain)(dict(params, chip=chip), np.random.default_rng(seed))
    return {"chain": chain, "chip": chip, "params": params, "seed": seed, "inputs": inputs}


#: the DeepSeek-V4 layer chains (qsfa.chain_v4): chip -> (path, the attention's top-k sizes)
_V4 = ("v4-swa", "v4-csa", "v4-hca")
_V4_CHIPS = {"A3": ("bf16", (512,)), "950": ("fp8", (512, 1024))}


@st.composite
def _v4_cases(draw, chain: str, *, chip: str | None = None, max_requests: int = 3, max_kv: int | None = None,
              max_q: int = 4) -> dict:
    """A V4 layer chain case: 1 .. ``max_requests`` requests of 1 .. ``max_kv`` tokens after the step (default 48;
    v4-hca 300, so that some requests hold compressed tokens), 1 (decode) or up to ``max_q`` new tokens each (a
    fresh request or a chunk over its history), the chip (A3 first: the bf16 path; 950: FP8), for v4-csa the
    indexer's top-k (the attention's K: 512 on A3, 512 or 1024 on the 950) and, for v4-csa / v4-hca on the 950,
    the compressors' ``cache_mode`` (1 paged, 2 ring buffer)."""
    from ..golden.generators import get_generator

    chip = chip or draw(st.sampled_from(("A3", "950")))
    path, topks = _V4_CHIPS[chip]
    max_kv = max_kv or (300 if chain == "v4-hca" else 48)
    n = draw(st.integers(1, max_requests))
    kv_lens = [draw(st.integers(1, max_kv)) for _ in range(n)]
    decode = draw(st.booleans())
    q_lens = [1 if decode else draw(st.integers(1, min(k, max_q))) for k in kv_lens]
    params = {"q_lens": q_lens, "kv_lens": kv_lens, "path": path, "block_size": 16}
    if chain == "v4-csa":
        params["sparse_count"] = draw(st.sampled_from(topks))
    if chain != "v4-swa" and chip == "950":  # the compressors' state: paged first, or the 950's ring buffer
        params["cache_mode"] = draw(st.sampled_from((1, 2)))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    inputs = get_generator(chain)(dict(params, chip=chip), np.random.default_rng(seed))
    return {"chain": chain, "chip": chip, "params": params, "seed": seed, "inputs": inputs}
