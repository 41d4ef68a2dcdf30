"""The whole property catalogue on the reference backend (or the one ``--qsfa-backend`` names), one test per property (the same definitions the
``qsfa conformance`` runner uses), under the active hypothesis profile (``ci`` by default: derandomised).

Metamorphic properties (including the invalid-argument ones) check the reference against relations and
float64 models derived independently of it. For the reference itself the vs_reference properties compare two
calls on copies of the same arguments (they catch non-determinism); every call also fails a backend that writes
into an input that is not an in-place parameter.
"""

import pytest

from qsfa.conformance import catalogue, run_property
from qsfa.conformance.pytest_plugin import check_result

PROPS = catalogue()


@pytest.mark.parametrize("prop", PROPS, ids=[p.name for p in PROPS])
def test_property_holds_on_reference(prop, qsfa_backend):
    """``pytest --qsfa-backend yours`` runs the same catalogue on another backend (qsfa.conformance.pytest_plugin)."""
    r = run_property(prop, qsfa_backend)
    check_result(r, skip=qsfa_backend != "reference")  # an ERROR (the backend raised) is reported as a pytest error
