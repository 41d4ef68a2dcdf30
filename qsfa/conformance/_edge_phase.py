"""The edge phase of a conformance run: the simplest example of every edge of the property's operator
(:data:`qsfa._edges.EDGES`), run as explicit hypothesis examples before the random ones.

Each edge example is ``hypothesis.find`` of the property's own strategy with ``edge`` pinned, generate phase
only, derandomised: the first (simplest) draw that fits the backend's limits. It is minimal by construction
(nothing to shrink) and a failure is saved as a case file like any other. Invalid-argument properties draw
their own broken arguments and get no edge phase.
"""

from __future__ import annotations

__all__ = ["edge_examples", "shrink_within_edge"]


def edge_examples(prop, bounds, chip, pins: dict, fits=None) -> list:
    """The edge examples of ``prop`` as ``(edge, Example)`` pairs, in the order of :data:`qsfa._edges.EDGES` (or of
    the property's own ``edges``);
    edges with no example within the backend's limits are left out. Each is drawn with ``edge_full`` (every
    boundary value the edge has, where its size would otherwise be drawn)."""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample, Unsatisfiable

    from .. import _edges
    from .._edges import EDGES

    from .._profiles import SIZE_BOUNDS

    if bounds.max_kv_tokens < SIZE_BOUNDS["ci"]["max_kv_tokens"]:  # tiny shapes (an interpreter): no edges
        return []
    if not _edges.ENABLED or prop.family == "invalid_rejected" or "edge" in pins or "edge" in prop.pins:
        return []
    cfg = settings(database=None, derandomize=True, phases=[Phase.generate], max_examples=20,
                   suppress_health_check=list(HealthCheck), deadline=None)
    out = []
    for e in (prop.edges if getattr(prop, "edges", None) is not None else EDGES.get(prop.op, ())):
        s = prop.strategy(bounds, chip, {**pins, "edge": e, "edge_full": True})
        ex = _simplest(s)
        if ex is not None and (fits is None or fits(ex)):
            out.append((e, ex))
            continue
        if fits is not None:
            s = s.filter(fits)
        try:
            out.append((e, find(s, lambda _: True, settings=cfg)))
        except (NoSuchExample, Unsatisfiable):
            continue
    return out


def shrink_within_edge(prop, edge: str, bounds, chip, pins: dict, fits, test, settings_kw: dict) -> None:
    """After the explicit example of ``edge`` failed (explicit examples are not shrunk): run ``test`` under
    hypothesis on the property's strategy with that edge pinned, so a failure found there is shrunk to a minimal
    case (``test`` records it as usual). Returns nothing; a run that finds no failure leaves the explicit one."""
    from hypothesis import given, settings

    s = prop.strategy(bounds, chip, {**pins, "edge": edge})
    if fits is not None:
        s = s.filter(fits)
    wrapped = given(s)(test)
    wrapped._hypothesis_internal_add_digest = f"{prop.name}/{edge}".encode()
    try:
        settings(**settings_kw)(wrapped)()
    except Exception:  # noqa: BLE001 - the failure (recorded by test) is the point
        pass


def _simplest(strategy):
    """The simplest draw of ``strategy`` (what ``find`` tries first), drawn directly - a few times faster than
    starting a search engine; None when that draw is rejected (then the caller falls back to ``find``)."""
    try:
        from hypothesis.control import BuildContext
        from hypothesis.internal.conjecture.choice import ChoiceTemplate
        from hypothesis.internal.conjecture.data import ConjectureData

        data = ConjectureData.for_choices([ChoiceTemplate("simplest", count=None)])
        with BuildContext(data, is_final=False, wrapped_test=_simplest):
            return data.draw(strategy)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a rejected draw (StopTest / assume), or a changed hypothesis internal
        return None
