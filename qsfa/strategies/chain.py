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
    """``{"chain", "chip", "params", "seed", "inputs"}``: a valid case of ``chain`` (only ``v32-mla-c8`` so far).

    Draws 1 .. ``max_requests`` requests, each with 1 .. ``max_kv`` tokens after the step of which 1 (decode) or
    more (prefill, chunked prefill) are new, the indexer's ``sparse_count`` (16 first, then below the shortest
    length and above the longest), the chip (A3 first) and its cache format, and the seed of the input generator."""
    from ..golden.generators import get_generator

    if chain != "v32-mla-c8":
        raise ValueError(f"no strategy for chain {chain!r}; strategies exist for: v32-mla-c8")
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
