"""Golden sets of whole layer chains and ``qsfa golden compare --chain`` (docs/golden.md#chains).

A chain golden set holds one case per link of each chain *instance*: case ``<instance>.<link>`` calls the
link's operator on the link's inputs (case inputs and the reference's intermediates of the earlier links),
so every intermediate is stored as the output of the link that makes it (``<instance>.<link>/out.<output>``)
and again as the input of the links that read it. The cases use the ``chain-link`` generator (the chain's
own generator makes the case inputs, the reference runs the links before this one), so a chain set is
built, generated, verified and replayed like any other set. The manifest records each instance's chain
(links, params and edges) under ``"chains"``.

:func:`compare_chain` walks an instance in chain order and judges each link by its outputs' own criteria
(bytes for caches and indices, the float criterion for attention), whether its upstream inputs matched,
and - given a backend - the link re-run on that backend fed with the *golden* inputs, which tells a
link's own error from one propagated from upstream.
"""

from __future__ import annotations

from .case import Case

__all__ = ["chain_cases", "chain_records"]

LINK_GENERATOR = "chain-link"


def chain_cases(chain_name: str, instance: str, params: dict, *, seed: int, description: str = "") -> list[Case]:
    """The cases of one instance of a registered chain (qsfa.chain.get_chain with ``params``): one per link, named
    ``<instance>.<link>``, all with ``seed``, the chain parameters ``params`` and the link's literal arguments."""
    from ..chain import get_chain

    ch = get_chain(chain_name, params)
    out = []
    for lk in ch.links:
        lits = {k: v for k, v in lk.args.items() if k not in lk.refs()}
        p = {**params, **lits, "chain": chain_name, "link": lk.name}
        out.append(Case(name=f"{instance}.{lk.name}", op=lk.op, params=p, seed=seed, generator=LINK_GENERATOR,
                        description=(description + f" - link {lk.name}").strip(" -")))
    return out


def chain_records(entries: list) -> list:
    """The manifest's ``"chains"``: per instance, its chain (qsfa.chain's JSON form with its ``edges``: [source
    tensor, link, parameter]), its params and link -> case name."""
    from ..chain import get_chain

    recs: dict = {}
    for e in entries:
        p = e.get("params") or {}
        if e.get("generator") != LINK_GENERATOR or "chain" not in p or "link" not in p:
            continue
        inst = e["name"][: -len(p["link"]) - 1] if e["name"].endswith("." + p["link"]) else e["name"]
        if inst not in recs:
            ch = get_chain(p["chain"], p)
            recs[inst] = {"instance": inst, "chain": {**ch.to_dict(), "edges": ch.edges()},
                          "params": {k: v for k, v in p.items() if k not in ("chain", "link")}, "cases": {}}
        recs[inst]["cases"][p["link"]] = e["name"]
    return list(recs.values())
