"""The property catalogue on the "triton" backend, for every property whose operators the Triton kernels
implement (c8_cache_write, kv_quant_sparse_flash_attention): backend-vs-reference (cache bytes exact;
attention within the docs/numerics/comparison.md#float-criterion criterion) plus the metamorphic properties, all through the same
definitions ``qsfa conformance --backend triton`` runs.

Without a CUDA device the kernels run in the Triton CPU interpreter (TRITON_INTERPRET=1, set by
tests/_triton_env.py before triton is first imported): tiny shapes and a few examples per property keep that inside CI's budget. On a
GPU the active profile's bounds and example counts apply. Skips with the reason when the backend is unusable.
"""

from __future__ import annotations

import pytest

from _triton_env import prepare

_, INTERPRETED = prepare(__name__)  # before triton is imported: tests/_triton_env.py

from qsfa import strategies as qst  # noqa: E402
from qsfa._dispatch import backends  # noqa: E402
from qsfa._profiles import PROFILES, active_profile  # noqa: E402
from qsfa.conformance import catalogue, run_property  # noqa: E402

_STATUS = backends()["triton"]
if not _STATUS.usable:
    pytest.skip(f"backend 'triton' is not usable here: {_STATUS.reason}", allow_module_level=True)

IMPLEMENTED = set(_STATUS.operators)
PROPS = [p for p in catalogue() if set(p.ops) <= IMPLEMENTED]

#: interpreter: tiny shapes (one batch, two query rows, 16 KV tokens, two heads) and few examples
TINY = qst.Bounds(max_batch=1, max_q_tokens=2, max_kv_tokens=16, max_sparse=4, max_heads=2, max_block_size=16,
                  max_tokens=4)
_INTERPRETER_EXAMPLES = {"ci": 8, "dev": 25, "nightly": 100}


def _budget():
    prof = active_profile()
    if not INTERPRETED:
        return None, None
    return TINY, min(_INTERPRETER_EXAMPLES.get(prof, 8), PROFILES[prof]["max_examples"])


def test_triton_implements_the_kernel_operators():
    assert {"c8_cache_write", "kv_quant_sparse_flash_attention"} <= IMPLEMENTED
    names = {p.name for p in PROPS}
    assert {"c8_cache_write.vs_reference", "kv_quant_sparse_flash_attention.vs_reference"} <= names


@pytest.mark.triton
@pytest.mark.parametrize("prop", PROPS, ids=[p.name for p in PROPS])
def test_property_holds_on_triton(prop):
    bounds, n = _budget()
    r = run_property(prop, "triton", bounds=bounds, max_examples=n)
    assert r.status == "passed", (
        f"{r.property} ({r.status}): {r.message}\nminimal falsifying example: {r.falsifying_example}\n"
        f"{r.reproduce or ''}"
    )
    assert r.examples > 0
