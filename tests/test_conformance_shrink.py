"""Shrinking a conformance failure is bounded in time (issue 12: a triton run spent 5 of its 7 minutes silently
shrinking). A property that fails on every integer >= 10 shrinks to 10 with the default budget; with a zero budget
the runner stops right after the first failure and still reports a replayable failing example."""

import pytest

pytest.importorskip("hypothesis")

from hypothesis import strategies as st  # noqa: E402

from qsfa.conformance import runner  # noqa: E402
from qsfa.conformance.properties import Example, Property, PropertyFailure  # noqa: E402


def _property(seen):
    def check(ex, backend):
        seen.append(ex.args["n"])
        if ex.args["n"] >= 10:
            raise PropertyFailure(f"n = {ex.args['n']} >= 10")

    def strategy(bounds, chip, pins):
        return st.builds(lambda n: Example({"n": n}), st.integers(0, 10 ** 9))

    return Property("formats.encode.toy_shrink", ("formats.encode",), "metamorphic", "fails for n >= 10",
                    strategy, check)


def test_default_budget_shrinks_to_the_minimal_example():
    seen = []
    r = runner.run_property(_property(seen), "reference", profile="ci")
    assert r.status == "failed"
    assert "n = 10 >= 10" in r.message and "shrinking stopped" not in r.message


def test_zero_budget_stops_after_the_first_failure(monkeypatch):
    monkeypatch.setattr(runner, "SHRINK_SECONDS", 0.0)
    seen = []
    r = runner.run_property(_property(seen), "reference", profile="ci")
    assert r.status == "failed", r.message
    assert "shrinking stopped after 0 s" in r.message
    first_fail = next(i for i, n in enumerate(seen) if n >= 10)
    assert len(seen) == first_fail + 2  # the first failure, then only hypothesis's final replay of it
    assert seen[-1] == seen[first_fail]


def test_triton_interpreter_runs_default_to_tiny_shapes(monkeypatch):
    """The README's TRITON_INTERPRET=1 conformance command must finish in minutes: without --bound /
    --max-examples it draws the interpreter's tiny shapes and few examples; either flag restores the user's."""
    import argparse

    from qsfa._profiles import INTERPRETER_BOUNDS
    from qsfa.conformance.cli import interpreter_budget

    def ns(**kw):
        base = dict(backend="triton", bound=None, max_examples=None, profile="ci")
        return argparse.Namespace(**{**base, **kw})

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    b, n = interpreter_budget(ns())
    assert b.to_dict()["max_kv_tokens"] == INTERPRETER_BOUNDS["max_kv_tokens"] and n == 8
    assert interpreter_budget(ns(max_examples=25)) is None
    assert interpreter_budget(ns(bound=["max_kv_tokens=32"])) is None
    assert interpreter_budget(ns(backend="reference")) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter_budget(ns()) is None
