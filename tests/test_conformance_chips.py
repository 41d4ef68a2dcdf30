"""The property catalogue on the reference for every chip family explicitly (docs/numerics/chips.md).

``tests/test_conformance_reference.py`` runs the catalogue with ``chip=None`` (each call resolves its own chip);
here every call models one named chip: examples are drawn within that chip's limits and every rounding and
saturation point is that chip's, so a property that holds only under one chip's modes fails here. A3 builds the
same kernel sources as A2 (the chip table has no cell where they differ), so A2 stands for both. Each property
runs its edge examples (ties at every rounding point come first, qsfa/_edges.py) plus a few drawn ones, to keep
the suite inside CI's budget; the full per-chip run is `qsfa conformance --backend reference --chip 950`.
"""

import pytest

from qsfa.conformance import catalogue, run_property
from qsfa.conformance.pytest_plugin import check_result

PROPS = catalogue()
# A3 builds A2's kernels for every operator but sparse_attn_sharedkv, which runs on Atlas A3 only (on A2 and the 950
# all its properties are not applicable): its properties run on A3 as well
A3_ONLY = [p for p in PROPS if p.op == "sparse_attn_sharedkv"]


@pytest.mark.parametrize("chip", ["A2", "950"])
@pytest.mark.parametrize("prop", PROPS, ids=[p.name for p in PROPS])
def test_property_holds_on_reference_for_chip(prop, chip):
    _run(prop, chip)


@pytest.mark.parametrize("prop", A3_ONLY, ids=[p.name for p in A3_ONLY])
def test_a3_only_property_holds_on_reference(prop):
    _run(prop, "A3")


def _run(prop, chip):
    r = run_property(prop, "reference", chip=chip, max_examples=8)
    if r.status == "skipped":  # only a property the chip cannot run (e.g. no LSE output on the 950), before drawing
        assert r.not_applicable and r.message.startswith(f"not applicable on {chip}: "), r.message
        assert r.examples == 0 and r.edge_examples == 0, (r.examples, r.edge_examples)
    check_result(r)
